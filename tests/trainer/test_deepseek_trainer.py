"""The reference trainer on DeepSeek-V3 / V2 models: multi-latent attention (compression norms, decoupled rope,
interleaved pairs, YaRN with mscale), group-limited sigmoid routing with the correction bias, routed scaling,
shared experts and dense first layers give transformers' own logits and gradients; `interop parity` trains it
at 1x1, tp 2, pp 2 and ep 2 beside transformers' model within 1e-5 over 10 steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.deepseek_models import build, save, v2_config, v3_config
from interop.convert import convert
from interop.layout import ParallelLayout
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.grid import Grid
from interop.trainer.mla import MLAttention
from interop.trainer.model import Stage, rope_tables
from interop.trainer.moe import MoE, route
from interop.workflows.parity import parity, parse_layouts

transformers = pytest.importorskip("transformers")
CASES = {"v3-yarn-interleaved": lambda: v3_config(),
         "v3-halves-no-yarn": lambda: v3_config(rope_interleave=False, rope_parameters={"rope_type": "default",
                                                                                          "rope_theta": 5000.0}),
         "v2-lite-groups": lambda: v2_config(),
         "v2-q-compressed-greedy": lambda: v2_config(q_lora_rank=24, topk_method="greedy")}


def stage_from(path, tmp_path) -> Stage:
    """The reference model of an HF checkpoint, its tensors read through interop's HF reader."""
    convert(path, tmp_path / "store", dst_format="interop")
    store = StoreReader(tmp_path / "store")
    spec = store.source.spec
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    mine = dict(stage.named_tensors())
    assert sorted(mine) == sorted(m.name for m in store.metas())
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(store.read(name))
    return stage.eval()


def stage_logits(stage: Stage, tokens):
    x = stage.embed(tokens)
    rope = rope_tables(stage.spec, tokens.shape[1])
    for block in stage.layers.values():
        x = block(x, rope)
    return F.linear(stage.final_norm(x), stage.lm_head.weight)[..., :stage.spec.vocab]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_equal_transformers(case, tmp_path):
    model = save(CASES[case](), tmp_path / "hf")
    stage = stage_from(tmp_path / "hf", tmp_path)
    assert isinstance(stage.layers["0"].attn, MLAttention) and isinstance(stage.layers["1"].mlp, MoE)
    assert not isinstance(stage.layers["0"].mlp, MoE)  # first_k_dense_replace
    tokens = torch.randint(0, stage.spec.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = stage_logits(stage, tokens), model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5
    targets = tokens.roll(-1, 1)
    stage(tokens, targets).backward()
    F.cross_entropy(model(tokens).logits.reshape(-1, stage.spec.vocab), targets.reshape(-1)).backward()
    convert_names = {"self_attn.q_a_proj": "attn.q_down", "self_attn.kv_b_proj": "attn.kv_up",
                     "self_attn.kv_a_proj_with_mqa": "attn.kv_down", "self_attn.o_proj": "attn.o",
                     "mlp.shared_experts.up_proj": "mlp.shared.up", "mlp.gate": "mlp.router"}
    grads = dict(stage.named_parameters())
    for name, p in model.named_parameters():
        for hf, ours in convert_names.items():
            if name.startswith("model.layers.") and f".{hf}.weight" in name:
                canonical = name.replace("model.", "", 1).replace(hf, ours)
                assert (grads[canonical].grad - p.grad).abs().max() < 1e-5, name


def test_group_limited_routing_is_transformers_router():
    """DeepSeek-V3's router (sigmoid + correction bias for the choice, top-2-sum groups, renormalised, scaled) and
    DeepSeek-V2's (softmax, best-score groups, unnormalised, scaled) choose transformers' experts with its weights."""
    for config in (v3_config(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4),
                   v2_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)):
        model = build(config)
        moe = model.model.layers[1].mlp
        x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(2))
        _, their_w, their_e = moe.gate(x)
        from interop.mappings.hf_config import spec_from_hf_config
        spec = spec_from_hf_config({**config.to_dict(), "model_type": config.model_type})
        bias = getattr(moe.gate, "e_score_correction_bias", None)
        ours_w, ours_e = route(F.linear(x, moe.gate.weight), spec, bias)
        order_t, order_o = their_e.argsort(1), ours_e.argsort(1)
        assert torch.equal(their_e.gather(1, order_t), ours_e.gather(1, order_o))
        assert (their_w.gather(1, order_t) - ours_w.gather(1, order_o)).abs().max() < 1e-6


def test_parity_against_transformers_at_1x1_tp2_pp2_ep2(tmp_path):
    """transformers has no MTP and no bias update: the trainer runs without either (router_bias_update_rate 0; MTP
    training is tests/trainer/test_mtp_trainer.py's)."""
    save(v3_config(num_hidden_layers=4, num_nextn_predict_layers=0), tmp_path / "hf")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3,
                      router_bias_update_rate=0.0)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,2x1,1x2,1x1x2x2"), frameworks=["torch", "hf"],
                    log=None)
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "torch 1x1x2 ep2", "hf"], result.failed
    assert result.ok, result.table()
    assert result.max_diff <= 1e-5
