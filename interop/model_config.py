"""--model-config: the model description for a checkpoint that carries none.

Any file map-args reads (HF config.json, a Megatron args file or launch script, MindSpeed /
MindFormers YAML) becomes completed Megatron args here, in core, so that a converter asks for
the description without knowing the map-args engine that parses it.
"""
from __future__ import annotations

from .io.small_files import read_json_object, require_small_file
from .mappings import megatron_args


def megatron_args_from_file(path) -> dict:
    """Completed Megatron args (`megatron_args.complete`) from a model description file.

    Its vocabulary is the true one (`vocab_size`; a file that names only `padded_vocab_size`, as a
    MindSpeed YAML's `model_config.vocab_size` maps, gives that): the padded rows are the checkpoint's
    fact, so `padded_vocab_size` stays only where the file states it beside `vocab_size`, else None."""
    from . import mapargs  # the loaders of every config format (no torch)
    path = require_small_file(path, "model config")  # not /dev/zero, a FIFO, a directory or a huge file
    if path.suffix.lower() == ".json":
        read_json_object(path, "model config")  # one line for bad JSON (too deep, a 5,000-digit number), not a traceback
    explicit = mapargs.load(path).explicit
    full = megatron_args.complete(explicit)
    stated = explicit.get("padded_vocab_size") if explicit.get("vocab_size") else None
    return {**full, "vocab_size": explicit.get("vocab_size") or explicit.get("padded_vocab_size"),
            "padded_vocab_size": stated}


def spec_from_file(path, dtype: str):
    """The ModelSpec of a --model-config file for a checkpoint whose tensors carry HF names: an HF
    config.json is read as transformers reads it (its vocab_size is the true vocabulary); any other
    description through completed Megatron args."""
    from .mappings.hf_config import spec_from_hf_config
    from .mappings.megatron_spec import spec_from_args
    path = require_small_file(path, "model config")
    if path.suffix.lower() == ".json":
        config = read_json_object(path, "model config")
        if "model_type" in config or "architectures" in config:
            return spec_from_hf_config(config, dtype, where=str(path))
    return spec_from_args(megatron_args_from_file(path), str(path), dtype)
