import pytest
import yaml

SELFTEST = {
    "experiment": "launch",
    "algorithm": "sft",
    "trial": "t",
    "models": {"actor": {"path": "unused", "trainable": True}},
    "cluster": {"name": "local-cpu", "nodes": 1, "devices_per_node": 3},
    "run": {"steps": 4},
    "algo": {"selftest_sleep_seconds": 0.0},
    "slurm": {"template": "local", "program": "restage.launch.selftest", "time_minutes": 5},
}


@pytest.fixture(autouse=True)
def no_site(monkeypatch):
    """The scripts of these tests do not depend on this machine's SLURM (sinfo, srun): a test that needs a site
    patches restage.launch.site."""
    monkeypatch.setenv("RESTAGE_SITE_PROBE", "0")


@pytest.fixture
def write_config(tmp_path):
    """Write a self-test experiment config (results under tmp_path) with nested updates; return its path."""

    def write(name="job.yaml", **sections):
        data = yaml.safe_load(yaml.safe_dump(SELFTEST))
        data["run"]["results_dir"] = str(tmp_path / "results")
        for key, value in sections.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write
