import dataclasses

import pytest
import yaml

from restage.config.choices import DatasetKind, Execution, PlanMode
from restage.config.load import load_config
from restage.config.schema import ExperimentConfig
from restage.config.sections import ModelSpec, PlanConfig
from restage.errors import ConfigError


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("experiment: x\nalgorithm: ppo\nmodels:\n  actor: {path: a, trainable: true, optim: {lr: 1e-5}}\n")
    return path


def test_load_with_overrides(config_file):
    cfg = load_config(config_file, ["run.batch_size=4", "models.actor.dtype=bf16", "algo.kl_coef=0.05"])
    assert cfg.run.batch_size == 4
    assert cfg.models["actor"].dtype == "bf16"
    assert cfg.models["actor"].optim.lr == pytest.approx(1e-5)
    assert cfg.algo == {"kl_coef": 0.05}
    assert cfg.trial_dir == config_file.parent / "results" / "x" / "default"  # beside the config (config.paths)


@pytest.mark.parametrize("override,message", [
    ("run.foo=1", "run.foo: unknown key; known keys here: steps,"),
    ("run.steps=abc", "run.steps: expected int, got 'abc'"),
    ("models.actor.dtype=f8", "models.actor.dtype: 'f8' must be one of fp32, bf16, fp16, auto"),
    ("algorithm=ppx", "algorithm: 'ppx' is unknown"),
    ("models.actor.optim.betas=[0.9]", "models.actor.optim.betas: expected 2 values, got 1"),
    # Refused before any rank starts (they failed inside a rank's traceback, or were taken silently):
    ("models.actor.optim.lr=-1e-5", "models.actor.optim.lr: -1e-05 must be > 0"),
    ("generation.max_new_tokens=0", "generation.max_new_tokens: 0 must be >= 1"),
    ("generation.max_new_tokens=-5", "generation.max_new_tokens: -5 must be >= 1"),
    ("generation.temperature=0", "generation.temperature: 0.0 must be > 0 (for greedy decoding set generation.greedy=true)"),
    ("generation.min_p=1", "generation.min_p in [0, 1)"),
    ("generation.max_slots=0", "generation.max_slots (0) must be >= 1"),
    ("generation.kv_cache=pages", "generation.kv_cache: 'pages' must be one of auto, paged, contiguous"),
    ("generation.kv_block_tokens=-16", "generation.kv_block_tokens: -16 must be >= 0 (0: automatic)"),
    ("run.save_every=-1", "run.save_every and run.stop_at_step must be >= 0"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints: 0 must be >= 1"),
    ("run.micro_batches=10", "run.micro_batches: 10 is more than run.batch_size (8)"),
    ("run.nonfinite=ignore", "run.nonfinite: 'ignore' must be one of skip, stop"),
    ("plan.execution=asynk", "plan.execution: 'asynk' must be one of sync, async, auto"),
    ("plan.mode=greedy", "plan.mode: 'greedy' must be one of search, heuristic, manual"),
    ("dataset.kind=chat", "dataset.kind: 'chat' must be one of prompt, sft, preference"),
    ("rewards.on_error=ignore", "rewards.on_error: 'ignore' must be one of zero, stop"),
    ("rewards.on_timeout=retry", "rewards.on_timeout: 'retry' must be one of score, stop"),
    ("models.actor.optim.lr_schedule=step", "models.actor.optim.lr_schedule: 'step' must be one of constant, linear, cosine"),
    ("models.actor.zero_stage=5", "models.actor.zero_stage: 5 must be one of 0, 1, 2, 3"),
    ("models.actor.zero_stage=true", "models.actor.zero_stage: True must be one of 0, 1, 2, 3"),
    ("run.eval_every=-1", "run.eval_every: -1 must be >= 0 (0: no evaluation)"),
    ("run.threads_per_rank=-1", "run.threads_per_rank: -1 must be >= 0 (0: from the rank's cores)"),
    ("run.eval_every=5", "run.eval_every: 5 evaluates held-out prompts, but dataset.eval_fraction is 0; hold some out"),
])
def test_bad_config_gets_one_line_naming_the_key(config_file, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(config_file, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_command_line_names_stay_names(config_file):
    cfg = load_config(config_file, ["trial=off", "experiment=3", "models.actor.trainable=false"])
    assert cfg.trial == "off" and cfg.experiment == "3"
    assert cfg.models["actor"].trainable is False


def test_dtype_defaults_to_bf16_on_gpu_clusters_and_fp32_on_cpu(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("experiment: e\nalgorithm: sft\nmodels: {actor: {path: m, trainable: true}, ref: {path: m, dtype: fp32}}\n")
    gpu = load_config(path, ["cluster.name=h100-80gb"])
    assert (gpu.models["actor"].dtype, gpu.models["ref"].dtype) == ("bf16", "fp32")  # an explicit dtype stays
    assert load_config(path).models["actor"].dtype == "fp32"  # local-cpu
    assert "dtype: bf16" in gpu.to_yaml()  # the trial's config.yaml records what ran


def test_evaluation_needs_held_out_prompts_to_answer(config_file):
    cfg = load_config(config_file, ["run.eval_every=5", "dataset.eval_fraction=0.1"])
    assert (cfg.run.eval_every, cfg.dataset.eval_fraction) == (5, 0.1)
    assert load_config(config_file).run.eval_every == 0  # off unless asked
    with pytest.raises(ConfigError, match="run.eval_every: evaluation generates answers to held-out prompts, but "
                                          "dataset.kind is 'sft' \\(ppo does not generate\\); set run.eval_every=0"):
        load_config(config_file, ["run.eval_every=5", "dataset.eval_fraction=0.1", "dataset.kind=sft"])


def test_choices_are_enums_or_literals_in_files_and_in_code(config_file):
    """A file's names become the enums' members; a config built in code is checked the same way; YAML keeps names."""
    cfg = load_config(config_file, ["plan.execution=async", "plan.mode=heuristic"])
    assert (cfg.plan.execution, cfg.plan.mode, cfg.dataset.kind) == (Execution.ASYNC, PlanMode.HEURISTIC,
                                                                      DatasetKind.PROMPT)
    assert cfg.plan.execution is Execution.ASYNC
    plain = yaml.safe_load(cfg.to_yaml())
    assert (plain["plan"]["execution"], plain["plan"]["mode"], plain["dataset"]["kind"]) == ("async", "heuristic",
                                                                                            "prompt")
    assert type(plain["plan"]["execution"]) is str
    built = ExperimentConfig("x", "ppo", {"actor": ModelSpec(path="a", trainable=True)},
                             plan=PlanConfig(execution="async"))  # a plain name, as a tool may give it
    assert built.plan.execution is Execution.ASYNC
    with pytest.raises(ConfigError, match="^plan.execution: 'asynk' must be one of sync, async, auto$"):
        dataclasses.replace(built, plan=PlanConfig(execution="asynk"))
    with pytest.raises(ConfigError, match="^models.actor.dtype: 'f8' must be one of fp32, bf16, fp16, auto$"):
        ExperimentConfig("x", "ppo", {"actor": ModelSpec(path="a", dtype="f8")})
