"""The training state (data position, LR schedule, update rule) <-> where Megatron keeps it.

Megatron keeps it in three places of a checkpoint (rank file or torch_dist `common.pt`):
`iteration`; the args namespace (`consumed_train_samples`, which Megatron's `load_checkpoint`
restores, and the flags of the schedule and update rule: `lr`, `min_lr`, `lr_warmup_iters`,
`lr_decay_iters`, `lr_decay_style`, `train_iters`, `weight_decay`, `adam_beta1/2`, `adam_eps`,
`clip_grad`, `global_batch_size`, ...); and `opt_param_scheduler`, megatron-core's
`OptimizerParamScheduler.state_dict()` (megatron/core/optimizer_param_scheduler.py), whose
steps are SAMPLES: Megatron-LM builds it with `lr_warmup_steps = lr_warmup_iters * global_batch_size`
and steps it by the global batch every iteration (megatron/training/training.py,
`get_optimizer_param_scheduler` and `train_step`).

The canonical form is the interop trainer's state (`trainer/train.py` `_state`): `iteration`,
`consumed_samples`, `scheduler` {lr, min_lr, warmup, decay_steps, decay_style, total_steps} in
iterations, `optimizer` {type, step, betas, eps, weight_decay, clip_grad}, `data`.
"""
from __future__ import annotations

from .optimizer import DEFAULT_GROUPS

# OptimizerParamScheduler.load_state_dict's older spellings of its keys, as it accepts them
SCHEDULER_ALIASES = {"max_lr": ("max_lr", "start_lr"), "lr_warmup_steps": ("lr_warmup_steps", "warmup_steps", "warmup_iter"),
                     "lr_decay_steps": ("lr_decay_steps", "decay_steps", "end_iter"),
                     "lr_decay_style": ("lr_decay_style", "decay_style"), "num_steps": ("num_steps", "num_iters")}


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (samples / global batch), else None."""
    value = _number(value)
    return int(value) if value is not None and float(value).is_integer() else None


def to_megatron(state: dict, args: dict, iteration: int) -> tuple[dict | None, list[str]]:
    """Megatron's `opt_param_scheduler` for `state` and notes; `args` is updated in place.

    A Megatron source's own scheduler and args are kept as they were.  Otherwise the trainer's
    schedule is written as megatron-core lays it out, counted in samples of its global batch.
    """
    meg = state.get("megatron") or {}
    notes = []
    if isinstance(state.get("rng"), dict):
        notes.append("the source's rng state is not written (Megatron keeps per-rank python, numpy, torch and "
                     "cuda generator states; resume Megatron with --no-load-rng)")
    if isinstance(meg.get("opt_param_scheduler"), dict):
        return dict(meg["opt_param_scheduler"]), notes
    consumed = _whole(state.get("consumed_samples"))
    if consumed is not None:
        args["consumed_train_samples"] = consumed
    data, opt = state.get("data") or {}, state.get("optimizer") or {}
    for key, dest in (("seq_length", "seq_length"), ("global_batch_size", "global_batch_size")):
        if _whole(data.get(key)) is not None:
            args[dest] = _whole(data[key])
    if _whole((state.get("trainer") or {}).get("micro_batch_size")) is not None:
        args["micro_batch_size"] = state["trainer"]["micro_batch_size"]
    if _whole((state.get("rng") or {}).get("seed")) is not None:
        args["seed"] = state["rng"]["seed"]
    betas = opt.get("betas")
    if isinstance(betas, list) and len(betas) == 2 and all(_number(b) is not None for b in betas):
        args["adam_beta1"], args["adam_beta2"] = betas
    for key, dest in (("eps", "adam_eps"), ("clip_grad", "clip_grad")):
        if _number(opt.get(key)) is not None:
            args[dest] = opt[key]
    wd = _number(opt.get("weight_decay"))
    if wd is not None:
        args.update(weight_decay=wd, start_weight_decay=wd, end_weight_decay=wd, weight_decay_incr_style="constant")
    sched = state.get("scheduler")
    if not isinstance(sched, dict):
        return None, notes + ["no LR schedule in the source: opt_param_scheduler not written (Megatron "
                              "resumes its optimizer only with one; or load with --no-load-optim)"]
    gbs = _whole(args.get("global_batch_size"))
    total = _whole(sched.get("total_steps"))
    decay = _whole(sched.get("decay_steps")) or total
    warmup = _whole(sched.get("warmup")) or 0
    if not gbs or decay is None or _number(sched.get("lr")) is None:
        return None, notes + ["the source's LR schedule lacks the global batch size, its length or its rate: "
                              "opt_param_scheduler not written"]
    args.update(lr=sched["lr"], min_lr=sched.get("min_lr") or 0.0, lr_warmup_iters=warmup, lr_decay_iters=decay,
                lr_decay_style=sched.get("decay_style") or "linear", train_iters=total or decay)
    samples = consumed if consumed is not None else iteration * gbs
    scheduler = {"max_lr": sched["lr"], "lr_warmup_steps": warmup * gbs, "num_steps": samples,
                 "lr_decay_style": args["lr_decay_style"], "lr_decay_steps": decay * gbs,
                 "min_lr": args["min_lr"], "start_wd": wd if wd is not None else args.get("weight_decay", 0.01),
                 "end_wd": wd if wd is not None else args.get("weight_decay", 0.01),
                 "wd_incr_style": "constant", "wd_incr_steps": (total or decay) * gbs}
    return scheduler, notes


def from_megatron(args: dict, scheduler, optimizer_step) -> dict:
    """The canonical training-state keys a Megatron checkpoint states (none that it does not)."""
    out: dict = {}
    consumed = _whole(args.get("consumed_train_samples"))
    gbs = _whole(args.get("global_batch_size"))
    if consumed is not None:
        out["consumed_samples"] = consumed
    data = {k: _whole(args.get(k)) for k in ("seq_length", "global_batch_size")}
    data = {k: v for k, v in data.items() if v is not None}
    if consumed is not None:
        data["consumed_samples"] = consumed
    if data:
        out["data"] = data
    if isinstance(scheduler, dict) and gbs:
        scheduler = dict(scheduler, **{key: next((scheduler[a] for a in names if a in scheduler), None)
                                       for key, names in SCHEDULER_ALIASES.items()})

        def iters(key):
            value = _whole(scheduler.get(key))
            return value // gbs if value is not None and value % gbs == 0 else None
        warmup, decay = iters("lr_warmup_steps"), iters("lr_decay_steps")
        if _number(scheduler.get("max_lr")) is not None and warmup is not None and decay is not None:
            total = _whole(args.get("train_iters")) or iters("wd_incr_steps") or decay
            out["scheduler"] = {"lr": scheduler["max_lr"], "min_lr": scheduler.get("min_lr", 0.0), "warmup": warmup,
                                "decay_steps": None if decay == total else decay,  # None: the whole run
                                "decay_style": scheduler.get("lr_decay_style"),
                                "total_steps": total}
    # megatron-core's "adam" is torch's AdamW (decoupled weight decay)
    optimizer = {"type": {"adam": "adamw"}.get(args.get("optimizer") or "adam", args.get("optimizer"))}
    if optimizer_step is not None:
        optimizer["step"] = optimizer_step
    if _number(args.get("adam_beta1")) is not None and _number(args.get("adam_beta2")) is not None:
        optimizer["betas"] = [args["adam_beta1"], args["adam_beta2"]]
    for key, src in (("eps", "adam_eps"), ("weight_decay", "weight_decay"), ("clip_grad", "clip_grad")):
        if _number(args.get(src)) is not None:
            optimizer[key] = args[src]
    if len(optimizer) > 1:
        out["optimizer"] = optimizer
    if isinstance(args.get("tokenizer_model"), str) and args["tokenizer_model"]:
        out["tokenizer_model"] = args["tokenizer_model"]  # neutral (interop.state): an HF target takes the file
    return out


def optimizer_hyper(state: dict) -> dict | None:
    """Megatron's optimizer hyperparameters for a source that is not Megatron (the trainer's update rule):
    its [decay, no-decay] param groups with torch Adam's betas and eps (megatron-core's optimizer load
    replaces its groups with the saved ones; the scheduler sets lr and weight decay), and the step."""
    meg = state.get("megatron") or {}
    if isinstance(meg.get("optimizer"), dict):
        return meg["optimizer"]
    opt = state.get("optimizer")
    if not isinstance(opt, dict):
        return None
    groups = []
    for group in DEFAULT_GROUPS:
        g = dict(group)
        betas = opt.get("betas")
        if isinstance(betas, list) and len(betas) == 2:
            g["betas"] = tuple(betas)
        if _number(opt.get("eps")) is not None:
            g["eps"] = opt["eps"]
        if _number(opt.get("weight_decay")) is not None:
            g["weight_decay"] = opt["weight_decay"] * g["wd_mult"]
        g["decoupled_weight_decay"] = opt.get("type") == "adamw"
        groups.append(g)
    step = _whole(opt.get("step"))
    return {"param_groups": groups, "step": step if step is not None else _whole(state.get("iteration"))}
