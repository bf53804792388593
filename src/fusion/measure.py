"""`kernels=auto` decides by measurement: each op the diagnosis calls for is timed, forward and
backward, at this run's shapes and dtype on the run's GPU, as eager, torch.compile and the fused
Triton kernel; the fastest is used. A diagnosis says where time goes, not which remedy pays.

What is timed is what a training step pays: GPU time with the host ahead of the device. The
training loop never syncs inside a run of steps (src/train/loop.py's Readback), so on the seed's
step the host queues a step faster than the GPU runs it, and an op's host path costs the step
nothing while it stays under its share of that margin. Each candidate is therefore called back to
back behind a queued spin and timed by CUDA events (src/fusion/timing.py queued_ms), and its host
microseconds per call are recorded beside it. Timed one call at a time, with a sync after each, an
op whose Python backward costs more host than its kernels take (the fused norms) loses to eager:
that is the cost of a step that syncs every step, which this one is not.

Timings are per training step: an op used k times a step (RMSNorm twice a block and once before
the head, once of them after the residual add) counts k times. The loss is timed with the output
head, since the fused linear + cross-entropy replaces both: its candidates are eager (head GEMM,
then the loss), compile (the same under torch.compile), triton (head GEMM, then the fused loss)
and triton's linear_cross_entropy (no logits at all).

The optimizer, where the diagnosis calls AdamW memory-bound or latency-limited: torch's fused AdamW
(plus, on the steps the loop reads, get_total_norm's pass over the gradients) against
optim.impl=triton (one launch, the norm summed in the update's pass), over this rank's parameter
shards, when the step only reports the norm (no clipping, no skipping, no update in backward) and
optim.impl is left to auto.

Then the block as a whole: the ops inside a transformer block (norms, the MLP's activation) are
also what Inductor fuses when it compiles the block (`kernels.compile`), with the residual adds and
casts no per-op swap reaches. One block, forward and backward, is timed as the per-op picks would
run it, under torch.compile, and (where a pick changed it) as plain eager modules, with the run's
precision (precision=fp8: its linears swapped for float8 ones, as the run swaps them); compile or
eager is used where it beats the picks by more than the noise, and it then replaces the in-block
picks (the loss, outside the blocks, keeps its own). Eager is a candidate because the per-op
picks are made on GPU time: with few tokens a step (data=text's 8 x 128) the picked block queues
several times slower than it runs, its fused norms' host path longer than eager's, so the picks that
save GPU time cost a host-bound step time.
The blocks are most of the step, so a block is charged the larger of its GPU time and its host time:
where queuing a block takes longer than running it, the GPU waits on the host whatever the kernels
cost. At the seed's shapes in bf16 the blocks queue in about what they run, and the per-op picks
stay. Float8 blocks are compiled whenever they compile (FLOAT8_EAGER_BLOCKS): each eager float8
linear launches about 12 kernels from Python, and the step pays more for that than a block timed
alone shows.

Every candidate is timed under the run's own Inductor settings (src/distributed/parallelize.py
inductor_config): with `speed.cudagraphs` the compiled block is timed replayed from CUDA graphs, as
the run would replay it, so its host time is a graph launch and the trees' checks of its inputs
rather than Inductor's ~50 launches a block. Where the chosen block still queues slower than it
runs and graphs are off, the log says so and names the setting (graphs_hint).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from src.distributed.float8 import gathers_float8
from src.fusion.choice import OPTIMIZER
from src.fusion.ops import OPS, load
from src.runtime import world_size

log = logging.getLogger("src.run")

CANDIDATES = ("eager", "compile", "triton")
# A candidate replaces eager only when it is more than this much faster: do_bench medians of the
# same kernel spread by about this much between two calls, and a wrong swap costs more than a
# missed one (a compile's warm-up, a Python backward).
NOISE = 0.03


@dataclass
class Use:
    """One way the model uses an op: the kernel_bench case, its shape, and how often a step."""

    case: str
    shape: list[int]
    per_step: int
    picks: dict[str, str] = field(default_factory=dict)
    """block only: the in-block op -> candidate the per-op timings chose (the "picked" block)"""


@dataclass
class OpTiming:
    op: str
    """the registry op (src/fusion/registry.py)"""
    ms: dict[str, float | None] = field(default_factory=dict)
    """candidate -> GPU ms per step, forward and backward, host ahead; None: the candidate failed"""
    host_ms: dict[str, float | None] = field(default_factory=dict)
    """candidate -> host ms per step to issue those calls (None: not timed, or failed)"""
    pick: str = "eager"
    """eager, compile, triton, or linear_cross_entropy (the loss only)"""
    why: str = ""
    """where the pick is not GPU time's: the rule that decided (the block: HOST_CHARGED, FLOAT8_EAGER_BLOCKS)"""
    seconds: float = 0.0
    """wall seconds its candidates took where they were timed: building, compiling and timing them"""


def uses(cfg: DictConfig) -> dict[str, list[Use]]:
    """registry op -> how this model uses it per step (an empty list: the model has none)."""
    return {op.name: load(op.measured)(cfg) if op.measured else [] for op in OPS}


def _tokens(cfg: DictConfig) -> int:
    return cfg.data.batch_size * cfg.data.seq_len  # per device: each rank computes on its own batch


def norm_uses(cfg: DictConfig) -> list[Use]:
    m = cfg.model
    return [Use("rms_norm", [_tokens(cfg), m.dim], m.n_layers + 1), Use("add_rms_norm", [_tokens(cfg), m.dim], m.n_layers)]


def swiglu_uses(cfg: DictConfig) -> list[Use]:
    from src.models import meta_model

    m = cfg.model
    if str(m.mlp) != "swiglu" or m.n_layers < 1:
        return []
    hidden = meta_model(m).layers[0].ffn.down.in_features  # the width the architecture's constructor makes
    return [Use("swiglu", [_tokens(cfg), hidden], m.n_layers)]


def head_loss_uses(cfg: DictConfig) -> list[Use]:
    m = cfg.model
    return [Use("head_loss", [_tokens(cfg), m.dim, m.vocab_size], 1)]


def optimizer_uses(cfg: DictConfig) -> list[Use]:
    return [Use(OPTIMIZER, shard_numels(cfg), 1)] if optimizer_swappable(cfg) is None else []


def shard_numels(cfg: DictConfig) -> list[int]:
    """Each parameter's elements on one rank: FSDP2 shards dim 0 over the ranks of a replica
    (padded to a multiple of them); without sharding every rank holds them all."""
    import math

    from src.models import meta_model

    model = meta_model(cfg.model)
    world = world_size(cfg)
    shards = {"fsdp2": world, "hsdp": world // max(cfg.sharding.replicate, 1)}.get(str(cfg.sharding.strategy), 1)
    return [math.ceil(p.shape[0] / shards) * (p.numel() // p.shape[0]) if p.dim() else 1 for p in model.parameters()]


def optimizer_swappable(cfg: DictConfig) -> str | None:
    """None where kernels=auto may put optim.impl=triton in place of torch's AdamW, else why not."""
    o = cfg.optim
    if str(o.impl) != "auto":
        return f"optim.impl={o.impl} is set"
    if o.grad_clip > 0 or cfg.train.nonfinite == "skip":
        return "the step needs the grad norm before the update (clipping or skipping)"
    if cfg.sharding.cpu_offload or cfg.backend.name != "cuda":
        return "the optimizer does not run on a GPU"
    if gathers_float8(cfg.precision, cfg.sharding.strategy):
        return "float8-gathered weights are wrapper tensors the Triton optimizer cannot address"
    return None


def pick(ms: dict[str, float | None], noise: float = NOISE, base: str = "eager") -> str:
    """The fastest candidate, but `base` unless it is beaten by more than `noise`."""
    baseline = ms.get(base)
    timed = {k: v for k, v in ms.items() if v is not None}
    if not timed:
        return base
    best = min(timed, key=timed.get)
    if baseline is None or best == base or timed[best] < baseline * (1 - noise):
        return best
    return base


Timer = Callable[[Use, str], "float | tuple[float, float]"]
"""(use, candidate) -> GPU ms of one forward + backward, or (GPU ms, host ms) of it"""


LOSS_OPS = tuple(op.name for op in OPS if op.loss)
BLOCK_OPS = tuple(op.name for op in OPS if op.in_block)
"""ops that live inside a transformer block: a compiled block subsumes their picks"""
BLOCK = "block"


def measure(ops: list[str], cfg: DictConfig, timer: Timer) -> list[OpTiming]:
    """Time every candidate of every op in `ops` that this model uses (ops it does not use are
    left out); the loss ops are timed once, together with the head, as "cross_entropy". `timer`
    raising for a candidate marks it failed (None), not the run."""
    plan = uses(cfg)
    todo = [op for op in ops if op not in LOSS_OPS] + (["cross_entropy"] if any(op in LOSS_OPS for op in ops) else [])
    results: list[OpTiming] = []
    for op in todo:
        if not plan.get(op):
            continue
        candidates = ("eager", "triton") if op == OPTIMIZER else CANDIDATES + (("linear_cross_entropy",) if op == "cross_entropy" else ())
        results.append(_timed(op, plan[op], candidates, timer))
    in_block = {t.op: t.pick for t in results if t.op in BLOCK_OPS}
    if in_block or cfg.precision.float8:  # float8 blocks are weighed whatever the diagnosis names (FLOAT8_EAGER_BLOCKS)
        results.append(measure_block(cfg, timer, in_block))
    return results


def measure_block(cfg: DictConfig, timer: Timer, picks: dict[str, str]) -> OpTiming:
    """One transformer block, forward and backward, as the per-op `picks` run it ("picked"), under
    torch.compile ("compile") and, where a pick changed it, as torch's modules alone ("eager"),
    times the blocks a step. Each is charged the larger of its GPU and host time (block_paid_ms),
    and compile or eager must beat the picks by more than the noise; with float8 linears compile
    is used whenever it ran (FLOAT8_EAGER_BLOCKS). `why` says which rule decided where the pick
    is not GPU time's."""
    m = cfg.model
    use = Use(BLOCK, [cfg.data.batch_size, cfg.data.seq_len, m.dim], m.n_layers, dict(picks))
    # eager is its own candidate where a pick changed the block: the picks won on GPU time alone,
    # and a fused op's Python path can cost a host-bound block more than its kernels save
    candidates = ("picked", "compile", "eager") if any(how != "eager" for how in picks.values()) else ("picked", "compile")
    timing = _timed(BLOCK, [use], candidates, timer, base="picked")
    timing.pick = pick(block_paid_ms(timing), base="picked")
    if timing.pick != pick(timing.ms, base="picked"):
        timing.why = HOST_CHARGED
    if cfg.precision.float8 and timing.ms.get("compile") is not None and timing.pick != "compile":
        timing.pick, timing.why = "compile", FLOAT8_EAGER_BLOCKS
    return timing


def graphs_hint(timing: OpTiming, cfg: DictConfig) -> str | None:
    """A line for the log where the chosen block queues slower than it runs (host past GPU by more than
    the noise) and speed.cudagraphs is off: replayed from graphs, a compiled block's host is a graph launch
    and the trees' input checks. A host-bound step leaves the device idle for most of the step at small
    batches, and graphs are the setting that takes that host time away."""
    gpu, host = timing.ms.get(timing.pick), timing.host_ms.get(timing.pick)
    if cfg.speed.cudagraphs or gpu is None or host is None or host <= gpu * (1 + NOISE):
        return None
    keep = (" with speed.keep_unsharded=true (FSDP2 then keeps the gathered weights where the graphs read them; the whole "
            "param_dtype model stays on each GPU)") if cfg.sharding.strategy in ("fsdp2", "hsdp") and not cfg.speed.keep_unsharded else ""
    return (f"kernels=auto: the blocks as chosen ({timing.pick}) queue slower than they run, {host:.1f} ms of host a step against "
            f"{gpu:.1f} of GPU; speed.cudagraphs=true{keep} lets auto weigh compiled blocks replayed from CUDA graphs, one launch a graph")


HOST_CHARGED = "charged the larger of GPU and host time: a block that queues slower than it runs makes the step wait on the host"


FLOAT8_EAGER_BLOCKS = ("float8 blocks are compiled whenever they compile: eager ones launch every cast from Python, "
                       "and a block timed alone does not show what that costs in the step")
"""Why auto compiles float8 blocks whatever the block's timings say. In the seed's step eager float8
blocks were host-bound in every run and slower than compiled ones, and their host time timed alone
varied widely from machine to machine, only once under their GPU time: inside the step an eager
block's host cost is higher than alone, by more than the timings can be trusted to show."""


def block_paid_ms(timing: OpTiming) -> dict[str, float | None]:
    """What the step pays for each block candidate: the larger of its GPU and host ms (GPU alone
    where the host was not timed; None where the candidate failed)."""
    return {c: None if gpu is None else max(gpu, timing.host_ms.get(c) or 0.0) for c, gpu in timing.ms.items()}


def _timed(op: str, op_uses: list[Use], candidates: tuple[str, ...], timer: Timer, base: str = "eager") -> OpTiming:
    """Each candidate's ms per step over `op_uses`, and the pick; a candidate that fails to run (a
    compile error) is None, never chosen."""
    timing, start = OpTiming(op), time.perf_counter()
    for candidate in candidates:
        try:
            times = [(use.per_step, timer(use, candidate)) for use in op_uses]
        except Exception as err:
            log.info("kernels=auto: %s as %s failed to run: %s", op, candidate, str(err).splitlines()[0] if str(err) else type(err).__name__)
            timing.ms[candidate] = timing.host_ms[candidate] = None
            continue
        pairs = [(n, t if isinstance(t, tuple) else (t, None)) for n, t in times]
        timing.ms[candidate] = sum(n * gpu for n, (gpu, _) in pairs)
        hosts = [n * host for n, (_, host) in pairs if host is not None]
        timing.host_ms[candidate] = sum(hosts) if len(hosts) == len(pairs) else None
    timing.pick = pick(timing.ms, base=base)
    timing.seconds = time.perf_counter() - start
    return timing


def chosen(timings: list[OpTiming]) -> tuple[list[str], list[str], bool]:
    """(kernels.fused, kernels.compiled, kernels.compile) from the picks: a compiled or an eager
    block drops the in-block ops' own picks."""
    block = next((t.pick for t in timings if t.op == BLOCK), "picked")
    compile_blocks = block == "compile"
    ops = [t for t in timings if t.op not in (BLOCK, OPTIMIZER) and not (block != "picked" and t.op in BLOCK_OPS)]
    fused = [t.pick if t.pick == "linear_cross_entropy" else t.op for t in ops if t.pick in ("triton", "linear_cross_entropy")]
    return fused, [t.op for t in ops if t.pick == "compile"], compile_blocks


HEAD_BAND = 0.10
"""The fused head + loss this close to the fastest head + loss timed alone is weighed against it in the
run's own steps (HEAD_TRIAL_PAIRS pairs, src/fusion/trial.py): it never holds the logits, and what that
saves in the step (their bytes written and read around the loss, the peak they set) is not in the op
timed alone, where the two measure alike."""
HEAD_TRIAL_PAIRS = 2


def head_contest(timings: list[OpTiming]) -> str | None:
    """The loss candidate (triton, compile or eager) that the fused head (linear_cross_entropy) is
    weighed against in the run's steps: the timed pick where the fused head ran within HEAD_BAND of
    it; None where the fused head is the pick, failed or is further off."""
    t = next((t for t in timings if t.op == "cross_entropy"), None)
    if t is None or t.pick == "linear_cross_entropy":
        return None
    fused, best = t.ms.get("linear_cross_entropy"), t.ms.get(t.pick)
    if fused is None or best is None or fused > best * (1 + HEAD_BAND):
        return None
    return t.pick


def optimizer_chosen(timings: list[OpTiming]) -> str | None:
    """optim.impl the timings call for: "triton" where it beat torch's AdamW, else None (unchanged)."""
    return "triton" if any(t.op == OPTIMIZER and t.pick == "triton" for t in timings) else None


def _time_optimizer(use: Use, candidate: str, hyper: DictConfig, log_every: int, device: torch.device) -> tuple[float, float]:
    """One step's AdamW over parameter shards of `use.shape`'s sizes (fp32 parameters, gradients
    and moments, as FSDP2 holds them): "eager" is torch's fused AdamW plus get_total_norm on one
    step in `log_every` (the steps the loop reads), "triton" the one launch with the squares summed."""
    from perflab_kernels.triton.adamw import TritonAdamW

    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device, generator=gen)) for n in use.shape]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    kw = {"lr": hyper.lr, "betas": tuple(hyper.betas), "eps": hyper.eps, "weight_decay": hyper.weight_decay}
    if candidate == "triton":
        opt = TritonAdamW(params, **kw)
        opt.grad_norm_wanted = True
        gpu, host = _gpu_and_host(opt.step, device)
    else:
        opt = torch.optim.AdamW(params, fused=True, **kw)
        grads = [p.grad for p in params]
        step_gpu, step_host = _gpu_and_host(opt.step, device)
        norm_gpu, norm_host = _gpu_and_host(lambda: torch.nn.utils.get_total_norm(grads), device)
        gpu, host = step_gpu + norm_gpu / log_every, step_host + norm_host / log_every
    del opt, params
    torch.cuda.empty_cache()
    return gpu, host


def _head_loss(candidate: str, loss_fp32: bool) -> Callable:
    """The output head and the loss as the training step runs them under `candidate`."""
    if candidate in ("eager", "compile"):
        def fn(h, w, t):
            logits = h @ w.t()
            return F.cross_entropy(logits.float() if loss_fp32 else logits, t)

        return torch.compile(fn, dynamic=False) if candidate == "compile" else fn
    if candidate == "triton":
        from perflab_kernels.triton.cross_entropy import fused_cross_entropy

        return lambda h, w, t: fused_cross_entropy(h @ w.t(), t)
    from perflab_kernels.triton.linear_cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy


def build_block(model_cfg: DictConfig, precision_cfg: DictConfig | None, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """One transformer block of this model as the run's blocks are before compile and sharding: in
    the compute dtype (FSDP2 gathers the blocks' parameters in it), and with precision=fp8 its
    linears swapped for the run's float8 ones (impl and recipe), so the casts are timed too."""
    from src.models import meta_model

    m = model_cfg
    from omegaconf import OmegaConf

    model = meta_model(OmegaConf.merge(m, {"n_layers": 1}))  # the block's arguments, one block's worth
    block = model.new_block().to(device, dtype)
    if precision_cfg is not None and precision_cfg.float8:
        from src.distributed.float8 import act_in_cast, convert_blocks_to_float8

        # not under FSDP2 here, so no float8 all-gather; every linear of the block is a block linear
        convert_blocks_to_float8(block, str(precision_cfg.fp8_recipe), False, impl=str(precision_cfg.fp8_impl),
                                 module_filter=lambda module, fqn: isinstance(module, torch.nn.Linear),
                                 fold_activation=act_in_cast(precision_cfg, m.mlp),
                                 fast_accum=bool(precision_cfg.fp8_fast_accum))
    return block


def _time_block(use: Use, candidate: str, model_cfg: DictConfig, precision_cfg: DictConfig | None, dtype: torch.dtype,
                device: torch.device) -> tuple[float, float]:
    """One block of this model (build_block), forward and backward with its weight gradients:
    "picked" with the per-op swaps, "compile" under torch.compile (compiled once before timing),
    "eager" with none."""
    from src.fusion.compiled import apply_compiled
    from src.fusion.registry import apply_fused

    batch, seq, dim = use.shape
    block = build_block(model_cfg, precision_cfg, dtype, device)
    if candidate == "compile":
        fn = torch.compile(block, dynamic=False)
    elif candidate == "eager":
        fn = block
    else:
        apply_fused(block, [op for op, how in use.picks.items() if how == "triton"])
        apply_compiled(block, [op for op, how in use.picks.items() if how == "compile"])
        fn = block
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq, dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    leaves = [x, *block.parameters()]
    grad_out = torch.randn(batch, seq, dim, device=device, dtype=dtype, generator=gen)

    def step() -> None:
        torch.autograd.grad(fn(x), leaves, grad_out)

    step()  # compilation (tens of seconds for a block, forward and backward) before the clock
    return _gpu_and_host(step, device)


def _gpu_and_host(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(GPU ms with the host ahead, host ms to issue) of one call of `step`."""
    from src.fusion.timing import host_us_per_call, queued_ms

    return queued_ms(step, device), host_us_per_call(step, device) / 1e3


def gpu_timer(dtype: torch.dtype, loss_fp32: bool, model_cfg: DictConfig | None = None, optim_cfg: DictConfig | None = None,
              log_every: int = 1, precision_cfg: DictConfig | None = None) -> Timer:
    """GPU time of forward + backward with the host ahead (queued_ms), as a step that never syncs
    pays it, and the host time to issue it. `model_cfg` and `precision_cfg`: the model whose block
    is timed, and its precision (float8 linears or not); `optim_cfg` and `log_every`: the
    optimizer's settings and how often the loop reads the norm."""
    from src.fusion.cases import forward_backward, make_case, seed, variant

    device = torch.device("cuda", torch.cuda.current_device())

    def time_one(use: Use, candidate: str) -> tuple[float, float]:
        if use.case == BLOCK:
            return _time_block(use, candidate, model_cfg, precision_cfg, dtype, device)
        if use.case == OPTIMIZER:
            return _time_optimizer(use, candidate, optim_cfg, log_every, device)
        case = make_case("linear_cross_entropy" if use.case == "head_loss" else use.case, use.shape)
        fn = _head_loss(candidate, loss_fp32) if use.case == "head_loss" else variant(use.case, candidate)
        seed(device)
        inputs = case.inputs(device, dtype, True)
        step = forward_backward(fn, inputs)
        return _gpu_and_host(step, device)

    return time_one


def _measure_in_child(ops: list[str], cfg_yaml: str) -> list[dict]:
    from omegaconf import OmegaConf

    from src.dtypes import torch_dtype
    from src.speed.inductor import inductor_config

    cfg = OmegaConf.create(cfg_yaml)
    torch.cuda.set_device(0)
    timer = gpu_timer(torch_dtype(cfg.precision.param_dtype), cfg.train.loss_fp32, cfg.model, cfg.optim, cfg.train.log_every, cfg.precision)
    with inductor_config(cfg):  # the compiled candidates as the run compiles them: speed.cudagraphs' graphs
        return [asdict(t) for t in measure(ops, cfg, timer)]


def measure_on_gpu(ops: list[str], cfg: DictConfig) -> list[OpTiming]:
    """`measure` on GPU 0 in a spawned process, so the launcher holds no CUDA context while the
    ranks train."""
    import multiprocessing

    from omegaconf import OmegaConf

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        rows = pool.apply(_measure_in_child, (ops, OmegaConf.to_yaml(cfg, resolve=True)))
    return [OpTiming(**r) for r in rows]
