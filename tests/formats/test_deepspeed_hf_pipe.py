"""`--from deepspeed`: a DeepSpeed PipelineModule whose layers are a Hugging Face model's own modules.

The fixture (tests/fixtures/deepspeed-hf-pipe, PROVENANCE; scripts/make_ds_hf_pipeline_fixture.py) was written
by DeepSpeed 0.19.8's `engine.save_checkpoint` (CPU, gloo, pp 2 x dp 2, ZeRO 1, two AdamW steps) for
PipelineModule([nn.Embedding, LlamaDecoderLayer x 4, LlamaRMSNorm, nn.Linear]): the embedding, the final norm
and the head files each hold just `weight`; the layers hold HF names after `model.layers.{i}.`.
`expected.safetensors`: the trained weights gathered from every rank's parameters in memory.
"""
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from interop.cli.main import main
from interop.converters import deepspeed
from interop.formats import detect_format

FIXTURE = Path(__file__).parents[1] / "fixtures" / "deepspeed-hf-pipe"
EXPECTED = load_file(FIXTURE / "expected.safetensors")
GPT_MODEL_PIPE = Path(__file__).parents[1] / "fixtures" / "deepspeed"


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_on_disk_the_three_small_files_hold_just_weight():
    step = FIXTURE / "global_step2"
    assert (FIXTURE / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in step.glob("layer_*")) == [f"layer_{i:02d}-model_states.pt" for i in range(7)]
    for i in (0, 5, 6):
        assert list(torch.load(step / f"layer_{i:02d}-model_states.pt", weights_only=True)) == ["weight"]
    assert detect_format(FIXTURE) == "deepspeed"


def test_to_hf_loads_in_transformers_bit_exact(tmp_path):
    from transformers import AutoModelForCausalLM
    code, out = run("convert", FIXTURE, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    assert "a PipelineModule of HF modules: the embedding, final norm and head told apart" in out
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(got) == set(EXPECTED) and len(got) == 39
    assert all(torch.equal(got[k], EXPECTED[k]) for k in EXPECTED)


def test_placed_by_position_and_shape_and_zero_state_read():
    """The final norm (1-D) and the head ([vocab, hidden]) are told apart; the ZeRO-1 masters over two
    data-parallel partitions and two stages equal the weights (fp32 run), the moments are there, step 2."""
    reader = deepspeed.Reader(FIXTURE)
    assert reader.native_name("embed.word.weight") == "layer_00: weight"
    assert reader.native_name("final_norm.weight") == "layer_05: weight"
    assert reader.native_name("lm_head.weight") == "layer_06: weight"
    assert reader.native_name("layers.3.mlp.gate.weight") == "layer_04: mlp.gate_proj.weight"
    assert (reader.source.spec.vocab, reader.source.spec.tied_embeddings, reader.layout.pp) == (250, False, 2)
    weights = [m.name for m in reader.metas() if not m.name.startswith("optim.")]
    assert len(weights) == 39
    for name in weights:
        assert torch.equal(reader.read("optim.fp32_param." + name), reader.read(name)), name
        assert reader.read("optim.exp_avg_sq." + name).abs().sum() > 0, name
    assert reader.source.state["optimizer"]["step"] == 2


def test_model_config_when_no_config_json(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "global_step2", src / "global_step2")
    shutil.copy(FIXTURE / "latest", src / "latest")
    code, out = run("convert", src, tmp_path / "a", "--from", "deepspeed", "--to", "hf")
    assert code == 2 and not (tmp_path / "a").exists()
    assert out.strip().splitlines()[-1].endswith("a PipelineModule of HF modules is read with its config.json "
                                                 "beside `latest` or --model-config"), out
    code, out = run("convert", src, tmp_path / "b", "--to", "hf", "--model-config", FIXTURE / "config.json", "-q")
    assert code == 0, out
    code, out = run("convert", GPT_MODEL_PIPE, tmp_path / "c", "--to", "hf", "--model-config", FIXTURE / "config.json")
    assert code == 2 and "--model-config does not apply to a Megatron-DeepSpeed checkpoint" in out, out
