"""A train step's loss is normalised by the whole optimizer step's counts (``registry.LossNorm``,
``execute.loss_norm``), so the gradient does not depend on the layout: GRPO with DAPO's token-level loss
(``loss_agg: token_mean``) on answers of different lengths trains to the one-rank weights under dp2 and with three
micro-batches per step on one rank, up to the order of float sums. Before, each micro-batch's (each dp rank's) loss
was its own token mean, which weighs a token of a micro-batch with fewer answer tokens more. (The logged
statistics stay each micro-batch's own means, merged by samples: they are not compared.)"""

import pytest
import torch
from runs import hf_weights, last_checkpoint, restage_run, tiny_assets

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.scale]  # about 45 s; make test-scale runs it

MFCS = ("actor_gen", "ref_inf", "actor_train")
JOB = ["jobs/grpo_tiny.yaml", "run.steps=2", "run.save_every=2", "algo.loss_agg=token_mean", "algo.minibatches=1",
       "plan.mode=manual"]
LAYOUTS = {"one-rank": ["-n", "1", *(f"plan.layouts.{m}=ranks:0-0 dp1" for m in MFCS)],
           "micro3": ["-n", "1", "run.micro_batches=3", *(f"plan.layouts.{m}=ranks:0-0 dp1" for m in MFCS)],
           "dp2": ["-n", "2", *(f"plan.layouts.{m}=ranks:0-1 dp2" for m in MFCS)]}


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].double().flatten() for k in sorted(a)])
    y = torch.cat([b[k].double().flatten() for k in sorted(b)])
    return float((x - y).norm() / y.norm())


def test_token_mean_loss_trains_to_the_one_rank_weights_under_dp2_and_three_micro_batches(tmp_path):
    for trial, layout in LAYOUTS.items():
        _ok(restage_run(tmp_path, *JOB, *layout, f"trial={trial}"))
    trials = {t: tmp_path / "grpo-tiny" / t for t in LAYOUTS}
    mean_length = read_log(trials["one-rank"]).stat_series()["actor_gen/answer_tokens"][1]
    assert any(float(m) != round(float(m)) for m in mean_length), mean_length  # answers of different lengths
    weights = {t: hf_weights(last_checkpoint(path) / "actor" / "hf") for t, path in trials.items()}
    trained = _relative(weights["one-rank"], hf_weights(tiny_assets()))  # how far the two steps moved the weights
    apart = {t: _relative(weights[t], weights["one-rank"]) for t in ("micro3", "dp2")}
    assert max(apart.values()) <= 2e-5 and trained > 1e-2, (apart, trained)
