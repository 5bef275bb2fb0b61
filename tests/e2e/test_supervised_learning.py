"""SFT, reward modelling and DPO learn the shipped sort task under `restage run` (fixed seed, CPU).

Each test runs the job's YAML with fewer steps, reads the training statistics from log.h5 and
evaluates the saved HF checkpoint on the held-out split with `transformers`.
"""

import pytest
import torch
from e2e_jobs import answer_logprobs, held_out, layout_overrides, pair_accuracy, report, restage_run, reward_scores, tiny_model

from restage.algorithms import packed_ops

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

# Pinned layouts (not the planner's choice) so the runs are the same on every machine.
DP2 = {"reward_train": "ranks:0-1 dp2", "ref_inf": "ranks:0-1 dp2", "actor_train": "ranks:0-1 dp2"}


def _answer_nll(hf_dir, batch) -> float:
    """Mean negative log-likelihood per answer token."""
    logprobs = answer_logprobs(hf_dir, batch, "packed_input_ids")
    return float(-logprobs.sum() / (~batch["prompt_mask"].bool()).sum())


def test_sft_loss_falls_by_half(tmp_path):
    steps = 60
    run = restage_run(tmp_path, "sft_tiny", 1, "e2e", f"run.steps={steps}")
    loss = run.stat("actor_train/loss")
    assert len(loss) == steps
    start, end = float(loss[0]), float(loss[-5:].mean())
    assert end <= 0.5 * start, f"training loss {start:.3f} -> {end:.3f}"
    # The same on the held-out pairs, with the saved checkpoint against the model it started from.
    evaluation = held_out("sft_tiny")
    before, after = _answer_nll(tiny_model(), evaluation), _answer_nll(run.checkpoint("actor"), evaluation)
    assert after <= 0.5 * before, f"held-out loss {before:.3f} -> {after:.3f}"
    report("sft", steps=steps, train_loss_start=start, train_loss_end=end, heldout_loss_start=before,
           heldout_loss_end=after, seconds=run.seconds)


def test_reward_model_separates_held_out_pairs(tmp_path):
    steps = 40
    run = restage_run(tmp_path, "rm_tiny", 2, "e2e", f"run.steps={steps}", *layout_overrides(DP2, ("reward_train",)))
    accuracy = run.stat("reward_train/accuracy")
    evaluation = held_out("rm_tiny")
    scores = reward_scores(run.checkpoint("reward"), evaluation, "packed_pair_ids")
    held_out_accuracy = pair_accuracy(scores[0::2], scores[1::2])
    assert held_out_accuracy >= 0.9, f"held-out accuracy {held_out_accuracy:.3f}"
    report("rm", steps=steps, train_accuracy_first_step=float(accuracy[0]), heldout_pairs=evaluation.n_samples,
           heldout_accuracy_end=held_out_accuracy, seconds=run.seconds)


def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    steps = 40
    run = restage_run(tmp_path, "dpo_tiny", 2, "e2e", f"run.steps={steps}",
                      *layout_overrides(DP2, ("ref_inf", "actor_train")))
    evaluation = held_out("dpo_tiny")
    cu = evaluation.cu_seqlens
    ref = packed_ops.seq_sum(answer_logprobs(tiny_model(), evaluation, "packed_pair_ids"), cu)
    policy = packed_ops.seq_sum(answer_logprobs(run.checkpoint("actor"), evaluation, "packed_pair_ids"), cu)
    # DPO's implicit reward accuracy (h = log-ratio of chosen minus that of rejected > 0): the
    # starting policy is the reference, so h = 0 on every pair.
    h_start = torch.zeros(evaluation.n_samples)
    h_end = (policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2])
    implicit_start, implicit_end = pair_accuracy(h_start, 0 * h_start), pair_accuracy(h_end, 0 * h_end)
    # The policy's own preference (chosen more likely than rejected), before and after.
    own_start, own_end = pair_accuracy(ref[0::2], ref[1::2]), pair_accuracy(policy[0::2], policy[1::2])
    assert implicit_end - implicit_start >= 0.2, f"implicit reward accuracy {implicit_start:.3f} -> {implicit_end:.3f}"
    assert own_end - own_start >= 0.2, f"policy accuracy {own_start:.3f} -> {own_end:.3f}"
    report("dpo", steps=steps, heldout_pairs=evaluation.n_samples, implicit_accuracy_start=implicit_start,
           implicit_accuracy_end=implicit_end, policy_accuracy_start=own_start, policy_accuracy_end=own_end,
           seconds=run.seconds)
