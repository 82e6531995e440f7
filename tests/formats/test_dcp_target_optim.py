"""`--to dcp` with the optimizer state: accelerate's `optimizer_0/` beside the model, which a real FSDP2 run
(torch 2.13, 2 CPU ranks over gloo: tests/helpers/fsdp2_resume.py) loads with torch's own
`dcp.load` + `set_optimizer_state_dict` (as accelerate's load_fsdp_optimizer does) and resumes from.

Sources: FSDP2's own checkpoint (tests/fixtures/fsdp_dcp, written by scripts/make_fsdp_dcp_fixtures.py), the
same after a trip through Megatron (tp 2), the HF Trainer's DeepSpeed ZeRO-2 (tied, tests/fixtures/deepspeed_zero)
and torchtitan 0.3.0's own save (tests/fixtures/torchtitan).
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from interop.cli.main import main
from interop.converters.deepspeed import engine
from interop.params import TensorKey

FIXTURES = Path(__file__).parents[1] / "fixtures"
FSDP2 = FIXTURES / "fsdp_dcp"
ZERO2 = FIXTURES / "deepspeed_zero" / "z2_fp32" / "checkpoint-2"
TITAN = FIXTURES / "torchtitan"  # torchtitan 0.3.0's own save (scripts/make_torchtitan_fixture.py)
HYPER = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def consolidated(folder: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each checkpoint converted, then loaded and stepped once by FSDP2 (one torchrun for all)."""
    tmp = tmp_path_factory.mktemp("dcp_optim")
    notes = {"direct": run("convert", FSDP2, tmp / "direct", "--to", "dcp")}
    run("convert", FSDP2, tmp / "meg", "--to", "megatron", "--tp", "2")
    notes["megatron"] = run("convert", tmp / "meg", tmp / "megatron", "--to", "dcp")
    notes["zero2"] = run("convert", ZERO2, tmp / "zero2", "--to", "dcp")
    notes["titan"] = run("convert", TITAN / "step-2", tmp / "titan", "--to", "dcp", "--model-config",
                         TITAN / "config.json")
    folders = {"fsdp2": FSDP2, "direct": tmp / "direct", "megatron": tmp / "megatron", "zero2": tmp / "zero2",
               "trainer": f"{tmp / 'direct'}#trainer", "titan": tmp / "titan"}
    helper = Path(__file__).parents[1] / "helpers" / "fsdp2_resume.py"
    with socket.socket() as probe:  # a free port: other test runs on this machine use theirs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(helper), str(tmp / "out.pt"), *map(str, folders.values())],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp / "out.pt", weights_only=False)
    return {name: out[str(folder)] for name, folder in folders.items()}, notes, tmp


def moments(loaded: dict) -> dict:
    """{(HF name, kind): tensor} of a full optimizer state dict."""
    return {(name, kind): value for name, state in loaded["optimizer"]["state"].items()
            for kind, value in state.items()}


def test_fsdp2_resumes_exactly_as_from_its_own_checkpoint(resumed, tmp_path):
    """FSDP2 checkpoint -> interop -> DCP: FSDP2 loads the weights, moments, step and hyperparameters it saved
    and its next step (loss, updated weights) is bit-identical to resuming its own checkpoint."""
    got, notes, tmp = resumed
    own, ours = got["fsdp2"], got["direct"]
    saved = consolidated(FSDP2 / "optimizer_0", tmp_path)["optimizer"]["state"]
    assert set(ours["model"]) == set(own["model"]) and len(ours["model"]) == 21
    assert all(torch.equal(ours["model"][k], own["model"][k]) for k in own["model"])
    assert set(moments(ours)) == set(moments(own)) == {(k, m) for k in saved for m in saved[k]}
    assert all(torch.equal(v, saved[k][m]) for (k, m), v in moments(ours).items())
    group = ours["optimizer"]["param_groups"][0]
    assert {h: group[h] for h in HYPER} == {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01,
                                           "decoupled_weight_decay": True}  # not the run's own 0.5s
    assert ours["loss"] == own["loss"]
    assert all(torch.equal(ours["after"][k], own["after"][k]) for k in own["after"])
    assert "note:" not in notes["direct"].replace("note: accelerate layout", "").replace(
        "note: converted the optimizer state", "")


def test_megatron_to_fsdp2_keeps_the_moments(resumed, tmp_path):
    """Through Megatron (tp 2) and on to DCP: the same weights and moments; Megatron keeps no learning rate
    without a schedule, so torch AdamW's default is written, with a note."""
    got, notes, _ = resumed
    own, ours = got["fsdp2"], got["megatron"]
    assert all(torch.equal(ours["model"][k], own["model"][k]) for k in own["model"])
    assert set(moments(ours)) == set(moments(own))
    assert all(torch.equal(v, moments(own)[k]) for k, v in moments(ours).items())
    assert "the source states no lr; torch AdamW's defaults written (lr 0.001)" in notes["megatron"]
    assert ours["optimizer"]["param_groups"][0]["lr"] == 0.001


def test_deepspeed_zero2_to_fsdp2(resumed):
    """The HF Trainer's ZeRO-2 (dp 2, tied embeddings) to DCP: FSDP2 holds zero_to_fp32's weights and the
    moments, step and learning rate DeepSpeed's optimizer had."""
    got, notes, _ = resumed
    ours = got["zero2"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    expected = get_fp32_state_dict_from_zero_checkpoint(str(ZERO2))
    assert all(torch.equal(ours["model"][k], expected[k]) for k in expected)
    reader = engine.Reader(ZERO2)
    want = {(reader.native_name(m.param), m.kind): reader.read(f"optim.{m.kind}.{m.param}")
            for m in (TensorKey.parse(x.name) for x in reader.metas()) if m.kind in ("exp_avg", "exp_avg_sq")}
    assert set(moments(ours)) - {(k, "step") for k, _ in want} == set(want) and len(want) == 2 * 20
    assert all(torch.equal(moments(ours)[k], v) for k, v in want.items())
    assert all(moments(ours)[(k, "step")].item() == 2.0 for k, _ in want)
    group = ours["optimizer"]["param_groups"][0]
    assert {h: group[h] for h in HYPER} == {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01,
                                           "decoupled_weight_decay": True}
    assert "note: optimizer" not in notes["zero2"]



def test_hf_trainer_param_groups_load(resumed):
    """An optimizer with the HF Trainer's groups (decay; no decay for biases and norms) loads the two groups
    written: the same moments, each group's hyperparameters, the norms undecayed."""
    got, _, _ = resumed
    ours, own = got["trainer"], got["fsdp2"]
    assert all(torch.equal(v, moments(own)[k]) for k, v in moments(ours).items())
    decay, no_decay = ours["optimizer"]["param_groups"]
    assert no_decay["params"] == [n for n in own["model"] if n.endswith("norm.weight")]
    assert len(no_decay["params"]) == 5 and len(decay["params"]) == 16
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["lr"], no_decay["betas"]) == (
        0.01, 0.0, 0.01, (0.9, 0.95))
    assert ours["loss"] == own["loss"]


def test_torchtitan_to_fsdp2(resumed):
    """torchtitan's step-2 (its names, fused wqkv moments, interleaved rope) to accelerate's layout: FSDP2 holds
    torchtitan's own HF export of the weights, and the moments, step and lr its AdamW had."""
    from safetensors.torch import load_file
    from interop.converters import dcp
    got, _, _ = resumed
    ours = got["titan"]
    expected = load_file(TITAN / "expected_hf.safetensors")
    assert set(ours["model"]) == set(expected) and all(torch.equal(ours["model"][k], expected[k]) for k in expected)
    reader = dcp.Reader(TITAN / "step-2", model_config=TITAN / "config.json")
    for i in range(2):
        for hf, canonical in (("self_attn.q_proj", "attn.q"), ("self_attn.k_proj", "attn.k"),
                              ("self_attn.v_proj", "attn.v"), ("mlp.down_proj", "mlp.down")):
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(moments(ours)[(f"model.layers.{i}.{hf}.weight", kind)],
                                   reader.read(f"optim.{kind}.layers.{i}.{canonical}.weight")), (i, hf, kind)
    assert moments(ours)[("lm_head.weight", "step")].item() == 2.0
    assert ours["optimizer"]["param_groups"][0]["lr"] == 0.01 * 8 / 9
