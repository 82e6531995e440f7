"""megatron-core 0.16.1 MoE models with expert tensor parallelism other than tp (`expert_tensor_parallel_size`).

    run(root, kind, torch_ckpt, dist_ckpt) -> {"loss:torch": .., "loss:dist": ..}   (spawns 2 gloo processes)

1. tp 2, ep 2, etp 1 (world 2): a fresh model loads interop's torch-format output as Megatron-LM's resume does (each
   rank its folder `mp_rank_{tp rank}_{ep rank}`, strict), computes the loss, and saves itself as Megatron-LM's
   `--ckpt-format torch` does (ranks of expert-data-parallel rank 0, here both, write their folder) into
   root/mcore-etp/iter_0000001.
2. tp 2, ep 1, etp 1: a fresh model loads interop's torch_dist output with megatron-core's dist_checkpointing.

Which rank holds what (parallel_state.py, order tp-cp-ep-dp-pp; experts' tp = etp): rank r has dense tp rank r % 2,
EP rank r // etp % ep and expert tp rank r % etp, so at tp 2 / ep 2 / etp 1 rank 1's folder is mp_rank_01_001 and
holds whole experts (no expert tp split) next to dense tp shard 1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import helpers.megatron_ref as R
import helpers.moe_megatron_ref as MR


def _build(kind: str, tp: int, ep: int, etp: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = MR.config(kind, tp, ep)
    cfg.expert_tensor_parallel_size = etp
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=R.VOCAB, max_sequence_length=MR.DIMS["max_position_embeddings"],
                    position_embedding_type="rope", rotary_base=int(R.ROPE_BASE),
                    share_embeddings_and_output_weights=False).eval()


def _worker(rank: int, world: int, port: int, root: str, kind: str, torch_ckpt: str, dist_ckpt: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R.patch_cpu()
    MR._patch_moe_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    root = Path(root)
    out = {}
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                     expert_tensor_parallel_size=1)
        model = _build(kind, 2, 2, 1)
        folder = MR.rank_folder(ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), 2)
        state = torch.load(Path(torch_ckpt) / folder / "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        out["loss:torch"] = R.mcore_loss(model)
        args = MR.megatron_args(kind, 2, 2, "torch")
        args.expert_tensor_parallel_size = 1
        save = root / "mcore-etp" / f"iter_{MR.ITERATION:07d}" / folder
        if ps.get_expert_data_parallel_rank() == 0:
            save.mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": MR.ITERATION,
                        "model": model.state_dict_for_save_checkpoint(), "num_floating_point_operations_so_far": 0},
                       save / "model_optim_rng.pt")
        torch.distributed.barrier()
        if rank == 0:
            (root / "mcore-etp" / "latest_checkpointed_iteration.txt").write_text(str(MR.ITERATION))
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        model = _build(kind, 2, 1, 1)
        MR.load_dist(model, dist_ckpt)
        out["loss:dist"] = R.mcore_loss(model)
        ps.destroy_model_parallel()
        if rank == 0:
            (root / "etp-results.json").write_text(json.dumps(out))
    finally:
        torch.distributed.destroy_process_group()


def run(root, kind: str, torch_ckpt, dist_ckpt) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, R.free_port(), str(root), kind, str(torch_ckpt), str(dist_ckpt)), nprocs=2, join=True)
    return json.loads((Path(root) / "etp-results.json").read_text())
