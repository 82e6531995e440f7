"""MindFormers Llama checkpoints as MindFormers writes and loads them.

Facts (mindspore-lab/mindformers):
- r1.3.0 / r1.3.1 mindformers/models/llama/convert_weight.py convert_qkv_concat_weight(): w_qkv =
  np.concatenate((wq, wk, wv), 0), w_gate_hidden = np.concatenate((w1, w3), 0), w_qkv.bias =
  np.concatenate of the biases; its model (llama_transformer.py) splits w_qkv's output plainly
  (hidden, kv_dim, kv_dim) and llama_layer.py splits w_gate_hidden's (hidden_dim, hidden_dim).
- r1.5.0 and later (2.1.0 installed here): convert_qkv_concat_weight() regroups the weights with
  utils/convert_utils.py qkv_concat_hf2mg (per KV group) and ffn_concat_hf2mg (gate/up interleaved), but
  still joins the biases plainly; the model reshapes w_qkv's output to (n_kv_head, (n_rep + 2) * head_dim),
  so the bias it trains and saves is grouped like the weight.
- 2.1.0 LlamaForCausalLM with tie_word_embeddings has no lm_head parameter; its converter still writes
  `lm_head.weight` when the HF file has one.

The names and shapes are checked against MindFormers 2.1.0's real LlamaForCausalLM (installed with
--no-deps by scripts/setup.sh): interop's output loads into it with strict_load and nothing left over.
Its forward pass cannot run on CPU with mindspore 2.10 (RmsNorm has no CPU kernel unless
fused_rms_norm=False, and the rotary embedding's BatchMatMul of a [b, n, s, d] tensor with a [d, d] swap
matrix is refused on CPU: "inputs shape cannot be broadcast on CPU/GPU"), so the loss is compared by
interop's own MindSpore model in test_mindspore_model.py, not here.
"""
import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import assert_same_hf
from helpers.hostile import run
from interop.convert import convert
from interop.io.ms_ckpt import load_ckpt, save_ckpt

ms = pytest.importorskip("mindspore")




def bare(src_dir, dst_dir):
    """A MindFormers single-file checkpoint without interop's sidecar, as MindFormers' tools leave it."""
    dst_dir.mkdir()
    shutil.copy(src_dir / "model.ckpt", dst_dir / "model.ckpt")
    return dst_dir


def r13_concat(tensors: dict) -> dict:
    """r1.3.0 convert_qkv_concat_weight(), re-encoded: plain [q; k; v], [w1; w3], plain bias."""
    out = dict(tensors)
    i = 0
    while f"model.layers.{i}.attention.wq.weight" in out:
        p = f"model.layers.{i}."
        out[p + "attention.w_qkv.weight"] = torch.cat([out.pop(p + f"attention.{w}.weight") for w in ("wq", "wk", "wv")])
        out[p + "feed_forward.w_gate_hidden.weight"] = torch.cat(
            [out.pop(p + "feed_forward.w1.weight"), out.pop(p + "feed_forward.w3.weight")])
        if p + "attention.wq.bias" in out:
            out[p + "attention.w_qkv.bias"] = torch.cat([out.pop(p + f"attention.{w}.bias") for w in ("wq", "wk", "wv")])
        i += 1
    return out


@pytest.fixture
def mindformers(tmp_path, monkeypatch):
    """MindFormers 2.1.0, imported from a scratch directory (it writes ./output/log on import)."""
    monkeypatch.chdir(tmp_path)
    return pytest.importorskip("mindformers")


def test_qkv_concat_without_a_layout_is_refused_with_the_flag(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": True})
    src = bare(tmp_path / "ms", tmp_path / "bare")
    code, out = run("convert", src, tmp_path / "out", "--to", "hf", "--model-config",
                    hf_checkpoints["llama"] / "config.json", "-q")
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "--qkv-layout grouped" in lines[0] and "--qkv-layout plain" in lines[0]
    assert not (tmp_path / "out").exists()


def test_r13_plain_concat_read_with_qkv_layout_plain(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    (tmp_path / "r13").mkdir()
    save_ckpt(tmp_path / "r13" / "model.ckpt", r13_concat(load_ckpt(tmp_path / "ms" / "model.ckpt")))
    code, out = run("convert", tmp_path / "r13", tmp_path / "back", "--to", "hf", "--qkv-layout", "plain",
                    "--model-config", hf_checkpoints["llama"] / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(hf_checkpoints["llama"], tmp_path / "back")
    # and written back plainly: the same bytes as the r1.3 file
    convert(hf_checkpoints["llama"], tmp_path / "ours13", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": True, "qkv_layout": "plain"})
    ours, real = load_ckpt(tmp_path / "ours13" / "model.ckpt"), load_ckpt(tmp_path / "r13" / "model.ckpt")
    assert sorted(ours) == sorted(real) and all(torch.equal(ours[k], real[k]) for k in real)


def test_mindspore_to_mindspore_names_each_sides_layout(hf_checkpoints, tmp_path):
    """MindSpore -> MindSpore: --qkv-layout is the output's, --src-qkv-layout the source's.  An r1.3 plain file
    rewritten grouped (r1.5+) equals interop's grouped output; the source's layout given only as --qkv-layout
    (ambiguous) is one error line naming --src-qkv-layout, and --qkv-layout without --qkv-concat is refused."""
    src = hf_checkpoints["llama"]
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    (tmp_path / "r13").mkdir()
    save_ckpt(tmp_path / "r13" / "model.ckpt", r13_concat(load_ckpt(tmp_path / "ms" / "model.ckpt")))
    cfg = src / "config.json"
    code, out = run("convert", tmp_path / "r13", tmp_path / "g", "--to", "mindspore", "--dialect", "mindformers",
                    "--qkv-concat", "--src-qkv-layout", "plain", "--qkv-layout", "grouped", "--model-config", cfg, "-q")
    assert code == 0, out
    convert(src, tmp_path / "ours", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": True, "qkv_layout": "grouped"})
    ours, got = load_ckpt(tmp_path / "ours" / "model.ckpt"), load_ckpt(tmp_path / "g" / "model.ckpt")
    assert sorted(ours) == sorted(got) and all(torch.equal(ours[k], got[k]) for k in ours)
    for flags in (["--qkv-concat", "--qkv-layout", "grouped"], ["--qkv-layout", "plain"]):
        code, out = run("convert", tmp_path / "r13", tmp_path / "bad", "--to", "mindspore", "--dialect",
                        "mindformers", *flags, "--model-config", cfg, "-q")
        lines = [line for line in out.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "--src-qkv-layout" in lines[0], out
        assert not (tmp_path / "bad").exists()


def test_tied_llama_with_lm_head_present_is_accepted(hf_checkpoints, tmp_path):
    src = hf_checkpoints["llama-tied"]
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    tensors = load_ckpt(tmp_path / "ms" / "model.ckpt")
    (tmp_path / "real").mkdir()
    save_ckpt(tmp_path / "real" / "model.ckpt",
              {**tensors, "lm_head.weight": tensors["model.tok_embeddings.embedding_weight"].clone()})
    summary = convert(tmp_path / "real", tmp_path / "back", dst_format="hf",
                      options={"model_config": str(src / "config.json")})
    assert_same_hf(src, tmp_path / "back")
    assert any("lm_head.weight: the tied head's copy" in n for n in summary.notes)
    save_ckpt(tmp_path / "real" / "model.ckpt",
              {**tensors, "lm_head.weight": tensors["model.tok_embeddings.embedding_weight"] + 1})
    code, out = run("convert", tmp_path / "real", tmp_path / "out", "--to", "hf", "--model-config",
                    src / "config.json", "-q")
    assert code == 2 and "lm_head.weight differs from the tied embedding" in out, out


# ---------------------------------------------------------------- the real MindFormers 2.1.0


def mf_config(mindformers, qkv_concat, tied, qkv_bias=False):
    from mindformers.models.llama import LlamaConfig
    return LlamaConfig(batch_size=1, seq_length=8, hidden_size=64, num_layers=6, num_heads=8, n_kv_heads=4,
                       vocab_size=250, intermediate_size=96, compute_dtype="float32", layernorm_compute_type="float32",
                       softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
                       use_flash_attention=False, qkv_concat=qkv_concat, use_past=False, fused_rms_norm=False,
                       tie_word_embeddings=tied, qkv_has_bias=qkv_bias)


@pytest.mark.parametrize("kind,qkv_concat", [("llama", False), ("llama", True), ("llama-tied", True)])
def test_strict_load_into_mindformers_llama(hf_checkpoints, tmp_path, mindformers, kind, qkv_concat):
    from mindformers.models.llama import LlamaForCausalLM
    convert(hf_checkpoints[kind], tmp_path / "ms", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": qkv_concat})
    model = LlamaForCausalLM(mf_config(mindformers, qkv_concat, kind == "llama-tied"))
    params = ms.load_checkpoint(str(tmp_path / "ms" / "model.ckpt"))
    not_loaded, unused = ms.load_param_into_net(model, params, strict_load=True)
    assert not_loaded == [] and unused == []
    hf = load_file(hf_checkpoints[kind] / "model.safetensors")
    got = dict(model.parameters_and_names())
    assert (got["model.layers.2.attention_norm.weight"].asnumpy()
            == hf["model.layers.2.input_layernorm.weight"].numpy()).all()
    # every tensor the model now holds equals HF's under MindFormers' names, fused (qkv_concat) by MindFormers'
    # own convert_weight.convert_qkv_concat_weight (the oracle for the grouped layout)
    from mindformers.models.llama.convert_weight import convert_qkv_concat_weight
    renames = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
               "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
               "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
               "post_attention_layernorm": "ffn_norm", "model.embed_tokens.weight": "model.tok_embeddings.embedding_weight",
               "model.norm.weight": "model.norm_out.weight"}
    expected = {}
    for name, value in hf.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        expected[name] = ms.Parameter(ms.Tensor(value.numpy()), name=name)
    if qkv_concat:
        convert_qkv_concat_weight(expected, types.SimpleNamespace(model_config={
            "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64, "intermediate_size": 96}))
    assert set(got) <= set(expected), set(got) - set(expected)
    for name, param in got.items():
        assert (param.asnumpy() == expected[name].asnumpy()).all(), name


def test_mindformers_convert_weight_output_biases_plain(hf_checkpoints, tmp_path, mindformers):
    """2.1.0's own convert_qkv_concat_weight() (run here) on a q/k/v-bias Llama: weights grouped, biases
    plain.  Read with --qkv-layout grouped --qkv-bias-layout plain: exact.  Without the bias flag the
    default (the model's grouped bias) is used and the summary says so."""
    from mindformers.models.llama.convert_weight import convert_qkv_concat_weight
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    convert(hf_checkpoints["llama"], tmp_path / "plain", dst_format="interop")
    reader = StoreReader(tmp_path / "plain")
    spec = reader.spec.replace(qkv_bias=True)
    from interop.params import param_table
    metas = [m for m in reader.metas()]
    from interop.tensors import TensorMeta
    biases = {p.name: torch.randn(p.shape) for p in param_table(spec) if p.name.endswith(("q.bias", "k.bias", "v.bias"))}
    metas += [TensorMeta(n, torch.float32, tuple(t.shape)) for n, t in biases.items()]
    order = {p.name: i for i, p in enumerate(param_table(spec))}
    metas.sort(key=lambda m: order[m.name])
    (tmp_path / "biased").mkdir()
    writer = StoreWriter(tmp_path / "biased", spec, ParallelLayout.build(6), metas)
    for m in metas:
        writer.write(m.name, biases[m.name] if m.name in biases else reader.read(m.name))
    writer.finish({})
    convert(tmp_path / "biased", tmp_path / "sep", dst_format="mindspore", options={"dialect": "mindformers"})
    param_dict = {k: ms.Parameter(ms.Tensor(v.numpy())) for k, v in load_ckpt(tmp_path / "sep" / "model.ckpt").items()}
    config = types.SimpleNamespace(model_config={"num_heads": 8, "n_kv_heads": 4, "hidden_size": 64,
                                                 "intermediate_size": 96})
    convert_qkv_concat_weight(param_dict, config)
    (tmp_path / "real").mkdir()
    ms.save_checkpoint(param_dict, str(tmp_path / "real" / "model.ckpt"))
    (tmp_path / "spec.json").write_text(json.dumps({"spec": spec.to_dict()}))

    code, out = run("convert", tmp_path / "real", tmp_path / "back", "--to", "interop", "--model-config",
                    tmp_path / "spec.json", "--qkv-layout", "grouped", "--qkv-bias-layout", "plain", "-q")
    assert code == 0, out
    again = StoreReader(tmp_path / "back")
    for m in metas:
        want = biases[m.name] if m.name in biases else reader.read(m.name)
        assert torch.equal(again.read(m.name), want), m.name

    summary = convert(tmp_path / "real", tmp_path / "assumed", dst_format="interop",
                      options={"model_config": str(tmp_path / "spec.json"), "qkv_layout": "grouped"})
    assert any("read w_qkv.bias grouped per KV group" in n and "--qkv-bias-layout plain" in n for n in summary.notes)

    # interop's own --qkv-concat output (grouped bias) is what the 2.1.0 model with qkv_has_bias loads
    from mindformers.models.llama import LlamaForCausalLM
    convert(tmp_path / "biased", tmp_path / "ours", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": True})
    model = LlamaForCausalLM(mf_config(mindformers, True, False, qkv_bias=True))
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / "ours" / "model.ckpt")),
                                                strict_load=True)
    assert not_loaded == [] and unused == []
    got = dict(model.parameters_and_names())["model.layers.1.attention.w_qkv.bias"].asnumpy().reshape(4, 4, 8)
    assert (got[:, 2].reshape(-1) == biases["layers.1.attn.k.bias"].numpy()).all()  # per group: q, q, k, v


@pytest.fixture(scope="module")
def attention_bias_llama(tmp_path_factory):
    """HF Llama with attention_bias=True (q, k, v and o biases) and mlp_bias=False."""
    import transformers
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=6,
                                      intermediate_size=96, vocab_size=250, max_position_embeddings=64,
                                      attention_bias=True, mlp_bias=False, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "llama-attn-bias"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("qkv_concat", [False, True])
def test_llama_attention_bias_without_mlp_bias_both_ways(attention_bias_llama, tmp_path, mindformers, qkv_concat):
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    convert(attention_bias_llama, tmp_path / "ms", dst_format="mindspore", tp=2, pp=2,
            options={"dialect": "mindformers", "qkv_concat": qkv_concat})
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    assert_same_hf(attention_bias_llama, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["attention_bias"], config["mlp_bias"]) == (True, False)
    convert(attention_bias_llama, tmp_path / "one", dst_format="mindspore",
            options={"dialect": "mindformers", "qkv_concat": qkv_concat})
    model = LlamaForCausalLM(LlamaConfig(
        batch_size=1, seq_length=8, hidden_size=64, num_layers=6, num_heads=8, n_kv_heads=4, vocab_size=250,
        intermediate_size=96, compute_dtype="float32", layernorm_compute_type="float32",
        softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32", use_flash_attention=False,
        qkv_concat=qkv_concat, use_past=False, fused_rms_norm=False, tie_word_embeddings=False, qkv_has_bias=True,
        attn_proj_has_bias=True))
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / "one" / "model.ckpt")),
                                                strict_load=True)
    assert not_loaded == [] and unused == []
