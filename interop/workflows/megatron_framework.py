"""megatron-core as a parity framework: its own GPTModel trains the run, when megatron-core is installed.

The checkpoint is converted to Megatron's `torch` format (tp 1) with `interop.convert`,
loaded into an mcore `GPTModel` (local layer spec, no Transformer Engine; a mixture-of-experts
model gets mcore's MoE layers, `moe_config`) with `load_state_dict(strict=True)`, and trained
on the same batches with the same update rule (`optim.py`) over mcore's gradients.  It runs in
child processes of its own (one, or `ep` for a MoE model's experts over expert-parallel ranks):
mcore needs torch.distributed and model-parallel state, and on a machine without
CUDA three calls are patched to CPU stand-ins (as megatron-core's own CPU tests do),
none of which should leak into the caller.

Megatron computes the loss over its whole padded vocabulary (padding rows give
logits of 0, which enter the softmax), so parity with frameworks that use the true
vocabulary needs a vocabulary with no padding (a multiple of 128 at tp 1).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from interop.errors import InteropError
from interop.spec import ModelSpec, llama3_rope_scaling

from ..trainer.config import TrainConfig
from ..trainer.data import TokenData
from ..trainer.optim import clip_grad_norm, lr_at, make_adamw, set_lr
from .model_facts import uncomputed


def available() -> str | None:
    """None when megatron-core can run here, else why not."""
    import importlib.util
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        found = False
    return None if found else "megatron-core is not installed (pip install megatron-core)"


def precondition(spec: ModelSpec) -> str | None:
    """Why megatron-core cannot train this model here (for parity), or None."""
    why = available()
    if why:
        return f"not available: {why}"
    if spec.is_moe and spec.linear_bias:
        return ("megatron-core's experts take biases from add_bias_linear, which this model's experts do not have "
                "(its dense layers do)")
    if spec.is_moe and spec.moe_router_score == "sigmoid" and not spec.moe_norm_topk and spec.moe_topk > 1:
        return ("megatron-core renormalises the top-k of sigmoid router scores always (moe_utils "
                "topk_routing_with_score_function); this model does not (moe_norm_topk false)")
    from interop.formats import converter
    padded = converter("megatron").Writer.padded_vocab(spec, 1)
    if padded != spec.vocab:
        return (f"the vocabulary ({spec.vocab}) is padded to {padded} rows, and megatron-core's loss counts "
                f"the padding; use a vocabulary that is a multiple of 128")
    return None


def megatron_losses(ckpt, cfg: TrainConfig, ep: int = 1) -> list[float]:
    """megatron-core's per-step losses training `ckpt` with `cfg`; `ep` > 1: a mixture-of-experts model's experts
    over `ep` gloo processes (dp = ep, as Megatron carves expert parallelism out of data parallelism)."""
    from interop.store import StoreReader
    spec = StoreReader(ckpt, verify=False).spec
    why = precondition(spec)
    if why:
        raise InteropError(f"framework megatron: {why}")
    if ep > 1:
        spec.check_ep(ep)
        if cfg.global_batch_size % (cfg.micro_batch_size * ep):
            raise InteropError(f"framework megatron at ep {ep}: the global batch {cfg.global_batch_size} is not a "
                               f"multiple of micro batch {cfg.micro_batch_size} x dp {ep}")
    return _in_child(_train, str(ckpt), (cfg, ep), world=ep)


def forward_logits(ckpt, tokens) -> torch.Tensor:
    """megatron-core's logits over the true vocabulary for `tokens` [batch, seq] from common-format `ckpt`
    (no training; a padded vocabulary is fine here: its rows are cut from the logits)."""
    why = available()
    if why:
        raise InteropError(f"framework megatron is not available: {why}")
    # numpy through the queue: a torch tensor would travel as shared memory the exiting child takes away
    return torch.from_numpy(_in_child(_forward, str(ckpt), tokens.numpy()))


def _in_child(fn, ckpt: str, arg, world: int = 1):
    """Run `fn(ckpt, arg)` in `world` child processes of their own (see the module docstring), ranks of one gloo
    world, and return rank 0's result.  A rank that fails stops the others."""
    import queue
    from ..trainer.launch import free_port, start_method
    import torch.multiprocessing as mp
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    port = str(free_port())
    procs = [ctx.Process(target=_child, args=(fn, ckpt, arg, results, {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(world)}))
        for rank in range(world)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        while len(got) < world:
            try:
                rank, kind, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, proc in enumerate(procs) if r not in got and proc.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"megatron-core run failed: rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode}") from None
                continue
            if kind == "error":
                raise InteropError(value)
            if kind == "crash":
                raise RuntimeError(f"megatron-core run failed" + (f" (rank {rank})" if world > 1 else "")
                                   + f":\n{value}")
            got[rank] = value
    finally:
        for proc in procs:
            if len(got) < world and proc.is_alive():
                proc.terminate()
            proc.join()
    return got[0]


def _child(fn, ckpt: str, arg, results, env: dict) -> None:
    import traceback
    import warnings
    from ..trainer.launch import enter_own_world
    enter_own_world(env)
    rank = int(env["RANK"])
    # megatron-core announces every fused kernel it falls back from; we ask for the plain ones on purpose.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)  # mcore's own default
    # megatron-core's dispatcher calls torch's all_gather_into_tensor / reduce_scatter_tensor, which torch renames
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed", category=FutureWarning)
    try:
        results.put((rank, "ok", fn(ckpt, arg)))
    except InteropError as exc:
        results.put((rank, "error", str(exc)))
    except BaseException:
        results.put((rank, "crash", traceback.format_exc()))


def _patch_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mcore_random
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def moe_config(spec: ModelSpec, router_bias_update_rate: float = 1e-3) -> dict:
    """megatron-core's TransformerConfig MoE fields for `spec` ({} for a dense model): SequentialMLP experts
    (no grouped GEMM), the allgather dispatcher, and the router as ModelSpec describes it (trainer/moe.py
    `route`): softmax top-k renormalised is megatron's top-k of the logits then softmax over the k; softmax
    without renormalising is `moe_router_pre_softmax`; sigmoid renormalises for k > 1 in both."""
    if not spec.is_moe:
        return {}
    coeff = spec.moe_aux_loss_coeff
    return dict(
        num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk, moe_ffn_hidden_size=spec.moe_ffn_hidden,
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden,
        moe_shared_expert_gate=spec.shared_expert_gate, moe_router_score_function=spec.moe_router_score,
        moe_router_pre_softmax=spec.moe_router_score == "softmax" and not spec.moe_norm_topk,
        moe_router_enable_expert_bias=spec.moe_router_bias, moe_router_bias_update_rate=router_bias_update_rate,
        moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_router_num_groups=spec.moe_groups, moe_router_group_topk=spec.moe_group_topk,
        moe_router_topk_scaling_factor=None if spec.moe_routed_scaling == 1.0 else spec.moe_routed_scaling,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")


# what megatron-core's GPT model with the local layer spec computes beyond the plain decoder (model_facts)
COMPUTES = frozenset({"mixture of experts", "MTP modules", "qk_norm", "rope_scaling llama3"})


def cannot_build(spec: ModelSpec) -> str | None:
    """Why megatron-core's own GPTModel (local layer spec) cannot compute `spec`, or None."""
    if spec.is_mla:  # its MLASelfAttention passes k_channels / v_channels to a core attention that takes neither
        return ("megatron-core's multi-latent attention does not build without Transformer Engine (0.16.1's local "
                "DotProductAttention takes no k_channels / v_channels)")
    missing = uncomputed(spec, COMPUTES)
    if missing:
        return (f"megatron-core's own GPT model (local layer spec) cannot compute this model's {', '.join(missing)} "
                "(Megatron-Bridge's layer specs and providers do)")
    return None


def build_gpt_model(spec: ModelSpec, router_bias_update_rate: float = 1e-3, ep: int = 1):
    """An mcore GPTModel for `spec` with every fused kernel off (plain torch ops, any device); a
    mixture-of-experts spec gets megatron-core's MoE layers where `spec.is_moe_layer` (`moe_config`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    norm = "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm"
    why = cannot_build(spec)
    if why:
        raise InteropError(why)
    act = {"swiglu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[spec.activation]
    config = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.kv_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden,
        normalization=norm, layernorm_epsilon=spec.norm_eps, add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias, gated_linear_unit=spec.gated_mlp, activation_func=act,
        bias_activation_fusion=False, params_dtype=torch.float32, use_cpu_initialization=True,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        qk_layernorm=spec.qk_norm, expert_model_parallel_size=ep, mtp_num_layers=spec.mtp_layers or None,
        mtp_loss_scaling_factor=spec.mtp_loss_weight,
        **moe_config(spec, router_bias_update_rate))
    scaling = spec.rope_scaling
    if scaling is not None and scaling != llama3_rope_scaling(scaling.get("factor", 0)):
        raise InteropError(f"megatron-core's rope scaling fixes low_freq_factor 1, high_freq_factor 4 and "
                           f"original_max_position_embeddings 8192; this model has {scaling}")
    if spec.is_moe:
        # per-layer specs: moe_layer_freq's dense layers get a dense MLP (get_gpt_layer_local_spec gives
        # every layer the MoE one)
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=norm)
    else:
        layers = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=spec.qk_norm)
    # A sliding window is given as the attention mask (causal_mask); megatron-core's own window_size
    # builds its mask on CUDA only.
    mtp = None
    if spec.mtp_layers:  # MultiTokenPredictionBlock: each module's layer built like the last decoder layer
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        last = layers.layer_specs[-1] if spec.is_moe else layers
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
    return GPTModel(config, layers, vocab_size=spec.padded_vocab, max_sequence_length=spec.max_positions,
                    mtp_block_spec=mtp,
                    position_embedding_type="rope" if spec.position == "rope" else "learned_absolute",
                    rotary_base=int(spec.rope_base), rotary_percent=spec.rotary_percent,
                    share_embeddings_and_output_weights=spec.tied_embeddings,
                    rope_scaling=scaling is not None, rope_scaling_factor=scaling["factor"] if scaling else 8.0)


def causal_mask(spec: ModelSpec, s: int) -> torch.Tensor:
    """[1, 1, s, s], True = masked: the future, and with a sliding window the keys W or more behind."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    masked = j > i
    if spec.sliding_window is not None:
        masked |= i - j >= spec.sliding_window
    return masked[None, None]


@contextlib.contextmanager
def _loaded_model(ckpt: str, purpose: str, padded_vocab, router_bias_update_rate: float = 1e-3, ep: int = 1,
                  trained=lambda spec: spec, **convert_options):
    """In the child (each rank of the gloo world of WORLD_SIZE = `ep` processes): megatron-core's model-parallel
    state (tp 1, pp 1, `ep` expert-parallel ranks), and the checkpoint converted by rank 0 to Megatron tp 1 /
    ep `ep` `torch` files, each rank's file loaded strictly into a GPTModel of `padded_vocab(spec)` rows;
    yields (model, spec) and tears the world down after."""
    import shutil
    import torch.distributed as dist
    from megatron.core import parallel_state
    from interop.convert import convert_here  # one process: this runs inside megatron-core's own ranks
    from interop.io.safe_pickle import safe_torch_load
    if not torch.cuda.is_available():
        _patch_cpu()
    _patch_no_te_router()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    tmp = [tempfile.mkdtemp(prefix=f"interop-{purpose}-megatron-") if rank == 0 else None]
    try:
        dist.broadcast_object_list(tmp, src=0)
        if rank == 0:
            convert_here(ckpt, Path(tmp[0]) / "meg", src_format="interop", dst_format="megatron", tp=1, ep=ep,
                    **convert_options)
        dist.barrier()
        # Megatron-LM's get_checkpoint_name: mp_rank_TT, with expert parallelism mp_rank_TT_EEE
        folder = "mp_rank_00" if ep == 1 else f"mp_rank_00_{parallel_state.get_expert_model_parallel_rank():03d}"
        files = sorted((Path(tmp[0]) / "meg").glob(f"*/{folder}/model_optim_rng.pt"))
        if len(files) != 1:
            raise RuntimeError(f"expected one Megatron rank file {folder}, found {files}")
        state = safe_torch_load(files[0])["model"]
        spec = trained(_spec_of(ckpt))  # the model as the run trains it (TrainConfig.trained_spec)
        model = build_gpt_model(spec.replace(padded_vocab=padded_vocab(spec)), router_bias_update_rate, ep)
        model.load_state_dict(state, strict=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
            tmp[0] = None
        model.eval()  # dropout is 0 anyway; gradients are unaffected
        yield model, spec
    finally:
        if rank == 0 and tmp[0]:
            shutil.rmtree(tmp[0], ignore_errors=True)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _patch_no_te_router() -> None:
    """megatron-core's router GEMM tests `te_general_gemm`, a name moe_utils defines only when Transformer
    Engine imports: without TE it is None (the plain matmul), as megatron-core's own code means it."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _train(ckpt: str, arg) -> list[float]:
    """Megatron-LM's train_step, on each dp rank (dp = ep): its share of the global batch in micro-batches of
    `cfg.micro_batch_size` (each loss scaled by 1 / micro-batches, and so the MoE aux losses,
    MoEAuxLossAutoScaler.set_loss_scale as its forward_step does); the dense gradients averaged over dp and the
    experts' (each held by one rank, `param.allreduce` False) scaled by 1 / dp as megatron-core's DDP does;
    finalize_model_grads' expert-bias update; clipping by the global norm; the update rule."""
    import torch.distributed as dist
    cfg, ep = arg
    # precondition() refused a padded vocabulary: the model has exactly spec.vocab rows
    with _loaded_model(ckpt, "parity", lambda spec: spec.vocab, router_bias_update_rate=cfg.router_bias_update_rate,
                       ep=ep, trained=cfg.trained_spec) as (model, spec):
        model.train()  # MoE routers add their aux loss and count tokens for the expert bias in training only
        rank, dp = dist.get_rank(), dist.get_world_size()
        optimizer = make_adamw(model.named_parameters(), cfg.optim())
        params = list(model.parameters())
        expert = [not getattr(p, "allreduce", True) for p in params]
        data = TokenData(spec.vocab, cfg.seq_length, cfg.seed, cfg.data)
        b, s, mbs = cfg.global_batch_size, cfg.seq_length, cfg.micro_batch_size
        if b % (mbs * dp):
            raise InteropError(f"global batch {b} is not a multiple of micro batch {mbs} x dp {dp}")
        per_rank = b // dp
        micro_batches = per_rank // mbs
        positions = torch.arange(s).unsqueeze(0).expand(mbs, s)
        causal = causal_mask(spec, s)
        if spec.is_moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))
        if spec.mtp_layers:  # the MTP losses' gradients scaled like the LM loss's (schedules.py forward_step)
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))
        losses = []
        for step in range(1, cfg.steps + 1):
            tokens, targets = data.batch((step - 1) * b + rank * per_rank, per_rank)
            optimizer.zero_grad(set_to_none=False)
            total = torch.zeros(())
            for m in range(micro_batches):
                rows = slice(m * mbs, (m + 1) * mbs)
                loss = model(input_ids=tokens[rows], position_ids=positions, attention_mask=causal,
                             labels=targets[rows]).mean() / micro_batches
                loss.backward()
                total += loss.detach()
            if dp > 1:
                for p, is_expert in zip(params, expert):
                    if not is_expert:
                        dist.all_reduce(p.grad)
                    p.grad.div_(dp)
                dist.all_reduce(total)
                total /= dp
            if spec.is_moe:
                _finalize_moe(model)
            # each expert's gradient lives on one rank, the dense ones on all: counted once
            clip_grad_norm([(p.grad, is_expert or rank == 0) for p, is_expert in zip(params, expert)], cfg.clip_grad,
                           (dist.group.WORLD,) if dp > 1 else ())
            set_lr(optimizer, lr_at(cfg.optim(), step, cfg.steps))
            optimizer.step()
            losses.append(float(total))
        return losses


def _finalize_moe(model) -> None:
    """What megatron-core's finalize_model_grads does for MoE routers after the backward passes: move the
    expert bias by the step's token counts (aux-loss-free balancing) and zero the counts."""
    import importlib
    # the module, not the function of the same name that megatron.core.distributed exports
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    if model.config.moe_router_enable_expert_bias:
        fmg._update_router_expert_bias([model], model.config)
    fmg.reset_model_temporary_tensors(model.config, [model])


def _forward(ckpt: str, tokens):
    """In the child: the checkpoint as Megatron tp 1 `torch` files, loaded strictly into a GPTModel, one forward."""
    from interop.formats import converter
    padded = lambda spec: converter("megatron").Writer.padded_vocab(spec, 1)  # noqa: E731
    with _loaded_model(ckpt, "verify", padded, dtype="fp32") as (model, spec):
        tokens = torch.from_numpy(tokens)
        b, s = tokens.shape
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        # MTP modules (loaded strictly above) compute only a training loss from labels: the logits are the
        # main model's, so its forward runs without them
        model.mtp_process, model.config.mtp_num_layers = False, None
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=causal_mask(spec, s))
        return logits[..., :spec.vocab].float().numpy().copy()


def _spec_of(ckpt) -> ModelSpec:
    from interop.store import StoreReader
    return StoreReader(ckpt, verify=False).spec
