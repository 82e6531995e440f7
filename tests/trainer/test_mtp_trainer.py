"""The reference trainer's multi-token prediction (DeepSeek-V3's MTP modules, megatron-core 0.16.1's
MultiTokenPredictionLayer / GPTModel._postprocess): its LM loss, each MTP module's loss and every gradient equal
megatron-core's own MLA + MTP GPTModel (built on CPU, helpers/mcore_mla.py) over 3 steps; trained at tp 2, pp 2
and ep 2 it follows the 1x1 run within 1e-5 over 10 steps (`interop parity`); a resumed run carries the MTP
modules and their AdamW moments.

Facts pinned from megatron-core 0.16.1 (transformer/multi_token_prediction.py, models/gpt/gpt_model.py,
pipeline_parallel/schedules.py, distributed/finalize_model_grads.py):
- module k embeds input_ids rolled left k + 1 times (roll_tensor: the tail filled with token 0), normalises the
  embedding (enorm) and the previous hidden state (hnorm: the decoder's output after its final_layernorm, then
  module k-1's output after its final_layernorm), concatenates [embedding; hidden] and projects with eh_proj
  (column-parallel, its output gathered over tp), runs its transformer layer, then its final_layernorm; the
  shared output layer gives its logits;
- its loss: labels and loss_mask rolled left k + 1 times, sum(mask * loss) / sum(mask); the objective adds
  mtp_loss_scaling_factor / mtp_num_layers x each (MTPLossAutoScaler, scaled like the LM loss: 1 / micro-batches);
  the LM loss is what is reported, each MTP loss is logged apart;
- at pp > 1 the last stage holds an embedding copy for the MTP block, its gradient all-reduced with the first
  stage's (finalize_model_grads: `share_embeddings_and_output_weights or mtp_num_layers`).
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.deepseek_models import save, v3_config
from interop.convert import convert
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.store import StoreReader
from interop.trainer.checkpoint import newest_checkpoint
from interop.trainer.config import TrainConfig
from interop.trainer.grid import Grid
from interop.trainer.launch import train
from interop.trainer.model import Stage
from interop.workflows.parity import parity, parse_layouts

pytest.importorskip("transformers")


def stage_of(store_path) -> Stage:
    store = StoreReader(store_path)
    spec = store.source.spec
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    mine = dict(stage.named_tensors())
    assert sorted(mine) == sorted(m.name for m in store.metas())  # the MTP modules are loaded, none left out
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(store.read(name))
    return stage


def test_loss_and_gradients_equal_megatron_core(tmp_path_factory, tmp_path):
    """megatron-core's GPTModel (MLA with q compression, group-limited sigmoid routing, a dense first layer, one
    MTP module whose layer is MoE, mtp_loss_scaling_factor 0.3) trains 3 SGD steps on CPU; the trainer, from the
    same weights read through interop's Megatron reader, gives its LM loss, its MTP loss and every gradient
    (megatron-core's, converted to canonical names by the same reader) within fp32 rounding."""
    pytest.importorskip("megatron.core")
    import helpers.mcore_mla as ML

    root, theirs = ML.mtp_training_once(tmp_path_factory, steps=3, lr=0.05)
    convert(root / "start", tmp_path / "start", dst_format="interop")
    stage = stage_of(tmp_path / "start").train()
    spec = stage.spec
    assert (spec.mtp_layers, spec.mtp_loss_weight, spec.vocab, spec.padded_vocab) == (1, ML.MTP_WEIGHT, 1000, 1000)
    assert spec.is_mla and spec.is_mtp_moe() and spec.moe_groups == 4
    tokens, labels = ML.mtp_batch()
    worst = {"loss": 0.0, "mtp": 0.0, "grad": 0.0}
    for step, ref in enumerate(theirs):
        stage.zero_grad()
        loss = stage(tokens, labels)
        loss.backward()
        worst["loss"] = max(worst["loss"], abs(float(loss.detach()) - ref["loss"]))
        assert len(ref["mtp"]) == 1 and stage.mtp_log[-1].shape == (1,)
        worst["mtp"] = max(worst["mtp"], abs(float(stage.mtp_log[-1][0]) - ref["mtp"][0]))
        convert(root / f"grad{step}", tmp_path / f"grad{step}", dst_format="interop")
        grads = StoreReader(tmp_path / f"grad{step}")
        params = dict(stage.named_parameters())
        assert set(params) == {m.name for m in grads.metas() if not m.name.endswith(".router.expert_bias")}
        for name, p in params.items():
            expected = grads.read(name)
            scale = max(1.0, float(expected.abs().max()))
            worst["grad"] = max(worst["grad"], float((p.grad - expected).abs().max()) / scale)
        assert float(stage.mtp["0"].eh_proj.weight.grad.abs().max()) > 0  # the MTP loss reaches its module
        with torch.no_grad():
            for p in stage.parameters():
                p -= 0.05 * p.grad
    print(f"max |diff| vs megatron-core over 3 steps: {worst}")
    assert worst["loss"] < 1e-5 and worst["mtp"] < 1e-5 and worst["grad"] < 1e-5, worst


def test_mtp_weight_scales_only_the_gradient(tmp_path):
    """The reported loss is the LM loss whatever the weight; the gradient is d(LM) + weight / K x sum d(L_k):
    weight 0 gives exactly the gradient of a model without MTP modules, and the gradients are linear in it."""
    save(v3_config(), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "store", dst_format="interop")
    stage = stage_of(tmp_path / "store")
    tokens = torch.randint(0, stage.spec.vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    targets = tokens.roll(-1, 1)
    grads, values = {}, {}
    for weight in (0.0, 0.1, 0.2):
        stage.spec = stage.spec.replace(mtp_loss_weight=weight)
        stage.zero_grad()
        loss = stage(tokens, targets)
        loss.backward()
        values[weight] = float(loss.detach())
        grads[weight] = {n: p.grad.clone() for n, p in stage.named_parameters()}
    assert values[0.0] == values[0.1] == values[0.2]
    no_mtp = Stage(stage.spec.replace(mtp_layers=0), ParallelLayout.build(stage.spec.num_layers), Grid(1, 1, 1, 0))
    no_mtp.load_state_dict({k: v for k, v in stage.state_dict().items() if not k.startswith("mtp.")})
    no_mtp(tokens, targets).backward()
    for name, p in no_mtp.named_parameters():
        assert torch.equal(p.grad, grads[0.0][name]), name
    for name in grads[0.0]:  # g(0.2) - g(0) = 2 (g(0.1) - g(0))
        a, b = grads[0.2][name] - grads[0.0][name], 2 * (grads[0.1][name] - grads[0.0][name])
        assert (a - b).abs().max() <= 1e-6 * max(1.0, float(a.abs().max())), name
    assert grads[0.1]["mtp.0.eh_proj.weight"].abs().max() > 0 and grads[0.1]["embed.word.weight"].ne(
        grads[0.0]["embed.word.weight"]).any()


def test_mtp_on_at_tp2_pp2_ep2_equals_1x1(tmp_path):
    """MTP trained at tp 2 (eh_proj column-parallel, its output gathered), pp 2 (the MTP module and an embedding
    copy on the last stage, its gradient summed with the first stage's), ep 2 (the MTP layer's experts split) and
    tp 2 x pp 2 follows the 1x1 run within 1e-5 over 10 steps, the routers' expert bias (the MTP layer's too) moving.  AdamW's
    eps is 1e-6: at 1e-8 the few gradient elements within ~1e-8 of zero, whose fp32 rounding differs between layouts
    (the gradients agree to 1e-6 relative), move by up to lr x their relative difference and part the curves by
    ~3e-5: Adam amplifying rounding, not a difference of the computation."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3,
                      eps=1e-6)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,2x1,1x2,1x1x2x2,2x2"), frameworks=["torch"],
                    log=None)
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "torch 1x1x2 ep2", "torch 2x2"], result.failed
    print(result.table())
    assert result.ok and result.max_diff <= 1e-5, result.table()


def test_parity_with_transformers_needs_mtp_switched_off(tmp_path):
    """transformers' model has no MTP modules: beside a run that trains them the losses would part after step 1, so
    parity refuses hf in one line; at --mtp-loss-scaling-factor 0 (the MTP modules run, their gradient is 0) the
    trainer follows transformers within 1e-5 over 10 steps, at 1x1 and pp 2 (the MTP stage)."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3,
                      router_bias_update_rate=0.0)
    with pytest.raises(InteropError, match="framework hf: transformers' model has no MTP modules.*"
                                           "--mtp-loss-scaling-factor 0"):
        parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1"), frameworks=["torch", "hf"], log=None)
    result = parity(tmp_path / "hf", cfg.replace(mtp_loss_scaling_factor=0.0), layouts=parse_layouts("1x1,1x2"),
                    frameworks=["torch", "hf"], log=None)
    assert list(result.runs) == ["torch 1x1", "torch 1x2", "hf"], result.failed
    assert result.ok and result.max_diff <= 1e-5, result.table()


def test_resume_carries_mtp_modules_and_their_moments(tmp_path):
    """Stopped at step 3 at 1x1 and resumed at pp 2 x tp 2: the MTP modules' weights and AdamW moments come back
    (saved once, by the last stage) and the loss curve continues the uninterrupted run's within 1e-6; each step's MTP
    loss is logged beside the LM loss (metrics.jsonl `mtp_loss`, one per module)."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "store", dst_format="interop")
    cfg = TrainConfig(load=str(tmp_path / "store"), steps=6, save_interval=3, micro_batch_size=2,
                      global_batch_size=4, seq_length=16, lr=3e-3, eps=1e-6, quiet=True)
    whole = train(cfg.replace(save=str(tmp_path / "A")))
    reader = StoreReader(tmp_path / "A" / "step_000003")
    names = set(reader.manifest["tensors"])
    for name in ("mtp.0.eh_proj.weight", "mtp.0.layer.mlp.experts.7.down.weight", "mtp.0.final_norm.weight"):
        assert {name, f"optim.exp_avg.{name}", f"optim.exp_avg_sq.{name}"} <= names
    assert reader.read("optim.exp_avg_sq.mtp.0.enorm.weight").abs().max() > 0  # trained, not zeros
    resumed = train(cfg.replace(load=str(tmp_path / "A" / "step_000003"), save=str(tmp_path / "B"), resume=True,
                                pp=2, tp=2))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(whole[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert len(a["mtp_loss"]) == 1 and abs(a["mtp_loss"][0] - b["mtp_loss"][0]) <= 1e-5, (a, b)
    logged = [json.loads(line) for line in (tmp_path / "A" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mtp_loss"] for r in logged] == [r["mtp_loss"] for r in whole]  # Megatron-LM's "mtp_1 loss", apart
    assert all(r["mtp_loss"][0] > r["loss"] * 0.5 for r in whole)  # a cross entropy over the vocabulary, not 0
    end = StoreReader(newest_checkpoint(tmp_path / "B"))
    assert end.source.state["iteration"] == 6 and end.layout.pp == 2
    assert (end.read("mtp.0.eh_proj.weight") - StoreReader(tmp_path / "A" / "step_000006").read(
        "mtp.0.eh_proj.weight")).abs().max() < 1e-5


def test_short_sequence_refused_in_one_line(tmp_path):
    save(v3_config(), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "store", dst_format="interop")
    with pytest.raises(InteropError, match="--seq-length 1: the model's 1 MTP module"):
        train(TrainConfig(load=str(tmp_path / "store"), steps=1, seq_length=1, quiet=True))


def test_mtp_loss_scaling_factor_from_flag_or_megatron_args(tmp_path):
    """Megatron's --mtp-loss-scaling-factor is a training argument: read from an args file (`--config`) or the flag,
    checked at the door, and trained (the run's summary and the saved model say it)."""
    from interop.trainer.config import load_config
    from interop.trainer.launch import prepare
    from interop.trainer.train import describe_plan
    args = tmp_path / "run.sh"
    args.write_text("torchrun pretrain_gpt.py --mtp-num-layers 1 --mtp-loss-scaling-factor 0.25 --lr 3e-3\n")
    assert load_config(args).mtp_loss_scaling_factor == 0.25
    assert load_config(None).mtp_loss_scaling_factor is None  # the model's own
    with pytest.raises(InteropError, match="--mtp-loss-scaling-factor must be a finite number >= 0.0, got -1.0"):
        load_config(None, mtp_loss_scaling_factor=-1.0)
    save(v3_config(), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "store", dst_format="interop")
    plan = prepare(TrainConfig(load=str(tmp_path / "store"), mtp_loss_scaling_factor=0.25))
    assert plan.spec.mtp_loss_weight == 0.25
    assert "1 MTP module(s) trained, loss weight 0.25" in describe_plan(plan)[0]
