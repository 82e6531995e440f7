"""Megatron args <-> ModelSpec for the DeepSeek facts: multi-latent attention, YaRN, group-limited routing,
routed scaling, MTP modules.  `megatron_spec` calls these beside its own rules.

Facts from megatron-core 0.16.1:
- transformer_config.py MLATransformerConfig: q_lora_rank (None: one q projection), kv_lora_rank,
  qk_head_dim (the part WITHOUT rope: ours is qk_head_dim + qk_pos_emb_head_dim), qk_pos_emb_head_dim,
  v_head_dim; rope_type "rope" or "yarn" (rotary_scaling_factor, mscale, mscale_all_dim;
  original_max_position_embeddings 4096, beta_fast 32, beta_slow 1 are config fields no Megatron-LM flag sets);
- models/common/embeddings/rope_utils.py `_apply_rotary_pos_emb_bshd(multi_latent_attention=True)`: the rope part
  is always taken as interleaved pairs (x[0::2], x[1::2]): an MLA model in Megatron is `rope_interleave`;
- transformer/moe/moe_utils.py `group_limited_topk`: a group scores the sum of its topk // group_topk best,
  so DeepSeek-V3's sum of two is `moe_router_topk == 2 * moe_router_group_topk`; `topk_scaling_factor`
  multiplies the routed weights;
- transformer/multi_token_prediction.py: `mtp_num_layers` modules, loss scaled by `mtp_loss_scaling_factor`.
"""
from __future__ import annotations

from ..errors import InteropError
from ..spec import ModelSpec, yarn_rope_scaling

YARN_FIXED = {"original_max_positions": 4096, "beta_fast": 32.0, "beta_slow": 1.0}  # MLATransformerConfig's


def mla_from_args(full: dict, where: str) -> dict:
    """ModelSpec fields of an MLA model's args ({} without --multi-latent-attention)."""
    if not full.get("multi_latent_attention"):
        return {}
    nope, rope = int(full.get("qk_head_dim") or 128), int(full.get("qk_pos_emb_head_dim") or 64)
    q_rank = full.get("q_lora_rank")
    return dict(head_dim=nope + rope, kv_groups=int(full["num_attention_heads"]),
                q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(full.get("kv_lora_rank") or 32),
                qk_rope_head_dim=rope, v_head_dim=int(full.get("v_head_dim") or 128), rope_interleave=True)


def yarn_from_args(full: dict, where: str):
    """ModelSpec.rope_scaling of --rope-type yarn (None otherwise)."""
    if full.get("rope_type") != "yarn":
        return None
    original = full.get("rope_scaling_original_max_position_embeddings")  # MindSpeed-LLM's spellings, when given
    beta_fast, beta_slow = full.get("beta_fast"), full.get("beta_slow")
    return yarn_rope_scaling(float(full.get("rotary_scaling_factor") or 1.0),
                             int(original or YARN_FIXED["original_max_positions"]),
                             float(YARN_FIXED["beta_fast"] if beta_fast is None else beta_fast),
                             float(YARN_FIXED["beta_slow"] if beta_slow is None else beta_slow),
                             float(full.get("mscale") or 0.0), float(full.get("mscale_all_dim") or 0.0))


def mtp_from_args(full: dict) -> dict:
    layers = int(full.get("mtp_num_layers") or 0)
    weight = full.get("mtp_loss_scaling_factor")
    return dict(mtp_layers=layers, mtp_loss_weight=0.1 if weight is None else float(weight))


def routing_from_args(full: dict, topk: int, where: str) -> dict:
    """Group-limited routing and routed scaling of a MoE model's args."""
    out = {}
    groups, group_topk = full.get("moe_router_num_groups"), full.get("moe_router_group_topk")
    if groups is not None or group_topk is not None:
        if groups is None or group_topk is None:
            raise InteropError(f"{where}: --moe-router-num-groups and --moe-router-group-topk go together")
        if topk != 2 * int(group_topk):
            raise InteropError(f"{where}: megatron-core scores a group by the sum of its moe_router_topk // "
                               f"moe_router_group_topk = {topk // int(group_topk)} best experts; the model "
                               "description holds DeepSeek-V3's sum of two (topk = 2 x group_topk)")
        out.update(moe_groups=int(groups), moe_group_topk=int(group_topk), moe_group_score="top2")
    scaling = full.get("moe_router_topk_scaling_factor")
    if scaling is not None:
        out["moe_routed_scaling"] = float(scaling)
    return out


def deepseek_args(spec: ModelSpec) -> dict:
    """The Megatron args that state `spec`'s DeepSeek facts (MLA, yarn, MTP); the plain defaults otherwise."""
    out = {"multi_latent_attention": spec.is_mla, "mtp_num_layers": spec.mtp_layers or None,
           "mtp_loss_scaling_factor": spec.mtp_loss_weight}
    if spec.is_mla:
        out.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
                   qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_type="rope")
    scaling = spec.rope_scaling
    if scaling is not None and scaling["type"] == "yarn" and spec.is_mla:  # a GPT model's: megatron_spec.GPT_YARN
        out.update(rope_type="yarn", rotary_scaling_factor=scaling["factor"], mscale=scaling["mscale"],
                   mscale_all_dim=scaling["mscale_all_dim"])
        # no Megatron-LM flag states these: MindSpeed-LLM's spellings, only where they are not core's defaults
        for key, dest in (("original_max_positions", "rope_scaling_original_max_position_embeddings"),
                          ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if scaling[key] != YARN_FIXED[key]:
                out[dest] = scaling[key]
    return out


def routing_args(spec: ModelSpec) -> dict:
    return {"moe_router_num_groups": spec.moe_groups, "moe_router_group_topk": spec.moe_group_topk,
            "moe_router_topk_scaling_factor": None if spec.moe_routed_scaling == 1.0 else spec.moe_routed_scaling}


def refusals(spec: ModelSpec) -> list[str]:
    """What Megatron args cannot hold exactly: refused (the model would compute differently)."""
    out = []
    if spec.is_mla and not spec.rope_interleave:
        out.append("megatron-core's multi-latent attention rotates interleaved pairs of the rope part; this model "
                   "rotates its halves (rope_interleave false)")
    # (a token keeping every group, GLM-4.5's one group of all experts, chooses nothing by the group scores)
    if spec.moe_groups is not None and spec.moe_group_topk < spec.moe_groups and (
            spec.moe_group_score != "top2" or spec.moe_topk != 2 * spec.moe_group_topk):
        out.append(f"megatron-core scores a group by the sum of its moe_router_topk // moe_router_group_topk best "
                   f"experts; this model's groups score {spec.moe_group_score} with top-k {spec.moe_topk} of "
                   f"{spec.moe_group_topk} groups")
    return out


def losses(spec: ModelSpec) -> list[str]:
    """YaRN values no Megatron-LM flag states (MLATransformerConfig's defaults apply)."""
    scaling = spec.rope_scaling
    if scaling is None or scaling["type"] != "yarn" or not spec.is_mla:  # a GPT model's yarn: Bridge's fields
        return []
    off = {k: scaling[k] for k, v in YARN_FIXED.items() if scaling[k] != v}
    return [f"yarn {', '.join(f'{k} {v}' for k, v in off.items())}: no Megatron-LM flag states it (written as "
            f"MindSpeed-LLM's flags; megatron-core's MLATransformerConfig has "
            f"{', '.join(f'{k} {YARN_FIXED[k]}' for k in off)})"] if off else []
