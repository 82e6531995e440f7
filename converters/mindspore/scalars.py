"""Training state <-> the scalars MindSpeed-Core-MS keeps beside the tensors (step, epoch, optimizer
param groups, LR scheduler), typed as `convert_pt2ckpt.py` writes them (tables in mappings)."""
from __future__ import annotations

import re

import torch

from ...mappings.mindspore_names import (EPOCH_NUM, GROUP_FLAGS, GROUP_RENAMES, RNG_TAGS, SCHEDULER_STYLES,
                                         SCHEDULER_TYPES, STATE_STEP, STEP_NUM)

GROUP_TAG = re.compile(r"^(.+)_group_(\d+)$")
_DTYPES = {"float64": torch.float64, "int32": torch.int32}
_RENAMED_BACK = {v: k for k, v in GROUP_RENAMES.items()}


def _number(value) -> bool:
    return isinstance(value, (bool, int, float))


def state_to_scalars(state: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The scalars for one rank file, and notes for what the state holds that they cannot carry."""
    notes = []
    meg = state.get("megatron") or {}
    iteration = state.get("iteration")
    out = {STEP_NUM: torch.tensor(int(iteration) if isinstance(iteration, int) else 0, dtype=torch.int64),
           EPOCH_NUM: torch.tensor(int((state.get("mindspeed") or {}).get(EPOCH_NUM, 0)), dtype=torch.int64)}
    hyper = meg.get("optimizer") or {}
    if hyper.get("step") is not None:
        out[STATE_STEP] = torch.tensor([float(hyper["step"])], dtype=torch.float32)
    skipped = set()
    for i, group in enumerate(hyper.get("param_groups") or []):
        for key, value in group.items():
            if key in ("step", "params"):
                continue
            tag = f"{GROUP_RENAMES.get(key, key)}_group_{i}"
            if isinstance(value, (list, tuple)) and all(_number(v) for v in value):
                out[tag] = torch.tensor([float(v) for v in value], dtype=torch.float32)
            elif _number(value):
                out[tag] = torch.tensor(float(value), dtype=torch.float32)
            elif value is not None:
                skipped.add(key)
    if skipped:
        notes.append(f"optimizer param-group values that are not numbers were not written ({', '.join(sorted(skipped))})")
    scheduler = meg.get("opt_param_scheduler") or {}
    for key, value in scheduler.items():
        if key in SCHEDULER_STYLES and isinstance(value, str):
            if value not in SCHEDULER_STYLES[key]:
                notes.append(f"LR scheduler {key}={value!r} has no MindSpeed index: not written")
                continue
            value = SCHEDULER_STYLES[key].index(value)
        if not _number(value):
            continue
        dtype = _DTYPES.get(SCHEDULER_TYPES.get(key), torch.float32)
        out[key] = torch.tensor(int(value) if dtype == torch.int32 else float(value), dtype=dtype)
    if not scheduler and (isinstance(iteration, int) or hyper):  # a training state without its scheduler
        notes.append("no LR-scheduler state in the source: MindSpeed training resuming from this checkpoint "
                     "needs override_opt_param_scheduler (its scheduler checks max_lr, num_steps, ...)")
    return out, notes


class BadScalar(ValueError):
    """A training-state scalar that is not a finite number (NaN, Inf), or not whole where a count belongs."""


def _checked(tag: str, value: torch.Tensor, whole: bool) -> torch.Tensor:
    """`value` when every element is finite (and, with `whole`, an integer): NaN in a step count would
    raise deep in `int()`, NaN in a learning rate would train nothing."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise BadScalar(f"scalar {tag} is {value.tolist()}: not a finite number")
    if whole and value.is_floating_point() and not bool((value == value.round()).all()):
        raise BadScalar(f"scalar {tag} is {value.tolist()}: not a whole number")
    return value


def scalars_to_state(scalars: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """Training state (iteration, optimizer hyperparameters, scheduler) from one rank file's scalars.
    A value that is not finite (or not whole where a count belongs) raises `BadScalar`."""
    state, groups, scheduler, dropped = {}, {}, {}, []
    step = None
    for tag, value in scalars.items():
        m = GROUP_TAG.match(tag)
        if tag in (STEP_NUM, EPOCH_NUM, STATE_STEP) or tag in SCHEDULER_TYPES or m:  # what the state takes
            _checked(tag, value, tag in (STEP_NUM, EPOCH_NUM, STATE_STEP) or tag in SCHEDULER_STYLES
                     or SCHEDULER_TYPES.get(tag) == "int32")
        if tag == STEP_NUM:
            state["iteration"] = int(value.item())
        elif tag == EPOCH_NUM:
            state.setdefault("mindspeed", {})[EPOCH_NUM] = int(value.item())
        elif tag == STATE_STEP:
            step = int(value.reshape(-1)[0].item())
        elif tag in SCHEDULER_TYPES:
            v = value.item()
            if tag in SCHEDULER_STYLES and 0 <= int(v) < len(SCHEDULER_STYLES[tag]):
                v = SCHEDULER_STYLES[tag][int(v)]
            elif SCHEDULER_TYPES[tag] == "int32":
                v = int(v)
            scheduler[tag] = v
        elif m:
            key = _RENAMED_BACK.get(m.group(1), m.group(1))
            if key == "params":  # the parameters' indices: rebuilt by whoever writes an optimizer
                continue
            v = value.tolist()
            groups.setdefault(int(m.group(2)), {})[key] = bool(v) if key in GROUP_FLAGS else v
        elif tag in RNG_TAGS:
            dropped.append(tag)
        else:
            dropped.append(tag)
    if groups or step is not None:
        state.setdefault("megatron", {})["optimizer"] = {
            "param_groups": [groups[i] for i in sorted(groups)], "step": step}
    if scheduler:
        state.setdefault("megatron", {})["opt_param_scheduler"] = scheduler
    notes = []
    rng = [t for t in dropped if t in RNG_TAGS]
    if rng:
        notes.append(f"dropped the rng state ({', '.join(rng)}: per-rank generator states do not survive resharding)")
    other = [t for t in dropped if t not in RNG_TAGS]
    if other:
        notes.append(f"dropped {len(other)} scalar entries that are not parameters ({', '.join(sorted(other)[:5])})")
    return state, notes


def is_scalar_tag(tag: str, shape: tuple) -> bool:
    """Scalars and the short 1-d lists (state_step, betas_group_0, params_group_0) MindSpeed stores."""
    return shape == () or tag == STATE_STEP or bool(GROUP_TAG.match(tag)) or tag in RNG_TAGS
