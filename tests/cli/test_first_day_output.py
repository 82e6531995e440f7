"""What a first conversion leaves and says (issue 27 items 5 and 13): `--tokenizer DIR` to HF brings the generation
config and the bos/eos ids; notes are one line each, their details with -v."""
import json

from click.testing import CliRunner

from interop.cli.main import main
from interop.convert import convert


def cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _tokenizer_dir(path, bos: int, eos: int):
    """An HF folder as a user has it: a tokenizer (tokenizers' own files), config.json and generation_config.json
    with the special token ids, and no weights needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": bos, "</s>": eos}
    vocab.update({f"t{i}": i for i in range(250) if i not in vocab.values()})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))


def test_tokenizer_dir_brings_generation_config_and_ids(hf_checkpoints, tmp_path):
    """Item 5: `convert ./llama-meg --to hf --tokenizer ./llama-hf` wrote neither generation_config.json nor the ids."""
    convert(hf_checkpoints["llama"], tmp_path / "llama-meg", dst_format="megatron", tp=2)
    _tokenizer_dir(tmp_path / "tok", bos=1, eos=2)
    result = cli("convert", tmp_path / "llama-meg", tmp_path / "hf", "--to", "hf", "--tokenizer", tmp_path / "tok", "-q")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    import transformers
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)


def test_sentencepiece_model_gives_its_ids(hf_checkpoints, tmp_path):
    """Item 5, Megatron's `--tokenizer-model` file: the ids come from the sentencepiece model itself."""
    import sentencepiece
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"word{i} token{i % 7} piece{i % 13}" for i in range(400)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "tokenizer"), vocab_size=30,
                                            bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron")
    result = cli("convert", tmp_path / "meg", tmp_path / "hf", "--to", "hf", "--tokenizer", tmp_path / "tokenizer.model",
                 "-q")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_hf_to_mindspeed_notes_are_short(hf_checkpoints, tmp_path):
    """Item 13: HF -> MindSpeed printed a 600-character pt_meta/ note and a scheduler note with no training state
    involved: now one short line, the details with -v, and no scheduler note."""
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "ms", "--to", "mindspore", "--tp", 2, "-q")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if line.startswith("  note:")]
    assert all(len(line) <= 160 for line in notes), notes
    assert "  note: pt_meta/ written for MindSpeed's convert_ckpt2pt.py --convert-param-only, with 3 caveats " \
           "(-v: more)" in notes
    assert not any("scheduler" in line for line in result.stdout.splitlines())
    verbose = cli("-v", "convert", hf_checkpoints["llama"], tmp_path / "ms2", "--to", "mindspore", "--tp", 2, "-q")
    assert verbose.exit_code == 0, verbose.output
    details = verbose.stdout.split("with 3 caveats\n", 1)[1].splitlines()[:4]
    assert all(line.startswith("    ") for line in details) and "param_map_buffer" in details[0]
    assert any("global_batch_size" in line for line in details)


def test_a_tokenizer_model_that_is_not_sentencepiece_is_one_line(hf_checkpoints, tmp_path):
    """--tokenizer naming a file that sentencepiece cannot parse: one error line, exit 2, no output left."""
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.model").write_text("not a model")
    result = cli("convert", tmp_path / "meg", tmp_path / "out", "--to", "hf", "--tokenizer",
                 tmp_path / "tok" / "tokenizer.model")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not a sentencepiece tokenizer.model" in errors[0]
    assert not (tmp_path / "out").exists()
