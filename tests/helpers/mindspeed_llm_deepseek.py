"""A MindSpeed-LLM DeepSeek-V3 torch checkpoint laid out as its converter wrote it before July 2025 (MindSpeed-LLM
1050caf3 renamed linear_qb / linear_kvb / k_layernorm to megatron-core's names; the current layout is checked against
its real converter's output in tests/formats/test_mindspeed_llm_writer.py), built here from an HF one.

Follows Ascend MindSpeed-LLM examples/mcore/deepseek3/convert_ckpt_deepseek3.py (CkptConvert, the layout its
DeepSeek-V3 training loads; it needs NPUs and bitsandbytes, so it is not run here): `iter_0000001/mp_rank_TT[_PPP]
/model_optim_rng.pt` holding {"model", "checkpoint_version": 3.0, "iteration": 1} and no args;
- attention (set_model_layer_attn): `linear_qkv` = cat(q_a_proj, kv_a_proj_with_mqa) on every TP rank,
  `linear_proj` chunked on dim 1, `q_layernorm`, `k_layernorm`, `linear_qb` / `linear_kvb` chunked on dim 0;
- dense MLP: `linear_fc1` = [gate_t; up_t] per TP rank, `linear_fc2` chunked on dim 1; MoE (--moe-grouped-gemm):
  `router.weight`, `router.expert_bias`, `shared_experts.linear_fc1` / `linear_fc2` as the dense MLP, `experts.weight1`
  = the experts' fc1.T ([gate_t; up_t] over TP) concatenated, viewed [E, h, 2F], cut on dim 2 by TP, reshaped
  (h, -1); `experts.weight2` = the fc2.T viewed [E, F, h], cut on dim 1, reshaped (-1, h);
- MTP (set_mtp_preprocess / set_mtp_postprocess, on the last stage): `mtp.layers.K.enorm` / `hnorm` / `eh_proj`
  (chunked on dim 0), the layer under `mtp.layers.K.transformer_layer.`, `mtp.final_layernorms.K.weight`, the
  embedding copy `embedding.word_embeddings.weight` when pp > 1; with MTP the model's final norm is
  `final_layernorm.weight` (set_model_postprocess), else `decoder.final_layernorm.weight`.
"""
from __future__ import annotations

import torch
from safetensors.torch import load_file


def _chunk(x, tp, dim):
    return [c.clone() for c in torch.chunk(x, tp, dim=dim)]


def _gated(gate, up, tp):
    return [torch.cat(pair) for pair in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]


def _layer(hf: dict, j: int, prefix: str, tp: int, dense: bool, out: list) -> None:
    """HF layer j into each TP rank's dict under `prefix` (`decoder.layers.N` or `mtp.layers.K.transformer_layer`)."""
    h = f"model.layers.{j}."
    a = prefix + ".self_attention."
    qkv = torch.cat([hf[h + "self_attn.q_a_proj.weight"], hf[h + "self_attn.kv_a_proj_with_mqa.weight"]])
    proj = _chunk(hf[h + "self_attn.o_proj.weight"], tp, 1)
    qb, kvb = _chunk(hf[h + "self_attn.q_b_proj.weight"], tp, 0), _chunk(hf[h + "self_attn.kv_b_proj.weight"], tp, 0)
    for t in range(tp):
        out[t][prefix + ".input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[t][prefix + ".pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        out[t].update({a + "linear_qkv.weight": qkv.clone(), a + "linear_proj.weight": proj[t],
                       a + "q_layernorm.weight": hf[h + "self_attn.q_a_layernorm.weight"].clone(),
                       a + "k_layernorm.weight": hf[h + "self_attn.kv_a_layernorm.weight"].clone(),
                       a + "linear_qb.weight": qb[t], a + "linear_kvb.weight": kvb[t]})
    m = prefix + ".mlp."
    if dense:
        fc1 = _gated(hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"], tp)
        fc2 = _chunk(hf[h + "mlp.down_proj.weight"], tp, 1)
        for t in range(tp):
            out[t][m + "linear_fc1.weight"], out[t][m + "linear_fc2.weight"] = fc1[t], fc2[t]
        return
    shared1 = _gated(hf[h + "mlp.shared_experts.gate_proj.weight"], hf[h + "mlp.shared_experts.up_proj.weight"], tp)
    shared2 = _chunk(hf[h + "mlp.shared_experts.down_proj.weight"], tp, 1)
    experts = sorted({int(k.split(".")[5]) for k in hf if k.startswith(h + "mlp.experts.")})
    hidden = hf[h + "input_layernorm.weight"].shape[0]
    fc1 = [torch.cat(_gated(hf[f"{h}mlp.experts.{e}.gate_proj.weight"], hf[f"{h}mlp.experts.{e}.up_proj.weight"],
                            tp)).t() for e in experts]
    fc2 = [hf[f"{h}mlp.experts.{e}.down_proj.weight"].t() for e in experts]
    gemm1 = torch.cat(fc1).view(hidden, -1).view(len(experts), hidden, -1)
    gemm2 = torch.cat(fc2).view(-1, hidden).view(len(experts), -1, hidden)
    w1, w2 = torch.chunk(gemm1, tp, dim=2), torch.chunk(gemm2, tp, dim=1)
    for t in range(tp):
        out[t].update({m + "router.weight": hf[h + "mlp.gate.weight"].clone(),
                       m + "router.expert_bias": hf[h + "mlp.gate.e_score_correction_bias"].clone(),
                       m + "shared_experts.linear_fc1.weight": shared1[t],
                       m + "shared_experts.linear_fc2.weight": shared2[t],
                       m + "experts.weight1": w1[t].reshape(hidden, -1).clone(),
                       m + "experts.weight2": w2[t].reshape(-1, hidden).clone()})


def write(hf_dir, out_dir, config, tp: int = 1, pp: int = 1) -> None:
    """`out_dir` as CkptConvert(tp_size=tp, pp_size=pp, ep_size=1, moe_grouped_gemm=True, mtp_num_layers=K) writes
    it for the HF checkpoint in `hf_dir` (one model.safetensors) of `config` (its DeepseekV3Config)."""
    hf = load_file(hf_dir / "model.safetensors")
    layers, dense, mtp = config.num_hidden_layers, config.first_k_dense_replace, config.num_nextn_predict_layers
    per = layers // pp
    root = out_dir / "iter_0000001"
    for p in range(pp):
        model = [{} for _ in range(tp)]
        if p == 0:
            for t, emb in enumerate(_chunk(hf["model.embed_tokens.weight"], tp, 0)):
                model[t]["embedding.word_embeddings.weight"] = emb
        if p == pp - 1:
            for k in range(mtp):
                j, pre = layers + k, f"mtp.layers.{k}."
                eh, emb = _chunk(hf[f"model.layers.{j}.eh_proj.weight"], tp, 0), \
                    _chunk(hf[f"model.layers.{j}.embed_tokens.weight"], tp, 0)
                for t in range(tp):
                    model[t][pre + "enorm.weight"] = hf[f"model.layers.{j}.enorm.weight"].clone()
                    model[t][pre + "hnorm.weight"] = hf[f"model.layers.{j}.hnorm.weight"].clone()
                    model[t][pre + "eh_proj.weight"] = eh[t]
                    if pp > 1:
                        model[t]["embedding.word_embeddings.weight"] = emb[t]
                _layer(hf, j, pre + "transformer_layer", tp, False, model)
                for t in range(tp):
                    model[t][f"mtp.final_layernorms.{k}.weight"] = \
                        hf[f"model.layers.{j}.shared_head.norm.weight"].clone()
        for local, j in enumerate(range(p * per, (p + 1) * per)):
            _layer(hf, j, f"decoder.layers.{local}", tp, j < dense, model)
        if p == pp - 1:
            head = _chunk(hf["lm_head.weight"], tp, 0)
            for t in range(tp):
                model[t]["final_layernorm.weight" if mtp else "decoder.final_layernorm.weight"] = \
                    hf["model.norm.weight"].clone()
                model[t]["output_layer.weight"] = head[t]
        for t in range(tp):
            folder = root / (f"mp_rank_{t:02}" if pp == 1 else f"mp_rank_{t:02}_{p:03}")
            folder.mkdir(parents=True)
            torch.save({"model": model[t], "checkpoint_version": 3.0, "iteration": 1}, folder / "model_optim_rng.pt")
    (out_dir / "latest_checkpointed_iteration.txt").write_text("1")
