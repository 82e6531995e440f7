"""Block-scaled FP8 Hugging Face sources as DeepSeek-V3's release stores them (config.json quantization_config
{quant_method: fp8, fmt: e4m3, weight_block_size}; every projection float8_e4m3fn beside its float32
`weight_scale_inv`, grids ceil-divided; embeddings, norms, router and head in bf16): dequantised exactly as
transformers' fine-grained FP8 / DeepSeek's weight_dequant, to bf16 by default or --dtype, said in the summary;
incomplete or inconsistent scales refused in one line with nothing left behind."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.deepseek_models import config_json, save, v3_config
from helpers.hostile import assert_one_error, run
from interop.convert import convert
from interop.errors import InteropError
from interop.transforms import BlockScaledFP8

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
BLOCK = [16, 16]  # tiny widths: kv_a_proj_with_mqa's 40 rows make a ceil-divided grid of 3, as V3's 576 make 5
TOKENS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(4))


def quantizable(key: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's release quantises the linear projections, not embeddings, norms, router or head."""
    return t.dim() == 2 and "embed_tokens" not in key and "lm_head" not in key and "shared_head.head" not in key \
        and not key.endswith(("mlp.gate.weight", "norm.weight"))


def fp8_checkpoint(root, block, config=None):
    """The tiny V3 (with its MTP module) stored as DeepSeek-V3's release stores it, in blocks of `block`."""
    save(config or v3_config(), root / "bf16", mtp=True)
    held = load_file(root / "bf16" / "model.safetensors")
    out = {}
    for key, t in held.items():
        if quantizable(key, t):
            q, s = BlockScaledFP8(block).quantize(t)
            out[key], out[key[:-len("weight")] + "weight_scale_inv"] = q, s
        else:
            out[key] = t if key.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    (root / "fp8").mkdir()
    save_file(out, root / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = config_json(root / "bf16")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    (root / "fp8" / "config.json").write_text(json.dumps(config))
    return root / "fp8"


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8"), BLOCK)


def expected(q, s, dtype):
    """transformers' own dequantisation where its grid divides the weight; DeepSeek's per-block
    weight_dequant (x.to(float32) * s, stored in dtype) where the grid is ceil-divided."""
    if q.shape[0] % BLOCK[0] == 0 and q.shape[1] % BLOCK[1] == 0:
        return fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            r, c = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[r, c] = (q[r, c].to(torch.float32) * s[i, j]).to(dtype)
    return out


@pytest.mark.parametrize("dtype, torch_dtype", [("keep", torch.bfloat16), ("fp32", torch.float32)])
def test_fp8_source_is_dequantised_exactly_and_says_so(fp8_source, tmp_path, dtype, torch_dtype):
    summary = convert(fp8_source, tmp_path / "hf", dst_format="hf", dtype=dtype)
    held, out = load_file(fp8_source / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    scaled = [k for k in held if k.endswith("weight_scale_inv")]
    assert len(scaled) > 100 and not [k for k in out if "scale_inv" in k]
    assert any(held[k].shape[0] % BLOCK[0] for k in held if k.endswith("kv_a_proj_with_mqa.weight"))
    for scale in scaled:
        key = scale[:-len("_scale_inv")]
        assert out[key].dtype == torch_dtype and torch.equal(out[key], expected(held[key], held[scale], torch_dtype)), key
    note = [n for n in summary.notes if n.startswith("dequantised")]
    assert note and f"dequantised {len(scaled)} block-scaled FP8 weights" in note[0]
    assert note[0].split(" to ")[-1].startswith(dict(keep="bfloat16", fp32="float32")[dtype])
    assert "quantization_config" not in config_json(tmp_path / "hf")
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(TOKENS).logits).all()


def _edited(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    held = load_file(src / "model.safetensors")
    config = config_json(src)
    if edit_tensors:
        edit_tensors(held)
    if edit_config:
        edit_config(config)
    save_file(held, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


K = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize("tensors, config, message", [
    (lambda t: t.pop(K + "_scale_inv"), None, f"{K} is float8_e4m3fn but {K}_scale_inv is missing"),
    (lambda t: t.update({K + "_scale_inv": t[K + "_scale_inv"][:2]}), None,
     rf"{K}_scale_inv has shape \[2, 4\], but {K} \[40, 64\] in blocks of \[16, 16\] needs \[3, 4\]"),
    (lambda t: t.update({K: t[K].to(torch.bfloat16)}), None, f"{K}_scale_inv scales no float8_e4m3fn weight"),
    (None, lambda c: c.pop("quantization_config"), "is block-scaled FP8 but config.json has no quantization_config"),
    (None, lambda c: c.update(quantization_config={"quant_method": "gptq"}), "quant_method 'gptq' is not supported"),
    (None, lambda c: c["quantization_config"].update(weight_block_size=[16]),
     "weight_block_size must be two positive integers"),
])
def test_bad_fp8_source_is_one_error_and_leaves_nothing(fp8_source, tmp_path, tensors, config, message):
    src = _edited(fp8_source, tmp_path / "src", tensors, config)
    with pytest.raises(InteropError, match=message):
        convert(src, tmp_path / "out", dst_format="hf")
    assert not (tmp_path / "out").exists()
    assert_one_error(*run("convert", src, tmp_path / "out2", "--to", "hf"))
    assert not (tmp_path / "out2").exists()


def test_fp8_source_to_fp8_hf_keeps_weights_and_scales_byte_identical(tmp_path):
    src = fp8_checkpoint(tmp_path / "src", [128, 128])  # DeepSeek-V3's block: the writer's
    summary = convert(src, tmp_path / "hf", dst_format="hf", dtype="fp8", workers=1)
    held, out = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(held) == sorted(out)
    for key in held:  # fp8 weights, fp32 scales and correction biases, bf16 rest: all as they were
        assert out[key].dtype == held[key].dtype, key
        assert torch.equal(out[key].view(torch.uint8), held[key].view(torch.uint8)), key
    scaled = sum(k.endswith("weight_scale_inv") for k in held)
    assert any(f"{scaled} weights and scales kept byte-identical from the FP8 source, 0 quantised" in n
               for n in summary.notes)
    assert config_json(tmp_path / "hf")["quantization_config"]["weight_block_size"] == [128, 128]


def test_full_precision_source_to_fp8_hf_quantises_by_transformers_rule_and_reads_back(tmp_path):
    save(v3_config(), tmp_path / "bf16", mtp=True)
    summary = convert(tmp_path / "bf16", tmp_path / "fp8", dst_format="hf", dtype="fp8")
    held, out = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(tmp_path / "fp8" / "model.safetensors")
    key = "model.layers.3.self_attn.kv_b_proj.weight"  # the MTP module's: quantised as well
    assert out[key].dtype == torch.float8_e4m3fn and out[key + "_scale_inv"].shape == (1, 1)
    assert out["model.embed_tokens.weight"].dtype == held["model.embed_tokens.weight"].dtype  # not quantised
    assert out["model.layers.1.mlp.gate.weight"].dtype == held["model.layers.1.mlp.gate.weight"].dtype
    assert torch.equal(out["model.layers.3.embed_tokens.weight"], out["model.embed_tokens.weight"])
    q, s = BlockScaledFP8().quantize(held[key])
    assert out["model.norm.weight"].dtype == held["model.norm.weight"].dtype  # kept
    assert torch.equal(out[key].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[key + "_scale_inv"], s)
    assert any("0 weights and scales kept" in n and "quantised (transformers' rule)" in n for n in summary.notes)
    back = convert(tmp_path / "fp8", tmp_path / "back", dst_format="hf")
    assert any(n.startswith("dequantised") for n in back.notes)


def test_fp8_target_that_cannot_hold_it_is_refused(fp8_source, tmp_path):
    assert_one_error(*run("convert", fp8_source, tmp_path / "out", "--to", "interop", "--dtype", "fp8"),
                     "--dtype fp8", "cannot store block-scaled FP8")
    assert not (tmp_path / "out").exists()


def test_megatron_fp8_target_is_refused_with_its_reason(fp8_source, tmp_path):
    """megatron-core stores FP8-trained weights in high precision: its dist_checkpointing `load` dequantises the
    model's FP8 parameters before reading (megatron/core/dist_checkpointing/serialization.py, 0.16.1:
    `force_all_tensors_to_non_fp8`), so a Megatron target has no block-scaled form to write; the FP8 source itself
    converts to Megatron by dequantising (test_megatron_mla.py)."""
    assert_one_error(*run("convert", fp8_source, tmp_path / "out", "--to", "megatron", "--dtype", "fp8"),
                     "--dtype fp8", "high precision", "--dtype bf16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_fp8_source_to_megatron_ep2_is_its_dequantisation(tmp_path, fmt):
    """FP8 HF -> Megatron (tp 2, ep 2, bf16) -> HF gives exactly what FP8 HF -> HF bf16 gives: the Megatron
    files hold the dequantised weights (what megatron-core loads), nothing re-rounded on the way.  Top-4 of 2
    groups: megatron-core scores a group by its top-k / group-top-k best experts (the tiny V3's top-2 is not)."""
    fp8_source = fp8_checkpoint(tmp_path / "src", BLOCK, v3_config(num_experts_per_tok=4))
    direct = convert(fp8_source, tmp_path / "direct", dst_format="hf", dtype="bf16")
    via = convert(fp8_source, tmp_path / "mcore", dst_format="megatron", format=fmt, tp=2, ep=2, dtype="bf16")
    assert any(n.startswith("dequantised") for n in via.notes) and any(n.startswith("dequantised") for n in direct.notes)
    convert(tmp_path / "mcore", tmp_path / "back", dst_format="hf")
    a, b = load_file(tmp_path / "direct" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and not any(k.endswith("_scale_inv") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_transformers_loads_the_fp8_output_as_interop_dequantises_it(tmp_path):
    """transformers' own FP8 loader (on CPU it dequantises to bf16, Fp8Dequantize) and interop's dequantisation
    of the same written checkpoint give the same model: equal logits."""
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it
    transformers = __import__("transformers")
    save(v3_config(), tmp_path / "full", mtp=True)
    convert(tmp_path / "full", tmp_path / "fp8", dst_format="hf", dtype="fp8")
    convert(tmp_path / "fp8", tmp_path / "bf16", dst_format="hf")  # FP8 weights to bf16, the rest kept
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(theirs(TOKENS).logits, ours(TOKENS).logits)
