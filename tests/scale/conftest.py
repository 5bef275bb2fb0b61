import pytest
from scale_jobs import scale_assets


@pytest.fixture(scope="session")
def scale_assets_dir(tmp_path_factory):
    """(dense model, mixture model, fixed-length prompts), made once per session."""
    return scale_assets(tmp_path_factory.mktemp("scale-assets"))
