"""The MindSpore model's loss on converted weights equals HF's loss on the originals (fp32, 1e-5)."""
import pytest
import torch

from interop.convert import convert

ms = pytest.importorskip("mindspore")
from interop.workflows.mindspore_model import load, lm_loss, logits  # noqa: E402

TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))


_REF = {}


def hf_loss_and_logits(path):
    if path in _REF:
        return _REF[path]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model(TOKENS, labels=TOKENS)
    _REF[path] = float(out.loss), out.logits
    return _REF[path]


@pytest.mark.parametrize("kind,dialect,qkv_concat", [
    ("gpt2", "mindspeed", False), ("gpt2", "mindformers", False),
    ("llama", "mindspeed", False), ("llama", "mindformers", False), ("llama", "mindformers", True),
])
def test_loss_matches_hf(hf_checkpoints, tmp_path, kind, dialect, qkv_concat):
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "ms", dst_format="mindspore",
            options={"dialect": dialect, **({"qkv_concat": True} if qkv_concat else {})})
    model = load(tmp_path / "ms")
    ref_loss, ref_logits = hf_loss_and_logits(src)
    assert abs(lm_loss(model, TOKENS.numpy()) - ref_loss) < 1e-5
    got = torch.from_numpy(logits(model, TOKENS.numpy()).asnumpy())
    assert got.shape == ref_logits.shape
    assert torch.allclose(got, ref_logits, atol=1e-4, rtol=0)


def test_loss_after_sharded_round_trip(hf_checkpoints, tmp_path):
    """HF -> mindspeed tp2 pp3 -> mindformers tp1 (vocab padded on the way) keeps the loss."""
    src = hf_checkpoints["llama-tied"]
    convert(src, tmp_path / "sharded", dst_format="mindspore", tp=4, pp=3, options={"dialect": "mindspeed"})
    convert(tmp_path / "sharded", tmp_path / "one", dst_format="mindspore", options={"dialect": "mindformers"})
    model = load(tmp_path / "one")
    assert model.spec.padded_vocab == 252 and model.spec.vocab == 250
    ref_loss, _ = hf_loss_and_logits(src)
    assert abs(lm_loss(model, TOKENS.numpy()) - ref_loss) < 1e-5
