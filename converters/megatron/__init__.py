"""Megatron-LM checkpoints <-> canonical tensors: one `megatron` format, two on-disk layouts.

- `torch` (rank files `iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt`): `torch_format.py`
- `torch_dist` (PyTorch DCP + `common.pt` + `metadata.json`): `torch_dist.py`

The Reader picks by what is on disk; the Writer by its `format` option (`--format`, default
torch); the classes they give subclass the contract's bases (`interop.contract`) directly.  What
both share: the name rows (`rows.py`), the stored args (`args.py`; their meaning as a ModelSpec is
`mappings/megatron_spec.py`) and the tracker / iteration folders (`checkpoint.py`).
"""
from __future__ import annotations

from pathlib import Path

from ...contract import BaseReader, BaseWriter
from ...errors import InteropError
from ...layout import ParallelLayout
from . import lora, mindspeed_llm, torch_format
from .args import padded_vocab as _padded_vocab
from .checkpoint import TRACKER, has_rank_dirs, is_dist_dir, iteration_dir

FORMATS = ("torch", "torch_dist")


def _torch_dist():
    """The torch_dist module, imported when a torch_dist checkpoint is read or written."""
    from . import torch_dist

    return torch_dist


def detect(path) -> bool:
    """A Megatron save or iteration folder.  Rank folders of MindSpore `.ckpt` files are not one (interop's
    earlier MindSpore layout borrowed Megatron's folder names): each format claims only its own files."""
    root = Path(path)
    if not (root.is_dir() and ((root / TRACKER).is_file() or has_rank_dirs(root) or is_dist_dir(root))):
        return False
    return not (any(root.glob("mp_rank_*/*.ckpt")) or any(root.glob("*/mp_rank_*/*.ckpt")))


def _is_torch_dist(path, iteration: int | None) -> bool:
    try:
        folder, _ = iteration_dir(path, iteration)
    except InteropError:
        return False
    return is_dist_dir(folder)


class Reader(BaseReader):
    """The format's reader: opening one gives the reader of the layout on disk, a `torch_dist.Reader` for a
    DCP iteration directory, a `torch_format.Reader` otherwise (each subclasses `BaseReader` itself)."""

    options = ("iteration", "model_config", "vocab_size", "allow_identical_ranks")

    def __new__(cls, path, iteration: int | None = None, model_config=None, vocab_size: int | None = None,
                allow_identical_ranks: bool | None = None):
        if _is_torch_dist(path, iteration):  # global tensors: no rank folders to compare
            try:
                return _torch_dist().Reader(path, iteration=iteration, model_config=model_config, vocab_size=vocab_size)
            except InteropError:  # a Megatron-Bridge LoRA adapter (`.adapter.linear_in` / `linear_out` only)?
                from . import lora_dist
                if not lora_dist.holds_adapter(iteration_dir(path, iteration)[0]):
                    raise
            return lora_dist.Reader(path, iteration=iteration, model_config=model_config, vocab_size=vocab_size)
        try:
            return torch_format.Reader(path, iteration=iteration, model_config=model_config, vocab_size=vocab_size,
                                       allow_identical_ranks=bool(allow_identical_ranks))
        except InteropError:  # a LoRA adapter's rank files (no embedding, no base weights) are not a model's
            if not lora.holds_adapter(path, iteration):
                raise
        return lora.Reader(path, iteration=iteration, model_config=model_config, vocab_size=vocab_size)


class Writer(BaseWriter):
    """The format's writer: opening one gives the writer of the `format` asked for (`--format`, default
    torch), a `torch_format.Writer` or a `torch_dist.Writer` (each subclasses `BaseWriter` itself)."""

    options = ("format", "iteration", "distributed_optimizer", "dp", "transformer_impl", "fork", "noop_layers",
               "mla_mm_split")
    splits = True
    holds_moe = True  # routed experts, router and shared experts, at any --ep (torch: EP rank folders)
    holds_adapter = True  # LoRA adapters: MindSpeed-LLM's (torch format, `lora.Writer`), Megatron-Bridge's
    # (torch_dist, `lora_dist.Writer`)
    padded_vocab = staticmethod(_padded_vocab)
    # megatron-core 0.16.1 dist_checkpointing/serialization.py `load`: force_all_tensors_to_non_fp8 dequantises
    # the model's FP8 parameters before reading, so a checkpoint holds FP8-trained weights in high precision
    no_fp8 = ("holds FP8-trained weights in high precision (megatron-core's load dequantises its FP8 parameters "
              "before reading a checkpoint into them): convert with --dtype bf16")

    @staticmethod
    def build_layout(num_layers: int, sizes: dict, options: dict) -> ParallelLayout:
        """MindSpeed-LLM's layout places its --noop-layers among the layers; megatron-core has none."""
        if options.get("fork") == "mindspeed-llm":
            return mindspeed_llm.Writer.build_layout(num_layers, sizes, options)
        if options.get("noop_layers") is not None:
            raise InteropError("--noop-layers is MindSpeed-LLM's (identity layers megatron-core does not build): "
                               "write it with --fork mindspeed-llm")
        return ParallelLayout.build(num_layers, **sizes)

    def __new__(cls, root, spec, layout, metas, format: str | None = None, iteration: int | None = None,
                distributed_optimizer: bool | None = None, dp: int | None = None, transformer_impl: str | None = None,
                fork: str | None = None, noop_layers: str | None = None, mla_mm_split: bool | None = None, only=None,
                adapter=None):
        if adapter is not None:
            if distributed_optimizer or dp is not None:
                raise InteropError("Megatron LoRA adapters are written without optimizer options: leave out "
                                   "--distributed-optimizer and --dp")
            if format == "torch_dist":  # Megatron-Bridge's PEFT names
                from . import lora_dist
                return lora_dist.Writer(root, spec, layout, metas, adapter, iteration)
            return lora.Writer(root, spec, layout, metas, adapter, iteration)
        if (format or "torch") not in FORMATS:
            raise InteropError(f"--format {format} is not a Megatron format (known: {', '.join(FORMATS)})")
        if dp is not None and (format == "torch_dist" or not distributed_optimizer):
            raise InteropError("--dp applies to Megatron output only with --distributed-optimizer --format torch "
                               "(distrib_optim.pt is laid out for one dp; torch_dist loads at any dp)")
        if fork == "mindspeed-llm":  # MindSpeed-LLM's own converter's layout: the torch format, local spec
            given = [flag for flag, value in (("--format torch_dist", format == "torch_dist"),
                                              ("--transformer-impl", transformer_impl), ("--distributed-optimizer",
                                              distributed_optimizer), ("--dp", dp is not None)) if value]
            if given:
                raise InteropError(f"--fork mindspeed-llm writes MindSpeed-LLM's torch rank files as its converter "
                                   f"does (local spec, no distrib_optim.pt): leave out {given[0]}")
            return mindspeed_llm.Writer(root, spec, layout, metas, iteration=iteration, noop_layers=noop_layers,
                                        mla_mm_split=mla_mm_split, only=only)
        if mla_mm_split:
            raise InteropError("--mla-mm-split is MindSpeed-LLM's layout (megatron-core stores the up projections "
                               "whole): write it with --fork mindspeed-llm")
        if format == "torch_dist":
            return _torch_dist().Writer(root, spec, layout, metas, iteration=iteration,
                                        distributed_optimizer=distributed_optimizer, transformer_impl=transformer_impl,
                                        only=only)
        return torch_format.Writer(root, spec, layout, metas, iteration=iteration,
                                   distributed_optimizer=distributed_optimizer, dp=dp,
                                   transformer_impl=transformer_impl, only=only)
