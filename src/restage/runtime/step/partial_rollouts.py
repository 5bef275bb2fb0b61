"""Partial rollouts (``plan.partial_rollouts``): one generate call finishes a step's batch and begins the next's.

The generate op of step ``s`` (``Generate.partial``, schedule/async_program.py) hands the rollout engine the
requests of batch ``T = s + ahead`` that are not done yet (those begun at step ``s - 1`` with their answers so
far, then those not begun), followed by batch ``T + 1``'s; the first must finish, the second start in the slots
they free (``generation.continue_generate``). A begun answer is prefilled again as prompt + answer so far under
the weights the copy holds now (its keys and values recomputed, as AReaL does), and decodes on from its answer
position with its own noise key, so each token records the version that chose it. Request ``r`` of the batch of
step ``t`` has the seed ``request_seed(seed_t, r)`` of a whole-batch generation, so under unchanged weights the
answers equal that generation's (tests/models/test_partial_rollout_on_cpu.py).
"""

from __future__ import annotations

from restage.algorithms.base import AlgoState, CallContext
from restage.algorithms.interface import Algorithm
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC
from restage.models.decoder import StageModule
from restage.rollout.generation import PartialRequest, continue_generate
from restage.runtime.dataplane.rollout_buffer import Answer
from restage.runtime.step.execute import MFCResult, answers_result, prompt_lists, request_seeds, sampling_params


def _requests(prompts: Batch, group: int, seed: int) -> list[tuple[tuple[int, ...], int]]:
    """(prompt, noise seed) of every request of a batch: request ``i * group + j`` is sample j of prompt i, seeded as
    ``execute.request_seeds`` seeds it."""
    ids = prompt_lists(prompts)
    return [(tuple(ids[r // group]), s) for r, s in enumerate(request_seeds(prompts, group, seed))]


def run_partial_generate(module: StageModule, mfc: MFC, now: Batch, begun: tuple[Answer, ...] | None,
                         later: Batch | None, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
                         call: CallContext, seeds: tuple[int, int], version: int
                         ) -> tuple[MFCResult, int, tuple[Answer, ...] | None]:
    """Finish the batch of prompts ``now`` (``begun``: its answers so far, None: none begun) and begin ``later``'s
    (None: no later step); returns ``now``'s result, the version of its oldest token and ``later``'s answers so
    far. ``seeds``: the two batches'."""
    group = mfc.options.group
    params = sampling_params(module, mfc, cfg, seeds[0])
    first = _requests(now, group, seeds[0])
    begun = begun if begun is not None else tuple(Answer() for _ in first)
    assert len(begun) == len(first), f"{mfc.name}: {len(begun)} answers begun for {len(first)} requests"
    second = _requests(later, group, seeds[1]) if later is not None else []
    rows = [r for r, answer in enumerate(begun) if not answer.finished]
    requests = [PartialRequest(first[r][0], first[r][1], begun[r].tokens, begun[r].logprobs) for r in rows]
    requests += [PartialRequest(prompt, seed) for prompt, seed in second]
    answers = list(begun)
    later_answers = [Answer() for _ in second]
    # Called even with nothing to finish (no slots then): under ep the replicas of an ep group step together.
    out = continue_generate(module, requests, params, must_finish=len(rows))
    tokens, logprobs = out.output.sequences(), out.output.token_logprobs()
    for i, row in enumerate([*rows, *range(len(first), len(first) + len(second))]):
        old = begun[row] if row < len(first) else Answer()
        new = Answer(tuple(tokens[i]), tuple(logprobs[i]),
                     old.versions + (version,) * (len(tokens[i]) - len(old.tokens)), out.finished[i])
        if row < len(first):
            answers[row] = new
        else:
            later_answers[row - len(first)] = new
    result = answers_result(mfc, now, [list(a.tokens) for a in answers], [list(a.logprobs) for a in answers],
                            [list(a.versions) for a in answers], algo, cfg, state, call)
    cut = [a for a in later_answers if a.tokens and not a.finished]
    result.stats[f"{mfc.name}/cut_samples"] = len(cut) / max(1, len(later_answers))
    result.stats[f"{mfc.name}/cut_tokens"] = sum(len(a.tokens) for a in later_answers) / max(1, len(later_answers))
    oldest = min((v for a in answers for v in a.versions), default=version)
    return result, oldest, (tuple(later_answers) if later is not None else None)
