"""The sections of an experiment config, one frozen dataclass each (``schema.ExperimentConfig`` holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from restage.algorithms.tools import ToolFormat
from restage.config.choices import (
    DatasetKind,
    DtypeSetting,
    Execution,
    KvCacheLayout,
    LauncherSetting,
    OnNonfinite,
    OnRewardError,
    OnRewardTimeout,
    PlanMode,
    ShardFrozenChoice,
    WandbMode,
    ZeroStage,
)
from restage.config.optim import OptimConfig

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
    """How generate MFCs sample (``rollout.sampling.SamplingParams`` extends it with the run's own settings)."""

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
