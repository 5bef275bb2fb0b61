"""docs/algorithms.md's worked example (an external reward and a registered algorithm) runs as written."""

import re
import sys
from pathlib import Path

import pytest

from restage.algorithms import register_algorithm
from restage.algorithms.interface import get_algorithm
from restage.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- (file: (?P<file>\S+)|run) -->\n```\w*\n(?P<code>.*?)```", re.S)


@pytest.fixture
def example(tmp_path, monkeypatch):
    blocks = list(BLOCK.finditer((ROOT / "docs" / "algorithms.md").read_text()))
    files = {m["file"]: m["code"] for m in blocks if m["file"]}
    runs = [m["code"] for m in blocks if not m["file"]]
    assert set(files) == {"myproject/rewards.py", "myproject/reinforce.py", "reinforce_tiny.yaml"} and len(runs) == 1
    for name, code in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    (tmp_path / "myproject" / "__init__.py").write_text("")
    (tmp_path / "data").symlink_to(ROOT / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield runs[0]
    for name in [m for m in sys.modules if m == "myproject" or m.startswith("myproject.")]:
        del sys.modules[name]


def test_the_documented_extension_runs(example):
    exec(compile(example, "docs/algorithms.md", "exec"), {})


def test_a_registered_short_name_and_a_module_missing_functions(example, monkeypatch):
    import restage.algorithms

    monkeypatch.setattr(restage.algorithms, "_REGISTERED", {})
    register_algorithm("reinforce", "myproject.reinforce")
    assert get_algorithm("reinforce").__name__ == "myproject.reinforce"
    register_algorithm("broken", "myproject.rewards")
    with pytest.raises(ConfigError, match="myproject.rewards lacks mfcs, validate"):
        get_algorithm("broken")
    with pytest.raises(ConfigError, match="cannot import no_such.module"):
        get_algorithm("no_such.module")
