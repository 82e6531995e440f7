"""megatron-core 0.16.1 mixture-of-experts GPT models on CPU as the oracle for interop's Megatron MoE layouts.

One spawned gloo group of 2 processes (see megatron_ref for the CPU patches) runs, per model kind:
  1. tp 1 / ep 2: a real MoE GPTModel (local spec, SequentialMLP experts) with weights drawn per GLOBAL
     parameter (expert numbers global) from a seed; its loss; saved as Megatron-LM saves it: the torch
     format's EP rank folders `mp_rank_00_{ep:03d}` (training/checkpointing.py get_checkpoint_name) and
     `dist_checkpointing.save` (torch_dist).  Rank 0 converts both with interop (to ep 2, ep 1 and tp 2,
     torch and torch_dist); every converted checkpoint is loaded back by megatron-core's own loaders into
     fresh models of the layout it was written for, and their losses recorded.
     The legacy GroupedMLP (--moe-grouped-gemm without TE) is built too (its CUDA grouped_gemm is only
     needed by its forward), loaded from the SequentialMLP torch_dist by mcore's own dist_checkpointing
     (their sharded layouts are the same), and its `weight1`/`weight2` state dict saved in the torch format.
  2. tp 2 / ep 1 (expert tensor parallel 2) and 3. tp 1 / ep 1: fresh models load interop's outputs.
The pytest process only reads what was saved and the results JSON.

Extra CPU patches for MoE: the router's `te_general_gemm` (a name megatron-core leaves undefined without
Transformer Engine) is set to None, and GroupedMLP's grouped_gemm availability assert is skipped for the
legacy model, which is never run forward.  Token dispatch: `allgather` (the alltoall dispatcher makes CUDA streams).
"""
from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path

import torch

import helpers.megatron_ref as R

ITERATION = 1
NORM_EPS = 1e-5
# Mixtral-like: softmax top-2 renormalised, every layer MoE.  Qwen2-MoE-like: q/k/v biases, softmax before
# top-k (not renormalised), shared expert with its sigmoid gate.  DeepSeek-like: first layer dense, sigmoid
# scores with the aux-loss-free expert bias, shared expert without gate.
KINDS = {
    "mixtral": dict(add_qkv_bias=False, moe_router_score_function="softmax", moe_router_pre_softmax=False,
                    moe_layer_freq=1, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                    moe_router_enable_expert_bias=False),
    "qwen2moe": dict(add_qkv_bias=True, moe_router_score_function="softmax", moe_router_pre_softmax=True,
                     moe_layer_freq=1, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                     moe_router_enable_expert_bias=False),
    "deepseek": dict(add_qkv_bias=False, moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                     moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=False,
                     moe_router_enable_expert_bias=True),
}
DIMS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, max_position_embeddings=32)
# interop's conversions of the mcore ep-2 checkpoints: label -> (source format, target format, tp, ep)
CONVERSIONS = {
    "dist-ep2": ("torch_dist", "torch_dist", 1, 2), "dist-ep1": ("torch_dist", "torch_dist", 1, 1),
    "torch-ep2": ("torch", "torch", 1, 2), "torch-ep1": ("torch", "torch", 1, 1),
    "dist-tp2": ("torch", "torch_dist", 2, 1), "torch-tp2": ("torch_dist", "torch", 2, 1),
}


def config(kind: str, tp: int, ep: int, grouped: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    k = KINDS[kind]
    shared = k["moe_shared_expert_intermediate_size"]
    return TransformerConfig(
        num_layers=DIMS["num_layers"], hidden_size=DIMS["hidden_size"], num_attention_heads=DIMS["num_attention_heads"],
        num_query_groups=DIMS["num_query_groups"], ffn_hidden_size=DIMS["ffn_hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS, add_bias_linear=False, add_qkv_bias=k["add_qkv_bias"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        params_dtype=torch.float32, use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=DIMS["num_experts"], moe_router_topk=DIMS["moe_router_topk"],
        moe_ffn_hidden_size=DIMS["moe_ffn_hidden_size"], moe_grouped_gemm=grouped,
        moe_router_score_function=k["moe_router_score_function"], moe_router_pre_softmax=k["moe_router_pre_softmax"],
        moe_layer_freq=k["moe_layer_freq"], moe_router_enable_expert_bias=k["moe_router_enable_expert_bias"],
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=k["moe_shared_expert_gate"],
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")


def build(kind: str, tp: int, ep: int, grouped: bool = False):
    """The local-spec GPTModel; per-layer specs (get_gpt_decoder_block_spec) so that moe_layer_freq makes dense
    layers dense (get_gpt_layer_local_spec gives every layer the MoE spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = config(kind, tp, ep, grouped)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=R.VOCAB,
                    max_sequence_length=DIMS["max_position_embeddings"], position_embedding_type="rope",
                    rotary_base=int(R.ROPE_BASE), share_embeddings_and_output_weights=False).eval()


def global_name(name: str, ep_rank: int) -> str:
    """A state-dict key with its local expert number made global (experts per rank: E / 2 at ep 2)."""
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    j, rest = tail.split(".", 1)
    return f"{head}.experts.{ep_rank * DIMS['num_experts'] // 2 + int(j)}.{rest}"


def fill(model, ep_rank: int, seed: int = 0) -> None:
    """Every weight from a generator seeded by its GLOBAL name (tp 1): the same model at any ep."""
    with torch.no_grad():
        for name, x in model.state_dict(keep_vars=True).items():
            if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
                continue
            g = torch.Generator().manual_seed(zlib.crc32(global_name(name, ep_rank).encode()) + seed)
            noise = torch.randn(x.shape, generator=g)
            if "norm" in name:
                value = 1.0 + 0.1 * noise
            elif name.endswith("router.weight"):
                value = 0.5 * noise
            elif name.endswith("expert_bias"):
                value = 0.05 * noise
            else:
                value = 0.08 * noise
            x.copy_(value)


def megatron_args(kind: str, tp: int, ep: int, ckpt_format: str, grouped: bool = False) -> argparse.Namespace:
    args = vars(R.megatron_args("llama", tp, ckpt_format))
    args.update({k: v for k, v in DIMS.items()}, **KINDS[kind], untie_embeddings_and_output_weights=True,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, moe_grouped_gemm=grouped,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, group_query_attention=True,
                kv_channels=DIMS["hidden_size"] // DIMS["num_attention_heads"])
    return argparse.Namespace(**args)


def rank_folder(tp_rank: int, ep_rank: int, ep: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ep > 1 else "")


def save_torch(model, save_dir: Path, args, ep: int) -> None:
    """Megatron-LM's `--ckpt-format torch` with expert parallelism: every rank of expert-data-parallel rank 0
    writes iter_0000001/mp_rank_TT[_EEE]/model_optim_rng.pt (here every rank: ep = world)."""
    from megatron.core import parallel_state as ps

    folder = save_dir / f"iter_{ITERATION:07d}" / rank_folder(ps.get_tensor_model_parallel_rank(),
                                                              ps.get_expert_model_parallel_rank(), ep)
    if ps.get_expert_data_parallel_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(), "num_floating_point_operations_so_far": 0},
                   folder / "model_optim_rng.pt")
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()


def save_dist(model, save_dir: Path, args) -> None:
    from megatron.core import dist_checkpointing

    folder = save_dir / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.sharded_state_dict(metadata=dict(R.SHARDED_SD_METADATA)),
             "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, str(folder), content_metadata=dict(R.SHARDED_SD_METADATA))
    if torch.distributed.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()


def load_dist(model, folder) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=dict(R.SHARDED_SD_METADATA))},
                                    str(folder))
    model.load_state_dict(state["model"], strict=True)


def load_torch(model, folder, ep: int) -> None:
    """Megatron-LM's torch-format resume: this rank's folder, load_state_dict(strict)."""
    from megatron.core import parallel_state as ps

    path = Path(folder) / rank_folder(ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), ep)
    model.load_state_dict(torch.load(path / "model_optim_rng.pt", weights_only=False)["model"], strict=True)


def iteration_folder(root: Path) -> Path:
    return root / f"iter_{ITERATION:07d}"


def convert_all(root: Path, kind: str) -> None:
    """Rank 0: interop converts mcore's ep-2 checkpoints into every CONVERSIONS target."""
    from interop.convert import convert

    for label, (src_fmt, dst_fmt, tp, ep) in CONVERSIONS.items():
        convert(root / src_fmt / kind, root / "interop" / f"{kind}-{label}", dst_format="megatron", src_format="megatron",
                tp=tp, ep=ep, format=dst_fmt)


def _patch_moe_cpu() -> None:
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as mu

    mu.te_general_gemm = None
    gg.assert_grouped_gemm_is_available = lambda: None


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R.patch_cpu()
    _patch_moe_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    root = Path(root)
    results: dict = {}
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=2)
        for kind in KINDS:
            entry = results[kind] = {}
            model = build(kind, 1, 2)
            fill(model, ps.get_expert_model_parallel_rank())
            entry["loss"] = R.mcore_loss(model)
            save_torch(model, root / "torch" / kind, megatron_args(kind, 1, 2, "torch"), 2)
            save_dist(model, root / "torch_dist" / kind, megatron_args(kind, 1, 2, "torch_dist"))
            grouped = build(kind, 1, 2, grouped=True)  # legacy GroupedMLP, loaded by mcore from the sequential save
            load_dist(grouped, iteration_folder(root / "torch_dist" / kind))
            save_torch(grouped, root / "grouped" / kind, megatron_args(kind, 1, 2, "torch", grouped=True), 2)
            if rank == 0:
                convert_all(root, kind)
            torch.distributed.barrier()
            for label in ("dist-ep2", "torch-ep2"):
                fresh = build(kind, 1, 2)
                folder = iteration_folder(root / "interop" / f"{kind}-{label}")
                load_dist(fresh, folder) if label.startswith("dist") else load_torch(fresh, folder, 2)
                entry[f"loaded:{label}"] = R.mcore_loss(fresh)
        ps.destroy_model_parallel()
        for tp in (2, 1):  # ep 1: tp 2 (expert tensor parallel 2), then tp 1 with dp 2
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            for kind in KINDS:
                entry = results[kind]
                labels = ("dist-tp2", "torch-tp2") if tp == 2 else ("dist-ep1", "torch-ep1", "mcore-dist-ep2")
                for label in labels:
                    fresh = build(kind, tp, 1)
                    if label == "mcore-dist-ep2":  # mcore's own EP resharding, for comparison
                        load_dist(fresh, iteration_folder(root / "torch_dist" / kind))
                    else:
                        folder = iteration_folder(root / "interop" / f"{kind}-{label}")
                        load_dist(fresh, folder) if label.startswith("dist") else load_torch(fresh, folder, 1)
                    entry[f"loaded:{label}"] = R.mcore_loss(fresh)
            ps.destroy_model_parallel()
        if rank == 0:
            (root / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        torch.distributed.destroy_process_group()


_CACHE: dict = {}


def reference_once(tmp_path_factory) -> tuple[Path, dict]:
    """The reference run, once per test session: (root, {kind: {"loss": ..., "loaded:<label>": ...}})."""
    if "run" not in _CACHE:
        import torch.multiprocessing as mp

        root = tmp_path_factory.mktemp("mcore-moe")
        mp.spawn(_worker, args=(2, R.free_port(), str(root)), nprocs=2, join=True)
        _CACHE["run"] = (root, json.loads((root / "results.json").read_text()))
    return _CACHE["run"]
