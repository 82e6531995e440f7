"""Megatron legacy rank state dicts built by hand from a tiny HF checkpoint, and MindSpeed-Core-MS's convert_pt2ckpt.py param-only run over them."""
import json
import numpy as np
import pytest
import torch
from safetensors.torch import load_file


ms = pytest.importorskip("mindspore")


PARAM_KEY_MAP = {"dense_h_to_4h": "mapping", "dense_4h_to_h": "projection", "self_attention": "attention",
                 "query_key_value": "qkv_proj", "dense": "out_proj"}


OPT_SCHEDULER_MAP = {"state_step": "fp32", "max_lr": "fp64", "lr_warmup_steps": "int64", "num_steps": "int64",
                     "lr_decay_style": "int64", "lr_decay_steps": "int64", "min_lr": "fp64", "start_wd": "fp64",
                     "end_wd": "fp64", "wd_incr_style": "int64", "wd_incr_steps": "int64"}


WD_INCR_STYLE = ["constant", "linear", "cosine"]


LR_DECAY_STYLE = ["constant", "WSD", "linear", "cosine", "inverse-square-root"]


def megatron_legacy_ranks(hf_dir, kind, tp, pp, vpp=1):
    """{(t, p): {"model" or "model{v}": {flat legacy key: tensor}}} from a tiny HF checkpoint (Megatron legacy
    GPT model names, QKV per query group, fc1 [gate_r; up_r]), written out here independently of interop."""
    hf = load_file(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    gpt2 = kind == "gpt2"
    L = cfg["n_layer"] if gpt2 else cfg["num_hidden_layers"]
    heads = cfg["n_head"] if gpt2 else cfg["num_attention_heads"]
    kv = heads if gpt2 else cfg["num_key_value_heads"]
    h = cfg["n_embd"] if gpt2 else cfg["hidden_size"]
    d = h // heads
    tied = gpt2 or cfg.get("tie_word_embeddings", False)

    def layer(i):
        if gpt2:
            p = f"transformer.h.{i}."
            q, k, v = hf[p + "attn.c_attn.weight"].t().split(h, 0)
            qb, kb, vb = hf[p + "attn.c_attn.bias"].split(h, 0)
            return {"input_norm": (hf[p + "ln_1.weight"], hf[p + "ln_1.bias"]), "q": (q, qb), "k": (k, kb), "v": (v, vb),
                    "o": (hf[p + "attn.c_proj.weight"].t(), hf[p + "attn.c_proj.bias"]),
                    "post": (hf[p + "ln_2.weight"], hf[p + "ln_2.bias"]),
                    "fc1": [(hf[p + "mlp.c_fc.weight"].t(), hf[p + "mlp.c_fc.bias"])],
                    "fc2": (hf[p + "mlp.c_proj.weight"].t(), hf[p + "mlp.c_proj.bias"])}
        p = f"model.layers.{i}."
        return {"input_norm": (hf[p + "input_layernorm.weight"], None),
                "q": (hf[p + "self_attn.q_proj.weight"], None), "k": (hf[p + "self_attn.k_proj.weight"], None),
                "v": (hf[p + "self_attn.v_proj.weight"], None), "o": (hf[p + "self_attn.o_proj.weight"], None),
                "post": (hf[p + "post_attention_layernorm.weight"], None),
                "fc1": [(hf[p + "mlp.gate_proj.weight"], None), (hf[p + "mlp.up_proj.weight"], None)],
                "fc2": (hf[p + "mlp.down_proj.weight"], None)}

    def rows(x, t):
        n = x.shape[0] // tp
        return x[t * n:(t + 1) * n]

    def cols(x, t):
        n = x.shape[1] // tp
        return x[:, t * n:(t + 1) * n]

    def qkv(q, k, v, t):
        per = heads // kv
        out = []
        for g in range(t * kv // tp, (t + 1) * kv // tp):
            out += [q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
        return torch.cat(out)

    per_chunk = L // (pp * vpp)
    out = {}
    for t in range(tp):
        for p in range(pp):
            chunks = {}
            for v in range(vpp):
                sd = {}
                c = v * pp + p
                if c == 0:
                    sd["language_model.embedding.word_embeddings.weight"] = rows(
                        hf["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"], t)
                    if gpt2:
                        sd["language_model.embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
                for local in range(per_chunk):
                    x = layer(c * per_chunk + local)
                    pre = f"language_model.encoder.layers.{local}."
                    sd[pre + "input_norm.weight"] = x["input_norm"][0]
                    if gpt2:
                        sd[pre + "input_norm.bias"] = x["input_norm"][1]
                    sd[pre + "self_attention.query_key_value.weight"] = qkv(x["q"][0], x["k"][0], x["v"][0], t)
                    if gpt2:
                        sd[pre + "self_attention.query_key_value.bias"] = qkv(x["q"][1], x["k"][1], x["v"][1], t)
                    sd[pre + "self_attention.dense.weight"] = cols(x["o"][0], t)
                    if gpt2:
                        sd[pre + "self_attention.dense.bias"] = x["o"][1]
                    sd[pre + "post_attention_norm.weight"] = x["post"][0]
                    if gpt2:
                        sd[pre + "post_attention_norm.bias"] = x["post"][1]
                    sd[pre + "mlp.dense_h_to_4h.weight"] = torch.cat([rows(w, t) for w, _ in x["fc1"]])
                    if gpt2:
                        sd[pre + "mlp.dense_h_to_4h.bias"] = torch.cat([rows(b, t) for _, b in x["fc1"]])
                    sd[pre + "mlp.dense_4h_to_h.weight"] = cols(x["fc2"][0], t)
                    if gpt2:
                        sd[pre + "mlp.dense_4h_to_h.bias"] = x["fc2"][1]
                if c == pp * vpp - 1:
                    norm = "transformer.ln_f." if gpt2 else "model.norm."
                    sd["language_model.encoder.final_norm.weight"] = hf[norm + "weight"]
                    if gpt2:
                        sd["language_model.encoder.final_norm.bias"] = hf[norm + "bias"]
                    if not tied:
                        sd["language_model.output_layer.weight"] = rows(hf["lm_head.weight"], t)
                    elif pp > 1:
                        sd["word_embeddings_for_head.weight"] = rows(hf["model.embed_tokens.weight" if not gpt2
                                                                         else "transformer.wte.weight"], t)
                chunks["model" if vpp == 1 else f"model{v}"] = sd
            out[(t, p)] = chunks
    return out


def vpp_layers_map(total_layers, vpp, pp):
    """get_vpp_layers_map()."""
    if vpp <= 1:
        return None
    return [x.tolist() for x in np.split(np.arange(total_layers).reshape(vpp, total_layers // vpp), pp, -1)]


def converted_name(key, p, pp, stage_list, vpp_map, v):
    """_convert_param_name() for data_key 'param' (no prefix) of the tensor `key` of chunk v on stage p."""
    parts = key.split(".")
    for i, part in enumerate(list(parts)):
        if part in PARAM_KEY_MAP:
            parts[i] = PARAM_KEY_MAP[part]
        elif vpp_map and part == "layers":
            parts[i + 1] = str(vpp_map[p][v][int(parts[i + 1])])
        elif pp > 1 and part == "layers":
            parts[i + 1] = str(int(parts[i + 1]) + sum(stage_list[:p]))
    return ".".join(parts)


def pt2ms_args(pt: dict, iteration: int) -> dict:
    """get_pt2ms_args(): the append_dict."""
    flat = {}
    if "optimizer" in pt:
        for i, group in enumerate(pt["optimizer"]["optimizer"]["param_groups"]):
            for k, v in group.items():
                if k == "lr":
                    k = "learning_rate"
                elif k == "step":
                    flat["state_step"] = [v]
                    continue
                flat[k + f"_group_{i}"] = v
    if "opt_param_scheduler" in pt:
        sched = dict(pt["opt_param_scheduler"])
        sched["wd_incr_style"] = WD_INCR_STYLE.index(sched["wd_incr_style"])
        sched["lr_decay_style"] = LR_DECAY_STYLE.index(sched["lr_decay_style"])
        flat.update(sched)
    out = {"step_num": int(iteration), "epoch_num": 0}
    for k, v in flat.items():
        if isinstance(v, list):
            out[k] = ms.Parameter([float(e) for e in v])
        elif OPT_SCHEDULER_MAP.get(k) == "fp64":
            out[k] = ms.Parameter(ms.Tensor(v, dtype=ms.float64))
        elif OPT_SCHEDULER_MAP.get(k) == "fp32":
            out[k] = ms.Parameter(float(v))
        elif OPT_SCHEDULER_MAP.get(k) == "int64":
            out[k] = ms.Parameter(int(v))
        elif isinstance(v, (int, float)):
            out[k] = ms.Parameter(float(v))
    return out


def run_convert_pt2ckpt(ranks, out, L, tp, pp, vpp=1, dp=1, pt_extra=None, iteration=40):
    """The tool's param-only run over every mp_rank: rank_{r}/network.ckpt with the append_dict."""
    stage_list = [L // pp] * pp
    vpp_map = vpp_layers_map(L, vpp, pp)
    for (t, p), chunks in ranks.items():
        params = {}
        for v in range(vpp):
            for key, value in chunks["model" if vpp == 1 else f"model{v}"].items():
                params[converted_name(key, p, pp, stage_list, vpp_map, v)] = ms.Parameter(
                    ms.Tensor(value.float().numpy(), dtype=ms.float32))
        path = out / f"rank_{p * dp * tp + t}" / "network.ckpt"
        path.parent.mkdir(parents=True)
        ms.save_checkpoint(params, str(path), append_dict=pt2ms_args(pt_extra or {}, iteration))
    (out / "pt_meta").mkdir()


PT_EXTRA = {
    "optimizer": {"optimizer": {"param_groups": [
        {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "bias_correction": True,
         "step": 40, "params": [0, 1, 2]}]}},
    "opt_param_scheduler": {"max_lr": 3e-4, "lr_warmup_steps": 4, "num_steps": 320, "lr_decay_style": "cosine",
                            "lr_decay_steps": 800, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1,
                            "wd_incr_style": "constant", "wd_incr_steps": 800},
}
