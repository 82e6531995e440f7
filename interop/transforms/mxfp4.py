"""MXFP4 expert weights (gpt-oss's public release, transformers' Mxfp4 integration): `X_blocks` uint8
[..., rows, G, 16] (two FP4 E2M1 codes a byte, the low nibble first) beside `X_scales` uint8 [..., rows, G], one
power-of-two scale (exponent + 127) per block of 32 values along the last axis:

    value[..., r, 32 g + 2 b]     = FP4[blocks[..., r, g, b] & 0xF] * 2 ** (scales[..., r, g] - 127)
    value[..., r, 32 g + 2 b + 1] = FP4[blocks[..., r, g, b] >> 4]  * 2 ** (scales[..., r, g] - 127)

then the last two axes swapped: gate_up_proj blocks [E, 2f, h / 32, 16] -> [E, h, 2f], down_proj [E, h, f / 32, 16]
-> [E, f, h], the layouts GptOssExperts computes with.  transformers 5.24 integrations/mxfp4.py
`_convert_moe_packed_tensors` computes exactly this (a lookup table in the target dtype, `torch.ldexp`, then
`transpose(1, 2)`); every FP4 value times a power of two is exact in float32 and in bfloat16 within its exponent range,
so the result does not depend on the dtype it is computed in (here float32, a few rows at a time).
"""
from __future__ import annotations

import functools

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
    def dequantize(blocks, scales, dtype, rows_per_step: int = 256, empty=None):
        """The expert tensor in `dtype` ([..., G * 32, rows], a transposed view).  Each byte's two FP4 values (low
        nibble first) come from a 256-entry table of float32 pairs (one 8-byte lookup per byte), each block's
        2 ** (s - 127) from a 256-entry table (exact powers of two: 2 ** 128 is inf in float32, as torch.exp2 gives),
        their product in float32 (exact) is cast into the output: `rows_per_step` rows at a time, through
        temporaries of a few MB that stay in cache, never a float32 copy of an expert or of the stacked tensor.
        `empty(shape, dtype)`: where the output is allocated (a reader's `memory.BufferPool`; torch.empty by default)."""
        import torch
        pairs, powers = _tables()
        *lead, rows, groups, pair = blocks.shape
        width = groups * pair
        shape = (*lead, rows, 2 * width)
        out = torch.empty(shape, dtype=dtype) if empty is None else empty(shape, dtype)
        flat_out, flat_blocks = out.view(-1, rows, 2 * width), blocks.reshape(-1, rows, width)
        flat_scales = scales.reshape(-1, rows, groups)
        step = max(1, min(rows_per_step, rows))
        codes = torch.empty(step * width, dtype=torch.int64)
        values = torch.empty(step * width, dtype=torch.float64)  # a pair of float32 values per byte
        exps = torch.empty(step * groups, dtype=torch.int64)
        factors = torch.empty(step * groups, dtype=torch.float32)
        for e in range(flat_out.shape[0]):
            for r in range(0, rows, step):
                n = min(step, rows - r)
                code, value = codes[:n * width].view(n, width), values[:n * width]
                exp, factor = exps[:n * groups].view(n, groups), factors[:n * groups]
                code.copy_(flat_blocks[e, r:r + n])
                torch.index_select(pairs, 0, code.view(-1), out=value)
                exp.copy_(flat_scales[e, r:r + n])
                torch.index_select(powers, 0, exp.view(-1), out=factor)
                products = value.view(torch.float32).view(n, groups, 2 * pair)
                products.mul_(factor.view(n, groups, 1))
                flat_out[e, r:r + n].copy_(products.view(n, 2 * width))
        return out.transpose(-1, -2)


@functools.lru_cache(maxsize=1)
def _tables():
    """(byte -> its (low, high) FP4 values as one float64-sized pair of float32, [256]; scale byte -> 2 ** (s - 127)
    in float32, [256])."""
    import torch
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    pairs = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).contiguous().view(torch.float64).view(256)
    powers = torch.tensor([2.0 ** (s - SCALE_BIAS) for s in range(256)], dtype=torch.float64).to(torch.float32)
    return pairs, powers
