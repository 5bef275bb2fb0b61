"""The runtime's early stop: a tripped flag on any DP rank skips that optimizer step and the rest of the batch.

One PPO step with two epochs over the batch and a ratio threshold that the second epoch passes
(after one update the importance ratios move well past 1.001) must leave the actor exactly as
one PPO step with a single epoch does.
"""

import pytest
import torch
from e2e_jobs import layout_overrides, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

DP2 = {m: "ranks:0-1 dp2" for m in ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")}
COMMON = ["run.steps=1", "run.batch_size=16", "algo.minibatches=1", *layout_overrides(DP2, tuple(DP2))]


def _actor(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run.checkpoint("actor") / "model.safetensors")


def test_early_stop_skips_the_rest_of_the_batch(tmp_path):
    stopped = restage_run(tmp_path, "ppo_tiny", 2, "stopped", *COMMON, "algo.ppo_epochs=2", "algo.early_stop_ratio=1.001")
    one_epoch = restage_run(tmp_path, "ppo_tiny", 2, "one", *COMMON, "algo.ppo_epochs=1", "algo.early_stop_ratio=0")
    stats = read_log(stopped.trial_dir).stat_series()
    # Two minibatch passes, the second tripped: the flag's mean over the step's micro-batches is 1/2.
    assert float(stats["actor_train/early_stop"][1][0]) == 0.5
    a, b = _actor(stopped), _actor(one_epoch)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=f"{name} moved after the early stop")
