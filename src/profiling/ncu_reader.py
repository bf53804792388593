"""Read Nsight Compute results into one record per kernel, from either form ncu writes:

- a `.ncu-rep` report, through NVIDIA's `ncu_report` module (PyPI `ncu-report`, or the copy in
  an Nsight Compute install's extras/python), which works without a GPU;
- the `--csv --page raw` export: ncu's own `==PROF==`/`==WARNING==` lines first, then a header
  row, a row of units, and numbers with thousands separators ("1,980,000").

Units are normalised to seconds, bytes, bytes/s and percent, so both forms give the same numbers.
"""
from __future__ import annotations

import csv
import glob
import gzip
import io
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
DRAM_PCT = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
# "Memory Throughput" of Speed Of Light: the max over L1, L2 and DRAM. It reads 95% on a GEMM that
# streams from shared memory, so it is kept for display only, never for the memory-bound verdict.
MEM_PCT = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"
DURATION = "gpu__time_duration.sum"
DRAM_BYTES = "dram__bytes.sum"
DRAM_RATE = "dram__bytes.sum.per_second"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
SM_CLOCK = "smsp__cycles_elapsed.avg.per_second"
# fp32 SASS instruction rates (summed over SM sub-partitions, per elapsed cycle): FLOPs = 2 FFMA + FADD + FMUL.
FP32_OPS = {
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum.per_cycle_elapsed": 2,
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum.per_cycle_elapsed": 1,
    "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum.per_cycle_elapsed": 1,
}
# Tensor-core FLOPs, which the fp32 counters above miss (a GEMM's are nearly all here): the tensor
# pipe's active share of cycles x its dense bf16/fp16 rate per SM per cycle x SMs x cycles.
# Hopper: 4096 FLOP/clk/SM (the datasheet's dense bf16 rate over SMs x boost clock); Ampere half that.
# On the fixture capture's square GEMM this comes within 2% of the FLOPs the GEMM computes.
# Kernels with no MMA read a few percent there: below TENSOR_MIN_PCT it is not counted.
TENSOR_PCT = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"
SM_COUNT = "device__attribute_multiprocessor_count"
TENSOR_MIN_PCT = 10.0
TENSOR_FLOP_PER_SM_CYCLE = {"H100": 4096, "H200": 4096, "H800": 4096, "GH200": 4096, "A100": 2048, "A800": 2048}
WANTED = (SM_PCT, DRAM_PCT, MEM_PCT, DURATION, DRAM_BYTES, DRAM_RATE, OCCUPANCY, SM_CLOCK, TENSOR_PCT, SM_COUNT, *FP32_OPS)

_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_TIME = {"ns": 1e-9, "us": 1e-6, "usecond": 1e-6, "msecond": 1e-3, "ms": 1e-3, "s": 1.0, "second": 1.0, "nsecond": 1e-9}


@dataclass
class KernelRecord:
    index: int
    name: str
    """the demangled kernel name"""
    nvtx: list[str] = field(default_factory=list)
    """the NVTX push/pop ranges open at launch, outermost first"""
    duration_s: float = math.nan
    sm_pct: float = math.nan
    dram_pct: float = math.nan
    mem_pct: float = math.nan
    dram_bytes: float | None = None
    fp32_flops: float | None = None
    occupancy_pct: float | None = None
    tensor_flops: float | None = None
    """tensor-core FLOPs, estimated from the tensor pipe's utilisation (None where the device's rate is unknown)"""
    device: str = ""
    grid: str = ""
    block: str = ""

    @property
    def short_name(self) -> str:
        return short_kernel_name(self.name)

    @property
    def flops(self) -> float | None:
        """fp32 pipe plus tensor pipe: a GEMM counted by its fp32 instructions alone sits far below the roof"""
        if self.fp32_flops is None and self.tensor_flops is None:
            return None
        return (self.fp32_flops or 0.0) + (self.tensor_flops or 0.0)

    @property
    def arithmetic_intensity(self) -> float | None:
        if not self.flops or not self.dram_bytes:
            return None
        return self.flops / self.dram_bytes

    @property
    def achieved_flops(self) -> float | None:
        if not self.flops or not self.duration_s:
            return None
        return self.flops / self.duration_s



def short_kernel_name(name: str) -> str:
    """`void at::<unnamed>::vectorized_layer_norm_kernel<c10::BFloat16, ...>(int, ...)` -> `vectorized_layer_norm_kernel`."""
    depth, out = 0, []
    for ch in name:  # drop template arguments and the parameter list
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    base = "".join(out).split()[-1] if "".join(out).split() else name
    return base.split("::")[-1] or name


def to_base_unit(value: float, unit: str) -> float:
    """Scale a value by its ncu unit: ms -> s, Tbyte/s -> byte/s, Gbyte -> byte, Ghz -> Hz, % stays."""
    unit = unit.strip()
    if not unit or unit in ("%", "inst", "warp", "cycle", "block", "thread", "register/thread", "inst/cycle", "pass"):
        return value
    if unit in _TIME:
        return value * _TIME[unit]
    m = re.fullmatch(r"([KMGTP]?)(byte|hz|Hz|cycle)(/s|/second)?", unit, flags=re.I)
    if m:
        return value * _PREFIX[m.group(1).upper()]
    m = re.fullmatch(r"([KMGTP]?)byte/(\w+)", unit)
    if m:
        return value * _PREFIX[m.group(1)]
    return value


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def _records_from_metrics(index: int, name: str, nvtx: list[str], metric: dict[str, float], strings: dict[str, str]) -> KernelRecord:
    rec = KernelRecord(index=index, name=name, nvtx=nvtx, device=strings.get("device", ""), grid=strings.get("grid", ""), block=strings.get("block", ""))
    rec.sm_pct = metric.get(SM_PCT, math.nan)
    rec.dram_pct = metric.get(DRAM_PCT, math.nan)
    rec.mem_pct = metric.get(MEM_PCT, math.nan)
    rec.duration_s = metric.get(DURATION, math.nan)
    if DRAM_BYTES in metric:
        rec.dram_bytes = metric[DRAM_BYTES]
    elif DRAM_RATE in metric and not math.isnan(rec.duration_s):
        rec.dram_bytes = metric[DRAM_RATE] * rec.duration_s
    rec.occupancy_pct = metric.get(OCCUPANCY)
    if all(k in metric for k in FP32_OPS) and SM_CLOCK in metric and not math.isnan(rec.duration_s):
        cycles = metric[SM_CLOCK] * rec.duration_s
        rec.fp32_flops = sum(w * metric[k] for k, w in FP32_OPS.items()) * cycles
        rate = next((v for k, v in TENSOR_FLOP_PER_SM_CYCLE.items() if k in rec.device), None)
        if rate and metric.get(TENSOR_PCT, 0.0) >= TENSOR_MIN_PCT and SM_COUNT in metric:
            rec.tensor_flops = metric[TENSOR_PCT] / 100 * rate * metric[SM_COUNT] * cycles
    return rec


def _nvtx_from_csv(cell: str) -> list[str]:
    # e.g. `906  "<default domain>:ops:none:none:none:none:none:none" `: thread id, then one quoted
    # `domain:range:payload...` entry per open range.
    return [entry.split(":")[1] for entry in re.findall(r'"([^"]*)"', cell) if ":" in entry]


def read_csv(text: str) -> list[KernelRecord]:
    lines = [line for line in text.splitlines() if not line.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        raise ValueError("no ncu raw-page header (a row starting with \"ID\") in this CSV; export with `ncu --csv --page raw`")
    header, units = rows[start], rows[start + 1]
    col = {h: i for i, h in enumerate(header)}
    nvtx_col = next((i for h, i in col.items() if h.startswith("thread Domain:Push/Pop_Range")), None)
    records = []
    for n, row in enumerate(rows[start + 2 :]):
        if len(row) < len(header):
            continue
        metric = {}
        for key in WANTED:
            if key in col:
                value = _number(row[col[key]])
                if value is not None:
                    metric[key] = to_base_unit(value, units[col[key]])
        strings = {"device": row[col["device__attribute_display_name"]] if "device__attribute_display_name" in col else "",
                   "grid": row[col["Grid Size"]] if "Grid Size" in col else "",
                   "block": row[col["Block Size"]] if "Block Size" in col else ""}
        nvtx = _nvtx_from_csv(row[nvtx_col]) if nvtx_col is not None else []
        records.append(_records_from_metrics(int(_number(row[col["ID"]]) or n), row[col["Kernel Name"]], nvtx, metric, strings))
    return records


def _import_ncu_report():
    try:
        import ncu_report  # type: ignore

        return ncu_report
    except ImportError:
        pass
    # An Nsight Compute install carries the module in extras/python.
    for pattern in ("/opt/nvidia/nsight-compute/*/extras/python", "/usr/local/cuda*/nsight-compute*/extras/python"):
        for path in sorted(glob.glob(pattern), reverse=True):
            sys.path.insert(0, path)
            try:
                import ncu_report  # type: ignore

                return ncu_report
            except ImportError:
                sys.path.remove(path)
    raise ImportError("reading .ncu-rep needs NVIDIA's ncu_report module: `pip install ncu-report`, or export the report with `ncu --import REPORT --csv --page raw > report.csv`")


# Every .ncu-rep that ncu writes starts with these bytes; ncu_report loads anything else as an
# empty report, which would read as "no kernels" instead of "not a report".
NCU_REP_MAGIC = b"NVR\x00"
NOT_A_REPORT = "{path}: not an Nsight Compute report ({why}); give an .ncu-rep that `ncu -o` wrote, or its `ncu --import REPORT --csv --page raw` export"


def read_ncu_rep(path: str | os.PathLike) -> list[KernelRecord]:
    ncu_report = _import_ncu_report()
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ValueError(NOT_A_REPORT.format(path=path, why=f"not gzip data: {err}")) from None
    if not raw.startswith(NCU_REP_MAGIC):
        raise ValueError(NOT_A_REPORT.format(path=path, why="no NVR header"))
    if path.suffix == ".gz":
        import tempfile

        tmp = Path(tempfile.mkdtemp()) / path.stem
        tmp.write_bytes(raw)
        path = tmp
    report = ncu_report.load_report(str(path))
    records = []
    for r in range(report.num_ranges()):
        rng = report.range_by_idx(r)
        for i in range(rng.num_actions()):
            action = rng.action_by_idx(i)
            names = set(action.metric_names())
            metric = {}
            for key in WANTED:
                if key in names:
                    m = action[key]
                    if m.has_value():
                        metric[key] = to_base_unit(m.as_double(), m.unit())
            strings = {}
            if "device__attribute_display_name" in names:
                strings["device"] = action["device__attribute_display_name"].as_string()
            for key, out in (("launch__grid_size", "grid"), ("launch__block_size", "block")):
                if key in names:
                    strings[out] = str(action[key].as_uint64())
            nvtx = []
            state = action.nvtx_state()
            if state is not None:
                for domain_id in state.domains():
                    nvtx.extend(state.domain_by_id(domain_id).push_pop_ranges())
            name = action.name(ncu_report.IAction.NameBase_DEMANGLED)
            records.append(_records_from_metrics(len(records), name, list(nvtx), metric, strings))
    return records


def read_diagnosis_kernels(path: Path) -> list[KernelRecord]:
    """The kernels kept in a diagnosis.json, to diagnose them again (other thresholds) without the report."""
    import json

    data = json.loads(path.read_text())
    if "kernels" not in data:
        raise ValueError(f"{path}: a JSON report must be a diagnosis.json with a 'kernels' list")
    keep = {f for f in KernelRecord.__dataclass_fields__}
    records = [KernelRecord(**{k: v for k, v in kernel.items() if k in keep}) for kernel in data["kernels"]]
    for r in records:  # the device is kept once, at the top of the file: the roofline's title and ceilings need it
        r.device = r.device or data.get("device", "")
    return records


def read_report(path: str | os.PathLike) -> list[KernelRecord]:
    """Kernels of an `.ncu-rep` (optionally .gz), of a `--csv --page raw` export, or of a diagnosis.json."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such report")
    if path.name.endswith((".ncu-rep", ".ncu-rep.gz")):
        return read_ncu_rep(path)
    if path.suffix == ".json":
        return read_diagnosis_kernels(path)
    return read_csv(path.read_text(errors="replace"))
