"""The training state survives every Megatron hop: a trainer checkpoint converted through Megatron
torch and torch_dist (at other layouts) and back resumes exactly where it stopped.

Where Megatron keeps the state (what the writers must produce):
- `opt_param_scheduler`: megatron-core's `OptimizerParamScheduler.state_dict()`
  (megatron/core/optimizer_param_scheduler.py), counted in samples: Megatron-LM's
  `get_optimizer_param_scheduler` (megatron/training/training.py) sets
  `lr_warmup_steps = lr_warmup_iters * global_batch_size` and `train_step` steps it by the global batch;
- `args.consumed_train_samples`, which Megatron-LM's `load_checkpoint` (megatron/training/checkpointing.py)
  restores; `iteration`.
The scheduler written is loaded here by megatron-core's own `OptimizerParamScheduler`.
"""
from __future__ import annotations

import pytest
import torch

from interop.convert import convert
from interop.errors import InteropError
from interop.io.megatron_dist import DistCheckpoint
from interop.io.torch_file import LazyTorchFile
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.init import init_checkpoint, read_spec
from interop.trainer.launch import train
from interop.trainer.optim import lr_at
from helpers.specs import LLAMA, write_spec

STEPS, K, GBS = 4, 2, 4


def config(**kw) -> TrainConfig:
    base = dict(steps=STEPS, save_interval=K, micro_batch_size=2, global_batch_size=GBS, seq_length=16, lr=3e-3,
                warmup=1, min_lr=1e-4, decay_style="cosine", quiet=True)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("megstate")
    start = init_checkpoint(read_spec(write_spec(root / "llama.yaml", LLAMA)), root / "start", seed=5)
    history = train(config(load=str(start), save=str(root / "A")))
    return root, {r["step"]: r["loss"] for r in history}


def _args_and_scheduler(path, fmt):
    if fmt == "torch_dist":
        common = DistCheckpoint(next(path.glob("iter_*"))).common
        return vars(common["args"]), common.get("opt_param_scheduler"), common["iteration"]
    obj = LazyTorchFile(next(path.glob("iter_*/mp_rank_*/model_optim_rng.pt"))).obj
    return vars(obj["args"]), obj.get("opt_param_scheduler"), obj["iteration"]


def _param_groups(path, fmt):
    if fmt == "torch_dist":
        saved = DistCheckpoint(next(path.glob("iter_*"))).common["optimizer"]
    else:
        saved = LazyTorchFile(next(path.glob("iter_*/mp_rank_*/model_optim_rng.pt"))).obj["optimizer"]
    return saved.get("optimizer", saved)["param_groups"]


def _mcore_lr(scheduler: dict) -> float:
    """The learning rate megatron-core's own scheduler computes after loading `scheduler`."""
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.5, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=1,
                                    lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
                                    wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)
    sched.load_state_dict(scheduler)
    return sched.get_lr(opt.param_groups[0])


def test_state_survives_every_megatron_hop_and_resumes_exactly(run, tmp_path):
    root, losses = run
    hops = [("megatron", "torch", dict(tp=2)), ("interop", None, {}), ("megatron", "torch_dist", dict(pp=2)),
            ("megatron", "torch", dict(tp=2, pp=2)), ("megatron", "torch_dist", {}), ("interop", None, {})]
    src = root / "A" / "step_000002"
    cfg = config()
    for i, (fmt, layout, kw) in enumerate(hops):
        dst = tmp_path / f"hop{i}-{fmt}-{layout}"
        summary = convert(src, dst, dst_format=fmt, options={"format": layout} if layout else None, **kw)
        if fmt == "megatron":
            args, scheduler, iteration = _args_and_scheduler(dst, layout)
            assert iteration == K and args["consumed_train_samples"] == K * GBS
            assert scheduler == {"max_lr": 3e-3, "lr_warmup_steps": 1 * GBS, "num_steps": K * GBS,
                                 "lr_decay_style": "cosine", "lr_decay_steps": STEPS * GBS, "min_lr": 1e-4,
                                 "start_wd": cfg.weight_decay, "end_wd": cfg.weight_decay,
                                 "wd_incr_style": "constant", "wd_incr_steps": STEPS * GBS}
            # megatron-core's scheduler, loaded, is where the trainer's schedule is after K updates
            assert _mcore_lr(scheduler) == pytest.approx(lr_at(cfg.optim(), K, STEPS), rel=1e-12)
            # the update rule goes into the groups megatron-core's optimizer load puts in place of its own
            groups = _param_groups(dst, layout)
            assert [(tuple(g["betas"]), g["eps"], g["weight_decay"], g["wd_mult"]) for g in groups] == [
                ((cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, 1.0), ((cfg.beta1, cfg.beta2), cfg.eps, 0.0, 0.0)]
            # the trainer's rng (hop 0) has no Megatron equivalent: said; later hops have none to lose
            assert any("rng state is not written" in n for n in summary.notes) == (i == 0)
        src = dst
    state = StoreReader(src).source.state
    assert state["iteration"] == K and state["consumed_samples"] == K * GBS
    assert state["scheduler"] == {"lr": 3e-3, "min_lr": 1e-4, "warmup": 1, "decay_steps": None,
                                  "decay_style": "cosine", "total_steps": STEPS}
    assert state["optimizer"]["step"] == K and state["optimizer"]["betas"] == [cfg.beta1, cfg.beta2]
    resumed = train(config(load=str(src), save=str(tmp_path / "B"), resume=True))
    assert {r["step"]: r["loss"] for r in resumed} == {s: losses[s] for s in range(K + 1, STEPS + 1)}


def test_resume_without_data_position_says_what_is_missing(run, tmp_path):
    """A Megatron checkpoint without `consumed_train_samples` (e.g. a tool that never wrote it): one line."""
    root, _ = run
    meg = tmp_path / "meg"
    convert(root / "A" / "step_000002", meg, dst_format="megatron")
    rank = next(meg.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    obj = torch.load(rank, weights_only=False)
    del obj["args"].consumed_train_samples
    torch.save(obj, rank)
    back = tmp_path / "back"
    convert(meg, back, dst_format="interop")
    with pytest.raises(InteropError, match="lacks consumed_samples"):
        train(config(load=str(back), save=str(tmp_path / "B"), resume=True))


def test_no_schedule_in_the_source_is_noted(tmp_path):
    """A checkpoint with moments but no schedule (e.g. from MindSpore): Megatron gets no scheduler, and a note."""
    start = init_checkpoint(read_spec(write_spec(tmp_path / "llama.yaml", LLAMA)), tmp_path / "start", seed=5)
    train(config(load=str(start), save=str(tmp_path / "A"), steps=1, save_interval=1))
    ckpt = tmp_path / "A" / "step_000001"
    import json
    manifest = json.loads((ckpt / "interop.json").read_text())
    del manifest["state"]["scheduler"]
    (ckpt / "interop.json").write_text(json.dumps(manifest))
    for fmt in ("torch", "torch_dist"):
        summary = convert(ckpt, tmp_path / fmt, dst_format="megatron", options={"format": fmt})
        assert any("no LR schedule in the source: opt_param_scheduler not written" in n for n in summary.notes)
        assert _args_and_scheduler(tmp_path / fmt, fmt)[1] is None
