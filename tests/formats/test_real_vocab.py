"""Real tools' checkpoints with real vocabularies (tests/fixtures/real_vocab, PROVENANCE there).

Megatron-LM pads the vocabulary to a multiple of 128 x tp (250 -> 256, 1000 -> 1024), MindSpeed-Core-MS's
convert_pt2ckpt.py keeps those rows and saves the whole Megatron args in pt_meta/, an mbridge-built model
is saved unpadded (1000 rows).  The rows in the file are the fact, the description gives the true
vocabulary: every one converts, with the padding dropped for HF (a note), and the oracle is the tool's own
file read here with torch / safetensors, never interop's readers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hostile import assert_one_error, leftovers, run
from interop.convert import convert
from interop.formats import converter

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "real_vocab"
CASES = {"llama_v250_tp1": (250, 1, False), "llama_v1000_tp2": (1000, 2, False),
         "llama_tied_v250_tp2": (250, 2, True), "gpt2_v1000_tp1": (1000, 1, True)}


def megatron_rows(case: str) -> dict[str, torch.Tensor]:
    """The legacy model's vocab matrices as Megatron-LM saved them, joined over the tp rank files."""
    tp = CASES[case][1]
    parts = []
    for t in range(tp):
        path = ROOT / case / "megatron" / "iter_0000002" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        parts.append(torch.load(path, map_location="cpu", weights_only=False)["model"]["language_model"])
    out = {"embed": torch.cat([p["embedding"]["word_embeddings"]["weight"] for p in parts])}
    if "output_layer" in parts[0]:
        out["head"] = torch.cat([p["output_layer"]["weight"] for p in parts])
    return out


def hf_rows(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(path / "model.safetensors")
    out = {"embed": tensors.get("model.embed_tokens.weight", tensors.get("transformer.wte.weight"))}
    if "lm_head.weight" in tensors:
        out["head"] = tensors["lm_head.weight"]
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("source", ["megatron", "mindspeed"])
def test_real_padded_checkpoints_convert_to_hf_with_their_true_vocabulary(tmp_path, case, source):
    """Megatron's own args, or MindSpeed's pt_meta/ alone (no --model-config), or the user's HF config.json:
    HF gets the true rows exactly, the padding dropped with a note, and transformers loads it."""
    vocab, tp, tied = CASES[case]
    want = megatron_rows(case)
    assert want["embed"].shape[0] == (256 if vocab == 250 else 1024)  # the real tool padded them
    for given in ([], ["--model-config", str(ROOT / case / "config.json")]):
        out = tmp_path / f"hf{len(given)}"
        code, text = run("convert", ROOT / case / source, out, "--to", "hf", *given)
        assert code == 0, text
        assert f"padding rows of embed.word.weight (beyond the true vocab of {vocab})" in text
        got = hf_rows(out)
        assert sorted(got) == sorted(want) and ("head" in got) != tied
        for key in want:
            assert torch.equal(got[key], want[key][:vocab].to(got[key].dtype)), (key, given)
        assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape[0] == vocab


@pytest.mark.parametrize("case", ["llama_v1000_tp2", "gpt2_v1000_tp1"])
def test_mindspeed_pt_meta_is_the_model_description(case):
    """No --model-config: pt_meta/'s Megatron args describe the model, and say so."""
    reader = converter("mindspore").Reader(ROOT / case / "mindspeed")
    try:
        spec = reader.source.spec
        assert (spec.vocab, spec.padded_vocab, spec.num_layers, spec.hidden) == (1000, 1024, 2, 16)
        assert spec.arch == ("gpt2" if case.startswith("gpt2") else "llama")
        assert any("model description taken from pt_meta/'s Megatron args" in n for n in reader.source.notes)
    finally:
        reader.close()


def test_a_model_config_that_disagrees_with_pt_meta_is_one_line(tmp_path):
    config = json.loads((ROOT / "llama_v250_tp1" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    code, out = run("convert", ROOT / "llama_v250_tp1" / "mindspeed", tmp_path / "out", "--to", "hf",
                    "--model-config", tmp_path / "config.json")
    assert_one_error(code, out, "describe different models", "num_layers 3 vs 2", "pt_meta")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source,given", [("megatron", "--model-config"), ("megatron", "--vocab-size"),
                                          ("mindspeed", "--vocab-size")])
def test_fewer_rows_than_the_vocabulary_is_one_line(tmp_path, source, given):
    config = json.loads((ROOT / "llama_v250_tp1" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    value = tmp_path / "config.json" if given == "--model-config" else "300"
    code, out = run("convert", ROOT / "llama_v250_tp1" / source, tmp_path / "out", "--to", "hf", given, value)
    assert_one_error(code, out, "holds 256 vocab rows, fewer than the vocabulary (300)")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")


def _restate_padded(src: Path, dst: Path, padded: int) -> None:
    """A copy of a Megatron save whose args state another padded_vocab_size than its rows."""
    shutil.copytree(src, dst)
    for path in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["args"].padded_vocab_size = padded
        torch.save(state, path)


def test_a_stated_padded_size_that_disagrees_names_both_and_the_flag(tmp_path):
    _restate_padded(ROOT / "llama_v250_tp1" / "megatron", tmp_path / "meg", 384)
    code, out = run("convert", tmp_path / "meg", tmp_path / "out", "--to", "hf")
    assert_one_error(code, out, "holds 256 vocab rows", "padded_vocab_size=384", "--vocab-size")
    code, out = run("convert", tmp_path / "meg", tmp_path / "out", "--to", "hf", "--vocab-size", "250")
    assert code == 0, out
    assert torch.equal(hf_rows(tmp_path / "out")["embed"], megatron_rows("llama_v250_tp1")["embed"][:250])


def test_unpadded_torch_dist_with_a_hf_config_converts_everywhere(tmp_path):
    """An mbridge-style save (1000 rows, no args) + the HF config.json: HF gets the rows as they are, Megatron
    re-pads them (1024 at tp 2, zeros) and MindSpeed keeps them; all three come back to the same HF."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    case = ROOT / "llama_v1000_unpadded"
    dcp_to_torch_save(str(case / "torch_dist" / "iter_0000001"), str(tmp_path / "dcp.pt"))
    saved = torch.load(tmp_path / "dcp.pt", map_location="cpu", weights_only=False)
    embed = saved["embedding.word_embeddings.weight"]
    assert embed.shape[0] == 1000
    config = ["--model-config", str(case / "config.json")]
    code, out = run("convert", case / "torch_dist", tmp_path / "hf", "--to", "hf", *config)
    assert code == 0, out
    assert torch.equal(hf_rows(tmp_path / "hf")["embed"], embed)
    assert torch.equal(hf_rows(tmp_path / "hf")["head"], saved["output_layer.weight"])
    code, out = run("convert", case / "torch_dist", tmp_path / "meg", "--to", "megatron", "--tp", "2", *config)
    assert code == 0, out
    rows = torch.cat([torch.load(p, map_location="cpu", weights_only=False)["model"]["embedding.word_embeddings.weight"]
                      for p in sorted((tmp_path / "meg").glob("iter_*/mp_rank_*/model_optim_rng.pt"))])
    assert rows.shape[0] == 1024 and torch.equal(rows[:1000], embed) and not rows[1000:].any()
    convert(case / "torch_dist", tmp_path / "ms", dst_format="mindspore", tp=2, dialect="mindspeed",
            model_config=str(case / "config.json"))
    for name in ("meg", "ms"):
        convert(tmp_path / name, tmp_path / f"{name}-hf", dst_format="hf")
        assert torch.equal(hf_rows(tmp_path / f"{name}-hf")["embed"], embed), name


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_to_mindspeed_holds_what_convert_pt2ckpt_wrote(tmp_path, case):
    """interop's MindSpeed output from the real Megatron save holds every tensor the real convert_pt2ckpt.py wrote
    from it, under the same names with the same values and padded rows (mindspore's own load_checkpoint reads
    both)."""
    ms = pytest.importorskip("mindspore")
    tp = CASES[case][1]
    convert(ROOT / case / "megatron", tmp_path / "ms", dst_format="mindspore", tp=tp, dialect="mindspeed")
    for r in range(tp):
        tool = ms.load_checkpoint(str(ROOT / case / "mindspeed" / f"rank_{r}" / "network.ckpt"))
        ours = ms.load_checkpoint(str(tmp_path / "ms" / f"rank_{r}" / "network.ckpt"))
        weights = [name for name, value in tool.items() if value.ndim >= 1 and name not in ("state_step",)]
        assert any("word_embeddings" in name for name in weights)
        for name in weights:
            assert name in ours, (case, r, name)
            assert tool[name].shape == ours[name].shape, (case, r, name)
            assert (tool[name].asnumpy() == ours[name].asnumpy()).all(), (case, r, name)


def test_pt_meta_stating_another_padded_size_names_both_and_the_flag(tmp_path):
    shutil.copytree(ROOT / "llama_v250_tp1" / "mindspeed", tmp_path / "ms")
    path = tmp_path / "ms" / "pt_meta" / "args_tp00_pp000.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    saved["args"].padded_vocab_size = 384
    torch.save(saved, path)
    code, out = run("convert", tmp_path / "ms", tmp_path / "out", "--to", "hf")
    assert_one_error(code, out, "holds 256 vocab rows", "pt_meta/'s Megatron args say padded_vocab_size=384",
                     "--vocab-size")
    code, out = run("convert", tmp_path / "ms", tmp_path / "out", "--to", "hf", "--vocab-size", "250")
    assert code == 0, out
    assert torch.equal(hf_rows(tmp_path / "out")["embed"], megatron_rows("llama_v250_tp1")["embed"][:250])
