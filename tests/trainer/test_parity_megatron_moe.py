"""megatron-core's own mixture-of-experts GPTModel in `interop parity` and `interop verify`.

`interop/workflows/megatron_framework.py` builds megatron-core 0.16.1's GPTModel with its MoE layers
(TransformerConfig num_moe_experts, moe_router_topk, moe_ffn_hidden_size, moe_layer_freq,
moe_shared_expert_intermediate_size / _gate, moe_router_score_function, moe_router_pre_softmax,
moe_router_enable_expert_bias, moe_aux_loss_coeff; SequentialMLP experts from
`get_gpt_decoder_block_spec` with the local spec, as megatron-core's gpt_layer_specs.py builds them), loads the
checkpoint converted to Megatron's torch format strictly, and trains it as Megatron-LM's train_step does:
micro-batches with MoEAuxLossAutoScaler's scale, then finalize_model_grads' expert-bias update.
"""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from interop.cli.main import main
from interop.convert import convert
from interop.spec import ModelSpec
from interop.trainer.config import TrainConfig
from interop.trainer.init import init_checkpoint
from interop.trainer.launch import train
from interop.workflows.parity import parity
from interop.workflows.verify import verify
from helpers.moe_models import MIXTRAL, QWEN2_MOE, hf_model

pytest.importorskip("megatron.core")

# megatron-core's loss counts vocabulary padding: a vocabulary that is a multiple of 128 has none
UNPADDED = dict(vocab=128, padded_vocab=128)
CFG = TrainConfig(steps=4, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, warmup=2)


def test_mixtral_in_megatron_core_trains_like_the_trainer_and_transformers(tmp_path):
    """Tiny Mixtral (softmax top-2 of 4 renormalised, every layer MoE, no load-balancing loss): the reference
    trainer, transformers' MixtralForCausalLM and megatron-core's MoE GPTModel, 4 updates, within 1e-5."""
    ckpt = init_checkpoint(ModelSpec(**dict(MIXTRAL, **UNPADDED)), tmp_path / "mixtral", seed=5)
    result = parity(ckpt, CFG, layouts=[(1, 1, 1)], frameworks=["torch", "hf", "megatron"], log=None)
    assert list(result.runs) == ["torch 1x1", "hf", "megatron"], result.failed
    assert all(len(v) == 4 for v in result.runs.values())
    assert result.ok and result.max_diff < 1e-5, result.table()


# DeepSeek-style routing on a Qwen2-MoE-shaped model: layer 0 dense, layer 1 MoE with a gated shared expert,
# sigmoid top-2 with the aux-loss-free expert bias, and a load-balancing loss.
ROUTED = dict(QWEN2_MOE, **UNPADDED, moe_norm_topk=True, moe_router_score="sigmoid", moe_router_bias=True,
              moe_aux_loss_coeff=0.1)


def test_shared_expert_bias_and_aux_loss_in_megatron_core_at_ep1_and_ep2(tmp_path):
    """megatron-core (its router's aux loss through MoEAuxLossAutoScaler at 1 / micro-batches, its expert-bias
    update, its gated shared expert, a dense first layer) follows the reference trainer within 1e-5 over 4
    updates, in one process and with its experts over 2 gloo processes (`megatron:ep2`: expert_model_parallel_size
    2, dp 2, megatron-core's allgather dispatcher moving the tokens).  Both the aux loss and the bias update move
    the losses by more than the tolerance (the trainer without either differs), so the agreement shows
    megatron-core computes both as the trainer does."""
    cfg = CFG.replace(router_bias_update_rate=0.01)
    ckpt = init_checkpoint(ModelSpec(**ROUTED), tmp_path / "routed", seed=5)
    result = parity(ckpt, cfg, layouts=[(1, 1, 1)], frameworks=["torch", "megatron", "megatron:ep2"], log=None)
    assert list(result.runs) == ["torch 1x1", "megatron", "megatron ep2"], result.failed
    assert result.ok and result.max_diff < 1e-5, result.table()
    megatron = result.runs["megatron"]
    no_aux = init_checkpoint(ModelSpec(**dict(ROUTED, moe_aux_loss_coeff=0.0)), tmp_path / "no-aux", seed=5)
    base = dict(steps=4, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, warmup=2, quiet=True)
    for load, rate in ((no_aux, 0.01), (ckpt, 0.0)):
        other = [r["loss"] for r in train(TrainConfig(load=str(load), router_bias_update_rate=rate, **base))]
        assert max(abs(a - b) for a, b in zip(other, megatron)) > 1e-5, (load, rate)


def test_megatron_moe_checkpoint_verified_in_megatron_core(tmp_path):
    """transformers' Mixtral -> Megatron at ep 2 (two EP rank folders): `verify` runs megatron-core's own MoE
    model on the converted checkpoint, with the same logits as transformers and the reference model."""
    model = hf_model("mixtral")
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "meg", dst_format="megatron", ep=2)
    assert sorted(p.name for p in (tmp_path / "meg").glob("*/mp_rank_*")) == ["mp_rank_00_000", "mp_rank_00_001"]
    result = verify(tmp_path / "hf", tmp_path / "meg")
    labels = [c.label for c in result.checks]
    assert "megatron-core, converted (megatron)" in labels and "transformers, source (hf)" in labels, labels
    assert result.ok and result.max_diff < 1e-5, result.lines()


def test_what_megatron_core_cannot_run_is_one_line(tmp_path):
    """megatron-core renormalises a sigmoid router's top-k always: a model that does not is one error line
    before anything runs, naming why; so are experts without the biases of a model with linear biases (mcore's
    experts take add_bias_linear's), an ep that does not divide the experts, and a malformed `megatron:`."""
    ckpt = init_checkpoint(ModelSpec(**dict(ROUTED, moe_norm_topk=False)), tmp_path / "unnormalised", seed=5)
    run = CliRunner().invoke(main, ["parity", str(ckpt), "--frameworks", "torch,megatron", "--steps", "1"])
    assert run.exit_code == 2 and "framework megatron: megatron-core renormalises" in run.stderr, run.output
    assert "Traceback" not in run.output
    biased = init_checkpoint(ModelSpec(**dict(MIXTRAL, **UNPADDED, linear_bias=True)), tmp_path / "biased", seed=5)
    run = CliRunner().invoke(main, ["parity", str(biased), "--frameworks", "torch,megatron", "--steps", "1"])
    assert run.exit_code == 2 and "megatron-core's experts take biases" in run.stderr, run.output
    routed = init_checkpoint(ModelSpec(**ROUTED), tmp_path / "routed", seed=5)
    for framework, message in (("megatron:ep3", "framework megatron:ep3: ep=3 does not divide the 4 experts"),
                               ("megatron:2", "write megatron:epN")):
        run = CliRunner().invoke(main, ["parity", str(routed), "--frameworks", f"torch,{framework}", "--steps", "1"])
        assert run.exit_code == 2 and message in run.stderr, run.output
        assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.output
