"""`restage submit` (and --dry-run) checks a job as `restage run` does before anything is queued, takes a cluster's
devices per node from its cluster file, and asks SLURM for whole nodes, the partition's time and PMIx's srun.

The site (sinfo, srun --mpi=list) is a fake here (restage.launch.site patched): the script must not depend on the
machine the tests run on."""

import re
from pathlib import Path

import pytest
import yaml

from restage import cli
from restage.config.sections import SlurmConfig
from restage.errors import ConfigError
from restage.launch import checks, site
from restage.launch.geometry import JobGeometry
from restage.launch.launcher import node_launcher
from restage.launch.resources import DEFAULT_TIME_MINUTES, choose_launcher, job_resources

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "results" / "assets" / "tiny-llama")
# A job written for one H200, as jobs/gpu_ppo_300m.yaml is, on the tiny model; absolute paths.
ONE_GPU = {
    "experiment": "one-gpu", "algorithm": "grpo", "reward_fn": "sort",
    "algo": {"group_size": 8, "ppo_epochs": 1, "minibatches": 2},
    "models": {"actor": {"path": TINY, "trainable": True}, "ref": {"path": TINY}},
    "dataset": {"path": str(ROOT / "data/synthetic/prompts.jsonl"), "kind": "prompt",
                "tokenizer": str(ROOT / "data/synthetic/tokenizer"), "max_prompt_tokens": 9, "max_answer_tokens": 7},
    "generation": {"max_new_tokens": 7},
    "run": {"steps": 4, "batch_size": 16},
    "plan": {"mode": "heuristic"},
    "cluster": {"name": "h200-141gb", "devices_per_node": 1},
}
H100_SITE = site.Partition("gpu", 224, 2880)  # DGX H100 nodes (2 x 56 cores, 2 threads each), two days


@pytest.fixture
def one_gpu_job(tmp_path):
    from restage.demo import ensure_tiny_model

    ensure_tiny_model(ROOT)

    def write(**updates):
        data = yaml.safe_load(yaml.safe_dump(ONE_GPU))
        data["run"]["results_dir"] = str(tmp_path / "results")
        for dotted, value in updates.items():
            node = data
            *parents, last = dotted.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
        path = tmp_path / "one_gpu.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write


@pytest.fixture
def h100_site(monkeypatch):
    monkeypatch.setattr(site, "partition", lambda name="": H100_SITE if name in ("", "gpu") else None)
    monkeypatch.setattr(site, "srun_mpi_plugins", lambda: ["pmix", "none", "cray_shasta", "pmi2"])


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", script, re.M))


def test_dry_run_for_2_by_8_h100s_from_a_one_gpu_job(one_gpu_job, h100_site, capsys):
    config = one_gpu_job()
    code = cli.main(["submit", str(config), "--dry-run", "cluster.name=h100-80gb", "cluster.nodes=2",
                     "slurm.partition=gpu", "slurm.account=proj1", "slurm.qos=high", "slurm.constraint=h100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    flags = sbatch_flags(out)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["gpus-per-node"]) == ("2", "8", "8")
    assert (flags["partition"], flags["account"], flags["qos"], flags["constraint"]) == ("gpu", "proj1", "high", "h100")
    assert "exclusive" in flags and flags["mem"] == "0" and flags["cpus-per-task"] == "28"  # 224 CPUs / 8 ranks
    assert flags["time"] == "2880"  # the partition's limit
    assert "export RESTAGE_NODES=2 RESTAGE_RANKS_PER_NODE=8 RESTAGE_GPUS_PER_NODE=8 RESTAGE_WORLD_SIZE=16" in out
    assert ("#   srun --mpi=pmix --nodes=2 --ntasks=16 --ntasks-per-node=8 --cpus-per-task=<cpus_on_node/ranks_per_node>"
            " --cpu-bind=cores") in out
    assert "# restage: --cpus-per-task=28: partition gpu's 224 CPUs per node / 8 ranks per node" in out
    assert "# restage: launcher srun: slurm.launcher=auto and this site's srun offers pmix (`srun --mpi=list`)" in out
    assert err.splitlines() == [
        f"restage: note: cluster.devices_per_node: 1 in {config} was written for cluster h200-141gb; "
        "cluster.name=h100-80gb has 8 per node (its cluster file), which the job uses: set "
        "cluster.devices_per_node=1 to keep the file's",
        "restage: checked: models, data set and a plan for 16 ranks (2 x 8) that fits"]
    assert not (config.parent / "results").exists()  # a dry run writes nothing


def test_devices_per_node_set_with_the_new_cluster_is_kept(one_gpu_job):
    config = one_gpu_job()
    same = ["cluster.name=h100-80gb", "cluster.devices_per_node=4"]
    assert checks.job_overrides(config, same) == (same, [])
    assert checks.job_overrides(config, ["cluster.nodes=2"]) == (["cluster.nodes=2"], [])
    assert checks.job_overrides(config, ["cluster.name=h200-141gb"]) == (["cluster.name=h200-141gb"], [])
    cfg, effective, notes = checks.load_job_config(config, ["cluster.name=h100-80gb"])
    assert effective[-1] == "cluster.devices_per_node=0" and len(notes) == 1
    assert cfg.cluster.devices_per_node == 0


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_missing_checkpoint_is_refused_before_anything_is_queued(one_gpu_job, h100_site, tmp_path, capsys, dry_run):
    missing = tmp_path / "no-such-model"
    config = one_gpu_job(**{"models.actor.path": str(missing)})
    code = cli.main(["submit", str(config), "cluster.name=h100-80gb", "cluster.nodes=2", *(["--dry-run"] * dry_run)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (f"restage: error: checkpoint directory {missing} does not exist; point the model's "
                                    "path at a HF model directory")
    assert not (tmp_path / "results").exists()  # no trial directory, no sbatch


@pytest.mark.parametrize("override,line", [
    ("run.batch_size=100000", "run.batch_size 100000 exceeds the"),
    ("generation.max_new_tokens=64", "generation.max_new_tokens 64 leaves no room for a prompt"),
])
def test_submit_refuses_what_run_refuses_with_the_same_line(one_gpu_job, capsys, override, line):
    """Both go through restage.launch.checks.validate: the same input gives the same one line."""
    config = one_gpu_job(**{"cluster.name": "local-cpu"})
    errors = []
    for command in (["run", str(config), "-n", "1"], ["submit", str(config), "--dry-run", "cluster.devices_per_node=1"]):
        assert cli.main([*command, override]) == 2
        out, err = capsys.readouterr()
        errors.append([ln for ln in err.splitlines() if ln.startswith("restage: error:")])
    assert errors[0] == errors[1] and len(errors[0]) == 1 and line in errors[0][0]


def test_a_job_that_does_not_fit_in_memory_is_refused(one_gpu_job, tmp_path, capsys):
    """The plan is checked too: a 70B-sized LLaMA (its config.json; no weights are read) on one H200."""
    import json

    big = tmp_path / "llama-70b-sized"
    big.mkdir()
    sizes = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128}
    (big / "config.json").write_text(json.dumps({**json.loads(Path(TINY, "config.json").read_text()), **sizes}))
    config = one_gpu_job(**{"models.actor.path": str(big), "models.ref.path": str(big)})
    code = cli.main(["submit", str(config), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert re.fullmatch(r"restage: error: actor, ref do not fit on 1 node\(s\) x 1 h200-141gb: the leanest plan needs "
                        r"[\d.]+ GiB on its fullest device, 126.9 GiB usable; it fits on \d+ nodes .*", err.strip())


def test_resources_from_the_site():
    geometry = JobGeometry(2, 8, 8)
    plugins = ["pmix_v4", "pmi2"]
    got = job_resources(SlurmConfig(), geometry, H100_SITE, plugins)
    assert (got.time_minutes, got.cpus_per_task, got.mem, got.launcher) == (2880, 28, "0", "srun")
    shared = job_resources(SlurmConfig(exclusive=False, time_minutes=30), geometry, H100_SITE, ["pmi2"])
    assert (shared.time_minutes, shared.cpus_per_task, shared.mem, shared.launcher) == (30, 0, "", "mpirun")
    unknown = job_resources(SlurmConfig(mem_gb=500), geometry, None, None)
    assert (unknown.time_minutes, unknown.cpus_per_task, unknown.mem, unknown.launcher) == (
        DEFAULT_TIME_MINUTES, 0, "500GB", "mpirun")
    unlimited = site.Partition("long", 8, None)
    assert job_resources(SlurmConfig(), JobGeometry(1, 16, 0), unlimited, plugins).time_minutes == DEFAULT_TIME_MINUTES
    assert job_resources(SlurmConfig(), JobGeometry(1, 16, 0), unlimited, plugins).cpus_per_task == 0  # 8 CPUs < 16


@pytest.mark.parametrize("slurm,message", [
    (SlurmConfig(time_minutes=3000), "slurm.time_minutes=3000 exceeds partition gpu's time limit of 2880 minutes; "
                                     "set slurm.time_minutes <= 2880"),
    (SlurmConfig(cpus_per_task=32), "slurm.cpus_per_task=32 x 8 ranks per node needs 256 CPUs, but partition gpu's "
                                    "nodes have 224; set slurm.cpus_per_task <= 28"),
    (SlurmConfig(launcher="pmi"), "slurm.launcher: 'pmi' must be one of auto, srun, mpirun"),
])
def test_resources_the_site_cannot_give_are_refused(slurm, message):
    with pytest.raises(ConfigError) as err:
        job_resources(slurm, JobGeometry(2, 8, 8), H100_SITE, ["pmix"])
    assert str(err.value).startswith(message)


def test_choose_launcher():
    assert choose_launcher("auto", ["pmix", "pmi2"])[0] == "srun"
    assert choose_launcher("auto", ["pmix_v5"])[0] == "srun"
    assert choose_launcher("auto", ["pmi2", "none"])[0] == "mpirun"
    assert choose_launcher("auto", None)[0] == "mpirun"  # no srun to ask
    assert choose_launcher("mpirun", ["pmix"])[0] == "mpirun"
    assert choose_launcher("srun", None)[0] == "srun"  # cannot be checked here: as set
    with pytest.raises(ConfigError, match=r"slurm.launcher=srun needs Slurm's PMIx plugin, but `srun --mpi=list` here "
                                          r"offers pmi2, none; set slurm.launcher=mpirun \(or auto\)"):
        choose_launcher("srun", ["pmi2", "none"])


def test_the_driver_resolves_auto_on_its_node(monkeypatch):
    monkeypatch.setattr(site, "srun_mpi_plugins", lambda: ["pmix"])
    assert (node_launcher("auto"), node_launcher("mpirun")) == ("srun", "mpirun")
    monkeypatch.setattr(site, "srun_mpi_plugins", lambda: None)
    assert node_launcher("auto") == "mpirun"


@pytest.mark.parametrize("text,minutes", [("30:00", 30), ("1-00:00:00", 1440), ("2-12:00:00", 3600), ("45", 45),
                                          ("1:30:00", 90), ("infinite", None), ("UNLIMITED", None), ("10:30", 11)])
def test_sinfo_time_limits(text, minutes):
    assert site.parse_time_limit(text) == minutes


def test_sinfo_partitions(monkeypatch):
    out = "gpu*|224|2-00:00:00\ngpu*|112|2-00:00:00\ndebug|64|30:00\n"
    monkeypatch.setattr(site, "_ask", lambda command: out)
    assert site.partition() == site.Partition("gpu", 112, 2880)  # the default; its smallest nodes
    assert site.partition("debug") == site.Partition("debug", 64, 30)
    assert site.partition("nosuch") is None


def test_a_sweep_checks_every_trial_as_submit_does_and_names_the_one_that_fails(one_gpu_job, h100_site, tmp_path,
                                                                                capsys):
    config = one_gpu_job(**{"cluster.name": "local-cpu", "cluster.devices_per_node": 1})
    missing = tmp_path / "no-such-model"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": config.name, "name": "sw",
                                     "grid": {"models.actor.path": [TINY, str(missing)]}}))
    assert cli.main(["sweep", str(sweep), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == (
        f"restage: error: sweep trial 001 {{'models.actor.path': '{missing}'}}: checkpoint directory {missing} does "
        "not exist; point the model's path at a HF model directory")
    assert not (tmp_path / "results").exists()
    sweep.write_text(yaml.safe_dump({"base": config.name, "name": "sw", "grid": {"run.batch_size": [16, 100000]}}))
    assert cli.main(["sweep", str(sweep), "--dry-run"]) == 2
    assert "sweep trial 001 {'run.batch_size': 100000}: run.batch_size 100000 exceeds the" in capsys.readouterr().err
    sweep.write_text(yaml.safe_dump({"base": config.name, "name": "sw", "grid": {"run.steps": [2, 3]}}))
    assert cli.main(["sweep", str(sweep), "--dry-run"]) == 0
    assert capsys.readouterr().out.count("#SBATCH --array=0-1%2") == 1
