"""`--from state_dict`: one torch.save file of HF names (FSDP FULL_STATE_DICT, ColossalAI's model.pt), exactly.

Fixtures: tests/fixtures/state_dict (PROVENANCE, scripts/make_state_dict_fixtures.py): accelerate's
`pytorch_model_fsdp.bin` gathered from a FSDP2-sharded tiny Llama (vocab 1000, GQA, tied) and ColossalAI
0.5.0's own `GeneralCheckpointIO.save_model` of a tiny GPT-2 (Conv1D, fused c_attn, vocab 250).  The
expected values: the file as torch loads it, and the model ColossalAI's own `load_model` builds from it.
"""
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner

from interop.cli.main import main
from interop.formats import detect_format

ROOT = Path(__file__).parents[1] / "fixtures" / "state_dict"
FSDP = ROOT / "fsdp_full" / "pytorch_model_fsdp.bin"
COLOSSAL = ROOT / "colossalai" / "model.pt"


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def hf_state(folder: Path) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_detected():
    assert detect_format(FSDP) == "state_dict" and detect_format(COLOSSAL) == "state_dict"


def test_fsdp_full_state_dict_to_hf_is_exact(tmp_path):
    code, out = run("convert", FSDP, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    saved, got = torch.load(FSDP), hf_state(tmp_path / "hf")
    assert set(got) == set(saved)
    assert all(torch.equal(got[k], saved[k]) for k in got)


def test_colossalai_model_pt_matches_colossalai_load_model(tmp_path):
    from colossalai.checkpoint_io import GeneralCheckpointIO
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(COLOSSAL.parent))
    GeneralCheckpointIO().load_model(model, str(COLOSSAL))  # ColossalAI's own reading of its file
    code, out = run("convert", COLOSSAL, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    expected, got = model.state_dict(), hf_state(tmp_path / "hf")
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_without_a_description_is_one_line_and_model_config_fixes_it(tmp_path):
    lone = tmp_path / "model.pt"
    shutil.copy(COLOSSAL, lone)
    code, out = run("convert", lone, tmp_path / "a", "--to", "hf")
    assert code == 2 and "pass --model-config" in out.strip().splitlines()[-1], out
    assert not (tmp_path / "a").exists()
    code, out = run("convert", lone, tmp_path / "b", "--to", "megatron", "--tp", "2",
                    "--model-config", COLOSSAL.parent / "config.json")
    assert code == 0, out


def test_legacy_colossalai_pipeline_checkpoint_is_refused_with_why(tmp_path):
    """The seeds' hybrid-parallel GPT saved by colossalai.legacy's save_checkpoint (colossalai 0.5.0
    legacy/utils/checkpointing.py: {"epoch", "model", "optimizer", "lr_scheduler"}; the model merged from every
    stage's state dict, whose blocks each stage numbers from 0): refused in one line saying why."""
    model = {"embedding.word_embeddings.weight": torch.zeros(8, 4), "blocks.0.attn.query_key_value.weight":
             torch.zeros(12, 4), "norm.weight": torch.ones(4), "head.weight": torch.zeros(8, 4)}
    torch.save({"epoch": 3, "model": model, "optimizer": {}, "lr_scheduler": {}}, tmp_path / "gpt.pt")
    code, out = run("convert", tmp_path / "gpt.pt", tmp_path / "out", "--to", "hf")
    assert code == 2 and out.strip().splitlines()[-1].startswith("error:"), out
    assert "later stage's blocks.N overwrote the earlier ones'" in out
    assert not (tmp_path / "out").exists()
