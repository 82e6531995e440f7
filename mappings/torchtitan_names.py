"""torchtitan's Llama parameter names <-> canonical names (its DCP `step-N/` holds the model's state dict
at the top level, torchtitan components/checkpointer/dcp.py `_flattened_model_states_sd`).

Each row: (torchtitan name, its transform, the canonical tensors).  q and k are stored for interleaved
rope (`RopePairs`; torchtitan models/llama3/state_dict_adapter.py permutes them to and from HF).
Two spellings: torchtitan 0.3 (`attention.qkv_linear.wq`, `lm_head`) and 0.1-0.2 (`attention.wq`, `output`);
the reader takes the one whose names the checkpoint holds, the writer writes 0.3's.
"""
from ..transforms import Copy, RopePairs


def _llama(q: str, k: str, v: str, head: str) -> list:
    return [
        ("tok_embeddings.weight", Copy, ["embed.word.weight"]),
        ("layers.{i}.attention_norm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
        (f"layers.{{i}}.attention.{q}.weight", RopePairs, ["layers.{i}.attn.q.weight"]),
        (f"layers.{{i}}.attention.{k}.weight", RopePairs, ["layers.{i}.attn.k.weight"]),
        (f"layers.{{i}}.attention.{v}.weight", Copy, ["layers.{i}.attn.v.weight"]),
        ("layers.{i}.attention.wo.weight", Copy, ["layers.{i}.attn.o.weight"]),
        ("layers.{i}.ffn_norm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
        ("layers.{i}.feed_forward.w1.weight", Copy, ["layers.{i}.mlp.gate.weight"]),
        ("layers.{i}.feed_forward.w3.weight", Copy, ["layers.{i}.mlp.up.weight"]),
        ("layers.{i}.feed_forward.w2.weight", Copy, ["layers.{i}.mlp.down.weight"]),
        ("norm.weight", Copy, ["final_norm.weight"]),
        (head, Copy, ["lm_head.weight"]),
    ]


# version -> (its table, the name of the output head a tied model also stores)
TABLES = {
    "0.3": (_llama("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv", "lm_head.weight"), "lm_head.weight"),
    "0.2": (_llama("wq", "wk", "wv", "output.weight"), "output.weight"),
}
WRITTEN = "0.3"
