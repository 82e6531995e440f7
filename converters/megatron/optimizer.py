"""Megatron's non-distributed optimizer state (in `model_optim_rng.pt`) <-> per-parameter moments.

Megatron saves `optimizer` as {"optimizer": a torch Adam state_dict, "fp32_from_fp16_params":
[[fp32 master per param] per group], ...} with mixed precision, or the torch state_dict itself
(FP32Optimizer).  Torch numbers the parameters 0.. across `param_groups` in group order; within
a group they follow the model's parameter order (model chunks in order, each in state-dict
order).  Megatron puts biases and 1-D parameters (norms) in a no-weight-decay group
(`wd_mult` 0, or `weight_decay` 0 in older saves).  The distributed optimizer keeps only the
param groups in the rank file (`distrib_hyper`); its moments and masters are in `distrib_optim.pt`,
in bucket order (`distrib.py`).

torch_dist (megatron-core's `sharded_state_dict` of the same optimizers) stores each moment as
a tensor of its own, `optimizer.state.<kind>.<weight key>`, with the weight's global (stacked,
fused) layout; what is not a tensor goes to `common.pt` as `optimizer`: the torch state_dict
with `params` dropped from each group and the shared step as `state.common_step`
({"param_groups", "state"} for FP32Optimizer; wrapped in {"optimizer": ...} by the mixed-precision
optimizer, whose fp32 masters are the `fp32_param` tensors).  `dist_hyper` / `dist_common` read
and write that entry.
"""
from __future__ import annotations

import re

import torch

from ...io.safe_pickle import to_plain
from . import distrib

KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")  # optim.<kind>.<canonical name>
MOMENTS = ("exp_avg", "exp_avg_sq")
# Megatron's grouping when nothing says otherwise: weight decay, then no weight decay, with the
# keys megatron-core matches saved groups to its own by (`param_group_identifier_keys`).
DEFAULT_GROUPS = [{"wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
                  for wd in (1.0, 0.0)]


def no_decay(key: str, shape) -> bool:
    return len(shape) == 1 or key.endswith(".bias")


def _is_no_decay_group(group: dict) -> bool:
    if "wd_mult" in group:
        return float(group["wd_mult"]) == 0.0
    return float(group.get("weight_decay", 0.0)) == 0.0


def unpack(saved, params: list[tuple[object, str, tuple]], read) -> tuple[dict, dict] | str:
    """{param id: {kind: tensor}} and the JSON-able hyperparameters, or why it cannot be mapped.

    `params` are (id, key, shape) of the rank's trainable parameters in model order; `read`
    turns a stored (lazy) tensor into its value.
    """
    if not isinstance(saved, dict):
        return "the optimizer entry is not a dict"
    inner = saved.get("optimizer", saved)
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        return "the optimizer entry is not a torch optimizer state_dict"
    groups = inner["param_groups"]
    if len(groups) == 1:
        members = [params]
    elif len(groups) == 2 and _is_no_decay_group(groups[0]) != _is_no_decay_group(groups[1]):
        members = [[p for p in params if no_decay(p[1], p[2]) == _is_no_decay_group(g)] for g in groups]
    else:
        return f"{len(groups)} parameter groups (only weight-decay / no-weight-decay grouping is understood)"
    masters = saved.get("fp32_from_fp16_params") if "optimizer" in saved else None
    out, step = {}, None
    for g, (group, mine) in enumerate(zip(groups, members)):
        if len(group["params"]) != len(mine):
            return f"group {g} holds {len(group['params'])} parameters, the model {len(mine)} of its kind"
        for j, (idx, (pid, key, shape)) in enumerate(zip(group["params"], mine)):
            state = inner["state"].get(idx, {})
            got = {k: state[k] for k in MOMENTS if k in state}
            if masters is not None:
                got["fp32_param"] = masters[g][j]
            for k, t in got.items():
                if tuple(t.shape) != tuple(shape):
                    return f"{k} of parameter {idx} has shape {list(t.shape)}, {key} is {list(shape)}"
            if got:
                out[pid] = got
            if "step" in state and step is None:
                value = state["step"]
                step = int(read(value).item() if isinstance(value, torch.Tensor) else value)
    hyper = {"param_groups": [{k: to_plain(v) for k, v in g.items() if k != "params"} for g in groups],
             "step": step}
    return out, hyper


def pack(params: list[tuple[str, tuple, dict]], hyper: dict | None, step, add, bare: bool = False) -> dict:
    """A resumable Megatron optimizer entry from (key, shape, {kind: tensor or ref}) in model order.

    `add` stores a tensor in the rank file being written and returns its reference.  `bare`: fp32 weights, whose
    FP32Optimizer saves the torch state_dict itself (optimizer/optimizer.py FP32Optimizer.state_dict; its
    load_state_dict reads `state` at the top), not wrapped in {"optimizer": ...} as the mixed-precision optimizer.
    """
    hyper = hyper or {}
    saved_groups = hyper.get("param_groups") or DEFAULT_GROUPS
    if len(saved_groups) == 1:
        members = [params]
    else:
        members = [[p for p in params if no_decay(p[0], p[1]) == _is_no_decay_group(g)] for g in saved_groups]
    state, groups, masters, i = {}, [], [], 0
    for saved, mine in zip(saved_groups, members):
        ids = []
        masters.append([])
        for key, shape, kinds in mine:
            entry = {k: kinds[k] for k in MOMENTS if k in kinds}
            if entry:
                # one step tensor per parameter: torch Adam increments it in place (`step_t += 1`), so a tensor
                # shared by all (as unpickling keeps it) would advance once per parameter per update
                entry = {"step": add(torch.tensor(float(step or 0))), **entry}
                state[i] = entry
            if "fp32_param" in kinds:
                masters[-1].append(kinds["fp32_param"])
            ids.append(i)
            i += 1
        groups.append({**saved, "params": ids})
    inner = {"state": state, "param_groups": groups}
    if any(masters):
        return {"optimizer": inner, "fp32_from_fp16_params": masters}
    return inner if bare else {"optimizer": inner}


def _step_value(value) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return None if value is None else int(value)


def dist_hyper(saved) -> dict:
    """The hyperparameters (param_groups, step) from a torch_dist `common.pt`'s `optimizer` entry."""
    inner = saved.get("optimizer", saved) if isinstance(saved, dict) else {}
    inner = inner if isinstance(inner, dict) else {}
    groups = inner.get("param_groups") or []
    state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
    return {"param_groups": [{k: to_plain(v) for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)],
            "step": _step_value(state.get("common_step"))}


def dist_common(hyper: dict | None, step, kinds) -> dict:
    """The `optimizer` entry of `common.pt` that megatron-core's optimizer `load_state_dict` expects."""
    hyper = hyper or {}
    inner = {"state": {"common_step": torch.tensor(float(step or 0))},
             "param_groups": [dict(g) for g in (hyper.get("param_groups") or DEFAULT_GROUPS)]}
    return {"optimizer": inner} if "fp32_param" in kinds else inner


def distrib_hyper(saved) -> dict:
    """The hyperparameters of the distributed optimizer's rank-file entry (its moments are in distrib_optim.pt).

    megatron-core's `DistributedOptimizer.state_dict()` keeps the torch param_groups (the step inside each
    group in recent releases) without `state`; older releases kept the step under `state`."""
    inner = saved.get("optimizer", saved) if isinstance(saved, dict) else {}
    inner = inner if isinstance(inner, dict) else {}
    groups = [g for g in inner.get("param_groups") or [] if isinstance(g, dict)]
    step = next((g["step"] for g in groups if "step" in g), None)
    state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
    if step is None:
        step = state.get("common_step", next((s.get("step") for s in state.values() if isinstance(s, dict)), None))
    return {"param_groups": [{k: to_plain(v) for k, v in g.items() if k not in ("params", "step")} for g in groups],
            "step": _step_value(step)}


def distrib_entry(hyper: dict | None, step) -> dict:
    """megatron-core's `DistributedOptimizer.state_dict()`: torch param groups with the step inside each, no
    per-parameter state (the rank file's `optimizer` beside distrib_optim.pt)."""
    hyper = hyper or {}
    groups = [dict(g, step=float(step or 0)) for g in (hyper.get("param_groups") or DEFAULT_GROUPS)]
    return {"optimizer": {"param_groups": groups}}


def dist_common_distributed(hyper: dict | None, step) -> dict:
    """The `optimizer` entry of common.pt for megatron-core's distributed optimizer (`fully_reshardable`)."""
    return {**distrib_entry(hyper, step), "param_state_sharding_type": "fully_reshardable"}


# ------------------------------------------------------------------------------------------------
# Mixture of experts: megatron-core's ChainedOptimizer of the dense and the expert optimizer

DENSE, EXPERT = 0, 1  # their places in the chained optimizer's saved list (optimizer/__init__.py get_megatron_optimizer)


def is_expert_param(key: str) -> bool:
    """A routed expert's parameter (`allreduce=False` in megatron-core: SequentialMLP's local_experts, GroupedMLP's
    weight1/2, TEGroupedMLP's linear_fc1/2.weightN); the router and the shared experts are dense."""
    return ".mlp.experts." in key


def split_experts(params: list, with_dense: bool) -> list[tuple[int, list]]:
    """[(DENSE, the dense params), (EXPERT, the routed experts' params)] of one rank's (id, key, shape) list in model
    order; only EXPERT where the dense state is read from another folder (a copy of the same tp rank's)."""
    dense = [x for x in params if not is_expert_param(x[1])]
    experts = [x for x in params if is_expert_param(x[1])]
    return ([(DENSE, dense)] if with_dense else []) + [(EXPERT, experts)]


def chained_entry(saved, which: int | None):
    """The `which` optimizer's entry of a chained optimizer's saved list (`ChainedOptimizer.state_dict()` and
    `save_parameter_state` save a list, one entry per optimizer; a dict keyed 0, 1 loads too); `saved` itself for
    None; a string saying why not."""
    if which is None:
        return saved
    if isinstance(saved, dict) and set(saved) == {DENSE, EXPERT}:
        saved = [saved[DENSE], saved[EXPERT]]
    if not isinstance(saved, (list, tuple)):
        return "one optimizer for all parameters (megatron-core keeps the experts' in an optimizer of their own)"
    if len(saved) != 2:
        return f"a chained optimizer of {len(saved)} (the dense and the expert optimizer expected)"
    if saved[which] is None:
        return f"no {'dense' if which == DENSE else 'expert'} optimizer state in it"
    return saved[which]


def expert_data_parallel(dp: int, tp: int, ep: int, etp: int) -> int | str:
    """The expert-data-parallel size (parallel_state.py: world = tp * pp * dp = etp * ep * edp * pp), over which the
    expert optimizer's buffers are laid out; a string saying why it does not divide."""
    if (dp * tp) % (ep * etp):
        return f"dp {dp} * tp {tp} is not a multiple of ep {ep} * etp {etp} (no expert-data-parallel size)"
    return dp * tp // (ep * etp)


def expert_groups(hyper: dict | None, keys_shapes: list[tuple[str, tuple]]) -> list[dict]:
    """The expert optimizer's param groups: the saved ones where the source had them, else the dense groups that
    its parameters fall in (weight decay / no weight decay) marked `is_expert_parallel` (as `_get_param_groups`
    makes them: groups exist only where parameters do)."""
    hyper = hyper or {}
    if hyper.get("expert_param_groups"):
        return [dict(g) for g in hyper["expert_param_groups"]]
    dense = hyper.get("param_groups") or DEFAULT_GROUPS
    if len(dense) == 1:
        return [dict(dense[0], is_expert_parallel=True)]
    kinds = {no_decay(k, s) for k, s in keys_shapes}
    return [dict(g, is_expert_parallel=True) for g in dense if _is_no_decay_group(g) in kinds]


_LOCAL_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.")


def parameter_order(keys: list[str]) -> list[str]:
    """megatron-core's parameter order (its `named_parameters`, which the optimizers number and the DDP buffers
    lay out in) of a local-spec chunk whose keys are listed by kind: `distrib.module_order`, with each MoE layer's
    routed experts expert by expert (local_experts.0.linear_fc1, .0.linear_fc2, .1.linear_fc1, ...)."""
    out = distrib.module_order(keys)
    i = 0
    while i < len(out):
        m = _LOCAL_EXPERT.match(out[i])
        if not m:
            i += 1
            continue
        j = i
        while j < len(out) and (n := _LOCAL_EXPERT.match(out[j])) and n.group(1) == m.group(1):
            j += 1
        out[i:j] = sorted(out[i:j], key=lambda k: int(_LOCAL_EXPERT.match(k).group(2)))
        i = j
    return out
