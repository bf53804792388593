"""AdamW over many fp32 tensors in one launch, with the gradients' sum of squares taken on the way.

torch's fused AdamW (`_fused_adamw_`) is bound by memory (28 bytes a parameter: read parameter,
gradient and both moments, write three) and takes many multi_tensor_apply launches. A step that logs
its gradient norm then reads every gradient again for it (`get_total_norm`). Here one launch walks every tensor's tiles (a tile table built once for the parameter
shapes; the tensors' offsets in a table per step, since FSDP2 hands out new gradient buffers),
and each program writes its tile's sum of squared gradients, so the norm costs a reduction of one
float per tile instead of a second pass over the gradients.

The update is torch's AdamW (decoupled weight decay, bias corrections from the step count, no
amsgrad), in fp32, in the order torch's fused kernel computes it; results agree with it to fp32
rounding (tests/integration/test_kernel_adamw.py), not bit for bit. `TritonAdamW` is torch.optim.AdamW with
this step (optim.impl=triton builds it), over plain tensors or FSDP2's DTensors.

The same launch can also write each updated parameter's bf16 copy (`TritonAdamW.write_copies`):
FSDP2 casts every fp32 parameter to bf16 at each unshard (read 4 bytes, write 2), which on one rank
is the unsharded parameter itself; written in the update it costs the 2-byte store alone, the
fp32 value being in registers already (src/speed/one_rank.py's cast_in_step).

The moments can be kept in bf16 (`TritonAdamW(state_dtype=torch.bfloat16)`, optim.state_dtype): 2
bytes a parameter each instead of 4, so the update moves 22 bytes a parameter instead of 30 and the
moments take half the memory. They are read as fp32, updated in fp32
and rounded stochastically on the way back (`_bf16_sr`). Rounded to nearest, exp_avg_sq's increment
(1 - beta2) * (g^2 - v) at beta2 = 0.999 is under half of bf16's ulp of v (0.2-0.4% of v) unless g^2
is over 3-5x v, so v would never fall and would stop following the gradients; rounded
stochastically each stored value is unbiased. The random bits are an integer hash
(`_rounding_bits`) of the run's seed, the step, the parameter's place in the optimizer and each
element's index in the whole (unsharded) parameter: the same bits however FSDP2 shards it. The
update is faster this way than with fp32 moments, since it moves fewer bytes; a hash keeps it bound
by memory, where Philox4x32-10 (tl.randint4x) for the bits made it compute-bound and slower than fp32
moments (benchmarks/optimizer_in_step.py times the update inside the step).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

import triton
import triton.language as tl
from perflab_kernels.triton.device import interpreted
from perflab_kernels.triton.rounding import bf16_rne  # by name in the kernels: kernels/triton/pdl.py says why

# A program takes TILE = BLOCK x ITERS elements of one tensor (16 fp32 elements a thread per stream
# at 4 warps a pass, as the gradient upcast in kernels/triton/cast.py streams fastest with), so the
# tile table's loads are paid once per several passes. Every load must be a vector load: a first
# version read each tensor's address as a pointer, and a loaded address carries no alignment, so
# every load was scalar and the update took over twice torch's time. Addresses are now element offsets
# from each stream's first tensor (a kernel argument, aligned by Triton's specialisation), hinted as
# multiples of 16 bytes where they are; a load masked against a length read from memory stays scalar
# too, so whole tiles run unmasked.
TILE, NUM_WARPS = 16384, 4
# Elements a pass (BLOCK; ITERS = TILE // BLOCK passes) by whether the moments are bf16 (STATE_BF16).
# bf16 moments add the rounding's integer work to each element, and fewer elements a thread keep
# more programs resident, so inside the seed's step their update is fastest at the smallest block;
# fp32 moments' time hardly moves with it, so they keep the larger one (benchmarks/kernel_configs.py
# --only adamw sweeps these).
BLOCKS = {False: 2048, True: 512}
GRAD_DTYPES = {torch.float32: False, torch.bfloat16: True}
STATE_DTYPES = {torch.float32: False, torch.bfloat16: True}  # the moments' dtype: True where rounded stochastically
COPY_DTYPES = (torch.bfloat16,)  # what a parameter's copy written in the update may be (write_copies): rounded by the bits, bf16's only
RAND_INDEX_BITS = 32  # a random base: the parameter's key above these bits, its first element's flat index (mod 2^32) in them
MAX_TABLES = 64  # tile tables kept per optimizer: one per parameter set it steps (one, or one per FSDP unit)


@triton.jit
def _bf16_sr(x, r):
    """fp32 -> bf16 rounded stochastically: up (away from zero) with probability equal to the
    fraction of a bf16 ulp that truncation drops, so the rounded value's expectation is x. `r` holds
    random uint32s; their low 16 bits are added below the kept ones. A NaN stays a NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (r & 0xFFFF)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mix32(x):
    """A 32-bit integer hash (Wellons' lowbias32: two multiply-xorshift rounds, each output bit
    flipping with about half of the input bits): 2 multiplies, where Philox4x32-10 takes 20 full
    32 x 32-bit products."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


def mix32(x: int) -> int:
    """_mix32 on the host, for the step's key."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def step_key(seed: int, step: int) -> int:
    """The rounding bits' key for step `step` of a run seeded `seed`: 31 bits (a kernel argument of
    one type whatever its value), a hash of both, so no two steps of a run round with the same bits."""
    return mix32((step & 0xFFFFFFFF) ^ mix32(seed & 0xFFFFFFFF)) & 0x7FFFFFFF


@triton.jit
def _rounding_stream(rand_base, key):
    """A tensor's stream of rounding bits this step: the hash of its parameter's key (rand_base's
    high word) under the step's `key` (step_key), and its first element's index mod 2^32 (the low
    word). One program works it out once for its tile."""
    stream = _mix32((rand_base >> 32).to(tl.uint32) ^ key.to(tl.uint32))
    return stream, (rand_base & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _rounding_bits(stream, first, offs):
    """32 random bits for each element at `offs` (`first` + offs its index in the whole parameter,
    mod 2^32: elements 2^32 apart in one parameter share bits, which biases nothing): one hash an
    element. The high half rounds exp_avg, the low half exp_avg_sq (_bf16_sr takes 16 bits)."""
    return _mix32((first + offs.to(tl.uint32)) ^ stream)


@triton.jit
def _adamw_block(P, G, M, V, C, offs, n, wd_scale, beta1, beta2, step_size, inv_bc2_sqrt, eps, stream, first, mul, MASKED: tl.constexpr,
                 HAS_COPY: tl.constexpr, STATE_BF16: tl.constexpr, HAS_MUL: tl.constexpr, GRAD_BF16: tl.constexpr):
    """AdamW over BLOCK elements at `offs` (P, G, M, V, C already at the tensor's first element); the
    gradients' squares, for the norm. Unmasked where the block is whole: a mask against a length read
    from memory has no known divisibility, so its loads would not vectorise. With HAS_COPY the
    updated parameter is also stored to C in bf16 (round to nearest even, as torch's .to()). With
    STATE_BF16 the moments are bf16, rounded stochastically with the bits `_rounding_bits` gives
    for the tensor's (stream, first) (_rounding_stream) and offs. With HAS_MUL each gradient is
    multiplied by `mul` first and rounded to its own dtype, as clip_grads_with_norm_'s in-place
    multiply stores it; the squares are the gradients' as read."""
    mask = offs < n if MASKED else None
    g = tl.load(G + offs, mask=mask, other=0.0 if MASKED else None).to(tl.float32)
    squares = g * g
    if HAS_MUL:
        g = g * mul
        if GRAD_BF16:
            g = bf16_rne(g).to(tl.float32)
    p = tl.load(P + offs, mask=mask)
    m = tl.load(M + offs, mask=mask).to(tl.float32)
    v = tl.load(V + offs, mask=mask).to(tl.float32)
    p = p * wd_scale  # decoupled weight decay: p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_bc2_sqrt + eps)
    tl.store(P + offs, p, mask=mask)
    if STATE_BF16:
        bits = _rounding_bits(stream, first, offs)
        tl.store(M + offs, _bf16_sr(m, bits >> 16), mask=mask)
        tl.store(V + offs, _bf16_sr(v, bits), mask=mask)
    else:
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(C + offs, bf16_rne(p), mask=mask)
    return squares


@triton.jit(do_not_specialize=["seed"])  # a new key each step: one compiled kernel for all of them
def _adamw_tiles(P, G, M, V, C, OFFSETS, NUMELS, TILE_TENSOR, TILE_START, SQUARES, MUL, n_tensors, wd_scale, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                 seed, BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr, GRAD_BF16: tl.constexpr, WANT_SQUARES: tl.constexpr,
                 HAS_COPY: tl.constexpr, COPY_ALIGN: tl.constexpr, STATE_BF16: tl.constexpr, HAS_MUL: tl.constexpr,
                 ROUND_MUL: tl.constexpr):
    """One tile of one tensor a program. OFFSETS holds four rows of n_tensors element offsets, from
    P, G, M and V: parameters, gradients, first moments, second moments; with HAS_COPY a fifth,
    from C: the parameters' bf16 copies (COPY_ALIGN elements to 16 bytes); with STATE_BF16 one more,
    each tensor's random base (the last row). With HAS_MUL, MUL is one fp32 factor every gradient is
    multiplied by before the update (the clipping's); with ROUND_MUL the factor is first rounded to
    bf16, the gradients' dtype (factor_rounded_to_grads)."""
    tile = tl.program_id(0)
    t = tl.load(TILE_TENSOR + tile)
    start = tl.load(TILE_START + tile)
    n = tl.load(NUMELS + t)
    p_off = tl.load(OFFSETS + t)
    g_off = tl.load(OFFSETS + n_tensors + t)
    m_off = tl.load(OFFSETS + 2 * n_tensors + t)
    v_off = tl.load(OFFSETS + 3 * n_tensors + t)
    c_off = 0
    if HAS_COPY:
        c_off = tl.load(OFFSETS + 4 * n_tensors + t)
    stream, first = 0, 0
    if STATE_BF16:
        stream, first = _rounding_stream(tl.load(OFFSETS + (5 if HAS_COPY else 4) * n_tensors + t), seed)
    if ALIGNED:  # every tensor starts on 16 bytes: 4 fp32 or 8 bf16 elements
        p_off = tl.multiple_of(p_off, 4)
        g_off = tl.multiple_of(g_off, 8 if GRAD_BF16 else 4)
        m_off = tl.multiple_of(m_off, 8 if STATE_BF16 else 4)
        v_off = tl.multiple_of(v_off, 8 if STATE_BF16 else 4)
        if HAS_COPY:
            c_off = tl.multiple_of(c_off, COPY_ALIGN)
        start = tl.multiple_of(start, BLOCK)
    P, G, M, V = P + p_off, G + g_off, M + m_off, V + v_off
    if HAS_COPY:
        C = C + c_off
    mul = tl.load(MUL) if HAS_MUL else 1.0
    if ROUND_MUL:
        mul = bf16_rne(mul).to(tl.float32)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    if start + BLOCK * ITERS <= n:  # a whole tile: every tile but a tensor's last
        for i in range(ITERS):
            squares += _adamw_block(P, G, M, V, C, start + i * BLOCK + tl.arange(0, BLOCK), n, wd_scale, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                                    stream, first, mul, False, HAS_COPY, STATE_BF16, HAS_MUL, GRAD_BF16)
    else:
        for i in range(ITERS):
            squares += _adamw_block(P, G, M, V, C, start + i * BLOCK + tl.arange(0, BLOCK), n, wd_scale, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                                    stream, first, mul, True, HAS_COPY, STATE_BF16, HAS_MUL, GRAD_BF16)
    if WANT_SQUARES:
        tl.store(SQUARES + tile, tl.sum(squares, axis=0))


class TileTable:
    """Which tensor and which offset each program takes, for one list of tensor sizes: built once
    (735M elements are 45k tiles, 0.5 MB of table) and reused while the sizes stay."""

    def __init__(self, numels: list[int], device: torch.device):
        tiles = [math.ceil(n / TILE) for n in numels]
        self.n_tiles = sum(tiles)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        index = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(tiles))
        first = torch.cumsum(torch.tensor([0, *tiles[:-1]]), 0)
        start = (torch.arange(self.n_tiles) - first[index]) * TILE
        self.tensor = index.to(torch.int32).to(device)
        self.start = start.to(torch.int64).to(device)


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's first element as an element offset from the first tensor's (any sign)."""
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    return [(t.data_ptr() - base) // size for t in tensors]


# Where torch's in-place multiply of bf16 gradients by clip_grads_with_norm_'s fp32 0-dim factor
# rounds the factor to bf16 first. On CUDA the factor is a device tensor, so _foreach_mul_ leaves its
# fast path (the dtypes differ) for Tensor.mul_, whose TensorIterator casts both inputs to the common
# dtype, bf16, before the fp32 multiply; on the CPU a 0-dim tensor is a CPU scalar, read at fp32.
# Seen on CUDA with torch 2.11: the unrounded factor differed in the last bit of some updates.
FACTOR_ROUNDED_ON = frozenset({"cuda"})


def factor_rounded_to_grads(device: torch.device, grad_dtype: torch.dtype) -> bool:
    return device.type in FACTOR_ROUNDED_ON and grad_dtype == torch.bfloat16


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                table: TileTable, *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                want_squares: bool = False, copies: list[torch.Tensor] | None = None, rand_bases: list[int] | None = None,
                rounding_key: int = 0, grad_mul: torch.Tensor | None = None) -> torch.Tensor | None:
    """AdamW's update of every tensor in place (fp32 parameters, contiguous; gradients fp32 or bf16,
    contiguous, all of one dtype; moments all fp32 or all bf16), the bias corrections of step `step`
    (counted from 1). With `copies` (one contiguous bf16 tensor of each parameter's size), each
    updated parameter is also written to its copy, rounded as torch's cast: 2 bytes more a
    parameter, where a separate cast would read the 4-byte parameter again. bf16 moments are rounded
    stochastically with the bits hashed from (`rounding_key`, 31 bits: step_key's, the tensor's
    `rand_bases` entry + the element's index). With `grad_mul` (a one-element fp32 tensor on the
    parameters' device) every gradient is taken times it, rounded to the gradient's dtype, as
    clip_grads_with_norm_ would have left it on that device (factor_rounded_to_grads); the gradients themselves are not written. Returns the
    sum of the gradients' squares (an fp32 device scalar, of the gradients as read) when `want_squares`."""
    if not params:
        return torch.zeros((), dtype=torch.float32) if want_squares else None
    device = params[0].device
    streams = (params, grads, exp_avgs, exp_avg_sqs) + ((copies,) if copies else ())
    if copies and (len(copies) != len(params) or any(c.numel() != p.numel() or c.dtype not in COPY_DTYPES or not c.is_contiguous()
                                                     for c, p in zip(copies, params))):
        raise ValueError("adamw_step_ writes one contiguous bf16 copy of each parameter's size")
    state_dtypes = {t.dtype for t in exp_avgs + exp_avg_sqs}
    if len(state_dtypes) != 1 or not state_dtypes <= STATE_DTYPES.keys():
        raise ValueError(f"adamw_step_ keeps the moments all in fp32 or all in bf16; got {sorted(map(str, state_dtypes))}")
    state_bf16 = STATE_DTYPES[exp_avgs[0].dtype]
    if state_bf16 and (rand_bases is None or len(rand_bases) != len(params)):
        raise ValueError("adamw_step_ rounds bf16 moments stochastically: give each tensor its random base (rand_bases)")
    if grad_mul is not None and (grad_mul.numel() != 1 or grad_mul.dtype != torch.float32 or grad_mul.device != device):
        raise ValueError(f"adamw_step_'s grad_mul is one fp32 element on {device}; got {grad_mul.dtype} {tuple(grad_mul.shape)} on {grad_mul.device}")
    if any(t.data_ptr() % t.element_size() for group in streams for t in group):
        raise ValueError("adamw_step_ takes tensors aligned to their element size")
    aligned = all(t.data_ptr() % 16 == 0 for group in streams for t in group)
    # one pinned table of offsets a step (FSDP2's gradients move), copied behind the stream's work:
    # no host sync
    rows = [o for group in streams for o in _offsets(group)] + (list(rand_bases) if state_bf16 else [])
    offsets = torch.tensor(rows, dtype=torch.int64,
                           pin_memory=device.type == "cuda").to(device, non_blocking=True)
    squares = torch.empty(table.n_tiles, dtype=torch.float32, device=device) if want_squares else offsets
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    block = BLOCKS[state_bf16]
    head = (params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], copies[0] if copies else params[0], offsets, table.numels, table.tensor, table.start)
    # the factor, or any pointer in its place where there is none (HAS_MUL off: never read)
    tail = (grad_mul if grad_mul is not None else offsets, len(params), 1.0 - lr * weight_decay, beta1, beta2, lr / bc1, 1.0 / math.sqrt(bc2), eps, rounding_key)
    spec = dict(BLOCK=block, ITERS=TILE // block, ALIGNED=aligned, GRAD_BF16=GRAD_DTYPES[grads[0].dtype], HAS_COPY=bool(copies),
                COPY_ALIGN=16 // copies[0].element_size() if copies else 1, STATE_BF16=state_bf16, HAS_MUL=grad_mul is not None,
                ROUND_MUL=grad_mul is not None and factor_rounded_to_grads(device, grads[0].dtype), num_warps=NUM_WARPS)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # the tensors' GPU, whichever is current
        _adamw_tiles[(table.n_tiles,)](*head, squares, *tail, WANT_SQUARES=want_squares, **spec)
        _compile_other_variant(device, head, tail, spec, want_squares, table.n_tiles)
    return squares.sum() if want_squares else None


# Which launches (device, specialisation) have had the other WANT_SQUARES variant compiled beside them.
_BOTH_COMPILED: set[tuple] = set()


def _compile_other_variant(device: torch.device, head: tuple, tail: tuple, spec: dict, want_squares: bool, n_tiles: int) -> None:
    """Compile, without running, the variant of this launch that the next step may want. A run that
    reads the gradient norm only at its logging steps (train.log_every; no clipping, as the float8
    preset runs) would compile the summing variant at the first of them, mid-run, leaving the GPU
    idle for about half a second. Compiled here, at the launch's first step, it joins the run's other
    first-step compiles."""
    if device.type != "cuda" or interpreted():
        return
    key = (device.index, want_squares, tuple(t.dtype for t in head[:5]), tail[0].dtype, tail[1], tuple(sorted(spec.items())))
    if key in _BOTH_COMPILED:
        return
    _BOTH_COMPILED.add(key)
    # the summing variant's SQUARES is a float32 buffer (a pointer's dtype and alignment are part of
    # the compiled kernel's key); the other reads none, and is given the offsets as a placeholder
    squares = head[5] if want_squares else torch.empty(n_tiles, dtype=torch.float32, device=device)
    _adamw_tiles.warmup(*head, squares, *tail, WANT_SQUARES=not want_squares, grid=(n_tiles,), **spec)


def increment_version(tensors: list[torch.Tensor]) -> None:
    """Move each tensor's version counter on by one, as a torch in-place op on it would."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(tensors)
    else:  # older torch: the C++ call, one tensor at a time
        for t in tensors:
            torch._C._increment_version(t)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP2's parameters, gradients and the moments made like them)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def sharding_of(t: torch.Tensor):
    """(mesh, the mesh dimensions `t` is sharded on) for a DTensor, None for a plain tensor: where
    global_norm_from_squares reduces a rank's sum of squares."""
    if not hasattr(t, "placements"):
        return None
    return t.device_mesh, tuple(i for i, pl in enumerate(t.placements) if pl.is_shard())


def global_norm_from_squares(squares: list[torch.Tensor], sharded, device: torch.device) -> torch.Tensor:
    """The global L2 norm from this rank's sums of squares (0-dim fp32 tensors): summed, all-reduced
    over the mesh dimensions the gradients are sharded on (`sharded`: (mesh, dims) or None), square
    root; what get_total_norm(...).full_tensor() gives, summed in another order."""
    # a rank with no gradient this step still joins the all-reduce, with 0
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if sharded is not None and dist.is_initialized():
        mesh, dims = sharded
        for d in dims:  # the shards' sums of squares; replicated dimensions hold the same sum already
            # a dimension of one rank holds the whole sum already: no collective, which on one
            # GPU would be the run's first and start NCCL there, a stall of a fraction of a second
            # at the first logged step
            if mesh.size(d) > 1:
                dist.all_reduce(total, group=mesh.get_group(d))
    return total.sqrt()


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (same param groups, same state: `step`, `exp_avg`, `exp_avg_sq`, so state dicts,
    DCP checkpoints and resumes are AdamW's) whose step runs adamw_step_ over every parameter of a
    group in one launch. With `grad_norm_wanted` set, step() also leaves the global
    L2 norm of the gradients it read in `last_grad_norm` (a device scalar, no host sync), summed
    over the mesh dimensions the parameters are sharded on, which is what get_total_norm returns.
    With `grad_mul` set (a one-element fp32 tensor; the training loop's clipping factor), step()
    updates as if every gradient had been multiplied by it first (adamw_step_'s grad_mul)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, state_dtype: torch.dtype = torch.float32,
                 seed: int = 0):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"TritonAdamW keeps its moments in fp32 or bf16, not {state_dtype}")
        self.state_dtype, self.seed = state_dtype, seed
        self._keys: dict[int, int] = {}  # each parameter's place in the optimizer, in the order added: its random stream
        self._rand_bases: dict[int, int] = {}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._tables: dict[tuple[int, ...], object] = {}
        self.grad_norm_wanted = False
        self.grad_mul: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._copies: dict[int, tuple[torch.Tensor, object]] = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._keys.setdefault(id(p), len(self._keys))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the moments back in this optimizer's state_dtype: torch casts them to
        the parameter's dtype (fp32), and a checkpoint may come from a run with the other state_dtype.
        Done here, once, rather than checked at every step (DCP's set_optimizer_state_dict loads
        through this too)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state and state[name].dtype != self.state_dtype:
                    state[name] = state[name].to(self.state_dtype)

    def _rand_base(self, p: torch.Tensor) -> int:
        """Where p's local elements start in the random stream: its key in the high 32 bits, and the
        flat index (mod 2^32) of its local shard's first element in the whole parameter below (FSDP2 shards dim
        0, so a shard is one run of the flat parameter; any other layout keys the shard by its mesh
        coordinates instead, which keeps the streams apart but not the bits across shardings)."""
        base = self._rand_bases.get(id(p))
        if base is None:
            key, start = self._keys[id(p)], 0
            if hasattr(p, "placements"):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if tuple(local_shape[1:]) == tuple(p.shape[1:]) and not any(offset[1:]):
                    start = offset[0] * math.prod(p.shape[1:])
                else:
                    key += (1 + p.device_mesh.get_rank()) << 16  # up to 65536 parameters keyed apart
            base = self._rand_bases[id(p)] = (key << RAND_INDEX_BITS) | (start % (1 << RAND_INDEX_BITS))
        return base

    def write_copies(self, pairs) -> int:
        """(parameter, copy) pairs: each step also writes the updated parameter to `copy.out` (a
        contiguous bf16 tensor of the parameter's local shard's size) in the same launch, moves
        the parameter's version counters, then calls `copy.written()`, so whoever reads
        `copy.out` can tell it still holds the parameter's cast. FSDP2's one-rank unshard reads them
        (src/speed/one_rank.py's cast_in_step). Returns how many this optimizer now writes."""
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        for param, copy in pairs:
            out, local = copy.out, local_shard(param)
            if id(param) not in owned:
                raise ValueError("write_copies takes this optimizer's own parameters")
            if out.numel() != local.numel() or out.dtype not in COPY_DTYPES or not out.is_contiguous() or out.device != local.device:
                raise ValueError(f"a parameter's copy is a contiguous bf16 tensor of its {local.numel()} elements on {local.device}; "
                                 f"got {out.dtype} {tuple(out.shape)} on {out.device}")
            self._copies[id(param)] = (param, copy)
        return len(self._copies)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        squares, sharded = [], None
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable"):
                raise ValueError("TritonAdamW runs plain AdamW: no amsgrad, maximize, capturable or differentiable")
            # one launch per step count, gradient dtype and copy dtype (one of each, in practice):
            # local parameters, gradients, moments, copies' tensors, copies, parameters, random bases
            launches: dict[tuple[float, torch.dtype, torch.dtype | None], tuple[list, list, list, list, list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # a fused AdamW's checkpoint keeps it on the GPU: read once, not every step
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                if sharded is None:
                    sharded = sharding_of(p)
                tensors = (local_shard(p), local_shard(p.grad), local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]))
                if any(t.numel() and not t.data_ptr() for t in tensors):  # a wrapper subclass (torchao's float8 weights) has no storage
                    raise ValueError(f"TritonAdamW reads each tensor's storage, and a {type(tensors[0]).__name__} parameter has none; use torch's fused AdamW")
                if tensors[0].dtype != torch.float32 or tensors[1].dtype not in GRAD_DTYPES or not all(t.is_contiguous() for t in tensors):
                    raise ValueError(f"TritonAdamW updates contiguous fp32 parameters with fp32 or bf16 gradients; got a {tensors[0].dtype} "
                                     f"parameter with a {tensors[1].dtype} gradient; use torch's fused AdamW")
                copy = self._copies.get(id(p))
                copy = copy[1] if copy is not None and copy[0] is p else None
                if copy is not None and copy.out.untyped_storage().size() < copy.out.numel() * copy.out.element_size():
                    copy = None  # its storage was freed since (not by FSDP2 under cast_in_step): no copy to write
                key = (float(state["step"]), tensors[1].dtype, copy.out.dtype if copy is not None else None)
                lists = launches.setdefault(key, ([], [], [], [], [], [], [], []))
                for lst, t in zip(lists, tensors):
                    lst.append(t)
                lists[4].append(copy.out if copy is not None else None)
                lists[5].append(copy)
                lists[6].append(p)
                lists[7].append(self._rand_base(p) if self.state_dtype != torch.float32 else 0)
            for (step, _, copy_dtype), (*streams, outs, copies, params, rand_bases) in launches.items():
                numels = tuple(t.numel() for t in streams[0])
                table = self._tables.get(numels)
                if table is None:
                    if len(self._tables) >= MAX_TABLES:  # parameter sets that come and go (units stepped in backward)
                        self._tables.clear()
                    table = self._tables[numels] = TileTable(list(numels), streams[0][0].device)
                sq = adamw_step_(*streams, table, step=int(step), lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                 eps=group["eps"], weight_decay=group["weight_decay"], want_squares=self.grad_norm_wanted,
                                 copies=outs if copy_dtype is not None else None, rand_bases=rand_bases,
                                 rounding_key=step_key(self.seed, int(step)), grad_mul=self.grad_mul)
                # the kernel wrote the parameters behind autograd's back: their version counters
                # (a DTensor's and its local tensor's) move as a torch in-place op's would, which
                # is what a reader of a copy compares against
                increment_version(streams[0] + [p for p in params if p is not local_shard(p)])
                for copy in copies:
                    if copy is not None:
                        copy.written()
                if sq is not None:
                    squares.append(sq)
        if self.grad_norm_wanted:
            self.last_grad_norm = global_norm_from_squares(squares, sharded, self.param_groups[0]["params"][0].device)
        return loss
