"""Megatron args -> ATorch / DeepSpeed 3D parallel (seed 004): the parallel and precision parts.

One JSON file: `parallel_mode` is ATorch's load_strategy entry
`("parallel_mode", ([("tensor", t), ("data", d), ("pipeline", p)], None))` as a
mapping, and `ds_config` is the DeepSpeed config that DeepSpeed3DParallelConfig
takes (batch sizes, clipping, fp16/bf16 and loss scaling, ZeRO stage, optimizer).
"""
from __future__ import annotations

import ast
import math

from ..errors import InteropError
from .key_mapping import R, Unmappable, rename

OPTIMIZER = {"adam": "AdamW", "sgd": "SGD"}


def _scale_power(scale):
    power = math.log2(scale) if scale and scale > 0 else -1
    if power != int(power) or power < 0:
        raise Unmappable(f"initial_scale_power holds a power of two, {scale} is not one")
    return int(power)


ROWS = [
    R("tensor_model_parallel_size", "parallel_mode.tensor", 1),
    R("data_parallel_size", "parallel_mode.data"),
    R("pipeline_model_parallel_size", "parallel_mode.pipeline", 1),
    R("global_batch_size", "ds_config.train_batch_size"),
    R("micro_batch_size", "ds_config.train_micro_batch_size_per_gpu"),
    R("micro_batch_num", "ds_config.gradient_accumulation_steps"),
    R("clip_grad", "ds_config.gradient_clipping"),
    R("log_interval", "ds_config.steps_per_print"),
    R("fp16", "ds_config.fp16.enabled", False),
    R("loss_scale", "ds_config.fp16.loss_scale", 0, unset=True),  # 0: dynamic, Megatron's unset --loss-scale
    R("initial_loss_scale", "ds_config.fp16.initial_scale_power", to=_scale_power,
      back=lambda v, doc: {"initial_loss_scale": float(2 ** v)}),
    R("loss_scale_window", "ds_config.fp16.loss_scale_window",
      to=lambda v: int(v) if isinstance(v, float) and v.is_integer() else v),
    R("hysteresis", "ds_config.fp16.hysteresis"),
    R("min_loss_scale", "ds_config.fp16.min_loss_scale"),
    R("bf16", "ds_config.bf16.enabled", False),
    R("use_distributed_optimizer", "ds_config.zero_optimization.stage", 0,
      to=lambda v: 1 if v else 0, back=lambda v, doc: {"use_distributed_optimizer": v >= 1}),
    rename("optimizer", "ds_config.optimizer.type", OPTIMIZER),
    R("lr", "ds_config.optimizer.params.lr"),
    R(("adam_beta1", "adam_beta2"), "ds_config.optimizer.params.betas", to=lambda b1, b2: [b1, b2],
      back=lambda v, doc: {"adam_beta1": v[0], "adam_beta2": v[1]}),
    R("adam_eps", "ds_config.optimizer.params.eps"),
    R("weight_decay", "ds_config.optimizer.params.weight_decay"),
]


# ---------------------------------------------------------------- ATorch strategy scripts (read only)

PARALLEL_MODE = {"tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size",
                 "data": "data_parallel_size"}


def _argparse_defaults(tree) -> dict:
    """`parser.add_argument("--name", ..., default=D)` literals: {"name": D}."""
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if names and isinstance(default, ast.Constant):
                defaults[names[0].lstrip("-").replace("-", "_")] = default.value
    return defaults


def _assignments(tree) -> dict:
    """name -> the expression last assigned to it anywhere in the script."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def read_strategy(text: str, where: str) -> tuple[dict, list, list[str]]:
    """An ATorch load_strategy's ("parallel_mode", ([("tensor", t), ("data", d), ("pipeline", p)], None)),
    read with `ast` and never run: sizes that are literals, or names bound to the script's argparse
    defaults (said in a warning), are values; sizes computed at run time are named as missing.
    Returns (values, [(key, expression, why)], warnings)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        raise InteropError(f"{where}: not a readable Python file ({exc})") from None
    defaults, bound = _argparse_defaults(tree), _assignments(tree)
    explicit, entries, warnings = {}, [], []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant)
                and node.elts[0].value == "parallel_mode" and isinstance(node.elts[1], ast.Tuple)
                and node.elts[1].elts and isinstance(node.elts[1].elts[0], (ast.List, ast.Tuple))):
            continue
        for pair in node.elts[1].elts[0].elts:
            if not (isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and isinstance(pair.elts[0], ast.Constant)):
                continue
            name, size = pair.elts[0].value, pair.elts[1]
            dest = PARALLEL_MODE.get(name)
            if dest is None:
                entries.append((f"parallel_mode.{name}", ast.unparse(size), "no Megatron equivalent"))
                continue
            value, how = _resolve(size, bound, defaults)
            if value is None:
                entries.append((f"parallel_mode.{name}", ast.unparse(size),
                                     f"computed when the script runs ({how}): give it with --set {dest}=N"))
            else:
                explicit[dest] = value
                if how:
                    warnings.append(f"parallel_mode.{name} = {value}: {how}")
    if "data_parallel_size" in explicit:
        dp = explicit.pop("data_parallel_size")
        if "tensor_model_parallel_size" in explicit and "pipeline_model_parallel_size" in explicit:
            explicit["world_size"] = dp * explicit["tensor_model_parallel_size"] * explicit["pipeline_model_parallel_size"]
    return explicit, entries, warnings


def _resolve(node, bound: dict, defaults: dict, depth: int = 0):
    """(int value or None, how it was found)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value, ""
    if depth < 4 and isinstance(node, ast.Name) and node.id in bound:
        return _resolve(bound[node.id], bound, defaults, depth + 1)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
        if isinstance(defaults.get(node.attr), int):
            return defaults[node.attr], f"the script's --{node.attr} default (a command line may change it)"
        return None, f"args.{node.attr} has no default"
    return None, ast.unparse(node)
