"""HF -> MindSpore (both dialects, any tp/pp) -> HF is bit-exact; bad MindSpore input fails cleanly."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers.hf_models import assert_same_hf
from interop.cli.main import main
from interop.convert import convert
from interop.formats import names as format_names
from interop.io.ms_ckpt import CkptFile, load_ckpt, save_ckpt

DIALECTS = [("mindspeed", False), ("mindformers", False), ("mindformers", True)]


def options(dialect, qkv_concat):
    return {"dialect": dialect, **({"qkv_concat": True} if qkv_concat else {})}




def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


# qkv_concat is a MindFormers Llama variant: no GPT2 with it.
VARIANTS = [(kind, dialect, qkv) for kind in ("gpt2", "llama", "llama-tied") for dialect, qkv in DIALECTS
            if not (qkv and kind == "gpt2")]


@pytest.mark.parametrize("kind,dialect,qkv_concat", VARIANTS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 3), (4, 2)])
def test_hf_mindspore_hf_bit_exact(hf_checkpoints, tmp_path, kind, dialect, qkv_concat, tp, pp):
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "ms", dst_format="mindspore", tp=tp, pp=pp, options=options(dialect, qkv_concat))
    desc = json.loads((tmp_path / "ms" / "mindspore_model.json").read_text())
    assert (desc["dialect"], desc["layout"]["tp"], desc["layout"]["pp"]) == (dialect, tp, pp)
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    assert_same_hf(src, tmp_path / "back")


def test_mindspeed_layout_and_names(hf_checkpoints, tmp_path):
    """rank_{p * tp + t}/network.ckpt (MindSpeed-Core-MS r0.1.0 convert_pt2ckpt.py get_ms_dir_format, dp 1)."""
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2, pp=3,
            options={"dialect": "mindspeed"})
    root = tmp_path / "ms"
    ranks = sorted(p.name for p in root.glob("rank_*"))
    assert ranks == sorted(f"rank_{r}" for r in range(6))
    assert all((root / r / "network.ckpt").is_file() for r in ranks)
    with CkptFile(root / "rank_3" / "network.ckpt") as f:  # tp rank 1 of stage 1
        # global layer numbers: stage 1 of 3 holds layers 2 and 3; qkv rows per rank: 2 groups x (2 q + k + v) x 8
        assert f.meta("language_model.encoder.layers.2.attention.qkv_proj.weight")[1] == (64, 64)
        assert f.meta("language_model.encoder.layers.3.mlp.mapping.weight")[1] == (96, 64)  # [gate_r; up_r]
        assert f.meta("language_model.encoder.layers.3.mlp.projection.weight")[1] == (64, 48)
        assert not any(".layers.0." in k or ".layers.4." in k for k in f.keys())
        assert f.meta("step_num") == (torch.int64, ())
    hf = load_file(hf_checkpoints["llama"] / "model.safetensors")
    with CkptFile(root / "rank_1" / "network.ckpt") as f:
        mapping = f.read("language_model.encoder.layers.0.mlp.mapping.weight")
    assert torch.equal(mapping[:48], hf["model.layers.0.mlp.gate_proj.weight"][48:])
    assert torch.equal(mapping[48:], hf["model.layers.0.mlp.up_proj.weight"][48:])


def test_mindformers_names_qkv_concat_and_strategy(hf_checkpoints, tmp_path):
    ms = pytest.importorskip("mindspore")
    convert(hf_checkpoints["llama"], tmp_path / "one", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": True})
    hf = load_file(hf_checkpoints["llama"] / "model.safetensors")
    loaded = ms.load_checkpoint(str(tmp_path / "one" / "model.ckpt"))  # mindspore itself reads our file
    gh = loaded["model.layers.1.feed_forward.w_gate_hidden.weight"].asnumpy()
    assert (gh[0::2] == hf["model.layers.1.mlp.gate_proj.weight"].numpy()).all()
    assert (gh[1::2] == hf["model.layers.1.mlp.up_proj.weight"].numpy()).all()
    qkv = torch.from_numpy(loaded["model.layers.1.attention.w_qkv.weight"].asnumpy()).reshape(4, 4, 8, 64)
    assert torch.equal(qkv[:, 2].reshape(-1, 64), hf["model.layers.1.self_attn.k_proj.weight"])
    assert (loaded["model.tok_embeddings.embedding_weight"].asnumpy() == hf["model.embed_tokens.weight"].numpy()).all()

    convert(hf_checkpoints["llama"], tmp_path / "tp2", dst_format="mindspore", tp=2, pp=2,
            options={"dialect": "mindformers"})
    assert sorted(p.name for p in (tmp_path / "tp2").glob("rank_*")) == [f"rank_{r}" for r in range(4)]
    strategy = json.loads((tmp_path / "tp2" / "strategy" / "strategy_stage1.json").read_text())
    items = strategy["parallel_layout_item"]
    assert items["model.layers.3.attention.wq.weight"]["tensor_map"] == [0, -1]
    assert items["model.layers.3.attention.wo.weight"]["tensor_map"] == [-1, 0]
    assert items["model.norm_out.weight"]["tensor_map"] == [-1]
    assert "model.layers.0.attention.wq.weight" not in items  # stage 0's
    built = ms.build_searched_strategy(str(tmp_path / "tp2" / "strategy" / "strategy_stage1.json"))
    assert list(built["model.layers.3.attention.wq.weight"].dev_matrix[0].dim) == [2]
    for r in range(4):
        ms.load_checkpoint(str(tmp_path / "tp2" / f"rank_{r}" / f"checkpoint_{r}.ckpt"))


def test_reshard_between_mindspore_dialects(hf_checkpoints, tmp_path):
    src = hf_checkpoints["llama"]
    convert(src, tmp_path / "a", dst_format="mindspore", tp=2, pp=3, options={"dialect": "mindspeed"})
    convert(tmp_path / "a", tmp_path / "b", dst_format="mindspore", tp=4, pp=2,
            options={"dialect": "mindformers", "qkv_concat": True})
    convert(tmp_path / "b", tmp_path / "back", dst_format="hf")
    assert_same_hf(src, tmp_path / "back")


def test_optimizer_moments_ride_along(hf_checkpoints, tmp_path):
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    convert(hf_checkpoints["gpt2"], tmp_path / "plain", dst_format="interop")
    reader = StoreReader(tmp_path / "plain")
    metas = reader.metas()
    moments = [TensorMeta(p + m.name, torch.float32, m.shape) for p in ("optim.exp_avg.", "optim.exp_avg_sq.")
               for m in metas]
    (tmp_path / "with_optim").mkdir()
    writer = StoreWriter(tmp_path / "with_optim", reader.spec, ParallelLayout.build(6), metas + moments)
    g = torch.Generator().manual_seed(3)
    expected = {}
    for m in metas + moments:
        t = reader.read(m.name) if not m.name.startswith("optim.") else torch.rand(m.shape, generator=g)
        expected[m.name] = t
        writer.write(m.name, t)
    writer.finish({"iteration": 7})
    convert(tmp_path / "with_optim", tmp_path / "ms", dst_format="mindspore", tp=2, pp=2,
            options={"dialect": "mindspeed"})
    with CkptFile(tmp_path / "ms" / "rank_0" / "network.ckpt") as f:
        assert "exp_avg.language_model.encoder.layers.0.attention.qkv_proj.weight" in f
        assert "exp_avg_sq.language_model.embedding.word_embeddings.weight" in f
        assert f.read("step_num").item() == 7
    convert(tmp_path / "ms", tmp_path / "again", dst_format="interop")
    again = StoreReader(tmp_path / "again")
    assert again.source.state == {"iteration": 7, "mindspeed": {"epoch_num": 0}}
    for name, t in expected.items():
        assert torch.equal(again.read(name), t), name


def test_bare_ckpt_with_model_config(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["gpt2"], tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    (tmp_path / "bare").mkdir()
    shutil.copy(tmp_path / "ms" / "model.ckpt", tmp_path / "bare" / "gpt2.ckpt")
    code, out = run("convert", tmp_path / "bare" / "gpt2.ckpt", tmp_path / "x", "--from", "mindspore", "--to", "hf")
    assert code == 2 and "carries no model description; pass --model-config" in out
    code, out = run("convert", tmp_path / "bare" / "gpt2.ckpt", tmp_path / "back", "--from", "mindspore", "--to", "hf",
                    "--model-config", hf_checkpoints["gpt2"] / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(hf_checkpoints["gpt2"], tmp_path / "back")


def test_cli_headline_megatron_to_mindspore(hf_checkpoints, tmp_path):
    """`interop convert MEGATRON OUT --from megatron --to mindspore` from another layout, then back to HF."""
    if "megatron" not in format_names():
        pytest.skip("the Megatron converter is not registered yet")
    src = hf_checkpoints["llama"]
    code, out = run("convert", src, tmp_path / "meg", "--to", "megatron", "--tp", "2", "--pp", "2", "-q")
    assert code == 0, out
    code, out = run("convert", tmp_path / "meg", tmp_path / "ms", "--from", "megatron", "--to", "mindspore",
                    "--dialect", "mindspeed", "--tp", "4", "--pp", "3", "-q")
    assert code == 0, out
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--from", "mindspore", "--to", "hf", "-q")
    assert code == 0, out
    assert_same_hf(src, tmp_path / "back")


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


@pytest.fixture
def ms_ckpt(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    return tmp_path / "ms"


def assert_clean_failure(src, dst, *words):
    code, out = run("convert", src, dst, "--from", "mindspore", "--to", "hf", "-q")
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for word in words:
        assert word in lines[0], (word, out)
    assert not dst.exists()
    assert [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")] == []


def test_truncated_ckpt(ms_ckpt, tmp_path):
    path = ms_ckpt / "model.ckpt"
    path.write_bytes(path.read_bytes()[:-1000])
    assert_clean_failure(ms_ckpt, tmp_path / "out", "model.ckpt", "truncated")


def test_crc_mismatch(ms_ckpt, tmp_path):
    path = ms_ckpt / "model.ckpt"
    save_ckpt(path, load_ckpt(path), crc=True)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert_clean_failure(ms_ckpt, tmp_path / "out", "model.ckpt", "crc check failed")


def test_encrypted_ckpt(ms_ckpt, tmp_path):
    ms = pytest.importorskip("mindspore")
    path = ms_ckpt / "model.ckpt"
    tensors = load_ckpt(path)
    path.unlink()
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v.numpy())} for k, v in tensors.items()], str(path),
                       enc_key=b"0123456789abcdef")
    assert_clean_failure(ms_ckpt, tmp_path / "out", "model.ckpt", "encrypted")


def test_unknown_tag_layout(ms_ckpt, tmp_path):
    path = ms_ckpt / "model.ckpt"
    save_ckpt(path, {**load_ckpt(path), "model.layers.0.attention.wz.weight": torch.zeros(4, 4)})
    assert_clean_failure(ms_ckpt, tmp_path / "out", "model.layers.0.attention.wz.weight", "unknown tag layout")


def test_missing_rank_file(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2, pp=2,
            options={"dialect": "mindspeed"})
    (tmp_path / "ms" / "rank_3" / "network.ckpt").unlink()
    assert_clean_failure(tmp_path / "ms", tmp_path / "out", "rank_3", "no .ckpt file")
    shutil.rmtree(tmp_path / "ms" / "rank_3")
    assert_clean_failure(tmp_path / "ms", tmp_path / "out", "stage 1 has 1 rank files", "tp=2")


def test_mindformers_gpt2_mask_buffers_are_dropped_with_a_note(hf_checkpoints, tmp_path):
    """MindFormers' own GPT2 converter carries HF's mask buffers as attention.beta / masked_beta."""
    from interop.io.ms_ckpt import CkptFile, save_ckpt
    convert(hf_checkpoints["gpt2"], tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    path = tmp_path / "ms" / "model.ckpt"
    f = CkptFile(path)
    tensors = {k: f.read(k) for k in f.keys()}
    f.close()
    tensors["backbone.blocks.0.attention.beta"] = torch.ones(1, 1, 8, 8)
    tensors["backbone.blocks.0.attention.masked_beta"] = torch.tensor([-1e4])
    save_ckpt(path, tensors)
    summary = convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    assert any("causal-mask buffer" in n for n in summary.notes)
    assert_same_hf(hf_checkpoints["gpt2"], tmp_path / "back")


@pytest.mark.parametrize("dialect", ["mindspeed", "mindformers"])
def test_fp32_master_weights(hf_checkpoints, tmp_path, dialect):
    """A mixed-precision source (bf16 weights + fp32 masters): MindSpeed gets the masters as its weights,
    as convert_pt2ckpt.py writes them; MindFormers the weights; either way a note, never a traceback."""
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    convert(hf_checkpoints["llama"], tmp_path / "plain", dst_format="interop")
    reader = StoreReader(tmp_path / "plain")
    metas = [TensorMeta(m.name, torch.bfloat16, m.shape) for m in reader.metas()]
    masters = [TensorMeta("optim.fp32_param." + m.name, torch.float32, m.shape) for m in metas]
    (tmp_path / "mixed").mkdir()
    writer = StoreWriter(tmp_path / "mixed", reader.spec.replace(dtype="bfloat16"), ParallelLayout.build(6),
                         metas + masters)
    for m in metas:
        writer.write(m.name, reader.read(m.name).to(torch.bfloat16))
    for m in masters:
        writer.write(m.name, reader.read(m.name[len("optim.fp32_param."):]))
    writer.finish({})
    summary = convert(tmp_path / "mixed", tmp_path / "ms", dst_format="mindspore", tp=2, pp=2,
                      options={"dialect": dialect})
    assert any("fp32 master" in n for n in summary.notes)
    back = StoreReader(tmp_path / "plain")
    convert(tmp_path / "ms", tmp_path / "again", dst_format="interop")
    again = StoreReader(tmp_path / "again")
    for m in back.metas():
        want = back.read(m.name) if dialect == "mindspeed" else back.read(m.name).to(torch.bfloat16)
        assert torch.equal(again.read(m.name), want), m.name


def test_earlier_interop_layout_still_read(hf_checkpoints, tmp_path):
    """interop before the MindSpeed layout wrote `release/mp_rank_TT_PPP/model_optim_rng.ckpt`: still read."""
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2, pp=2,
            options={"dialect": "mindspeed"})
    for p in range(2):
        for t in range(2):
            folder = tmp_path / "ms" / "release" / f"mp_rank_{t:02d}_{p:03d}"
            folder.mkdir(parents=True)
            (tmp_path / "ms" / f"rank_{p * 2 + t}" / "network.ckpt").rename(folder / "model_optim_rng.ckpt")
            (tmp_path / "ms" / f"rank_{p * 2 + t}").rmdir()
    (tmp_path / "ms" / "latest_checkpointed_iteration.txt").write_text("release")
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    assert_same_hf(hf_checkpoints["llama"], tmp_path / "back")
