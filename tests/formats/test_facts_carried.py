"""Facts carried faithfully (issue 27 items 10 and 11): the source's dropouts, not Megatron's defaults; Llama-3 rope
scaling that megatron-core's flags cannot state survives HF -> Megatron -> HF unchanged."""
import json

import torch
from click.testing import CliRunner

from helpers.family_models import build
from interop.cli.main import main
from interop.convert import convert


def cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _args(path) -> dict:
    return vars(torch.load(path / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"])


def test_dropouts_of_the_source(hf_checkpoints, tmp_path):
    """Item 10: HF Llama (attention_dropout 0.0, no hidden dropout) -> Megatron stored Megatron's 0.1 / 0.1; then
    `map-args` of that checkpoint and `convert --to hf` disagreed. Now both say the source's 0.0."""
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron")
    args = _args(tmp_path / "meg")
    assert (args["attention_dropout"], args["hidden_dropout"]) == (0.0, 0.0)
    convert(tmp_path / "meg", tmp_path / "hf", dst_format="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["attention_dropout"] == 0.0
    mapped = cli("map-args", tmp_path / "meg", "--to", "hf", "-o", tmp_path / "mapped.json")
    assert mapped.exit_code == 0, mapped.output
    assert json.loads((tmp_path / "mapped.json").read_text())["attention_dropout"] == 0.0


def test_megatron_dropouts_reach_hf(hf_checkpoints, tmp_path):
    """A Megatron run's own dropouts (0.1 / 0.1, Megatron's defaults) reach HF's keys: GPT2's attn_pdrop /
    resid_pdrop / embd_pdrop, Llama's attention_dropout (it has no hidden dropout)."""
    for kind, keys in (("gpt2", ("attn_pdrop", "resid_pdrop", "embd_pdrop")), ("llama", ("attention_dropout",))):
        convert(hf_checkpoints[kind], tmp_path / f"{kind}-meg", dst_format="megatron")
        path = tmp_path / f"{kind}-meg" / "release" / "mp_rank_00" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        state["args"].attention_dropout, state["args"].hidden_dropout = 0.1, 0.1  # as Megatron's own run saves them
        torch.save(state, path)
        convert(tmp_path / f"{kind}-meg", tmp_path / f"{kind}-hf", dst_format="hf")
        config = json.loads((tmp_path / f"{kind}-hf" / "config.json").read_text())
        assert {k: config[k] for k in keys} == dict.fromkeys(keys, 0.1), kind


def test_llama3_rope_scaling_survives_megatron(tmp_path):
    """Item 11: rope scaling with original_max_position_embeddings 64: HF -> Megatron kept only the factor, and
    Megatron -> HF wrote 8192; `verify` then called them different models. Now the args carry the whole scaling."""
    build("llama3-short").save_pretrained(tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert source["original_max_position_embeddings"] == 64
    result = cli("convert", tmp_path / "hf", tmp_path / "meg", "--to", "megatron", "--tp", 2, "-q")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if "rope scaling" in line]
    assert len(notes) == 1 and "kept in the args as interop_rope_scaling" in notes[0]
    args = vars(torch.load(tmp_path / "meg" / "release" / "mp_rank_00" / "model_optim_rng.pt",
                           weights_only=False)["args"])
    assert args["use_rope_scaling"] and args["rope_scaling_factor"] == 4.0
    assert args["interop_rope_scaling"]["original_max_positions"] == 64
    result = cli("convert", tmp_path / "meg", tmp_path / "back", "--to", "hf", "-q")
    assert result.exit_code == 0, result.output
    back = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert back == source
    verified = cli("verify", tmp_path / "hf", tmp_path / "back", "--reference-only")
    assert verified.exit_code == 0, verified.output
    assert "weights: " in verified.stdout and verified.stdout.rstrip().endswith("OK")


def test_megatron_own_rope_scaling_stays_megatrons(tmp_path):
    """A Megatron checkpoint without interop's key keeps megatron-core's meaning: 1 / 4 / 8192."""
    build("llama3-short").save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "meg", dst_format="megatron")
    path = tmp_path / "meg" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["args"].interop_rope_scaling  # as Megatron-LM itself saves it
    torch.save(state, path)
    convert(tmp_path / "meg", tmp_path / "back", dst_format="hf")
    back = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert (back["factor"], back["low_freq_factor"], back["high_freq_factor"],
            back["original_max_position_embeddings"]) == (4.0, 1.0, 4.0, 8192)
