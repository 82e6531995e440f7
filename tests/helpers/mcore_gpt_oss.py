"""megatron-core 0.16.1's own GPTModel (local layer spec) built from a gpt-oss Megatron checkpoint's args, as
Megatron-Bridge's GPTOSSProvider sets them (models/gpt_oss/gpt_oss_provider.py: softmax_type "learnable",
activation_func quick_gelu with activation_func_clamp_value and glu_linear_offset, add_bias_linear, window_size with
window_attn_skip_freq, position_embedding_type "yarn" with the yarn_* fields), the rank file loaded strictly, its logits
on the tokens given written to a file.  Run as a script (its own process: it starts a one-rank gloo world):

    python tests/helpers/mcore_gpt_oss.py MEGATRON_DIR TOKENS.pt OUT.pt

CPU: megatron-core builds its sliding-window mask on CUDA (transformer/utils.py get_sliding_window_causal_mask); here
the same mask on CPU (True = masked: the future and keys more than window[0] behind), nothing else replaced.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main(megatron_dir: str, tokens_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from interop.io.safe_pickle import safe_torch_load
    from interop.workflows import megatron_framework as MF
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    MF._patch_cpu()
    MF._patch_no_te_router()
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_softmax
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1)

    def cpu_window_mask(sq, sk, window):
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        return (j > i) | (i - j > window[0])

    fused_softmax.get_sliding_window_causal_mask = cpu_window_mask
    files = sorted(Path(megatron_dir).rglob("model_optim_rng.pt"))
    assert len(files) == 1, files  # tp 1, pp 1, ep 1
    saved = safe_torch_load(files[0])
    a = vars(saved["args"])
    assert a["softmax_type"] == "learnable" and a["quick_geglu"] and a["add_bias_linear"]
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], kv_channels=a["kv_channels"], ffn_hidden_size=a["ffn_hidden_size"],
        normalization="RMSNorm", layernorm_epsilon=a["norm_epsilon"], add_bias_linear=True, add_qkv_bias=True,
        gated_linear_unit=True, activation_func=quick_gelu, activation_func_clamp_value=a["activation_func_clamp_value"],
        glu_linear_offset=a["glu_linear_offset"], softmax_type="learnable", window_size=tuple(a["window_size"]),
        window_attn_skip_freq=a["window_attn_skip_freq"], bias_activation_fusion=False, params_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=a["num_experts"], moe_router_topk=a["moe_router_topk"],
        moe_ffn_hidden_size=a["moe_ffn_hidden_size"], moe_router_pre_softmax=a["moe_router_pre_softmax"],
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather")
    for field in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                  "yarn_beta_slow", "yarn_correction_range_round_to_int"):
        setattr(config, field, a[field])  # GPTModel reads them off the config (Megatron-Bridge's provider fields)
    # HF's attention factor 0.1 ln(factor) + 1: megatron-core's mscale 1 over mscale_all_dim 0
    config.yarn_mscale, config.yarn_mscale_all_dim = 1.0, 0.0
    model = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"),
                     vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                     position_embedding_type="yarn", rotary_base=a["rotary_base"],
                     share_embeddings_and_output_weights=False)
    model.load_state_dict(saved["model"], strict=True)
    model.eval()
    tokens = torch.load(tokens_file)
    b, s = tokens.shape
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, -1), causal)
    torch.save(logits[..., :a["vocab_size"]].clone(), out_file)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
