"""DeepSeek-V2/V3 facts in ModelSpec (multi-latent attention, multi-token prediction, group-limited routing,
YaRN) and the canonical tensors they add, at DeepSeek-V3's real widths (no tensor is built)."""
import pytest

from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.params import param_index, param_table
from interop.spec import ModelSpec, yarn_rope_scaling

# DeepSeek-V3 as its config.json states it (hidden 7168, 128 heads of 128 + 64, ranks 1536 / 512, 256 experts
# of 2048 in 8 groups, 3 dense layers, one MTP module, YaRN factor 40 from 4096 positions), 5 layers here.
V3 = dict(arch="llama", num_layers=5, hidden=7168, ffn_hidden=18432, heads=128, kv_groups=128, head_dim=192,
          vocab=129280, padded_vocab=129280, max_positions=163840, norm="rmsnorm", norm_eps=1e-6,
          activation="swiglu", position="rope", tied_embeddings=False,
          num_experts=256, moe_topk=8, moe_ffn_hidden=2048, moe_layers=[3, 4], moe_router_score="sigmoid",
          moe_router_bias=True, shared_expert_ffn_hidden=2048, moe_groups=8, moe_group_topk=4,
          moe_group_score="top2", moe_routed_scaling=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
          v_head_dim=128, rope_interleave=True, mtp_layers=1,
          rope_scaling=yarn_rope_scaling(40, 4096, 32, 1, mscale=1.0, mscale_all_dim=1.0))


def test_v3_facts_round_trip_and_a_dense_llama_dict_is_unchanged():
    spec = ModelSpec(**V3)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.is_mla and spec.qk_nope_head_dim == 128 and spec.attn_out_dim == 128 * 128
    plain = ModelSpec(**{k: V3[k] for k in ("arch", "num_layers", "hidden", "ffn_hidden", "heads", "kv_groups",
                                            "head_dim", "vocab", "padded_vocab", "max_positions", "norm",
                                            "norm_eps", "activation", "position")})
    assert not {"q_lora_rank", "kv_lora_rank", "mtp_layers", "moe_groups", "rope_interleave",
                "moe_routed_scaling", "mtp_loss_weight"} & set(plain.to_dict())


def test_mla_tensors_have_deepseek_v3_shapes_and_splits():
    index = param_index(ModelSpec(**V3))
    shapes = {n[len("layers.0.attn."):]: (p.shape, p.split) for n, p in index.items()
              if n.startswith("layers.0.attn.")}
    assert shapes == {
        "q_down.weight": ((1536, 7168), "replicated"), "q_down_norm.weight": ((1536,), "replicated"),
        "q_up.weight": ((128 * 192, 1536), "column"),
        "kv_down.weight": ((512 + 64, 7168), "replicated"), "kv_down_norm.weight": ((512,), "replicated"),
        "kv_up.weight": ((128 * (128 + 128), 512), "column"), "o.weight": ((7168, 128 * 128), "row")}
    assert "layers.0.mlp.gate.weight" in index and "layers.3.mlp.experts.255.down.weight" in index


def test_v2_lite_has_one_q_projection():
    index = param_index(ModelSpec(**dict(V3, q_lora_rank=None)))
    assert index["layers.0.attn.q.weight"].shape == (128 * 192, 7168)
    assert not [n for n in index if "q_down" in n or "q_up" in n]


def test_mtp_module_is_a_last_stage_layer_like_the_last_decoder_layer():
    spec = ModelSpec(**V3)
    table = param_table(spec)
    mtp = [p for p in table if p.name.startswith("mtp.")]
    assert table[-len(mtp):] == mtp  # after the head
    names = {p.name for p in mtp}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight", "mtp.0.final_norm.weight",
            "mtp.0.layer.attn.kv_up.weight", "mtp.0.layer.mlp.router.expert_bias",
            "mtp.0.layer.mlp.experts.255.gate.weight", "mtp.0.layer.mlp.shared.down.weight"} <= names
    assert param_index(spec)["mtp.0.eh_proj.weight"].shape == (7168, 2 * 7168)
    layout = ParallelLayout.build(5, pp=2, first_stage_layers=3)  # uneven
    assert {layout.stage_of(p) for p in mtp} == {1} and all(p.layer is None for p in mtp)
    dense_last = ModelSpec(**dict(V3, moe_layers=[2, 3]))  # the last layer dense: so is the MTP layer
    assert "mtp.0.layer.mlp.up.weight" in param_index(dense_last)


@pytest.mark.parametrize("changes, message", [
    (dict(q_lora_rank=64, kv_lora_rank=None, qk_rope_head_dim=None, v_head_dim=None),
     "q_lora_rank needs kv_lora_rank"),
    (dict(v_head_dim=None), "v_head_dim must be a positive integer"),
    (dict(kv_groups=8), "kv_groups \\(8\\) must equal heads"),
    (dict(qk_rope_head_dim=192), "must exceed qk_rope_head_dim"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim must be even"),
    (dict(qkv_bias=True), "no q/k/v biases"),
    (dict(moe_group_score=None), "needs moe_groups, moe_group_topk, moe_group_score together"),
    (dict(moe_groups=7), "must divide num_experts"),
    (dict(moe_group_topk=9), "must not exceed moe_groups"),
    (dict(moe_group_topk=1, moe_topk=40), "exceeds the experts of the 1 groups"),
    (dict(moe_group_score="mean"), "moe_group_score must be one of"),
    (dict(moe_routed_scaling=0), "moe_routed_scaling must be a positive number"),
    (dict(mtp_layers=-1), "mtp_layers must be an integer"),
    (dict(mtp_loss_weight=-0.1), "mtp_loss_weight must be a number >= 0"),
    (dict(rope_scaling=dict(yarn_rope_scaling(40, 4096), mscale=-1.0)), "mscale and mscale_all_dim must be"),
    (dict(rope_scaling={"type": "yarn", "factor": 40.0}), "rope_scaling must have exactly the keys"),
])
def test_inconsistent_deepseek_facts_are_refused(changes, message):
    with pytest.raises(InteropError, match=message):
        ModelSpec(**dict(V3, **changes))


def test_routing_facts_need_experts():
    dense = {k: v for k, v in V3.items() if not k.startswith(("moe", "num_experts", "shared"))}
    with pytest.raises(InteropError, match="moe_groups needs num_experts"):
        ModelSpec(**dense, moe_groups=8)
    with pytest.raises(InteropError, match="moe_routed_scaling needs num_experts"):
        ModelSpec(**dense, moe_routed_scaling=2.5)


def test_partial_rotary_fact_is_validated_and_absent_when_whole():
    """rotary_percent: rope on the first int(head_dim * percent) values; an odd or empty part, a percent outside
    (0, 1], or one on multi-latent attention is refused; 1.0 is left out of the stored description."""
    from interop.spec import ModelSpec
    base = dict(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=4, kv_groups=2, head_dim=16, vocab=250,
                padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu",
                position="rope")
    assert ModelSpec(**base, rotary_percent=0.5).rotary_dim == 8 and ModelSpec(**base).rotary_dim == 16
    assert "rotary_percent" not in ModelSpec(**base).to_dict()
    assert ModelSpec.from_dict(ModelSpec(**base, rotary_percent=0.25).to_dict()).rotary_percent == 0.25
    for bad, message in ((0.2, "even number"), (0.0, r"in \(0, 1\]"), (1.5, r"in \(0, 1\]"), ("half", r"in \(0, 1\]")):
        with pytest.raises(InteropError, match=message):
            ModelSpec(**base, rotary_percent=bad)
    with pytest.raises(InteropError, match="rotary_percent below 1 needs position=rope"):
        ModelSpec(**{**base, "position": "learned"}, rotary_percent=0.5)
