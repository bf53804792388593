"""A training run's peak memory a rank, from its config alone, before any rank starts.

Counted: the model's tensors. The parameters are an fp32 shard (the master copy: a bf16 or fp16
precision computes in gathered `param_dtype` copies of it, `working` below), their gradients, and
AdamW's two moments (optim.state_dtype); fsdp2 shards all three over dist.nproc x dist.nnodes ranks,
hsdp over that / sharding.replicate, and sharding=none keeps them whole on every rank. The
activations are what backward needs at the loss, per ac.mode, for data.batch_size x data.seq_len
tokens a rank. Left out: the Python, torch and CUDA runtime (a few hundred MB a process), and what
float8 and torch.compile change (they keep less, so the estimate stays above such runs' peaks).

Gradients live from backward to the optimizer step (the loop's zero_grad(set_to_none=True)), and
backward frees the activations as it makes them, so the peak holds the larger of the two (the
gradients with what the update allocates), not both. It matches GPU runs' peaks of docs/RESULTS.md
to within 1%; tests/integration/test_memory_estimate.py holds it to CPU runs' measured peaks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from src.dtypes import torch_dtype
from src.fusion.registry import selected_ops


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a rank, and what they come from."""

    n_params: int
    """the model's parameters, each shared tensor once"""
    shards: int
    """the ranks that share the parameters, gradients and optimizer state"""
    parameters: float
    gradients: float
    optimizer: float
    """AdamW's two moments"""
    update: float
    """what the update allocates while it runs: torch's multi-tensor (foreach) AdamW one fp32
    temporary the size of the shard (sqrt of exp_avg_sq); fused and Triton updates none"""
    working: float
    """param_dtype copies the step computes in: FSDP2's gathered units, autocast's cast weights,
    DDP's gradient buckets"""
    activations: float
    """what backward keeps at the loss: the blocks' saved tensors and the logits' bytes"""
    offloaded: bool = False
    """sharding.cpu_offload: parameters, gradients and optimizer state in host memory"""

    @property
    def peak(self) -> float:
        """The device's peak: the larger of the activations (end of forward) and the gradients
        (the optimizer step), on top of what lives through the step."""
        if self.offloaded:
            return self.working + self.activations
        return self.parameters + self.optimizer + self.working + max(self.activations, self.gradients + self.update)

    def summary(self) -> str:
        """`12.3 GB a rank (parameters 1.0 GB, gradients 1.0 GB, ...)`"""
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("AdamW state", self.optimizer),
                 *([("AdamW's foreach buffer", self.update)] if self.update else []), ("working copies", self.working), ("activations", self.activations)]
        where = " in host memory" if self.offloaded else ""
        return (f"{human_bytes(self.peak)} a rank ({', '.join(f'{name} {human_bytes(b)}' for name, b in parts)}; "
                f"{human_count(self.n_params)} parameters over {self.shards} rank(s){where})")


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"


def human_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _dtype_bytes(name: str) -> int:
    return torch.tensor([], dtype=torch_dtype(str(name))).element_size()


@dataclass(frozen=True)
class _Shape:
    """What the estimate reads of the model, built on the meta device (no memory)."""

    n_params: int
    block_params: int
    embed_params: int
    head_params: int
    n_layers: int
    dim: int
    block_elements: int
    """elements a token one block saves for backward"""
    op_elements: int
    """the same under ac.selective=op: its input, attention's output and every other matmul's"""
    vocab: int


def _shape(model_cfg: DictConfig) -> _Shape:
    from src.models import meta_model

    model = meta_model(model_cfg)
    block = model.layers[0]
    attn, ffn = block.attn, block.ffn
    d = model.embed.embedding_dim
    heads = attn.n_heads * attn.head_dim
    qkv = heads + 2 * attn.n_kv_heads * attn.head_dim
    hidden = ffn.down.in_features
    swiglu = hasattr(ffn, "gate")
    # Each block saves, a token (counted with saved_tensors_hooks over mini_llm and llama3 blocks:
    # 17 x dim for mini_llm's SiLU MLP, 25 x dim for SwiGLU at 4 x dim, 21 x dim for a small GQA
    # llama3 against 19 here): both norms' inputs and outputs (4 x dim), q, k and v for attention,
    # attention's output and out_proj's input copy (2 x heads), and in the MLP the up projection's
    # output and the down projection's input (SiLU), or gate, up, silu(gate) and their product (SwiGLU).
    elements = 4 * d + qkv + 2 * heads + (4 if swiglu else 2) * hidden
    matmul_outputs = qkv + d + (2 if swiglu else 1) * hidden + d
    head = model.head.weight
    shared = head is model.embed.weight
    return _Shape(
        n_params=model.num_params(non_embedding=False),
        block_params=sum(p.numel() for p in block.parameters()),
        embed_params=model.embed.weight.numel(),
        head_params=0 if shared else head.numel(),
        n_layers=len(model.layers),
        dim=d,
        block_elements=elements,
        op_elements=d + heads + matmul_outputs // 2,
        vocab=head.shape[0],
    )


def _activation_bytes(cfg: DictConfig, shape: _Shape, act_bytes: int) -> float:
    tokens = cfg.data.batch_size * cfg.data.seq_len
    L, block = shape.n_layers, shape.block_elements
    ac = cfg.ac
    if ac.mode == "full":
        kept = L * shape.dim + block  # each block's input, and one block's forward run again in backward
    elif ac.mode == "selective" and str(ac.selective) == "op":
        kept = L * shape.op_elements + block
    elif ac.mode == "selective":
        wrapped = L // int(ac.selective)  # every Nth block (src/distributed/activation_checkpoint.py)
        kept = wrapped * shape.dim + (L - wrapped) * block + block
    else:
        kept = L * block
    # The loss: the logits in the compute dtype, then (train.loss_fp32) an fp32 copy, cross-entropy's
    # fp32 log-softmax and backward's fp32 gradient of it, all alive at once; in the compute dtype
    # otherwise. The fused cross-entropy writes the gradient in forward beside the logits; the fused
    # linear + cross-entropy never forms them, one chunk of rows at a time (its chunk_rows).
    fused = selected_ops(cfg.kernels.fused)
    if "linear_cross_entropy" in fused:
        from perflab_kernels.triton.linear_cross_entropy import (
            chunk_rows,  # only where the fused head runs: it needs Triton
        )

        logits = chunk_rows(tokens, shape.vocab, act_bytes) * shape.vocab * act_bytes
        # precision.fp8_head: W and the hidden input in e4m3 (a byte an element) beside them
        float8 = (shape.vocab + tokens) * shape.dim if cfg.precision.get("fp8_head") else 0
        return tokens * kept * act_bytes + logits + float8
    elif "cross_entropy" in fused:
        per_logit = 2 * act_bytes
    else:
        per_logit = act_bytes + (12 if cfg.train.loss_fp32 else 2 * act_bytes)
    return tokens * (kept * act_bytes + shape.vocab * per_logit)


def estimate(cfg: DictConfig) -> MemoryEstimate:
    """The peak bytes a rank of a training run (train, profile, diagnose's step) would hold."""
    shape = _shape(cfg.model)
    world = cfg.dist.nproc * cfg.dist.nnodes
    strategy = cfg.sharding.strategy
    shards = world // max(1, cfg.sharding.replicate) if strategy == "hsdp" else world if strategy == "fsdp2" else 1
    n = shape.n_params / shards
    p = _dtype_bytes(cfg.precision.param_dtype)
    state = _dtype_bytes(cfg.optim.state_dtype)
    impl = str(cfg.optim.impl)  # auto: fused on CUDA parameters, foreach elsewhere (src/train/optimizer.py)
    foreach = impl == "foreach" or (impl == "auto" and not (cfg.backend.name == "cuda" and not cfg.sharding.cpu_offload))
    if strategy in ("fsdp2", "hsdp"):
        # FSDP2 keeps the root unit (embedding and head, unless split_root) gathered from forward to
        # backward; the blocks too where sharding.reshard_after_forward=false or speed.keep_unsharded,
        # else one running and one prefetched. A unit's unsharded gradient and reduce-scatter input
        # come in backward, once its activations are freed: counting them too overestimates the
        # measured peak, and without them the estimate matches it.
        rest = shape.n_params - shape.n_layers * shape.block_params - shape.embed_params - shape.head_params  # the final norm
        if cfg.sharding.split_root:  # the embedding and the head units of their own; the head's stays gathered
            root = rest + shape.head_params + (0 if cfg.sharding.reshard_after_forward else shape.embed_params)
        else:
            root = rest + shape.embed_params + shape.head_params
        blocks = shape.n_layers if not cfg.sharding.reshard_after_forward or cfg.speed.keep_unsharded else 2
        working = p * (root + blocks * shape.block_params)
    else:
        # sharding=none: autocast caches each weight's cast for the step (a non-fp32 param_dtype), and
        # DDP (more than one rank) allocates its gradient buckets, the gradients' size in fp32.
        working = (p * shape.n_params if p < 4 else 0) + (4 * shape.n_params if world > 1 else 0)
    return MemoryEstimate(
        n_params=shape.n_params,
        shards=shards,
        parameters=4 * n,
        gradients=4 * n,
        optimizer=2 * state * n,
        update=4 * n if foreach else 0,
        working=working,
        activations=_activation_bytes(cfg, shape, p),
        offloaded=bool(cfg.sharding.cpu_offload),
    )


def host_available_bytes() -> int | None:
    """The host's available memory (MemAvailable: free plus what the kernel can reclaim)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing: Linux's own count
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def gpu_capacity(devices: int) -> tuple[int, str] | None:
    """The smallest total memory of the first `devices` visible GPUs, and that GPU's name; None
    where no GPU is visible."""
    if not torch.cuda.is_available():
        return None
    count = min(max(1, devices), torch.cuda.device_count())
    props = min((torch.cuda.get_device_properties(i) for i in range(count)), key=lambda pr: pr.total_memory)
    return int(props.total_memory), props.name
