"""Make tests/fixtures/deepspeed/: a real DeepSpeed pipeline checkpoint of a tiny Llama, Megatron-DeepSpeed names.

Run (4 CPU processes over gloo: tp 2 x pp 2 x dp 1; deepspeed 0.19.8, DS_ACCELERATOR=cpu):

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_deepspeed_fixtures.py tests/fixtures/deepspeed

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
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

L, H, HEADS, GROUPS, D, FFN, VOCAB, TP, PP = 4, 16, 4, 2, 4, 32, 64, 2, 2
ITERATION = 1


def full_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    w = {"embed.word.weight": r(VOCAB, H)}
    for i in range(L):
        p = f"layers.{i}."
        w.update({p + "attn_norm.weight": 1 + r(H), p + "attn.q.weight": r(HEADS * D, H),
                  p + "attn.k.weight": r(GROUPS * D, H), p + "attn.v.weight": r(GROUPS * D, H),
                  p + "attn.o.weight": r(H, HEADS * D), p + "mlp_norm.weight": 1 + r(H),
                  p + "mlp.gate.weight": r(FFN, H), p + "mlp.up.weight": r(FFN, H), p + "mlp.down.weight": r(H, FFN)})
    w["final_norm.weight"] = 1 + r(H)
    return w


def shard(x: torch.Tensor, dim: int, t: int) -> torch.Tensor:
    return x.chunk(TP, dim=dim)[t].clone()


def qkv_shard(w: dict, i: int, t: int) -> torch.Tensor:
    """Rank t's query_key_value: for each of its query groups, [that group's q heads; k; v]."""
    q = w[f"layers.{i}.attn.q.weight"].view(GROUPS, -1, H)
    k = w[f"layers.{i}.attn.k.weight"].view(GROUPS, -1, H)
    v = w[f"layers.{i}.attn.v.weight"].view(GROUPS, -1, H)
    fused = torch.cat([q, k, v], dim=1)
    return fused.chunk(TP, dim=0)[t].reshape(-1, H).clone()


class EmbeddingPipe(torch.nn.Module):
    def __init__(self, w, t):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB // TP, H)
        self.word_embeddings.weight.data.copy_(shard(w["embed.word.weight"], 0, t))

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        return self.word_embeddings(ids % (VOCAB // TP))


class _Attention(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.query_key_value = torch.nn.Linear(H, (HEADS + 2 * GROUPS) * D // TP, bias=False)
        self.dense = torch.nn.Linear(HEADS * D // TP, H, bias=False)
        self.query_key_value.weight.data.copy_(qkv_shard(w, i, t))
        self.dense.weight.data.copy_(shard(w[f"layers.{i}.attn.o.weight"], 1, t))


class _MLP(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(H, 2 * FFN // TP, bias=False)
        self.dense_4h_to_h = torch.nn.Linear(FFN // TP, H, bias=False)
        gate, up = (shard(w[f"layers.{i}.mlp.{n}.weight"], 0, t) for n in ("gate", "up"))
        self.dense_h_to_4h.weight.data.copy_(torch.cat([gate, up]))
        self.dense_4h_to_h.weight.data.copy_(shard(w[f"layers.{i}.mlp.down.weight"], 1, t))


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class ParallelTransformerLayerPipe(torch.nn.Module):
    def __init__(self, w, i, t):
        super().__init__()
        self.input_layernorm = _RMSNorm(w[f"layers.{i}.attn_norm.weight"])
        self.self_attention = _Attention(w, i, t)
        self.post_attention_layernorm = _RMSNorm(w[f"layers.{i}.mlp_norm.weight"])
        self.mlp = _MLP(w, i, t)

    def forward(self, h):  # a stand-in for the real math: every parameter gets a gradient
        qkv = self.self_attention.query_key_value(self.input_layernorm(h))
        h = h + self.self_attention.dense(torch.tanh(qkv[..., :HEADS * D // TP]) + qkv[..., HEADS * D // TP:].mean())
        gate, up = self.mlp.dense_h_to_4h(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.mlp.dense_4h_to_h(F.silu(gate) * up)


def _to_float16(x):  # GPTModelPipe's first spec: a function, index 0, no checkpoint file
    return x


def run(out: Path) -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    w = full_weights()
    topo = PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=1)
    t = topo.get_coord(rank).model

    def logits(embedding, h):
        return F.linear(h, embedding.word_embeddings_weight)

    specs = [_to_float16, TiedLayerSpec("embed", EmbeddingPipe, w, t, tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(ParallelTransformerLayerPipe, w, i, t) for i in range(L)]
    specs += [LayerSpec(_RMSNorm, w["final_norm.weight"]),
              TiedLayerSpec("embed", EmbeddingPipe, w, t, forward_fn=logits, tied_weight_attr="word_embeddings_weight")]
    loss = lambda out_, labels: F.cross_entropy(out_.reshape(-1, out_.shape[-1]), labels.reshape(-1) % (VOCAB // TP))  # noqa: E731
    model = PipelineModule(layers=specs, loss_fn=loss, topology=topo, partition_method="type:ParallelTransformerLayerPipe")
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 100}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    # the weights before the step are the reference; save them now, then train one step for Adam state
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, VOCAB, (1, 8), generator=gen), torch.randint(0, VOCAB, (1, 8), generator=gen))
    engine.train_batch(data_iter=iter([batch, batch]))
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
        kv_channels=D, padded_vocab_size=VOCAB, max_position_embeddings=32, seq_length=8, swiglu=True,
        normalization="rmsnorm", layernorm_epsilon=1e-5, use_rotary_position_embeddings=True, rope_theta=10000,
        untie_embeddings_and_output_weights=False, add_bias_linear=False, tensor_model_parallel_size=TP,
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


def reference(out: Path) -> None:
    """The full model's weights after the step, from every rank's parameters (canonical names)."""
    from safetensors.torch import save_file

    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    ranks = torch.load(out / "_ranks.pt")
    (out / "_ranks.pt").unlink()
    topo = PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=1)
    per = L // PP
    got = {}
    for rank in range(TP * PP):
        c = topo.get_coord(rank)
        for key, x in ranks.items():
            r, name = key.split("/", 1)
            if int(r) == rank:
                got[(c.pipe, c.model, name)] = x
    ref = {"embed.word.weight": torch.cat([got[(0, t, "tied_modules.embed.word_embeddings.weight")] for t in range(TP)])}
    for i in range(L):
        p, idx = i // per, i + 2
        tp_ = [lambda n, t=t: got[(p, t, f"{idx}.{n}")] for t in range(TP)]
        fused = torch.cat([f("self_attention.query_key_value.weight") for f in tp_]).view(GROUPS, -1, H)
        q_rows = HEADS // GROUPS * D
        ref[f"layers.{i}.attn_norm.weight"] = tp_[0]("input_layernorm.weight")
        ref[f"layers.{i}.attn.q.weight"] = fused[:, :q_rows].reshape(-1, H)
        ref[f"layers.{i}.attn.k.weight"] = fused[:, q_rows:q_rows + D].reshape(-1, H)
        ref[f"layers.{i}.attn.v.weight"] = fused[:, q_rows + D:].reshape(-1, H)
        ref[f"layers.{i}.attn.o.weight"] = torch.cat([f("self_attention.dense.weight") for f in tp_], dim=1)
        ref[f"layers.{i}.mlp_norm.weight"] = tp_[0]("post_attention_layernorm.weight")
        halves = [f("mlp.dense_h_to_4h.weight").chunk(2) for f in tp_]
        ref[f"layers.{i}.mlp.gate.weight"] = torch.cat([h[0] for h in halves])
        ref[f"layers.{i}.mlp.up.weight"] = torch.cat([h[1] for h in halves])
        ref[f"layers.{i}.mlp.down.weight"] = torch.cat([f("mlp.dense_4h_to_h.weight") for f in tp_], dim=1)
    ref["final_norm.weight"] = got[(PP - 1, 0, f"{L + 2}.weight")]
    save_file({k: v.contiguous() for k, v in ref.items()}, out / "reference.safetensors")


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    if os.environ.get("RANK") is not None:
        run(out)
        return
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533",
               WORLD_SIZE=str(TP * PP), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(out)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(TP * PP)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    reference(out)
    versions = {"deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__}
    (out / "PROVENANCE").write_text(
        "Made by scripts/make_deepspeed_fixtures.py (see its docstring) with "
        + json.dumps(versions) + ":\n  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python "
        "scripts/make_deepspeed_fixtures.py tests/fixtures/deepspeed\n"
        f"Tiny Llama: {L} layers, hidden {H}, {HEADS} heads / {GROUPS} query groups, ffn {FFN} (swiglu), vocab {VOCAB},\n"
        f"tied embeddings, fp32; tp {TP} x pp {PP} x dp 1, ZeRO stage 1, one Adam step, tag global_step{ITERATION}.\n"
        "reference.safetensors: the full model's weights after that step (canonical names), gathered from\n"
        "every rank's parameters in memory, not from the files.\n")


if __name__ == "__main__":
    main()
