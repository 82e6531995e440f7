import pytest


@pytest.fixture
def mcore(tmp_path, monkeypatch):
    """MindFormers with its mcore-style models switched on (use_legacy False), switched back afterwards."""
    monkeypatch.chdir(tmp_path)  # it writes ./output/log on import
    pytest.importorskip("mindformers")
    from mindformers.core.context.build_context import MFContextOperator
    from mindformers.tools.register import MindFormerConfig
    MFContextOperator.reset_instance()
    MFContextOperator(MindFormerConfig(use_legacy=False))
    yield
    MFContextOperator.reset_instance()
