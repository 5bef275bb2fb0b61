"""SFT of a tiny Mixtral under `restage run`: two pipeline stages train (load-balancing loss included, through
DeepSpeed) to the weights of a one-rank run, and the router statistics of every layer reach log.h5."""

import shutil

import pytest
import torch
from runs import ROOT, hf_weights, last_checkpoint, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

LAYERS = 2


def _tiny_mixtral(path):
    from restage.models.tiny import build_tiny

    build_tiny(path, family="mixtral", vocab_size=16, tokenizer=False, hidden_size=32, intermediate_size=48,
               num_layers=LAYERS, num_heads=4, num_kv_heads=2, max_positions=64, router_aux_loss_coef=0.05)
    for file in (ROOT / "data" / "synthetic" / "tokenizer").iterdir():
        shutil.copy(file, path / file.name)
    return path


def test_two_stage_moe_training_equals_one_rank_and_logs_router_load(tmp_path):
    model = _tiny_mixtral(tmp_path / "mixtral")
    common = ["jobs/sft_tiny.yaml", "run.steps=3", "run.batch_size=8", "run.micro_batches=2", "plan.mode=manual",
              f"models.actor.path={model}", "models.actor.optim.warmup_steps=0"]
    one = restage_run(tmp_path, *common, "-n", "1", "trial=one", "plan.layouts.actor_train=ranks:0 dp1")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = restage_run(tmp_path, *common, "-n", "2", "trial=two", "plan.layouts.actor_train=ranks:0-1 pp2")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    trials = tmp_path / "sft-tiny"
    a, b = (hf_weights(last_checkpoint(trials / t) / "actor" / "hf") for t in ("one", "two"))
    assert a.keys() == b.keys() and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in a
    flat_a, flat_b = (torch.cat([w[n].flatten() for n in sorted(w)]) for w in (a, b))
    assert ((flat_a - flat_b).norm() / flat_a.norm()).item() <= 1e-5
    original = hf_weights(model)
    moved = (a["model.layers.0.block_sparse_moe.gate.weight"] - original["model.layers.0.block_sparse_moe.gate.weight"])
    assert moved.abs().max() > 0  # the router trains

    stats_one, stats_two = read_log(trials / "one").stat_series(), read_log(trials / "two").stat_series()
    for layer in range(LAYERS):  # layer 0 lives on stage 0, whose statistics reach the master through stage 1
        for kind in ("max_load", "min_load"):
            name = f"actor_train/router/layer{layer}/{kind}"
            assert len(stats_two[name][1]) == 3
            torch.testing.assert_close(torch.tensor(stats_two[name][1]), torch.tensor(stats_one[name][1]))
        assert all(0.0 <= low <= 1.0 <= high <= 4.0 for low, high in
                   zip(stats_two[f"actor_train/router/layer{layer}/min_load"][1],
                       stats_two[f"actor_train/router/layer{layer}/max_load"][1], strict=True))
    aux = "actor_train/router/aux_loss"
    torch.testing.assert_close(torch.tensor(stats_two[aux][1]), torch.tensor(stats_one[aux][1]), rtol=1e-5, atol=0)
    assert all(0.0 < v <= 8.0 for v in stats_two[aux][1])  # E * sum_e f_e P_e lies in (0, E * k]
