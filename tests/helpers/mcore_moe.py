"""megatron-core's own MoE layer on the CPU: one forward and backward, saved for comparison.

    python tests/helpers/mcore_moe.py OUT_DIR    # writes OUT_DIR/{softmax,pre_softmax,sigmoid_bias}.pt

megatron-core 0.16.1 `MoELayer` (local layer spec: SequentialMLP experts, `allgather` dispatcher, one gloo
process) with 4 SwiGLU experts, top-2, the aux loss ("aux_loss", coefficient 0.1) and a gated shared
expert, in training mode, once per router kind (CASES).  Each file holds its weights under canonical names, the input x, the output
gradient g, the output, and every weight's gradient of sum(out * g) (aux loss included, through
megatron's MoEAuxLossAutoScaler at scale 1), and with an expert bias, the bias after megatron's update.  A script of its own: mcore needs torch.distributed and
CPU stand-ins for three CUDA calls, none of which may leak into the test process.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1]))
import helpers.megatron_ref as R  # noqa: E402

HIDDEN, EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN, COEFF, BIAS_RATE = 16, 4, 2, 8, 12, 0.1, 1e-3
CASES = {
    "softmax": {},  # top-k of the logits, softmax over the k: Mixtral's renormalised top-k
    "pre_softmax": {"moe_router_pre_softmax": True},  # softmax over all, top-k, no renormalisation (Qwen2-MoE)
    "sigmoid_bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},  # DeepSeek-V3
}


def canonical(name: str) -> str:
    """mcore MoELayer names -> the canonical names (without the `layers.{i}.mlp.` prefix)."""
    if m := re.fullmatch(r"experts\.local_experts\.(\d+)\.linear_fc(1|2)\.weight", name):
        return f"experts.{m[1]}.{'gate_up' if m[2] == '1' else 'down'}.weight"
    return {"router.weight": "router.weight", "router.expert_bias": "router.expert_bias",
            "shared_experts.gate_weight": "shared_gate.weight",
            "shared_experts.linear_fc1.weight": "shared.gate_up.weight",
            "shared_experts.linear_fc2.weight": "shared.down.weight"}[name]


def split_gate_up(tensors: dict) -> dict:
    """mcore's fused linear_fc1 [2f, h] is gate rows then up rows (its glu: act(first half) * second half)."""
    out = {}
    for name, t in tensors.items():
        if ".gate_up." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up", "gate")], out[name.replace("gate_up", "up")] = gate, up
        else:
            out[name] = t
    return out


def main(out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(R.free_port()))
    R.patch_cpu()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None  # 0.16.1 names it only when Transformer Engine imports
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1)
    for case in CASES:
        run_case(case, TransformerConfig, build_module, get_gpt_layer_local_spec, Path(out_dir) / f"{case}.pt")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_case(case: str, TransformerConfig, build_module, get_gpt_layer_local_spec, out_path) -> None:
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=32, normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        params_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_aux_loss_coeff=COEFF,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True, **CASES[case])
    layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False,
                                                  normalization="RMSNorm").submodules.mlp, config=config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if layer.router.expert_bias is not None:  # a bias that changes the choice
            layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    layer.train()
    x = torch.randn(10, 3, HIDDEN, generator=gen, requires_grad=True)  # [seq, batch, hidden]
    g = torch.randn(10, 3, HIDDEN, generator=gen)
    out, _ = layer(x)
    (out * g).sum().backward()
    weights = {canonical(n): p.detach().clone() for n, p in layer.named_parameters()}
    if layer.router.expert_bias is not None:
        weights["router.expert_bias"] = layer.router.expert_bias.clone()
    grads = {canonical(n): p.grad.clone() for n, p in layer.named_parameters()}
    result = {"weights": split_gate_up(weights), "grads": split_gate_up(grads), "x": x.detach(), "g": g,
              "out": out.detach(), "x_grad": x.grad.clone()}
    if layer.router.expert_bias is not None:  # the aux-loss-free update finalize_model_grads applies
        from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
        result["updated_bias"] = get_updated_expert_bias(layer.router.local_tokens_per_expert.clone(),
                                                         layer.router.expert_bias, BIAS_RATE)
    torch.save(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
