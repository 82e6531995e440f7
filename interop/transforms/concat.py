"""PlainConcat and GatedMLP: parts joined one after another on the output axis."""
from __future__ import annotations

from .base import Transform


class PlainConcat(Transform):
    """The parts one after another on axis 0: HF GPT2 c_attn's bias [q; k; v], MindFormers r1.3's
    w_qkv [q; k; v] and w_gate_hidden [gate; up] (its convert_weight.py np.concatenate).

        canonical q [4, ...], k [2, ...], v [2, ...]  ->  stored [q0..q3, k0 k1, v0 v1]
        TP rank t of tp: [q_t; k_t; v_t], each part's own rank-t rows (so at tp > 1 the ranks'
        tensors are NOT an even cut of the whole stored tensor: the framework fuses per rank)
    """

    def __init__(self, shapes, axis):
        if axis not in (0, None):
            raise ValueError(f"{type(self).__name__} joins parts split on axis 0, not {axis}")
        super().__init__(shapes, axis)


class GatedMLP(PlainConcat):
    """SwiGLU's gate and up in one tensor, Megatron style (megatron-core linear_fc1 with --swiglu,
    legacy dense_h_to_4h, MindSpeed mlp.mapping): each TP rank holds [gate_r; up_r], which its
    forward chunks in two (megatron/core/transformer/mlp.py `glu`: torch.chunk(x, 2, dim=-1)).

        canonical gate [f, h], up [f, h]   ->  stored [gate; up] [2f, h]
        tp 2: rank 0 [gate[:f/2]; up[:f/2]], rank 1 [gate[f/2:]; up[f/2:]]
    """

    def __init__(self, shapes, axis):
        if len(shapes) != 2:
            raise ValueError(f"GatedMLP stores gate and up, got {len(shapes)} parts")
        super().__init__(shapes, axis)
