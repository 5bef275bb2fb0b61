"""Experiment config schema: the dataclasses of each section and their validation with clear errors (loading: ``load.py``).

A config is plain frozen data. Each section is a dataclass; unknown keys and wrong types are
refused with the dotted key that is wrong and what it should be. Algorithm-specific
hyper-parameters live in the free-form ``algo`` mapping, which the algorithm validates.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml

from restage.algorithms import algorithm_names, is_algorithm_name
from restage.algorithms.tools import ToolFormat
from restage.cluster import load_cluster
from restage.errors import ConfigError

# The closed choices of a config. Each set of allowed values is written once, here: ``check_choice`` (the config
# reader's and ``ExperimentConfig``'s check) makes the error from it. The choices code dispatches on are enums
# (``match`` on the members); the rest are ``Literal``s. StrEnums keep the plain names in YAML, JSON and logs.


class DatasetKind(StrEnum):
    """``dataset.kind``: what a row holds."""

    PROMPT = "prompt"
    SFT = "sft"
    PREFERENCE = "preference"


class Execution(StrEnum):
    """``plan.execution``: sync (generate, then train, every step), async (generation runs ahead of training) or
    auto (the planner predicts both and runs the faster)."""

    SYNC = "sync"
    ASYNC = "async"
    AUTO = "auto"


class PlanMode(StrEnum):
    """``plan.mode``: how the layouts are chosen."""

    SEARCH = "search"
    HEURISTIC = "heuristic"
    MANUAL = "manual"


Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[Dtype, ...] = typing.get_args(Dtype)
AUTO_DTYPE: Literal["auto"] = "auto"  # bf16 on a GPU cluster, fp32 on a CPU one (resolved when the config is built)
DtypeSetting = Literal[Dtype, "auto"]  # models.<name>.dtype as written; "auto" is resolved when the config is built
ZeroStage = Literal[0, 1, 2, 3]  # models.<name>.zero_stage
LrSchedule = Literal["constant", "linear", "cosine"]
KvCacheLayout = Literal["auto", "paged", "contiguous"]  # generation.kv_cache
KV_CACHE_LAYOUTS: tuple[KvCacheLayout, ...] = typing.get_args(KvCacheLayout)
OnRewardError = Literal["zero", "stop"]  # rewards.on_error
OnRewardTimeout = Literal["score", "stop"]  # rewards.on_timeout
WandbMode = Literal["off", "offline", "online"]  # dashboards.wandb
OnNonfinite = Literal["skip", "stop"]  # run.nonfinite
ShardFrozenChoice = Literal["off", "auto"]  # plan.shard_frozen
LauncherSetting = Literal["auto", "srun", "mpirun"]  # slurm.launcher


def allowed_values(tp: object) -> tuple[str | int, ...] | None:
    """The values a ``Literal`` or enum annotation allows (in the order written); None for any other annotation."""
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tuple(member.value for member in tp)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def check_choice(value: object, tp: object, key: str) -> Any:
    """``value`` if ``tp`` (a ``Literal`` or an enum) allows it, an enum's member for its name; else a one-line
    ConfigError made from the allowed values."""
    allowed = allowed_values(tp)
    assert allowed is not None, f"{key}: {tp} is not a closed choice"
    if isinstance(value, (str, int)) and not isinstance(value, bool) and value in allowed:
        return tp(value) if isinstance(tp, type) else value
    raise ConfigError(f"{key}: {value!r} must be one of {', '.join(str(v) for v in allowed)}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


# LoRA targets: restage's canonical module names, and the HF names they may also be given as.
LORA_MODULES = ("q", "k", "v", "o", "gate", "up", "down")
LORA_HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}
LORA_ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer of the blocks (a mixture's: attention only)


@dataclass(frozen=True)
class LoraSpec:
    """``models.<name>.lora``: low-rank adapters on a frozen base (docs/algorithms.md, "LoRA")."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = (LORA_ALL_LINEAR,)
    dropout: float = 0.0

    def canonical_targets(self) -> tuple[str, ...]:
        """The targets as canonical names (HF names mapped, all-linear the seven), in canonical order."""
        if LORA_ALL_LINEAR in self.target_modules:
            return LORA_MODULES
        names = {LORA_HF_NAMES.get(t, t) for t in self.target_modules}
        return tuple(m for m in LORA_MODULES if m in names)


@dataclass(frozen=True)
class ModelSpec:
    """One named model of the experiment (actor, critic, ref, reward)."""

    path: str = ""  # HF model directory (optional for planning when ``arch`` names a preset)
    arch: str = ""  # architecture preset (restage.models.presets), e.g. llama-7b; used when path is empty
    trainable: bool = False
    dtype: DtypeSetting = "fp32"  # in a config file an absent dtype is AUTO_DTYPE (config_from_dict)
    zero_stage: ZeroStage = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    gradient_checkpointing: bool = False
    offload_when_idle: bool = False  # non-trainable models: move to CPU memory between their MFCs
    # Frozen models: hold the parameters 1/dp per rank of the home layout, gathered unit by unit in each forward
    # (ZeRO-3 / FSDP inference, runtime/store/sharded_frozen.py). The planner may also choose it (plan.md).
    shard_frozen: bool = False
    init_critic_from_lm: bool = False  # build a scalar head on top of a causal LM checkpoint
    router_aux_loss_coef: float | None = None  # mixture of experts: load-balancing loss weight; None: config.json's
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraSpec | None = None  # adapters on a frozen base; absent: the whole model is trained


@dataclass(frozen=True)
class DatasetConfig:
    path: str = ""
    kind: DatasetKind = DatasetKind.PROMPT
    tokenizer: str = ""  # defaults to the actor's (or first model's) directory
    max_prompt_tokens: int = 128
    max_answer_tokens: int = 128
    eval_fraction: float = 0.0
    shuffle: bool = True
    # Where each role's text is in a row (data/sources.py): e.g. {prompt: question}; unnamed roles keep their name.
    fields: dict[str, str] = field(default_factory=dict)
    chat_template: bool = False  # prompts (text or message lists) go through the tokenizer's chat template
    split: str = "train"  # the split of a HF datasets directory holding several (a DatasetDict)
    eval_split: str = ""  # held out: that split of the same directory ("" : eval_fraction or eval_path)
    eval_path: str = ""  # held out: another file or directory of the same layout


@dataclass(frozen=True)
class RewardsConfig:
    """How rule rewards run (algorithms/scoring.py) and the options of the verifiers (algorithms/verifiers.py)."""

    workers: int = 4  # threads scoring one batch's answers at once
    on_error: OnRewardError = "zero"  # a reward that raises or is NaN: zero (reported, run goes on) or stop
    reference_field: str = "answer"  # math: the row's field holding the reference answer
    tests_field: str = "tests"  # code: the row's field holding the tests (a list of Python snippets)
    format_pattern: str = ""  # format: a regex the whole answer must match
    code_timeout_seconds: float = 5.0  # code: wall-clock limit of one test run
    code_memory_bytes: int = 512 * 2**20  # code: address-space limit of one test run
    # Time limits (docs/algorithms.md, "Time limits"): one call of the reward (an answer of a per-sample reward, the
    # batch of a batched one), and one batch's scoring from its start; either > 0 runs the reward in worker
    # processes killed at the limit (algorithms/timelimit.py); 0 and 0: no limit, on threads as before.
    timeout_seconds: float = 0.0
    batch_timeout_seconds: float = 0.0
    on_timeout: OnRewardTimeout = "score"  # score: such answers score timeout_score (one line, <mfc>/reward_timed_out); or stop
    timeout_score: float = 0.0


@dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn episodes with tool calls (algorithms/environments.py, runtime/step/multi_turn.py); name "" : off."""

    name: str = ""  # a registered environment (tool_use) or module:function; "": one answer per prompt
    tools: tuple[str, ...] = ()  # registered tools (algorithms/tools.py): calculator, python
    tool_format: ToolFormat = "plain"  # plain (<call> NAME ARGS </call>) or chat_template (<tool_call>{json}</tool_call>)
    max_turns: int = 4  # answers per episode
    max_episode_tokens: int = 256  # answer plus observation tokens of one episode (its prompt not counted)
    over_budget_reward: float = 0.0  # an episode cut at its budget or its last turn before it was done gets this
    tool_call_reward: float = 0.0  # tool_use: added once when a call ran
    failed_call_reward: float = 0.0  # tool_use: added per call that failed (unknown, malformed, raised, timed out)
    tool_timeout_seconds: float = 5.0  # sandbox wall-clock limit of one call
    tool_memory_bytes: int = 512 * 2**20  # sandbox address-space limit of one call
    tool_latency_seconds: float = 0.1  # the estimator's figure for one call (plan/)


@dataclass(frozen=True)
class DashboardsConfig:
    """Copies of the log's scalars for a dashboard (report/dashboards.py); log.h5 stays the source of truth."""

    tensorboard: bool = False  # event files under <trial>/tensorboard
    wandb: WandbMode = "off"  # off, offline (files under <trial>/wandb) or online
    wandb_project: str = "restage"


@dataclass(frozen=True)
class GenerationConfig:
    """How generate MFCs sample (``models.sampling.SamplingParams`` extends it with the run's own settings)."""

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: off)
    # The rollout engine's KV cache: as many slots (sequences decoding at once) as this budget holds, at most max_slots.
    kv_cache_gib: float = 0.0  # 0: 40% of the free memory on a GPU, 2 GiB on CPU
    max_slots: int = 64
    # paged: blocks of kv_block_tokens positions taken as answers grow, a group's prompt held once (rollout/paged_cache.py);
    # contiguous: one slot of the longest possible sequence per request; auto: paged where flash-attn's paged kernel
    # serves (CUDA, bf16/fp16, installed), contiguous elsewhere (a gather per layer and step would cost more).
    kv_cache: KvCacheLayout = "auto"
    kv_block_tokens: int = 0  # 0: 256 where flash-attn's paged kernel serves (CUDA, bf16/fp16), else 16
    # On CUDA, decode steps are captured as one CUDA graph per batch bucket and replayed (rollout/decode_graphs.py);
    # CPU and the layouts graphs do not cover (pp > 1, tp > 1 over gloo, mixtures of experts) decode eagerly whatever this
    # says; tp > 1 over NCCL captures its collectives.
    cuda_graphs: bool = True


@dataclass(frozen=True)
class ClusterRef:
    name: str = "local-cpu"  # cluster/<name>.yaml
    nodes: int = 1
    devices_per_node: int = 0  # 0: as the cluster file says


@dataclass(frozen=True)
class PlanConfig:
    mode: PlanMode = PlanMode.SEARCH
    heuristic: str = "colocated"  # baseline used when mode=heuristic
    layouts: dict[str, str] = field(default_factory=dict)  # manual: MFC name -> "ranks:0-3 dp2tp2pp1"
    time_budget_seconds: float = 60.0
    # sync: generate, then train, every step. async: generation runs ahead of training, and a token trained at
    # policy version v was generated by a version >= v - staleness (docs/algorithms.md, "Asynchronous training").
    # auto: the planner predicts both and runs the faster (docs/plan.md).
    execution: Execution = Execution.SYNC
    staleness: int = 1
    # async: the trained actor's weights reach the generation ranks after every push_every-th step (1 <= push_every
    # <= staleness); generation runs staleness - push_every + 1 steps ahead of training (docs/runtime.md).
    push_every: int = 1
    # async: partial rollouts. Generation of each buffered batch spans two steps: the answers still being written
    # when new weights land continue under them (prompt + answer so far prefilled again), every token recording
    # its own version; generation runs staleness - push_every steps ahead, so it needs staleness >= push_every + 1
    # (docs/runtime.md, "Partial rollouts").
    partial_rollouts: bool = False
    # off: frozen models held as models.<name>.shard_frozen says. auto: the search may also hold each frozen model
    # the runtime can shard 1/dp per rank of its home layout (ZeRO-3 / FSDP inference), when that plan is faster.
    shard_frozen: ShardFrozenChoice = "off"


@dataclass(frozen=True)
class RunConfig:
    steps: int = 10
    stop_at_step: int = 0  # > 0: checkpoint and stop once this step is done (resume later with --resume)
    batch_size: int = 8  # prompts (or pairs) per step
    micro_batches: int = 1
    save_every: int = 0  # 0: only at the end
    # Under SLURM: checkpoint and stop (the job is requeued and resumes) at the first step boundary with less than
    # this left before the time limit; 0: automatic, when the time left no longer covers the next step, its
    # checkpoint and a margin, from the measured step and save times (runtime/control/deadline.py)
    save_before_end_seconds: float = 0.0
    # > 0: after every eval_every-th step and the last, the actor answers every held-out prompt
    # (dataset.eval_fraction) greedily with the weights the step made, in sync and async mode alike, and the
    # run's reward scores it (runtime/step/evaluation.py); 0: off
    eval_every: int = 0
    keep_checkpoints: int = 2
    log_every: int = 1
    # NCCL's watchdog counts from when an op is queued, so every timeout must outlast a peer's long step
    # (a 70B train step can take many minutes). Start-up: rendezvous and the first set-up of every
    # communicator, while peers may still be importing or loading shards.
    startup_timeout_seconds: float = 3600.0
    # Data plane: one collective or P2P once its ranks take part (pipeline neighbours and DP replicas
    # still wait on each other's compute inside a step).
    collective_timeout_seconds: float = 1800.0
    # Before a reallocation its ranks wait for each other over the rendezvous store (no watchdog),
    # so a receiver does not queue an irecv while its senders are still generating or training.
    peer_wait_timeout_seconds: float = 7200.0
    # The watchdog warns (one line, once per activity) when a rank has spent longer than this in one activity of a
    # step (an MFC, a transfer) even when no peer waits on it: a reward that never returns; 0: off.
    activity_timeout_seconds: float = 1800.0
    # ranks of the job; 0: derived, cluster.nodes x devices per node (cluster.devices_per_node, else the cluster
    # file's). A value set here must equal that (launch/geometry.py refuses one that does not).
    nprocs: int = 0
    results_dir: str = "results"  # in a config file: beside it (config/paths.py)
    # NaN or inf in a train MFC's inputs: skip that MFC this step, or stop the run (runtime/step/nonfinite.py);
    # this many consecutive skipped steps of one MFC stop it too.
    nonfinite: OnNonfinite = "skip"
    max_skipped_steps: int = 3
    # torch CPU threads per rank; 0: automatic, from the rank's cores (OMP_NUM_THREADS if set; runtime/control/threads.py)
    threads_per_rank: int = 0


@dataclass(frozen=True)
class SlurmConfig:
    template: str = "generic"  # templates/<template>.sh
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_minutes: int = 0  # per attempt; 0: the partition's time limit (sinfo), else 24 h (launch/resources.py)
    mem_gb: int = 0  # 0: all of each node's memory (--mem=0) when exclusive, else the site's default
    exclusive: bool = True  # whole nodes: --exclusive, --mem=0, --cpus-per-task = the node's CPUs / ranks per node
    constraint: str = ""
    launcher: LauncherSetting = "auto"  # auto: srun where the site's srun offers PMIx, else mpirun; or srun, mpirun
    requeue: bool = True
    template_vars: dict[str, str] = field(default_factory=dict)
    cpus_per_task: int = 0  # cores per rank; 0: the node's CPUs in the allocation / ranks per node
    network_interface: str = ""  # e.g. ib0: pins Open MPI's TCP/OOB, NCCL and gloo to it ($RESTAGE_NETWORK_INTERFACE wins)
    signal_delay_seconds: int = 90  # the pre-timeout signal comes this long before the limit: time to checkpoint
    max_requeues: int = 3  # submitit requeues a timed-out job at most this many times
    program: str = ""  # the SPMD module each rank runs; "" = restage.runtime.spmd (env RESTAGE_PROGRAM wins)


@dataclass(frozen=True)
class ExperimentConfig:
    experiment: str
    algorithm: str
    models: dict[str, ModelSpec]
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    trial: str = "default"
    seed: int = 1
    algo: dict[str, Any] = field(default_factory=dict)
    reward_fn: str = ""  # "module:function" rule-based reward instead of a reward model
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    dashboards: DashboardsConfig = field(default_factory=DashboardsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cluster: ClusterRef = field(default_factory=ClusterRef)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run: RunConfig = field(default_factory=RunConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        if not is_algorithm_name(self.algorithm):
            raise ConfigError(f"algorithm: {self.algorithm!r} is unknown; use one of {', '.join(algorithm_names())}")
        if not self.models:
            raise ConfigError("models: at least one model is needed (e.g. models.actor.path)")
        _check_choices(self, "")
        for name, spec in self.models.items():
            if not spec.path and not spec.arch:
                raise ConfigError(f"models.{name}: give path (a HF model directory) or arch (a preset such as llama-7b)")
            if spec.router_aux_loss_coef is not None and not spec.router_aux_loss_coef >= 0:
                raise ConfigError(f"models.{name}.router_aux_loss_coef: {spec.router_aux_loss_coef} must be >= 0 "
                                  "(or left out for the checkpoint's config.json value)")
            if spec.shard_frozen and (spec.trainable or spec.offload_when_idle or spec.lora is not None):
                why = "trainable" if spec.trainable else "offload_when_idle" if spec.offload_when_idle else "lora"
                raise ConfigError(f"models.{name}.shard_frozen: a sharded frozen model runs only inference on its home "
                                  f"layout, but models.{name}.{why} is set; set models.{name}.shard_frozen false")
        self._resolve_auto_dtypes()
        if self.run.steps < 1 or self.run.batch_size < 1 or self.run.micro_batches < 1:
            raise ConfigError("run.steps, run.batch_size and run.micro_batches must be >= 1")
        self._check_values()
        if self.run.max_skipped_steps < 1:
            raise ConfigError(f"run.max_skipped_steps: {self.run.max_skipped_steps} must be >= 1")
        if self.plan.staleness < 1:
            raise ConfigError(f"plan.staleness: {self.plan.staleness} must be >= 1 (policy versions a trained token "
                              "may lag behind the weights being trained)")
        if not 1 <= self.plan.push_every <= self.plan.staleness:
            raise ConfigError(f"plan.push_every: {self.plan.push_every} must be between 1 and plan.staleness="
                              f"{self.plan.staleness} (weights older than the bound would generate)")
        if self.plan.partial_rollouts:
            _check_partial_rollouts(self.plan)

    def _check_values(self) -> None:
        """Values whose validity needs no rank: refused here, in one line, before anything starts."""
        for name, spec in self.models.items():
            optim = spec.optim
            if spec.trainable and not optim.lr > 0:
                raise ConfigError(f"models.{name}.optim.lr: {optim.lr} must be > 0")
            if optim.grad_clip < 0 or optim.weight_decay < 0 or optim.warmup_steps < 0:
                raise ConfigError(f"models.{name}.optim: grad_clip, weight_decay and warmup_steps must be >= 0")
            if spec.lora is not None:
                _check_lora(name, spec)
        gen, run = self.generation, self.run
        if gen.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens: {gen.max_new_tokens} must be >= 1")
        if not 0 <= gen.min_new_tokens <= gen.max_new_tokens:
            raise ConfigError(f"generation.min_new_tokens: {gen.min_new_tokens} must be in 0..max_new_tokens "
                              f"({gen.max_new_tokens})")
        if not gen.temperature > 0:
            raise ConfigError(f"generation.temperature: {gen.temperature} must be > 0 (for greedy decoding set "
                              "generation.greedy=true)")
        if gen.max_slots < 1 or gen.kv_cache_gib < 0:
            raise ConfigError(f"generation.max_slots ({gen.max_slots}) must be >= 1 and generation.kv_cache_gib "
                              f"({gen.kv_cache_gib}) >= 0 (0: sized from free memory)")
        if gen.kv_block_tokens < 0:
            raise ConfigError(f"generation.kv_block_tokens: {gen.kv_block_tokens} must be >= 0 (0: automatic)")
        if gen.top_k < 0 or not 0 < gen.top_p <= 1 or not 0 <= gen.min_p < 1:
            raise ConfigError("generation.top_k must be >= 0, generation.top_p in (0, 1] and generation.min_p in [0, 1)")
        if run.save_every < 0 or run.stop_at_step < 0 or run.log_every < 1:
            raise ConfigError("run.save_every and run.stop_at_step must be >= 0 (0: off), run.log_every >= 1")
        if run.save_before_end_seconds < 0:
            raise ConfigError(f"run.save_before_end_seconds: {run.save_before_end_seconds} must be >= 0 (0: automatic, "
                              "from the measured step and checkpoint times)")
        if run.nprocs < 0:
            raise ConfigError(f"run.nprocs: {run.nprocs} must be >= 0 (0: cluster.nodes x devices per node)")
        if run.threads_per_rank < 0:
            raise ConfigError(f"run.threads_per_rank: {run.threads_per_rank} must be >= 0 (0: from the rank's cores)")
        if run.eval_every < 0:
            raise ConfigError(f"run.eval_every: {run.eval_every} must be >= 0 (0: no evaluation)")
        held_out = self.dataset.eval_fraction > 0 or self.dataset.eval_split or self.dataset.eval_path
        if run.eval_every > 0 and not held_out:
            raise ConfigError(f"run.eval_every: {run.eval_every} evaluates held-out prompts, but dataset.eval_fraction "
                              "is 0; hold some out (e.g. dataset.eval_fraction=0.02, or dataset.eval_split / "
                              "dataset.eval_path) or set run.eval_every=0")
        if run.eval_every > 0 and self.dataset.kind is not DatasetKind.PROMPT:
            raise ConfigError(f"run.eval_every: evaluation generates answers to held-out prompts, but dataset.kind is "
                              f"{self.dataset.kind.value!r} ({self.algorithm} does not generate); set run.eval_every=0")
        _check_user_data(self)
        if run.keep_checkpoints < 1:
            raise ConfigError(f"run.keep_checkpoints: {run.keep_checkpoints} must be >= 1 (the newest is always kept)")
        if run.micro_batches > run.batch_size:
            raise ConfigError(f"run.micro_batches: {run.micro_batches} is more than run.batch_size "
                              f"({run.batch_size}); use at most one micro-batch per prompt")

    def _resolve_auto_dtypes(self) -> None:
        """``dtype: auto`` becomes bf16 where the cluster's devices are GPUs (flash-attn, tensor cores) and fp32 on CPUs."""
        auto = [name for name, spec in self.models.items() if spec.dtype == AUTO_DTYPE]
        if not auto:
            return
        cluster = load_cluster(self.cluster.name, self.cluster.nodes, self.cluster.devices_per_node or None)
        dtype: Dtype = "bf16" if cluster.has_gpus else "fp32"
        for name in auto:  # the mapping is this config's own (built by ``build``), frozen specs inside it
            self.models[name] = dataclasses.replace(self.models[name], dtype=dtype)

    @property
    def trial_dir(self) -> Path:
        return Path(self.run.results_dir) / self.experiment / self.trial

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_lora(name: str, spec: ModelSpec) -> None:
    lora, key = spec.lora, f"models.{name}.lora"
    assert lora is not None  # called for a model with a lora section
    if not spec.trainable:
        raise ConfigError(f"{key}: adapters are trained, but models.{name} is not trainable; set "
                          f"models.{name}.trainable=true or remove {key}")
    if lora.rank < 1:
        raise ConfigError(f"{key}.rank: {lora.rank} must be >= 1")
    if not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha: {lora.alpha} must be > 0")
    unknown = [t for t in lora.target_modules if t not in LORA_MODULES and t not in LORA_HF_NAMES]
    if LORA_ALL_LINEAR in lora.target_modules:
        unknown = [] if len(lora.target_modules) == 1 else [t for t in lora.target_modules if t != LORA_ALL_LINEAR]
    if unknown or not lora.target_modules:
        raise ConfigError(f"{key}.target_modules: {unknown or 'an empty list'} is not a list of "
                          f"{', '.join(LORA_MODULES)} (or their HF names {', '.join(LORA_HF_NAMES)}), or "
                          f"[{LORA_ALL_LINEAR}] alone")
    if lora.dropout != 0:
        raise ConfigError(f"{key}.dropout: {lora.dropout}; LoRA dropout is not implemented, set it to 0")


def _check_user_data(cfg: ExperimentConfig) -> None:
    """The dataset's held-out choice, the rewards' and the dashboards' options."""
    ds, rewards = cfg.dataset, cfg.rewards
    if sum(bool(x) for x in (ds.eval_fraction, ds.eval_split, ds.eval_path)) > 1:
        raise ConfigError("dataset: hold out by one of eval_fraction, eval_split or eval_path, not several")
    if rewards.workers < 1:
        raise ConfigError(f"rewards.workers: {rewards.workers} must be >= 1")
    if not rewards.code_timeout_seconds > 0 or rewards.code_memory_bytes < 2**20:
        raise ConfigError("rewards.code_timeout_seconds must be > 0 and rewards.code_memory_bytes >= 1 MiB")
    if not (rewards.timeout_seconds >= 0 and rewards.batch_timeout_seconds >= 0):
        raise ConfigError("rewards.timeout_seconds and rewards.batch_timeout_seconds must be >= 0 (0: no limit)")
    if not float("-inf") < rewards.timeout_score < float("inf"):
        raise ConfigError(f"rewards.timeout_score: {rewards.timeout_score} must be a finite number")


def _check_choices(section: Any, key: str) -> None:
    """Refuse a closed choice's value that is not one of its allowed ones, for a config built in code as well as one
    read from a file; an enum's plain name becomes its member. Sections are frozen: set in place while being built."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        where, value = f"{key}.{f.name}" if key else f.name, getattr(section, f.name)
        if allowed_values(hints[f.name]) is not None:
            object.__setattr__(section, f.name, check_choice(value, hints[f.name], where))
        elif dataclasses.is_dataclass(value):
            _check_choices(value, where)
        elif isinstance(value, dict):
            for name, item in value.items():
                if dataclasses.is_dataclass(item):
                    _check_choices(item, f"{where}.{name}")


def _check_partial_rollouts(plan: PlanConfig) -> None:
    """Partial rollouts continue answers across weight pushes: asynchronous training, with room for two versions."""
    match plan.execution:
        case Execution.SYNC:
            raise ConfigError("plan.partial_rollouts: partial rollouts continue answers across weight pushes, which "
                              "only asynchronous training has; set plan.execution=async (or auto) or drop it")
        case Execution.ASYNC if plan.staleness < plan.push_every + 1:
            raise ConfigError(f"plan.partial_rollouts: needs plan.staleness >= plan.push_every + 1 (an answer spans "
                              f"two steps' weights), got staleness={plan.staleness} push_every="
                              f"{plan.push_every}; set plan.staleness={plan.push_every + 1} or "
                              "plan.partial_rollouts=false")
        case Execution.ASYNC | Execution.AUTO:
            pass
        case unknown:
            typing.assert_never(unknown)


def _to_plain(value):
    if isinstance(value, Enum):
        return value.value  # the plain name, as the config file has it
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value
