"""The plans peer RLHF systems produce by their documented defaults: the baselines restage must beat.

Each rule builds layouts from the cluster and the models alone; restage's estimator only scores the
result, picks micro-batch counts, and raises a knob the peer's documentation says to raise until the
model fits (a TP degree, a memory saver). Sources (docs/plan.md cites them in full):

* ``deepspeed_chat`` (DeepSpeedExamples, applications/DeepSpeed-Chat, step3 ``rlhf_engine.py`` and
  ``training_scripts/llama2/run_llama2_7b.sh``): all four models on every GPU; actor and critic
  trained data-parallel with ZeRO-3 (the LLaMA-2 scripts' stage), reference and reward ZeRO-3 too
  (``_init_ref`` / ``_init_reward`` follow the actor's / critic's stage 3); generation in the Hybrid
  Engine with ``--inference_tp_size`` (default 1) on a copy of the actor gathered per ``generate`` call,
  ``--per_device_generation_batch_size`` (default 16) prompts a call (``peer_engines.HybridEngine``); the
  reference model offloaded to the host (``--offload_reference_model``).
* ``openrlhf`` (OpenRLHF ``openrlhf/cli/train_ppo_ray.py``): the fastest of ``--colocate_all_models``
  (the hybrid engine: everything on all GPUs), ``--colocate_actor_ref --colocate_critic_reward`` groups
  1 : 1 : 1 with the vLLM engines, and ``examples/scripts/train_ppo_llama_ray_70b.sh``'s groups actor 4 :
  critic 4 : vLLM 4 : reference 2 : reward 2; DeepSpeed ZeRO-3 (``--zero_stage 3``) for every model;
  vLLM engines of ``--vllm_tensor_parallel_size`` (from 1) GPUs each, fed the actor's weights.
* ``nemo_aligner`` (NeMo-Aligner ``docs/user-guide/rlhf.rst``, ``Accelerated-RLHF.md``): two jobs, the
  actor with the initial policy and the critic with the reward model, the critic job sized by its share
  of the trained parameters; each job one Megatron (TP, PP), the smallest that fits, TP inside a node
  first; generation by TensorRT-LLM resharded from PP to TP (``trainer.ppo.trt_llm.reshard``);
  Megatron's distributed optimizer (ZeRO-1); the frozen model of a job offloaded to the host.
* ``verl`` (verl ``ppo_trainer.yaml`` and its performance-tuning guide): every model colocated on all
  GPUs, FSDP (ZeRO-3) for every model, rollout on a resharded copy with
  ``rollout.tensor_model_parallel_size`` (default 2), raised until
  ``memory_per_gpu x gpu_memory_utilization (0.5) x TP > 2 x parameters`` and the plan fits.

The models' memory settings are the peer's (ZeRO stage, host offload of frozen models, gradient
checkpointing, optimizer offload); the savers are turned on one after the other only when the plan
does not fit without them, which can only make a baseline faster. What the peers' engines do and
restage's runtime does not (frozen models sharded ZeRO-3 / FSDP style, batched generation, the
old-log-prob pass) is modelled in ``peer_engines.py`` for the peers only.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, assert_never, get_args

from restage.graph import MFC, MFCKind
from restage.layout import Layout, Strategy
from restage.plan.generation_cost import VllmEngine
from restage.plan.layout_cost import dp_size_ok
from restage.plan.model_state import stage_param_elements
from restage.plan.peers.peer_engines import HybridEngine, PeerEngine, PeerProblem
from restage.plan.plan_score import PlanEvaluation, fit_plan
from restage.plan.problem import Plan, PlanProblem
from restage.plan.roles import ModelRole

Found = tuple[Plan, PlanEvaluation]
RoleChange = Callable[[ModelRole], ModelRole]
# A peer's rule: per problem (one memory level), the layouts it would try, in order; None: a choice that does not apply.
LayoutOptions = Callable[[PlanProblem], Iterable[dict[str, Layout] | None]]
PEERS = ("deepspeed_chat", "openrlhf", "nemo_aligner", "verl")
# The memory savers a peer turns on one after another until its plan fits (``_ladder``), in that order.
Saver = Literal["offload_frozen", "gradient_checkpointing", "offload_optimizer"]
SAVERS: tuple[Saver, ...] = get_args(Saver)
# OpenRLHF's 70B example: GPUs per group for the actor, critic, vLLM engines, reference, reward.
OPENRLHF_WEIGHTS = {"trained": 4, "generate": 4, "frozen": 2}
VERL_GPU_MEMORY_UTILIZATION = 0.5
# OpenRLHF's hybrid-engine example (``--colocate_all_models --vllm_enable_sleep --vllm_gpu_memory_utilization 0.6``);
# its separate vLLM engines keep vLLM's own default (0.9, ``VllmEngine``).
OPENRLHF_COLOCATED_ENGINE = VllmEngine(gpu_memory_utilization=0.6)


def derived(problem: PlanProblem, change: RoleChange, engine: PeerEngine = HybridEngine()) -> PlanProblem:
    """The same problem with every model's role changed (a peer's memory strategy), scored as the peers' engines
    run it (``peer_engines.PeerProblem``, generating on ``engine``); the estimator's caches are shared."""
    roles = {name: change(role) for name, role in problem.roles.items()}
    return PeerProblem(problem.graph, roles, problem.cluster, estimator=problem.estimator,
                       samples_per_iteration=problem.samples_per_iteration, overlap_iterations=problem.overlap_iterations,
                       exact_realloc=problem.exact_realloc, keep_per_size=problem.keep_per_size, engine=engine)


def _with_stage(stage: int, shard_frozen: bool = False) -> RoleChange:
    """Trained models at ZeRO ``stage``; with ``shard_frozen`` the frozen ones partitioned ZeRO-3 / FSDP style."""
    def change(role: ModelRole) -> ModelRole:
        if role.trainable:
            return dataclasses.replace(role, zero_stage=stage)
        return dataclasses.replace(role, shard_frozen=shard_frozen, prefetch_gathers=shard_frozen)
    return change


def _ladder(base: RoleChange, savers: tuple[Saver, ...] = SAVERS) -> list[RoleChange]:
    """``base``, then ``base`` with the first k memory savers on, k = 1, 2, ..."""
    def level(k: int) -> RoleChange:
        def change(role: ModelRole) -> ModelRole:
            role = base(role)
            for saver in savers[:k]:
                role = _saved(role, saver)
            return role
        return change
    return [level(k) for k in range(len(savers) + 1)]


def _saved(role: ModelRole, saver: Saver) -> ModelRole:
    """``role`` with ``saver`` on: offloading applies to frozen models, the other savers to trained ones."""
    match saver:
        case "offload_frozen":
            return role if role.trainable else dataclasses.replace(role, offload_when_idle=True)
        case "gradient_checkpointing":
            return dataclasses.replace(role, gradient_checkpointing=True) if role.trainable else role
        case "offload_optimizer":
            return dataclasses.replace(role, offload_optimizer=True) if role.trainable else role
        case _:
            assert_never(saver)


def _tp_degrees(start: int, size: int, role: ModelRole, devices_per_node: int) -> list[int]:
    """Powers of two from ``start`` up to the mesh (and one node) that the model's heads admit."""
    cfg, out, tp = role.arch, [], 1
    while tp <= min(size, devices_per_node):
        if tp >= start and size % tp == 0 and cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def _dp_ok(problem: PlanProblem, layouts: dict[str, Layout]) -> bool:
    return all(dp_size_ok(m, layouts[m.name].strategy.dp) for m in problem.mfcs)


def _first_fit(problem: PlanProblem, levels: list[RoleChange], options: LayoutOptions,
               engine: PeerEngine) -> Found | None:
    """The first (memory level, layouts) in order that fits; ``options(p)`` yields layouts per level."""
    for change in levels:
        p = derived(problem, change, engine)
        for layouts in options(p):
            if layouts is None or not _dp_ok(p, layouts):
                continue
            got = fit_plan(p, layouts)
            if got is not None:
                return got
    return None


def _colocated_rule(problem: PlanProblem, first_tp: Callable[[ModelRole], int],
                    engine: PeerEngine) -> Found | None:
    """Every MFC on all devices data-parallel; generation on a copy with TP from ``first_tp`` upward."""
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node

    def options(p: PlanProblem) -> Iterator[dict[str, Layout]]:
        gens = [m for m in p.mfcs if m.kind is MFCKind.GENERATE]
        tps = _tp_degrees(max(first_tp(p.role(gens[0])), 1), world, p.role(gens[0]), per_node) if gens else [1]
        for tp in tps:
            yield {m.name: Layout.contiguous(0, Strategy(dp=world // tp, tp=tp) if m.kind is MFCKind.GENERATE
                                             else Strategy(dp=world)) for m in p.mfcs}

    return _first_fit(problem, _ladder(_with_stage(3, shard_frozen=True)), options, engine)


def deepspeed_chat(problem: PlanProblem, engine: HybridEngine = HybridEngine()) -> Found | None:
    return _colocated_rule(problem, lambda role: 1, engine)  # its Hybrid Engine decodes eagerly, a batch at a time


def verl(problem: PlanProblem) -> Found | None:
    memory = problem.cluster.memory_bytes * VERL_GPU_MEMORY_UTILIZATION

    def first_tp(role: ModelRole) -> int:
        params = sum(_stage_params(role)) * role.bytes_per_element
        tp = 2
        while memory * tp <= params:  # verl's rule: memory x utilisation x TP > 2 x parameters (bytes in 16 bits)
            tp *= 2
        return tp

    return _colocated_rule(problem, first_tp, VllmEngine(gpu_memory_utilization=VERL_GPU_MEMORY_UTILIZATION))


def _stage_params(role: ModelRole) -> tuple[int, ...]:
    return stage_param_elements(role.arch, 1, 1)


GENERATE = "<generate>"  # the generation engines' group in a peer's GPU groups
Groups = list[tuple[tuple[str, ...], int]]  # (models sharing the GPUs, or GENERATE; weight), in rank order


def openrlhf_groups(problem: PlanProblem, colocate_pairs: bool) -> Groups:
    """OpenRLHF's GPU groups: the 70B script's actor 4 : critic 4 : vLLM 4 : reference 2 : reward 2, or with
    ``--colocate_actor_ref --colocate_critic_reward`` each trained model sharing its group with the frozen model
    of the same head (LM or scalar), in the 1 : 1 : 1 (actor : critic : vLLM) its hybrid-engine docs advise."""
    trained = [n for n in problem.graph.models() if problem.roles[n].trainable]
    frozen = [n for n in problem.graph.models() if not problem.roles[n].trainable]
    generates = any(m.kind is MFCKind.GENERATE for m in problem.mfcs)
    groups: Groups = []
    if not colocate_pairs:
        groups += [((n,), OPENRLHF_WEIGHTS["trained"]) for n in trained]
        groups += [((GENERATE,), OPENRLHF_WEIGHTS["generate"])] if generates else []
        return groups + [((n,), OPENRLHF_WEIGHTS["frozen"]) for n in frozen]
    for n in trained:
        partners = [f for f in frozen if problem.roles[f].arch.is_critic == problem.roles[n].arch.is_critic]
        pick = partners[:1]
        frozen = [f for f in frozen if f not in pick]
        groups.append(((n, *pick), 1))
    return groups + ([((GENERATE,), 1)] if generates else []) + [((f,), 1) for f in frozen]


def _grouped_rule(problem: PlanProblem, groups: Groups, engine: VllmEngine) -> Found | None:
    """Each group data-parallel on its own GPUs (ZeRO-3, frozen models sharded); generation on vLLM engines of
    ``--vllm_tensor_parallel_size`` from 1 upward, inside a node."""
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node
    sizes = _proportional(world, [w for _, w in groups])
    if sizes is None:
        return None
    where: dict[str, tuple[int, int]] = {}  # a group member (or GENERATE) -> (first rank, ranks)
    first = 0
    for (members, _), size in zip(groups, sizes):
        where.update({member: (first, size) for member in members})
        first += size

    def options(p: PlanProblem) -> Iterator[dict[str, Layout]]:
        gen = next((m for m in p.mfcs if m.kind is MFCKind.GENERATE), None)
        g0, gsize = where.get(GENERATE, (0, 1))
        for tp in _tp_degrees(1, gsize, p.role(gen), per_node) if gen is not None else [1]:
            if gen is not None and g0 // per_node != (g0 + tp - 1) // per_node:
                continue  # an engine's TP group must stay inside a node
            yield {m.name: Layout.contiguous(g0, Strategy(dp=gsize // tp, tp=tp)) if m.kind is MFCKind.GENERATE
                   else Layout.contiguous(where[m.model][0], Strategy(dp=where[m.model][1])) for m in p.mfcs}

    return _first_fit(problem, _ladder(_with_stage(3, shard_frozen=True)), options, engine)


def openrlhf_arrangements(problem: PlanProblem) -> dict[str, Found | None]:
    """OpenRLHF's three documented arrangements: ``--colocate_all_models`` (the hybrid engine: every model and
    the vLLM engines on all GPUs, vLLM asleep while training), the paired groups, the 70B script's groups."""
    return {"colocate_all_models": _colocated_rule(problem, lambda role: 1, OPENRLHF_COLOCATED_ENGINE),
            "colocate_actor_ref+critic_reward": _grouped_rule(problem, openrlhf_groups(problem, True), VllmEngine()),
            "separate": _grouped_rule(problem, openrlhf_groups(problem, False), VllmEngine())}


def openrlhf(problem: PlanProblem) -> Found | None:
    """The fastest of OpenRLHF's arrangements that fits (a user picks one by flags; we grant the best)."""
    return _fastest(openrlhf_arrangements(problem).values())


def _fastest(found: Iterable[Found | None]) -> Found | None:
    fitting = [f for f in found if f is not None]
    return min(fitting, key=lambda f: f[1].iteration_seconds) if fitting else None


def _proportional(world: int, weights: list[int]) -> list[int] | None:
    """Integer group sizes summing to ``world`` in proportion to ``weights`` (largest remainder), each >= 1."""
    if world < len(weights):
        return None
    total = sum(weights)
    exact = [world * w / total for w in weights]
    sizes = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(sizes) < world:
        sizes[by_remainder[i % len(sizes)]] += 1
        i += 1
    while sum(sizes) > world:
        j = max(range(len(sizes)), key=lambda k: sizes[k])
        sizes[j] -= 1
    return sizes


def nemo_critic_sizes(problem: PlanProblem) -> list[int]:
    """GPUs NeMo-Aligner's critic job may get: every power of two up to half the cluster (the actor job gets the
    rest). The job sizes are set by hand per job (``trainer.num_nodes`` / ``trainer.devices``), so the rule grants
    the peer the fastest split that fits, whatever the model sizes."""
    sizes, size = [], 1
    while size <= problem.cluster.world_size // 2:
        sizes.append(size)
        size *= 2
    return sizes


def nemo_aligner(problem: PlanProblem) -> Found | None:
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node
    scalar = {name for name, role in problem.roles.items() if role.arch.is_critic}
    critic_job = [m for m in problem.mfcs if m.model in scalar]
    actor_job = [m for m in problem.mfcs if m.model not in scalar]
    if not critic_job or not actor_job:
        return _nemo_split(problem, [j for j in (actor_job, critic_job) if j], [world], per_node)
    return _fastest(_nemo_split(problem, [actor_job, critic_job], [world - size, size], per_node)
                    for size in nemo_critic_sizes(problem))


def _nemo_split(problem: PlanProblem, jobs: list[list[MFC]], sizes: list[int], per_node: int) -> Found | None:
    """Each job one Megatron (TP, PP), the smallest that fits, TP to a node first; generation resharded from PP
    to TP (``trainer.ppo.trt_llm.reshard``: TP x PP, PP 1) where the heads divide."""
    def megatron(job: list[MFC], size: int) -> list[Strategy]:
        roles = list({m.model: problem.role(m) for m in job}.values())
        tps = [tp for tp in _tp_degrees(1, size, roles[0], per_node)
               if all(r.arch.num_heads % tp == 0 and r.arch.num_kv_heads % tp == 0 for r in roles)]
        pairs = [(tp, 1) for tp in tps]
        top, pp = (tps[-1] if tps else 1), 2
        while size % (top * pp) == 0 and pp <= min(r.arch.num_layers for r in roles):
            pairs.append((top, pp))
            pp *= 2
        return [Strategy(dp=size // (tp * pp), tp=tp, pp=pp) for tp, pp in pairs]

    def resharded(s: Strategy, role: ModelRole) -> Strategy:
        tp = s.tp * s.pp  # TensorRT-LLM's TP group spans the PP stages' nodes too
        ok = role.arch.num_heads % tp == 0 and role.arch.num_kv_heads % tp == 0
        return Strategy(dp=s.dp, tp=tp) if s.pp > 1 and ok else s

    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    choices = [megatron(job, size) for job, size in zip(jobs, sizes)]

    def options(p: PlanProblem) -> Iterator[dict[str, Layout]]:
        for picked in itertools.product(*choices):
            yield {m.name: Layout.contiguous(start, resharded(s, p.role(m)) if m.kind is MFCKind.GENERATE else s)
                   for start, job, s in zip(starts, jobs, picked) for m in job}

    return _first_fit(problem, _ladder(_with_stage(1), SAVERS[:2]), options, VllmEngine())  # TensorRT-LLM


BUILDERS: dict[str, Callable[[PlanProblem], Found | None]] = {
    "deepspeed_chat": deepspeed_chat, "openrlhf": openrlhf, "nemo_aligner": nemo_aligner, "verl": verl,
}
