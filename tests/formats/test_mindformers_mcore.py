"""MindFormers' mcore-style models (`--dialect mindformers-mcore`): Qwen3, Qwen3-MoE and DeepSeek-style MoE layers.

Oracles, MindFormers 2.1.0 installed `--no-deps` (its `use_legacy: False` models, built on CPU):
- models/qwen3/modeling_qwen3_train.py TrainingQwen3ForCausalLM and models/qwen3_moe/modeling_qwen3_moe_train.py
  TrainingQwen3MoeForCausalLM (GPTModel of parallel_core/training_graph/): interop's model.ckpt loads into them
  with strict_load;
- a GPTModel built with gpt_layer_specs.get_gpt_decoder_block_spec (what deepseek3's training model uses) with
  first_k_dense_replace = 1, shared experts with their gate and a sigmoid router with expert bias, with standard
  attention (deepseek3's multi-latent attention is refused);
- MindFormers' own HF -> MF converter ops (checkpoint/converter/convert_op.py QKVConvertOp, ConcatConvertOp
  interleaved, ExpertsConvertOp; named in models/qwen3_moe/utils.py weight_converters): the fused tensors interop
  writes equal theirs byte for byte.
"""

import numpy as np
import pytest
import torch

from helpers.hostile import run
from interop.convert import convert
from interop.io.ms_ckpt import load_ckpt
from interop.layout import ParallelLayout
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta
from helpers.ms_moe_store import moe_store

ms = pytest.importorskip("mindspore")

BASE = dict(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=4, head_dim=8, vocab=250,
            padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope",
            tied_embeddings=False, qk_norm=True)
MOE = dict(num_experts=4, moe_topk=2, moe_ffn_hidden=48)
DEEPSEEK_STYLE = dict(MOE, shared_expert_ffn_hidden=96, shared_expert_gate=True, moe_router_bias=True,
                      moe_router_score="sigmoid", moe_layers=[1])
COMMON_HF = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=8, max_position_embeddings=64, compute_dtype="float32",
                 params_dtype="float32", layernorm_compute_dtype="float32", softmax_compute_dtype="float32",
                 rotary_dtype="float32", seq_length=8)


def store(path, **changes):
    """A canonical checkpoint with random weights: (path, spec, {name: tensor})."""
    return moe_store(path, base=BASE, seed=7, **changes)


def qwen3(tied=False):
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
    return TrainingQwen3ForCausalLM(Qwen3Config(**COMMON_HF, tie_word_embeddings=tied))


def qwen3_moe(**extra):
    from mindformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from mindformers.models.qwen3_moe.modeling_qwen3_moe_train import TrainingQwen3MoeForCausalLM
    return TrainingQwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON_HF, moe_intermediate_size=48, num_experts=4,
                                                      num_experts_per_tok=2, moe_grouped_gemm=True, **extra))


def deepseek_style_gpt():
    """deepseek3's block builder (a dense first layer, then MoE with gated shared experts and a sigmoid router with
    expert bias) over Qwen3's attention: the TransformerConfig of a Qwen3-MoE model with those switched on."""
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_model import GPTModel
    model = qwen3_moe(moe_shared_expert_intermediate_size=96, use_shared_expert_gating=True,
                      moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    config = model.convert_to_transformer_config(model.config)
    config.first_k_dense_replace, config.qk_layernorm = 1, True
    return GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config),
                    vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type=config.position_embedding_type, share_embeddings_and_output_weights=False)


def strict_load(model, path):
    """Load a checkpoint strictly; returns the model's parameters by saved name and what it did not load."""
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(path)), strict_load=True)
    assert unused == [], unused
    return {p.name: p.asnumpy() for _, p in model.parameters_and_names()}, not_loaded


def read_back(tmp_path, tensors):
    """The written files read without interop's sidecar (dialect from the names, model from --model-config)."""
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    summary = convert(tmp_path / "ms", tmp_path / "back", dst_format="interop",
                      options={"model_config": str(tmp_path / "common-spec.json")})
    assert any("use_interleaved_weight_layout_mlp=True" in n for n in summary.notes), summary.notes
    back = StoreReader(tmp_path / "back")
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_dense_strict_loads_and_reads_back(tmp_path, mcore, tied):
    """Untied and tied (the tied model holds no output_layer: none is written)."""
    src, spec, tensors = store(tmp_path / "common", tied_embeddings=tied)
    summary = convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    assert any("use_interleaved_weight_layout_mlp=True" in n for n in summary.notes), summary.notes
    got, not_loaded = strict_load(qwen3(tied), tmp_path / "ms" / "model.ckpt")
    assert not_loaded == []
    assert ("output_layer.weight" in got) == (not tied)
    assert (got["decoder.layers.1.self_attention.q_layernorm.weight"]
            == tensors["layers.1.attn.q_norm.weight"].numpy()).all()
    assert (got["decoder.layers.1.self_attention.k_layernorm.weight"]
            == tensors["layers.1.attn.k_norm.weight"].numpy()).all()
    if not tied:
        assert (got["output_layer.weight"] == tensors["lm_head.weight"].numpy()).all()
    fc1 = got["decoder.layers.1.mlp.linear_fc1.weight"]  # MLPInterleaved: gate, up rows alternate
    assert (fc1[0::2] == tensors["layers.1.mlp.gate.weight"].numpy()).all()
    assert (fc1[1::2] == tensors["layers.1.mlp.up.weight"].numpy()).all()
    read_back(tmp_path, tensors)


def test_qwen3_moe_strict_loads_and_reads_back(tmp_path, mcore):
    src, spec, tensors = store(tmp_path / "common", **MOE)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    got, not_loaded = strict_load(qwen3_moe(), tmp_path / "ms" / "model.ckpt")
    # the router's accumulated load statistic is rebuilt in training, not a weight: not written
    assert sorted(not_loaded) == [f"decoder.layers.{i}.mlp.router.fi_accu" for i in range(2)], not_loaded
    w1 = got["decoder.layers.1.mlp.experts.weight1"]
    w2 = got["decoder.layers.1.mlp.experts.weight2"]
    assert w1.shape == (4 * 64, 2 * 48) and w2.shape == (4 * 48, 64)
    for e in range(4):  # ffn.py forward: weight1.reshape(E, h, 2f) (swiglu over [gate | up]), weight2 (E, f, h)
        gate, up = (tensors[f"layers.1.mlp.experts.{e}.{p}.weight"] for p in ("gate", "up"))
        assert (w1.reshape(4, 64, 96)[e] == torch.cat([gate, up]).T.numpy()).all(), e
        assert (w2.reshape(4, 48, 64)[e] == tensors[f"layers.1.mlp.experts.{e}.down.weight"].T.numpy()).all(), e
    assert (got["decoder.layers.1.mlp.router.weight"] == tensors["layers.1.mlp.router.weight"].numpy()).all()
    read_back(tmp_path, tensors)


def test_deepseek_style_moe_strict_loads_and_reads_back(tmp_path, mcore):
    src, spec, tensors = store(tmp_path / "common", **DEEPSEEK_STYLE)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    got, not_loaded = strict_load(deepseek_style_gpt(), tmp_path / "ms" / "model.ckpt")
    assert sorted(not_loaded) == ["decoder.layers.1.mlp.router.expert_load", "decoder.layers.1.mlp.router.fi_accu"]
    assert (got["decoder.layers.0.mlp.linear_fc2.weight"] == tensors["layers.0.mlp.down.weight"].numpy()).all()
    shared = got["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert (shared[0::2] == tensors["layers.1.mlp.shared.gate.weight"].numpy()).all()
    assert (shared[1::2] == tensors["layers.1.mlp.shared.up.weight"].numpy()).all()
    assert (got["decoder.layers.1.mlp.shared_experts.shared_experts_gate.weight"]
            == tensors["layers.1.mlp.shared_gate.weight"].numpy()).all()
    assert (got["decoder.layers.1.mlp.router.expert_bias"] == tensors["layers.1.mlp.router.expert_bias"].numpy()).all()
    read_back(tmp_path, tensors)


def test_a_file_mindformers_saved_reads_with_its_statistics_dropped(tmp_path, mcore):
    """MindFormers' own save of the model (with router.expert_load / fi_accu) reads back exact, the buffers noted."""
    src, spec, tensors = store(tmp_path / "common", **DEEPSEEK_STYLE)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    model = deepseek_style_gpt()
    strict_load(model, tmp_path / "ms" / "model.ckpt")
    (tmp_path / "saved").mkdir()
    ms.save_checkpoint(model, str(tmp_path / "saved" / "model.ckpt"))
    summary = convert(tmp_path / "saved", tmp_path / "back", dst_format="interop",
                      options={"model_config": str(tmp_path / "common-spec.json")})
    assert any("expert-load" in n for n in summary.notes) and any("load-balancing" in n for n in summary.notes)
    back = StoreReader(tmp_path / "back")
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


def test_fused_tensors_equal_mindformers_converter_ops(tmp_path, mcore):
    """MindFormers' HF -> MF ops (convert_op.py), parameters set as set_model_config would at tp 1 / ep 1."""
    from mindformers.checkpoint.converter.convert_op import ConcatConvertOp, ExpertsConvertOp, QKVConvertOp
    src, spec, tensors = store(tmp_path / "common", **DEEPSEEK_STYLE)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    ours = {k: v.numpy() for k, v in load_ckpt(tmp_path / "ms" / "model.ckpt").items()}
    t = {k: v.numpy() for k, v in tensors.items()}
    qkv = QKVConvertOp(hf_names=["q", "k", "v"], mf_names=["qkv"], num_attention_heads=8, num_query_groups=4,
                       kv_channels=8, hidden_size=64, tensor_model_parallel_size=1, optimizer_parallel_size=1)
    for i in range(2):
        want = qkv._hf_to_mf([t[f"layers.{i}.attn.{x}.weight"] for x in "qkv"])[0]
        assert (ours[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] == want).all(), i
    fc1 = ConcatConvertOp(hf_names=["gate", "up"], mf_names=["decoder.layers.0.mlp.linear_fc1.weight"])
    assert fc1.interleaved
    assert (ours["decoder.layers.0.mlp.linear_fc1.weight"]
            == fc1._hf_to_mf([t["layers.0.mlp.gate.weight"], t["layers.0.mlp.up.weight"]])[0]).all()
    experts = dict(num_moe_experts=4, hidden_size=64, moe_ffn_hidden_size=48, expert_parallel_size=1,
                   optimizer_parallel_size=1)
    stacked = {p: np.stack([t[f"layers.1.mlp.experts.{e}.{p}.weight"] for e in range(4)]) for p in ("gate", "up", "down")}
    w1 = ExpertsConvertOp(hf_names=["g", "u"], mf_names=["w1"], **experts)._hf_to_mf([stacked["gate"], stacked["up"]])
    w2 = ExpertsConvertOp(hf_names=["d"], mf_names=["w2"], **experts)._hf_to_mf([stacked["down"]])
    assert (ours["decoder.layers.1.mlp.experts.weight1"] == w1[0]).all()
    assert (ours["decoder.layers.1.mlp.experts.weight2"] == w2[0]).all()


def test_qwen3_dense_tp2_merged_by_transform_checkpoints(tmp_path):
    """tp 2 rank files + strategy: mindspore's own transform_checkpoints merges them into the tp 1 tensors."""
    src, spec, tensors = store(tmp_path / "common")
    convert(src, tmp_path / "ms", dst_format="mindspore", tp=2, options={"dialect": "mindformers-mcore"})
    convert(src, tmp_path / "one", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    strategy = tmp_path / "ms" / "strategy" / "strategy_stage0.json"
    (tmp_path / "src_ckpt").mkdir()
    for r in range(2):
        (tmp_path / "src_ckpt" / f"rank_{r}").mkdir()
        (tmp_path / "src_ckpt" / f"rank_{r}" / f"checkpoint_{r}.ckpt").write_bytes(
            (tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes())
    ms.transform_checkpoints(str(tmp_path / "src_ckpt"), str(tmp_path / "merged"), "merged_", str(strategy), None)
    merged = load_ckpt(next((tmp_path / "merged").rglob("*.ckpt")))
    one = load_ckpt(tmp_path / "one" / "model.ckpt")
    assert sorted(merged) == sorted(one)
    for name in one:
        assert torch.equal(merged[name], one[name]), name
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "interop", "--model-config",
                    tmp_path / "common-spec.json", "-q")
    assert code == 0, out
    back = StoreReader(tmp_path / "back")
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_first", "mixtral", "qwen2_moe", "qwen3",
                                    "qwen3_tied"])
def test_hf_through_mindformers_mcore_and_back(tmp_path, family):
    """HF -> MindFormers mcore-style -> HF, the MindSpore file read without interop's sidecar (the model from the
    HF config.json, the dialect from the names): identical tensors, and the same logits from transformers.  Qwen3-MoE (what MindFormers' qwen3_moe converts;
    also with a dense first layer, mlp_only_layers), Mixtral (routed experts), Qwen2-MoE (gated shared expert),
    Qwen3 (q/k norms)."""
    import transformers
    from helpers.hf_models import assert_same_hf
    torch.manual_seed(0)
    small = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5, num_hidden_layers=2, intermediate_size=24)
    if family.startswith("qwen3_moe"):
        dense = [0] if family == "qwen3_moe_dense_first" else []
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **small, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
            mlp_only_layers=dense))
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    elif family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=8,
                                                                       tie_word_embeddings=family == "qwen3_tied"))
    model.save_pretrained(tmp_path / "hf")
    code, out = run("convert", tmp_path / "hf", tmp_path / "ms", "--to", "mindspore", "--dialect", "mindformers-mcore",
                    "-q")
    assert code == 0, out
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in load_ckpt(tmp_path / "ms" / "model.ckpt")
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "hf", "--model-config",
                    tmp_path / "hf" / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(tmp_path / "hf", tmp_path / "back")
    # and transformers builds the same model from the config.json written back: the same logits
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(model)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, back.eval()(ids).logits)


def test_refusals_are_one_line(tmp_path):
    src, _, _ = store(tmp_path / "common", **MOE)
    code, out = run("convert", src, tmp_path / "ms", "--to", "mindspore", "--dialect", "mindformers-mcore",
                    "--tp", "2", "--ep", "3", "-q")  # 4 experts
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "ep=3 does not divide the 4 experts" in lines[0], out
    assert not (tmp_path / "ms").exists()
    # deepseek3's multi-latent attention
    convert(src, tmp_path / "mf", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    params = load_ckpt(tmp_path / "mf" / "model.ckpt")
    params["decoder.layers.0.self_attention.linear_q_down_proj.weight"] = torch.zeros(4, 64)
    (tmp_path / "mla").mkdir()
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v.numpy())} for n, v in params.items()],
                       str(tmp_path / "mla" / "model.ckpt"))
    code, out = run("convert", tmp_path / "mla", tmp_path / "back", "--to", "interop", "--model-config",
                    tmp_path / "common-spec.json", "-q")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "multi-latent attention" in lines[0], out
    assert not (tmp_path / "back").exists()


def test_adam_moments_ride_along_as_mindformers_names_them(tmp_path):
    """Adam moments as `adam_m.` / `adam_v.` + the parameter name (mindformers/core/optim/adamw.py
    clone_state(prefix="adam_m" / "adam_v")), stacked experts included; read back exact without the sidecar."""
    src, spec, tensors = store(tmp_path / "common", **MOE)
    reader = StoreReader(src)
    metas = reader.metas()
    moments = [TensorMeta(p + m.name, torch.float32, m.shape) for p in ("optim.exp_avg.", "optim.exp_avg_sq.")
               for m in metas]
    (tmp_path / "with_optim").mkdir()
    writer = StoreWriter(tmp_path / "with_optim", spec, ParallelLayout.build(2), metas + moments)
    g = torch.Generator().manual_seed(3)
    expected = {}
    for m in metas + moments:
        expected[m.name] = reader.read(m.name) if not m.name.startswith("optim.") else torch.rand(m.shape, generator=g)
        writer.write(m.name, expected[m.name])
    writer.finish({})
    convert(tmp_path / "with_optim", tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    stored = load_ckpt(tmp_path / "ms" / "model.ckpt")
    w2 = stored["adam_v.decoder.layers.1.mlp.experts.weight2"]
    assert w2.shape == (4 * 48, 64)
    assert torch.equal(w2.view(4, 48, 64)[2], expected["optim.exp_avg_sq.layers.1.mlp.experts.2.down.weight"].T)
    assert "adam_m.decoder.layers.0.self_attention.q_layernorm.weight" in stored
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    convert(tmp_path / "ms", tmp_path / "back", dst_format="interop",
            options={"model_config": str(tmp_path / "common-spec.json")})
    back = StoreReader(tmp_path / "back")
    for name, t in expected.items():
        assert torch.equal(back.read(name), t), name
