"""`--from atorch`: ATorch FSDP's streaming checkpoint (save_fsdp_flat_param + save_fsdp_optim_param), read exactly.

The fixtures (tests/fixtures/atorch_fsdp, see PROVENANCE and scripts/make_atorch_fsdp_fixtures.py) were written by
ATorch 0.2.5's own savers (atorch/utils/fsdp_save_util.py) from FSDP1 over gloo on CPU after two AdamW steps of a
tiny HF Llama (vocab 250, hidden 30, 3 heads over 1 KV group): fp32 at dp 3 (every flat parameter padded to a
multiple of 3, FSDP's alignment padding between parameters) and bf16 tied at dp 2.  The references beside them
are ATorch's own consolidations run on the same files: `ConvertFlatParam` (expected.safetensors) and `ShardOptim`
(expected_optim.safetensors, 1-D per `name-state`).
"""
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hostile import assert_refused, cli, run
from interop.converters import atorch
from interop.formats import detect_format

FIXTURES = Path(__file__).parents[1] / "fixtures" / "atorch_fsdp"
FP32, BF16 = FIXTURES / "fp32_dp3", FIXTURES / "bf16_tied_dp2"


def expected(case: Path) -> dict:
    return load_file(str(case / "expected.safetensors"))


@pytest.mark.parametrize("case", [FP32, BF16], ids=["fp32_dp3", "bf16_tied_dp2"])
def test_files_are_atorchs_and_detected(case):
    world = 3 if case == FP32 else 2
    names = sorted(p.name for p in (case / "streaming_ckpt").iterdir())
    assert names == sorted(["buffers", "ckpt_meta", "optim_meta"] + [
        f"{kind}.{r:05d}-{world:05d}" for kind in ("flat_meta", "flat_param", "optim_param") for r in range(world)])
    assert detect_format(case) == "atorch"
    assert detect_format(case / "streaming_ckpt") == "atorch"


@pytest.mark.parametrize("case", [FP32, BF16], ids=["fp32_dp3", "bf16_tied_dp2"])
def test_bit_exact_against_convert_flat_param(case):
    ref = expected(case)
    reader = atorch.Reader(case)
    spec = reader.source.spec
    assert (spec.vocab, spec.heads, spec.kv_groups, spec.hidden) == (250, 3, 1, 30)
    assert spec.tied_embeddings == (case == BF16)
    weights = [m.name for m in reader.metas() if not m.name.startswith("optim.")]
    assert len(weights) == len(ref)  # the tied head is stored once, as the embedding
    for name in weights:
        got = reader.read(name)
        want = ref[reader.native_name(name)]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    reader.close()


def test_optimizer_state_bit_exact_against_shard_optim():
    ref, moments = expected(FP32), load_file(str(FP32 / "expected_optim.safetensors"))
    reader = atorch.Reader(FP32)
    names = [m.name for m in reader.metas()]
    weights = [n for n in names if not n.startswith("optim.")]
    assert len(names) == 4 * len(weights) == 4 * 21
    for name in weights:
        hf = reader.native_name(name)
        assert torch.equal(reader.read("optim.fp32_param." + name), ref[hf])
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reader.read(f"optim.{kind}.{name}").flatten(), moments[f"{hf}-{kind}"]), (kind, name)
    assert reader.source.state["optimizer"] == {"type": "adamw", "step": 2, "lr": 0.01, "betas": [0.9, 0.95],
                                                "eps": 1e-8, "weight_decay": 0.1}
    reader.close()


def test_bf16_moments_are_not_carried_and_it_says_so():
    reader = atorch.Reader(BF16)
    assert not any(m.name.startswith("optim.") for m in reader.metas())
    assert any("optimizer state not converted (weights bfloat16, moments bfloat16" in n for n in reader.source.notes)
    reader.close()


@pytest.mark.parametrize("case", [FP32, BF16], ids=["fp32_dp3", "bf16_tied_dp2"])
def test_to_hf_loads_in_transformers(case, tmp_path):
    from transformers import AutoModelForCausalLM
    code, out = run("convert", case, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    assert "unchecked: ATorch's flat_param / optim_param safetensors files carry no checksums" in out
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").state_dict()
    ref = expected(case)
    if case == BF16:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    assert set(got) == set(ref)
    assert all(got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in got)


def test_to_megatron_pp2_with_the_optimizer_reads_back_exactly(tmp_path):
    """Weights and Adam's moments into Megatron at pp 2 (vocabulary padded to 256; 3 heads over 1 KV group: tp 1),
    read back exactly."""
    from interop.converters import megatron
    code, out = run("convert", FP32, tmp_path / "meg", "--to", "megatron", "--pp", "2", "--verify")
    assert code == 0, out
    assert "megatron-core, converted (megatron)" in out and "bit-identical" in out, out  # megatron-core loads it
    back, reader = megatron.Reader(tmp_path / "meg"), atorch.Reader(FP32)
    names = [m.name for m in reader.metas()]
    assert set(names) <= {m.name for m in back.metas()}
    for name in names:
        ours = back.read(name)
        want = reader.read(name)
        assert torch.equal(ours[tuple(slice(0, n) for n in want.shape)], want), name
    assert back.source.state["optimizer"]["step"] == 2
    reader.close()


def test_model_config_when_no_config_json(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FP32 / "streaming_ckpt", folder / "streaming_ckpt")
    code, err, _ = cli("convert", folder, tmp_path / "a", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "a", "pass --model-config")
    code, out = run("convert", folder, tmp_path / "b", "--from", "atorch", "--to", "hf",
                    "--model-config", FP32 / "config.json")
    assert code == 0, out


def _copy(tmp_path: Path) -> Path:
    case = tmp_path / "case"
    shutil.copytree(FP32, case)
    return case / "streaming_ckpt"


def _rewrite_meta(path: Path, edit) -> None:
    data = pickle.loads(path.read_bytes())
    edit(data)
    path.write_bytes(pickle.dumps(data))


def test_missing_rank_file_is_one_line(tmp_path):
    folder = _copy(tmp_path)
    (folder / "flat_param.00001-00003").unlink()
    code, err, _ = cli("convert", folder.parent, tmp_path / "out", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "flat_param files of ranks [1] missing", "world size 3")


def test_rank_beyond_the_world_size_is_one_line(tmp_path):
    folder = _copy(tmp_path)
    shutil.copy(folder / "flat_param.00002-00003", folder / "flat_param.00003-00003")
    code, err, _ = cli("convert", folder.parent, tmp_path / "out", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "flat_param.00003-00003", "beyond the world size 3")


def test_missing_optimizer_file_converts_the_weights_and_says_so(tmp_path):
    folder = _copy(tmp_path)
    (folder / "optim_param.00002-00003").unlink()
    reader = atorch.Reader(folder)
    assert not any(m.name.startswith("optim.") for m in reader.metas())
    assert "optimizer state not converted (optim_param files of ranks [2] are missing); weights converted" in \
        reader.source.notes
    ref = expected(FP32)
    assert all(torch.equal(reader.read(m.name), ref[reader.native_name(m.name)]) for m in reader.metas())
    reader.close()


def test_piece_outside_its_shard_is_one_line(tmp_path):
    folder = _copy(tmp_path)
    _rewrite_meta(folder / "flat_meta.00002-00003",
                  lambda d: d["param_meta"]["lm_head.weight"].update(param_offsets=(0, 6000)))
    code, err, _ = cli("convert", folder.parent, tmp_path / "out", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "lm_head.weight", "lies outside")


def test_pieces_that_do_not_tile_the_parameter_are_one_line(tmp_path):
    folder = _copy(tmp_path)
    _rewrite_meta(folder / "flat_meta.00002-00003",
                  lambda d: d["param_meta"]["lm_head.weight"].update(param_offsets=(0, 5000)))
    code, err, _ = cli("convert", folder.parent, tmp_path / "out", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "lm_head.weight", "hold 7490 values")


def test_hostile_meta_pickle_is_refused_unrun(tmp_path):
    folder = _copy(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            import os
            return os.system, (f"touch {marker}",)

    (folder / "flat_meta.00000-00003").write_bytes(pickle.dumps({"param_meta": Evil(), "flat_param_meta": {}}))
    code, err, _ = cli("convert", folder.parent, tmp_path / "out", "--from", "atorch", "--to", "hf")
    assert_refused((code, err), tmp_path / "out", "flat_meta", "refused global", marker=marker)
