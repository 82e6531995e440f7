"""Mixtral and Qwen2-MoE through the HF converter and the common format at --ep, against transformers' own
MixtralForCausalLM / Qwen2MoeForCausalLM (5.23) as the oracle.

Names confirmed in transformers 5.23: `conversion_mapping.py` ("mixtral": block_sparse_moe -> mlp,
experts.E.w1/w3 -> experts.gate_up_proj, w2 -> down_proj; "qwen2_moe": experts.E.gate_proj/up_proj ->
gate_up_proj) maps the hub names onto the stacked tensors its models hold, and `save_pretrained` reverts it
(`revert_weight_conversion`), so hub checkpoints and transformers' own output both hold per-expert tensors.
Config keys: models/mixtral/configuration_mixtral.py, models/qwen2_moe/configuration_qwen2_moe.py;
Qwen2MoeDecoderLayer (modeling_qwen2_moe.py) makes layer i MoE unless i is in mlp_only_layers, when
(i + 1) % decoder_sparse_step == 0.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from helpers.hf_models import assert_same_hf
from helpers.hostile import assert_one_error, leftovers, run
from interop.convert import convert
from interop.errors import InteropError
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.store import StoreReader

transformers = pytest.importorskip("transformers")
VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)


def build(kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4,
                                            num_experts_per_tok=2, router_aux_loss_coef=0.02, sliding_window=8)
        model = transformers.MixtralForCausalLM(config)
    else:
        extra = dict(num_hidden_layers=3, mlp_only_layers=[1]) if kind == "qwen2_moe" else \
            dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False,
                 tie_word_embeddings=True)  # "qwen2_moe-sparse": MoE on layers 1 and 3
        config = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                             **extra)
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, biases and router: a swapped tensor cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    return model.eval()


KINDS = ["mixtral", "qwen2_moe", "qwen2_moe-sparse"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for kind in KINDS:
        model = build(kind)
        model.save_pretrained(root / kind)
        with torch.no_grad():
            out[kind] = (root / kind, model(TOKENS).logits)
    return out


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp, ep", [(1, 1), (1, 2), (2, 2)])
def test_hf_to_interop_to_hf_is_bit_exact_and_transformers_loads_it(sources, tmp_path, kind, tp, ep):
    src, logits = sources[kind]
    convert(src, tmp_path / "store", dst_format="interop", tp=tp, ep=ep)
    convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    assert_same_hf(src, tmp_path / "hf")
    source_config, config = (json.loads((p / "config.json").read_text()) for p in (src, tmp_path / "hf"))
    assert config["architectures"] == source_config["architectures"]
    assert torch.equal(hf_logits(tmp_path / "hf"), logits)


def test_mixtral_names_are_the_hub_ones(sources, tmp_path):
    """What Mixtral-8x7B-v0.1 on the hub holds: block_sparse_moe.gate and experts.E.w1/w2/w3 (w1 gate, w3 up)."""
    src, _ = sources["mixtral"]
    convert(src, tmp_path / "hf", dst_format="hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        w1 = f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w1.weight")
        w3 = f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= keys
    assert not any(".mlp." in k for k in keys)
    fused = build("mixtral").model.layers[1].mlp.experts.gate_up_proj[3]  # transformers' [gate; up] stacking
    assert torch.equal(fused, torch.cat([w1, w3]))


def test_store_at_ep2_puts_each_expert_with_its_rank(sources, tmp_path):
    src, _ = sources["qwen2_moe"]
    convert(src, tmp_path / "store", dst_format="interop", tp=2, ep=2)
    manifest = json.loads((tmp_path / "store" / "interop.json").read_text())
    assert manifest["layout"]["ep"] == 2
    tensors = manifest["tensors"]
    for e in range(4):
        for part in ("gate", "up", "down"):
            files = [s["file"] for s in tensors[f"layers.0.mlp.experts.{e}.{part}.weight"]["shards"]]
            assert files == [f"model-tp{t:02d}-pp00-ep{e // 2:02d}.safetensors" for t in range(2)]
    for name in ("layers.0.mlp.router.weight", "layers.0.mlp.shared_gate.weight"):  # replicated: tp 0, no ep
        assert [s["file"] for s in tensors[name]["shards"]] == ["model-tp00-pp00.safetensors"]
    assert [s["file"] for s in tensors["layers.0.mlp.shared.up.weight"]["shards"]] == \
        ["model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"]
    assert "layers.1.mlp.experts.0.up.weight" not in tensors  # layer 1 is dense (mlp_only_layers)
    with safe_open(tmp_path / "store" / "model-tp01-pp00-ep01.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(f"layers.{i}.mlp.experts.{e}.{p}.weight" for i in (0, 2) for e in (2, 3)
                                          for p in ("gate", "up", "down"))
        assert f.get_slice("layers.0.mlp.experts.3.down.weight").get_shape() == [32, 8]  # tp 1's columns
    # an ep rank's reader opens only its own experts' files
    reader = StoreReader(tmp_path / "store")
    try:
        reader.read("layers.0.mlp.experts.3.up.weight")
        assert sorted(reader._files) == ["model-tp00-pp00-ep01.safetensors", "model-tp01-pp00-ep01.safetensors"]
    finally:
        reader.close()
    code, out = run("inspect", tmp_path / "store", "--no-tensors")
    assert code == 0 and "ep=2" in out and "experts: 4 routed, top-2, each ffn 16, shared expert 24, on layers [0, 2]" in out
    code, out = run("inspect", tmp_path / "store", "--json", "--no-tensors")
    info = json.loads(out)
    assert code == 0 and info["ep"] == 2 and (info["spec"]["num_experts"], info["spec"]["moe_topk"]) == (4, 2)


def test_resharding_ep_down_and_up_keeps_every_tensor(sources, tmp_path):
    src, _ = sources["mixtral"]
    convert(src, tmp_path / "ep2", dst_format="interop", tp=2, ep=2)
    convert(tmp_path / "ep2", tmp_path / "ep1", dst_format="interop", ep=1)
    convert(tmp_path / "ep1", tmp_path / "ep4", dst_format="interop", ep=4, pp=2)
    readers = [StoreReader(tmp_path / name) for name in ("ep2", "ep1", "ep4")]
    try:
        assert not any("-ep" in name for name in readers[1].manifest["files"])
        assert readers[2].layout.ep == 4
        for meta in readers[0].metas():
            want = readers[0].read(meta.name)
            assert all(torch.equal(r.read(meta.name), want) for r in readers[1:]), meta.name
    finally:
        for r in readers:
            r.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen2_moe-sparse"])
def test_config_round_trips_through_the_spec(sources, kind):
    src, _ = sources[kind]
    config = json.loads((src / "config.json").read_text())
    spec = spec_from_hf_config(config)
    assert spec.num_experts == 4 and spec.moe_topk == 2
    if kind == "mixtral":
        assert (spec.moe_ffn_hidden, spec.moe_layers, spec.moe_norm_topk, spec.sliding_window) == (24, None, True, 8)
        assert spec.moe_aux_loss_coeff == 0.02 and spec.rope_base == 1e6 and not spec.tied_embeddings
    elif kind == "qwen2_moe":
        assert (spec.moe_ffn_hidden, spec.ffn_hidden, spec.shared_expert_ffn_hidden) == (16, 48, 24)
        assert spec.moe_layers == [0, 2] and spec.shared_expert_gate and not spec.moe_norm_topk and spec.qkv_bias
    else:
        assert spec.moe_layers == [1, 3] and spec.moe_norm_topk and not spec.qkv_bias and spec.tied_embeddings
    assert spec_from_hf_config(json.loads(json.dumps(hf_config_from_spec(spec)))) == spec


def test_what_hf_cannot_hold_is_refused_before_writing(sources, tmp_path):
    spec = spec_from_hf_config(json.loads((sources["mixtral"][0] / "config.json").read_text()))
    for changes, words in ((dict(moe_router_score="sigmoid"), "a sigmoid router"),
                           (dict(moe_norm_topk=False), "Mixtral always renormalises"),
                           (dict(moe_layers=[1]), "dense layers"),
                           (dict(qk_norm=True), "q/k norms"),
                           (dict(shared_expert_ffn_hidden=16), "shared expert without its sigmoid gate")):
        with pytest.raises(InteropError, match=words):
            hf_config_from_spec(spec.replace(**changes))


@pytest.mark.parametrize("args, words", [
    (["--to", "interop", "--ep", "3"], ["ep=3 does not divide the 4 experts"]),
    (["--to", "interop", "--ep", "0"], ["--ep must be a positive integer"]),
    (["--to", "hf", "--ep", "2"], ["not sharded", "--ep 1"]),
    (["--to", "megatron", "--ep", "3"], ["ep=3 does not divide the 4 experts"]),
    (["--to", "mindspore", "--dialect", "mindformers", "--ep", "2"], ["MindFormers MoE output is written at --ep 1"]),
])
def test_bad_targets_are_one_error_line_and_leave_nothing(sources, tmp_path, args, words):
    dst = tmp_path / "out"
    code, out = run("convert", sources["mixtral"][0], dst, "-q", *args)
    assert_one_error(code, out, *words)
    assert not dst.exists() and not leftovers(dst)


def test_ep_on_a_dense_model_is_refused(tmp_path):
    from helpers.hf_models import save
    save("llama", tmp_path / "llama")
    code, out = run("convert", tmp_path / "llama", tmp_path / "out", "--to", "interop", "--ep", "2", "-q")
    assert_one_error(code, out, "needs a mixture-of-experts model")


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_transformers_stacked_experts_are_read_and_written_with_hub_names(sources, tmp_path, kind):
    """`save_pretrained(save_original_format=False)` writes the model's own stacked experts
    (mlp.experts.gate_up_proj [E, 2 ffn, h], down_proj [E, h, ffn]; Mixtral's router as mlp.gate)."""
    src, logits = sources[kind]
    build(kind).save_pretrained(tmp_path / "stacked", save_original_format=False)
    with safe_open(tmp_path / "stacked" / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    convert(tmp_path / "stacked", tmp_path / "store", dst_format="interop", ep=2)
    convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    assert_same_hf(src, tmp_path / "hf")
    assert torch.equal(hf_logits(tmp_path / "hf"), logits)


def test_router_training_settings_are_carried_to_hf_and_named(tmp_path):
    model = build("mixtral")
    model.config.output_router_logits = True
    model.config.router_jitter_noise = 0.01
    model.save_pretrained(tmp_path / "src")
    code, out = run("convert", tmp_path / "src", tmp_path / "hf", "--to", "hf", "-q")
    assert code == 0 and "output_router_logits=True, router_jitter_noise=0.01: router training settings" in out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["output_router_logits"] is True and config["router_jitter_noise"] == 0.01


def test_verify_runs_moe_in_the_reference_model(sources, tmp_path):
    """verify's reference model (the trainer's decoder, with its MoE layer) and transformers' Mixtral (sliding
    window) agree on the store converted at ep 2."""
    src, _ = sources["mixtral"]
    convert(src, tmp_path / "store", dst_format="interop", ep=2)
    code, out = run("verify", src, tmp_path / "store")
    assert code == 0 and "reference model, converted (interop)" in out and out.strip().endswith("OK"), out


def test_a_pre_softmax_router_is_refused_for_hf_unless_asked(sources, tmp_path):
    """mbridge builds Mixtral with moe_router_pre_softmax (top-k of the softmax, not renormalised) and Megatron
    saves it in the args: HF Mixtral always renormalises, so the default refuses and names the flag;
    --renormalize-topk writes HF Mixtral with the same tensors, a note says the rule changed, and verify shows
    what it changes."""
    src, _ = sources["mixtral"]
    convert(src, tmp_path / "meg", dst_format="megatron")
    for path in (tmp_path / "meg").glob("*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["args"].moe_router_pre_softmax = True  # as mbridge's Mixtral config sets it
        torch.save(state, path)
    code, out = run("convert", tmp_path / "meg", tmp_path / "hf", "--to", "hf")
    assert_one_error(code, out, "top-k probabilities left unnormalised", "--renormalize-topk")
    assert not (tmp_path / "hf").exists()
    code, out = run("convert", tmp_path / "meg", tmp_path / "hf", "--to", "hf", "--renormalize-topk")
    assert code == 0 and "the HF router renormalises each token's top-k expert probabilities" in out, out
    assert "interop verify runs both and shows the logit difference" in out
    assert_same_hf(src, tmp_path / "hf")  # the tensors are Mixtral's own
    code, out = run("verify", tmp_path / "meg", tmp_path / "hf")
    assert code == 1 and "FAIL" in out and "computes moe_norm_topk=True, the source moe_norm_topk=False" in out, out


# The hub's config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen1.5-MoE-A2.7B (written by transformers 4.36 /
# 4.39: rope_theta at the top, no qkv_bias or mlp_only_layers key), with 2 layers instead of 32 / 24 to stay small.
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 8,
                "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
              "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
              "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 2, "num_key_value_heads": 16,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
              "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
              "router_aux_loss_coef": 0.001}


@pytest.mark.parametrize("config", [MIXTRAL_8X7B, QWEN15_MOE], ids=["mixtral-8x7b", "qwen1.5-moe"])
def test_real_configs_describe_the_model_transformers_builds(config):
    """The spec read from a real config.json, written back, makes transformers build a model with exactly the
    canonical table's parameters (counted on the meta device: nothing is allocated)."""
    import math
    from interop.params import param_table
    spec = spec_from_hf_config(config, "bfloat16")
    written = transformers.AutoConfig.for_model(**hf_config_from_spec(spec))
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "rms_norm_eps", "num_key_value_heads", "vocab_size",
                "intermediate_size") + (("num_local_experts",) if config["model_type"] == "mixtral" else
                                        ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                                         "norm_topk_prob", "decoder_sparse_step")):
        assert getattr(written, key) == config[key], key
    assert written.rope_parameters["rope_theta"] == config["rope_theta"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(written)
    assert sum(p.numel() for p in model.parameters()) == sum(math.prod(p.shape) for p in param_table(spec))


def test_a_dense_size_mixtral_cannot_hold_is_named(sources, tmp_path):
    """Megatron's --ffn-hidden-size may differ from --moe-ffn-hidden-size; HF Mixtral has only the experts' width."""
    convert(sources["mixtral"][0], tmp_path / "store", dst_format="interop")
    manifest = json.loads((tmp_path / "store" / "interop.json").read_text())
    manifest["spec"]["ffn_hidden"] = 64
    (tmp_path / "store" / "interop.json").write_text(json.dumps(manifest))
    summary = convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    assert any("ffn_hidden 64 not written" in n for n in summary.notes)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["intermediate_size"] == 24
    assert_same_hf(sources["mixtral"][0], tmp_path / "hf")


def test_optimizer_state_of_an_expert_goes_with_its_ep_rank(sources):
    from interop.layout import ParallelLayout
    from interop.params import param_table
    from interop.store import plan_shards
    from interop.tensors import TensorMeta
    spec = spec_from_hf_config(json.loads((sources["mixtral"][0] / "config.json").read_text()))
    metas = [TensorMeta(prefix + p.name, torch.float32, p.shape) for prefix in ("", "optim.exp_avg.")
             for p in param_table(spec)]
    placement, _ = plan_shards(spec, ParallelLayout.build(2, tp=2, ep=2), metas)
    assert [f for f, _ in placement["optim.exp_avg.layers.1.mlp.experts.2.down.weight"]] == \
        ["optim-tp00-pp00-ep01.safetensors", "optim-tp01-pp00-ep01.safetensors"]
    assert [f for f, _ in placement["optim.exp_avg.layers.1.mlp.router.weight"]] == ["optim-tp00-pp00.safetensors"]
