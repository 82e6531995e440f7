"""MXFP4 expert weights (gpt-oss's public release, transformers' Mxfp4 integration): `X_blocks` uint8
[..., rows, G, 16] (two FP4 E2M1 codes a byte, the low nibble first) beside `X_scales` uint8 [..., rows, G], one
power-of-two scale (exponent + 127) per block of 32 values along the last axis:

    value[..., r, 32 g + 2 b]     = FP4[blocks[..., r, g, b] & 0xF] * 2 ** (scales[..., r, g] - 127)
    value[..., r, 32 g + 2 b + 1] = FP4[blocks[..., r, g, b] >> 4]  * 2 ** (scales[..., r, g] - 127)

then the last two axes swapped: gate_up_proj blocks [E, 2f, h / 32, 16] -> [E, h, 2f], down_proj [E, h, f / 32, 16]
-> [E, f, h], the layouts GptOssExperts computes with.  transformers 5.24 integrations/mxfp4.py
`_convert_moe_packed_tensors` computes exactly this (a lookup table in the target dtype, `torch.ldexp`, then
`transpose(1, 2)`); every FP4 value times a power of two is exact in float32 and in bfloat16 within its exponent range,
so the result does not depend on the dtype it is computed in (here float32, one expert at a time).
"""
from __future__ import annotations

from ..errors import InteropError

# FP4 E2M1 codes 0..15 (the sign is the high bit of a nibble)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


class MXFP4:
    """One stored layout: (uint8 blocks, uint8 scales) <-> the dequantised [E, in, out] expert tensor."""

    def __repr__(self) -> str:
        return "MXFP4()"

    def __eq__(self, other) -> bool:
        return isinstance(other, MXFP4)

    def __hash__(self) -> int:
        return hash("MXFP4")

    @staticmethod
    def shape(blocks_shape) -> tuple[int, ...]:
        """The dequantised tensor's shape: [..., rows, G, 16] -> [..., G * 32, rows]."""
        *lead, rows, groups, pair = blocks_shape
        return (*lead, groups * 2 * pair, rows)

    @staticmethod
    def check(name: str, blocks_shape, scales_name: str, scales_shape) -> None:
        """Refuse, in one line, scales that are missing or whose grid is not the blocks'."""
        if scales_shape is None:
            raise InteropError(f"{name} is MXFP4 but {scales_name} is missing: its blocks cannot be read without scales")
        if len(blocks_shape) < 3 or blocks_shape[-1] * 2 != BLOCK:
            raise InteropError(f"{name} has shape {list(blocks_shape)}: MXFP4 blocks are [..., rows, groups, 16]")
        if tuple(scales_shape) != tuple(blocks_shape[:-1]):
            raise InteropError(f"{scales_name} has shape {list(scales_shape)}, but {name} {list(blocks_shape)} needs "
                               f"{list(blocks_shape[:-1])}")

    @staticmethod
    def dequantize(blocks, scales, dtype):
        """The expert tensor in `dtype` ([..., G * 32, rows], a transposed view): each byte's two FP4 values (low
        nibble first) from a 256-entry table, times its block's 2 ** (s - 127) (a power of two: exact), one leading
        slice (an expert) at a time so the float32 temporaries stay one expert's."""
        import torch
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        pairs = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1)  # byte -> (low value, high value)
        *lead, rows, groups, pair = blocks.shape
        out = torch.empty(*lead, rows, groups * 2 * pair, dtype=dtype)
        flat_out, flat_blocks = out.view(-1, rows, groups * 2 * pair), blocks.reshape(-1, rows, groups, pair)
        flat_scales = scales.reshape(-1, rows, groups)
        for e in range(flat_out.shape[0]):
            values = pairs[flat_blocks[e].to(torch.int32)]  # [rows, G, 16, 2]
            values.mul_(torch.exp2(flat_scales[e].to(torch.float32) - SCALE_BIAS)[..., None, None])
            flat_out[e].copy_(values.view(rows, groups * 2 * pair))
        return out.transpose(-1, -2)
