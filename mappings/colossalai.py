"""Megatron args -> a ColossalAI hybrid-parallel CONFIG (seed 003): parallel and precision parts.

The file is Python, as ColossalAI reads it: module constants (SEQ_LEN,
BATCH_SIZE, NUM_MICRO_BATCHES inside CONFIG, TENSOR_SHAPE) and
`CONFIG = dict(parallel=dict(pipeline=P, tensor=dict(mode='1d', size=T)),
fp16=dict(mode=AMP_TYPE.NAIVE))`. We read it back with `ast`, never by running it.
"""
from __future__ import annotations

import ast
import pprint

from .key_mapping import OMIT, R, Unmappable

NAIVE = "AMP_TYPE.NAIVE"


def _fp16(fp16, bf16):
    if bf16:
        raise Unmappable("ColossalAI's AMP is fp16 only (AMP_TYPE.NAIVE/TORCH/APEX), no bf16")
    return NAIVE if fp16 else OMIT


def _micro_batches(doc) -> int:
    config = doc.get("CONFIG")
    n = config.get("NUM_MICRO_BATCHES", 1) if isinstance(config, dict) else 1
    return n if isinstance(n, int) and n > 0 else 1


ROWS = [
    R("seq_length", "SEQ_LEN"),
    R(("micro_batch_size", "micro_batch_num"), "BATCH_SIZE", to=lambda mbs, n: mbs * n if mbs and n else OMIT,
      back=lambda v, doc: {"micro_batch_size": v // _micro_batches(doc)}),
    R(("micro_batch_size", "seq_length", "hidden_size"), "TENSOR_SHAPE",
      to=lambda mbs, s, h: [mbs, s, h] if mbs and s and h else OMIT,
      back=lambda v, doc: {"micro_batch_size": v[0], "seq_length": v[1], "hidden_size": v[2]}),
    R("micro_batch_num", "CONFIG.NUM_MICRO_BATCHES"),
    R("pipeline_model_parallel_size", "CONFIG.parallel.pipeline", 1),
    R("tensor_model_parallel_size", "CONFIG.parallel.tensor.size", 1),
    R("tensor_model_parallel_size", "CONFIG.parallel.tensor.mode", "1d", to=lambda tp: "1d",
      back=lambda v, doc: {}),
    R(("fp16", "bf16"), "CONFIG.fp16.mode", to=_fp16, back=lambda v, doc: {"fp16": v == NAIVE}),
    R("clip_grad", "CONFIG.clip_grad_norm"),
]


class _Name(str):
    """A bare Python name (AMP_TYPE.NAIVE) that must be written without quotes."""

    def __repr__(self):
        return str(self)


def _py(value, indent=0):
    if isinstance(value, dict):
        pad = " " * (indent + 4)
        items = ",\n".join(f"{pad}{k}={_py(v, indent + 4)}" for k, v in value.items())
        return "dict(\n" + items + "\n" + " " * indent + ")"
    if value == NAIVE:
        return NAIVE
    if isinstance(value, list):
        return "(" + ", ".join(_py(v) for v in value) + ")"
    return pprint.pformat(value)


# AMP_TYPE is where seed 003's ColossalAI (0.1-0.2) keeps it, or in `colossalai.legacy.amp` (0.3 and later,
# e.g. 0.5.0); imported only by a config that names it, so one without fp16 loads with no AMP module at all.
AMP_IMPORT = ["try:", "    from colossalai.amp import AMP_TYPE  # ColossalAI 0.1-0.2",
              "except ImportError:", "    from colossalai.legacy.amp import AMP_TYPE  # 0.3 and later"]


def render(doc: dict) -> str:
    lines = ["# ColossalAI config written by `interop map-args`."]
    lines += AMP_IMPORT if NAIVE in repr(doc) else []
    lines.append("")
    for key, value in doc.items():
        lines.append(f"{key} = {_py(value)}")
    return "\n".join(lines) + "\n"


def _literal(node):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return {kw.arg: _literal(kw.value) for kw in node.keywords}
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "AMP_TYPE":
        return f"AMP_TYPE.{node.attr}"
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def parse(text: str) -> dict:
    """Module-level `NAME = literal` assignments of a config file; anything else is skipped."""
    doc = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                doc[node.targets[0].id] = _literal(node.value)
            except ValueError:
                continue
    return doc
