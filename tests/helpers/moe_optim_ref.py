"""megatron-core 0.16.1 training a mixture-of-experts model on CPU: the oracle for the MoE optimizer state of the
Megatron `torch` format (plain optimizer in `model_optim_rng.pt`, distributed optimizer in `distrib_optim.pt`).

    save:   python -c "import moe_optim_ref as O; O.save(ROOT)"      (spawns 2 gloo processes)
    resume: O.resume(JOBS_JSON)

`save` builds the qwen2moe model of moe_megatron_ref (tp 1, ep 2, world 2: dp 2, expert dp 1), wraps it in
megatron-core's DistributedDataParallel, trains STEPS updates with `get_megatron_optimizer` (a ChainedOptimizer of
the dense and the expert optimizer, megatron/core/optimizer/__init__.py) and saves it as Megatron-LM's
`save_checkpoint` does for `--ckpt-format torch` (training/checkpointing.py): every rank of expert-data-parallel
rank 0 writes `mp_rank_00_{ep:03d}/model_optim_rng.pt` with `optimizer.state_dict()` (the chained optimizer's list
of two state dicts), and with the distributed optimizer every rank calls `save_parameter_state` on its own folder's
`distrib_optim.pt` (ChainedOptimizer.save_parameter_state: a list, None where the rank is not data-parallel rank 0
of that optimizer).  It records, per global parameter name, the live optimizer's fp32 master, exp_avg and exp_avg_sq
(the distributed optimizer's shards gathered), and the losses of the next two updates.

`resume` runs jobs: for each, a fresh model at the job's tp / ep loads a checkpoint as Megatron-LM's
`load_checkpoint` does (its rank folder's model and optimizer, then `load_parameter_state`), reports the live
per-parameter state (tp 1 targets) and trains the same two updates.  Each update consumes the same global batch of
MICRO micro-batches at any data-parallel size (dp rank r takes MICRO/dp of them).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "scripts"))
import helpers.megatron_ref as R  # noqa: E402
import helpers.moe_megatron_ref as MR  # noqa: E402

KIND = "qwen2moe"  # q/k/v biases (a no-weight-decay group), a gated shared expert, 4 routed experts
STEPS, MICRO, MBS, SEQ = 2, 2, 2, 16
LR = 1e-3  # = make_megatron_fixtures.LR, whose scheduler is used


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, R.VOCAB, (MBS, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens[:, :-1], positions, causal, tokens[:, 1:]


def _setup(rank: int, world: int, port: int) -> None:
    import make_megatron_fixtures as FX

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    FX._patch_cpu()
    R.patch_cpu()
    MR._patch_moe_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _build(tp: int, ep: int, distributed: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # eval mode: no dropout or aux loss here anyway, and MoELayer refuses to *train* tp > 1 without sequence
    # parallelism, which the local spec's torch norms do not support; gradients flow the same
    model = MR.build(KIND, tp, ep).eval()
    if tp == 1:
        MR.fill(model, ps.get_expert_model_parallel_rank())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=False), model)
    cfg = OptimizerConfig(optimizer="adam", lr=LR, min_lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                          clip_grad=1.0, bf16=False, params_dtype=torch.float32, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(cfg, [ddp])
    return model, ddp, optimizer, FX_scheduler(optimizer)


def FX_scheduler(optimizer):
    """Megatron-LM's OptimizerParamScheduler as the fixtures script makes it (cosine, warmup 1 iteration)."""
    import make_megatron_fixtures as FX

    return FX._scheduler(optimizer, MICRO * MBS)


def _train_step(ddp, optimizer, scheduler, step: int) -> float:
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = MICRO // dp
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    total = 0.0
    for micro in range(r * n, (r + 1) * n):
        inputs, positions, mask, labels = _batch(step, micro)
        loss = ddp(input_ids=inputs, position_ids=positions, attention_mask=mask, labels=labels).float().mean() / n
        loss.backward()
        total += loss.item()
    ddp.finish_grad_sync()
    optimizer.step()
    scheduler.step(increment=MICRO * MBS)
    value = torch.tensor(total)
    torch.distributed.all_reduce(value)  # tp ranks agree; dp ranks hold their share
    return value.item() / torch.distributed.get_world_size()


def _live_state(model, optimizer, distributed: bool) -> dict[str, torch.Tensor]:
    """{kind/global mcore name: tensor} of the live chained optimizer (tp 1 only), gathered over all ranks."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    names = {p: MR.global_name(n, ep_rank) for n, p in model.named_parameters()}
    pieces = []  # (kind/name, start, stop, flat values, numel)
    for opt in optimizer.chained_optimizers:
        if distributed:
            for p in names:
                if p not in opt.model_param_group_index_map:
                    continue
                rng = opt._get_model_param_range_map(p)["param"]
                tensors = opt._get_main_param_and_optimizer_states(p)
                for theirs, ours in (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                    pieces.append((f"{ours}/{names[p]}", rng.start, rng.end, tensors[theirs].detach().float().clone(),
                                   tuple(p.shape)))
        else:
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    for k in ("exp_avg", "exp_avg_sq"):
                        pieces.append((f"{k}/{names[p]}", 0, p.numel(), inner.state[p][k].detach().clone().reshape(-1),
                                       tuple(p.shape)))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, pieces)
    flat: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple] = {}
    for part in gathered:
        for key, start, stop, values, shape in part:
            full = flat.setdefault(key, torch.full((int(torch.Size(shape).numel()),), float("nan")))
            full[start:stop] = values
            shapes[key] = shape
    out = {}
    for key, full in flat.items():
        assert not full.isnan().any(), f"{key}: not covered by the shards"
        out[key] = full.view(shapes[key])
    return out


def _args(tp: int, ep: int, distributed: bool):
    args = MR.megatron_args(KIND, tp, ep, "torch")
    args.use_distributed_optimizer = distributed
    args.data_parallel_size = 2 // tp
    args.iteration = STEPS
    args.optimizer, args.lr, args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_eps = \
        "adam", LR, 0.01, 0.9, 0.95, 1e-8
    import make_megatron_fixtures as FX  # the schedule FX._scheduler builds, in Megatron-LM's argument names

    args.min_lr, args.lr_warmup_iters, args.lr_decay_iters, args.lr_decay_style, args.train_iters = \
        FX.MIN_LR, FX.WARMUP, FX.TRAIN_ITERS, "cosine", FX.TRAIN_ITERS
    args.start_weight_decay = args.end_weight_decay = 0.01
    args.weight_decay_incr_style, args.clip_grad = "constant", 1.0
    args.micro_batch_size, args.global_batch_size = MBS, MBS * MICRO
    args.consumed_train_samples, args.seq_length = STEPS * MBS * MICRO, SEQ
    return args


def _folder(tp: int, ep: int) -> str:
    from megatron.core import parallel_state as ps

    return MR.rank_folder(ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), ep)


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    from megatron.core import parallel_state as ps

    _setup(rank, world, port)
    root = Path(root)
    try:
        for distributed in (False, True):
            ps.initialize_model_parallel(expert_model_parallel_size=2)
            model, ddp, optimizer, scheduler = _build(1, 2, distributed)
            assert len(optimizer.chained_optimizers) == 2  # dense, experts
            losses = [_train_step(ddp, optimizer, scheduler, s) for s in range(1, STEPS + 1)]
            live = _live_state(model, optimizer, distributed)
            out = root / ("distopt" if distributed else "plain")
            folder = out / f"iter_{STEPS:07d}" / _folder(1, 2)
            folder.mkdir(parents=True, exist_ok=True)
            if distributed:
                optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
            if ps.get_expert_data_parallel_rank() == 0:
                torch.save({"args": _args(1, 2, distributed), "checkpoint_version": 3.0, "iteration": STEPS,
                            "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                            "opt_param_scheduler": scheduler.state_dict(),
                            "num_floating_point_operations_so_far": 0}, folder / "model_optim_rng.pt")
            torch.distributed.barrier()
            next_losses = [_train_step(ddp, optimizer, scheduler, s) for s in (STEPS + 1, STEPS + 2)]
            if rank == 0:
                (out / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
                torch.save(live, out / "expected_state.pt")
                (out / "expected.json").write_text(json.dumps({"losses": losses, "next_losses": next_losses}))
            torch.distributed.barrier()
            ps.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


def _load(folder: Path, model, optimizer, scheduler, ep: int, distributed: bool) -> None:
    import make_megatron_fixtures as FX

    mine = folder / _folder(0, ep)
    state = torch.load(mine / "model_optim_rng.pt", weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if distributed:
        FX._keep_torch_step(optimizer)
        with torch.no_grad():  # fp32 weights: the masters are views of the parameters, which autograd guards
            optimizer.load_parameter_state(str(mine / "distrib_optim.pt"))
        # megatron-core without TE/apex gives every parameter the SAME `step` tensor (distrib_optimizer.py
        # load_state_dict, "Extract 'step', for non-Apex/TE support"), which torch Adam then increments once per
        # parameter per update; TE's FusedAdam keeps no per-parameter step.  Give each its own, as a fresh run has.
        for opt in optimizer.chained_optimizers:
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _resume_worker(rank: int, world: int, port: int, jobs_path: str) -> None:
    from megatron.core import parallel_state as ps

    _setup(rank, world, port)
    jobs = json.loads(Path(jobs_path).read_text())
    results = {}
    try:
        for job in jobs:
            tp, ep, distributed = job["tp"], job["ep"], job["distributed"]
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
            model, ddp, optimizer, scheduler = _build(tp, ep, distributed)
            _load(Path(job["folder"]), model, optimizer, scheduler, ep, distributed)
            entry = results[job["label"]] = {}
            if tp == 1:
                live = _live_state(model, optimizer, distributed)
                if rank == 0:
                    torch.save(live, Path(job["folder"]).parent / "loaded_state.pt")
            entry["next_losses"] = [_train_step(ddp, optimizer, scheduler, s) for s in (STEPS + 1, STEPS + 2)]
            torch.distributed.barrier()
            ps.destroy_model_parallel()
        if rank == 0:
            Path(jobs_path).with_suffix(".results.json").write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


def save(root) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_save_worker, args=(2, R.free_port(), str(root)), nprocs=2, join=True)


def resume(jobs: list[dict], path) -> dict:
    """jobs: [{label, folder (an iteration folder), tp, ep, distributed}] -> {label: {next_losses}}; a tp-1 job's
    loaded per-parameter state goes to <folder>/../loaded_state.pt."""
    import torch.multiprocessing as mp

    path = Path(path)
    path.write_text(json.dumps(jobs))
    mp.spawn(_resume_worker, args=(2, R.free_port(), str(path)), nprocs=2, join=True)
    return json.loads(path.with_suffix(".results.json").read_text())
