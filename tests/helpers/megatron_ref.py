"""megatron-core on CPU as the Megatron reference for the tests.

Real mcore GPTModels (GPT2-style, Llama-style, Qwen2-style q/k/v biases and Qwen3-style
q/k layernorms; tp 1 and 2 over gloo) compute the loss
on a fixed batch and save themselves exactly as Megatron-LM's training loop does, in the
legacy `torch` layout and in `torch_dist`; they also load torch_dist checkpoints written
by interop.  Everything mcore runs in ONE spawned group of 2 processes (tp 2, then tp 1
with dp 2), so the pytest process never touches torch.distributed or the CUDA patches.

CPU patches (megatron-core assumes CUDA): `torch.cuda.current_device` -> "cpu",
`torch.cuda.synchronize` -> no-op, `CudaRNGStatesTracker.fork` -> null context, plus the
TransformerConfig switches that turn every fused kernel off.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import zlib
from pathlib import Path

import numpy as np
import torch

KINDS = ("gpt2", "llama", "qwen2", "qwen3")
TPS = (2, 1)
VOCAB = 256  # a multiple of 128 * tp for tp 1 and 2: Megatron pads nothing, so no padded logits
SEQ, BATCH = 16, 2
ITERATION = 1

# The models, in Megatron's words.
DIMS = {
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256,
                 max_position_embeddings=32, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                 position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False),
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                  max_position_embeddings=32, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  position_embedding_type="rope", untie_embeddings_and_output_weights=True),
    # Qwen2: q/k/v biases without --add-bias-linear; Qwen3: --qk-layernorm and kv_channels * heads != hidden.
    "qwen2": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                  max_position_embeddings=32, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  add_qkv_bias=True, position_embedding_type="rope", untie_embeddings_and_output_weights=False),
    "qwen3": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                  max_position_embeddings=32, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  qk_layernorm=True, kv_channels=12, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True),
}
# DIMS keys with a default, for the kinds that leave them out.
FAMILY_DEFAULTS = dict(add_qkv_bias=None, qk_layernorm=False, kv_channels=None)


def dims(kind: str) -> dict:
    d = FAMILY_DEFAULTS | DIMS[kind]
    d["add_qkv_bias"] = d["add_bias_linear"] if d["add_qkv_bias"] is None else d["add_qkv_bias"]
    d["kv_channels"] = d["kv_channels"] or d["hidden_size"] // d["num_attention_heads"]
    return d
NORM_EPS, ROPE_BASE = 1e-5, 10000.0


def batch() -> torch.Tensor:
    """The fixed batch: [BATCH, SEQ + 1] token ids; position t predicts token t + 1."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1234))


# --- the Hugging Face side (runs in the pytest process) -----------------------------------------------

def hf_loss(path) -> float:
    """Mean next-token loss of the HF checkpoint at `path` on `batch()` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = batch()
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()


def build_hf(kind: str, path, seed: int = 0):
    """An HF model with the same shape as the mcore one of `kind`, non-trivial norms and biases, saved."""
    import transformers

    d = dims(kind)
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=d["num_layers"], n_embd=d["hidden_size"], n_head=d["num_attention_heads"],
                                         n_inner=d["ffn_hidden_size"], vocab_size=VOCAB, n_positions=d["max_position_embeddings"],
                                         layer_norm_epsilon=NORM_EPS, activation_function="gelu",
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif kind in ("qwen2", "qwen3"):
        cls = transformers.Qwen2Config if kind == "qwen2" else transformers.Qwen3Config
        config = cls(hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
                     num_key_value_heads=d["num_query_groups"], num_hidden_layers=d["num_layers"], head_dim=d["kv_channels"],
                     intermediate_size=d["ffn_hidden_size"], vocab_size=VOCAB, max_position_embeddings=d["max_position_embeddings"],
                     rope_theta=ROPE_BASE, rms_norm_eps=NORM_EPS, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=not d["untie_embeddings_and_output_weights"])
        model = (transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.Qwen3ForCausalLM)(config)
    else:
        config = transformers.LlamaConfig(hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
                                          num_key_value_heads=d["num_query_groups"], num_hidden_layers=d["num_layers"],
                                          intermediate_size=d["ffn_hidden_size"], vocab_size=VOCAB,
                                          max_position_embeddings=d["max_position_embeddings"], rope_theta=ROPE_BASE,
                                          rms_norm_eps=NORM_EPS, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    model.eval().save_pretrained(path)
    return model


# --- the megatron-core side (runs in the spawned processes) -------------------------------------------

def patch_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def transformer_config(kind: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = dims(kind)
    extra = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu) if d["swiglu"] else {}
    return TransformerConfig(
        num_layers=d["num_layers"], hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d["num_query_groups"], ffn_hidden_size=d["ffn_hidden_size"],
        normalization=d["normalization"], layernorm_epsilon=NORM_EPS, add_bias_linear=d["add_bias_linear"],
        add_qkv_bias=d["add_qkv_bias"], qk_layernorm=d["qk_layernorm"], kv_channels=d["kv_channels"],
        tensor_model_parallel_size=_tp(), params_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _tp() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def build_model(kind: str, seed: int):
    """An mcore GPTModel with the local (no Transformer Engine) spec; norms and biases made non-trivial.

    Weights are drawn on the CPU from `seed` (the same global tensors at every tp); replicated
    parameters get the same values on every rank, TP shards of biases differ per rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    d = dims(kind)
    torch.manual_seed(seed)
    model = GPTModel(transformer_config(kind), get_gpt_layer_local_spec(normalization=d["normalization"],
                                                                        qk_layernorm=d["qk_layernorm"]),
                     vocab_size=VOCAB, max_sequence_length=d["max_position_embeddings"],
                     position_embedding_type="learned_absolute" if d["position_embedding_type"] == "learned_absolute" else "rope",
                     rotary_base=int(ROPE_BASE),
                     share_embeddings_and_output_weights=not d["untie_embeddings_and_output_weights"])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed + (1000 * tp_rank if sharded else 0))
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def mcore_loss(model) -> float:
    tokens = batch()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    with torch.no_grad():
        return model(input_ids=inputs, position_ids=positions, attention_mask=causal, labels=labels).mean().item()


def megatron_args(kind: str, tp: int, ckpt_format: str) -> argparse.Namespace:
    """The slice of Megatron-LM's `args` a converter reads, under Megatron's own names."""
    d = dims(kind)
    return argparse.Namespace(
        **d, group_query_attention=d["num_query_groups"] != d["num_attention_heads"],
        norm_epsilon=NORM_EPS, rotary_base=int(ROPE_BASE), rotary_percent=1.0, rotary_interleaved=False,
        openai_gelu=False, squared_relu=False, bias_gelu_fusion=False,
        apply_layernorm_1p=False, num_experts=None, seq_length=SEQ,
        vocab_size=VOCAB, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, sequence_parallel=False, context_parallel_size=1,
        expert_model_parallel_size=1, world_size=2, data_parallel_size=2 // tp,
        fp16=False, bf16=False, params_dtype=torch.float32, transformer_impl="local", use_mcore_models=True,
        ckpt_format=ckpt_format, use_distributed_optimizer=False, micro_batch_size=BATCH, global_batch_size=BATCH * 2 // tp,
        iteration=ITERATION, consumed_train_samples=0, train_iters=10, lr=1e-4, hidden_dropout=0.0, attention_dropout=0.0)


def _rng_state():
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}


def _write_tracker(save_dir: Path) -> None:
    if torch.distributed.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()


def save_legacy(model, save_dir: Path, args) -> None:
    """Megatron-LM's `--ckpt-format torch`: iter_0000001/mp_rank_TT/model_optim_rng.pt from dp rank 0."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0:
        folder = save_dir / f"iter_{ITERATION:07d}" / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": model.state_dict_for_save_checkpoint(), "rng_state": [_rng_state()],
                 "num_floating_point_operations_so_far": 0}
        torch.save(state, folder / "model_optim_rng.pt")
    torch.distributed.barrier()
    _write_tracker(save_dir)


SHARDED_SD_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                       "chained_optim_avoid_prefix": True}


def save_torch_dist(model, save_dir: Path, args) -> None:
    """Megatron-LM's `--ckpt-format torch_dist`: dist_checkpointing.save of the training state into iter_0000001/."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = save_dir / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    rng = ShardedObject("rng_state", [_rng_state()], (1, tp), (0, tp_rank),
                        replica_id=parallel_state.get_data_parallel_rank())
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.sharded_state_dict(metadata=dict(SHARDED_SD_METADATA)), "rng_state": rng,
             "num_floating_point_operations_so_far": 0}
    # (copies: mcore adds the live dp group to the metadata dict it is given)
    dist_checkpointing.save(state, str(folder), content_metadata=dict(SHARDED_SD_METADATA))
    _write_tracker(save_dir)


def load_torch_dist(model, folder) -> None:
    """Megatron-LM's resume path: dist_checkpointing.load of the model's sharded state dict, then load_state_dict."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=dict(SHARDED_SD_METADATA))}, str(folder))
    model.load_state_dict(state["model"], strict=True)


def load_legacy(model, folder) -> None:
    """Megatron-LM's `torch` resume path: this TP rank's model_optim_rng.pt, load_state_dict(strict)."""
    from megatron.core import parallel_state

    path = Path(folder) / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}" / "model_optim_rng.pt"
    model.load_state_dict(torch.load(path, weights_only=False)["model"], strict=True)


def _rewrite_with_interop(src: Path, dst: Path) -> None:
    """Copy an mcore torch_dist checkpoint through interop.io.megatron_dist (rank 0): read every tensor
    by key, a layer at a time, and write it back with the byte objects mcore declares (None extra state)."""
    from interop.io.megatron_dist import DistCheckpoint, LazyTensor, write_dist_checkpoint

    ckpt = DistCheckpoint(src)
    tensors = [(key, LazyTensor(*ckpt.meta(key), lambda layer, key=key: ckpt.read(key, layer))) for key in ckpt.keys()]
    objects = {key: None for key in ckpt.objects() if "._extra_state/" in key}
    write_dist_checkpoint(dst, tensors, common={}, objects=objects)


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def _worker(rank: int, world: int, port: int, root: str, loads: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    root = Path(root)
    results = {}
    try:
        for tp in TPS:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            for kind in KINDS:
                name = f"{kind}-tp{tp}"
                model = build_model(kind, seed=0)
                entry = results[name] = {"loss": mcore_loss(model)}
                save_legacy(model, root / "torch" / name, megatron_args(kind, tp, "torch"))
                save_torch_dist(model, root / "torch_dist" / name, megatron_args(kind, tp, "torch_dist"))
                # interop's writer: mcore's own checkpoint copied through it loads back bit for bit.
                rewritten = root / "rewritten" / name
                if rank == 0:
                    _rewrite_with_interop(root / "torch_dist" / name / f"iter_{ITERATION:07d}", rewritten)
                torch.distributed.barrier()
                fresh = build_model(kind, seed=1)
                load_torch_dist(fresh, rewritten)
                entry["rewritten_loss"] = mcore_loss(fresh)
                entry["rewritten_equal"] = _all_ranks(_state_equal(model, fresh))
                # The reverse direction: checkpoints interop wrote from HF, loaded into mcore at this tp.
                for label, folder in loads.get(kind, {}).items():
                    other = build_model(kind, seed=2)
                    if label.startswith("torch"):  # legacy rank files: one checkpoint per tp
                        if not label.endswith(f"-tp{tp}"):
                            continue
                        load_legacy(other, folder)
                    else:
                        load_torch_dist(other, folder)
                    entry[f"loaded_loss:{label.rsplit('-tp', 1)[0]}"] = mcore_loss(other)
            parallel_state.destroy_model_parallel()
        if rank == 0:
            (root / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        torch.distributed.destroy_process_group()


def _all_ranks(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_reference(root, loads: dict | None = None) -> dict:
    """Run every mcore model once (2 processes), saving under `root`; returns {"<kind>-tp<tp>": {...}}.

    `loads`: {kind: {label: torch_dist dir}} checkpoints to load into each mcore model of that kind
    (at every tp); their losses come back as `loaded_loss:<label>`.
    """
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    loads = {k: {label: str(p) for label, p in v.items()} for k, v in (loads or {}).items()}
    mp.spawn(_worker, args=(2, free_port(), str(root), loads), nprocs=2, join=True)
    return json.loads((root / "results.json").read_text())


def legacy_dir(root, kind: str, tp: int) -> Path:
    return Path(root) / "torch" / f"{kind}-tp{tp}"


def dist_dir(root, kind: str, tp: int) -> Path:
    return Path(root) / "torch_dist" / f"{kind}-tp{tp}"


def convert_hf_to_megatron_dist(src, dst) -> str | None:
    """HF -> interop -> torch_dist with whichever converter handles it; None when none is there yet."""
    from interop.formats import names as format_names
    from interop.convert import convert

    if "megatron" in format_names():
        convert(src, dst, src_format="hf", dst_format="megatron", options={"format": "torch_dist"})
        return "megatron"
    return None


def convert_hf_to_megatron_torch(src, dst, tp: int) -> Path | None:
    """HF -> interop -> Megatron `torch` rank files at `tp`; the iteration folder, or None without a converter."""
    from interop.formats import names as format_names
    from interop.convert import convert

    if "megatron" not in format_names():
        return None
    from interop.converters.megatron.checkpoint import iteration_dir

    convert(src, dst, src_format="hf", dst_format="megatron", tp=tp)
    return iteration_dir(dst)[0]


_CACHE: dict = {}


def reference_once(tmp_path_factory) -> tuple[Path, dict]:
    """The reference run, once per test session whichever test module asks first.

    Before the spawn, builds the HF models (`<root>/hf/<kind>`) and, where a converter can,
    converts them to torch_dist (`<root>/hf2mcore/<kind>`, loss key `loaded_loss:hf`) and to
    the `torch` format at each tp (`loaded_loss:torch_hf`) for the mcore processes to load."""
    if "run" not in _CACHE:
        root = tmp_path_factory.mktemp("mcore")
        loads = {}
        for kind in KINDS:
            build_hf(kind, root / "hf" / kind)
            dst = root / "hf2mcore" / kind
            if convert_hf_to_megatron_dist(root / "hf" / kind, dst):
                from interop.io.megatron_dist import checkpoint_dir

                loads.setdefault(kind, {})["hf"] = checkpoint_dir(dst)
            for tp in TPS:
                folder = convert_hf_to_megatron_torch(root / "hf" / kind, root / "hf2mcore" / f"{kind}-torch-tp{tp}", tp)
                if folder is not None:
                    loads.setdefault(kind, {})[f"torch_hf-tp{tp}"] = folder
        _CACHE["run"] = (root, run_reference(root, loads))
    return _CACHE["run"]
