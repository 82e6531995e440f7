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


class WholeConcat(PlainConcat):
    """The parts one after another on axis 0, the whole tensor on every TP rank whatever the parts' own split:
    a fused projection each rank computes whole.

        canonical q_a [r_q, h] (replicated), kv_a [r_kv + rope, h] (replicated)  ->  stored [q_a; kv_a]
        canonical q [heads * d, h] (column), kv_a [r_kv + rope, h]               ->  stored [q; kv_a]
        every TP rank of tp: the whole stored tensor

    MindSpeed-LLM's multi-latent attention `linear_qkv` (mindspeed_llm/tasks/checkpoint/convert_hf2mg.py
    set_model_layer_attn, pack_mla: torch.cat([q_a_proj or q_proj, kv_a_proj_with_mqa]) cloned to every tp rank):
    with query compression both parts are replicated anyway; without it (DeepSeek-V2-Lite) its q_proj, cut by heads
    in megatron-core, is whole here too."""

    @classmethod
    def bind(cls, spec, params) -> "WholeConcat":
        return cls([p.shape for p in params], None)


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
