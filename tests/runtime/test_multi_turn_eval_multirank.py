"""Held-out evaluation of a multi-turn job (run.eval_every with environment.name) plays each held-out prompt's
episode through the job's environment and tools, greedily, in real `restage run`s of jobs/grpo_calculator_tiny.yaml
(issue 31), whose environment is ``graded_env.Graded`` (three turns, rewards and calls that depend on what the
random policy writes; the calculator itself rarely runs for it). The learning rate is 1e-30, so the evaluation after
step 1 sees the starting weights: what it logs equals ``episode_sums`` of the same episodes played here in-process,
on one rank and under dp2 alike."""

import dataclasses
import json

import numpy as np
import pytest
from runs import ROOT, restage_run

from restage.algorithms.base import CallContext
from restage.algorithms.interface import get_algorithm
from restage.algorithms.rewards import resolve_accuracy
from restage.config.load import load_config
from restage.data import datasets
from restage.data.tokenizer import load_tokenizer
from restage.demo import ensure_arith_model
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.report.log import read_log
from restage.runtime.step.evaluation import episode_sums
from restage.runtime.step.multi_turn import eval_episodes

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.scale]  # about 35 s: make test's time bound

JOB = ROOT / "jobs" / "grpo_calculator_tiny.yaml"
HELD_OUT = 6
ENV = "graded_env:Graded"
RUN = [str(JOB), "run.steps=1", "run.eval_every=1", "models.actor.optim.lr=1e-30", f"environment.name={ENV}"]
KEYS = ("reward", "length", "turns", "tool_call_rate", "final_score", "accuracy")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    rows = [json.loads(line) for line in (ROOT / "data" / "arith" / "prompts.jsonl").read_text().splitlines()]
    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[-HELD_OUT:]))
    return path


@pytest.fixture(scope="module")
def expected(held_out):
    """The logged means the evaluation must give: the held-out episodes of the starting weights, played here."""
    model = ensure_arith_model(ROOT)
    cfg = load_config(JOB)
    cfg = dataclasses.replace(cfg, environment=dataclasses.replace(cfg.environment, name=ENV))
    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    prompts = datasets.collate(datasets.tokenize(rows, "prompt", tokenizer, cfg.dataset.max_prompt_tokens,
                                                 cfg.dataset.max_answer_tokens), "prompt")
    records = eval_episodes(load_stage(model, Layout((0,), Strategy()), None, 0), state.graph["actor_gen"], prompts,
                            cfg, state, CallContext())
    sums = episode_sums(records, tokenizer, resolve_accuracy(cfg.reward_fn))
    # Every episode has its three turns; rewards and calls vary with what the policy wrote.
    assert sums["prompts"] == HELD_OUT and sums["turns"] == 3 * HELD_OUT
    assert 0 < sums["tool_call_rate"] < HELD_OUT and sums["reward"] > 0, sums
    return {key: sums[key] / HELD_OUT for key in KEYS}


@pytest.mark.parametrize("ranks, layouts", [
    (1, []),
    (2, ["plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 dp2"]),
], ids=["one-rank", "dp2"])
def test_multi_turn_eval_plays_the_held_out_episodes_through_the_environment(tmp_path, held_out, expected, ranks,
                                                                              layouts):
    done = restage_run(tmp_path, *RUN, "-n", str(ranks), *layouts, "dataset.eval_fraction=0", f"dataset.eval_path={held_out}",
                       "trial=eval")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    series = read_log(tmp_path / "grpo-calculator-tiny" / "eval").stat_series()
    assert series["eval/prompts"][1].tolist() == [float(HELD_OUT)]
    got = {key: float(series[f"eval/{key}"][1][0]) for key in KEYS}
    np.testing.assert_allclose([got[k] for k in KEYS], [expected[k] for k in KEYS], rtol=1e-6, err_msg=str(got))
