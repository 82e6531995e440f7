"""A real megatron-core torch_dist checkpoint with Adam state, and megatron-core loading one back.

    python tests/helpers/mcore_optimizer.py save DIR           # train 2 steps, save DIR/iter_0000002 (+ tracker)
    python tests/helpers/mcore_optimizer.py compare DIR1 DIR2  # load both into mcore: same weights and Adam state?

Llama-style mcore model (megatron_ref's, tp 1, one gloo process on the CPU) under megatron-core's
FP32Optimizer over torch Adam, saved as Megatron-LM's training loop does: `optimizer` is the
optimizer's `sharded_state_dict` (moments as `optimizer.state.exp_avg.<weight key>`, step and
param groups in common.pt).  Run as a script: dist_checkpointing starts helper processes, which
needs a `__main__` guard.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import helpers.megatron_ref as R  # noqa: E402

STEPS = 2


def _setup():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(R.free_port()))
    R.patch_cpu()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def _model_and_optimizer(seed: int):
    """mcore's FP32Optimizer over Adam with Megatron's [decay, no-decay] groups (its __init__ wants CUDA: skipped)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    model = R.build_model("llama", seed).train()
    params = list(model.parameters())
    group = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    adam = torch.optim.Adam([dict(group, params=[p for p in params if p.dim() > 1], wd_mult=1.0),
                             dict(group, params=[p for p in params if p.dim() == 1], wd_mult=0.0)], lr=1e-3)

    def init_state(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, OptimizerConfig(lr=1e-3), init_state)
    return model, opt, adam


def _sharded(model, opt, is_loading=False) -> dict:
    msd = model.sharded_state_dict(metadata=dict(R.SHARDED_SD_METADATA))
    return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading)}


def save(root: Path) -> None:
    from megatron.core import dist_checkpointing

    model, opt, adam = _model_and_optimizer(seed=0)
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        adam.step()
    state = {"args": R.megatron_args("llama", 1, "torch_dist"), "checkpoint_version": 3.0, "iteration": STEPS,
             "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": STEPS * 4, "warmup_steps": 1},
             "num_floating_point_operations_so_far": 0, **_sharded(model, opt)}
    folder = root / f"iter_{STEPS:07d}"
    folder.mkdir(parents=True)
    dist_checkpointing.save(state, str(folder), content_metadata=dict(R.SHARDED_SD_METADATA))
    (root / "latest_checkpointed_iteration.txt").write_text(str(STEPS))


def _load(folder: Path):
    from megatron.core import dist_checkpointing

    model, opt, adam = _model_and_optimizer(seed=1)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), str(folder))
    model.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    return model, adam


def compare(a: Path, b: Path) -> dict:
    (ma, oa), (mb, ob) = _load(a), _load(b)
    sa, sb = oa.state_dict(), ob.state_dict()
    same_state = sa["state"].keys() == sb["state"].keys() and all(
        sa["state"][i].keys() == sb["state"][i].keys() and all(torch.equal(sa["state"][i][k], sb["state"][i][k])
                                                             for k in sa["state"][i]) for i in sa["state"])
    strip = lambda groups: [{k: v for k, v in g.items() if k != "betas"} for g in groups]  # noqa: E731 (list vs tuple)
    return {"weights_equal": all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters())),
            "state_equal": same_state, "groups_equal": strip(sa["param_groups"]) == strip(sb["param_groups"]),
            "steps": sorted({float(s["step"]) for s in sb["state"].values()}), "moments": len(sb["state"])}


def main(argv) -> None:
    _setup()
    try:
        if argv[0] == "save":
            save(Path(argv[1]))
        else:
            print(json.dumps(compare(Path(argv[1]), Path(argv[2]))))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
