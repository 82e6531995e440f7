"""The reference trainer trains a LoRA adapter on a frozen base (issue 28): the same adapter training at tp/pp 1x1,
2x1, 1x2 and in HF PEFT within 1e-5 over 10 steps; saved and resumed (at another layout) as a common-format
adapter with AdamW state for the adapter only; bad adapters refused in one line."""
from __future__ import annotations

import json
from dataclasses import replace  # TrainConfig.replace keeps a field given None

import pytest
import torch
from click.testing import CliRunner

from interop.adapter import AdapterSpec
from interop.cli.main import main
from interop.errors import InteropError
from interop.params import TensorKey
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.init import init_checkpoint, read_spec
from interop.trainer.launch import train
from interop.trainer.lora import LoRAColumnParallelLinear, LoRARowParallelLinear, init_adapter
from interop.trainer.tp import ColumnParallelLinear, RowParallelLinear
from interop.trainer.train import prepare
from helpers.moe_models import MIXTRAL
from helpers.specs import GPT2, LLAMA, write_spec

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="linear_qkv,linear_proj,linear_fc1,linear_fc2")
RUN = dict(micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-2, quiet=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return init_checkpoint(read_spec(write_spec(root / "llama.yaml", LLAMA)), root / "base", seed=5)


def test_lora_linears_compute_w_x_plus_scaled_b_a_x():
    torch.manual_seed(0)
    adapter = AdapterSpec(rank=3, alpha=6.0, targets=("attn.q",))
    x = torch.randn(2, 5, 8)
    for base_cls, lora_cls in ((ColumnParallelLinear, LoRAColumnParallelLinear),
                               (RowParallelLinear, LoRARowParallelLinear)):
        linear = base_cls(8, 6, True, 1, None)
        for p in linear.parameters():
            torch.nn.init.normal_(p)
        lora = lora_cls(linear, adapter)
        torch.nn.init.normal_(lora.lora_a)
        torch.nn.init.normal_(lora.lora_b)
        want = x @ linear.weight.T + linear.bias + 2.0 * (x @ lora.lora_a.T) @ lora.lora_b.T
        assert torch.allclose(lora(x), want, atol=1e-5)
        assert lora.weight is linear.weight  # the base's own Parameter, under its own name


def test_cli_parity_of_a_lora_adapter_at_three_layouts_and_in_peft(base):
    """`interop parity BASE --lora-*`: one fresh adapter, trained at 1x1, 2x1, 1x2 and by HF PEFT on transformers'
    model (PeftModel.from_pretrained of the adapter converted to PEFT's files): within 1e-5 over 10 steps."""
    pytest.importorskip("peft")
    result = CliRunner().invoke(main, ["parity", str(base), "--steps", "10", "--layouts", "1x1,2x1,1x2",
                                       "--frameworks", "torch,hf", "--seq-length", "16", "--lr", "3e-2",
                                       "--lora-rank", "4", "--lora-alpha", "8",
                                       "--lora-targets", "linear_qkv,linear_proj,linear_fc1,linear_fc2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert all(label in out for label in ("torch 1x1", "torch 2x1", "torch 1x2", " hf")) and "OK" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 10 and max(float(r[-1]) for r in rows) < 1e-5
    # the adapter changes the model by far more than the tolerance: the frozen base's own losses on these batches
    frozen = train(TrainConfig(load=str(base), steps=10, **{**RUN, "lr": 0.0}))
    assert max(abs(float(r[1]) - f["loss"]) for r, f in zip(rows, frozen)) > 1e-3


def test_lora_saves_the_adapter_alone_and_resumes_at_another_layout(base, tmp_path):
    cfg = TrainConfig(load=str(base), steps=6, **RUN, **LORA)
    straight = train(cfg.replace(tp=1, pp=1))
    first = train(cfg.replace(tp=1, pp=2, stop_at=3, save=str(tmp_path / "run")))
    saved = StoreReader(tmp_path / "run" / "step_000003")
    adapter = saved.source.adapter
    assert (adapter.rank, adapter.alpha, adapter.targets) == (4, 8.0, ("attn.k", "attn.o", "attn.q", "attn.v",
                                                                        "mlp.down", "mlp.gate", "mlp.up"))
    names = list(saved.manifest["tensors"])
    weights = {n for n in names if not TensorKey.parse(n).is_optim}
    assert weights == set(adapter.index(saved.spec)) and all(n.endswith((".lora_a", ".lora_b")) for n in weights)
    assert {TensorKey.parse(n).kind for n in names if TensorKey.parse(n).is_optim} == {"exp_avg", "exp_avg_sq"}
    assert sum(TensorKey.parse(n).is_optim for n in names) == 2 * len(weights)  # AdamW state of the adapter only
    assert saved.read("layers.3.mlp.down.lora_b").abs().sum() > 0  # B trained away from its zero start
    with pytest.raises(InteropError, match="--load BASE"):
        prepare(cfg.replace(resume=True, save=str(tmp_path / "run"), load=str(tmp_path / "run" / "step_000003")))
    resumed = train(cfg.replace(tp=2, pp=1, resume=True, save=str(tmp_path / "run")))
    losses = [r["loss"] for r in first + resumed]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert max(abs(a - b["loss"]) for a, b in zip(losses, straight)) < 1e-5
    json.loads((tmp_path / "run" / "step_000006" / "interop.json").read_text())["adapter"]  # saved as an adapter


def test_a_trained_adapter_exports_to_peft_with_its_moments_noted(base, tmp_path):
    """The trainer's checkpoint (adapter + AdamW moments) converts to PEFT's files (the moments noted, not
    written) and PEFT's own loader takes them onto transformers' model of the base, weights equal."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from interop.convert import convert
    train(TrainConfig(load=str(base), steps=2, save=str(tmp_path / "run"), **RUN, lora_rank=2, lora_alpha=4.0,
                      lora_targets="attn.q,attn.v"))
    summary = convert(tmp_path / "run" / "step_000002", tmp_path / "peft", dst_format="peft")
    assert any("optimizer state not written (exp_avg, exp_avg_sq)" in n for n in summary.notes)
    convert(base, tmp_path / "hf", dst_format="hf")
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                                           tmp_path / "peft")
    trained = StoreReader(tmp_path / "run" / "step_000002").read("layers.1.attn.v.lora_b")
    loaded = model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight
    assert trained.abs().sum() > 0 and torch.equal(loaded.detach(), trained)


def test_bad_lora_input_is_one_line(base, tmp_path):
    with pytest.raises(InteropError, match="--lora-alpha"):
        prepare(TrainConfig(load=str(base), lora_rank=4, lora_targets="attn.q"))  # alpha never defaulted
    other = dict(LLAMA, hidden=48, head_dim=12)
    other_base = init_checkpoint(read_spec(write_spec(tmp_path / "o.yaml", other)), tmp_path / "other", seed=1)
    adapter = init_adapter(read_spec(write_spec(tmp_path / "l.yaml", LLAMA)),
                           AdapterSpec(rank=2, alpha=4.0, targets=("attn.q",)), tmp_path / "adapter")
    with pytest.raises(InteropError, match=r"layers\.0\.attn\.q\.lora_a has shape \[2, 32\]"):
        prepare(TrainConfig(load=str(other_base), adapter=str(adapter)))  # an adapter for another base
    with pytest.raises(InteropError, match="a LoRA adapter, not a model"):
        prepare(TrainConfig(load=str(adapter)))
    with pytest.raises(InteropError, match="mlp.gate is not in the base model"):
        gpt2 = dict(LLAMA, activation="gelu")
        gpt2_base = init_checkpoint(read_spec(write_spec(tmp_path / "g.yaml", gpt2)), tmp_path / "g", seed=1)
        prepare(TrainConfig(load=str(gpt2_base), lora_rank=2, lora_alpha=2, lora_targets="attn.q,mlp.gate"))
    moe = init_checkpoint(read_spec(write_spec(tmp_path / "moe.yaml", MIXTRAL)), tmp_path / "moe", seed=1)
    with pytest.raises(InteropError, match="LoRA adapters on dense models"):
        prepare(TrainConfig(load=str(moe), lora_rank=2, lora_alpha=2, lora_targets="attn.q"))


def test_a_mindspeed_llm_script_or_a_peft_config_configures_the_lora_run(tmp_path):
    """--config reads LoRA settings through map-args: MindSpeed-LLM's flags (its defaults r 16, alpha 32 where
    --lora-target-modules is given alone), a PEFT adapter_config.json."""
    from interop.trainer.config import load_config
    script = tmp_path / "finetune.sh"
    script.write_text("python posttrain_gpt.py --lora-target-modules linear_qkv linear_fc2 --lora-alpha 8 --lr 1e-4\n")
    cfg = load_config(script)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lr) == (16, 8.0, "linear_qkv,linear_fc2", 1e-4)
    assert cfg.lora_shared_a is True  # its linear_qkv is one fused linear with one A
    assert load_config(script, lora_shared_a=False).lora_shared_a is False  # a flag overrides the file
    peft_config = tmp_path / "adapter_config.json"
    peft_config.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                       "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
    cfg = load_config(peft_config)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (4, 8.0, "linear_qkv,linear_proj")
    assert cfg.lora_shared_a is None  # PEFT's q_proj, k_proj, v_proj: the adapter's own description decides


def test_shared_a_trains_a_fused_linears_lora_as_peft_on_gpt2_and_megatron_hold_it(tmp_path):
    """--lora-shared-a: q, k, v (and gate, up) share one A, as a LoRA on a fused linear has: the same training as
    PEFT's LoRA on GPT2's fused c_attn at 1x1 and 2x1, and the trained adapter (moments noted) is written as
    MindSpeed-LLM's Megatron rank files (one A per linear_qkv) at tp 2."""
    pytest.importorskip("peft")
    from interop.convert import convert
    from interop.workflows.parity import parity
    gpt2 = init_checkpoint(read_spec(write_spec(tmp_path / "g.yaml", GPT2)), tmp_path / "gpt2", seed=5)
    cfg = TrainConfig(steps=4, **RUN, lora_rank=4, lora_alpha=8.0, lora_targets="linear_qkv,linear_fc1",
                      lora_shared_a=True)
    result = parity(gpt2, cfg, layouts=[(1, 1, 1), (2, 1, 1)], frameworks=["torch", "hf"], log=None)
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "hf"] and result.max_diff < 1e-5, result.table()
    train(cfg.replace(load=str(gpt2), steps=2, tp=2, save=str(tmp_path / "run")))
    saved = StoreReader(tmp_path / "run" / "step_000002")
    assert torch.equal(saved.read("layers.1.attn.q.lora_a"), saved.read("layers.1.attn.v.lora_a"))
    summary = convert(tmp_path / "run" / "step_000002", tmp_path / "megatron", dst_format="megatron", tp=2)
    assert any("optimizer state" in n for n in summary.notes)
    with pytest.raises(InteropError, match="attn.q, attn.k, attn.v are one fused linear"):
        prepare(cfg.replace(load=str(gpt2), lora_targets="attn.q,attn.v"))


def test_shared_a_is_the_adapters_fact_a_resume_takes_it_and_a_contradicting_flag_is_one_line(base, tmp_path):
    """The trainer states shared_a in the adapter it saves: a resume WITHOUT --lora-shared-a continues the tied
    adapter exactly; --no-lora-shared-a against it is one `error:` line naming both; an older adapter (the fact
    absent) with equal A's is refused naming --lora-shared-a, one whose A's differ reads as separate."""
    cfg = TrainConfig(load=str(base), steps=4, **RUN, lora_rank=2, lora_alpha=4.0,
                      lora_targets="linear_qkv,linear_fc1", lora_shared_a=True)
    straight = train(cfg)
    first = train(cfg.replace(stop_at=2, save=str(tmp_path / "run")))
    step2 = tmp_path / "run" / "step_000002"
    manifest = json.loads((step2 / "interop.json").read_text())
    assert manifest["adapter"]["shared_a"] is True
    resumed = train(replace(cfg, lora_shared_a=None, resume=True, save=str(tmp_path / "run")))  # no flag
    assert [r["step"] for r in resumed] == [3, 4]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(first + resumed, straight)) < 1e-5
    saved = StoreReader(tmp_path / "run" / "step_000004")
    assert saved.source.adapter.shared_a is True
    assert torch.equal(saved.read("layers.2.attn.q.lora_a"), saved.read("layers.2.attn.v.lora_a"))
    assert not torch.equal(saved.read("layers.2.attn.q.lora_a"), StoreReader(step2).read("layers.2.attn.q.lora_a"))

    result = CliRunner().invoke(main, ["train", "--load", str(base), "--adapter", str(step2), "--steps", "4",
                                       "--no-lora-shared-a", "--save", str(tmp_path / "other")])
    assert result.exit_code != 0 and not (tmp_path / "other").exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --no-lora-shared-a contradicts ") and \
        str(step2) in lines[0] and "shared_a true" in lines[0], result.output

    # an older adapter: no shared_a in its description
    older = tmp_path / "older"
    older.mkdir()
    for f in step2.iterdir():
        (older / f.name).write_bytes(f.read_bytes())
    del manifest["adapter"]["shared_a"]
    (older / "interop.json").write_text(json.dumps(manifest))
    given = replace(cfg, adapter=str(older), lora_rank=None, lora_alpha=None, lora_targets=None)
    with pytest.raises(InteropError, match="does not say whether q, k, v .* share one A.* --lora-shared-a"):
        prepare(replace(given, lora_shared_a=None))
    assert prepare(given).adapter.shared_a is True  # the flag settles it
    separate = tmp_path / "separate"
    init_adapter(read_spec(write_spec(tmp_path / "l.yaml", LLAMA)),
                 AdapterSpec(rank=2, alpha=4.0, targets=("attn.q", "attn.k", "attn.v")), separate)
    data = json.loads((separate / "interop.json").read_text())
    del data["adapter"]["shared_a"]
    (separate / "interop.json").write_text(json.dumps(data))
    sep = replace(cfg, adapter=str(separate), lora_rank=None, lora_alpha=None, lora_targets=None)
    assert prepare(replace(sep, lora_shared_a=None)).adapter.shared_a is False  # its A's differ
    with pytest.raises(InteropError, match="--lora-shared-a contradicts .*layers.0.attn.k.lora_a differs from "
                                           "layers.0.attn.q.lora_a"):
        prepare(sep)


def test_parity_refuses_hf_where_peft_ties_a_otherwise_than_the_adapter(base):
    """PEFT's LoRA on Llama's q_proj, k_proj, v_proj has an A each: a shared-A run has no PEFT twin there, and
    parity says so before any run (one line) rather than report a loss gap."""
    from interop.workflows.parity import parity
    cfg = TrainConfig(steps=2, **RUN, lora_rank=2, lora_alpha=4.0, lora_targets="linear_qkv", lora_shared_a=True)
    with pytest.raises(InteropError, match="framework hf: PEFT's LoRA on transformers' .* an A per projection .*"
                                           "--no-lora-shared-a"):
        parity(base, cfg, layouts=[(1, 1, 1)], frameworks=["torch", "hf"], log=None)
