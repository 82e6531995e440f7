"""MXFP4 (interop/transforms/mxfp4.py): dequantisation bit for bit as transformers 5.24's own
(integrations/mxfp4.py `convert_moe_packed_tensors`, run here on CPU as the oracle), for gpt-oss's gate_up_proj and
down_proj block shapes, every code and a wide exponent range; bad scales refused in one line."""
import pytest
import torch

from interop.errors import InteropError
from interop.transforms import MXFP4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def packed(shape, seed=0, low=110, high=140):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    scales = torch.randint(low, high, shape[:-1], dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 2 * 96, 64 // 32, 16), (4, 64, 96 // 32, 16)])  # gate_up [E, 2f, h/32, 16], down
def test_dequantize_is_bit_identical_to_transformers(shape, dtype):
    blocks, scales = packed(shape)
    ours = MXFP4.dequantize(blocks, scales, dtype)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.dtype == dtype and tuple(ours.shape) == MXFP4.shape(shape) == tuple(theirs.shape)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), theirs.view(bits))


def test_every_code_and_the_nibble_order():
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)  # every byte once
    scales = torch.full((1, 1, 16), 127, dtype=torch.uint8)  # 2 ** 0
    out = MXFP4.dequantize(blocks, scales, torch.float32).view(-1)
    assert out[0].item() == 0.0 and out[2 * 0x16].item() == 4.0 and out[2 * 0x16 + 1].item() == 0.5  # low nibble first
    assert out[2 * 0xF0 + 1].item() == -6.0
    wide = MXFP4.dequantize(*packed((2, 8, 1, 16), seed=1, low=100, high=160), torch.float32)
    assert torch.equal(wide, mxfp4.convert_moe_packed_tensors(*packed((2, 8, 1, 16), seed=1, low=100, high=160),
                                                              dtype=torch.float32))


def test_bad_scales_are_refused_in_one_line():
    with pytest.raises(InteropError, match=r"x_blocks is MXFP4 but x_scales is missing"):
        MXFP4.check("x_blocks", (2, 8, 1, 16), "x_scales", None)
    with pytest.raises(InteropError, match=r"x_scales has shape \[2, 8\], but x_blocks \[2, 8, 1, 16\] needs \[2, 8, 1\]"):
        MXFP4.check("x_blocks", (2, 8, 1, 16), "x_scales", (2, 8))


def previous_dequantize(blocks, scales, dtype):
    """The kernel interop used before the table-of-pairs one (one expert at a time through float32 temporaries of
    the expert's size, torch.exp2 for the scales): the reference the faster kernel must equal bit for bit."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.arange(256)
    pairs = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1)
    *lead, rows, groups, pair = blocks.shape
    out = torch.empty(*lead, rows, groups * 2 * pair, dtype=dtype)
    flat_out, flat_blocks = out.view(-1, rows, groups * 2 * pair), blocks.reshape(-1, rows, groups, pair)
    flat_scales = scales.reshape(-1, rows, groups)
    for e in range(flat_out.shape[0]):
        values = pairs[flat_blocks[e].to(torch.int32)]
        values.mul_(torch.exp2(flat_scales[e].to(torch.float32) - 127)[..., None, None])
        flat_out[e].copy_(values.view(rows, groups * 2 * pair))
    return out.transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_per_step", [1, 7, 256])
def test_the_kernel_equals_the_previous_one_on_every_code_and_every_scale(dtype, rows_per_step):
    """All 256 bytes (so all 16 nibbles in both places) under every one of the 256 scale exponents, extremes
    included (2 ** -127 subnormal, 2 ** 128 overflowing to inf and 0 x inf = nan), plus random bytes in uneven row
    steps: the same bits as the previous kernel, nan for nan."""
    every = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(256, 1, 1)  # [256 rows, 16 groups, 16]
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()
    rand_blocks, rand_scales = packed((3, 37, 5, 16), seed=2, low=0, high=256)
    for blocks, scales in ((every[None], scales[None]), (rand_blocks, rand_scales)):
        ours = MXFP4.dequantize(blocks, scales, dtype, rows_per_step=rows_per_step)
        before = previous_dequantize(blocks, scales, dtype)
        assert ours.shape == before.shape and ours.dtype == dtype
        assert torch.equal(ours.isnan(), before.isnan())
        bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
        same = ours.view(bits) == before.view(bits)
        assert bool((same | ours.isnan()).all())
    assert ours.isnan().any() and ours.isinf().any()  # the extremes were reached (scale 255 over random bytes)
