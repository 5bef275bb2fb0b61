"""The sbatch script of a 16-node, 8-GPU-per-node job, read as text; templates; one-line errors."""

import re

import pytest

from restage import cli
from restage.config.load import load_config
from restage.config.sections import SlurmConfig
from restage.errors import ConfigError
from restage.launch.slurm import render_template, sbatch_error, signal_delay_seconds

SITE_VARS = ["slurm.template=example-site", "slurm.template_vars.cuda_module=cuda/12.4",
             "slurm.template_vars.nccl_module=nccl/2.21", "slurm.template_vars.container_image=/img/restage.sqsh",
             "slurm.template_vars.ib_interface=ib0"]
# The self-test program: the script's text is the runtime's but for the module, and it needs no model (the runtime's
# jobs are checked and planned before the script is printed: tests/launch/test_submit_checks_on_cpu.py).
BIG = ["cluster.name=h100-80gb", "cluster.nodes=16", "cluster.devices_per_node=0",
       "slurm.partition=gpu", "slurm.account=proj1", "slurm.qos=high", "slurm.time_minutes=120", "slurm.mem_gb=512",
       "slurm.exclusive=true", "slurm.constraint=h100", "slurm.cpus_per_task=12", *SITE_VARS]


@pytest.fixture
def big_script(write_config, capsys):
    assert cli.main(["submit", str(write_config()), "--dry-run", *BIG]) == 0
    return capsys.readouterr().out


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", script, re.M))


def test_dry_run_resources(big_script):
    flags = sbatch_flags(big_script)
    assert flags["nodes"] == "16"
    assert flags["ntasks-per-node"] == "8"
    assert flags["gpus-per-node"] == "8"
    assert flags["cpus-per-task"] == "12"
    assert (flags["partition"], flags["account"], flags["qos"], flags["constraint"]) == ("gpu", "proj1", "high", "h100")
    assert (flags["time"], flags["mem"]) == ("120", "512GB")
    assert "exclusive" in flags and "requeue" in flags
    assert flags["signal"] == "B:USR2@90"  # to the driver only, 90 s before the limit
    assert flags["output"].endswith("/results/launch/t/slurm/%j_0_log.out")


def test_dry_run_rendezvous_and_binding(big_script):
    lines = big_script.splitlines()
    assert 'export RESTAGE_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)' in lines
    assert "export RESTAGE_RENDEZVOUS_HOST=${RESTAGE_HOSTS%%,*}" in lines  # the first host
    assert "export MASTER_ADDR=$RESTAGE_RENDEZVOUS_HOST" in lines
    assert "export RESTAGE_NODES=16 RESTAGE_RANKS_PER_NODE=8 RESTAGE_GPUS_PER_NODE=8 RESTAGE_WORLD_SIZE=128" in lines
    launch = next(line for line in lines if "mpirun" in line and " -n " in line)
    assert " -n 128 " in launch
    assert "--host " + ",".join(f"<host{i}>:8" for i in range(16)) in launch
    assert "restage.launch.rank restage.launch.selftest <trial_dir>/schedule.json" in launch
    assert ("# rank r runs on host r // 8 as LOCAL_RANK r % 8, CUDA_VISIBLE_DEVICES = the node's 8 GPUs, "
            "device index LOCAL_RANK") in lines
    assert "--map-by slot:PE=12 --bind-to core" in launch  # slurm.cpus_per_task=12 cores per rank
    # the driver replaces the batch shell, so the B: signal reaches it
    assert re.search(r"^exec \S+python\S* -u -m submitit.core._submit \S+/slurm$", big_script, re.M)


def test_dry_run_preamble_comes_before_the_driver(big_script):
    assert "module load cuda/12.4 nccl/2.21" in big_script
    assert "export NCCL_SOCKET_IFNAME=ib0" in big_script
    assert "--container-image=/img/restage.sqsh" in big_script
    assert big_script.index("module load") < big_script.index("export MASTER_ADDR") < big_script.index("\nexec ")
    assert "{{" not in big_script


def test_srun_launcher_line(write_config, capsys):
    assert cli.main(["submit", str(write_config()), "--dry-run", *BIG, "slurm.launcher=srun"]) == 0
    out = capsys.readouterr().out
    assert ("#   srun --mpi=pmix --nodes=16 --ntasks=128 --ntasks-per-node=8 --cpus-per-task=12 --cpu-bind=cores "
            "--kill-on-bad-exit=1") in out


GENERIC_BIG = [b for b in BIG if not b.startswith(("slurm.template", "slurm.cpus_per_task"))] + ["slurm.template=generic"]


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_dry_run_with_the_default_template_16_by_8(write_config, capsys, launcher):
    """The default template (generic) renders: it once held a literal placeholder in a comment."""
    assert cli.main(["submit", str(write_config()), "--dry-run", *GENERIC_BIG, f"slurm.launcher={launcher}"]) == 0
    script = capsys.readouterr().out
    flags = sbatch_flags(script)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["gpus-per-node"]) == ("16", "8", "8")
    assert "cpus-per-task" not in flags  # the whole node is shared out at run time: SLURM_CPUS_ON_NODE / 8
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in script
    launch = next(line for line in script.splitlines() if line.startswith("#   ") and launcher in line)
    cpus = "<cpus_on_node/ranks_per_node>"
    if launcher == "srun":
        assert launch.startswith(f"#   srun --mpi=pmix --nodes=16 --ntasks=128 --ntasks-per-node=8 --cpus-per-task={cpus} "
                                 "--cpu-bind=cores --kill-on-bad-exit=1 --export=ALL ")
    else:
        assert " -n 128 --allow-run-as-root --host " in launch or " -n 128 --host " in launch
        assert f"--map-by slot:PE={cpus} --bind-to core" in launch
        assert "-x NCCL_SOCKET_IFNAME" not in launch  # no interface configured: nothing pinned
    assert launch.endswith("restage.launch.rank restage.launch.selftest <trial_dir>/schedule.json")


def test_every_shipped_template_renders():
    from pathlib import Path

    from restage.launch.geometry import JobGeometry
    from restage.launch.slurm import template_variables

    site = {"cuda_module": "c", "nccl_module": "n", "container_image": "i", "ib_interface": "ib0"}
    cfg = load_config(Path(__file__).resolve().parents[2] / "jobs" / "ppo_tiny.yaml")
    templates = sorted((Path(__file__).resolve().parents[2] / "templates").glob("*.sh"))
    assert len(templates) >= 3
    for path in templates:
        text = render_template(path.read_text(), {**template_variables(cfg, JobGeometry(2, 2, 0)), **site}, path.name)
        code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
        assert not any("{{" in ln for ln in code), path.name


def test_a_placeholder_in_a_comment_is_no_error():
    text = "# use {{ name }} in a template\nexport A={{ a }}\n# export B={{ a }}\n"
    assert render_template(text, {"a": 1}) == "# use {{ name }} in a template\nexport A=1\n# export B=1\n"


def test_render_names_the_missing_variable():
    assert render_template("a {{ x }} b {{y}}", {"x": 1, "y": "z"}) == "a 1 b z"
    with pytest.raises(ConfigError) as err:
        render_template("module load {{ cuda_module }}\n$HOME {{ other }}", {}, "template site.sh")
    assert str(err.value) == ("template site.sh: variable 'cuda_module' has no value; set slurm.template_vars.cuda_module=..."
                              " (also missing: other)")


def test_template_variable_without_value_is_one_line(write_config, capsys):
    assert cli.main(["submit", str(write_config()), "--dry-run", "slurm.template=example-site"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "variable 'container_image' has no value; set slurm.template_vars.container_image=" in err


def test_unknown_template_is_named(write_config):
    with pytest.raises(ConfigError, match="slurm.template: 'nope' is unknown; use one of .*example-site"):
        from restage.launch.submit import prepare

        prepare(load_config(write_config(), ["slurm.template=nope"]))


def test_sbatch_error_is_one_line():
    text = ("sbatch: error: invalid partition specified: nosuch\n"
            "sbatch: error: Batch job submission failed: Invalid partition name specified")
    assert sbatch_error(RuntimeError(text)) == ("invalid partition specified: nosuch; "
                                                "Batch job submission failed: Invalid partition name specified")


def test_the_job_gets_absolute_paths_for_what_exists_here(tmp_path, monkeypatch):
    """The job may start in another directory: every relative path of the config file is made absolute against its
    directory (config/paths.py), a hub id too (refused where it is read, with the hub hint)."""
    from restage.launch.submit import resolved_dict

    (tmp_path / "model").mkdir()
    (tmp_path / "prompts.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.yaml"
    config.write_text("experiment: e\nalgorithm: sft\nmodels: {actor: {path: model}, ref: {path: org/hub-name}}\n"
                      "dataset: {path: prompts.jsonl, tokenizer: missing-dir}\nrun: {results_dir: out}\n")
    data = resolved_dict(load_config(config))
    assert data["models"]["actor"]["path"] == str(tmp_path / "model")
    assert data["models"]["ref"]["path"] == str(tmp_path / "org" / "hub-name")
    assert (data["dataset"]["path"], data["dataset"]["tokenizer"]) == (str(tmp_path / "prompts.jsonl"),
                                                                       str(tmp_path / "missing-dir"))
    assert data["run"]["results_dir"] == str(tmp_path / "out")


@pytest.mark.parametrize("limit_minutes,configured,expected", [(1, 90, 0), (2, 90, 0), (3, 90, 30), (5, 30, 30),
                                                                (5, 120, 90), (60, 90, 90)])
def test_the_signal_delay_stays_a_fallback(limit_minutes, configured, expected):
    """The --signal delay is capped so the signal, which SLURM may send a minute early, comes no sooner than halfway
    through the limit (none under 2.5 minutes): the runtime's deadline rule checkpoints before the limit."""
    assert signal_delay_seconds(SlurmConfig(time_minutes=limit_minutes, signal_delay_seconds=configured)) == expected
