"""``plan.shard_frozen: auto``: the search may hold a frozen model 1/dp per rank of its home layout (the runtime's
``models.<m>.shard_frozen``) and does when that plan is faster; ``off`` leaves the plan as it was."""

from restage.config.load import config_from_dict
from restage.layout import Layout
from restage.plan.estimator import Estimator
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule

GIB = 2**30


def grpo_70b_reference(shard_frozen: str):
    """GRPO of a LLaMA-7B actor (ZeRO-3) against a LLaMA-70B reference on one node of 8 A100-80GB."""
    def model(arch, trainable):
        return {"arch": arch, "trainable": trainable, "dtype": "bf16", "zero_stage": 3}

    return config_from_dict({"experiment": "t", "algorithm": "grpo", "reward_fn": "sort",
                             "models": {"actor": model("llama-7b", True), "ref": model("llama-70b", False)},
                             "run": {"batch_size": 64}, "dataset": {"max_prompt_tokens": 512},
                             "generation": {"max_new_tokens": 512}, "algo": {"minibatches": 4, "group_size": 4},
                             "cluster": {"name": "a100-80gb", "nodes": 1}, "plan": {"shard_frozen": shard_frozen}})


def _plan(shard_frozen: str):
    return make_plan(grpo_70b_reference(shard_frozen), seed=0, time_budget_seconds=60, max_steps=3000,
                     with_baselines=False)


def test_the_search_shards_a_reference_that_fits_whole_on_no_data_parallel_layout():
    whole, auto = _plan("off"), _plan("auto")
    ref = auto.problem.index["ref_inf"]
    assert not whole.problem.roles["ref"].shard_frozen and auto.problem.roles["ref"].shard_frozen
    # Sharded, the reference scores on all 8 ranks data-parallel; whole, the 140 GB of a 70B model in bf16 fit
    # only split by tp x pp, which is slower.
    assert auto.plan[ref].layout == Layout.contiguous(0, auto.plan[ref].layout.strategy)
    assert auto.plan[ref].layout.strategy.dp == 8
    assert whole.plan[whole.problem.index["ref_inf"]].layout.strategy.dp < 8
    estimator = Estimator(auto.problem.cluster, engine=auto.problem.estimator.engine)
    mfc, cand = auto.problem.mfcs[ref], auto.plan[ref]
    kept = estimator.estimate(mfc, whole.problem.roles["ref"], cand.layout, cand.micro_batches)
    held = estimator.estimate(mfc, auto.problem.roles["ref"], cand.layout, cand.micro_batches)
    capacity = auto.problem.capacity_bytes
    assert kept.peak_memory_bytes > capacity >= held.peak_memory_bytes  # whole it does not fit there; sharded it does
    assert held.state_bytes * 8 == kept.state_bytes
    assert auto.evaluation.feasible and auto.evaluation.iteration_seconds < whole.evaluation.iteration_seconds
    # The choice reaches the runtime through the schedule; an unsharded schedule does not name it.
    assert build_schedule(grpo_70b_reference("auto"), auto, exact=False).models["ref"].shard_frozen
    entry = build_schedule(grpo_70b_reference("off"), whole, exact=False).models["ref"]
    assert not entry.shard_frozen and "shard_frozen" not in entry.to_json()
