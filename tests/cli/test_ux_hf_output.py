"""HF output is a complete model directory: tokenizer, generation config and special token ids carried from an
HF source; `--tokenizer DIR_OR_FILE` from Megatron / MindSpore; `--max-shard-size` with an index.
The oracle is transformers itself: AutoTokenizer, GenerationConfig and AutoModelForCausalLM load the output."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from helpers.hf_models import build
from interop.cli.main import main
from interop.convert import convert
from interop.errors import InteropError

transformers = pytest.importorskip("transformers")


def tiny_tokenizer(vocab_size: int):
    """A word-level fast tokenizer with `vocab_size` entries (built here, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def complete_hf(tmp_path_factory):
    """A tiny HF Llama with a tokenizer, a generation config and special token ids, as save_pretrained writes."""
    root = tmp_path_factory.mktemp("complete") / "llama"
    model = build("llama")
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                                            max_new_tokens=7, do_sample=False)
    model.save_pretrained(root)
    tiny_tokenizer(250).save_pretrained(root)
    return root


def test_hf_source_carries_tokenizer_and_generation_config(complete_hf, tmp_path):
    summary = convert(complete_hf, tmp_path / "meg", dst_format="megatron", tp=2)
    assert any("not carried: " in n and "tokenizer.json" in n for n in summary.notes)
    summary = convert(complete_hf, tmp_path / "hf", dst_format="hf")
    assert not any("no tokenizer" in n for n in summary.notes)
    out = tmp_path / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w9").input_ids == transformers.AutoTokenizer.from_pretrained(complete_hf)("w5 w9").input_ids
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.max_new_tokens, gen.eos_token_id) == (7, 2)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.pad_token_id == 2


def test_megatron_to_hf_with_tokenizer_dir(complete_hf, tmp_path):
    convert(complete_hf, tmp_path / "meg", dst_format="megatron", tp=2, pp=2)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "meg"), str(tmp_path / "bare"), "--to", "hf", "-q"])
    assert result.exit_code == 0 and "output has no tokenizer: pass --tokenizer" in result.output
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "meg"), str(tmp_path / "hf"), "--to", "hf", "-q",
                                       "--tokenizer", str(complete_hf)])
    assert result.exit_code == 0, result.output
    assert "no tokenizer" not in result.output
    # the tokenizer folder's generation config comes too, as the README promises (issue 27 item 5; was: not)
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == \
        (complete_hf / "generation_config.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "</s>" and tok("w7").input_ids == [7]


def test_megatron_tokenizer_model_file(complete_hf, tmp_path):
    """Megatron's --tokenizer-model (a sentencepiece model) becomes tokenizer.model + a tokenizer_config.json."""
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("\n".join(f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, model_type="bpe", minloglevel=2)
    convert(complete_hf, tmp_path / "ms", dst_format="mindspore", tp=2)
    summary = convert(tmp_path / "ms", tmp_path / "hf", dst_format="hf", tokenizer=tmp_path / "sp.model")
    assert any("tokenizer_config.json" in n for n in summary.notes)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok("the quick fox").input_ids == [tok.bos_token_id] + reference.encode("the quick fox")


def test_tokenizer_errors(complete_hf, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InteropError, match="no tokenizer files"):
        convert(complete_hf, tmp_path / "a", dst_format="hf", tokenizer=tmp_path / "empty")
    with pytest.raises(InteropError, match="no such file"):
        convert(complete_hf, tmp_path / "a", dst_format="hf", tokenizer=tmp_path / "missing")
    with pytest.raises(InteropError, match="--tokenizer does not apply"):
        convert(complete_hf, tmp_path / "a", dst_format="interop", tokenizer=complete_hf)
    assert not (tmp_path / "a").exists()


def test_max_shard_size(complete_hf, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(complete_hf), str(tmp_path / "hf"), "--to", "hf", "-q",
                                       "--max-shard-size", "300KB"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(set(index["weight_map"].values()))
    assert all((out / f).stat().st_size <= 300_000 + 10_000 for f in files)  # + the header
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(complete_hf).eval()
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, original(tokens).logits)
    result = CliRunner().invoke(main, ["convert", str(complete_hf), str(tmp_path / "x"), "--to", "hf",
                                       "--max-shard-size", "lots"])
    assert result.exit_code == 2 and "expected a size such as 5GB" in result.output


def test_megatron_tokenizer_model_from_its_args(tmp_path):
    """A Megatron checkpoint whose args name a --tokenizer-model inside the checkpoint: HF output gets it, with
    a note.  One named outside the checkpoint is not copied (the checkpoint picks the name), said so."""
    spm = pytest.importorskip("sentencepiece")
    from helpers.megatron_built import hand_built, megatron_args
    (tmp_path / "corpus.txt").write_text("\n".join(f"a b c d e f g h {i}" for i in range(100)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=30, model_type="bpe", minloglevel=2)
    model = build("llama")
    args = megatron_args(model, "llama", 1, 1)
    args["tokenizer_model"] = str(tmp_path / "meg" / "sp.model")
    hand_built(tmp_path / "meg", model, "llama", tp=1, pp=1, args=args)
    shutil.copyfile(tmp_path / "sp.model", tmp_path / "meg" / "sp.model")
    summary = convert(tmp_path / "meg", tmp_path / "hf", dst_format="hf")
    assert any("the checkpoint's --tokenizer-model" in n for n in summary.notes), summary.notes
    assert not any("no tokenizer" in n for n in summary.notes)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("a b").input_ids[0] == 1  # <s> first
    (tmp_path / "meg" / "sp.model").unlink()  # named but gone: no tokenizer, said so
    summary = convert(tmp_path / "meg", tmp_path / "hf2", dst_format="hf")
    assert any("output has no tokenizer" in n for n in summary.notes)
    args["tokenizer_model"] = str(tmp_path / "sp.model")  # exists, but outside the checkpoint
    hand_built(tmp_path / "meg2", model, "llama", tp=1, pp=1, args=args)
    summary = convert(tmp_path / "meg2", tmp_path / "hf3", dst_format="hf")
    assert any("tokenizer not copied" in n and "--tokenizer" in n for n in summary.notes), summary.notes
    assert not (tmp_path / "hf3" / "tokenizer.model").exists()


def test_common_format_keeps_what_an_hf_source_carries(complete_hf, tmp_path):
    """HF -> interop (tp 2) -> interop (tp 1) -> HF: the tokenizer, generation config and token ids survive
    the hub format (kept in `carried/`, checksummed in the manifest) and transformers loads them."""
    convert(complete_hf, tmp_path / "hub", dst_format="interop", tp=2)
    assert (tmp_path / "hub" / "carried" / "tokenizer.json").is_file()
    convert(tmp_path / "hub", tmp_path / "hub1", dst_format="interop")
    summary = convert(tmp_path / "hub1", tmp_path / "hf", dst_format="hf")
    assert not any("no tokenizer" in n or "not carried" in n for n in summary.notes)
    out = tmp_path / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w9").input_ids == transformers.AutoTokenizer.from_pretrained(complete_hf)("w5 w9").input_ids
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


@pytest.mark.parametrize("carried, why", [
    ({"files": ["../escape.json"], "config": {}}, "plain file name"),
    ({"files": ["tokenizer.json"], "config": {}}, "plain file name"),  # not listed under files
    ({"files": "tokenizer.json"}, "'carried' must be"),
])
def test_a_bad_carried_entry_is_one_line(complete_hf, tmp_path, carried, why):
    convert(complete_hf, tmp_path / "hub", dst_format="interop")
    manifest_path = tmp_path / "hub" / "interop.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["carried"] = carried
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("carried/")}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(InteropError, match=why):
        convert(tmp_path / "hub", tmp_path / "hf", dst_format="hf")
    assert not (tmp_path / "hf").exists()
