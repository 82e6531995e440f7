import pytest

from helpers.hf_models import KINDS, save


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """One saved tiny HF checkpoint per kind: {kind: path}."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: _saved(root / kind, kind) for kind in KINDS}


def _saved(path, kind):
    save(kind, path)
    return path
