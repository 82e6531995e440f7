"""BlockScaledFP8 (interop/transforms/fp8.py): dequantisation bit for bit as transformers 5.24's fine-grained FP8
(`Fp8Dequantize._dequantize_one`) and DeepSeek's reference `weight_dequant` (inference/kernel.py: each 128x128
block loaded as float32, times its scale, stored in the default dtype), including DeepSeek-V3's ceil-divided grids
(kv_a_proj_with_mqa [576, 7168] has a [5, 56] grid); bad scales refused in one line."""
import pytest
import torch

from interop.errors import InteropError
from interop.transforms import BlockScaledFP8

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def quantized(shape, seed=0, block=(128, 128)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 0.02
    return BlockScaledFP8(block).quantize(x)


def weight_dequant_reference(q, s, block, dtype):
    """DeepSeek-V3 inference/kernel.py weight_dequant_kernel, one program per block: y = x.to(fp32) * s."""
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = (q[rows, cols].to(torch.float32) * s[i, j]).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)])  # a weight, and stacked experts
def test_dequantize_is_bit_identical_to_transformers(shape, dtype):
    q, s = quantized(shape)
    ours = BlockScaledFP8().dequantize(q, s, dtype)
    theirs = fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    assert ours.dtype == dtype and torch.equal(ours.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                               theirs.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_dequantize_matches_deepseeks_weight_dequant_on_a_ceil_divided_grid():
    q, s = quantized((576, 300))  # DeepSeek-V3's kv_a_proj_with_mqa height, a width that is not a multiple
    assert s.shape == (5, 3)
    ours = BlockScaledFP8().dequantize(q, s, torch.bfloat16)
    assert torch.equal(ours, weight_dequant_reference(q, s, (128, 128), torch.bfloat16))


def test_quantize_is_transformers_rule_and_round_trips_within_fp8_precision():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    q, s = BlockScaledFP8().quantize(x)

    class Config:
        weight_block_size = (128, 128)
        scale_fmt = None
    quantizer = type("Q", (), {"quantization_config": Config()})()
    theirs = fp8.Fp8Quantize(quantizer)._quantize_one("w.weight", x)
    assert torch.equal(q.view(torch.uint8), theirs["w.weight"].view(torch.uint8))
    assert torch.equal(s, theirs["w.weight_scale_inv"])
    back = BlockScaledFP8().dequantize(q, s, torch.float32)
    assert (back - x).abs().max() <= x.abs().max() / 8  # e4m3: 3 mantissa bits


def test_scale_grid_and_refusals():
    t = BlockScaledFP8([128, 128])
    assert t.scale_shape((576, 7168)) == (5, 56) and t.scale_shape((8, 2048, 7168)) == (8, 16, 56)
    t.check("w.weight", (576, 7168), "w.weight_scale_inv", (5, 56))
    with pytest.raises(InteropError, match=r"w.weight_scale_inv is missing"):
        t.check("w.weight", (576, 7168), "w.weight_scale_inv", None)
    with pytest.raises(InteropError, match=r"w.weight_scale_inv has shape \[4, 56\], but w.weight \[576, 7168\] "
                                           r"in blocks of \[128, 128\] needs \[5, 56\]"):
        t.check("w.weight", (576, 7168), "w.weight_scale_inv", (4, 56))
    with pytest.raises(InteropError, match="weight_block_size must be two positive integers"):
        BlockScaledFP8([128])
