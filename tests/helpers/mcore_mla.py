"""megatron-core 0.16.1 multi-latent-attention GPT models with MTP on CPU: the oracle for interop's Megatron MLA and
MTP names, shapes, tensor-parallel cuts and torch_dist keys.

One spawned gloo group of 2 processes (megatron_ref's CPU patches) runs, per model kind (KINDS: DeepSeek-V3-shaped
with q compression, group-limited sigmoid routing, a dense first layer and an MTP module; DeepSeek-V2-Lite-shaped
without q compression or MTP):
  1. tp 2: the real GPTModel (local layer spec, `get_gpt_decoder_block_spec` + `get_gpt_mtp_block_spec`), every
     weight random, saved as Megatron-LM saves it: the torch format's `mp_rank_0T/model_optim_rng.pt` (its
     `state_dict_for_save_checkpoint`) and torch_dist (`dist_checkpointing.save` of its `sharded_state_dict`).
     Rank 0 has interop convert both to HF and HF back to Megatron (torch at tp 2, torch at ep 2, torch_dist).
     Fresh models BUILT FROM THE ARGS INTEROP WROTE (Megatron-LM's core_transformer_config_from_args copies every
     args field that is a TransformerConfig field; the few it renames are renamed here) load interop's outputs
     with megatron-core's own loaders (strict) and every tensor is compared with the saved model's.
  2. tp 1 / ep 2, then pp 2: fresh models load interop's ep-2 (pp-2) torch output and, through megatron-core's own
     resharding, interop's torch_dist output; both must hold the same tensors (at pp 2 the last stage also holds
     megatron-core's embedding copy for its MTP block).
The pytest process only reads the results JSON.

Two stand-ins, neither touching what is saved: core attention is a small SDPA module accepting MLA's
`k_channels` / `v_channels` (0.16.1's local DotProductAttention does not take them; the saved state of MLA's
projections does not depend on it), and the `TELinear` / `TEColumnParallelLinear` names multi_latent_attention.py
compares against are set to dummy classes (without Transformer Engine they are MagicMocks, which `isinstance`
refuses); at pp 2 `Tensor.cuda` returns the tensor (language_module.py moves the last stage's embedding copy to
the GPU before its all-reduce with the first stage's).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

import helpers.megatron_ref as R
from helpers.moe_megatron_ref import load_dist, load_torch, save_dist, save_torch

VOCAB, PADDED = 1000, 1024  # not a multiple of 128; Megatron pads to 128 x tp
KINDS = {
    "v3": dict(q_lora_rank=48, mtp_num_layers=1, moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
               moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
               moe_router_topk=4, moe_router_topk_scaling_factor=2.5),
    "v2lite": dict(q_lora_rank=None, mtp_num_layers=None, moe_router_score_function="softmax", moe_router_pre_softmax=True,
                   moe_router_enable_expert_bias=False, moe_router_num_groups=None, moe_router_group_topk=None,
                   moe_router_topk=2, moe_router_topk_scaling_factor=None),
}
# Megatron-LM's words for the model (the args a DeepSeek run is launched with)
DIMS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
            norm_epsilon=1e-6, add_bias_linear=False, swiglu=True, multi_latent_attention=True, kv_lora_rank=32,
            qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True, rope_type="rope",
            num_experts=8, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1], moe_shared_expert_intermediate_size=32,
            max_position_embeddings=64, untie_embeddings_and_output_weights=True)
RENAMED = {"num_experts": "num_moe_experts", "norm_epsilon": "layernorm_epsilon"}  # args -> TransformerConfig
CPU = dict(params_dtype=torch.float32, use_cpu_initialization=True, bias_dropout_fusion=False,
           masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
           apply_rope_fusion=False, bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
           moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
           moe_permute_fusion=False, moe_router_fusion=False, moe_grouped_gemm=False, fp16=False, bf16=False,
           sequence_parallel=False)
# interop's conversions: label -> (source, format, tp, ep); "hf" is interop's HF output of mcore's torch save
CONVERSIONS = {"hf": ("torch", "hf", 1, 1), "hf-from-dist": ("torch_dist", "hf", 1, 1),
               "torch-tp2": ("hf", "torch", 2, 1), "torch-ep2": ("hf", "torch", 1, 2),
               "torch-pp2": ("hf", "torch", 1, 1, 2), "dist": ("hf", "torch_dist", 2, 1)}


class CoreAttention(torch.nn.Module):
    """Causal softmax attention over [s, b, n, d] q / k and [s, b, n, dv] v (no parameters)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, packed_seq_params=None, **_):
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def megatron_args(kind: str, tp: int, ep: int, ckpt_format: str) -> argparse.Namespace:
    args = vars(R.megatron_args("llama", tp, ckpt_format))
    args.update(DIMS, **KINDS[kind], vocab_size=VOCAB, padded_vocab_size=PADDED, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=tp, num_query_groups=DIMS["num_attention_heads"],
                group_query_attention=False, kv_channels=DIMS["qk_head_dim"] + DIMS["qk_pos_emb_head_dim"],
                position_embedding_type="rope", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    return argparse.Namespace(**args)


def config_from_args(args: dict, tp: int, ep: int, pp: int = 1):
    """MLATransformerConfig from Megatron args as Megatron-LM's core_transformer_config_from_args makes it (every
    same-named field; its renames; swiglu), with the CPU switches."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    kw = {RENAMED.get(k, k): v for k, v in args.items() if RENAMED.get(k, k) in names}
    if args.get("swiglu"):
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    kw.update(CPU, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=None,
              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None, pipeline_dtype=torch.float32)
    for key in [k for k in kw if k.startswith(("num_layers_in_", "pipeline_model_parallel_layout"))]:
        kw.pop(key)
    return MLATransformerConfig(**kw)


def build(args: dict, tp: int, ep: int, pp: int = 1):
    """This rank's model; at pp > 1 its stage's layers (the MTP block and an embedding copy on the last)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = config_from_args(args, tp, ep, pp)
    rank = ps.get_pipeline_model_parallel_rank()
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=rank)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False, pp_rank=rank) if cfg.mtp_num_layers \
        else None
    return GPTModel(cfg, spec, vocab_size=args["padded_vocab_size"], max_sequence_length=args["max_position_embeddings"],
                    position_embedding_type="rope", share_embeddings_and_output_weights=False, mtp_block_spec=mtp,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).eval()


def fill(model, seed: int) -> None:
    """Every weight random (norms near 1), per rank: the comparison is rank by rank."""
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, x in model.state_dict(keep_vars=True).items():
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()) + seed)
                noise = torch.randn(x.shape, generator=g)
                x.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise if "bias" in name else 0.08 * noise)


def tensors(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def differences(a: dict, b: dict) -> list[str]:
    """Keys held by one side only or whose tensors differ (empty: the same model)."""
    out = sorted(set(a) ^ set(b))
    return out + [k for k in sorted(set(a) & set(b)) if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def interop_args(folder: Path, fmt: str) -> dict:
    """The args interop wrote into its output (rank 0's file, or common.pt)."""
    if fmt == "torch_dist":
        return vars(torch.load(folder / "common.pt", weights_only=False)["args"])
    first = sorted(folder.glob("mp_rank_*/model_optim_rng.pt"))[0]
    return vars(torch.load(first, weights_only=False)["args"])


def release(root: Path) -> Path:
    """interop's Megatron output of an HF source (no iteration): `release/`."""
    return root / "release"


def convert_all(root: Path, kind: str) -> None:
    from interop.convert import convert

    for label, (src, fmt, tp, ep, *pp) in CONVERSIONS.items():
        source = root / "interop" / f"{kind}-hf" if src == "hf" else root / src / kind
        target = root / "interop" / f"{kind}-{label}"
        if fmt == "hf":
            convert(source, target, dst_format="hf", src_format="megatron")
        else:
            convert(source, target, dst_format="megatron", tp=tp, ep=ep, pp=pp[0] if pp else 1, format=fmt)


def _patch_mla_cpu() -> None:
    import megatron.core.transformer.moe.moe_utils as mu
    import megatron.core.transformer.multi_latent_attention as mla

    mu.te_general_gemm = None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the MTP stage's embedding copy is synced via .cuda()
    mla.TELinear = type("NoTELinear", (), {})
    mla.TEColumnParallelLinear = type("NoTEColumnParallelLinear", (), {})


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R.patch_cpu()
    _patch_mla_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    root = Path(root)
    results: dict = {}
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        saved = {}
        for kind in KINDS:
            entry = results[kind] = {}
            args = megatron_args(kind, 2, 1, "torch")
            model = build(vars(args), 2, 1)
            fill(model, 0)
            saved[kind] = tensors(model)
            entry["keys"] = {k: list(v.shape) for k, v in saved[kind].items()} if rank == 0 else None
            save_torch(model, root / "torch" / kind, args, 1)
            save_dist(model, root / "torch_dist" / kind, megatron_args(kind, 2, 1, "torch_dist"))
            if rank == 0:
                convert_all(root, kind)
            torch.distributed.barrier()
            for label in ("torch-tp2", "dist"):
                folder = release(root / "interop" / f"{kind}-{label}")
                fmt = "torch_dist" if label == "dist" else "torch"
                written = interop_args(folder, fmt)
                fresh = build(written, 2, 1)
                load_dist(fresh, folder) if fmt == "torch_dist" else load_torch(fresh, folder, 1)
                entry[f"differs:{label}"] = differences(saved[kind], tensors(fresh))
                entry[f"args:{label}"] = {k: written.get(k) for k in (
                    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim", "qk_layernorm", "mtp_num_layers", "transformer_impl")}
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
        for kind in KINDS:
            folder = release(root / "interop" / f"{kind}-torch-ep2")
            written = interop_args(folder, "torch")
            from_torch = build(written, 1, 2)
            load_torch(from_torch, folder, 2)
            from_dist = build(written, 1, 2)
            load_dist(from_dist, release(root / "interop" / f"{kind}-dist"))
            results[kind]["differs:torch-ep2"] = differences(tensors(from_dist), tensors(from_torch))
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
        for kind in KINDS:  # pp 2: the last stage holds the MTP block and megatron-core's embedding copy for it
            folder = release(root / "interop" / f"{kind}-torch-pp2")
            written = interop_args(folder, "torch")
            from_torch = build(written, 1, 1, 2)
            stage = folder / f"mp_rank_00_{ps.get_pipeline_model_parallel_rank():03d}" / "model_optim_rng.pt"
            from_torch.load_state_dict(torch.load(stage, weights_only=False)["model"], strict=True)
            from_dist = build(written, 1, 1, 2)
            load_dist(from_dist, release(root / "interop" / f"{kind}-dist"))
            mine = differences(tensors(from_dist), tensors(from_torch))
            keys = sorted(tensors(from_torch))
            gathered = [None, None]
            torch.distributed.all_gather_object(gathered, (mine, keys))
            results[kind]["differs:torch-pp2"] = gathered[0][0] + gathered[1][0]
            results[kind]["keys:pp2-last"] = gathered[1][1]
        ps.destroy_model_parallel()
        if rank == 0:
            (root / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        torch.distributed.destroy_process_group()


_CACHE: dict = {}


def reference_once(tmp_path_factory) -> tuple[Path, dict]:
    """The run, once per test session: (root, {kind: {"keys": ..., "differs:<label>": [...], "args:<label>": ...}})."""
    if "run" not in _CACHE:
        import torch.multiprocessing as mp

        root = tmp_path_factory.mktemp("mcore-mla")
        mp.spawn(_worker, args=(2, R.free_port(), str(root)), nprocs=2, join=True)
        _CACHE["run"] = (root, json.loads((root / "results.json").read_text()))
    return _CACHE["run"]


# --- MTP training oracle: megatron-core's own loss and gradients of the DeepSeek-V3-shaped model with MTP ---------
MTP_VOCAB = 1000  # not a multiple of 128: --make-vocab-size-divisible-by 8 leaves it unpadded, as megatron-core's
MTP_WEIGHT = 0.3  # loss counts padded columns (the trainer's does not); a non-default mtp_loss_scaling_factor
MTP_TOKENS = (2, 12)  # micro-batch, sequence


def mtp_args() -> argparse.Namespace:
    args = megatron_args("v3", 1, 1, "torch")
    args.vocab_size = args.padded_vocab_size = MTP_VOCAB
    args.make_vocab_size_divisible_by = 8
    args.mtp_loss_scaling_factor = MTP_WEIGHT
    args.world_size, args.data_parallel_size = 1, 1
    return args


class _Saved:
    """A state dict standing in for a model in save_torch (a gradient saved in its parameter's place)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict_for_save_checkpoint(self) -> dict:
        return self.state


def mtp_batch():
    """(tokens, labels) [2, 12]: labels are the next tokens, as Megatron-LM's GPT dataset gives them."""
    seq = torch.randint(0, MTP_VOCAB, (MTP_TOKENS[0], MTP_TOKENS[1] + 1), generator=torch.Generator().manual_seed(5))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _mtp_worker(rank: int, world: int, port: int, root: str, steps: int, lr: float) -> None:
    """tp 1: megatron-core's GPTModel with its MTP block trains `steps` plain SGD steps (p -= lr * grad) on one
    batch; per step its LM loss (the mean of GPTModel's per-token loss), each MTP module's loss as it logs it
    (MTPLossLoggingHelper.save_loss_to_tracker) and its gradients (of the LM loss, MTPLossAutoScaler adding
    mtp_loss_scaling_factor / mtp_num_layers x each MTP loss, at scale 1: one micro-batch) saved as a torch
    checkpoint, each gradient in its parameter's place.  The starting weights are saved too."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R.patch_cpu()
    _patch_mla_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    root = Path(root)
    logged: list = []
    MTPLossLoggingHelper.save_loss_to_tracker = staticmethod(
        lambda loss, layer_number, num_layers, **_: logged.append(float(loss.detach())))
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        args = mtp_args()
        model = build(vars(args), 1, 1).train()
        fill(model, 3)
        save_torch(model, root / "start", args, 1)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        tokens, labels = mtp_batch()
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        results = []
        for step in range(steps):
            model.zero_grad()
            logged.clear()
            loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels).mean()
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            state = {k: grads.get(k, v) for k, v in model.state_dict_for_save_checkpoint().items()}
            save_torch(_Saved(state), root / f"grad{step}", args, 1)
            results.append({"loss": float(loss), "mtp": list(logged)})
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        (root / "mtp.json").write_text(json.dumps(results))
        ps.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


def mtp_training_once(tmp_path_factory, steps: int = 3, lr: float = 0.05) -> tuple[Path, list]:
    """megatron-core's run, once per test session: (root with start/ and gradN/ torch checkpoints, per-step
    [{"loss": LM loss, "mtp": [each module's loss]}])."""
    if "mtp" not in _CACHE:
        import torch.multiprocessing as mp

        root = tmp_path_factory.mktemp("mcore-mtp")
        mp.spawn(_mtp_worker, args=(1, R.free_port(), str(root), steps, lr), nprocs=1, join=True)
        _CACHE["mtp"] = (root, json.loads((root / "mtp.json").read_text()))
    return _CACHE["mtp"]
