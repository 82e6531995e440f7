"""Hugging Face parameter names <-> canonical names, one table per architecture.

Each row: (HF name, its transform, the canonical tensors it holds, in order).  Transforms
(`interop.transforms`): Copy (one tensor as it is), PlainConcat (GPT2 c_attn's bias [q; k; v]),
Transpose (GPT2's Conv1D: the parts joined on the output axis, stored [in, out]), Stack (a 3-D
[experts, rows, in] tensor: for each expert `{e}` in turn its tensors joined on the output axis,
transformers 5's in-memory MoE experts; read only).
`{i}` is the global layer number, `{e}` a routed expert's number; a row whose canonical
names are absent from the model (a bias it does not have, the head of a tied model, an
expert row on a dense layer) is skipped.
"""
from ..transforms import Copy, GatedMLP, InterleavedExperts, PlainConcat, Stack, Transpose

GPT2 = [
    ("transformer.wte.weight", Copy, ["embed.word.weight"]),
    ("transformer.wpe.weight", Copy, ["embed.position.weight"]),
    ("transformer.h.{i}.ln_1.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("transformer.h.{i}.ln_1.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("transformer.h.{i}.attn.c_attn.weight", Transpose,
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("transformer.h.{i}.attn.c_attn.bias", PlainConcat,
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("transformer.h.{i}.attn.c_proj.weight", Transpose, ["layers.{i}.attn.o.weight"]),
    ("transformer.h.{i}.attn.c_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("transformer.h.{i}.ln_2.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("transformer.h.{i}.ln_2.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("transformer.h.{i}.mlp.c_fc.weight", Transpose, ["layers.{i}.mlp.up.weight"]),
    ("transformer.h.{i}.mlp.c_fc.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("transformer.h.{i}.mlp.c_proj.weight", Transpose, ["layers.{i}.mlp.down.weight"]),
    ("transformer.h.{i}.mlp.c_proj.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("transformer.ln_f.weight", Copy, ["final_norm.weight"]),
    ("transformer.ln_f.bias", Copy, ["final_norm.bias"]),
    ("lm_head.weight", Copy, ["lm_head.weight"]),
]

# Llama and the families that share its names (Qwen2, Qwen3, Mistral): absent tensors are skipped.
LLAMA = [
    ("model.embed_tokens.weight", Copy, ["embed.word.weight"]),
    ("model.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.self_attn.q_proj.weight", Copy, ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.self_attn.q_proj.bias", Copy, ["layers.{i}.attn.q.bias"]),
    ("model.layers.{i}.self_attn.k_proj.weight", Copy, ["layers.{i}.attn.k.weight"]),
    ("model.layers.{i}.self_attn.k_proj.bias", Copy, ["layers.{i}.attn.k.bias"]),
    ("model.layers.{i}.self_attn.v_proj.weight", Copy, ["layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.self_attn.v_proj.bias", Copy, ["layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.self_attn.o_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.self_attn.q_norm.weight", Copy, ["layers.{i}.attn.q_norm.weight"]),  # Qwen3
    ("model.layers.{i}.self_attn.k_norm.weight", Copy, ["layers.{i}.attn.k_norm.weight"]),
    ("model.layers.{i}.self_attn.o_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("model.layers.{i}.post_attention_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.mlp.gate_proj.weight", Copy, ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.mlp.gate_proj.bias", Copy, ["layers.{i}.mlp.gate.bias"]),
    ("model.layers.{i}.mlp.up_proj.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.mlp.up_proj.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("model.layers.{i}.mlp.down_proj.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.mlp.down_proj.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("model.norm.weight", Copy, ["final_norm.weight"]),
    ("lm_head.weight", Copy, ["lm_head.weight"]),
]

# The families whose layers have norms after attention and MLP (OLMo 2: only those; Gemma 2/3: both): HF names
# the norm on the attention's output `post_attention_layernorm` (Llama's name for the pre-MLP norm), the pre-MLP one
# `pre_feedforward_layernorm` and the MLP's output one `post_feedforward_layernorm` (transformers 5.24
# models/olmo2/modeling_olmo2.py Olmo2DecoderLayer, models/gemma2/modeling_gemma2.py Gemma2DecoderLayer).
POST_NORMS = [row for row in LLAMA if row[0] != "model.layers.{i}.post_attention_layernorm.weight"]
POST_NORMS[POST_NORMS.index(("model.layers.{i}.self_attn.o_proj.bias", Copy, ["layers.{i}.attn.o.bias"])) + 1:0] = [
    ("model.layers.{i}.post_attention_layernorm.weight", Copy, ["layers.{i}.attn_post_norm.weight"]),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
]
POST_NORMS[POST_NORMS.index(("model.layers.{i}.mlp.down_proj.bias", Copy, ["layers.{i}.mlp.down.bias"])) + 1:0] = [
    ("model.layers.{i}.post_feedforward_layernorm.weight", Copy, ["layers.{i}.mlp_post_norm.weight"]),
]

# Phi-3 (transformers 5.24 models/phi3/modeling_phi3.py): Llama's model with q, k, v in one `qkv_proj` [q; k; v]
# (Phi3Attention slices query_pos = heads * head_dim, then kv_heads * head_dim each) and gate, up in one
# `gate_up_proj` [gate; up] (Phi3MLP: `gate, up_states = up_states.chunk(2, dim=-1)`).  These are the layouts of
# PlainConcat and GatedMLP at tp 1 (HF is never tensor-parallel), so no new transform class.
_FUSED_BY_PHI3 = {"model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                  "model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.mlp.gate_proj.weight",
                  "model.layers.{i}.mlp.up_proj.weight"}
PHI3 = [row for row in LLAMA if row[0] not in _FUSED_BY_PHI3]
PHI3[1:1] = [("model.layers.{i}.self_attn.qkv_proj.weight", PlainConcat,
              ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
             ("model.layers.{i}.mlp.gate_up_proj.weight", GatedMLP,
              ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"])]

# Mixtral as its hub checkpoints hold it (and transformers 5.23's save_pretrained writes it back: its
# conversion_mapping.py "mixtral" entry renames block_sparse_moe -> mlp and stacks w1/w3 -> experts.gate_up_proj,
# w2 -> experts.down_proj on load only).  w1 = gate, w3 = up, w2 = down; `gate` is the router.
MIXTRAL_MOE = [
    ("model.layers.{i}.block_sparse_moe.gate.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", Copy, ["layers.{i}.mlp.experts.{e}.gate.weight"]),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", Copy, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"]),
]
# Qwen2-MoE (Qwen1.5-MoE hub checkpoints; transformers 5.23 conversion_mapping.py "qwen2_moe" stacks the
# experts on load only): `mlp.gate` is the router, `shared_expert_gate` [1, hidden] scales the shared expert.
QWEN2_MOE = [
    ("model.layers.{i}.mlp.gate.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.gate.weight"]),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", Copy, ["layers.{i}.mlp.shared.gate.weight"]),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", Copy, ["layers.{i}.mlp.shared.up.weight"]),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", Copy, ["layers.{i}.mlp.shared.down.weight"]),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", Copy, ["layers.{i}.mlp.shared_gate.weight"]),
]

# DeepSeek-V2 / V3 (transformers 5.24 models/deepseek_v3, deepseek_v2; the hub checkpoints): multi-latent
# attention (q_proj without q compression, else q_a_proj / q_a_layernorm / q_b_proj; kv_a_proj_with_mqa holds the
# latent then the shared rope key), `mlp.gate` the router with its `e_score_correction_bias` (V3), one tensor per
# expert, `shared_experts` (all n_shared_experts in one MLP), dense layers' MLP as Llama's.
DEEPSEEK_LAYER = [
    ("model.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.self_attn.q_proj.weight", Copy, ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.self_attn.q_a_proj.weight", Copy, ["layers.{i}.attn.q_down.weight"]),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", Copy, ["layers.{i}.attn.q_down_norm.weight"]),
    ("model.layers.{i}.self_attn.q_b_proj.weight", Copy, ["layers.{i}.attn.q_up.weight"]),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", Copy, ["layers.{i}.attn.kv_down.weight"]),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", Copy, ["layers.{i}.attn.kv_down_norm.weight"]),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", Copy, ["layers.{i}.attn.kv_up.weight"]),
    ("model.layers.{i}.self_attn.o_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.post_attention_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.mlp.gate_proj.weight", Copy, ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.mlp.up_proj.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.mlp.down_proj.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.mlp.gate.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", Copy, ["layers.{i}.mlp.router.expert_bias"]),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.gate.weight"]),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("model.layers.{i}.mlp.shared_experts.gate_proj.weight", Copy, ["layers.{i}.mlp.shared.gate.weight"]),
    ("model.layers.{i}.mlp.shared_experts.up_proj.weight", Copy, ["layers.{i}.mlp.shared.up.weight"]),
    ("model.layers.{i}.mlp.shared_experts.down_proj.weight", Copy, ["layers.{i}.mlp.shared.down.weight"]),
]
# DeepSeek-V3's MTP modules as its public release stores them (transformers ignores them on load): module {k} is
# `model.layers.{m}` with m = num_layers + k, its decoder layer named like the others.  `embed_tokens` and
# `shared_head.head` there are copies of the model's embedding and head (MIRRORS: written from them, checked
# equal to them on read; megatron-core shares them too).
DEEPSEEK_MTP = [
    ("model.layers.{m}.enorm.weight", Copy, ["mtp.{k}.enorm.weight"]),
    ("model.layers.{m}.hnorm.weight", Copy, ["mtp.{k}.hnorm.weight"]),
    ("model.layers.{m}.eh_proj.weight", Copy, ["mtp.{k}.eh_proj.weight"]),
    *[(hf.replace("model.layers.{i}.", "model.layers.{m}."), t, [c.replace("layers.{i}.", "mtp.{k}.layer.")
                                                                  for c in parts]) for hf, t, parts in DEEPSEEK_LAYER],
    ("model.layers.{m}.shared_head.norm.weight", Copy, ["mtp.{k}.final_norm.weight"]),
]
MIRRORS = {"deepseek_v3": [("model.layers.{m}.embed_tokens.weight", "embed.word.weight"),
                           ("model.layers.{m}.shared_head.head.weight", "lm_head.weight")]}
DEEPSEEK = [("model.embed_tokens.weight", Copy, ["embed.word.weight"]), *DEEPSEEK_LAYER,
            ("model.norm.weight", Copy, ["final_norm.weight"]), ("lm_head.weight", Copy, ["lm_head.weight"])]

# GLM-4.5 (transformers 5.24 models/glm4_moe; the zai-org/GLM-4.5 hub checkpoints, which conversion_mapping.py's
# "glm4_moe" -> qwen2_moe entry stacks on load only): Llama's attention (q/k/v biases, optional q_norm / k_norm) and
# dense MLP, DeepSeek's router (`mlp.gate` + `e_score_correction_bias`), per-expert tensors and `shared_experts`;
# its MTP modules stored as DeepSeek-V3's, `model.layers.{m}` after the last layer (Glm4MoePreTrainedModel ignores
# model.layers.46.* / 92.* on load).
_DEEPSEEK_MOE = [row for row in DEEPSEEK_LAYER if ".mlp.gate." in row[0] or ".experts." in row[0]
                 or ".shared_experts." in row[0]]
GLM4_MOE_LAYER = [row for row in LLAMA if "{i}" in row[0]] + _DEEPSEEK_MOE
GLM4_MOE_MTP = [row if "{i}" not in row[0] else
                (row[0].replace("model.layers.{i}.", "model.layers.{m}."), row[1],
                 [c.replace("layers.{i}.", "mtp.{k}.layer.") for c in row[2]])
                for row in DEEPSEEK_MTP[:3] + GLM4_MOE_LAYER + DEEPSEEK_MTP[-1:]]
MIRRORS["glm4_moe"] = MIRRORS["deepseek_v3"]
GLM4_MOE = [LLAMA[0], *GLM4_MOE_LAYER, LLAMA[-2], LLAMA[-1]]

# gpt-oss (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py, as save_pretrained writes it and the bf16 hub
# checkpoints hold it): Llama's attention with biases and `sinks` [heads], the router `mlp.router` with its bias, and
# every expert of a layer in one tensor each (InterleavedExperts: gate_up_proj [E, h, 2f] gate/up interleaved on the
# last axis, its bias [E, 2f] alike, down_proj [E, f, h], down_proj_bias [E, h]).  The public release's MXFP4
# `gate_up_proj_blocks` / `_scales` (and down_proj's) are read into the same tensors (interop/transforms/mxfp4.py).
_GATE_UP = ["layers.{i}.mlp.experts.{e}.gate.weight", "layers.{i}.mlp.experts.{e}.up.weight"]
GPT_OSS = [row for row in LLAMA if ".mlp." not in row[0]]
GPT_OSS[GPT_OSS.index(("model.layers.{i}.self_attn.o_proj.bias", Copy, ["layers.{i}.attn.o.bias"])) + 1:0] = [
    ("model.layers.{i}.self_attn.sinks", Copy, ["layers.{i}.attn.sinks"]),
]
GPT_OSS[GPT_OSS.index(("model.layers.{i}.post_attention_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"])) + 1:0] = [
    ("model.layers.{i}.mlp.router.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.mlp.router.bias", Copy, ["layers.{i}.mlp.router.bias"]),
    ("model.layers.{i}.mlp.experts.gate_up_proj", InterleavedExperts, _GATE_UP),
    ("model.layers.{i}.mlp.experts.gate_up_proj_bias", InterleavedExperts, [n.replace(".weight", ".bias") for n in _GATE_UP]),
    ("model.layers.{i}.mlp.experts.down_proj", InterleavedExperts, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("model.layers.{i}.mlp.experts.down_proj_bias", InterleavedExperts, ["layers.{i}.mlp.experts.{e}.down.bias"]),
]

# Qwen3-MoE (transformers 5.23 models/qwen3_moe: Qwen3MoeSparseMoeBlock): Qwen2-MoE's router and experts, no shared one.
TABLES = {"gpt_oss": GPT_OSS, "gpt2": GPT2, "llama": LLAMA, "olmo2": POST_NORMS, "gemma2": POST_NORMS, "gemma3_text": POST_NORMS, "phi3": PHI3, "mixtral": LLAMA + MIXTRAL_MOE, "qwen2_moe": LLAMA + QWEN2_MOE,
          "qwen3_moe": LLAMA + QWEN2_MOE[:4], "deepseek_v3": DEEPSEEK + DEEPSEEK_MTP, "deepseek_v2": DEEPSEEK,
          "glm4_moe": GLM4_MOE + GLM4_MOE_MTP}

# transformers 5.23's in-memory names (MixtralExperts / Qwen2MoeExperts: gate_up_proj [E, 2 * ffn, hidden] with
# each expert's gate rows then its up rows, down_proj [E, hidden, ffn]; Mixtral's router renamed to mlp.gate),
# which `save_pretrained(save_original_format=False)` writes: read, never written.
STACKED_EXPERTS = [
    ("model.layers.{i}.mlp.gate.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.mlp.experts.gate_up_proj", Stack,
     ["layers.{i}.mlp.experts.{e}.gate.weight", "layers.{i}.mlp.experts.{e}.up.weight"]),
    ("model.layers.{i}.mlp.experts.down_proj", Stack, ["layers.{i}.mlp.experts.{e}.down.weight"]),
]
_DEEPSEEK_UNSTACKED = [row for row in DEEPSEEK if ".experts.{e}." not in row[0] and ".mlp.gate.weight" not in row[0]]
STACKED_TABLES = {"gpt_oss": GPT_OSS, "mixtral": LLAMA + STACKED_EXPERTS, "qwen2_moe": LLAMA + STACKED_EXPERTS + QWEN2_MOE[4:],
                  "qwen3_moe": LLAMA + STACKED_EXPERTS, "deepseek_v2": _DEEPSEEK_UNSTACKED + STACKED_EXPERTS,
                  "deepseek_v3": _DEEPSEEK_UNSTACKED + STACKED_EXPERTS + DEEPSEEK_MTP,
                  "glm4_moe": [row for row in GLM4_MOE if ".experts.{e}." not in row[0]
                               and ".mlp.gate.weight" not in row[0]] + STACKED_EXPERTS + GLM4_MOE_MTP}
STACKED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # tells the layout apart

# What `--dtype fp8` keeps in bf16 (DeepSeek-V3's release: embeddings, output heads and the router; norms and
# biases are 1-D and never quantised): HF name fragments.
FP8_KEEP = ("embed_tokens", "lm_head", "shared_head.head", ".mlp.gate.weight", "wte", "wpe")

# Buffers some HF checkpoints carry that are not parameters: dropped with this reason.
IGNORED_SUFFIXES = {
    ".attn.bias": "GPT2 causal-mask buffer, rebuilt by the model",
    ".attn.masked_bias": "GPT2 mask-fill buffer, rebuilt by the model",
    ".rotary_emb.inv_freq": "RoPE frequency buffer, recomputed from rope_theta",
}
