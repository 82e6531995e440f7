"""A Megatron checkpoint's stored args: read safely, checked, completed, and the vocabulary padding they imply.

What the args mean as a model and a layout is `mappings/megatron_spec.py`'s (one place for the
converter, map-args and the trainer).
"""
from __future__ import annotations

import argparse
import types

from ...mappings import megatron_args as M
from ...mappings.megatron_spec import check_args, explicit_args  # noqa: F401 (this package's readers import them here)
from ...spec import ModelSpec, padded_vocab_size


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
