"""The reference trainer's mixture-of-experts layers: logits equal to transformers' Mixtral and Qwen2-MoE, the
auxiliary load-balancing loss equal to megatron-core's, and expert parallelism (all-to-all over gloo) giving the
same losses as one process, including after a resume at another ep."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.spec import ModelSpec
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.grid import Grid
from interop.trainer.init import init_checkpoint, read_spec
from interop.trainer.launch import train
from interop.trainer.model import MLP, Stage, rope_tables
from interop.trainer.moe import MoE, load_balancing_loss, set_aux_loss_scale, update_expert_bias
from interop.workflows.parity import parity, parse_layouts
from interop.trainer.train import prepare
from helpers.specs import write_spec
from helpers.moe_models import BASE, MIXTRAL, QWEN2_MOE, hf_model





def canonical(hf_state: dict, spec: ModelSpec) -> dict:
    """transformers 5.x in-memory names (fused experts.gate_up_proj [E, 2I, h], gate rows first) -> canonical.
    A test helper only: the real converter is interop.converters.hf."""
    out, moe_i = {}, spec.moe_ffn_hidden
    simple = {"embed_tokens.weight": "embed.word.weight", "norm.weight": "final_norm.weight",
              "lm_head.weight": "lm_head.weight"}
    for key, value in hf_state.items():
        key = key.removeprefix("model.")
        if key in simple:
            out[simple[key]] = value
            continue
        i, rest = re.match(r"layers\.(\d+)\.(.+)", key).groups()
        p = f"layers.{i}."
        if m := re.fullmatch(r"self_attn\.([qkvo])_proj\.(weight|bias)", rest):
            out[f"{p}attn.{m[1]}.{m[2]}"] = value
        elif rest == "input_layernorm.weight":
            out[p + "attn_norm.weight"] = value
        elif rest == "post_attention_layernorm.weight":
            out[p + "mlp_norm.weight"] = value
        elif rest == "mlp.gate.weight":
            out[p + "mlp.router.weight"] = value
        elif rest == "mlp.experts.gate_up_proj":
            for e in range(spec.num_experts):
                out[f"{p}mlp.experts.{e}.gate.weight"] = value[e, :moe_i]
                out[f"{p}mlp.experts.{e}.up.weight"] = value[e, moe_i:]
        elif rest == "mlp.experts.down_proj":
            for e in range(spec.num_experts):
                out[f"{p}mlp.experts.{e}.down.weight"] = value[e]
        elif m := re.fullmatch(r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", rest):
            out[f"{p}mlp.shared.{m[1]}.weight"] = value
        elif rest == "mlp.shared_expert_gate.weight":
            out[p + "mlp.shared_gate.weight"] = value
        elif m := re.fullmatch(r"mlp\.(gate|up|down)_proj\.weight", rest):
            out[f"{p}mlp.{m[1]}.weight"] = value
        else:
            raise AssertionError(f"unmapped HF tensor {key}")
    return out


def one_rank_stage(spec: ModelSpec, tensors: dict | None = None) -> Stage:
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    if tensors is not None:
        mine = dict(stage.named_tensors())
        assert sorted(mine) == sorted(tensors)
        with torch.no_grad():
            for name, t in mine.items():
                t.copy_(tensors[name])
    return stage


def stage_logits(stage: Stage, tokens):
    x = stage.embed(tokens)
    rope = rope_tables(stage.spec, tokens.shape[1])
    for block in stage.layers.values():
        x = block(x, rope)
    return F.linear(stage.final_norm(x), stage.lm_head.weight)[..., :stage.spec.vocab]


@pytest.mark.parametrize("kind, fields", [("mixtral", MIXTRAL), ("qwen2_moe", QWEN2_MOE)])
def test_logits_equal_transformers(kind, fields):
    """transformers 5.23 MixtralForCausalLM (softmax, top-2 renormalised) and Qwen2MoeForCausalLM (no
    renormalisation, a dense layer, sigmoid-gated shared expert): the same logits within 1e-5 in fp32, and
    the same gradients."""
    model, spec = hf_model(kind), ModelSpec(**fields)
    stage = one_rank_stage(spec, canonical(model.state_dict(), spec)).eval()
    tokens = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = stage_logits(stage, tokens), model(tokens).logits
    assert isinstance(stage.layers["1"].mlp, MoE) and isinstance(stage.layers["0"].mlp, MoE) == (kind == "mixtral")
    assert (ours - theirs).abs().max() < 1e-5
    # and the same gradients of the LM loss (no aux loss here: transformers' is another formula)
    targets = tokens.roll(-1, 1)
    stage(tokens, targets).backward()
    F.cross_entropy(model(tokens).logits.reshape(-1, spec.vocab), targets.reshape(-1)).backward()
    theirs = canonical({name: p.grad for name, p in model.named_parameters()}, spec)
    for name, p in stage.named_parameters():
        assert (p.grad - theirs[name]).abs().max() < 1e-5, name


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_equals_megatron_core(score):
    """megatron-core 0.16.1 `switch_load_balancing_loss_func` on the scores and routing map of its own
    `compute_routing_scores_for_aux_loss` (moe_utils.py), as its TopKRouter._apply_aux_loss calls it."""
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func)
    spec = ModelSpec(**dict(MIXTRAL, num_experts=8, moe_topk=3, moe_router_score=score, moe_aux_loss_coeff=0.02))
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(2))
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, 3, score)
    expected = switch_load_balancing_loss_func(scores, routing_map.sum(0), 40, 3, 8, 0.02)
    assert torch.allclose(load_balancing_loss(logits, spec), expected, rtol=1e-6, atol=0)


def test_aux_loss_gradient_is_that_of_lm_loss_plus_aux():
    """The aux loss rides the backward pass (Megatron's MoEAuxLossAutoScaler): the gradients equal those of
    (LM loss + the layers' aux losses) written out, with the 1 / micro-batches scale applied to both."""
    spec = ModelSpec(**dict(QWEN2_MOE, moe_layers=None, moe_aux_loss_coeff=0.1))
    torch.manual_seed(3)
    a = one_rank_stage(spec)
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.2)
    b = one_rank_stage(ModelSpec(**dict(QWEN2_MOE, moe_layers=None)), dict(a.named_tensors()))
    logits = []
    for layer in b.layers.values():
        layer.mlp.router.register_forward_hook(lambda module, inputs, out: logits.append(out))
    tokens = torch.randint(0, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    set_aux_loss_scale(a, 0.5)
    (a(tokens, tokens) * 0.5).backward()
    lm = b(tokens, tokens)
    ((lm + sum(load_balancing_loss(z, spec) for z in logits)) * 0.5).backward()
    assert len(logits) == 2
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-7, rtol=1e-5), name
    assert a.layers["0"].mlp.router.weight.grad.abs().sum() > 0


MCORE_CASES = {"softmax": {}, "pre_softmax": {"moe_norm_topk": False},
               "sigmoid_bias": {"moe_router_score": "sigmoid", "moe_router_bias": True}}


@pytest.fixture(scope="module")
def mcore_moe(tmp_path_factory):
    """megatron-core's MoELayer forward and backward for each router kind (tests/helpers/mcore_moe.py, its own process)."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("mcore-moe")
    run = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "mcore_moe.py"), str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", list(MCORE_CASES))
def test_layer_equals_megatron_core_moe_layer(mcore_moe, case):
    """The MoE layer against megatron-core 0.16.1's MoELayer with the same weights: output, input gradient and
    every weight's gradient (aux loss included: without it the router's gradient is off by ~3e-3), for
    Megatron's top-k-then-softmax, --moe-router-pre-softmax (no renormalisation) and sigmoid with expert bias
    (and then the bias's aux-loss-free update, `get_updated_expert_bias`)."""
    ref = torch.load(mcore_moe / f"{case}.pt")
    spec = ModelSpec(**dict(BASE, hidden=16, head_dim=4, ffn_hidden=32, num_experts=4, moe_topk=2, moe_ffn_hidden=8,
                            shared_expert_ffn_hidden=12, shared_expert_gate=True, moe_aux_loss_coeff=0.1,
                            **MCORE_CASES[case]))
    grid = Grid(1, 1, 1, 0)
    moe = MoE(spec, grid, MLP(spec, grid, 12, bias=False)).train()
    mine = dict(moe.named_parameters()) | {n: b for n, b in moe.named_buffers() if n == "router.expert_bias"}
    assert sorted(mine) == sorted(ref["weights"])
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(ref["weights"][name])
    x = ref["x"].clone().requires_grad_()
    out = moe(x)
    (out * ref["g"]).sum().backward()
    assert (out - ref["out"]).abs().max() < 1e-5
    assert (x.grad - ref["x_grad"]).abs().max() < 1e-5
    for name, p in moe.named_parameters():
        assert (p.grad - ref["grads"][name]).abs().max() < 2e-5, name
    if "updated_bias" in ref:  # aux-loss-free balancing: the same step from the same token counts
        update_expert_bias(moe, 1e-3, None)
        assert torch.allclose(moe.router.expert_bias, ref["updated_bias"], atol=1e-7)
        assert not torch.equal(moe.router.expert_bias, ref["weights"]["router.expert_bias"])


# Parity and resume: a gated shared expert, aux loss, sigmoid top-2 of 4 experts with the expert bias (updated
# every step from the global batch's counts) on both layers.
PARITY = dict(QWEN2_MOE, moe_layers=None, moe_norm_topk=True, moe_aux_loss_coeff=0.01, moe_router_score="sigmoid",
              moe_router_bias=True)


@pytest.fixture(scope="module")
def moe_start(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return init_checkpoint(read_spec(write_spec(root / "moe.yaml", PARITY)), root / "start", seed=5)


def test_parity_ep1_vs_ep2_and_tp2_ep2(moe_start):
    """One process vs experts split over 2 ranks (tokens exchanged by all-to-all on gloo) vs tp 2 with ep 2
    (4 ranks): the same losses within fp32 tolerance, aux loss included in the gradients."""
    cfg = TrainConfig(steps=3, micro_batch_size=2, global_batch_size=8, seq_length=16, lr=3e-3)
    result = parity(moe_start, cfg, layouts=parse_layouts("1x1,1x1x2x2,2x1x2x2"), frameworks=["torch"], log=None)
    assert list(result.runs) == ["torch 1x1", "torch 1x1x2 ep2", "torch 2x1x2 ep2"], result.failed
    assert result.ok, result.table()


def test_resume_at_ep2_continues_at_ep1(moe_start, tmp_path):
    """Saved at ep 2 (each expert from the rank holding it), resumed at ep 1: the loss curve continues.
    The ep 2 run's gradient norms equal one process's too (AdamW hides a wrongly scaled expert gradient
    from the losses, not from the norm)."""
    base = dict(steps=4, save_interval=2, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, quiet=True)
    full = train(TrainConfig(load=str(moe_start), save=str(tmp_path / "A"), ep=2, **base))
    single = train(TrainConfig(load=str(moe_start), **dict(base, save_interval=None)))
    for a, b in zip(full, single):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * b["grad_norm"]
    ckpt = tmp_path / "A" / "step_000002"
    reader = StoreReader(ckpt)
    assert reader.layout.ep == 2 and reader.source.state["trainer"]["ep"] == 2
    assert "optim.exp_avg.layers.1.mlp.experts.3.down.weight" in reader.manifest["tensors"]
    bias = reader.read("layers.1.mlp.router.expert_bias")  # two updates of +-1e-3 (or 0) from 0
    assert bias.abs().max() > 0 and torch.allclose(bias * 1e3, (bias * 1e3).round(), atol=1e-4)
    resumed = train(TrainConfig(load=str(ckpt), save=str(tmp_path / "B"), ep=1, resume=True, **base))
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a, b)


def test_ep_mistakes_are_one_line_errors(moe_start, tmp_path):
    dense = init_checkpoint(ModelSpec(**dict(BASE, ffn_hidden=16)), tmp_path / "dense")
    for cfg, message in [(TrainConfig(load=str(moe_start), ep=3), "ep=3 does not divide the 4 experts"),
                         (TrainConfig(load=str(moe_start), ep=2, dp=3), "--ep 2 must divide dp"),
                         (TrainConfig(load=str(dense), ep=2), "needs a mixture-of-experts model")]:
        with pytest.raises(InteropError, match=message):
            prepare(cfg)


def test_config_files_carry_ep(tmp_path):
    """MindSpeed YAML `parallel_config.expert_model_parallel_size` and Megatron `--expert-model-parallel-size`."""
    from interop.trainer.config import load_config
    (tmp_path / "c.yaml").write_text("parallel_config:\n  expert_model_parallel_size: 4\n")
    (tmp_path / "args.txt").write_text("--expert-model-parallel-size 2 --tensor-model-parallel-size 2\n")
    assert load_config(tmp_path / "c.yaml").ep == 4
    assert load_config(tmp_path / "args.txt").ep == 2
    assert load_config(tmp_path / "args.txt", ep=1).ep == 1  # a flag overrides the file


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_parity_against_transformers(kind, tmp_path):
    """`interop parity` from an HF checkpoint: one process, ep 2 and transformers' own model training on the
    same batches with the same update rule, within 1e-5 (no load-balancing loss: transformers' is another)."""
    model = hf_model(kind)
    model.config.router_aux_loss_coef = 0.0
    model.save_pretrained(tmp_path / "hf")
    cfg = TrainConfig(steps=3, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,1x1x2x2"), frameworks=["torch", "hf"], log=None)
    assert list(result.runs) == ["torch 1x1", "torch 1x1x2 ep2", "hf"], result.failed
    assert result.ok, result.table()


def test_parity_refuses_hf_with_a_load_balancing_loss(tmp_path):
    """With router_aux_loss_coef > 0 the two frameworks train different objectives: one line, nothing run."""
    model = hf_model("mixtral")
    model.config.router_aux_loss_coef = 0.02
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError, match="framework hf: the model has a load-balancing loss"):
        parity(tmp_path / "hf", TrainConfig(steps=1), layouts=[(1, 1, 1)], frameworks=["torch", "hf"], log=None)
