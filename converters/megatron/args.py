"""A Megatron checkpoint's stored args: read safely, checked, completed, and the vocabulary padding they imply.

What the args mean as a model and a layout is `mappings/megatron_spec.py`'s (one place for the
converter, map-args and the trainer).
"""
from __future__ import annotations

import argparse
import types

from ...mappings import megatron_args as M
from ...mappings.megatron_spec import check_args, explicit_args  # noqa: F401 (this package's readers import them here)
from ...errors import InteropError
from ...spec import ModelSpec, padded_vocab_size

# The model's shape: what a --model-config given beside a checkpoint's own args must agree with.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "num_experts",
              "moe_ffn_hidden_size")


def check_model_config(stored: dict | None, full: dict, model_config, where) -> None:
    """One line listing the fields that differ when `--model-config` (`full`, in Megatron's terms) describes
    another model than the checkpoint's own args (`stored`), instead of the first contradiction a spec meets."""
    if not stored or not stored.get("num_layers"):
        return
    own = M.complete(explicit_args(stored))
    differ = [f"{key} {full[key]} vs {own[key]}" for key in SHAPE_ARGS
              if full.get(key) is not None and own.get(key) is not None and full[key] != own[key]]
    if full.get("group_query_attention") and own.get("group_query_attention") \
            and full.get("num_query_groups") != own.get("num_query_groups"):
        differ.append(f"num_query_groups {full.get('num_query_groups')} vs {own.get('num_query_groups')}")
    vocab, padded = full.get("vocab_size") or full.get("padded_vocab_size"), stored.get("padded_vocab_size")
    if differ and vocab and padded and int(vocab) > int(padded):  # alone: the rows' own line says it (issue 22)
        differ.append(f"vocab_size {vocab} vs the checkpoint's padded_vocab_size {padded}")
    if differ:
        raise InteropError(f"--model-config {model_config} describes another model than {where}'s args "
                           f"(--model-config vs checkpoint): {', '.join(differ)}")


def vocab_divisor(vocab: int, padded: int, tp: int, default: int = 128) -> int | None:
    """A make_vocab_size_divisible_by that makes Megatron pad `vocab` to exactly `padded` at `tp`."""
    if padded_vocab_size(vocab, tp, default) == padded:
        return default
    d = default
    while d * tp <= padded:
        if padded % (d * tp) == 0 and padded_vocab_size(vocab, tp, d) == padded:
            return d
        d += default
    return None


def args_dict(args) -> dict | None:
    if args is None:
        return None
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    if hasattr(args, "state") and isinstance(getattr(args, "state"), dict):  # a placeholder Namespace subclass
        return dict(args.state)
    return None


def base_args(meg: dict) -> dict | None:
    """The source checkpoint's args (from `Source.state["megatron"]`), completed, unknown keys kept."""
    base = meg.get("args") or None
    if base is not None:
        base = M.complete(explicit_args(base)) | {k: v for k, v in base.items() if k not in M.ARGS}
    return base


def padded_vocab(spec: ModelSpec, tp: int) -> int:
    """Megatron's padding of the true vocab at `tp`; the source's rows kept when they still divide."""
    if spec.padded_vocab % (128 * tp) == 0 and vocab_divisor(spec.vocab, spec.padded_vocab, tp) is not None:
        return spec.padded_vocab
    return padded_vocab_size(spec.vocab, tp)
