"""The contract between the conversion engine and every format: `BaseReader` and `BaseWriter`.

Each format's `Reader` and `Writer` subclass these.  What a format must do is abstract; every
optional capability has a documented default that does nothing (a reader that cannot name byte
ranges answers None, a writer that stores no fused row accepts none), so the engine calls
methods and never asks an object what it has.

The engine (`interop.engine`, driven by `interop.convert`) calls, in this order:

 1. `Reader.options` / `Writer.options`: the format keywords each constructor takes (routing of
    `--dialect`, `--tokenizer`, ...); `Writer.padded_vocab(spec, tp)` and `Writer.holds_moe`.
 2. `reader = Reader(path, **options)`: open and check the source; sets `reader.source`
    (ModelSpec, layout, training state, notes).
 3. `reader.metas()`: every canonical tensor's name, dtype and global shape, in reading order.
 4. `writer = Writer(root, spec, layout, metas, **options, only=None)`: lay out the target.
    Split over processes (`Writer.splits`): a planner with `only=frozenset()` names its `units`;
    each worker opens its own reader (`Reader.options_for_worker`) and a writer with `only=` its units.
 5. `writer.carry(reader.carried)`: what the source holds besides weights (False: not kept, noted).
 6. The fused-row plan: `reader.fused_row(name)` and `writer.accepts_fused(names, transform)`.
 7. For each tensor the writer `wants(name)`, one of:
    a. a planned row: `reader.read_fused(name)` -> `writer.write_fused(names, tensor)`;
    b. bytes as they are: `reader.byte_ranges(name)` -> `writer.write_ranges(name, ranges)`;
    c. a padded vocabulary: `reader.read_into(name, buffer)` -> `writer.write(name, tensor)`;
    d. otherwise `reader.read(name)` -> `writer.write(name, tensor)`.
 8. `reader.confirm()`: checks made in the background while reading (a store's checksums).
 9. `writer.finish(state)`; split: each worker's `writer.finish_units(state)` -> results, then the
    planner's `writer.finish_global(state, results)` (results merged over the workers).
10. `writer.notes`: what the writer could not write, and why.
11. On any error after 4: `writer.abort()`.  Always, after 2: `reader.close()`.
"""
from __future__ import annotations

import abc
from types import MappingProxyType

import torch

from .layout import ParallelLayout
from .spec import ModelSpec
from .tensors import Source, TensorMeta

NOTHING_CARRIED = MappingProxyType({})


class BaseReader(abc.ABC):
    """Reads one checkpoint as canonical tensors, one global tensor at a time."""

    options: tuple[str, ...] = ()  # the format keywords __init__ takes (`--model-config`, ...), besides `path`
    source: Source  # set by __init__: spec, layout, training state, notes
    carried = NOTHING_CARRIED  # {"files": {name: path}, "config": {key: value}} kept beside the weights
    reads_adapter = False  # a LoRA adapter's files without its base: __init__ then takes `base=` (the base's ModelSpec)

    @classmethod
    def named_base(cls, path) -> str | None:
        """An adapter's base model as the adapter names it, when that is a checkpoint here; None: not named."""
        return None

    @classmethod
    def options_for_worker(cls, options: dict) -> dict:
        """The options a conversion worker reopens the source with: the parent's reader already made the
        checks that read every byte, so a reader that can skip them says so here.  Default: the same."""
        return options

    @classmethod
    def options_for_rank(cls, options: dict, rank: int, ranks: int) -> dict:
        """The options rank `rank` of `ranks` in a distributed conversion opens the source with: a reader
        whose checks read every byte splits them over the ranks here, so that the source is read once in all,
        not once per rank.  Default: the same."""
        return options

    @abc.abstractmethod
    def metas(self) -> list[TensorMeta]:
        """Every canonical tensor (name, dtype, global shape), in the order the engine reads them."""

    @abc.abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The global canonical tensor `name`."""

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` (a view of the right shape) with `name`, without a copy in between; False: cannot."""
        return False

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """[(file, offset, length)] holding `name` as it is (row-major, its dtype); None: not so stored."""
        return None

    def copied(self, name: str) -> None:
        """The engine copied `byte_ranges(name)` file to file: check (in the background, reported by `confirm`)
        what reading them would have checked, e.g. a record's CRC-32.  Default: nothing to check."""

    def fused_row(self, name: str):
        """(transform, names) of the fused row that stores `name` (its parts in order); None: stored alone."""
        return None

    def read_fused(self, name: str) -> torch.Tensor:
        """The whole stored tensor of `name`'s fused row, as at tp 1 (`transform.fuse(parts)`'s layout).
        Called only for a name `fused_row` answered."""
        raise NotImplementedError(f"{type(self).__name__} serves no fused row")

    def native_name(self, name: str) -> str | None:
        """The name the checkpoint stores `name` under (with its part when fused); None: not known."""
        return None

    def confirm(self) -> None:
        """Raise if a check made while reading (e.g. checksums verified in the background) failed."""

    def close(self) -> None:
        """Release files and caches."""


class BaseWriter(abc.ABC):
    """Writes canonical tensors into one target checkpoint at a layout; finishes once all are in.

    `__init__(root, spec, layout, metas, **options, only=None)`: `only` is the set of `units` this
    writer writes (a worker's share; None: all; an empty set: the planner, which writes only the
    files describing the whole checkpoint, in `finish_global`)."""

    options: tuple[str, ...] = ()  # the format keywords __init__ takes (`--max-shard-size`, ...)
    holds_moe = False  # whether it can hold a mixture-of-experts model
    splits = False  # whether it takes `only=` and finishes in two halves (`--workers`)
    holds_adapter = False  # whether it can hold a LoRA adapter (`interop.adapter`): __init__ then takes `adapter=`
    units: tuple = ()  # the target files a conversion split over processes divides, stage by stage
    # why `--dtype fp8` (block-scaled weights) is refused, for a writer that does not take `quantize_to`
    no_fp8 = "cannot store block-scaled FP8 weights yet (hf can)"
    notes: tuple = ()  # what it could not write, and why (read after finishing; a list in most writers)

    @staticmethod
    @abc.abstractmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        """The embedding rows this target stores for `spec` at `tp`."""

    @staticmethod
    def build_layout(num_layers: int, sizes: dict, options: dict) -> ParallelLayout:
        """The layout this target stores `num_layers` layers in at `sizes` (`ParallelLayout.build`'s keywords),
        given its `options` (MindSpeed-LLM's --noop-layers place identity layers among the stages' layers)."""
        return ParallelLayout.build(num_layers, **sizes)

    @abc.abstractmethod
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Take the global canonical tensor `name` (already cast and vocab-fitted) and place its shards."""

    def wants(self, name: str) -> bool:
        """Whether this writer (its `only` units) needs `name`: the engine reads nothing else."""
        return True

    def write_ranges(self, name: str, ranges: list[tuple[str, int, int]]) -> bool:
        """Write `name` straight from the source's byte ranges; False: it must come through `write`."""
        return False

    def accepts_fused(self, names: list[str], transform) -> bool:
        """Whether it stores exactly `names` as one row with a transform equal to `transform`."""
        return False

    def write_fused(self, names: list[str], fused: torch.Tensor) -> None:
        """Take a whole fused row (`transform.fuse(parts)`'s layout); called only after `accepts_fused`."""
        raise NotImplementedError(f"{type(self).__name__} accepts no fused row")

    def carry(self, carried) -> bool:
        """Keep what the source holds besides weights (`BaseReader.carried`); False: this target cannot."""
        return False

    def finish(self, state: dict | None = None) -> None:
        """Write everything left (one process): its units' files, then the describing ones."""
        self.finish_global(state, self.finish_units(state))

    @abc.abstractmethod
    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's units' files; returns what the describing files need (sizes, checksums, ...)."""

    @abc.abstractmethod
    def finish_global(self, state: dict | None, results: dict) -> None:
        """The files describing the whole checkpoint, from every unit's `finish_units` results merged."""

    def abort(self) -> None:
        """Close and drop what was started; the engine deletes the temporary directory."""

