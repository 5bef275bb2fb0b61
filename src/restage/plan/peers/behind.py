"""Where a plan is behind a peer's default plan, and what a user can do about it (``restage plan``'s baselines).

A peer's plan is scored under the peer's own system: its memory settings (``peers.py``) and its generation
engine and extra passes (``peer_engines.py``: vLLM, TensorRT-LLM or DeepSpeed's Hybrid Engine), which restage's
runtime does not run. The search starts from every peer layout restage can run, re-estimated under the config's
settings (``baselines.starting_plans``), so a searched plan behind a peer is behind on what the peer's system
does and restage's does not; a manual or heuristic plan may also be behind on its layouts. The line names the
MFC that loses the most predicted time against the peer's plan, both figures, and the setting that bears on it
(or that none does).
"""

from __future__ import annotations

from typing import assert_never

from restage.graph import MFCKind
from restage.plan.generation_cost import RestageEngine
from restage.plan.layout_cost import sequences_per_rank
from restage.plan.plan_score import PlanEvaluation
from restage.plan.planner import PlanOutcome
from restage.plan.problem import Candidate, PlanProblem
from restage.plan.roles import ModelRole
from restage.plan.rollout_cost import restage_live

# The generation engine each peer's plan is costed with (peer_engines.py).
PEER_ENGINES = {"deepspeed_chat": "DeepSpeed's Hybrid Engine", "openrlhf": "vLLM", "verl": "vLLM",
                "nemo_aligner": "TensorRT-LLM"}


def behind_line(outcome: PlanOutcome, name: str, peer: PlanEvaluation) -> str | None:
    """One line for a peer whose plan is predicted faster than ``outcome``'s: where the time goes and the knob;
    None when ``outcome``'s plan is at least as fast."""
    ours = outcome.evaluation
    if peer.iteration_seconds >= ours.iteration_seconds:
        return None
    mfcs = outcome.problem.mfcs
    if len(peer.mfc_seconds) != len(mfcs):
        return None
    gaps = [(ours.mfc_seconds[i] - peer.mfc_seconds[i], i) for i in range(len(mfcs))]
    gap, i = max(gaps)
    if gap <= 0:
        return (f"    behind in no one MFC ({ours.iteration_seconds - peer.iteration_seconds:.3f} s lost to "
                "reallocations and waits between MFCs); plan.mode=search with a longer plan.time_budget_seconds")
    mfc = mfcs[i]
    where = f"    behind in {mfc.name}: {ours.mfc_seconds[i]:.3f} s here, {peer.mfc_seconds[i]:.3f} s in {name}'s plan"
    return f"{where}; {_knob(outcome, name, i)}"


def _knob(outcome: PlanOutcome, name: str, index: int) -> str:
    """What a user can change about MFC ``index`` of ``outcome``'s plan, or why nothing closes the gap."""
    problem, cand = outcome.problem, outcome.plan[index]
    mfc = problem.mfcs[index]
    role = problem.role(mfc)
    match outcome.mode:
        case "manual" | "heuristic":
            return (f"this plan's layouts are plan.mode={outcome.mode}'s; plan.mode=search starts from the peers' "
                    "layouts restage can run")
        case "search" | "async-split":
            pass
        case _:
            assert_never(outcome.mode)
    match mfc.kind:
        case MFCKind.GENERATE:
            return _generation_knob(problem, cand, role, name)
        case MFCKind.INFERENCE if not role.trainable and not role.shard_frozen:
            return (f"{name} shards frozen models ZeRO-3 / FSDP style: try plan.shard_frozen=auto (or "
                    f"models.{mfc.model}.shard_frozen=true)")
        case MFCKind.INFERENCE | MFCKind.TRAIN_STEP:
            return (f"{name} runs it with its own memory settings (plan/peers/defaults.py); compare "
                    f"models.{mfc.model}.zero_stage, gradient_checkpointing and offload_* with docs/plan.md, "
                    "\"Baselines\"")
        case _:
            assert_never(mfc.kind)


def _generation_knob(problem: PlanProblem, cand: Candidate, role: ModelRole, name: str) -> str:
    """What bounds restage's rollout engine on ``cand``'s generation, or that the peer's engine is faster."""
    mfc = problem.graph[cand.mfc]
    engine = problem.estimator.engine
    assert isinstance(engine, RestageEngine)  # restage's own plans generate on its rollout engine
    live = restage_live(problem.cluster, engine, mfc, role, cand.layout)
    requests = int(sequences_per_rank(mfc, cand.layout.strategy.dp))
    if live < requests and live == engine.limits.max_slots:
        return (f"restage's rollout engine decodes {live} of a rank's {requests} answers at once: raise "
                f"generation.max_slots (now {engine.limits.max_slots})")
    if live < requests:
        return (f"restage's rollout engine has KV cache for {live} of a rank's {requests} answers at once: raise "
                "generation.kv_cache_gib or give generation more ranks")
    return (f"{name} generates with {PEER_ENGINES.get(name, 'its own engine')} (plan/peers/peer_engines.py), whose decode "
            "steps the estimator costs below restage's rollout engine's (CUDA graphs under tp and pp, a paged "
            "attention kernel, restage's only with flash-attn installed); no setting of restage's closes this")
