"""The reference trainer on GLM-4.5 models: partial rotary (rope on the first half of each head, rotate-half within
it), q/k/v biases, q/k norms, sigmoid group-limited routing with the correction bias, routed scaling, shared experts
and dense first layers give transformers' own Glm4MoeForCausalLM logits; `interop parity` trains it at 1x1, tp 2,
pp 2 and ep 2 beside transformers' model within 1e-5 over 10 steps (without MTP modules, which transformers does not
have); with its MTP module it trains as megatron-core's own GPTModel does (1x1 and ep 2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.glm_models import config, save
from interop.convert import convert
from interop.layout import ParallelLayout
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.grid import Grid
from interop.trainer.model import Stage
from interop.workflows.parity import parity, parse_layouts

transformers = pytest.importorskip("transformers")


def stage_from(path, tmp_path) -> Stage:
    convert(path, tmp_path / "store", dst_format="interop")
    spec = StoreReader(tmp_path / "store").source.spec
    store = StoreReader(tmp_path / "store")
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    with torch.no_grad():
        for name, t in stage.named_tensors():
            t.copy_(store.read(name))
    return stage.eval()


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
def test_logits_equal_transformers(tmp_path, factor):
    model = save(config(num_nextn_predict_layers=0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}), tmp_path / "hf", mtp=False)
    stage = stage_from(tmp_path / "hf", tmp_path)
    assert stage.spec.rotary_dim == int(16 * factor)
    tokens = torch.randint(0, stage.spec.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = F.linear(stage.final_norm(stage.blocks(stage.embed(tokens))), stage.lm_head.weight)
        assert (ours[..., :stage.spec.vocab] - model(tokens).logits).abs().max() < 1e-5


def test_mtp_training_equals_megatron_core(tmp_path):
    """GLM-4.5 with its MTP module trained by the reference trainer (1x1 and ep 2) and by megatron-core's own
    GPTModel with its MTP block (interop parity's megatron framework, at ep 1 and 2): the same curve within 1e-5 over
    10 steps of 2 micro-batches (the MTP loss scaled by 1 / micro-batches as megatron-core's schedule sets
    MTPLossAutoScaler) and the run's --mtp-loss-scaling-factor 0.3 in both, the routers' expert bias moving.  Vocabulary 1024: megatron-core's loss counts padded
    columns; AdamW eps 1e-6 (test_mtp_trainer.py says why)."""
    pytest.importorskip("megatron.core")
    save(config(vocab_size=1024), tmp_path / "hf")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, eps=1e-6,
                      mtp_loss_scaling_factor=0.3)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,1x1x2x2"),
                    frameworks=["torch", "megatron", "megatron:ep2"], log=None)
    assert list(result.runs) == ["torch 1x1", "torch 1x1x2 ep2", "megatron", "megatron ep2"], result.failed
    print(result.table())
    assert result.ok and result.max_diff <= 1e-5, result.table()


def test_parity_against_transformers_at_1x1_tp2_pp2_ep2(tmp_path):
    """transformers has no bias update: the trainer runs without it (router_bias_update_rate 0)."""
    save(config(num_nextn_predict_layers=0), tmp_path / "hf", mtp=False)
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3,
                      router_bias_update_rate=0.0)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,2x1,1x2,1x1x2x2"), frameworks=["torch", "hf"],
                    log=None)
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "torch 1x1x2 ep2", "hf"], result.failed
    assert result.ok, result.table()
    assert result.max_diff <= 1e-5
