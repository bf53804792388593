"""Hugging Face checkpoints of the LLaMA 3 family, in and out: LlamaForCausalLM (and Qwen2ForCausalLM,
the same layout with biases on q, k and v) folders of config.json and model.safetensors (or its
sharded index).

Names: our fused `attn.qkv` is Hugging Face's q_proj, k_proj and v_proj stacked by rows (in that
order); everything else maps one to one. Both use rotate-half RoPE, so no row of q or k is permuted.

Reading is by rows: each destination tensor is a stack of row ranges of source tensors, and a rank
whose FSDP2 shard holds rows [a, b) of a parameter reads only those rows (safetensors' memory-mapped
`get_slice`), so no rank ever holds another rank's part, let alone the whole model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


class HFCheckpointError(ValueError):
    """A folder that is not a checkpoint this model can read; the message names the fix."""


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the destination come from Hugging Face tensor `name` (all its rows)."""

    name: str
    start: int
    stop: int


def hf_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"model.hf_path={folder}: no config.json there; give a Hugging Face LlamaForCausalLM folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"model.hf_path={folder}: config.json is cut off or not JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"model.hf_path={folder}: config.json holds no settings object")
    return config


def _rope(config: dict) -> tuple[float, dict]:
    """(theta, the llama3 scaling dict or {}) from either transformers 4's or 5's way of writing them."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return theta, {}
    if kind != "llama3":
        raise HFCheckpointError(f"rope type {kind!r}: only LLaMA 3.1's scaling (llama3) or none is read")
    source = params if params.get("rope_type") == "llama3" else scaling
    return theta, source


def model_fields(config: dict) -> dict:
    """The model.* fields a Hugging Face config.json describes (the shape a run's model must have)."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise HFCheckpointError(f"architectures={config.get('architectures')}: read are {', '.join(ARCHITECTURES)}")
    needed = ("num_attention_heads", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    missing = [k for k in needed if not isinstance(config.get(k), int)]
    if missing:
        raise HFCheckpointError(f"config.json has no whole number {missing[0]}: not a {arch} config")
    n_heads = config["num_attention_heads"]
    theta, scaling = _rope(config)
    fields = {
        "vocab_size": config["vocab_size"], "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads, "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // n_heads, "ffn_hidden": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6), "rope_theta": theta, "rope_factor": float(scaling.get("factor", 0.0)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)), "qkv_bias": arch == "Qwen2ForCausalLM",
    }
    if scaling:
        fields.update(rope_low_freq=float(scaling["low_freq_factor"]), rope_high_freq=float(scaling["high_freq_factor"]),
                      rope_original_len=int(scaling["original_max_position_embeddings"]))
    if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise HFCheckpointError("attention_bias/mlp_bias=true: a LLaMA with biases is not read (Qwen2ForCausalLM's q, k, v biases are)")
    return fields


def shape_mismatch(model_cfg, folder: Path) -> str | None:
    """Why the checkpoint's shape is not the model's, in one line naming the fields; None where it is."""
    fields = model_fields(hf_config(folder))
    head_dim = model_cfg.head_dim or model_cfg.dim // model_cfg.n_heads
    ours = {**{k: model_cfg[k] for k in fields if k in model_cfg}, "n_kv_heads": model_cfg.n_kv_heads or model_cfg.n_heads, "head_dim": head_dim}
    differ = [f"{k}={ours[k]} (the checkpoint's {fields[k]})" for k in fields
              if k in ours and (abs(ours[k] - fields[k]) > 1e-9 * abs(fields[k]) if isinstance(fields[k], float) else ours[k] != fields[k])]
    if not differ:
        return tensor_mismatch(folder, fields)
    return f"model.hf_path={folder}: model={model_cfg.name} has " + ", ".join(f"model.{d}" for d in differ) + "; pick the model config of the checkpoint's shape"


# the dtypes a checkpoint's weights may have; an int8 or float8 tensor would be copied as its integers
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def expected_shapes(fields: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `fields`' shape holds, by its Hugging Face name, with its full shape."""
    dim, hd, ffn = fields["dim"], fields["head_dim"], fields["ffn_hidden"]
    q, kv = fields["n_heads"] * hd, fields["n_kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (fields["vocab_size"], dim), "model.norm.weight": (dim,)}
    if not fields["tie_embeddings"]:
        shapes["lm_head.weight"] = (fields["vocab_size"], dim)
    for i in range(fields["n_layers"]):
        b = f"model.layers.{i}"
        shapes.update({f"{b}.input_layernorm.weight": (dim,), f"{b}.post_attention_layernorm.weight": (dim,),
                       f"{b}.self_attn.q_proj.weight": (q, dim), f"{b}.self_attn.k_proj.weight": (kv, dim),
                       f"{b}.self_attn.v_proj.weight": (kv, dim), f"{b}.self_attn.o_proj.weight": (dim, q),
                       f"{b}.mlp.gate_proj.weight": (ffn, dim), f"{b}.mlp.up_proj.weight": (ffn, dim), f"{b}.mlp.down_proj.weight": (dim, ffn)})
        if fields["qkv_bias"]:
            shapes.update({f"{b}.self_attn.q_proj.bias": (q,), f"{b}.self_attn.k_proj.bias": (kv,), f"{b}.self_attn.v_proj.bias": (kv,)})
    return shapes


def _header(path: Path) -> dict:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}), checked against the file's
    size: a file cut off mid-copy fails here, naming it, and not inside a rank."""
    import struct

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


def tensor_mismatch(folder: Path, fields: dict) -> str | None:
    """Why the checkpoint's tensors are not those of its config.json's shape, naming the file and
    the tensor; None where every one is there, whole, of a float dtype and its full shape. Reads
    the files' headers only."""
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
    for tensor, shape in expected_shapes(fields).items():
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


def sources(name: str, sizes: tuple[int, int, int], tied: bool) -> list[Segment]:
    """Our parameter `name` as row segments of Hugging Face tensors (`sizes`: q, k and v rows)."""
    if name == "embed.weight":
        return [Segment("model.embed_tokens.weight", 0, -1)]
    if name == "norm.weight":
        return [Segment("model.norm.weight", 0, -1)]
    if name == "head.weight":
        return [Segment("model.embed_tokens.weight" if tied else "lm_head.weight", 0, -1)]
    parts = name.split(".")
    if parts[0] != "layers":
        raise KeyError(name)
    block, rest = f"model.layers.{parts[1]}", ".".join(parts[2:])
    if rest.startswith("attn.qkv."):
        kind = rest.rpartition(".")[2]  # weight or bias
        q, k, v = sizes
        return [Segment(f"{block}.self_attn.q_proj.{kind}", 0, q), Segment(f"{block}.self_attn.k_proj.{kind}", q, q + k),
                Segment(f"{block}.self_attn.v_proj.{kind}", q + k, q + k + v)]
    one = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
           "attn.out_proj.weight": "self_attn.o_proj.weight", "ffn.gate.weight": "mlp.gate_proj.weight",
           "ffn.up.weight": "mlp.up_proj.weight", "ffn.down.weight": "mlp.down_proj.weight"}
    return [Segment(f"{block}.{one[rest]}", 0, -1)]


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


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, folder: Path) -> int:
    """Copy a Hugging Face checkpoint's weights into `model` (a Llama3, plain or FSDP2-sharded), each
    rank reading only its own rows. Returns how many parameters were filled."""
    files = SafetensorsFolder(folder)
    first = model.layers[0].attn if len(model.layers) else None
    sizes = first.sizes if first is not None else (0, 0, 0)
    n = 0
    for name, param in model.named_parameters():
        name = name.replace("_orig_mod.", "").replace("_fsdp_wrapped_module.", "").replace("._checkpoint_wrapped_module", "")
        start, stop, local = _local_rows(param)
        if stop > start:
            rows = files.rows(sources(name, sizes, model.tie_embeddings), start, stop)
            if tuple(rows.shape[1:]) != tuple(local.shape[1:]):
                raise HFCheckpointError(f"model.hf_path={folder}: {name} has rows of {tuple(rows.shape[1:])} there, {tuple(local.shape[1:])} here")
            local.copy_(rows)
        n += 1
    return n


def hf_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict (plain tensors) in Hugging Face's names: q, k and v split off qkv."""
    sizes = model.layers[0].attn.sizes
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "head.weight" and model.tie_embeddings:
            continue  # tie_word_embeddings: lm_head is embed_tokens
        segments = sources(name, sizes, False)
        if len(segments) == 1:
            out[segments[0].name] = tensor.contiguous()
        else:
            for seg, part in zip(segments, tensor.split([s.stop - s.start for s in segments])):
                out[seg.name] = part.contiguous()
    return out


def hf_config_for(model: torch.nn.Module, model_cfg: dict, dtype: torch.dtype) -> dict:
    """config.json for `model` as LlamaForCausalLM (Qwen2ForCausalLM where q, k and v have biases)."""
    qwen = bool(model_cfg.get("qkv_bias"))
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": "qwen2" if qwen else "llama",
        "vocab_size": model_cfg["vocab_size"], "hidden_size": model.dim, "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "intermediate_size": model.layers[0].ffn.gate.out_features, "rms_norm_eps": model_cfg["norm_eps"],
        "hidden_act": "silu", "tie_word_embeddings": bool(model.tie_embeddings), "max_position_embeddings": 131072,
        "torch_dtype": str(dtype).removeprefix("torch."), "attention_bias": False, "mlp_bias": False,
        "rope_theta": model_cfg["rope_theta"],
    }
    if model_cfg.get("rope_factor"):
        config["rope_scaling"] = {"rope_type": "llama3", "factor": model_cfg["rope_factor"], "low_freq_factor": model_cfg["rope_low_freq"],
                                  "high_freq_factor": model_cfg["rope_high_freq"], "original_max_position_embeddings": model_cfg["rope_original_len"]}
    if qwen:
        config.pop("attention_bias")
        config.pop("mlp_bias")
    return config


def save_hf(model: torch.nn.Module, model_cfg: dict, state: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write `state` (our names, plain tensors) as a Hugging Face folder: config.json and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, state)
    dtype = next(iter(tensors.values())).dtype
    (folder / "config.json").write_text(json.dumps(hf_config_for(model, model_cfg, dtype), indent=2) + "\n")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
