"""The plans peer RLHF systems produce by their documented defaults: the baselines restage must beat.

Each rule builds layouts from the cluster and the models alone; restage's estimator only scores the
result, picks micro-batch counts, and raises a knob the peer's documentation says to raise until the
model fits (a TP degree, a memory saver). Sources (docs/plan.md cites them in full):

* ``deepspeed_chat`` (DeepSpeedExamples, applications/DeepSpeed-Chat, step3 ``rlhf_engine.py`` and
  ``training_scripts/llama2/run_llama2_7b.sh``): all four models on every GPU; actor and critic
  trained data-parallel with ZeRO-3 (the LLaMA-2 scripts' stage); generation in the Hybrid Engine
  with ``--inference_tp_size`` (default 1) on a gathered copy of the actor; the reference model
  offloaded to the host (``--offload_reference_model``).
* ``openrlhf`` (OpenRLHF ``examples/scripts/train_ppo_llama_ray_70b.sh``): every model on its own GPU
  group, in the proportion actor 4 : critic 4 : vLLM engines 4 : reference 2 : reward 2; training
  with DeepSpeed ZeRO-3 (``--zero_stage 3``), generation on vLLM engines of
  ``--vllm_tensor_parallel_size`` (default 1) GPUs each, fed the actor's weights.
* ``nemo_aligner`` (NeMo-Aligner ``docs/user-guide/rlhf.rst``): two jobs of equal size, the actor with
  the initial policy and the critic with the reward model; each job has one Megatron (TP, PP) for
  all its work (generation included), chosen as the smallest that fits, TP inside a node first;
  Megatron's distributed optimizer (ZeRO-1); the frozen model of a job offloaded to the host and
  loaded back when needed.
* ``verl`` (verl ``ppo_trainer.yaml`` and its performance-tuning guide): every model colocated on all
  GPUs, FSDP (ZeRO-3) for the actor and critic, rollout on a resharded copy with
  ``rollout.tensor_model_parallel_size`` (default 2), raised until
  ``memory_per_gpu x gpu_memory_utilization (0.5) x TP > 2 x parameters`` and the plan fits.

The models' memory settings are the peer's where restage's runtime can run them (ZeRO stage, host
offload of frozen models, gradient checkpointing, optimizer offload); the savers are turned on one
after the other only when the plan does not fit without them, which can only make a baseline
faster. Frozen models stay whole per data-parallel rank, as restage's runtime keeps them (the
peers' ZeRO-3 / FSDP inference engines shard them; a rule that needs that to fit has no plan).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from restage.layout import Layout, Strategy
from restage.plan.estimator import ModelRole, dp_size_ok, stage_param_elements
from restage.plan.evaluate import PlanEvaluation, fit_plan
from restage.plan.problem import Plan, PlanProblem

Found = tuple[Plan, PlanEvaluation]
RoleChange = Callable[[ModelRole], ModelRole]
PEERS = ("deepspeed_chat", "openrlhf", "nemo_aligner", "verl")
SAVERS = ("offload_frozen", "gradient_checkpointing", "offload_optimizer")
# OpenRLHF's 70B example: GPUs per group for the actor, critic, vLLM engines, reference, reward.
OPENRLHF_WEIGHTS = {"trained": 4, "generate": 4, "frozen": 2}
VERL_GPU_MEMORY_UTILIZATION = 0.5


def derived(problem: PlanProblem, change: RoleChange) -> PlanProblem:
    """The same problem with every model's role changed (a peer's memory strategy); caches are shared."""
    roles = {name: change(role) for name, role in problem.roles.items()}
    return PlanProblem(problem.graph, roles, problem.cluster, estimator=problem.estimator,
                       samples_per_iteration=problem.samples_per_iteration, overlap_iterations=problem.overlap_iterations,
                       exact_realloc=problem.exact_realloc, keep_per_size=problem.keep_per_size)


def _with_stage(stage: int) -> RoleChange:
    def change(role: ModelRole) -> ModelRole:
        return dataclasses.replace(role, zero_stage=stage) if role.trainable else role
    return change


def _ladder(base: RoleChange, savers: tuple[str, ...] = SAVERS) -> list[RoleChange]:
    """``base``, then ``base`` with the first k memory savers on, k = 1, 2, ..."""
    def level(k: int) -> RoleChange:
        def change(role: ModelRole) -> ModelRole:
            role = base(role)
            for saver in savers[:k]:
                if saver == "offload_frozen" and not role.trainable:
                    role = dataclasses.replace(role, offload_when_idle=True)
                elif saver != "offload_frozen" and role.trainable:
                    role = dataclasses.replace(role, **{saver: True})  # type: ignore[arg-type]  # saver names a bool field
            return role
        return change
    return [level(k) for k in range(len(savers) + 1)]


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


def _first_fit(problem: PlanProblem, levels: list[RoleChange], options) -> Found | None:
    """The first (memory level, layouts) in order that fits; ``options(p)`` yields layouts per level."""
    for change in levels:
        p = derived(problem, change)
        for layouts in options(p):
            if layouts is None or not _dp_ok(p, layouts):
                continue
            got = fit_plan(p, layouts)
            if got is not None:
                return got
    return None


def _colocated_rule(problem: PlanProblem, first_tp: Callable[[ModelRole], int]) -> Found | None:
    """Every MFC on all devices data-parallel; generation on a copy with TP from ``first_tp`` upward."""
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node

    def options(p: PlanProblem):
        gens = [m for m in p.mfcs if m.kind == "generate"]
        tps = _tp_degrees(max(first_tp(p.role(gens[0])), 1), world, p.role(gens[0]), per_node) if gens else [1]
        for tp in tps:
            yield {m.name: Layout.contiguous(0, Strategy(dp=world // tp, tp=tp) if m.kind == "generate"
                                             else Strategy(dp=world)) for m in p.mfcs}

    return _first_fit(problem, _ladder(_with_stage(3)), options)


def deepspeed_chat(problem: PlanProblem) -> Found | None:
    return _colocated_rule(problem, lambda role: 1)


def verl(problem: PlanProblem) -> Found | None:
    memory = problem.cluster.memory_bytes * VERL_GPU_MEMORY_UTILIZATION

    def first_tp(role: ModelRole) -> int:
        params = sum(_stage_params(role)) * role.bytes_per_element
        tp = 2
        while memory * tp <= params:  # verl's rule: memory x utilisation x TP > 2 x parameters (bytes in 16 bits)
            tp *= 2
        return tp

    return _colocated_rule(problem, first_tp)


def _stage_params(role: ModelRole) -> tuple[int, ...]:
    return stage_param_elements(role.arch, 1, 1)


def openrlhf(problem: PlanProblem) -> Found | None:
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node
    groups: list[tuple[str, int]] = []  # (group, weight) in rank order: trained models, vLLM engines, frozen models
    trained = [name for name in problem.graph.models() if problem.roles[name].trainable]
    frozen = [name for name in problem.graph.models() if not problem.roles[name].trainable]
    groups += [(name, OPENRLHF_WEIGHTS["trained"]) for name in trained]
    if any(m.kind == "generate" for m in problem.mfcs):
        groups.append(("<generate>", OPENRLHF_WEIGHTS["generate"]))
    groups += [(name, OPENRLHF_WEIGHTS["frozen"]) for name in frozen]
    sizes = _proportional(world, [w for _, w in groups])
    if sizes is None:
        return None
    start, where = 0, {}
    for (group, _), size in zip(groups, sizes):
        where[group] = (start, size)
        start += size

    def options(p: PlanProblem):
        gen = next((m for m in p.mfcs if m.kind == "generate"), None)
        g0, gsize = where.get("<generate>", (0, 1))
        tps = _tp_degrees(1, gsize, p.role(gen), per_node) if gen is not None else [1]
        for tp in tps:
            if gen is not None and g0 // per_node != (g0 + tp - 1) // per_node:
                continue  # an engine's TP group must stay inside a node
            layouts = {}
            for m in p.mfcs:
                if m.kind == "generate":
                    layouts[m.name] = Layout.contiguous(g0, Strategy(dp=gsize // tp, tp=tp))
                else:
                    s0, size = where[m.model]
                    layouts[m.name] = Layout.contiguous(s0, Strategy(dp=size))
            yield layouts

    return _first_fit(problem, _ladder(_with_stage(3)), options)


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


def nemo_aligner(problem: PlanProblem) -> Found | None:
    world, per_node = problem.cluster.world_size, problem.cluster.devices_per_node
    scalar = {name for name, role in problem.roles.items() if role.arch.is_critic}
    critic_job = [m for m in problem.mfcs if m.model in scalar]
    actor_job = [m for m in problem.mfcs if m.model not in scalar]
    jobs = [j for j in (actor_job, critic_job) if j]
    if world < len(jobs):
        return None
    size = world // len(jobs)

    def megatron(job) -> list[Strategy]:
        """(TP, PP) from the smallest up, TP to a node first, that every model of the job admits."""
        roles = list({m.model: problem.role(m) for m in job}.values())
        tps = [tp for tp in _tp_degrees(1, size, roles[0], per_node)
               if all(r.arch.num_heads % tp == 0 and r.arch.num_kv_heads % tp == 0 for r in roles)]
        pairs = [(tp, 1) for tp in tps]
        top, pp = (tps[-1] if tps else 1), 2
        while size % (top * pp) == 0 and pp <= min(r.arch.num_layers for r in roles):
            pairs.append((top, pp))
            pp *= 2
        return [Strategy(dp=size // (tp * pp), tp=tp, pp=pp) for tp, pp in pairs]

    choices = [megatron(job) for job in jobs]

    def options(p: PlanProblem):
        for picked in itertools.product(*choices):
            yield {m.name: Layout.contiguous(k * size, strategy) for k, (job, strategy) in enumerate(zip(jobs, picked))
                   for m in job}

    return _first_fit(problem, _ladder(_with_stage(1), SAVERS[:2]), options)


BUILDERS: dict[str, Callable[[PlanProblem], Found | None]] = {
    "deepspeed_chat": deepspeed_chat, "openrlhf": openrlhf, "nemo_aligner": nemo_aligner, "verl": verl,
}
