"""Make tests/fixtures/deepspeed/: a real DeepSpeed pipeline checkpoint of a tiny Llama, Megatron-DeepSpeed names.

Run (4 CPU processes over gloo each; deepspeed 0.19.8, DS_ACCELERATOR=cpu):

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_deepspeed_fixtures.py tests/fixtures/deepspeed llama
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_deepspeed_fixtures.py tests/fixtures/deepspeed-gpt2 gpt2

`llama`: RMSNorm, rotary, swiglu, GQA, no biases, tied embeddings; tp 2 x pp 2 x dp 1.
`gpt2`: LayerNorm, learned positions, GeLU, biases, untied (LMHeadPipe `lm_head`); tp 1 x pp 2 x dp 2,
so no model-parallel axis in the file names and ZeRO partitions over two data-parallel ranks.

The model is built the way Megatron-DeepSpeed's GPTModelPipe lays out its PipelineModule
(megatron/model/gpt_model.py): index 0 a function (_to_float16), 1 the tied EmbeddingPipe
('embed', word_embeddings), 2..L+1 ParallelTransformerLayerPipe, L+2 the final RMSNorm, L+3 the tied
head (a forward_fn of the embedding, no state of its own).  Each layer here is a small torch module whose
parameters carry GPTModelPipe's names and each tensor-parallel rank's shard shapes
(megatron/model/transformer.py: query_key_value per query group [q heads; k; v], swiglu dense_h_to_4h
[gate_r; up_r] per rank); their forward is a stand-in that uses every parameter so that one real
training step gives the optimizer state.  The weights are cut from one full model, saved beside as
`reference.safetensors` (canonical names): the expected values of the tests.

DeepSpeed's own engine writes the checkpoint (`engine.save_checkpoint`, ZeRO stage 1, fp32, client
state as Megatron-DeepSpeed's save_checkpoint passes it: args, iteration, checkpoint_version).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import cpu_ranks  # scripts/cpu_ranks.py (this folder is on the path of a script run)
import torch.nn.functional as F

L, H, HEADS, D, FFN, VOCAB, POS = 4, 16, 4, 4, 32, 64, 32
ITERATION = 1
VARIANTS = {"llama": dict(groups=2, tp=2, pp=2, dp=1, gpt2=False),
            "gpt2": dict(groups=4, tp=1, pp=2, dp=2, gpt2=True)}
VARIANT = VARIANTS[sys.argv[2] if len(sys.argv) > 2 else "llama"]
GROUPS, TP, PP, DP, GPT2 = (VARIANT[k] for k in ("groups", "tp", "pp", "dp", "gpt2"))
FFN_IN = FFN if GPT2 else 2 * FFN  # dense_h_to_4h rows: swiglu holds gate and up


def full_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    w = {"embed.word.weight": r(VOCAB, H)}
    if GPT2:
        w["embed.position.weight"] = r(POS, H)
    for i in range(L):
        p = f"layers.{i}."
        w.update({p + "attn_norm.weight": 1 + r(H), p + "attn.q.weight": r(HEADS * D, H),
                  p + "attn.k.weight": r(GROUPS * D, H), p + "attn.v.weight": r(GROUPS * D, H),
                  p + "attn.o.weight": r(H, HEADS * D), p + "mlp_norm.weight": 1 + r(H),
                  p + "mlp.up.weight": r(FFN, H), p + "mlp.down.weight": r(H, FFN)})
        if GPT2:
            w.update({p + "attn_norm.bias": r(H), p + "attn.q.bias": r(HEADS * D), p + "attn.k.bias": r(GROUPS * D),
                      p + "attn.v.bias": r(GROUPS * D), p + "attn.o.bias": r(H), p + "mlp_norm.bias": r(H),
                      p + "mlp.up.bias": r(FFN), p + "mlp.down.bias": r(H)})
        else:
            w[p + "mlp.gate.weight"] = r(FFN, H)
    w["final_norm.weight"] = 1 + r(H)
    if GPT2:
        w["final_norm.bias"] = r(H)
        w["lm_head.weight"] = r(VOCAB, H)
    return w


def shard(x: torch.Tensor, dim: int, t: int) -> torch.Tensor:
    return x.chunk(TP, dim=dim)[t].clone()


def qkv_shard(w: dict, i: int, t: int, what: str = "weight") -> torch.Tensor:
    """Rank t's query_key_value: for each of its query groups, [that group's q heads; k; v]."""
    rest = w[f"layers.{i}.attn.q.{what}"].shape[1:]
    q, k, v = (w[f"layers.{i}.attn.{n}.{what}"].view(GROUPS, -1, *rest) for n in "qkv")
    fused = torch.cat([q, k, v], dim=1)
    return fused.chunk(TP, dim=0)[t].reshape(-1, *rest).clone()


class EmbeddingPipe(torch.nn.Module):
    def __init__(self, w, t):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB // TP, H)
        self.word_embeddings.weight.data.copy_(shard(w["embed.word.weight"], 0, t))
        if GPT2:
            self.position_embeddings = torch.nn.Embedding(POS, H)
            self.position_embeddings.weight.data.copy_(w["embed.position.weight"])

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        h = self.word_embeddings(ids % (VOCAB // TP))
        return h + self.position_embeddings.weight[:ids.shape[-1]] if GPT2 else h


class _Attention(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.query_key_value = torch.nn.Linear(H, (HEADS + 2 * GROUPS) * D // TP, bias=GPT2)
        self.dense = torch.nn.Linear(HEADS * D // TP, H, bias=GPT2)
        self.query_key_value.weight.data.copy_(qkv_shard(w, i, t))
        self.dense.weight.data.copy_(shard(w[f"layers.{i}.attn.o.weight"], 1, t))
        if GPT2:  # tp 1: the row-parallel bias is whole
            self.query_key_value.bias.data.copy_(qkv_shard(w, i, t, "bias"))
            self.dense.bias.data.copy_(w[f"layers.{i}.attn.o.bias"])


class _MLP(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(H, FFN_IN // TP, bias=GPT2)
        self.dense_4h_to_h = torch.nn.Linear(FFN // TP, H, bias=GPT2)
        parts = ("up",) if GPT2 else ("gate", "up")
        self.dense_h_to_4h.weight.data.copy_(torch.cat([shard(w[f"layers.{i}.mlp.{n}.weight"], 0, t) for n in parts]))
        self.dense_4h_to_h.weight.data.copy_(shard(w[f"layers.{i}.mlp.down.weight"], 1, t))
        if GPT2:
            self.dense_h_to_4h.bias.data.copy_(w[f"layers.{i}.mlp.up.bias"])
            self.dense_4h_to_h.bias.data.copy_(w[f"layers.{i}.mlp.down.bias"])


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        if bias is not None:  # LayerNorm (gpt2)
            self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight
        return out + self.bias if GPT2 else out


class LMHeadPipe(torch.nn.Module):
    """Megatron-DeepSpeed's untied head (gpt_model.py LMHeadPipe): a ColumnParallelLinear `lm_head`, no bias."""

    def __init__(self, w, t):
        super().__init__()
        self.lm_head = torch.nn.Linear(H, VOCAB // TP, bias=False)
        self.lm_head.weight.data.copy_(shard(w["lm_head.weight"], 0, t))

    def forward(self, h):
        return self.lm_head(h)


class ParallelTransformerLayerPipe(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.input_layernorm = _RMSNorm(w[f"layers.{i}.attn_norm.weight"], w.get(f"layers.{i}.attn_norm.bias"))
        self.self_attention = _Attention(w, i, t)
        self.post_attention_layernorm = _RMSNorm(w[f"layers.{i}.mlp_norm.weight"], w.get(f"layers.{i}.mlp_norm.bias"))
        self.mlp = _MLP(w, i, t)

    def forward(self, h):  # a stand-in for the real math: every parameter gets a gradient
        qkv = self.self_attention.query_key_value(self.input_layernorm(h))
        h = h + self.self_attention.dense(torch.tanh(qkv[..., :HEADS * D // TP]) + qkv[..., HEADS * D // TP:].mean())
        inner = self.mlp.dense_h_to_4h(self.post_attention_layernorm(h))
        if GPT2:
            return h + self.mlp.dense_4h_to_h(F.gelu(inner))
        gate, up = inner.chunk(2, dim=-1)
        return h + self.mlp.dense_4h_to_h(F.silu(gate) * up)


def _to_float16(x):  # GPTModelPipe's first spec: a function, index 0, no checkpoint file
    return x


def run(out: Path) -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    w = full_weights()
    topo = topology()
    t = getattr(topo.get_coord(rank), "model", 0)

    def logits(embedding, h):
        return F.linear(h, embedding.word_embeddings_weight)

    if GPT2:
        specs = [_to_float16, LayerSpec(EmbeddingPipe, w, t)]
    else:
        specs = [_to_float16, TiedLayerSpec("embed", EmbeddingPipe, w, t, tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(ParallelTransformerLayerPipe, w, i, t) for i in range(L)]
    specs.append(LayerSpec(_RMSNorm, w["final_norm.weight"], w.get("final_norm.bias")))
    if GPT2:
        specs.append(LayerSpec(LMHeadPipe, w, t))
    else:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, w, t, forward_fn=logits,
                                   tied_weight_attr="word_embeddings_weight"))
    loss = lambda out_, labels: F.cross_entropy(out_.reshape(-1, out_.shape[-1]), labels.reshape(-1) % (VOCAB // TP))  # noqa: E731
    model = PipelineModule(layers=specs, loss_fn=loss, topology=topo, partition_method="type:ParallelTransformerLayerPipe")
    config = {"train_batch_size": 2 * DP, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 100}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    # the weights before the step are the reference; save them now, then train one step for Adam state
    gen = torch.Generator().manual_seed(1)
    for _ in range(topo.get_coord(rank).data + 1):  # data-parallel ranks see different batches
        batch = (torch.randint(0, VOCAB, (1, 8), generator=gen), torch.randint(0, VOCAB, (1, 8), generator=gen))
    engine.train_batch(data_iter=iter([batch, batch]))
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
        kv_channels=D, padded_vocab_size=VOCAB, max_position_embeddings=POS, seq_length=8, swiglu=not GPT2,
        normalization="layernorm" if GPT2 else "rmsnorm", layernorm_epsilon=1e-5,
        use_rotary_position_embeddings=not GPT2, rope_theta=10000,
        untie_embeddings_and_output_weights=GPT2, add_bias_linear=GPT2, tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP, deepspeed=True, params_dtype=torch.float32, iteration=ITERATION)
    engine.save_checkpoint(str(out), tag=f"global_step{ITERATION}",
                           client_state={"args": args, "iteration": ITERATION, "checkpoint_version": 3.0})
    if rank == 0:  # Megatron-DeepSpeed also writes Megatron's tracker beside DeepSpeed's `latest`
        (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    # every rank's trained weights, gathered into the full model for the expected values
    torch.distributed.barrier()
    mine = {f"{rank}/{name}": p.detach().clone() for name, p in engine.module.named_parameters()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        torch.save({k: v for d in gathered for k, v in d.items()}, out / "_ranks.pt")


def topology():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if TP == 1:  # no model axis: file names without `-model_YY`
        return PipeDataParallelTopology(num_pp=PP, num_dp=DP)
    return PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=DP)


def reference(out: Path) -> None:
    """The full model's weights after the step, from every rank's parameters (canonical names)."""
    from safetensors.torch import save_file

    ranks = torch.load(out / "_ranks.pt")
    (out / "_ranks.pt").unlink()
    topo = topology()
    per = L // PP
    got = {}
    for rank in range(TP * PP * DP):
        c = topo.get_coord(rank)
        if c.data != 0:
            continue  # data-parallel replicas hold the same weights
        for key, x in ranks.items():
            r, name = key.split("/", 1)
            if int(r) == rank:
                got[(c.pipe, getattr(c, "model", 0), name)] = x
    embed = "1.word_embeddings.weight" if GPT2 else "tied_modules.embed.word_embeddings.weight"
    ref = {"embed.word.weight": torch.cat([got[(0, t, embed)] for t in range(TP)])}
    if GPT2:
        ref["embed.position.weight"] = got[(0, 0, "1.position_embeddings.weight")]
    for i in range(L):
        p, idx = i // per, i + 2
        tp_ = [lambda n, t=t: got[(p, t, f"{idx}.{n}")] for t in range(TP)]
        q_rows = HEADS // GROUPS * D
        for what in ("weight", "bias") if GPT2 else ("weight",):
            fused = torch.cat([f(f"self_attention.query_key_value.{what}") for f in tp_])
            fused = fused.view(GROUPS, -1, *fused.shape[1:])
            rest = fused.shape[2:]
            ref[f"layers.{i}.attn.q.{what}"] = fused[:, :q_rows].reshape(-1, *rest)
            ref[f"layers.{i}.attn.k.{what}"] = fused[:, q_rows:q_rows + D].reshape(-1, *rest)
            ref[f"layers.{i}.attn.v.{what}"] = fused[:, q_rows + D:].reshape(-1, *rest)
        ref[f"layers.{i}.attn_norm.weight"] = tp_[0]("input_layernorm.weight")
        ref[f"layers.{i}.attn.o.weight"] = torch.cat([f("self_attention.dense.weight") for f in tp_], dim=1)
        ref[f"layers.{i}.mlp_norm.weight"] = tp_[0]("post_attention_layernorm.weight")
        if GPT2:
            ref[f"layers.{i}.mlp.up.weight"] = torch.cat([f("mlp.dense_h_to_4h.weight") for f in tp_])
            for ours, theirs in (("attn_norm.bias", "input_layernorm.bias"), ("attn.o.bias", "self_attention.dense.bias"),
                                 ("mlp_norm.bias", "post_attention_layernorm.bias"), ("mlp.up.bias", "mlp.dense_h_to_4h.bias"),
                                 ("mlp.down.bias", "mlp.dense_4h_to_h.bias")):
                ref[f"layers.{i}.{ours}"] = tp_[0](theirs)
        else:
            halves = [f("mlp.dense_h_to_4h.weight").chunk(2) for f in tp_]
            ref[f"layers.{i}.mlp.gate.weight"] = torch.cat([h[0] for h in halves])
            ref[f"layers.{i}.mlp.up.weight"] = torch.cat([h[1] for h in halves])
        ref[f"layers.{i}.mlp.down.weight"] = torch.cat([f("mlp.dense_4h_to_h.weight") for f in tp_], dim=1)
    ref["final_norm.weight"] = got[(PP - 1, 0, f"{L + 2}.weight")]
    if GPT2:
        ref["final_norm.bias"] = got[(PP - 1, 0, f"{L + 2}.bias")]
        ref["lm_head.weight"] = torch.cat([got[(PP - 1, t, f"{L + 3}.lm_head.weight")] for t in range(TP)])
    save_file({k: v.contiguous() for k, v in ref.items()}, out / "reference.safetensors")


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    if cpu_ranks.is_rank():
        run(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    cpu_ranks.launch(__file__, TP * PP * DP, 29533)
    reference(out)
    cpu_ranks.remove_deepspeed_copies(out)
    versions = {"deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__}
    (out / "PROVENANCE").write_text(
        "Made by scripts/make_deepspeed_fixtures.py (see its docstring) with "
        + json.dumps(versions) + ":\n  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python "
        f"scripts/make_deepspeed_fixtures.py {sys.argv[1]} {sys.argv[2] if len(sys.argv) > 2 else 'llama'}\n"
        f"Tiny {'GPT-2 (LayerNorm, learned positions, GeLU, biases, untied LMHeadPipe)' if GPT2 else 'Llama (RMSNorm, rotary, swiglu, tied)'}: "
        f"{L} layers, hidden {H}, {HEADS} heads / {GROUPS} query groups, ffn {FFN}, vocab {VOCAB},\n"
        f"fp32; tp {TP} x pp {PP} x dp {DP}, ZeRO stage 1, one Adam step, tag global_step{ITERATION}.\n"
        "DeepSpeed's zero_to_fp32.py / zero_to_torch.py, which save_checkpoint copies beside, are removed.\n"
        "reference.safetensors: the full model's weights after that step (canonical names), gathered from\n"
        "every rank's parameters in memory, not from the files.\n")


if __name__ == "__main__":
    main()
