"""megatron-core's distributed optimizer at tp/pp > 1 on the CPU: save a real run, resume one, dump its state.

    python tests/helpers/mcore_distopt.py save OUT --tp 2 --pp 1 --dp 2       # OUT/torch_dist/iter_0000002, OUT/torch/..., OUT/state_*
                                                                       # (--model-space: + OUT/torch_dist_model_space)
    python tests/helpers/mcore_distopt.py resume ITER_DIR OUT --tp 2 --dp 1    # loads (fully_reshardable or dp_reshardable)

The model, patches, optimizer, scheduler and save are scripts/make_megatron_fixtures.py's (a tiny Llama-style
GPTModel, bf16 weights, local layer spec, megatron-core's DDP and DistributedOptimizer), here on a tp x pp x dp
gloo world (megatron-core's rank order: tp fastest, then dp, then pp).  With pp 1 the run trains on real batches;
with pp > 1 (megatron-core's pipeline schedule needs CUDA streams) every stage takes its updates from fixed
pseudo-random gradients written into DDP's grad buffer, which is all the optimizer sees either way.
`state_tp<t>_pp<p>.safetensors`: the live optimizer's fp32 masters and Adam moments of that rank's parameters
(`<kind>/<mcore name>`, its dp shards gathered), the values a converted checkpoint must restore.
Run as a script: megatron-core needs torch.distributed and its CUDA patches, kept out of the pytest process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_megatron_fixtures as F  # noqa: E402

STEPS = F.STEPS
# a multiple of 128 * tp for tp 1 and 2, so that Megatron-LM's default padding (--make-vocab-size-divisible-by 128)
# keeps it at either tp (the batches use the first F.VOCAB token ids)
VOCAB = 256


def _start(rank: int, world: int, port: int, tp: int, pp: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    F._patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = dataclasses.replace(F._config(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                   max_sequence_length=F.DIMS["max_position_embeddings"], position_embedding_type="rope",
                   share_embeddings_and_output_weights=False, pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage()).bfloat16()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False), gpt)
    optimizer = F._optimizer(ddp, True)
    dp = ps.get_data_parallel_world_size()
    scheduler = F._scheduler(optimizer, F.MBS * dp)
    return ps, gpt, ddp, optimizer, scheduler


def _step(ps, gpt, ddp, optimizer, step: int, pp: int) -> float | None:
    """One update: real batches at pp 1 (the loss, averaged over dp), fixed gradients at pp > 1 (None)."""
    if pp == 1:
        return F._train_step(ddp, optimizer, step, ps.get_data_parallel_rank())
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for name, p in gpt.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(f"{ps.get_pipeline_model_parallel_rank()}/{name}/{step}".encode()))
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)
    ddp.finish_grad_sync()
    optimizer.step()
    return None


def _state(ps, gpt, optimizer) -> dict[str, torch.Tensor]:
    """{kind/name: tensor} of this rank's parameters from the live optimizer, its dp shards gathered."""
    inner_opt = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    names = {p: n for n, p in gpt.named_parameters()}
    pieces = []
    for model_group, main_group in zip(inner_opt.model_float16_groups, inner_opt.shard_fp32_from_float16_groups):
        for p, main in zip(model_group, main_group):
            rng = inner_opt._get_model_param_range_map(p)["param"]
            kinds = {"fp32_param": main.detach().clone()}
            kinds.update({k: inner_opt.optimizer.state[main][k].detach().clone() for k in ("exp_avg", "exp_avg_sq")})
            pieces.append((names[p], rng.start, rng.end, kinds))
    group = ps.get_data_parallel_group()
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, pieces, group=group)
    shapes = {n: p.shape for n, p in gpt.named_parameters()}
    flat = {}
    for part in gathered:
        for name, start, stop, kinds in part:
            for k, t in kinds.items():
                flat.setdefault(f"{k}/{name}", torch.full((shapes[name].numel(),), float("nan")))[start:stop] = t.float()
    return {key: full.view(shapes[key.split("/", 1)[1]]) for key, full in flat.items()}


def _dump_state(ps, gpt, optimizer, out: Path) -> None:
    state = _state(ps, gpt, optimizer)
    if ps.get_data_parallel_rank() == 0:
        from safetensors.torch import save_file

        t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"state_tp{t}_pp{p}.safetensors"))


def _save_torch(ps, out: Path, gpt, optimizer, scheduler, args) -> None:
    """Megatron-LM's `--ckpt-format torch` save at tp/pp: one folder per (tp, pp) rank (`mp_rank_<t>` at pp 1, else
    `mp_rank_<t>_<p>`: checkpointing.py get_checkpoint_name), its rank file from dp rank 0, and distrib_optim.pt
    from `save_parameter_state` (collective over dp)."""
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    folder = out / f"iter_{STEPS:07d}" / (f"mp_rank_{t:02d}" if args.pipeline_model_parallel_size == 1
                                          else f"mp_rank_{t:02d}_{p:03d}")
    folder.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": STEPS, "model": gpt.state_dict_for_save_checkpoint(),
             "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
             "rng_state": [F._rng_state()], "num_floating_point_operations_so_far": 12345}
    optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
    if ps.get_data_parallel_rank() == 0:
        torch.save(state, folder / "model_optim_rng.pt")
        (out / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    torch.distributed.barrier()


def _save_worker(rank: int, world: int, port: int, out: str, tp: int, pp: int, model_space: bool) -> None:
    ps, gpt, ddp, optimizer, scheduler = _start(rank, world, port, tp, pp)
    dp = world // (tp * pp)
    for step in range(1, STEPS + 1):
        _step(ps, gpt, ddp, optimizer, step, pp)
        scheduler.step(increment=F.MBS * dp)
    root = Path(out)
    _dump_state(ps, gpt, optimizer, root)
    args = F._args(True, "torch_dist", dp, STEPS * F.MBS * dp)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size = tp, pp, world
    args.vocab_size = args.padded_vocab_size = VOCAB
    F._save_torch_dist(root / "torch_dist", gpt, optimizer, scheduler, args, True, F._version())  # dp_reshardable
    torch_args = argparse.Namespace(**dict(vars(args), ckpt_format="torch"))
    _save_torch(ps, root / "torch", gpt, optimizer, scheduler, torch_args)
    if model_space:  # the same state as 0.12-0.15's Megatron-LM saves it
        real = F._sharded_metadata
        F._sharded_metadata = lambda version, distributed: dict(real(version, distributed),
                                                                distrib_optim_sharding_type="fully_sharded_model_space")
        F._save_torch_dist(root / "torch_dist_model_space", gpt, optimizer, scheduler, args, True, F._version())
    torch.distributed.destroy_process_group()


def _resume_worker(rank: int, world: int, port: int, ckpt: str, out: str, tp: int, sharding: str) -> None:
    ps, gpt, ddp, optimizer, scheduler = _start(rank, world, port, tp, 1)
    with torch.no_grad():  # other weights than the saved run's: the load must replace them all
        for p in gpt.parameters():
            p.add_(1.0)
    if (Path(ckpt) / "mp_rank_00").is_dir():  # the torch format at tp 1: rank file, then load_parameter_state
        F._load_torch(Path(ckpt), gpt, optimizer, scheduler, True)
    else:
        F._load_torch_dist(ckpt, gpt, optimizer, scheduler, True, sharding)
    _dump_state(ps, gpt, optimizer, Path(out))
    losses = [_step(ps, gpt, ddp, optimizer, step, 1) for step in (STEPS + 1, STEPS + 2)]
    if rank == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("save", "resume"))
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--sharding", default="fully_reshardable", help="resume: the sharding type to load with")
    parser.add_argument("--model-space", action="store_true",
                        help="save: also torch_dist_model_space/ (`fully_sharded_model_space`)")
    ns = parser.parse_args(argv)
    world = ns.tp * ns.pp * ns.dp
    if ns.what == "save":
        ns.paths[0].mkdir(parents=True, exist_ok=True)
        torch.multiprocessing.spawn(_save_worker, args=(world, F._free_port(), str(ns.paths[0]), ns.tp, ns.pp,
                                                        ns.model_space),
                                    nprocs=world)
    else:
        ckpt, out = ns.paths
        out.mkdir(parents=True, exist_ok=True)
        torch.multiprocessing.spawn(_resume_worker, args=(world, F._free_port(), str(ckpt), str(out), ns.tp,
                                                          ns.sharding), nprocs=world)


if __name__ == "__main__":
    main()
