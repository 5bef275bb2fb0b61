"""What a plan is chosen over: the graph, the models' roles, the cluster, and each MFC's candidate layouts.

A *candidate* is one way to run one MFC: a layout (mesh + strategy), a micro-batch count and the
estimate for them. Meshes are contiguous rank ranges aligned to their size: inside a node every
power-of-two size up to the node, across nodes power-of-two node counts aligned to node
boundaries, and the whole cluster. Strategies are every (dp, tp, pp) with TP inside a node that the
runtime takes (``models.sharding.layout_problem``, the rule it checks a schedule with at
start-up). Candidates that do not fit in a device's memory on their own are dropped, and for each
mesh size only the fastest few (plus the leanest) survive.

A *plan* is one candidate per MFC, in graph order. Each model has a *home* MFC whose layout
holds its persistent state: the train step of a trained model, else its first MFC. Its other
MFCs run on a reallocated copy when their layout differs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property

from restage.cluster import ClusterSpec
from restage.config.schema import ExperimentConfig
from restage.config.sections import LORA_ALL_LINEAR, LoraSpec, ModelSpec
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout, Strategy
from restage.models.arch import LoraConfig, ModelConfig
from restage.models.sharding import layout_problem
from restage.plan.estimator import Estimate, Estimator
from restage.plan.generation_cost import RestageEngine
from restage.plan.layout_cost import dp_size_ok, sequences_per_rank
from restage.plan.roles import ModelRole
from restage.plan.transfer_cost import ReallocCost, data_transfer_seconds, exact_realloc, fast_realloc
from restage.schedule.model_entry import CRITIC_NAMES
from restage.schedule.program import check_ema_architectures

KEEP_PER_SIZE = 6  # fastest (strategy, micro-batches) options kept per mesh size and MFC
MAX_MICRO_BATCH_DOUBLINGS = 5


@dataclass(frozen=True)
class Candidate:
    """One way to run one MFC."""

    mfc: str
    layout: Layout
    estimate: Estimate

    @property
    def micro_batches(self) -> int:
        return self.estimate.micro_batches

    @property
    def seconds(self) -> float:
        return self.estimate.seconds

    @property
    def start(self) -> int:
        return self.layout.mesh[0]

    @property
    def stop(self) -> int:
        return self.layout.mesh[-1] + 1

    def __str__(self) -> str:
        return f"{self.layout} mb{self.micro_batches}"


Plan = tuple[Candidate, ...]


def roles_from_config(cfg: ExperimentConfig, graph: DataflowGraph | None = None) -> dict[str, ModelRole]:
    """ModelRoles of a config's models (with ``graph``: those its MFCs run on): architecture from ``arch`` (a
    preset) or the checkpoint's config.json."""
    from restage.models.presets import preset

    trained = set(graph.trained_models()) if graph is not None else set()
    roles = {}
    for name, spec in cfg.models.items():
        if graph is not None and name not in graph.models():
            continue  # e.g. models.ref beside algo.kl_coef=0: nothing to plan (interface.unused_models)
        if spec.arch:
            # A preset has no head of its own: critic and reward models get the scalar head.
            arch = preset(spec.arch, critic=name in CRITIC_NAMES or spec.init_critic_from_lm)
        else:
            arch = ModelConfig.from_pretrained(spec.path)
            if spec.init_critic_from_lm:
                arch = arch.as_critic()
        if spec.lora is not None:
            arch = with_lora(name, arch, spec.lora)
        roles[name] = ModelRole(name=name, arch=arch, trainable=spec.trainable or name in trained, preset=spec.arch,
                                **{f: getattr(spec, f) for f in _SPEC_FIELDS})
    return roles


# The settings a ModelRole takes from models.<name> as they are (dtype, ZeRO, offload, shard_frozen, path): derived,
# so a setting added to both is carried without another line here.
_SPEC_FIELDS = tuple(sorted(({f.name for f in fields(ModelRole)} & {f.name for f in fields(ModelSpec)})
                            - {"name", "arch", "trainable", "preset"}))


def with_lora(name: str, arch: ModelConfig, spec: LoraSpec) -> ModelConfig:
    """``arch`` with the adapters of ``models.<name>.lora``; GPT-2 is refused in one line."""
    if arch.family == "gpt2":
        raise ConfigError(f"models.{name}.lora: LoRA supports the LLaMA family (llama, mistral, qwen2), not GPT-2; "
                          f"remove models.{name}.lora")
    targets = spec.canonical_targets()
    if arch.is_moe and LORA_ALL_LINEAR in spec.target_modules:  # the default: every linear that takes adapters
        targets = tuple(t for t in targets if t not in ("gate", "up", "down"))
    mlp = sorted(set(targets) & {"gate", "up", "down"})
    if arch.is_moe and mlp:
        raise ConfigError(f"models.{name}.lora: a mixture of experts takes no adapters on its MLP ({', '.join(mlp)}) "
                          f"yet; target attention only (q, k, v, o)")
    return replace(arch, lora=LoraConfig(spec.rank, spec.alpha, targets, spec.dropout))


def mesh_options(cluster: ClusterSpec) -> list[tuple[int, int]]:
    """(first rank, size) of every candidate mesh."""
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    sizes, size = [], 1
    while size < per_node:
        sizes.append(size)
        size *= 2
    sizes.append(per_node)
    out = [(node * per_node + offset, size) for size in sizes for node in range(nodes)
           for offset in range(0, per_node - size + 1, size)]
    count = 2
    while count < nodes:
        out += [(start * per_node, count * per_node) for start in range(0, nodes - count + 1, count)]
        count *= 2
    if nodes > 1:
        out.append((0, nodes * per_node))
    return sorted(set(out), key=lambda x: (x[1], x[0]))


def strategies_for(size: int, role: ModelRole, mfc: MFC, cluster: ClusterSpec) -> list[Strategy]:
    """Every (dp, tp, pp) over ``size`` ranks the runtime takes for this MFC (``runtime_refuses``), TP at most one
    node wide, and every DP rank given at least one sequence; for a mixture-of-experts model also every ep that
    divides dp and the experts."""
    out = []
    experts = role.arch.num_experts if role.arch.is_moe else 0
    for tp in _divisors(size):
        if tp > cluster.devices_per_node:
            continue
        for pp in _divisors(size // tp):
            dp = size // (tp * pp)
            for ep in [e for e in _divisors(dp) if experts % e == 0] if experts else [1]:
                strategy = Strategy(dp=dp, tp=tp, pp=pp, ep=ep)
                if dp_size_ok(mfc, strategy.dp) and not runtime_refuses(role, mfc, strategy, cluster):
                    out.append(strategy)
    return out


def runtime_refuses(role: ModelRole, mfc: MFC, strategy: Strategy, cluster: ClusterSpec) -> str | None:
    """Why the runtime would refuse to run ``mfc`` in a layout with this strategy (``models.sharding.layout_problem``,
    its start-up rule; a train step trains the model there), or None."""
    return layout_problem(role.name, role.arch, strategy, cluster.world_size, trained=mfc.kind is MFCKind.TRAIN_STEP,
                          zero_stage=role.zero_stage)


def untrainable(problem: PlanProblem, plan: Plan) -> str | None:
    """Why the runtime would refuse one of ``plan``'s layouts (a peer's plan models another system, which may
    train where restage cannot), or None."""
    for cand in plan:
        mfc = problem.graph[cand.mfc]
        reason = runtime_refuses(problem.role(mfc), mfc, cand.layout.strategy, problem.cluster)
        if reason:
            return f"{mfc.name}: {reason}"
    return None


def micro_batch_options(mfc: MFC, strategy: Strategy) -> list[int]:
    if mfc.kind is MFCKind.GENERATE:
        return [1]  # the runtime generates each DP rank's prompts as one batch
    base = max(mfc.micro_batches, strategy.pp)
    most = max(int(sequences_per_rank(mfc, strategy.dp)), 1)
    out: list[int] = []
    m = base
    for _ in range(MAX_MICRO_BATCH_DOUBLINGS + 1):
        if m > most and out:
            break
        out.append(m)
        m *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class AsyncExecution:
    """``plan.execution: async``: the staleness bound, the weight-push interval and the run's steps (over which the
    warm-up is spread)."""

    staleness: int
    push_every: int
    steps: int
    partial: bool = False  # plan.partial_rollouts


class PlanProblem:
    """The graph, roles and cluster of one planning run, with cached candidates and costs."""

    # restage's runtime generates in place on a ZeRO-3 layout in lockstep when the gathered stage does not fit
    # (``simulator.zero3_generation_mode``); the peers' engines always generate from a copy of their own.
    zero3_lockstep = True

    def __init__(self, graph: DataflowGraph, roles: dict[str, ModelRole], cluster: ClusterSpec,
                 estimator: Estimator | None = None, samples_per_iteration: int | None = None,
                 overlap_iterations: bool = False, exact_realloc: bool = False, keep_per_size: int = KEEP_PER_SIZE,
                 execution: AsyncExecution | None = None):
        missing = sorted({m.model for m in graph} - set(roles))
        if missing:
            raise ConfigError(f"the graph needs models {missing}; add them under models:")
        check_ema_architectures(graph, {name: role.arch for name, role in roles.items()})
        self.graph, self.roles, self.cluster = graph, roles, cluster
        self.estimator = estimator or Estimator(cluster)
        self.mfcs: tuple[MFC, ...] = graph.mfcs
        self.index = {m.name: i for i, m in enumerate(self.mfcs)}
        self.samples_per_iteration = samples_per_iteration or _default_samples(graph)
        self.overlap_iterations = overlap_iterations  # see simulator.steady_state
        self.execution = execution  # None: synchronous; else async mode's program (simulator.plan_program)
        self.exact_realloc = exact_realloc  # reallocation bytes from the runtime's planner (slow) or fast arithmetic
        self.keep_per_size = keep_per_size
        self._candidates: dict[str, tuple[Candidate, ...]] = {}
        self._shapes: dict[str, dict[tuple[int, Strategy], int]] = {}
        self._realloc: dict[tuple[str, Layout, Layout, bool], ReallocCost] = {}
        self._transfer: dict[tuple[Layout, Layout, int], float] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.cluster.usable_memory_bytes

    def role(self, mfc: MFC | str) -> ModelRole:
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        return self.roles[mfc.model]

    @cached_property
    def home(self) -> dict[str, str]:
        """Model -> the MFC whose layout holds the model's persistent state."""
        out = {}
        for mfc in self.mfcs:
            if mfc.kind is MFCKind.TRAIN_STEP:
                out[mfc.model] = mfc.name
        for mfc in self.mfcs:
            out.setdefault(mfc.model, mfc.name)
        return out

    def is_home(self, mfc: MFC) -> bool:
        return self.home[mfc.model] == mfc.name

    def candidate(self, mfc: MFC | str, layout: Layout, micro_batches: int | None = None) -> Candidate:
        """The candidate for exactly this layout (estimated on demand; need not be in ``candidates``)."""
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        return Candidate(mfc.name, layout, self.estimator.estimate(mfc, self.role(mfc), layout, micro_batches))

    def in_place_seconds(self, cand: Candidate) -> float:
        """Seconds of ``cand`` run on its ZeRO-3 model's partitioned training layout (``simulator.zero3_in_place``):
        restage's rollout engine decodes eagerly over partitions (``choose_decode_mode``'s ``partitioned``)."""
        mfc, engine = self.graph[cand.mfc], self.estimator.engine
        if mfc.kind is not MFCKind.GENERATE or not isinstance(engine, RestageEngine):
            return cand.seconds
        return self.estimator.estimate(mfc, self.role(mfc), cand.layout, cand.micro_batches,
                                       engine=replace(engine, partitioned=True)).seconds

    def alone_bytes(self, cand: Candidate) -> int:
        """Peak bytes per rank of this candidate with nothing else on its ranks (its home state, or its copy)."""
        est = cand.estimate
        held = est.state_bytes if self.home[self.graph[cand.mfc].model] == cand.mfc else est.param_bytes
        return held + est.transient_bytes

    def fits_alone(self, cand: Candidate) -> bool:
        return self.alone_bytes(cand) <= self.capacity_bytes

    def options(self, mfc: MFC | str, layout: Layout) -> list[Candidate]:
        """Candidates of every micro-batch count for one layout, fastest first."""
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        return sorted((self.candidate(mfc, layout, m) for m in micro_batch_options(mfc, layout.strategy)),
                      key=lambda c: c.seconds)

    def candidates(self, mfc: MFC | str) -> tuple[Candidate, ...]:
        """The MFC's candidates: on every mesh, the strategies it runs fastest (plus its leanest) for that
        mesh size, and those its model's other MFCs keep (sharing a layout saves a reallocation)."""
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        if mfc.name not in self._candidates:
            shapes: dict[tuple[int, Strategy], int | None] = dict(self._kept_shapes(mfc))
            for other in self.mfcs:
                if other.model == mfc.model and other.name != mfc.name:
                    for size, strategy in self._kept_shapes(other):
                        shapes.setdefault((size, strategy), None)
            meshes = mesh_options(self.cluster)
            out = []
            for (size, strategy), m in shapes.items():
                if strategy not in strategies_for(size, self.role(mfc), mfc, self.cluster):
                    continue
                for start in (start for start, s in meshes if s == size):
                    layout = Layout.contiguous(start, strategy)
                    cand = self.candidate(mfc, layout, m) if m else next(
                        (c for c in self.options(mfc, layout) if self.fits_alone(c)), None)
                    if cand is not None:
                        out.append(cand)
            self._candidates[mfc.name] = tuple(sorted(out, key=lambda c: (c.layout.size, c.start, c.seconds)))
        return self._candidates[mfc.name]

    def _kept_shapes(self, mfc: MFC) -> dict[tuple[int, Strategy], int]:
        """{(mesh size, strategy): micro-batches} this MFC keeps: per size, the fastest few and the leanest."""
        if mfc.name in self._shapes:
            return self._shapes[mfc.name]
        role = self.role(mfc)
        kept: dict[tuple[int, Strategy], int] = {}
        meshes = mesh_options(self.cluster)
        for size in sorted({size for _, size in meshes}):
            start = next(start for start, s in meshes if s == size)
            options = [c for strategy in strategies_for(size, role, mfc, self.cluster)
                       for c in self.options(mfc, Layout.contiguous(start, strategy)) if self.fits_alone(c)]
            options.sort(key=lambda c: c.seconds)
            chosen = options[:self.keep_per_size]
            if options:
                chosen.append(min(options, key=lambda c: (self.alone_bytes(c), c.seconds)))
            for c in chosen:
                kept.setdefault((size, c.layout.strategy), c.micro_batches)
        self._shapes[mfc.name] = kept
        return kept

    def realloc(self, model: str, src: Layout, dst: Layout) -> ReallocCost:
        """Cost of copying ``model``'s parameters from layout ``src`` to ``dst``."""
        key = (model, src, dst, self.exact_realloc)
        if key not in self._realloc:
            role = self.roles[model]
            cost = exact_realloc if self.exact_realloc else fast_realloc
            # A LoRA model's copies keep the frozen base (schedule/program.py): in the steady state only adapters move.
            self._realloc[key] = cost(role.arch, src, dst, role.bytes_per_element, self.cluster,
                                      adapters_only=role.arch.lora is not None)
        return self._realloc[key]

    def data_transfer(self, src: Layout, dst: Layout, nbytes: int) -> float:
        """Seconds to move ``nbytes`` of MFC outputs from layout ``src`` to layout ``dst``."""
        key = (src, dst, nbytes)
        if key not in self._transfer:
            self._transfer[key] = data_transfer_seconds(src, dst, nbytes, self.cluster)
        return self._transfer[key]

    def iteration_flops(self) -> float:
        from restage.plan.mfc_flops import mfc_flops

        return sum(mfc_flops(m, self.role(m).arch) for m in self.mfcs)


def _default_samples(graph: DataflowGraph) -> int:
    """Sequences per iteration: the largest generation batch, else the largest training batch."""
    gen: list[int] = [m.n_seqs for m in graph if m.kind is MFCKind.GENERATE]
    if gen:
        return max(gen)
    every: list[int] = [m.n_seqs for m in graph]
    return max(every)
