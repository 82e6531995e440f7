"""megatron-core itself as the reference: real mcore models (tp 1 and 2, CPU/gloo) saved as
Megatron-LM saves them, converted by interop to HF, give HF the same loss within 1e-5 (fp32);
and HF -> interop -> torch_dist loads into real mcore models with HF's loss.

One spawned group of 2 processes runs every mcore model (see megatron_ref).
"""
import argparse

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

import torch  # noqa: E402

import helpers.megatron_ref as R  # noqa: E402
from interop.convert import convert  # noqa: E402
from interop.formats import names as format_names  # noqa: E402

TOL = 1e-5
CASES = [(kind, tp) for kind in R.KINDS for tp in R.TPS]
# Which interop format reads each Megatron on-disk format.
SOURCE_FORMAT = {"torch": "megatron", "torch_dist": "megatron"}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return R.reference_once(tmp_path_factory)


def test_legacy_layout_is_megatron_lms(ref):
    root, _ = ref
    for kind, tp in CASES:
        save = R.legacy_dir(root, kind, tp)
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
        ranks = sorted(p.name for p in (save / "iter_0000001").iterdir())
        assert ranks == [f"mp_rank_{t:02d}" for t in range(tp)]
        state = torch.load(save / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 1
        assert isinstance(state["args"], argparse.Namespace) and state["args"].tensor_model_parallel_size == tp
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in state["model"]


def test_torch_dist_layout_is_megatron_lms(ref):
    root, _ = ref
    for kind, tp in CASES:
        folder = R.dist_dir(root, kind, tp) / "iter_0000001"
        names = {p.name for p in folder.iterdir()}
        assert {".metadata", "common.pt", "metadata.json"} <= names and any(n.endswith(".distcp") for n in names)


def test_llama_loss_does_not_depend_on_tp(ref):
    """Same seed, same global weights (no TP-sharded biases in Llama): tp 1 and tp 2 agree."""
    _, results = ref
    assert abs(results["llama-tp1"]["loss"] - results["llama-tp2"]["loss"]) < TOL


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("kind,tp", CASES)
def test_megatron_to_hf_loss_equals_mcore(ref, tmp_path, kind, tp, fmt):
    root, results = ref
    src_format = SOURCE_FORMAT[fmt]
    if src_format not in format_names():
        pytest.skip(f"no interop reader for Megatron {fmt} yet ({src_format!r} not registered)")
    src = (R.legacy_dir if fmt == "torch" else R.dist_dir)(root, kind, tp)
    convert(src, tmp_path / "hf", src_format=src_format, dst_format="hf")
    hf, mcore = R.hf_loss(tmp_path / "hf"), results[f"{kind}-tp{tp}"]["loss"]
    assert abs(hf - mcore) < TOL, f"{kind} tp={tp} {fmt}: HF {hf} vs megatron-core {mcore}"


@pytest.mark.parametrize("label", ["hf", "torch_hf"], ids=["torch_dist", "torch"])
@pytest.mark.parametrize("kind,tp", CASES)
def test_hf_to_megatron_loads_into_mcore_with_hf_loss(ref, kind, tp, label):
    """torch_dist: one global checkpoint loaded at tp 1 and tp 2; torch: rank files written at that tp."""
    root, results = ref
    loaded = results[f"{kind}-tp{tp}"].get(f"loaded_loss:{label}")
    if loaded is None:
        pytest.skip("no interop writer for this Megatron format yet")
    hf = R.hf_loss(root / "hf" / kind)
    assert abs(loaded - hf) < TOL, f"{kind} tp={tp}: megatron-core {loaded} vs HF {hf}"


def test_torch_dist_reads_as_the_merged_legacy_ranks(ref):
    """The same model saved both ways: each torch_dist tensor is the legacy rank shards merged
    (qkv/fc1 rows and proj columns over TP; fc1 as [gate_0; gate_1; up_0; up_1])."""
    root, _ = ref
    from interop.converters.megatron.torch_dist import Reader as DistReader
    from interop.converters.megatron.torch_format import Reader as TorchReader

    for kind in R.KINDS:
        a, b = DistReader(R.dist_dir(root, kind, 2)), TorchReader(R.legacy_dir(root, kind, 2))
        assert a.spec == b.spec
        for ma, mb in zip(a.metas(), b.metas()):
            assert ma == mb and torch.equal(a.read(ma.name), b.read(mb.name)), ma.name
