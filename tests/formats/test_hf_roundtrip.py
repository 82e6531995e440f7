"""HF -> common format (every tp x pp that fits) -> HF is bit-exact, and loads in transformers."""
import json

import pytest
import torch
from safetensors.torch import load_file

from interop.convert import convert
from interop.store import StoreReader

LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3)]


def assert_same_files(a, b):
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for key in x:
        assert x[key].dtype == y[key].dtype, key
        assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_roundtrip_bit_exact(hf_checkpoints, tmp_path, kind, tp, pp):
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "mid", dst_format="interop", tp=tp, pp=pp)
    reader = StoreReader(tmp_path / "mid")
    assert (reader.layout.tp, reader.layout.pp) == (tp, pp)
    assert reader.spec.padded_vocab % tp == 0 and reader.spec.vocab == 250
    files = sorted(p.name for p in (tmp_path / "mid").glob("model-*.safetensors"))
    assert files == sorted(f"model-tp{t:02d}-pp{p:02d}.safetensors" for t in range(tp) for p in range(pp))
    convert(tmp_path / "mid", tmp_path / "back", dst_format="hf")
    assert_same_files(src, tmp_path / "back")
    original, again = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "back"))
    for key in ("vocab_size", "tie_word_embeddings", "num_key_value_heads", "activation_function",
                "n_inner", "rms_norm_eps", "intermediate_size"):
        assert original.get(key) == again.get(key), key
    if kind != "gpt2":  # transformers 5 writes rope_parameters, 4.x rope_theta; we write both
        theta = original.get("rope_theta") or original["rope_parameters"]["rope_theta"]
        assert again["rope_theta"] == again["rope_parameters"]["rope_theta"] == theta == 5000.0


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied"])
def test_from_pretrained_logits_identical(hf_checkpoints, tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "mid", dst_format="interop", tp=4, pp=3)
    convert(tmp_path / "mid", tmp_path / "back", dst_format="hf")
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    for path in (src, tmp_path / "back"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_vocab_padding_is_recorded_and_stripped(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "tp4", dst_format="interop", tp=4)
    reader = StoreReader(tmp_path / "tp4")
    assert (reader.spec.vocab, reader.spec.padded_vocab) == (250, 252)
    for name in ("embed.word.weight", "lm_head.weight"):
        full = reader.read(name)
        assert full.shape[0] == 252 and not full[250:].any()
        original = load_file(hf_checkpoints["llama"] / "model.safetensors")
        hf_name = "model.embed_tokens.weight" if name.startswith("embed") else "lm_head.weight"
        assert torch.equal(full[:250], original[hf_name])


def test_direct_reshard_equals_converting_from_source(hf_checkpoints, tmp_path):
    """interop(tp4, pp2) -> interop(tp1, pp3) holds the same tensors as HF -> interop(tp1, pp3)."""
    src = hf_checkpoints["gpt2"]
    convert(src, tmp_path / "a", dst_format="interop", tp=4, pp=2)
    convert(tmp_path / "a", tmp_path / "b", dst_format="interop", tp=1, pp=3)
    convert(src, tmp_path / "c", dst_format="interop", tp=1, pp=3)
    b, c = StoreReader(tmp_path / "b"), StoreReader(tmp_path / "c")
    assert b.layout == c.layout
    assert [m for m in b.metas() if m.name != "embed.word.weight"] == \
        [m for m in c.metas() if m.name != "embed.word.weight"]
    for meta in c.metas():
        want, got = c.read(meta.name), b.read(meta.name)
        if meta.name == "embed.word.weight":  # tp4 padded 250 -> 252 rows, kept as zero padding
            assert not got[want.shape[0]:].any()
            got = got[:want.shape[0]]
        assert torch.equal(want, got), meta.name


def test_reader_reads_any_box_at_any_layout(hf_checkpoints, tmp_path):
    """A tp2 reader of a tp4 checkpoint gets exactly its half of each split tensor."""
    from interop.params import param_index
    from interop.shards import shard_box
    convert(hf_checkpoints["llama"], tmp_path / "tp4", dst_format="interop", tp=4, pp=2)
    reader = StoreReader(tmp_path / "tp4")
    index = param_index(reader.spec)
    for name in ("layers.1.attn.q.weight", "layers.4.attn.o.weight", "layers.5.mlp.down.weight", "embed.word.weight"):
        full = reader.read(name)
        param = index[name]
        for rank in range(2):
            box = shard_box(param.shape, param.axis, rank, 2)
            assert torch.equal(reader.read(name, box), full[box.slices()])


def test_dtype_cast(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "bf16", dst_format="interop", tp=2, dtype="bf16")
    reader = StoreReader(tmp_path / "bf16")
    assert reader.spec.dtype == "bfloat16"
    assert all(m.dtype == torch.bfloat16 for m in reader.metas())
    convert(tmp_path / "bf16", tmp_path / "hf", dst_format="hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    original = load_file(hf_checkpoints["llama"] / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], original[key].to(torch.bfloat16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_passthrough_copies_and_its_fallback(hf_checkpoints, tmp_path, monkeypatch):
    """Unchanged row blocks go file-to-file (copy_file_range); where the kernel refuses (another
    filesystem, an old kernel) the same bytes go through a buffer."""
    import os

    from interop.io import safetensors as st
    src = hf_checkpoints["llama"]
    convert(src, tmp_path / "mid", dst_format="interop", tp=4, pp=2)
    calls = []
    real = st._copy_range
    monkeypatch.setattr(st, "_copy_range", lambda *a: (calls.append(a), real(*a))[1])
    convert(tmp_path / "mid", tmp_path / "fast", dst_format="hf")
    assert len(calls) > 30  # embeddings, head, q/k/v, gate/up, norms: every tensor but the row-split ones
    assert_same_files(src, tmp_path / "fast")

    def refuse(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    convert(tmp_path / "mid", tmp_path / "slow", dst_format="hf")
    assert_same_files(src, tmp_path / "slow")


def test_failed_background_write_surfaces_and_leaves_nothing(hf_checkpoints, tmp_path, monkeypatch):
    """Tensors are written on a helper thread during a conversion: a write that fails there (here: the disk
    fills up a few tensors in) is raised in the caller, the CLI says so in one line, and no output is left."""
    import errno
    import subprocess
    import sys

    from interop.io import background
    from interop.io import safetensors as st
    real = st.SafetensorsWriter._write_all
    written = {"calls": 0}

    def filling_up(self, data):
        written["calls"] += 1
        if written["calls"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        real(self, data)

    monkeypatch.setattr(st.SafetensorsWriter, "_write_all", filling_up)
    with pytest.raises(OSError, match="No space left"):
        convert(hf_checkpoints["gpt2"], tmp_path / "out", dst_format="interop", tp=2, pp=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert background.idle()  # nothing left in flight for the next conversion
    monkeypatch.undo()
    convert(hf_checkpoints["gpt2"], tmp_path / "out", dst_format="interop", tp=2, pp=2)  # the next one works
    assert (tmp_path / "out" / "interop.json").is_file()

    code = ("import errno, sys; from interop.io import safetensors as st\n"
            "def full(self, data): raise OSError(errno.ENOSPC, 'No space left on device', self.path)\n"
            "st.SafetensorsWriter._write_all = full\n"
            "from interop.cli.main import main; sys.argv = ['interop'] + sys.argv[1:]; main()")
    run = subprocess.run([sys.executable, "-c", code, "convert", str(hf_checkpoints["gpt2"]), str(tmp_path / "cli"),
                          "--to", "interop", "-q"], capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().startswith("error: ") and "No space left on device" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cli").exists()
