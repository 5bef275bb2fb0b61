"""What the peers' engines do that restage's runtime does not, as the estimator sees it (``plan/peers/defaults.py``).

* **Batched generation** (``waves``): vLLM (OpenRLHF, verl) and TensorRT-LLM (NeMo-Aligner) batch
  continuously and hold KV cache only for the sequences being decoded; DeepSpeed-Chat generates
  ``--per_device_generation_batch_size`` prompts at a time (``HybridEngine``). Modelled as a DP rank's prompts
  decoded in ``w`` waves of ``ceil(b / w)`` sequences: KV cache and workspace of one wave, ``w`` times one wave's
  time. With one generation length for every sequence (what restage's MFCs carry) continuous batching
  is exactly this; with mixed lengths it would do better. The vLLM-style peers take the fewest waves that fit
  (``fit_plan`` tries micro-batch counts leanest-last; for a generation they are waves); DeepSpeed-Chat takes its
  batch's waves (``HybridEngine.waves``), more only where they do not fit.
* **The old-log-prob pass**: every peer recomputes the actor's log-probabilities of the rollout with a
  forward of its *training* engine after generation (the generation engine's own log-probs are not
  used): verl ``compute_log_prob`` (``actor_rollout_ref.actor``), OpenRLHF's experience maker,
  DeepSpeed-Chat ``generate_experience`` (``self.actor_model(seq, ...)``), NeMo-Aligner's
  ``get_inference_log_probs``. Restage's generation returns them, so the peers pay one more forward of
  the actor on its training layout; it is added to the actor's train step (same ranks, and the train
  step waits for it anyway). Under ZeRO-3 / FSDP that forward gathers the parameters layer by layer.

* **The generation engine's speed**: a peer that generates with vLLM (OpenRLHF, verl) or TensorRT-LLM
  (NeMo-Aligner: CUDA graphs and in-flight batching too, modelled the same way) has its generation time
  from ``engines.vllm_generate_seconds`` (CUDA graphs, continuous batching over the KV cache its memory
  setting leaves), one engine per data-parallel rank of the layout's TP; DeepSpeed-Chat's Hybrid Engine
  runs eager kernels over one wave at a time (``engines.OneBatchEngine``: each wave prefilled and decoded
  to its end, eagerly, as restage's runtime generated before its rollout engine). Whether a layout fits is
  still one wave's memory (above); a layout with pp > 1 (NeMo-Aligner without its reshard) keeps the waves' time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import assert_never

from restage.cluster import ClusterSpec
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout, Strategy
from restage.plan.estimator import Estimate, Estimator
from restage.plan.generation_cost import OneBatchEngine, VllmEngine, vllm_generate_seconds
from restage.plan.layout_cost import sequences_per_rank
from restage.plan.problem import Candidate, PlanProblem
from restage.plan.roles import ModelRole
from restage.plan.transfer_cost import zero3_gather_seconds

DSCHAT_GENERATION_BATCH = 16  # DeepSpeed-Chat step3 main.py: --per_device_generation_batch_size's default


@dataclass(frozen=True)
class HybridEngine:
    """DeepSpeed-Chat's generation in DeepSpeed's Hybrid Engine (``deepspeed/runtime/hybrid_engine.py``).

    ``ppo_trainer.generate_experience`` is called once per ``batch_per_device`` prompts of a rank
    (``--per_device_generation_batch_size``), and each call is one ``generate``: under ZeRO-3 it first gathers the
    whole actor (``DeepSpeedHybridEngine.generate`` wraps the decode in ``GatheredParameters`` over every layer when
    ``hybrid_engine.pin_parameters``, true by default, sets ``gather_all_layers``; at ``inference_tp_size`` > 1 it
    gathers ``tp_gather_partition_size`` layers at a time, the same bytes), decodes its batch eagerly to the end, and
    frees the gathered copy (``release_inference_cache`` frees the KV workspace too). So a rank's prompts run in
    ``ceil(prompts / batch_per_device)`` waves and the gather is paid once per wave, not once per generation."""

    batch_per_device: int = DSCHAT_GENERATION_BATCH

    def waves(self, mfc: MFC, dp: int) -> list[int]:
        """The batch's wave count, then twice, four times, ... as many while a wave keeps a sequence: a user lowers
        ``--per_device_generation_batch_size`` until the generation fits, never raises it past the setting."""
        return wave_counts(mfc, dp, fewest=math.ceil(_per_rank(mfc, dp) / self.batch_per_device))


PeerEngine = VllmEngine | HybridEngine


def _per_rank(mfc: MFC, dp: int) -> int:
    return max(int(sequences_per_rank(mfc, dp)), 1)


def wave_counts(mfc: MFC, dp: int, fewest: int = 1) -> list[int]:
    """``fewest``, twice, four times, ... as many waves, while each wave keeps at least one sequence per rank."""
    out, w = [], fewest
    while w <= _per_rank(mfc, dp):
        out.append(w)
        w *= 2
    return out


def hybrid_engine_estimate(problem: PlanProblem, mfc: MFC, layout: Layout, waves: int) -> Estimate:
    """DeepSpeed-Chat's generation (``HybridEngine``): ``waves`` eager batches, and under a ZeRO-3 actor the gathers
    of every call after the first (the plan's evaluation adds one gather to a generation in place, or a
    reallocation to one on a copy, already)."""
    est = waves_estimate(problem, mfc, layout, waves)
    role = problem.roles[mfc.model]
    if not (role.trainable and role.zero_stage == 3) or waves == 1:
        return est
    # The partitions are spread over every rank of the generation's mesh (DeepSpeed-Chat trains data-parallel
    # over all of them), whatever the generation's own tp: gather the whole model over that group.
    trained_on = Layout(layout.mesh, Strategy(dp=layout.size))
    regathers = (waves - 1) * zero3_gather_seconds(role.arch, trained_on, role.bytes_per_element, problem.cluster)
    return dataclasses.replace(est, seconds=est.seconds + regathers,
                               breakdown=est.breakdown + (("hybrid_engine_regather_seconds", regathers),))


def waves_estimate(problem: PlanProblem, mfc: MFC, layout: Layout, waves: int) -> Estimate:
    """A generation decoded in ``waves`` waves, each one batch to its end: one wave's memory, ``waves`` times its seconds."""
    dp = layout.strategy.dp
    live = math.ceil(sequences_per_rank(mfc, dp) / waves)
    one = problem.estimator.estimate(dataclasses.replace(mfc, n_seqs=live * dp), problem.role(mfc), layout,
                                     engine=OneBatchEngine())
    return dataclasses.replace(one, seconds=one.seconds * waves, micro_batches=waves,
                               breakdown=tuple((k, v * waves) for k, v in one.breakdown))


def layer_gathered(role: ModelRole) -> ModelRole:
    """A trained model's forward on its ZeRO-3 / FSDP training engine: a frozen model partitioned the same way,
    its layers gathered (and prefetched) one at a time."""
    sharded = role.zero_stage == 3
    return dataclasses.replace(role, trainable=False, shard_frozen=sharded, prefetch_gathers=sharded,
                               offload_when_idle=False)


def old_logprob_seconds(problem: PlanProblem, train: MFC, layout: Layout, micro_batches: int) -> float:
    """One forward of the trained model over the generation's sequences on its training layout."""
    gen = next(m for m in problem.mfcs if m.kind is MFCKind.GENERATE and m.model == train.model)
    frozen = layer_gathered(problem.role(train))  # the peer's ZeRO-3 engine gathers (and prefetches) the parameters
    forward = MFC(f"{train.model}_old_logprobs", MFCKind.INFERENCE, train.model, (), (), gen.n_seqs, gen.prompt_tokens,
                  gen.gen_tokens, micro_batches=micro_batches)
    return problem.estimator.estimate(forward, frozen, layout, micro_batches).seconds


def engine_estimate(problem: PlanProblem, mfc: MFC, layout: Layout, waves: int, engine: VllmEngine) -> Estimate:
    """A generation on one vLLM-style engine per data-parallel rank: ``waves``' memory, the engine's seconds."""
    est = waves_estimate(problem, mfc, layout, waves)
    s, role = layout.strategy, problem.role(mfc)
    if s.pp > 1:
        return est
    seconds = vllm_generate_seconds(problem.cluster, role.arch, role.dtype,
                                    dataclasses.replace(engine, tp=s.tp, first_rank=layout.mesh[0]),
                                    math.ceil(sequences_per_rank(mfc, s.dp)), mfc.prompt_tokens, mfc.gen_tokens)
    return dataclasses.replace(est, seconds=seconds, breakdown=(("engine_generate_seconds", seconds),))


class PeerProblem(PlanProblem):
    """A problem scored the way the peers' engines run it: batched generation on ``engine`` (a vLLM-style engine's
    settings, or DeepSpeed's Hybrid Engine) and the old-log-prob pass."""

    zero3_lockstep = False  # gathered before generating (vLLM holds its own copy; the Hybrid Engine regathers each
    # call after the first, hybrid_engine_estimate)

    def __init__(self, graph: DataflowGraph, roles: dict[str, ModelRole], cluster: ClusterSpec, *, estimator: Estimator,
                 samples_per_iteration: int, overlap_iterations: bool, exact_realloc: bool, keep_per_size: int,
                 engine: PeerEngine = HybridEngine()):
        super().__init__(graph, roles, cluster, estimator=estimator, samples_per_iteration=samples_per_iteration,
                         overlap_iterations=overlap_iterations, exact_realloc=exact_realloc, keep_per_size=keep_per_size)
        self.engine = engine

    def role(self, mfc: MFC | str) -> ModelRole:
        """An inference of a trained ZeRO-3 model (the critic's values) runs as a forward of its training engine,
        which fetches each layer's partitions as the layer runs and frees them after (DeepSpeed ZeRO-3's module
        hooks, ``deepspeed/runtime/zero/parameter_offload.py``, prefetching ``stage3_prefetch_bucket_size``; FSDP
        per wrapped layer in verl): the cost and memory of a frozen model sharded the same way, not a gather of the
        whole model (what restage's runtime does, ``simulator.zero3_in_place``). Sources: DeepSpeed-Chat
        ``step3_rlhf_finetuning/ppo_trainer.py`` ``generate_experience`` (``self.critic_model.forward_value`` on the
        critic's DeepSpeed engine), OpenRLHF's ``CriticModelActor.forward`` on its ZeRO-3 engine, verl's
        ``DataParallelPPOCritic.compute_values`` on the FSDP module."""
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        role = self.roles[mfc.model]
        if mfc.kind is MFCKind.INFERENCE and role.trainable and role.zero_stage == 3:
            return layer_gathered(role)
        return role

    def candidate(self, mfc: MFC | str, layout: Layout, micro_batches: int | None = None) -> Candidate:
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        match mfc.kind:
            case MFCKind.GENERATE:
                match self.engine:
                    case HybridEngine():
                        waves = micro_batches or self.engine.waves(mfc, layout.strategy.dp)[0]
                        est = hybrid_engine_estimate(self, mfc, layout, waves)
                    case VllmEngine():
                        est = engine_estimate(self, mfc, layout, micro_batches or 1, self.engine)
                    case _:
                        assert_never(self.engine)
                return Candidate(mfc.name, layout, est)
            case MFCKind.TRAIN_STEP if any(m.kind is MFCKind.GENERATE and m.model == mfc.model for m in self.mfcs):
                cand = super().candidate(mfc, layout, micro_batches)
                extra = old_logprob_seconds(self, mfc, layout, cand.micro_batches)
                est = cand.estimate
                return Candidate(mfc.name, layout, dataclasses.replace(
                    est, seconds=est.seconds + extra, breakdown=est.breakdown + (("old_logprob_seconds", extra),)))
            case MFCKind.TRAIN_STEP | MFCKind.INFERENCE:
                return super().candidate(mfc, layout, micro_batches)
            case _:
                assert_never(mfc.kind)

    def in_place_seconds(self, cand: Candidate) -> float:
        """The peers' engines hold their own copy to generate from (vLLM, TensorRT-LLM, the Hybrid Engine's gather)."""
        return cand.seconds

    def options(self, mfc: MFC | str, layout: Layout) -> list[Candidate]:
        mfc = self.graph[mfc] if isinstance(mfc, str) else mfc
        if mfc.kind is not MFCKind.GENERATE:
            return super().options(mfc, layout)
        dp = layout.strategy.dp
        waves = self.engine.waves(mfc, dp) if isinstance(self.engine, HybridEngine) else wave_counts(mfc, dp)
        return sorted((self.candidate(mfc, layout, w) for w in waves), key=lambda c: c.seconds)
