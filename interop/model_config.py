"""--model-config: the model description for a checkpoint that carries none.

Any file map-args reads (HF config.json, a Megatron args file or launch script, MindSpeed /
MindFormers YAML) becomes completed Megatron args here, in core, so that a converter asks for
the description without knowing the map-args engine that parses it.
"""
from __future__ import annotations

from .io.small_files import read_json_object, require_small_file
from .mappings import megatron_args


def megatron_args_from_file(path) -> dict:
    """Completed Megatron args (`megatron_args.complete`) from a model description file."""
    from . import mapargs  # the loaders of every config format (no torch)
    path = require_small_file(path, "model config")  # not /dev/zero, a FIFO, a directory or a huge file
    if path.suffix.lower() == ".json":
        read_json_object(path, "model config")  # one line for bad JSON (too deep, a 5,000-digit number), not a traceback
    return megatron_args.complete(mapargs.load(path).explicit)


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
    full = megatron_args_from_file(path)
    full.update(vocab_size=full.get("vocab_size") or full.get("padded_vocab_size"))
    return spec_from_args(full, str(path), dtype)
