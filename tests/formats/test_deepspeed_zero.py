"""`--from deepspeed` on the HF Trainer's DeepSpeed checkpoints: ZeRO 1, 2 and 3, fp32 and bf16, read exactly.

The fixtures (tests/fixtures/deepspeed_zero, see PROVENANCE and scripts/make_zero_trainer_fixtures.py) were
written by DeepSpeed 0.19.8's own engine (CPU, gloo, dp 2) after two AdamW steps of a tiny HF Llama (vocab
250, GQA), saved as the HF Trainer saves them.  The expected values are DeepSpeed's own consolidation,
`get_fp32_state_dict_from_zero_checkpoint` (what zero_to_fp32.py writes), run here on the same files.
"""
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from interop.cli.main import main
from interop.converters import deepspeed
from interop.formats import detect_format

ROOT = Path(__file__).parents[1] / "fixtures" / "deepspeed_zero"
VARIANTS = ["z1_fp32", "z2_fp32", "z3_fp32", "z1_bf16", "z2_bf16", "z3_bf16"]


def checkpoint(variant: str) -> Path:
    return ROOT / variant / "checkpoint-2"


def zero_to_fp32(folder: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(folder)).items()}


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize("variant", VARIANTS)
def test_files_are_deepspeeds_and_detected(variant):
    folder = checkpoint(variant)
    assert (folder / "latest").read_text().strip() == "global_step2"
    names = sorted(p.name for p in (folder / "global_step2").iterdir())
    bf16 = "bf16_" if variant.endswith("bf16") else ""  # DeepSpeed names every bf16 run's optimizer files so
    assert [n for n in names if n.endswith("optim_states.pt")] == [
        f"{bf16}zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(2)]
    if variant.startswith("z3"):
        assert [n for n in names if n.endswith("model_states.pt")] == [
            f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(2)]
        assert not (folder / "model.safetensors").exists()  # stage3_gather_16bit_weights_on_model_save=false
    else:
        assert "mp_rank_00_model_states.pt" in names
    assert detect_format(folder) == "deepspeed"  # before hf, though ZeRO 1/2 folders hold model.safetensors
    assert detect_format(folder / "global_step2") == "deepspeed"  # config.json found beside the tag folder


@pytest.mark.parametrize("variant", VARIANTS)
def test_bit_exact_against_zero_to_fp32(variant):
    """Every fp32 master equals DeepSpeed's consolidation; the weights are the masters (ZeRO 3) or the
    module's own (ZeRO 1/2: the masters rounded to the run's dtype)."""
    expected = zero_to_fp32(checkpoint(variant))
    reader = deepspeed.Reader(checkpoint(variant))
    spec = reader.source.spec
    assert (spec.vocab, spec.heads, spec.kv_groups, spec.num_layers) == (250, 4, 2, 2)
    assert spec.tied_embeddings == (variant in ("z2_fp32", "z1_bf16", "z3_bf16"))
    weight_dtype = torch.bfloat16 if variant.endswith("bf16") and not variant.startswith("z3") else torch.float32
    names = {m.name: m for m in reader.metas()}
    weights = [n for n in names if not n.startswith("optim.")]
    assert len(weights) == len(expected) - spec.tied_embeddings  # zero_to_fp32 repeats the tied lm_head
    for name in weights:
        hf = reader.native_name(name)
        assert names[name].dtype == weight_dtype
        assert torch.equal(reader.read(name), expected[hf].to(weight_dtype)), name
        assert torch.equal(reader.read("optim.fp32_param." + name), expected[hf]), name
        assert reader.read("optim.exp_avg_sq." + name).min() >= 0
    state = reader.source.state
    assert state["iteration"] == 2 and state["optimizer"]["step"] == 2
    assert state["optimizer"]["betas"] == [0.9, 0.95] and state["optimizer"]["weight_decay"] == 0.01


@pytest.mark.parametrize("variant", ["z1_fp32", "z2_bf16"])
def test_zero12_module_is_what_the_trainer_saved(variant):
    """The module in the engine file is the model.safetensors the Trainer's save_model wrote beside it."""
    saved = load_file(checkpoint(variant) / "model.safetensors")
    reader = deepspeed.Reader(checkpoint(variant))
    for m in reader.metas():
        if not m.name.startswith("optim."):
            assert torch.equal(reader.read(m.name), saved[reader.native_name(m.name)])


def test_zero3_to_hf_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    code, out = run("convert", checkpoint("z3_bf16"), tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    assert "ZeRO 3: weights rebuilt from the fp32 master partitions" in out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = zero_to_fp32(checkpoint("z3_bf16"))
    for name, tensor in model.state_dict().items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(tensor, expected[source]), name


def test_optimizer_state_reaches_the_common_format(tmp_path):
    from interop.store import StoreReader
    code, out = run("convert", checkpoint("z2_fp32"), tmp_path / "store", "--to", "interop", "--tp", "2")
    assert code == 0, out
    store, reader = StoreReader(tmp_path / "store"), deepspeed.Reader(checkpoint("z2_fp32"))
    moments = [m.name for m in reader.metas() if m.name.startswith("optim.exp_avg.")]
    assert moments
    for name in moments:
        assert torch.equal(store.read(name), reader.read(name))
    assert store.source.state["optimizer"]["step"] == 2


def test_zero3_without_its_optimizer_files_is_one_line(tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint("z3_fp32"), folder)
    (folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    code, out = run("convert", folder, tmp_path / "out", "--from", "deepspeed", "--to", "hf")
    assert code == 2 and out.strip().splitlines()[-1].startswith("error:"), out
    assert "hold the only copy of the weights" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant", ["z2_fp32", "z3_fp32", "z1_bf16"])
def test_moments_bit_exact_against_deepspeeds_universal_checkpoint(variant, tmp_path):
    """exp_avg, exp_avg_sq and the masters per parameter equal DeepSpeed's own consolidation of the optimizer
    state (`ds_to_universal`, which writes zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt)."""
    import os
    import subprocess
    import sys
    out = tmp_path / "universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(checkpoint(variant) / "global_step2"), "--output_folder", str(out), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=300)
    reader = deepspeed.Reader(checkpoint(variant))
    checked = 0
    for m in reader.metas():
        if m.name.startswith("optim."):
            kind = m.name.split(".")[1]
            hf = reader.native_name(m.name.split(".", 2)[2])
            saved = torch.load(out / "zero" / hf / f"{'fp32' if kind == 'fp32_param' else kind}.pt", weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            assert torch.equal(reader.read(m.name), saved.view(m.shape)), m.name
            checked += 1
    assert checked == 3 * len([m for m in reader.metas() if not m.name.startswith("optim.")])


def test_optimizer_state_reaches_mindspeed(tmp_path):
    """ZeRO's masters and moments into MindSpeed-Core-MS .ckpt files at tp 2, read back exactly."""
    from interop.converters import mindspore
    code, out = run("convert", checkpoint("z2_fp32"), tmp_path / "ms", "--to", "mindspore", "--dialect", "mindspeed",
                    "--tp", "2")
    assert code == 0, out
    back, reader = mindspore.Reader(tmp_path / "ms"), deepspeed.Reader(checkpoint("z2_fp32"))
    names = {m.name for m in back.metas()}
    moments = [m.name for m in reader.metas() if m.name.startswith(("optim.exp_avg.", "optim.exp_avg_sq."))]
    assert moments and set(moments) <= names
    for name in moments:
        assert torch.equal(back.read(name), reader.read(name)), name


def test_zero1_with_a_missing_optimizer_file_converts_the_weights_and_says_so(tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint("z1_fp32"), folder)
    (folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    code, out = run("convert", folder, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    assert "optimizer state not converted (the ZeRO file of dp rank 0 is missing); weights converted" in out
    saved = load_file(checkpoint("z1_fp32") / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(got[k], saved[k]) for k in got)


def test_deepspeeds_adam_is_adamw_unless_told():
    """ds_config's "Adam" runs AdamW (decoupled weight decay) unless adam_w_mode is false (DeepSpeed 0.19.8
    runtime/engine.py _configure_basic_optimizer); the neutral type says which, for Megatron's and DCP's groups."""
    from interop.converters.deepspeed.zero import update_rule
    assert update_rule({"type": "Adam", "params": {"lr": 1e-3}}) == "adamw"
    assert update_rule({"type": "Adam", "params": {"adam_w_mode": False}}) == "adam"
    assert update_rule({"type": "AdamW"}) == "adamw" and update_rule({"type": "Lamb"}) == "lamb"
