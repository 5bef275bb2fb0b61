"""The scale terms (plan/scale_terms.py) and the validation script built on them (bench/validation.py).

Every expected figure is worked out by hand from the term's definition; the validation script's published points
are checked against bench/calibration.py's own predictions of the same points, and its fit against a set built with
known constants.
"""

import math

import pytest
import torch

from restage.plan.scale_terms import (
    ScaleTerms,
    harmonic,
    hidden_seconds,
    longest_answer,
    slowest_rank_factor,
    train_seconds,
)


@pytest.fixture(scope="module")
def bench(bench_module):
    return tuple(bench_module(name) for name in ("validation", "validation_set", "calibration", "published"))


def test_overlap_hides_at_most_the_compute():
    parts = {"compute_seconds": 10.0, "zero3_gather_seconds": 3.0, "dp_comm_seconds": 2.0, "optimizer_seconds": 4.0}
    assert hidden_seconds(parts, 0.5) == pytest.approx(2.5)  # half of the 5 s of collectives
    assert hidden_seconds({"compute_seconds": 1.0, "zero3_gather_seconds": 5.0}, 1.0) == pytest.approx(1.0)
    assert hidden_seconds(parts, 0.0) == 0.0
    # 20 s step, 1 s hidden, over 1 rank: 19 s; over 100 ranks with sigma 0.1: x (1 + 0.1 sqrt(2 ln 100))
    assert train_seconds(20.0, {"compute_seconds": 10.0, "dp_comm_seconds": 1.0}, 1, ScaleTerms(overlap=1.0)) == 19.0
    factor = 1 + 0.1 * math.sqrt(2 * math.log(100))
    assert slowest_rank_factor(100, 0.1) == pytest.approx(factor)
    assert factor == pytest.approx(1.30349, abs=1e-5)
    assert slowest_rank_factor(1, 0.5) == 1.0


def test_terms_refuse_values_outside_their_range():
    with pytest.raises(ValueError, match="fraction"):
        ScaleTerms(overlap=1.5)
    with pytest.raises(ValueError, match="spread"):
        ScaleTerms(straggler_sigma=-0.1)


def test_longest_answer_is_the_exponential_maximum_capped():
    assert harmonic(4) == pytest.approx(25 / 12)
    assert harmonic(1000) == pytest.approx(sum(1 / k for k in range(1, 1001)), rel=1e-9)
    assert longest_answer(100.0, 10**6, 4) == pytest.approx(100 * 25 / 12)
    assert longest_answer(350.0, 2048, 1024) == 2048.0  # 350 x H_1024 = 2,633 tokens, past the cap
    # The formula against draws: the mean longest of 64 exponential answers of mean 300 over 4,000 batches.
    g = torch.Generator().manual_seed(0)
    draws = torch.empty(4000, 64, dtype=torch.float64).exponential_(1 / 300.0, generator=g)
    assert draws.max(dim=1).values.mean().item() == pytest.approx(longest_answer(300.0, 10**6, 64), rel=0.02)
    with pytest.raises(ValueError):
        longest_answer(0.0, 100, 4)


def test_tree_evaluation_applies_each_term_at_its_leaves(bench):
    v = bench[0]
    train = v.Leaf("train", 10.0, "train", 1, (("compute_seconds", 6.0), ("zero3_gather_seconds", 4.0)))
    node = v.Seq((v.Leaf("generate", 2.0), v.Leaf("tail", 3.0, "tail"), v.Par((train, v.Leaf("other", 7.0)))))
    assert v.evaluate(node, ScaleTerms()) == 2.0 + 0.0 + 10.0  # tail off; the longer of 10 and 7
    assert v.evaluate(node, ScaleTerms(tail=True)) == 2.0 + 3.0 + 10.0
    assert v.evaluate(node, ScaleTerms(overlap=0.5)) == 2.0 + 8.0  # 10 - 0.5 x 4 = 8 (> 7)
    assert v.evaluate(node, ScaleTerms(overlap=1.0)) == 2.0 + 7.0  # 10 - 4 = 6 < 7: the other branch counts
    assert [leaf.label for leaf in v.leaves(node)] == ["generate", "tail", "train", "other"]


def test_published_points_are_predicted_as_calibration_predicts_them(bench):
    v, vs, calibration, published = bench
    by_name = {p.name: p for p in published.POINTS}
    reused = [p for p in vs.POINTS if p.reuses]
    assert len(reused) == len(published.POINTS)  # every published point is in the fit set, once
    for point in reused:
        expected = calibration.predict(by_name[point.reuses])
        assert v.evaluate(v.tree(point), v.ScaleTerms()) == pytest.approx(expected, rel=1e-12), point.name


def test_every_fit_and_held_out_point_is_predicted_and_the_untouched_set_is_refused(bench):
    v, vs = bench[0], bench[1]
    for which in ("fit", "held_out"):
        seconds = v.predictions(which, ScaleTerms())
        assert set(seconds) == {p.name for p in vs.points(which)}
        assert all(s > 0 and math.isfinite(s) for s in seconds.values())
    with pytest.raises(PermissionError):
        v.predictions("untouched", ScaleTerms())
    with pytest.raises(KeyError, match="untouched"):
        v.tree(vs.points("untouched")[0])
    assert v.untouched_records()  # predicted once: its record is committed
    with pytest.raises(SystemExit, match="predicted once already"):
        v.main(["--final"])


def test_untouched_setups_build_without_being_shown(bench):
    """Each untouched point's tree is built (its setup is consistent with the point) and no figure is read: the set is
    predicted once, by --final."""
    v, vs = bench[0], bench[1]
    for p in vs.points("untouched"):
        node = v.untouched_tree(p)
        if p.system == "nemo-rl":
            on_policy = v._NEMO_RL_SETUPS[p.name][-1]
            assert isinstance(node, v.Seq if on_policy else v.Par), p.name
            assert [leaf.label for leaf in v.leaves(node)] == ["generate", "tail", "policy log-probs",
                                                               "reference log-probs", "train"]
        else:
            assert isinstance(node, v.Leaf) and node.kind == "train" and node.ranks == p.gpus, p.name
    assert v._expert_parallel(32, 16) == 16 and v._expert_parallel(16, 4) == 4 and v._expert_parallel(8, 12) == 6


def test_verl_setups_follow_their_points(bench):
    v, vs = bench[0], bench[1]
    for p in vs.points("held_out"):
        if p.system == "verl":
            placement = v._VERL_SETUPS[p.name][0]
            assert (placement if isinstance(placement, int) else sum(placement)) == p.gpus, p.name
        else:
            actor, critic = v._ALIGNER_SETUPS[p.name][:2]
            assert (actor + critic) * 8 == p.gpus and p.nodes == actor + critic, p.name


def test_fit_recovers_known_constants_and_halves_split_the_set(bench):
    v = bench[0]
    truth = ScaleTerms(overlap=0.5, straggler_sigma=0.0, tail=True)
    trees, measured = {}, {}
    for i in range(6):  # step times with different shares of collectives, and one generation with a tail
        comm = 1.0 + i
        leaf = v.Leaf("train", 10.0 + comm, "train", 1, (("compute_seconds", 10.0), ("dp_comm_seconds", comm)))
        trees[f"p{i}"] = v.Seq((leaf, v.Leaf("tail", 0.5 * i, "tail")))
        measured[f"p{i}"] = v.evaluate(trees[f"p{i}"], truth)
    assert measured["p2"] == pytest.approx(10.0 + 3.0 - 1.5 + 1.0)
    fitted = v.fit_terms(trees, measured)
    assert (fitted.overlap, fitted.straggler_sigma, fitted.tail) == (0.5, 0.0, True)
    first, second = v.halves(list(trees))
    assert set(first) | set(second) == set(trees) and not set(first) & set(second)
    assert abs(len(first) - len(second)) <= 1
    s = v.stability(trees, measured)
    assert s["move"] == {"overlap": 0.0, "straggler_sigma": 0.0}
