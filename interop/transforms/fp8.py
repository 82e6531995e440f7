"""Block-scaled FP8 weights (DeepSeek-V3's release, transformers' fine-grained FP8): a float8_e4m3fn weight
[rows, cols] beside `weight_scale_inv`, one float32 scale per block of `block` = (128, 128) elements, the grid
ceil-divided (a [576, 7168] weight has a [5, 56] grid, its last block row 64 rows high):

    weight[r, c] = fp8[r, c] * scale_inv[r // block_rows, c // block_cols]

Dequantising multiplies in float32 and rounds once to the target dtype: DeepSeek's reference `weight_dequant`
(inference/kernel.py: `x.to(float32) * s`, stored in the default dtype) and transformers 5.24's
`Fp8Dequantize._dequantize_one` (`(q * s).to(output_dtype)`) compute exactly this.  Quantising is their inverse
rule (transformers' `Fp8Quantize`): scale = 448 / amax(block), fp8 = clamp(x * scale, +-448), scale_inv = 1 / scale.
The HF reader applies it to every weight with a scale; a weight without its scale, or a scale whose grid does not
match, is refused (`check`).
"""
from __future__ import annotations

from ..errors import InteropError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class BlockScaledFP8:
    """One stored layout: (fp8 weight, float32 scale_inv per block) <-> a full-precision tensor."""

    def __init__(self, block=(128, 128)):
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise InteropError(f"weight_block_size must be two positive integers, got {block!r}")
        self.block = tuple(block)

    def __repr__(self) -> str:
        return f"BlockScaledFP8(block={list(self.block)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockScaledFP8) and other.block == self.block

    def __hash__(self) -> int:
        return hash(self.block)

    def scale_shape(self, shape) -> tuple[int, ...]:
        """The scale grid of a weight: its last two axes ceil-divided by the block (leading axes kept)."""
        if len(shape) < 2:
            raise InteropError(f"a block-scaled FP8 weight has at least 2 axes, got shape {list(shape)}")
        *lead, rows, cols = shape
        return (*lead, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def check(self, name: str, shape, scale_name: str, scale_shape) -> None:
        """Refuse, in one line, a scale that is missing or whose grid is not this weight's."""
        if scale_shape is None:
            raise InteropError(f"{name} is float8_e4m3fn but {scale_name} is missing: an FP8 weight without its "
                               "scale cannot be read")
        want = self.scale_shape(shape)
        if tuple(scale_shape) != want:
            raise InteropError(f"{scale_name} has shape {list(scale_shape)}, but {name} {list(shape)} in blocks of "
                               f"{list(self.block)} needs {list(want)}")

    def _expand(self, scale, shape):
        """The scale of every element (float32): each block's scale repeated over it, cut to the weight."""
        rows, cols = shape[-2:]
        full = scale.repeat_interleave(self.block[0], dim=-2).repeat_interleave(self.block[1], dim=-1)
        return full[..., :rows, :cols]

    def dequantize(self, weight, scale_inv, dtype):
        """The weight in `dtype`: fp8 and scale multiplied in float32, rounded once.  In place on one float32
        copy padded to whole blocks, each block times its scale by broadcasting (no per-element scale tensor)."""
        import torch
        *lead, rows, cols = weight.shape
        grid_rows, grid_cols = scale_inv.shape[-2:]
        padded = torch.zeros(*lead, grid_rows * self.block[0], grid_cols * self.block[1], dtype=torch.float32)
        padded[..., :rows, :cols] = weight
        blocks = padded.view(*lead, grid_rows, self.block[0], grid_cols, self.block[1])
        blocks.mul_(scale_inv.to(torch.float32).unsqueeze(-1).unsqueeze(-3))
        return padded[..., :rows, :cols].to(dtype)

    def quantize(self, tensor):
        """(float8_e4m3fn weight, float32 scale_inv): each block scaled so its largest magnitude is 448."""
        import torch
        x = tensor.to(torch.float32)
        *lead, rows, cols = x.shape
        grid = self.scale_shape(x.shape)
        padded = torch.zeros(*lead, grid[-2] * self.block[0], grid[-1] * self.block[1], dtype=torch.float32)
        padded[..., :rows, :cols] = x
        blocks = padded.unflatten(-1, (grid[-1], self.block[1])).unflatten(-3, (grid[-2], self.block[0]))
        amax = blocks.abs().amax(dim=(-3, -1))
        scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)  # transformers' rule
        q = (x * self._expand(scale, x.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, (1.0 / scale).to(torch.float32)
