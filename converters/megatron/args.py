"""A Megatron checkpoint's stored args: read safely, checked, completed, and the vocabulary padding they imply.

What the args mean as a model and a layout is `mappings/megatron_spec.py`'s (one place for the
converter, map-args and the trainer).
"""
from __future__ import annotations

import argparse
import math
import types

from ...errors import InteropError
from ...io.safe_pickle import to_plain
from ...mappings import megatron_args as M
from ...mappings.megatron_spec import CARRIED_ROPE_SCALING
from ...spec import ModelSpec, padded_vocab_size

# The numbers a reader builds the model and its layout from: checked at the door (`check_args`).
MODEL_NUMBERS = {**dict.fromkeys(
    ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
     "vocab_size", "padded_vocab_size", "max_position_embeddings", "seq_length", "make_vocab_size_divisible_by",
     "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
     "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "data_parallel_size",
     "global_batch_size", "consumed_train_samples", "ddp_bucket_size", "num_experts", "moe_router_topk",
     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "expert_model_parallel_size",
     "expert_tensor_parallel_size"), M.INT),
    **dict.fromkeys(("norm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor"), M.FLOAT)}


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
    if vocab and padded and int(vocab) > int(padded):
        differ.append(f"vocab_size {vocab} vs the checkpoint's padded_vocab_size {padded}")
    if differ:
        raise InteropError(f"--model-config {model_config} describes another model than {where}'s args "
                           f"(--model-config vs checkpoint): {', '.join(differ)}")


def explicit_args(stored: dict) -> dict:
    """Stored checkpoint args in the shared table's terms (plain values, known dests only)."""
    out = {}
    for key, value in stored.items():
        dest = M.CHECKPOINT_ALIASES.get(key, key)
        if (dest in M.ARGS or dest == CARRIED_ROPE_SCALING) and value is not None:
            out[dest] = to_plain(value)
    return out


def check_args(stored: dict | None, where) -> None:
    """One line for a stored args value that is not what Megatron's parser makes of its flag (a number that
    is a string, a 5,000-digit integer, a list where a number belongs): never a traceback further on."""
    for key, value in (stored or {}).items():
        kind = MODEL_NUMBERS.get(M.CHECKPOINT_ALIASES.get(key, key))
        if kind is None or value is None:
            continue
        if kind == M.INT:
            ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2 ** 63
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            if isinstance(value, int) and value.bit_length() > 64:  # repr() of a huge int is itself refused
                shown = f"an integer of {value.bit_length()} bits"
            else:
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise InteropError(f"{where}: args.{key} is {shown}, not {'an integer' if kind == M.INT else 'a number'}")


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
