"""`--from dcp`: accelerate's FSDP SHARDED_STATE_DICT (PyTorch DCP, keys `model.<HF name>`), read exactly.

The fixture (tests/fixtures/fsdp_dcp, see PROVENANCE and scripts/make_fsdp_dcp_fixtures.py) was written by
torch 2.13's FSDP2 (`fully_shard`, 2 CPU processes over gloo) after two AdamW steps of a tiny HF Llama, with
the calls accelerate's save_fsdp_model / save_fsdp_optimizer make.  The expected values are torch's own
consolidation, `dcp_to_torch_save`, run here on the same folders.
"""
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from interop.cli.main import main
from interop.converters import dcp
from interop.formats import detect_format

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fsdp_dcp"
# the same model and steps under FSDP1 (use_orig_params, SHARDED_STATE_DICT: ShardedTensor chunks)
FSDP1 = Path(__file__).parents[1] / "fixtures" / "fsdp1_dcp"


def consolidated(folder: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize("fixture", [FIXTURE, FSDP1], ids=["fsdp2", "fsdp1"])
def test_detected_not_megatron(fixture):
    assert sorted(p.name for p in (fixture / "pytorch_model_fsdp_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert detect_format(fixture) == "dcp"
    assert detect_format(fixture / "pytorch_model_fsdp_0") == "dcp"


@pytest.mark.parametrize("fixture", [FIXTURE, FSDP1], ids=["fsdp2", "fsdp1"])
def test_bit_exact_against_dcp_to_torch_save(fixture, tmp_path):
    model = consolidated(fixture / "pytorch_model_fsdp_0", tmp_path)["model"]
    optim = consolidated(fixture / "optimizer_0", tmp_path)["optimizer"]
    reader = dcp.Reader(fixture)
    spec = reader.source.spec
    assert (spec.vocab, spec.heads, spec.kv_groups, spec.tied_embeddings) == (250, 4, 2, False)
    names = [m.name for m in reader.metas()]
    weights = [n for n in names if not n.startswith("optim.")]
    assert len(weights) == len(model) and len(names) == 4 * len(model)
    for name in weights:
        hf = reader.native_name(name)[len("model."):]
        assert torch.equal(reader.read(name), model[hf]), name
        assert torch.equal(reader.read("optim.fp32_param." + name), model[hf])
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reader.read(f"optim.{kind}.{name}"), optim["state"][hf][kind]), (kind, name)
    assert reader.source.state["optimizer"] == {"type": "adamw", "step": 2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                "weight_decay": 0.01, "lr": 0.01}


def test_to_hf_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    code, out = run("convert", FIXTURE, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    expected = consolidated(FIXTURE / "pytorch_model_fsdp_0", tmp_path)["model"]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_model_config_instead_of_config_json(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "pytorch_model_fsdp_0", folder / "pytorch_model_fsdp_0")
    code, out = run("convert", folder, tmp_path / "a", "--from", "dcp", "--to", "hf")
    assert code == 2 and "pass --model-config" in out.strip().splitlines()[-1], out
    assert not (tmp_path / "a").exists()
    code, out = run("convert", folder, tmp_path / "b", "--from", "dcp", "--to", "hf",
                    "--model-config", FIXTURE / "config.json")
    assert code == 0, out
    assert "optimizer state not converted (no optimizer_0/" in out


# -- DCP as a target ---------------------------------------------------------------------------------

def fsdp2_loads(folder: Path, out: Path) -> dict:
    """What an FSDP2 model (2 ranks over gloo) holds after torch.distributed.checkpoint.load of `folder`."""
    import os
    import subprocess
    import sys
    helper = Path(__file__).parents[1] / "helpers" / "fsdp2_load.py"
    from helpers.megatron_ref import free_port
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(helper), str(folder), str(out)],  # not a fixed port: other runs
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # what torchrun said, not only its exit status
    return torch.load(out)


def test_dcp_target_loads_into_fsdp2(tmp_path):
    """GPT-2 from ColossalAI's model.pt (fused c_attn, Conv1D, tied) and a ZeRO 3 Llama (GQA) to DCP; FSDP2
    loads each and holds exactly the source's tensors."""
    from colossalai.checkpoint_io import GeneralCheckpointIO
    from transformers import AutoConfig, AutoModelForCausalLM
    state_dicts = Path(__file__).parents[1] / "fixtures" / "state_dict"
    zero3 = Path(__file__).parents[1] / "fixtures" / "deepspeed_zero" / "z3_fp32" / "checkpoint-2"
    code, out = run("convert", state_dicts / "colossalai" / "model.pt", tmp_path / "gpt2", "--to", "dcp")
    assert code == 0, out
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(state_dicts / "colossalai"))
    GeneralCheckpointIO().load_model(model, str(state_dicts / "colossalai" / "model.pt"))
    got = fsdp2_loads(tmp_path / "gpt2", tmp_path / "gpt2.pt")
    expected = model.state_dict()
    assert set(got) <= set(expected) and len(got) >= 28
    assert all(torch.equal(got[k], expected[k]) for k in got)

    code, out = run("convert", zero3, tmp_path / "llama", "--to", "dcp")
    assert code == 0, out
    assert (tmp_path / "llama" / "optimizer_0" / ".metadata").is_file()  # the moments too: test_dcp_target_optim.py
    got = fsdp2_loads(tmp_path / "llama", tmp_path / "llama.pt")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    expected = get_fp32_state_dict_from_zero_checkpoint(str(zero3))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)
    assert detect_format(tmp_path / "llama") == "dcp"  # and it reads back


def test_fsdp_optimizer_state_reaches_megatron(tmp_path):
    """accelerate's FSDP moments (and its fp32 weights as masters) into a Megatron checkpoint at tp 2, read
    back exactly by the Megatron reader."""
    from interop.converters import megatron
    code, out = run("convert", FIXTURE, tmp_path / "meg", "--to", "megatron", "--tp", "2")
    assert code == 0, out
    back, reader = megatron.Reader(tmp_path / "meg"), dcp.Reader(FIXTURE)
    moments = [m.name for m in reader.metas() if m.name.startswith("optim.")]
    assert moments and set(moments) <= {m.name for m in back.metas()}
    for name in moments:
        ours = reader.read(name)  # Megatron pads the vocabulary (250 -> a multiple of 128 x tp): compare the rows
        assert torch.equal(back.read(name)[tuple(slice(0, n) for n in ours.shape)], ours), name
    assert back.source.state["optimizer"]["step"] == 2
