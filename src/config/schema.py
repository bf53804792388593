"""Structured schemas for every config group, registered in Hydra's ConfigStore.

Each group's YAML starts with `defaults: [/base_<group>@_here_, _self_]`, so a typo in a key or a value of
the wrong type fails when the config is composed, before anything runs. Field docstrings are the
one-line reference a user reads with `python -m src.run --cfg job`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from omegaconf import II, MISSING

from src.config.help import register as register_help
from src.config.tasks import DiagnoseConfig, EdgeConfig, KernelBenchConfig, ProfileConfig
from src.dtypes import Dtype
from src.models.config import Mlp, ModelConfig, arch_configs  # noqa: F401  (Mlp: callers import it from here)


# String choices are StrEnums (OmegaConf 2.3 has no Literal): `sharding.strategy=fsdp` fails when
# the config is composed, naming the options, instead of training with neither FSDP nor DDP on
# 2 ranks. A StrEnum member equals, hashes and prints as its value, so code compares plain strings.
class Strategy(StrEnum):
    fsdp2 = "fsdp2"
    hsdp = "hsdp"
    none = "none"


class Use(StrEnum):
    """Whether a speed recipe (src/speed/) replaces torch's own path: auto, on where it applies (a
    CUDA run) and this torch is one it was verified on, else off with one warning line; on, asked
    for by name: refused in one line on a torch it was not verified on; off, torch's own path."""

    auto = "auto"
    on = "on"
    off = "off"


class CompileBackend(StrEnum):
    inductor = "inductor"
    aot_eager = "aot_eager"
    eager = "eager"


class DeviceType(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"
    vulkan = "vulkan"


class DistBackend(StrEnum):
    gloo = "gloo"
    nccl = "nccl"


class DataSource(StrEnum):
    random = "random"
    text = "text"
    tokens = "tokens"


class Schedule(StrEnum):
    constant = "constant"
    cosine = "cosine"


class NonFinite(StrEnum):
    fail = "fail"
    skip = "skip"


class Fp8Recipe(StrEnum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"
    rowwise_with_gw_tensorwise = "rowwise_with_gw_tensorwise"


class Fp8Impl(StrEnum):
    torchao = "torchao"
    triton = "triton"


class OptimImpl(StrEnum):
    auto = "auto"
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"
    triton = "triton"


class StateDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class ShardingConfig:
    name: str = MISSING
    strategy: Strategy = Strategy.fsdp2
    """fsdp2 (per-block fully_shard, then the root), hsdp (2-D mesh), ddp-style replication (none)"""
    reshard_after_forward: bool = True
    """free the gathered block after forward (ZeRO-3); false keeps it until backward (ZeRO-2)"""
    replicate: int = 1
    """hsdp only: replica groups on the outer mesh dimension; nproc must be a multiple of it"""
    cpu_offload: bool = False
    """keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)"""
    split_root: bool = False
    """fsdp2/hsdp: the embedding and the head as FSDP2 units of their own (torchtitan's layout), not
    one root group: the head's gradient is reduced while the blocks' backward runs"""


@dataclass
class PrecisionConfig:
    name: str = MISSING
    param_dtype: Dtype = Dtype.float32
    """dtype of the gathered parameters that compute runs in"""
    reduce_dtype: Dtype = Dtype.float32
    """dtype of the gradient reduce-scatter / all-reduce; on a mesh of one rank, where nothing is reduced, a
    reduce_dtype equal to param_dtype runs as float32 (the same bits, one cast fewer: src/distributed/parallelize.py)"""
    float8: bool = False
    """float8 GEMMs in the transformer blocks' nn.Linear layers (fp8_impl's casts; not the head unless fp8_head); CUDA, capability 8.9+"""
    fp8_recipe: Fp8Recipe = Fp8Recipe.rowwise_with_gw_tensorwise
    """float8 scaling: tensorwise (one scale a tensor, cuBLAS), rowwise (a scale per row, CUTLASS), or
    rowwise_with_gw_hp (rowwise output and grad-input GEMMs, the grad-weight GEMM in bf16: no transposed casts of activations),
    or rowwise_with_gw_tensorwise (the same with a float8 grad-weight GEMM on tensorwise dY^T and X^T; fp8_impl=triton only)"""
    fp8_all_gather: bool = True
    """tensorwise under FSDP2: all-gather the weights in float8 (half bf16's bytes); rowwise gathers bf16"""
    fp8_impl: Fp8Impl = Fp8Impl.triton
    """who casts: triton (kernels/triton/fp8_linear.py: rowwise_with_gw_hp or rowwise_with_gw_tensorwise, each operand
    cast in one pass; the one measured faster than bf16), or torchao's Float8Linear (tensorwise, rowwise, rowwise_with_gw_hp)"""
    fp8_fast_accum: bool = False
    """float8 GEMMs' accumulation: false gives the output GEMM fast accumulation (the tensor cores' own
    precision) and promotes the grad-input and grad-weight GEMMs' sums to fp32 along the way, as torchao
    does by default; true gives every float8 GEMM fast accumulation, the grad-weight GEMM where the recipe
    runs it in float8 (both fp8_impls)"""
    fp8_act_in_cast: bool | None = None
    """fp8_impl=triton: the MLP's activation inside the float8 casts. model.mlp=silu: SiLU inside the down
    projection's casts and its gradient inside the up projection's (a pass fewer each way); unset: on.
    model.mlp=swiglu (fp8_recipe=rowwise_with_gw_tensorwise): gate and up one GEMM, silu(gate) * up inside
    the down projection's cast, its gradient inside the cast of gate's and up's dY; unset: on"""
    fp8_head: bool = False
    """fp8_impl=triton with the fused head (kernels.fused has linear_cross_entropy): the loss's logits GEMM in
    float8 too, rowwise scales and fast accumulation as the blocks' output GEMMs; its backward GEMMs stay in
    param_dtype. torchtitan and torchao leave the head in bf16"""


@dataclass
class BackendConfig:
    name: str = MISSING
    device_type: DeviceType = DeviceType.cpu
    """torch device type: cpu, cuda, mps, or vulkan (inference through IREE only)"""
    dist_backend: DistBackend | None = DistBackend.gloo
    """torch.distributed backend for multi-rank training: gloo (CPU) or nccl (CUDA)"""


@dataclass
class KernelsConfig:
    name: str = MISSING
    compile: bool = False
    """torch.compile each transformer block before sharding"""
    compile_backend: CompileBackend = CompileBackend.inductor
    """torch.compile backend: inductor (generated kernels), or aot_eager / eager to check graph capture alone"""
    fused: list[str] | None = field(default_factory=list)
    """fused Triton variants to swap in (src/fusion/registry.py); null means every one"""
    auto: bool = False
    """choose `fused` from a diagnosis: the ops it marks memory-bound or latency-limited (src/fusion/choice.py)"""
    diagnosis: str = ""
    """with auto: diagnosis.json, or the run directory of a task=diagnose run; empty: the newest for this model"""
    compiled: list[str] = field(default_factory=list)
    """ops run under torch.compile on their own, the rest of the model eager (kernels=auto's choice where compile was fastest)"""
    loss_trial: int = 0
    """kernels=auto on a GPU with a fused loss picked: n > 0 alternates it with eager's loss over n pairs of steps and
    keeps it only where its median step is no more than 0.5% slower (src/fusion/trial.py)"""


@dataclass
class SpeedConfig:
    """Speed-ups that leave what the step computes unchanged, but for norm_in_copy_in's order of summing the
    gradient norm (python -m src.speed lists the recipes).

    The recipes replace torch internals (src/speed/: each verified on named torch releases, held to
    torch's own path bit for bit); the rest are FSDP2's and Inductor's own levers. Presets:
    conf/speed/ (torch, copies, graphs)."""

    name: str = MISSING
    grad_upcast: Use = Use.auto
    """FSDP2's upcast of bf16/fp16-reduced gradients to the fp32 parameters by a vectorised Triton kernel (recipe)"""
    reduce_copy_in: Use = Use.auto
    """FSDP2's copy of each unit's gradients into the reduce-scatter input by a vectorised Triton kernel (recipe)"""
    one_rank_copies: Use = Use.auto
    """a one-rank shard group: FSDP2's stand-in copies dropped, each unshard one cast, each reduce no copy (recipe)"""
    cast_in_step: Use = Use.auto
    """with one_rank_copies and optim.impl=triton: the update writes each parameter's bf16 cast into its kept
    unsharded storage, so unshards cast only what changed (recipe; 2 bytes a parameter of memory)"""
    keep_unsharded: bool = False
    """fsdp2/hsdp: the gathered parameters keep their memory between steps, so speed.cudagraphs' graphs replay with
    them and backward gathers nothing (FSDP2's own set_keep_unsharded_storage on torch 2.15+, a recipe before)"""
    cudagraphs: bool = False
    """Inductor: each compiled graph replayed from a CUDA graph (torch.compile's reduce-overhead), one launch a
    graph; under fsdp2/hsdp it needs keep_unsharded"""
    clip_in_update: bool = True
    """fused AdamW (torch's, or optim.impl=triton's) with optim.grad_clip > 0: the clipping factor applied
    inside the update instead of a pass of its own over the gradients"""
    norm_in_copy_in: Use = Use.off
    """one rank with speed.reduce_copy_in and one_rank_copies running and optim.grad_clip > 0: the copy-in kernel that writes
    the fp32 gradients also sums their squares, and clipping takes the norm from those sums instead of a pass over every
    gradient (the same sum in another order; auto under speed=copies and graphs)"""
    tied_embedding_grad: Use = Use.off
    """a head tied to the embedding (model.tie_embeddings): the embedding's gradient added into the head's in place,
    only the rows the batch touched, instead of a full-size gradient zero-filled and then added (kernels/triton/embedding_grad.py;
    torch's CUDA sums bit for bit above 3072 tokens a rank; auto under speed=copies and graphs: CUDA runs on a torch its GPU tests
    matched, src/speed/tied_embedding.py's VERIFIED)"""
    force_unverified: bool = False
    """run the recipes asked for on a torch or Triton release they were not verified on"""


@dataclass
class DataConfig:
    name: str = MISSING
    source: DataSource = DataSource.random
    """random (the seed's uniform tokens), text (byte-level corpus) or tokens (a corpus python -m src.data.prepare made)"""
    batch_size: int = 8
    """sequences per device per step (the seed's 8); the global batch is batch_size x data-parallel ranks"""
    seq_len: int = 1024
    text_path: str | None = None
    """text only: a UTF-8 file to train on; empty means the Python standard library's own source"""
    corpus_mb: float = 4.0
    """text only: megabytes of the standard-library corpus to read"""
    tokens_path: str | None = None
    """tokens only: the folder python -m src.data.prepare wrote (meta.json, token shards, tokenizer.json)"""


@dataclass
class TrackingConfig:
    name: str = MISSING
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI; a relative sqlite path is taken from the directory the run starts in"""
    experiment: str | None = None
    """MLflow experiment; empty means one per task: 'perflab' for task=train, 'perflab-TASK' for
    the others (+exp presets do not split: a run's preset is its `exp` param)"""
    run_name: str | None = None
    """empty means one built from the command-line overrides"""
    system_metrics: bool = True
    """MLflow's own system metrics (CPU, memory, GPU through pynvml), sampled beside the run"""
    system_metrics_interval_s: float = 10.0
    connect_timeout_s: float = 5.0
    """how long to wait for a tracking server before the run goes on without it"""
    retry_s: float = 60.0
    """a server that stops answering mid-run: step metrics are retried with backoff while training
    runs, and for this long after it ends; what is not stored by then stays in metrics.jsonl"""


@dataclass
class TaskConfig:
    name: str = MISSING


@dataclass
class DistConfig:
    nproc: int = 2
    """ranks on this node (GPUs with backend=cuda); the elastic launcher starts them"""
    nnodes: int = 1
    max_restarts: int = 0
    """elastic restarts of the whole group after a rank fails"""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous; empty picks a free local port (single node)"""
    timeout_s: int = 600
    """collective timeout; a hung rank fails the run after this long instead of hanging it"""
    fake: bool = False
    """rank 0 of the dist.nproc x dist.nnodes group alone in this process, every collective faked
    (torch's fake process group, torchtitan's fake_backend): an N-GPU run's sharding, per-rank peak
    memory, compile and CUDA graphs tried on one device before the N GPUs are had. No data crosses
    ranks (a gather repeats this rank's shard, or leaves the buffer as it was on older torch), so
    the losses and step times are not the N-GPU run's; the losses are not checked for NaN"""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    """clip the global gradient norm to this; 0 disables clipping (the norm is still reported)"""
    impl: OptimImpl = OptimImpl.auto
    """AdamW's kernels: fused (one kernel per batch of tensors), foreach (multi-tensor), for_loop, triton
    (every tensor in one launch, and the logged grad norm read in the same pass); auto: fused on CUDA, else foreach"""
    state_dtype: StateDtype = StateDtype.float32
    """AdamW's moments (exp_avg, exp_avg_sq): float32, or bfloat16 (impl=triton), rounded stochastically
    in the update: half the moments' memory and bytes"""
    schedule: Schedule = Schedule.constant
    """learning rate per step: constant (the seed's) or cosine (down to min_lr_ratio * lr at the last step)"""
    warmup_steps: int = 0
    """learning-rate warm-up: rises linearly to lr over these first steps (either schedule)"""
    min_lr_ratio: float = 0.1
    """cosine only: the last step's learning rate as a fraction of lr"""


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 0
    """one seed for weights and data: the same whatever the world size"""
    log_every: int = 1
    untimed_steps: int = 2
    """first steps left out of the throughput and step-time figures (allocator warm-up, compilation);
    the learning-rate warm-up is optim.warmup_steps"""
    seed_line: bool = False
    """also print docs/SEED.md's own line: 'Step N | Loss: ... | Peak VRAM/GPU: ... GB'"""
    progress: bool = True
    """live progress line on rank 0"""
    nonfinite: NonFinite = NonFinite.fail
    """a NaN/inf loss or gradient norm: fail (stop the run as FAILED, checked where the loop syncs
    anyway, before any checkpoint) or skip (drop that optimizer step; one more device sync a step)"""
    loss_fp32: bool = True
    """cross-entropy on fp32 logits (torchtitan's choice); the seed's script uses the bf16 logits as they come"""
    label_smoothing: float = 0.0
    """cross-entropy against (1 - e) on the target + e / vocab everywhere, as F.cross_entropy; the fused losses too"""
    gpu_hour_price: float = 0.0
    """the price of one GPU-hour, in any currency: summary.json's cost_per_mtok is what a million
    trained tokens cost at this run's tokens/s per device; 0: not priced"""
    gpu_clock_interval_s: float = 0.1
    """on a GPU, rank 0 samples its SM clock, power draw and power-cap state through NVML this often
    over the timed steps (src/profiling/gpu_clocks.py; summary.json's gpu_* figures, the last log
    line); 0 turns it off"""


class ACMode(StrEnum):
    none = "none"
    full = "full"
    selective = "selective"


@dataclass
class ActivationCheckpointConfig:
    """Activation checkpointing: blocks recompute their activations in backward instead of keeping them."""

    mode: ACMode = ACMode.none
    """none; full (every block keeps only its input); selective (ac.selective says which)"""
    selective: str = "op"
    """with mode=selective: op (every block keeps its matmuls' and attention's outputs, recomputes the rest),
    or N (every Nth block in full)"""


@dataclass
class FaultConfig:
    """Fault injection, to prove that failures are reported and recovered from (tests, drills)."""

    kind: str = "none"
    """none, raise (an exception), kill (SIGKILL the rank), or nan (a non-finite loss); a plain str
    checked in src/config/validate.py, not an Enum: the command line reads `fault.kind=nan` as a float"""
    rank: int = 0
    """the rank that fails"""
    step: int = 0
    """the step at which it fails (steps count from 0, as on the console, in metrics.jsonl and MLflow)"""


class StopSignal(StrEnum):
    """The signals checkpoint.on_signal may name (SIGINT stays Ctrl-C: stop now, save nothing)."""

    SIGTERM = "SIGTERM"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGHUP = "SIGHUP"


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint) and resuming from them."""

    enabled: bool = False
    interval: int = 0
    """save every this many steps (0: only at the end)"""
    folder: str = ""
    """where checkpoints go; empty means <run_dir>/checkpoints"""
    keep_last: int = 2
    """complete checkpoints kept; older ones are deleted once a newer one is complete"""
    async_mode: bool = False
    """stage to host memory and write in the background, overlapping training"""
    resume: str = "auto"
    """auto: the latest complete checkpoint in `folder`, if any (elastic restarts resume so);
    none: start fresh; or a step_NNNNNNNN folder to resume from (any world size)"""
    export_safetensors: bool = False
    """at the end, write the full weights to <run_dir>/model.safetensors (plain state_dict)"""
    on_signal: list[StopSignal] = field(default_factory=lambda: [StopSignal.SIGTERM, StopSignal.SIGUSR1])
    """signals that end the run after the step it is at, with a checkpoint of that step (SLURM sends
    SIGTERM at preemption and at the time limit, and `sbatch --signal=USR1@90`'s ahead of it); the run
    exits 128 + the signal's number and resumes from it (resume=auto). Under a submitit job its timeout
    signal (SIGUSR2) is added and submitit requeues the job. [] turns it off"""
    requeue: bool = True
    """in a SLURM batch job not run by submitit: `scontrol requeue` the job after that checkpoint"""


@dataclass
class SweepConfig:
    """How a -m sweep is judged and resumed (src/tracking/sweep.py); no job's result depends on it, so
    it is left out of each job's config_hash."""

    objective: str = ""
    """the summary.json figure that names a sweep's best job and that a searching sweeper
    (hydra/sweeper=optuna) gets back from each trial; empty: the task's headline figure
    (tokens_per_s_per_device for train). Lower-is-better figures (final_loss, *_ms, *_gb) want
    hydra.sweeper.direction=minimize, the rest maximize"""
    resume: bool = False
    """run the same sweep again under its MLflow parent run: a job whose config_hash a FINISHED
    child carries is skipped, the failed, killed and missing ones run"""


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    sharding: ShardingConfig = MISSING
    precision: PrecisionConfig = MISSING
    backend: BackendConfig = MISSING
    kernels: KernelsConfig = MISSING
    speed: SpeedConfig = MISSING
    data: DataConfig = MISSING
    tracking: TrackingConfig = MISSING
    task: TaskConfig = MISSING
    dist: DistConfig = field(default_factory=DistConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ac: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    kernel_bench: KernelBenchConfig = field(default_factory=KernelBenchConfig)
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    exp: str | None = None
    """name of the +exp experiment, set by each conf/exp/*.yaml"""
    extra: dict[str, Any] = field(default_factory=dict)
    """free-form tags for a run; the only untyped node"""


GROUPS = {
    "model": ModelConfig,
    "sharding": ShardingConfig,
    "precision": PrecisionConfig,
    "backend": BackendConfig,
    "kernels": KernelsConfig,
    "speed": SpeedConfig,
    "data": DataConfig,
    "tracking": TrackingConfig,
    "task": TaskConfig,
}


# Hydra's submitit launchers (hydra-submitit-launcher), as this project runs them: one task per node,
# an elastic agent that starts dist.nproc ranks there (src/distributed/cluster.py says why), nodes
# and GPUs taken from dist.*, and a job that dies recorded FAILED while the sweep goes on. Stored
# under the plugin's own names (hydra/launcher=submitit_local, submitit_slurm) in place of its.
_GPUS_PER_NODE = II("perflab_gpus_per_node:${backend.device_type},${dist.nproc},${dist.fake}")
_NODES = II("perflab_nodes:${dist.nnodes},${dist.fake}")


def job_gpus_per_node(device_type: str, nproc: int, fake: bool) -> int | None:
    """dist.nproc GPUs on a CUDA run (one under dist.fake: rank 0 alone), none asked for otherwise.
    Left unset, submitit's local executor hides every GPU from a job (CUDA_VISIBLE_DEVICES='')."""
    if device_type != "cuda":
        return None
    return 1 if fake else int(nproc)


def job_nodes(nnodes: int, fake: bool) -> int:
    """dist.nnodes nodes; one under dist.fake, whose rank 0 runs alone in the job's one process."""
    return 1 if fake else int(nnodes)


@dataclass
class SubmititLocalConfig(LocalQueueConf):
    """submitit's local executor: each sweep job a process on this machine, watched as on SLURM; one node."""

    _target_: str = "hydra_plugins.perflab_submitit_launcher.launchers.LocalLauncher"
    name: str = "perflab"
    tasks_per_node: int = 1
    """one: the task is the node's elastic agent, which starts dist.nproc ranks"""
    gpus_per_node: int | None = _GPUS_PER_NODE
    timeout_min: int = 240
    """a job still running after this long is stopped (and recorded FAILED)"""


@dataclass
class SubmititSlurmConfig(SlurmQueueConf):
    """SLURM through sbatch: an array with a job per sweep job, each on `nodes` nodes, a task per node."""

    _target_: str = "hydra_plugins.perflab_submitit_launcher.launchers.SlurmLauncher"
    name: str = "perflab"
    nodes: int = _NODES
    tasks_per_node: int = 1
    """one: the task is the node's elastic agent, which starts dist.nproc ranks"""
    gpus_per_node: int | None = _GPUS_PER_NODE
    cpus_per_task: int | None = II("dist.nproc")
    """a CPU per rank at least: SLURM binds the task, and so all its ranks, to the CPUs it asked for
    (one when unset: dist.nproc ranks on one core)"""
    timeout_min: int = 240
    """SLURM's --time in minutes; the partition's limit may be lower"""
    max_num_timeout: int = 3
    """times a job that reaches its time limit is requeued: ahead of the limit (signal_delay_s) the run saves
    its step (checkpoint.on_signal) and continues from it in the requeued job (submitit's own default, 0,
    records it failed after the save)"""


try:  # hydra-optuna-sweeper (a dependency); an environment without it only loses hydra/sweeper=optuna
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
except ImportError:  # pragma: no cover
    OptunaSweeperConf = None
else:
    @dataclass
    class OptunaSweeperConfig(OptunaSweeperConf):
        """hydra/sweeper=optuna: the plugin's sweeper, whose study with no finished trial ends as a sweep
        whose jobs all failed instead of a traceback (hydra_plugins/perflab_optuna_sweeper)."""

        _target_: str = "hydra_plugins.perflab_optuna_sweeper.sweeper.OptunaSweeper"
        direction: Any = None
        """minimize or maximize (a list for several objectives); none: the better side of sweep.objective"""


def register_configs() -> None:
    from hydra.core.plugins import Plugins
    from omegaconf import OmegaConf

    # Hydra's plugin scan runs each plugin module again, the submitit plugin's config module too,
    # which stores its launchers again: scan now (once a process; Plugins is a singleton), then
    # replace them.
    Plugins.instance()
    cs = ConfigStore.instance()
    cs.store(group="hydra/launcher", name="submitit_local", node=SubmititLocalConfig, provider="perflab")
    cs.store(group="hydra/launcher", name="submitit_slurm", node=SubmititSlurmConfig, provider="perflab")
    if OptunaSweeperConf is not None:
        cs.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConfig, provider="perflab")
    if not OmegaConf.has_resolver("perflab_gpus_per_node"):
        OmegaConf.register_new_resolver("perflab_gpus_per_node", job_gpus_per_node)
    if not OmegaConf.has_resolver("perflab_nodes"):
        OmegaConf.register_new_resolver("perflab_nodes", job_nodes)
    cs.store(name="base_config", node=RunConfig)
    for group, schema in GROUPS.items():
        # Stored outside the groups (each group's YAML pulls its schema with `/base_<group>@_here_`),
        # so a schema is never offered as an option: `model=base_model` would compose a model
        # with no name and fail deep inside a rank.
        cs.store(name=f"base_{group}", node=schema)
    for arch, schema in arch_configs().items():  # each architecture's own: a model's YAML pulls /base_model_ARCH
        cs.store(name=f"base_model_{arch}", node=schema)


register_configs()
register_help()  # `--help` reads field docstrings through a resolver
