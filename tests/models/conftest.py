"""Session fixture: every tiny model of model_cases.MODELS, built once."""

from __future__ import annotations

import pytest
from model_cases import MODELS


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from restage.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: str(build_tiny(root / name, seed=i, **kwargs)) for i, (name, kwargs) in enumerate(MODELS.items())}
