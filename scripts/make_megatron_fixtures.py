"""Generate the Megatron test fixtures with a real megatron-core (0.12 .. 0.16; 0.17 .. 0.19 under Python 3.12).

    pip install --target /tmp/mcore-0.12 "megatron-core==0.12.*" --no-deps
    PYTHONPATH=/tmp/mcore-0.12 python scripts/make_megatron_fixtures.py tests/fixtures/megatron
    # 0.17+ (wheels need Python >= 3.12; a 3.12 venv with torch, numpy, packaging, safetensors, psutil):
    /tmp/py312/bin/python -m pip install --target /tmp/mcore-0.18 "megatron-core==0.18.*" --no-deps
    PYTHONPATH=/tmp/mcore-0.18 /tmp/py312/bin/python scripts/make_megatron_fixtures.py tests/fixtures/megatron

A tiny Llama-style megatron-core GPTModel (bf16 weights, the local layer spec, one gloo process
per data-parallel rank on the CPU, megatron-core's own DDP, optimizer and scheduler) trains
STEPS updates and is saved the way Megatron-LM's `save_checkpoint` (megatron/training/checkpointing.py)
saves it, once per optimizer kind and checkpoint format:

    <version>/<optim>/torch/       iter_0000002/mp_rank_00/model_optim_rng.pt (+ distrib_optim.pt)
    <version>/<optim>/torch_dist/  iter_0000002/ (dist_checkpointing.save)
    <version>/<optim>/expected.safetensors   weights, fp32 masters, Adam moments per mcore parameter
    <version>/<optim>/expected.json          step, iteration, consumed samples, scheduler, next loss

<optim> is `fp16opt` (the mixed-precision optimizer, `--bf16` without `--use-distributed-optimizer`,
dp 1) or `distopt` (`--use-distributed-optimizer`, dp 2).  The expected values come from the live
optimizer's own per-parameter state (the distributed optimizer's shards gathered over dp), never
from interop's readers.  PROVENANCE lists versions and commands.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import torch

STEPS = 2
VOCAB, SEQ, MBS = 128, 8, 2
DIMS = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
            max_position_embeddings=16)
LR, MIN_LR, WARMUP, TRAIN_ITERS = 1e-3, 1e-4, 1, 4


def _cpu_device(fn):
    """`fn` with any CUDA `device=` argument sent to the CPU (megatron-core hard-codes 'cuda' in places)."""
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return wrapper


def _patch_torch_api() -> None:
    """megatron-core 0.12's async DCP writer predates torch's `serialization_format` argument (torch >= 2.7):
    pass torch's default, so torch's own `_write_item` writes the items as it always does."""
    import functools
    import inspect

    from torch.distributed.checkpoint import filesystem as dcp_fs
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if ("serialization_format" in inspect.signature(dcp_fs._write_item).parameters
            and "serialization_format" not in inspect.getsource(filesystem_async)):
        filesystem_async._write_item = functools.partial(dcp_fs._write_item,
                                                         serialization_format=dcp_fs.SerializationFormat.TORCH_SAVE)


def _patch_no_fp8() -> None:
    """megatron-core 0.12's distributed optimizer calls its fp8 quantizer with no fp8 parameters at all, and
    that quantizer raises when Transformer Engine is absent: with nothing to quantize it has nothing to do."""
    from megatron.core.optimizer import distrib_optimizer

    real = distrib_optimizer.quantize_param_shard

    def quantize(model_params, *args, **kwargs):
        if len(model_params):
            real(model_params, *args, **kwargs)
    distrib_optimizer.quantize_param_shard = quantize


class _NoStream:
    """The CPU has one stream: waiting on it, or on its events, is done already."""

    def wait_event(self, *args, **kwargs):
        return None

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None


def _patch_cpu() -> None:
    _patch_torch_api()
    _patch_no_fp8()
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, _cpu_device(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):  # the optimizers accept only 'torch.cuda.*Tensor' parameters
        name = real_type(self, *args, **kwargs)
        return "torch.cuda." + name[6:] if not args and not kwargs and name.startswith("torch.") else name
    torch.Tensor.type = cuda_type
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # 0.17+: grad sync waits on the current stream
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.is_available = lambda: False
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", None) or megatron.core.package_info.__version__


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **{k: v for k, v in DIMS.items() if k != "max_position_embeddings"}, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        layernorm_epsilon=1e-5, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)


def _model(config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                   max_sequence_length=DIMS["max_position_embeddings"], position_embedding_type="rope",
                   share_embeddings_and_output_weights=False)
    # Megatron-LM wraps the model in Float16Module, which casts every parameter (norms too) to bf16
    return gpt.bfloat16(), DistributedDataParallel


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens[:, :-1], positions, causal, tokens[:, 1:]


def _args(distributed: bool, ckpt_format: str, dp: int, consumed: int) -> argparse.Namespace:
    """The part of Megatron-LM's args a converter reads, under Megatron's names."""
    return argparse.Namespace(
        **DIMS, kv_channels=DIMS["hidden_size"] // DIMS["num_attention_heads"], group_query_attention=True,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, untie_embeddings_and_output_weights=True, norm_epsilon=1e-5,
        vocab_size=VOCAB, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, seq_length=SEQ,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        data_parallel_size=dp, world_size=dp, micro_batch_size=MBS, global_batch_size=MBS * dp,
        bf16=True, fp16=False, params_dtype=torch.bfloat16, use_distributed_optimizer=distributed,
        ckpt_format=ckpt_format, transformer_impl="local", use_mcore_models=True, optimizer="adam",
        lr=LR, min_lr=MIN_LR, lr_warmup_iters=WARMUP, lr_decay_iters=TRAIN_ITERS, lr_decay_style="cosine",
        train_iters=TRAIN_ITERS, weight_decay=0.01, start_weight_decay=0.01, end_weight_decay=0.01,
        weight_decay_incr_style="constant", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
        iteration=STEPS, consumed_train_samples=consumed, consumed_valid_samples=0, seed=1234)


def _optimizer(model, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                          adam_eps=1e-8, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
                          use_distributed_optimizer=distributed)
    return get_megatron_optimizer(cfg, [model])


def _scheduler(optimizer, gbs: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * gbs,
                                   lr_decay_steps=TRAIN_ITERS * gbs, lr_decay_style="cosine", start_wd=0.01,
                                   end_wd=0.01, wd_incr_steps=TRAIN_ITERS * gbs, wd_incr_style="constant")


def _train_step(ddp, optimizer, step: int, rank: int) -> float:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    inputs, positions, mask, labels = _batch(step, rank)
    loss = ddp(input_ids=inputs, position_ids=positions, attention_mask=mask, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    value = loss.detach().clone()
    torch.distributed.all_reduce(value)
    return value.item() / torch.distributed.get_world_size()


def _per_param_state(gpt, optimizer, distributed: bool) -> dict[str, torch.Tensor]:
    """{kind/param name: full tensor} from the live optimizer (distributed: this rank's shards, gathered)."""
    optimizer = getattr(optimizer, "chained_optimizers", [optimizer])
    assert len(optimizer) == 1, "one optimizer expected (no experts)"
    optimizer = optimizer[0]
    names = {p: n for n, p in gpt.named_parameters()}
    out = {f"weight/{n}": p.detach().clone() for n, p in gpt.named_parameters()}
    if not distributed:
        inner = optimizer.optimizer
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out[f"fp32_param/{names[p]}"] = main.detach().clone()
                for k in ("exp_avg", "exp_avg_sq"):
                    out[f"{k}/{names[p]}"] = inner.state[main][k].detach().clone()
        return out
    pieces = []  # (name, start, stop, {kind: flat shard})
    inner = optimizer.optimizer
    for model_group, main_group in zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups):
        for p, main in zip(model_group, main_group):
            rng = optimizer._get_model_param_range_map(p)["param"]
            kinds = {"fp32_param": main.detach().clone()}
            kinds.update({k: inner.state[main][k].detach().clone() for k in ("exp_avg", "exp_avg_sq")})
            pieces.append((names[p], rng.start, rng.end, kinds))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, pieces)
    shapes = {n: p.shape for n, p in gpt.named_parameters()}
    flat = {}
    for part in gathered:
        for name, start, stop, kinds in part:
            for k, t in kinds.items():
                full = flat.setdefault(f"{k}/{name}", torch.full((shapes[name].numel(),), float("nan")))
                full[start:stop] = t.float()
    for key, full in flat.items():
        assert not full.isnan().any(), f"{key}: not covered by the dp shards"
        out[key] = full.view(shapes[key.split("/", 1)[1]])
    return out


def _rng_state():
    import random

    import numpy as np

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}


def _save_torch(out: Path, gpt, optimizer, scheduler, args, distributed: bool) -> None:
    """Megatron-LM's `--ckpt-format torch` save: rank file from dp rank 0, distrib_optim.pt from every rank's shard."""
    rank = torch.distributed.get_rank()
    folder = out / f"iter_{STEPS:07d}" / "mp_rank_00"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": STEPS, "model": gpt.state_dict_for_save_checkpoint(),
             "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
             "rng_state": [_rng_state()], "num_floating_point_operations_so_far": 12345}
    if distributed:
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))  # collective; dp rank 0 writes
    if rank == 0:
        torch.save(state, folder / "model_optim_rng.pt")
        (out / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    torch.distributed.barrier()


def _sharded_metadata(version: str, distributed: bool) -> dict | None:
    """What Megatron-LM of the same release passes as `metadata` (None before 0.13: no such argument)."""
    minor = int(version.split(".")[1])
    if minor < 13:
        return None
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed:
        # 0.16's Megatron-LM default; before, per-parameter (`--dist-ckpt-optim-fully-reshardable` in 0.15:
        # 0.14 knows no dp_reshardable, and 0.15's asserts on torch Adam's per-parameter `step` without TE)
        meta["distrib_optim_sharding_type"] = "dp_reshardable" if minor >= 16 else "fully_sharded_model_space"
    return meta


def _save_torch_dist(out: Path, gpt, optimizer, scheduler, args, distributed: bool, version: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = out / f"iter_{STEPS:07d}"
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    meta = _sharded_metadata(version, distributed)
    model_sd = gpt.sharded_state_dict(metadata=dict(meta)) if meta is not None else gpt.sharded_state_dict()
    if meta is not None:
        optim_sd = optimizer.sharded_state_dict(model_sd, metadata=dict(meta))
    elif distributed:
        optim_sd = optimizer.sharded_state_dict(model_sd, sharding_type="fully_sharded_model_space")
    else:
        optim_sd = optimizer.sharded_state_dict(model_sd)
    dp_rank = torch.distributed.get_rank()
    rng = ShardedObject("rng_state", [_rng_state()], (1, 1), (0, 0), replica_id=dp_rank)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": STEPS, "model": model_sd, "optimizer": optim_sd,
             "opt_param_scheduler": scheduler.state_dict(), "rng_state": rng,
             "num_floating_point_operations_so_far": 12345}
    kwargs = {"content_metadata": dict(meta)} if meta is not None else {}
    dist_checkpointing.save(state, str(folder), **kwargs)
    if torch.distributed.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    torch.distributed.barrier()


def _worker(rank: int, world: int, port: int, out: str, distributed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with contextlib.suppress(Exception):
        model_parallel_cuda_manual_seed(1234)
    version = _version()
    config = _config()
    gpt, DDP = _model(config)
    ddp = DDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
                                                    overlap_grad_reduce=False), gpt)
    optimizer = _optimizer(ddp, distributed)
    gbs = MBS * world
    scheduler = _scheduler(optimizer, gbs)
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(_train_step(ddp, optimizer, step, rank))
        scheduler.step(increment=gbs)
    state = _per_param_state(gpt, optimizer, distributed)
    saved_scheduler = scheduler.state_dict()
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
    saved_steps = sorted({int(s["step"]) for s in inner.state_dict()["state"].values()})
    root = Path(out)
    for fmt in ("torch", "torch_dist"):
        args = _args(distributed, fmt, world, STEPS * gbs)
        if fmt == "torch":
            _save_torch(root / fmt, gpt, optimizer, scheduler, args, distributed)
        else:
            _save_torch_dist(root / fmt, gpt, optimizer, scheduler, args, distributed, version)
    # the losses of the next two updates from this state: what a resumed run must reproduce (the second
    # depends on the restored Adam moments, masters and learning rate)
    next_losses = []
    for step in (STEPS + 1, STEPS + 2):
        next_losses.append(_train_step(ddp, optimizer, step, rank))
        scheduler.step(increment=gbs)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(root / "expected.safetensors"))
        expected = {"megatron_core": version, "torch": torch.__version__, "dp": world, "distributed": distributed,
                    "iteration": STEPS, "consumed_samples": STEPS * gbs, "step": saved_steps,
                    "opt_param_scheduler": saved_scheduler, "losses": losses, "next_losses": next_losses,
                    "num_floating_point_operations_so_far": 12345}
        (root / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _resume_worker(rank: int, world: int, port: int, ckpt: str, distributed: bool, sharding: str | None,
                   bucket_size: int | None = None) -> None:
    """Megatron-LM's resume: load model, optimizer and scheduler from `ckpt` (an iteration folder, torch or
    torch_dist), train 2 updates, print losses."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    config = _config()
    gpt, DDP = _model(config)
    with torch.no_grad():  # other starting weights than the saved run's: the load must replace them all
        for p in gpt.parameters():
            p.add_(1.0)
    # --bucket-size: Megatron-LM's --overlap-grad-reduce --ddp-bucket-size N (the buffer in several buckets)
    ddp = DDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
                                                    overlap_grad_reduce=bucket_size is not None,
                                                    bucket_size=bucket_size), gpt)
    optimizer = _optimizer(ddp, distributed)
    gbs = MBS * world
    scheduler = _scheduler(optimizer, gbs)
    if (Path(ckpt) / "mp_rank_00").is_dir():
        _load_torch(Path(ckpt), gpt, optimizer, scheduler, distributed)
    else:
        _load_torch_dist(ckpt, gpt, optimizer, scheduler, distributed, sharding)
    losses = []
    for step in (STEPS + 1, STEPS + 2):
        losses.append(_train_step(ddp, optimizer, step, rank))
        scheduler.step(increment=gbs)
    if rank == 0:
        print(json.dumps({"losses": losses}))
    torch.distributed.destroy_process_group()


def _load_torch(folder: Path, gpt, optimizer, scheduler, distributed: bool) -> None:
    """Megatron-LM's `load_checkpoint` of a `--ckpt-format torch` iteration folder (tp 1, pp 1): the rank file
    on every rank, then (distributed optimizer) `load_parameter_state` of the distrib_optim.pt beside it."""
    state = torch.load(folder / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    gpt.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    if distributed:
        _keep_torch_step(optimizer)
        optimizer.load_parameter_state(str(folder / "mp_rank_00" / "distrib_optim.pt"))
    scheduler.load_state_dict(state["opt_param_scheduler"])


def _patch_for_dist_load(optimizer, distributed: bool) -> None:
    """What a torch_dist load of torch Adam needs from megatron-core without TE."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Without TE/apex, the distributed optimizer's state_dict() reads torch Adam's per-parameter `step`,
        # which megatron-core's init_state_fn (run before a load) does not create: add it as torch would.
        def init_state(opt, config=None, real=inner.init_state_fn):
            real(opt, config)
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state[p].setdefault("step", torch.tensor(0.0))
        inner.init_state_fn = init_state
        if distributed:  # its sharded_state_dict(is_loading) reads the state before initialising it
            init_state(inner.optimizer, getattr(inner, "config", None))
    if distributed:
        _keep_torch_step(optimizer)


def _keep_torch_step(optimizer) -> None:
    """The distributed optimizer's per-parameter load (`fully_reshardable`, and distrib_optim.pt's
    `load_parameter_state`) copies every state key, torch Adam's `step` included, which no checkpoint holds
    per parameter (load_state_dict already set it from the param groups, as it is with TE's FusedAdam,
    which keeps no per-parameter step): copy the rest, keep the step."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        real_set = inner._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, real_set=real_set, inner=inner):
            group, order = inner.model_param_group_index_map[model_param]
            state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None)
            real_set(model_param, tensors)
            if step is not None:
                state["step"] = step
        inner._set_main_param_and_optimizer_states = set_states


def _load_torch_dist(ckpt: str, gpt, optimizer, scheduler, distributed: bool, sharding: str | None) -> None:
    from megatron.core import dist_checkpointing

    _patch_for_dist_load(optimizer, distributed)
    meta = _sharded_metadata(_version(), distributed)
    if meta is not None and distributed:
        meta["distrib_optim_sharding_type"] = sharding
    if meta is None:  # before 0.13: no metadata argument
        model_sd = gpt.sharded_state_dict()
        kwargs = {"sharding_type": sharding} if distributed else {}
        request = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, **kwargs)}
    else:
        model_sd = gpt.sharded_state_dict(metadata=dict(meta))
        request = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                                metadata=dict(meta))}
    loaded = dist_checkpointing.load(request, ckpt)
    gpt.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    # load() returns the common state merged in (common.pt, or 0.19's `common_state` object)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="fixtures root (a <version>/ folder is made in it)")
    parser.add_argument("--only", choices=("fp16opt", "distopt"), default=None)
    parser.add_argument("--resume", action="store_true",
                        help="OUT is an iteration folder (torch or torch_dist): load it (--only's optimizer), "
                        "train 2 updates")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="--resume with --overlap-grad-reduce and DDP buckets of N elements")
    parser.add_argument("--sharding", default="fully_sharded_model_space",
                        help="the distributed optimizer's sharding type to load with (--resume)")
    ns = parser.parse_args(argv)
    if ns.resume:
        distributed = ns.only == "distopt"
        world = 2 if distributed else 1
        torch.multiprocessing.spawn(_resume_worker, args=(world, _free_port(), str(ns.out), distributed, ns.sharding,
                                                          ns.bucket_size),
                                    nprocs=world)
        return
    import megatron.core  # noqa: F401 (fail early when PYTHONPATH lacks it)

    version = _version()
    for kind in ("fp16opt", "distopt"):
        if ns.only and kind != ns.only:
            continue
        out = ns.out / version / kind
        if out.exists():
            raise SystemExit(f"{out} exists: remove it first")
        out.mkdir(parents=True)
        world = 2 if kind == "distopt" else 1
        torch.multiprocessing.spawn(_worker, args=(world, _free_port(), str(out), kind == "distopt"), nprocs=world)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
