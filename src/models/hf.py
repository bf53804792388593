"""Hugging Face checkpoints read and written by rows: folders of config.json and model.safetensors
(or its sharded index). An architecture's adapter (src/models/ARCH/hf.py, a RowMappedHF) says which
tensors a checkpoint of a shape holds and which rows of them make each of its parameters; reading,
checking and writing are here.

Reading is by rows: each destination tensor is a stack of row ranges of source tensors, and a rank
whose FSDP2 shard holds rows [a, b) of a parameter reads only those rows (safetensors' memory-mapped
`get_slice`), so no rank ever holds another rank's part, let alone the whole model.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.models.config import HF, HFConfigError, ModelConfig, hf_config

# the dtypes a checkpoint's weights may have; an int8 or float8 tensor would be copied as its integers
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


class HFCheckpointError(HFConfigError):
    """A folder that is not a checkpoint this model can read; the message names the fix."""


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the destination come from Hugging Face tensor `name` (all its rows)."""

    name: str
    start: int
    stop: int


class RowMappedHF:
    """An adapter whose every parameter is a stack of whole Hugging Face tensors' rows. Subclasses
    give `schema` (whose from_hf reads config.json), expected_shapes, sources and config_for."""

    schema: type[ModelConfig]

    def expected_shapes(self, fields: dict) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of `fields`' shape holds, by its Hugging Face name, with its full shape."""
        raise NotImplementedError

    def sources(self, name: str, model: torch.nn.Module) -> list[Segment]:
        """Our parameter `name` of `model` as row segments of Hugging Face tensors."""
        raise NotImplementedError

    def config_for(self, model: torch.nn.Module, model_cfg: dict, dtype: torch.dtype) -> dict:
        """config.json for `model`, which transformers loads."""
        raise NotImplementedError

    def model_fields(self, config: dict) -> dict:
        named = (config.get("architectures") or ["?"])[0]
        if named not in self.schema.HF_ARCHITECTURES:
            raise HFCheckpointError(f"architectures={config.get('architectures')}: read are {', '.join(self.schema.HF_ARCHITECTURES)}")
        return self.schema.from_hf(config)

    def check(self, model_cfg: DictConfig, folder: Path) -> str | None:
        try:
            fields = self.model_fields(hf_config(folder))
        except HFConfigError as err:
            return str(err)
        differ = [f"model.{k}={_ours(model_cfg, k)} (the checkpoint's {v})" for k, v in fields.items() if not _same(_ours(model_cfg, k), v)]
        if differ:
            fix = ("drop those settings: the shape is the folder's" if model_cfg.name == HF
                   else f"or take the shape from the folder: model=hf model.hf_path={folder}")
            return f"model.hf_path={folder}: model={model_cfg.name} has " + ", ".join(differ) + f"; {fix}"
        return tensor_mismatch(Path(folder), self.expected_shapes(fields))

    @torch.no_grad()
    def load(self, model: torch.nn.Module, folder: Path) -> int:
        files = SafetensorsFolder(folder)
        n = 0
        for name, param in model.named_parameters():
            name = name.replace("_orig_mod.", "").replace("_fsdp_wrapped_module.", "").replace("._checkpoint_wrapped_module", "")
            start, stop, local = _local_rows(param)
            if stop > start:
                rows = files.rows(self.sources(name, model), start, stop)
                if tuple(rows.shape[1:]) != tuple(local.shape[1:]):
                    raise HFCheckpointError(f"model.hf_path={folder}: {name} has rows of {tuple(rows.shape[1:])} there, {tuple(local.shape[1:])} here")
                local.copy_(rows)
            n += 1
        return n

    def state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict (plain tensors) in Hugging Face's names (a tied head left out)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name == "head.weight" and getattr(model, "tie_embeddings", False):
                continue  # tie_word_embeddings: lm_head is embed_tokens
            segments = self.sources(name, model)
            if len(segments) == 1:
                out[segments[0].name] = tensor.contiguous()
            else:
                for seg, part in zip(segments, tensor.split([s.stop - s.start for s in segments])):
                    out[seg.name] = part.contiguous()
        return out

    def save(self, model: torch.nn.Module, model_cfg: dict, state: dict[str, torch.Tensor], folder: Path) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = self.state_dict(model, state)
        dtype = next(iter(tensors.values())).dtype
        (folder / "config.json").write_text(json.dumps(self.config_for(model, model_cfg, dtype), indent=2) + "\n")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder


def _ours(model_cfg: DictConfig, key: str):
    """model_cfg's value of `key` as config.json states it (0 for n_kv_heads and head_dim means the default)."""
    if key == "n_kv_heads":
        return model_cfg.n_kv_heads or model_cfg.n_heads
    if key == "head_dim":
        return model_cfg.head_dim or model_cfg.dim // model_cfg.n_heads
    return model_cfg[key] if key in model_cfg else None


def _same(ours, theirs) -> bool:
    if isinstance(theirs, float) and isinstance(ours, (int, float)):
        return abs(ours - theirs) <= 1e-9 * abs(theirs)
    return ours == theirs


def _header(path: Path) -> dict:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}), checked against the file's
    size: a file cut off mid-copy fails here, naming it, and not inside a rank."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("its header runs past its end")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"{path}: not a safetensors file ({err}); copy it again") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if size < 8 + n + end:
        raise HFCheckpointError(f"{path}: cut off ({size:,} bytes where its tensors need {8 + n + end:,}); copy it again")
    return header


def tensor_mismatch(folder: Path, expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why the checkpoint's tensors are not `expected` (name: full shape), naming the file and the
    tensor; None where every one is there, whole, of a float dtype and its full shape. Reads the
    files' headers only."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            return f"model.hf_path={folder}: {index.name} is cut off or has no weight_map ({err})"
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return f"model.hf_path={folder}: neither model.safetensors nor model.safetensors.index.json there"
    found: dict[str, tuple[str, dict]] = {}
    for name in files:
        if not (folder / name).is_file():
            return f"model.hf_path={folder}: {name}, which the index names, is not there"
        try:
            header = _header(folder / name)
        except HFCheckpointError as err:
            return f"model.hf_path={folder}: {err}"
        found.update({k: (name, v) for k, v in header.items()})
    for tensor, shape in expected.items():
        if tensor not in found:
            return f"model.hf_path={folder}: no tensor {tensor} in the checkpoint, which config.json's shape needs"
        name, info = found[tensor]
        if info["dtype"] not in FLOAT_DTYPES:
            return (f"model.hf_path={folder}: {name}'s {tensor} is {info['dtype']}, not a float: a quantized checkpoint; "
                    "give its bf16, fp16 or fp32 weights")
        if tuple(info["shape"]) != shape:
            return (f"model.hf_path={folder}: {name}'s {tensor} is {tuple(info['shape'])}, and config.json's shape needs {shape}; "
                    "the weights are not those of its config.json")
    return None


class SafetensorsFolder:
    """The tensors of model.safetensors, or of the shards model.safetensors.index.json names, opened lazily."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: self.folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.folder / "model.safetensors", "pt") as f:
                self.where = dict.fromkeys(f.keys(), self.folder / "model.safetensors")
        else:
            raise HFCheckpointError(f"model.hf_path={folder}: neither model.safetensors nor model.safetensors.index.json there")
        self._open: dict[Path, object] = {}

    def slice(self, name: str):
        if name not in self.where:
            raise HFCheckpointError(f"model.hf_path={self.folder}: no tensor {name} in the checkpoint")
        path = self.where[name]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_slice(name)

    def rows(self, segments: list[Segment], start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the stack of `segments`, reading only those rows."""
        pieces, offset = [], 0
        for seg in segments:
            src = self.slice(seg.name)
            n = src.get_shape()[0] if seg.stop < 0 else seg.stop - seg.start
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                pieces.append(src[lo - offset: hi - offset])
            offset += n
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _local_rows(param: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(first row, past the last row, the local tensor) of this rank's part of `param`: a DTensor
    sharded on dim 0 as FSDP2 shards (torch.chunk: ceil(rows / ranks) each, the last ones short or
    empty), or a plain tensor (all rows)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0], param
    local = param.to_local()
    rows, start = param.shape[0], 0
    for dim_mesh, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise HFCheckpointError(f"a parameter sharded on dim {placement.dim}: only FSDP2's dim-0 shards are read by rows")
            ranks, rank = param.device_mesh.size(dim_mesh), param.device_mesh.get_coordinate()[dim_mesh]
            chunk = -(-rows // ranks)
            start = min(rank * chunk, rows)
    return start, start + local.shape[0], local
