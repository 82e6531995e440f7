"""The Python API a notebook user reaches for: keyword format options, progress, structured results."""
import dataclasses
import json

import pytest

from interop.convert import Summary, convert
from interop.describe import Description, describe
from interop.errors import InteropError


class FakeTqdm:
    """What convert() may rely on in a tqdm bar: update(n), a settable total, refresh()."""

    def __init__(self):
        self.total, self.n, self.refreshed = None, 0, 0

    def update(self, n):
        self.n += n

    def refresh(self):
        self.refreshed += 1


def test_format_options_as_keywords(hf_checkpoints, tmp_path):
    summary = convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2, pp=2, dialect="mindspeed")
    assert isinstance(summary, Summary)
    assert (summary.tp, summary.pp, summary.vpp) == (2, 2, 1)
    assert summary.src_format == "hf" and summary.dst_format == "mindspore"
    assert json.loads((tmp_path / "ms" / "mindspore_model.json").read_text())["dialect"] == "mindspeed"
    assert json.dumps(dataclasses.asdict(summary))  # plain data
    # the dict form still works, and a keyword wins over the same key in options
    convert(hf_checkpoints["llama"], tmp_path / "mf", dst_format="mindspore", options={"dialect": "mindspeed"},
            dialect="mindformers")
    assert json.loads((tmp_path / "mf" / "mindspore_model.json").read_text())["dialect"] == "mindformers"


def test_a_keyword_no_format_takes_is_refused(hf_checkpoints, tmp_path):
    with pytest.raises(InteropError, match="--dialect does not apply"):
        convert(hf_checkpoints["gpt2"], tmp_path / "x", dst_format="interop", dialect="mindspeed")
    assert not (tmp_path / "x").exists()


def test_progress_tqdm_bar(hf_checkpoints, tmp_path):
    bar = FakeTqdm()
    summary = convert(hf_checkpoints["gpt2"], tmp_path / "c", dst_format="interop", tp=2, progress=bar)
    assert bar.total == bar.n > 0 and bar.refreshed == 1
    assert summary.bytes == bar.total  # no cast: as many bytes written as read


def test_progress_callable(hf_checkpoints, tmp_path):
    calls = []
    convert(hf_checkpoints["gpt2"], tmp_path / "c", dst_format="interop", progress=lambda done, total: calls.append((done, total)))
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1] > 0
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len({t for _, t in calls}) == 1


def test_describe_is_structured(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["gpt2"], tmp_path / "c", dst_format="interop", tp=2, pp=3)
    info = describe(tmp_path / "c")
    assert isinstance(info, Description)
    assert (info.format, info.tp, info.pp, info.vpp) == ("interop", 2, 3, 1)
    assert info.spec["arch"] == "gpt2" and info.total["tensors"] == len(info.tensors) == 100
    q = next(t for t in info.tensors if t.name == "layers.5.attn.q.weight")
    assert q.shape == [64, 64] and q.dtype == "float32" and q.bytes == 64 * 64 * 4
    assert info.training_state() == {}
    assert "total: 100 tensors" in info.lines()[-1]
    hf = describe(hf_checkpoints["llama"], native=True)
    assert (hf.format, hf.tp, hf.pp) == ("hf", 1, 1)
    names = {t.name: t.native for t in hf.tensors}
    assert names["layers.0.attn.q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert "model.layers.0.self_attn.q_proj.weight" in "\n".join(hf.lines(native=True))


def test_inspect_native_names_and_training_state(hf_checkpoints, tmp_path):
    from click.testing import CliRunner
    from interop.cli.main import main
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron", tp=2, pp=2)
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2, dialect="mindspeed")
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "meg"), "--native"]).output
    # pipeline stage 1's first layer (global 3) is stored as its local layer 0, with q/k/v fused per group
    row = next(line for line in out.splitlines() if line.split()[:1] == ["layers.3.attn.k.weight"])
    assert "decoder.layers.0.self_attention.linear_qkv.weight (pp1) [part 2/3]" in row
    assert "training state: iteration" in out
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "ms"), "--native"]).output
    row = next(line for line in out.splitlines() if line.split()[:1] == ["layers.4.mlp.down.weight"])
    assert "language_model.encoder.layers.4." in row


def test_inspect_native_names_of_torch_dist(hf_checkpoints, tmp_path):
    """torch_dist: the layer-stacked DCP key at its global layer, with the part of a fused tensor; the
    distributed optimizer's state as its flat bucket and element range."""
    from interop.io.megatron_dist import DistCheckpoint, checkpoint_dir
    convert(hf_checkpoints["llama"], tmp_path / "dist", dst_format="megatron", tp=2, pp=2, format="torch_dist")
    info = describe(tmp_path / "dist", native=True)
    names = {t.name: t.native for t in info.tensors}
    assert names["layers.3.attn.k.weight"] == "decoder.layers.self_attention.linear_qkv.weight [layer 3] [part 2/3]"
    assert names["embed.word.weight"] == "embedding.word_embeddings.weight"
    ckpt = DistCheckpoint(checkpoint_dir(tmp_path / "dist"))  # the names are the checkpoint's own keys
    assert "decoder.layers.self_attention.linear_qkv.weight" in ckpt and "embedding.word_embeddings.weight" in ckpt
    assert not any("does not report native names" in n for n in info.notes)


def test_inspect_model_config_and_state(hf_checkpoints, tmp_path):
    """--model-config for a checkpoint without a description; the training state a trainer save holds."""
    import shutil
    from click.testing import CliRunner
    from interop.cli.main import main
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore")
    (tmp_path / "ms" / "mindspore_model.json").unlink()  # a bare .ckpt: no model description beside it
    shutil.rmtree(tmp_path / "ms" / "pt_meta")  # nor MindSpeed's saved Megatron args (they describe it: issue 22)
    bare = CliRunner().invoke(main, ["inspect", str(tmp_path / "ms"), "--no-tensors"])
    assert bare.exit_code == 2 and "--model-config" in bare.output
    ok = CliRunner().invoke(main, ["inspect", str(tmp_path / "ms"), "--no-tensors", "--model-config",
                                   str(hf_checkpoints["llama"] / "config.json")])
    assert ok.exit_code == 0, ok.output
    # MindSpeed rank files always carry the step/epoch scalars (as convert_pt2ckpt.py writes them): iteration 0
    assert "arch=llama" in ok.output and "training state: iteration 0" in ok.output
    from interop.trainer.config import TrainConfig
    from interop.trainer.launch import train
    convert(hf_checkpoints["gpt2"], tmp_path / "c", dst_format="interop")
    train(TrainConfig(load=str(tmp_path / "c"), save=str(tmp_path / "run"), steps=2, seq_length=16, quiet=True))
    info = describe(tmp_path / "run" / "step_000002")
    state = info.training_state()
    assert state["iteration"] == 2 and state["optimizer"] == "exp_avg, exp_avg_sq" and "decay_style=cosine" in state["scheduler"]
    shutil.rmtree(tmp_path / "run")
