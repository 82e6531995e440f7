"""The headline: `interop convert MEGATRON_DIR OUT --from megatron --to mindspore --tp 8 --pp 4`
on a Megatron checkpoint of another layout (tp 2 / pp 2), and back to HF bit-exact."""
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from interop.cli.main import main


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("dialect", ["mindspeed", "mindformers"])
def test_megatron_tp2pp2_to_mindspore_tp8pp4(tmp_path, dialect):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                                      num_hidden_layers=8, intermediate_size=128, vocab_size=300,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    cli("convert", tmp_path / "hf", tmp_path / "megatron", "--to", "megatron", "--tp", 2, "--pp", 2)
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").is_file()
    out = cli("convert", tmp_path / "megatron", tmp_path / "ms", "--from", "megatron", "--to", "mindspore",
              "--tp", 8, "--pp", 4, "--dialect", dialect)
    assert "tp=8 pp=4" in out
    cli("convert", tmp_path / "ms", tmp_path / "back", "--from", "mindspore", "--to", "hf")
    want, got = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
