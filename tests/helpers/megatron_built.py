"""Megatron save directories built by hand from a tiny HF model (independent of interop)."""
from __future__ import annotations
import argparse
import torch


VOCAB = 250


def canonical(model, kind):
    """Unfused per-layer weights read straight off the HF model."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = []
    if kind == "gpt2":
        h = model.config.n_embd
        emb, pos, head = sd["transformer.wte.weight"], sd["transformer.wpe.weight"], None
        for i in range(model.config.n_layer):
            p = f"transformer.h.{i}."
            w, b = sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]
            layers.append({
                "n1w": sd[p + "ln_1.weight"], "n1b": sd[p + "ln_1.bias"],
                "q": w[:h], "k": w[h:2 * h], "v": w[2 * h:], "qb": b[:h], "kb": b[h:2 * h], "vb": b[2 * h:],
                "o": sd[p + "attn.c_proj.weight"].t(), "ob": sd[p + "attn.c_proj.bias"],
                "n2w": sd[p + "ln_2.weight"], "n2b": sd[p + "ln_2.bias"],
                "up": sd[p + "mlp.c_fc.weight"].t(), "upb": sd[p + "mlp.c_fc.bias"],
                "down": sd[p + "mlp.c_proj.weight"].t(), "downb": sd[p + "mlp.c_proj.bias"]})
        final = {"w": sd["transformer.ln_f.weight"], "b": sd["transformer.ln_f.bias"]}
    else:
        emb, pos, head = sd["model.embed_tokens.weight"], None, sd["lm_head.weight"]
        for i in range(model.config.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append({
                "n1w": sd[p + "input_layernorm.weight"], "q": sd[p + "self_attn.q_proj.weight"],
                "k": sd[p + "self_attn.k_proj.weight"], "v": sd[p + "self_attn.v_proj.weight"],
                "o": sd[p + "self_attn.o_proj.weight"], "n2w": sd[p + "post_attention_layernorm.weight"],
                "gate": sd[p + "mlp.gate_proj.weight"], "up": sd[p + "mlp.up_proj.weight"],
                "down": sd[p + "mlp.down_proj.weight"]})
        final = {"w": sd["model.norm.weight"]}
    return emb, pos, head, layers, final


def _rows(x, t, tp):
    n = x.shape[0] // tp
    return x[t * n:(t + 1) * n].clone()


def _cols(x, t, tp):
    n = x.shape[1] // tp
    return x[:, t * n:(t + 1) * n].clone()


def _qkv(q, k, v, heads, groups):
    per_q, d = q.shape[0] // groups, k.shape[0] // groups
    rows = []
    for g in range(groups):
        rows += [q[g * per_q:(g + 1) * per_q], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(rows)


NAMES = {  # per scheme: Megatron key for each local piece, written out here independently of the converter
    "mcore": {"emb": "embedding.word_embeddings.weight", "pos": "embedding.position_embeddings.weight",
              "n1w": "decoder.layers.{j}.input_layernorm.weight", "n1b": "decoder.layers.{j}.input_layernorm.bias",
              "qkv": "decoder.layers.{j}.self_attention.linear_qkv.weight",
              "qkvb": "decoder.layers.{j}.self_attention.linear_qkv.bias",
              "o": "decoder.layers.{j}.self_attention.linear_proj.weight",
              "ob": "decoder.layers.{j}.self_attention.linear_proj.bias",
              "n2w": "decoder.layers.{j}.pre_mlp_layernorm.weight", "n2b": "decoder.layers.{j}.pre_mlp_layernorm.bias",
              "fc1": "decoder.layers.{j}.mlp.linear_fc1.weight", "fc1b": "decoder.layers.{j}.mlp.linear_fc1.bias",
              "fc2": "decoder.layers.{j}.mlp.linear_fc2.weight", "fc2b": "decoder.layers.{j}.mlp.linear_fc2.bias",
              "fw": "decoder.final_layernorm.weight", "fb": "decoder.final_layernorm.bias",
              "head": "output_layer.weight", "tied": "output_layer.weight"},
}


NAMES["te"] = dict(NAMES["mcore"], n1w="decoder.layers.{j}.self_attention.linear_qkv.layer_norm_weight",
                   n1b="decoder.layers.{j}.self_attention.linear_qkv.layer_norm_bias",
                   n2w="decoder.layers.{j}.mlp.linear_fc1.layer_norm_weight",
                   n2b="decoder.layers.{j}.mlp.linear_fc1.layer_norm_bias")


# legacy, in the oldest spellings (transformer / attention / *_layernorm): flattened, nested at save time
NAMES["legacy"] = {
    "emb": "language_model/embedding/word_embeddings/weight", "pos": "language_model/embedding/position_embeddings/weight",
    "n1w": "language_model/transformer/layers.{j}.input_layernorm.weight",
    "n1b": "language_model/transformer/layers.{j}.input_layernorm.bias",
    "qkv": "language_model/transformer/layers.{j}.attention.query_key_value.weight",
    "qkvb": "language_model/transformer/layers.{j}.attention.query_key_value.bias",
    "o": "language_model/transformer/layers.{j}.attention.dense.weight",
    "ob": "language_model/transformer/layers.{j}.attention.dense.bias",
    "n2w": "language_model/transformer/layers.{j}.post_attention_layernorm.weight",
    "n2b": "language_model/transformer/layers.{j}.post_attention_layernorm.bias",
    "fc1": "language_model/transformer/layers.{j}.mlp.dense_h_to_4h.weight",
    "fc1b": "language_model/transformer/layers.{j}.mlp.dense_h_to_4h.bias",
    "fc2": "language_model/transformer/layers.{j}.mlp.dense_4h_to_h.weight",
    "fc2b": "language_model/transformer/layers.{j}.mlp.dense_4h_to_h.bias",
    "fw": "language_model/transformer/final_layernorm.weight", "fb": "language_model/transformer/final_layernorm.bias",
    "head": "language_model/output_layer/weight", "tied": "word_embeddings_for_head/weight"}


def _put(sd, key, value):
    parts = key.split("/")
    for p in parts[:-1]:
        sd = sd.setdefault(p, {})
    sd[parts[-1]] = value


def megatron_args(model, kind, tp, pp, **extra):
    c = model.config
    if kind == "gpt2":
        a = dict(num_layers=c.n_layer, hidden_size=c.n_embd, ffn_hidden_size=c.n_inner, num_attention_heads=c.n_head,
                 kv_channels=c.n_embd // c.n_head, max_position_embeddings=c.n_positions, normalization="LayerNorm",
                 swiglu=False, position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
                 add_bias_linear=True, openai_gelu=c.activation_function == "gelu_new", bias_gelu_fusion=False,
                 norm_epsilon=c.layer_norm_epsilon)
    else:
        a = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
                 num_attention_heads=c.num_attention_heads, group_query_attention=True,
                 num_query_groups=c.num_key_value_heads, kv_channels=c.hidden_size // c.num_attention_heads,
                 max_position_embeddings=c.max_position_embeddings, normalization="RMSNorm", swiglu=True,
                 position_embedding_type="rope", rotary_base=int(c.rope_parameters["rope_theta"]),
                 untie_embeddings_and_output_weights=True, add_bias_linear=False, norm_epsilon=c.rms_norm_eps)
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    a.update(vocab_size=VOCAB, padded_vocab_size=padded, make_vocab_size_divisible_by=128,
             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32)
    a.update(extra)
    return a


def hand_built(root, model, kind, tp, pp, vpp=1, scheme="mcore", iteration="release", args=None, pad_seed=1):
    """A Megatron save directory built by hand; padding rows are random (Megatron's are initialised too)."""
    emb, pos, head, layers, final = canonical(model, kind)
    c = model.config
    heads = c.n_head if kind == "gpt2" else c.num_attention_heads
    groups = heads if kind == "gpt2" else c.num_key_value_heads
    a = args if args is not None else megatron_args(model, kind, tp, pp)
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    g = torch.Generator().manual_seed(pad_seed)
    pad = lambda x: torch.cat([x, torch.randn(padded - x.shape[0], x.shape[1], generator=g)])  # noqa: E731
    emb = pad(emb)
    head = pad(head) if head is not None else None
    n = len(layers)
    per = n // (pp * vpp)
    names = NAMES[scheme]
    sub = "release" if iteration == "release" else f"iter_{iteration:07d}"
    for p in range(pp):
        for t in range(tp):
            chunks = []
            for v in range(vpp):
                sd = {}
                start = (v * pp + p) * per
                if (p, v) == (0, 0):
                    _put(sd, names["emb"], _rows(emb, t, tp))
                    if pos is not None:
                        _put(sd, names["pos"], pos.clone())
                for j in range(per):
                    L = layers[start + j]
                    k = {key: names[key].replace("{j}", str(j)) for key in names if "{j}" in names[key]}
                    _put(sd, k["n1w"], L["n1w"].clone())
                    if "n1b" in L:
                        _put(sd, k["n1b"], L["n1b"].clone())
                    _put(sd, k["qkv"], _rows(_qkv(L["q"], L["k"], L["v"], heads, groups), t, tp))
                    if "qb" in L:
                        _put(sd, k["qkvb"], _rows(_qkv(L["qb"], L["kb"], L["vb"], heads, groups), t, tp))
                    _put(sd, k["o"], _cols(L["o"], t, tp))
                    if "ob" in L:
                        _put(sd, k["ob"], L["ob"].clone())
                    _put(sd, k["n2w"], L["n2w"].clone())
                    if "n2b" in L:
                        _put(sd, k["n2b"], L["n2b"].clone())
                    fc1 = torch.cat([_rows(L["gate"], t, tp), _rows(L["up"], t, tp)]) if "gate" in L else _rows(L["up"], t, tp)
                    _put(sd, k["fc1"], fc1)
                    if "upb" in L:
                        _put(sd, k["fc1b"], _rows(L["upb"], t, tp))
                    _put(sd, k["fc2"], _cols(L["down"], t, tp))
                    if "downb" in L:
                        _put(sd, k["fc2b"], L["downb"].clone())
                    if scheme != "legacy":
                        sd[f"decoder.layers.{j}.self_attention.linear_qkv._extra_state"] = None
                if (p, v) == (pp - 1, vpp - 1):
                    _put(sd, names["fw"], final["w"].clone())
                    if "b" in final:
                        _put(sd, names["fb"], final["b"].clone())
                    if head is not None:
                        _put(sd, names["head"], _rows(head, t, tp))
                    elif (p, v) != (0, 0):
                        _put(sd, names["tied"], _rows(emb, t, tp))
                chunks.append(sd)
            obj = {"args": argparse.Namespace(**a) if isinstance(a, dict) else a, "checkpoint_version": 3.0,
                   "iteration": 0 if iteration == "release" else iteration,
                   "rng_state": [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}]}
            if vpp == 1:
                obj["model"] = chunks[0]
            else:
                obj.update({f"model{v}": sd for v, sd in enumerate(chunks)})
            d = root / sub / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            d.mkdir(parents=True)
            torch.save(obj, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root
