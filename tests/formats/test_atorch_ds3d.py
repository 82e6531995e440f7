"""`--from deepspeed` on ATorch's DS 3D: a DeepSpeed PipelineModule of HF Llama modules, split over tp 2 by ATorch.

The fixture (tests/fixtures/atorch_ds3d, see PROVENANCE and scripts/make_atorch_ds3d_fixture.py) was written by
ATorch 0.2.5's own `auto_accelerate` with the `deepspeed_3d_parallel` strategy of dlrover's
atorch/examples/llama2/ds_3d_llama2.py (tensor 2 x data 1 x pipeline 2, ZeRO 1, two AdamW steps) on CPU: per
tensor-parallel rank `layer_00` the vocab-parallel embedding (251 tokens padded to 252 rows: 126 a rank),
`layer_01/02` the decoder layers (q/k/v/gate/up split by rows, o/down by columns), `layer_03` the norm, `layer_04`
transformers' model-level rotary_emb (empty), no head (the logits come from the tied embedding), though the HF
config says tie_word_embeddings=false.  expected.safetensors: the trained weights gathered in memory from every
rank's parameters and joined as ATorch's layers split them.
"""
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hostile import assert_refused, cli, run
from interop.converters import deepspeed
from interop.formats import detect_format

FIXTURE = Path(__file__).parents[1] / "fixtures" / "atorch_ds3d"


def expected() -> dict:
    return load_file(str(FIXTURE / "expected.safetensors"))


def test_files_are_atorchs_and_detected():
    tag = FIXTURE / "global_step2"
    names = sorted(p.name for p in tag.iterdir() if p.name.startswith("layer_"))
    assert names == [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(5) for t in range(2)]
    assert torch.load(tag / "layer_04-model_01-model_states.pt", weights_only=True) == {}
    assert torch.load(tag / "layer_00-model_00-model_states.pt", weights_only=True)["weight"].shape == (126, 32)
    assert detect_format(FIXTURE) == "deepspeed"


def test_bit_exact_against_the_trained_model():
    ref = expected()
    reader = deepspeed.Reader(FIXTURE)
    spec = reader.source.spec
    assert (spec.vocab, spec.padded_vocab, spec.heads, spec.kv_groups, spec.tied_embeddings) == (251, 252, 4, 2, True)
    assert (reader.layout.tp, reader.layout.pp) == (2, 2)
    assert any("read as tied" in n for n in reader.source.notes)
    weights = [m.name for m in reader.metas() if not m.name.startswith("optim.")]
    assert len(weights) == len(ref) == 20
    by_hf = {"embed.word.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    for name in weights:
        native = reader.native_name(name).split(": ", 1)[1]
        hf = by_hf.get(name) or f"model.layers.{name.split('.')[1]}.{native}"
        assert torch.equal(reader.read(name), ref[hf]), name
    reader.close()


def test_zero_masters_are_the_weights_and_moments_are_whole():
    """fp32 training: ZeRO's fp32 masters (from the optimizer partitions) equal the layer files' weights, so
    every tensor-parallel shard's state sits where the ATorch split puts the weight."""
    reader = deepspeed.Reader(FIXTURE)
    assert reader.source.state["optimizer"]["step"] == 2
    names = [m.name for m in reader.metas()]
    weights = [n for n in names if not n.startswith("optim.")]
    assert len(names) == 4 * len(weights)
    for name in weights:
        assert torch.equal(reader.read("optim.fp32_param." + name), reader.read(name)), name
        avg, sq = reader.read("optim.exp_avg." + name), reader.read("optim.exp_avg_sq." + name)
        assert avg.shape == sq.shape == reader.read(name).shape and bool((sq >= 0).all()) and sq.any(), name
    reader.close()


def test_to_hf_loads_in_transformers_tied(tmp_path):
    from transformers import AutoModelForCausalLM
    code, out = run("convert", FIXTURE, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.tie_word_embeddings is True
    got, ref = model.state_dict(), expected()
    assert torch.equal(got["model.embed_tokens.weight"], ref["model.embed_tokens.weight"][:251])
    assert torch.equal(got["lm_head.weight"], ref["model.embed_tokens.weight"][:251])
    assert all(torch.equal(got[k], v) for k, v in ref.items() if k != "model.embed_tokens.weight")


def test_to_megatron_tp2_pp2_with_the_optimizer_reads_back_exactly(tmp_path):
    from interop.converters import megatron
    code, out = run("convert", FIXTURE, tmp_path / "meg", "--to", "megatron", "--tp", "2", "--pp", "2", "--verify")
    assert code == 0, out
    assert "megatron-core, converted (megatron)" in out and "bit-identical" in out, out  # megatron-core loads it
    back, reader = megatron.Reader(tmp_path / "meg"), deepspeed.Reader(FIXTURE)
    names = [m.name for m in reader.metas()]
    assert set(names) <= {m.name for m in back.metas()}
    for name in names:
        want = reader.read(name)[:251] if "embed.word" in name else reader.read(name)
        got = back.read(name)
        assert torch.equal(got[tuple(slice(0, n) for n in want.shape)], want), name
    assert back.source.state["optimizer"]["step"] == 2
    reader.close()


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_split_the_table_does_not_name_is_one_line(monkeypatch):
    """Each key split over the tp ranks must be split as ATorch's table (mappings/deepspeed_names.py
    ATORCH_TP_SPLITS) says: a key it does not list as split is refused, named."""
    from interop.converters.deepspeed import pipeline
    from interop.errors import InteropError
    splits = {k: v for k, v in pipeline.ATORCH_TP_SPLITS.items() if k != ("layer", "mlp.down_proj.weight")}
    monkeypatch.setattr(pipeline, "ATORCH_TP_SPLITS", splits)
    with pytest.raises(InteropError, match="mlp.down_proj.weight over 2 tensor-parallel ranks"):
        deepspeed.Reader(FIXTURE)


def test_a_norm_cut_over_tp_is_one_line(tmp_path):
    """A norm cut in halves over the tp ranks (ATorch keeps norms whole): refused, naming the file."""
    ckpt = _copy(tmp_path)
    for t in range(2):
        path = ckpt / "global_step2" / f"layer_03-model_{t:02d}-model_states.pt"
        sd = torch.load(path, weights_only=True)
        torch.save({"weight": sd["weight"][t * 16:(t + 1) * 16].clone()}, path)
    code, err, _ = cli("convert", ckpt, tmp_path / "out", "--from", "deepspeed", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "layer_03")


def test_untied_config_without_a_tied_module_is_one_line(tmp_path):
    """No head and no tied module on the last stage: the checkpoint does not say where the logits come from."""
    ckpt = _copy(tmp_path)
    for mp in (2, 3):
        path = ckpt / "global_step2" / f"mp_rank_{mp:02d}_model_states.pt"
        state = torch.load(path, weights_only=False)
        state["param_shapes"] = [type(g)((k, v) for k, v in g.items() if not k.startswith("tied_modules."))
                                 for g in state["param_shapes"]]
        torch.save(state, path)
    code, err, _ = cli("convert", ckpt, tmp_path / "out", "--from", "deepspeed", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "tie_word_embeddings=False", "do not hold an lm_head")


def test_model_config_saying_tied_is_read_without_the_note(tmp_path):
    """--model-config with tie_word_embeddings true reads it as it says."""
    import json
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out = run("convert", FIXTURE, tmp_path / "out", "--from", "deepspeed", "--to", "hf",
                    "--model-config", tmp_path / "config.json")
    assert code == 0, out
    assert "read as tied" not in out
