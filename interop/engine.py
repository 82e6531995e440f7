"""The conversion engine: any reader -> canonical tensors -> any writer, one tensor (or one fused row) at a time.

Peak memory is one global tensor or fused row (plus the reader's and writer's view of it, and up
to `io.background.LIMIT` bytes still being written on the helper thread), never the model.
Resharding is the same operation: the writer cuts each global tensor into the target
layout's shards.  A row that both sides store with an equal transform (a grouped QKV, a gated
fc1) moves whole, re-sliced, never split and rebuilt (`fused_plan`; ARCHITECTURE.md, "Rows").

It speaks to readers and writers only through the contract (`interop.contract`: it calls methods,
never asks what an object has).  `interop.convert` drives it in this process; `interop.workers`
runs one `Task` per process, each over a part of the writer's units (`split_units`).  It imports
neither.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from . import memory
from .contract import BaseReader, BaseWriter
from .errors import InteropError
from .layout import ParallelLayout
from .adapter import tensor_index
from .params import base_param_name
from .spec import ModelSpec
from .tensors import TensorMeta


@dataclass(frozen=True)
class Task:
    """One process's share of a conversion: what it needs to open the source and its part of the target.

    Picklable (classes travel by name, never a tensor).  A `--workers` worker is one (`part`: its number,
    `only`: its units); a rank of a distributed conversion can be one the same way (`part`: its rank,
    `only`: `split_units(units, world)[rank]`)."""

    src: str
    reader_cls: type
    writer_cls: type
    reader_options: dict
    writer_options: dict
    dst: str
    spec: ModelSpec
    layout: ParallelLayout
    metas_in: tuple
    metas_out: tuple
    true_vocab: int
    part: int = 0
    only: frozenset | None = None

    def for_part(self, part: int, only: frozenset) -> "Task":
        return replace(self, part=part, only=only)

    def open_reader(self) -> BaseReader:
        """The source, reopened without the checks the first process made (`options_for_worker`)."""
        return self.reader_cls(self.src, **self.reader_cls.options_for_worker(dict(self.reader_options)))

    def index(self) -> dict:
        """The target's parameters by name: the model's, or a LoRA adapter's (`interop.adapter`)."""
        return tensor_index(self.spec, self.writer_options.get("adapter"))

    def open_writer(self) -> BaseWriter:
        return self.writer_cls(self.dst, self.spec, self.layout, list(self.metas_out), **self.writer_options,
                               only=self.only)


def split_units(units: list, n: int) -> list[frozenset]:
    """n runs of consecutive units, as even as can be: writers list their units stage by stage (layer by
    layer), so a part's units share their source tensors and each source tensor is read by few parts."""
    cuts = [len(units) * w // n for w in range(n + 1)]
    return [frozenset(units[cuts[w]:cuts[w + 1]]) for w in range(n)]


def fit_vocab(tensor: torch.Tensor, rows: int, true_vocab: int, name: str, notes: list[str]) -> torch.Tensor:
    """Pad with zero rows, or drop padding rows (reported when they held anything), to `rows`."""
    have = tensor.shape[0]
    if have < rows:
        pad = torch.zeros((rows - have, *tensor.shape[1:]), dtype=tensor.dtype)
        return torch.cat([tensor, pad])
    if have > rows:
        if rows < true_vocab:
            raise InteropError(f"cannot fit {name} into {rows} rows: the vocabulary has {true_vocab} tokens")
        if tensor[rows:].any():
            notes.append(f"dropped {have - rows} padding rows of {name} (beyond the true vocab of {true_vocab})")
        return tensor[:rows]
    return tensor


@contextlib.contextmanager
def one_torch_thread():
    """Conversion copies are memory-bound: torch's thread pool only adds spinning, which on a busy
    2-core machine made strided copies 50x slower (measured).  The CRC thread has the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _passed_through(reader, writer, m_in: TensorMeta, m_out: TensorMeta) -> bool:
    """Bytes that need no change go from file to file in the kernel (copy_file_range), when the reader can
    name them as file ranges and the writer stores them as they are."""
    if m_in.dtype != m_out.dtype or m_in.shape != m_out.shape:
        return False
    ranges = reader.byte_ranges(m_in.name)
    if ranges is None or not writer.write_ranges(m_out.name, ranges):
        return False
    reader.copied(m_in.name)  # what a read would have checked (a CRC-32), checked in the background
    return True


def _read_padded(reader, m_in: TensorMeta, m_out: TensorMeta) -> torch.Tensor | None:
    """A vocab tensor that the target pads, read straight into its padded buffer when the reader can
    (`read_into`): padding by concatenation would hold the model's largest tensor twice.  None otherwise."""
    if m_out.shape[0] <= m_in.shape[0] or m_in.dtype != m_out.dtype:
        return None
    out = memory.empty(m_out.shape, m_out.dtype)
    if not reader.read_into(m_in.name, out[:m_in.shape[0]]):
        return None
    out[m_in.shape[0]:].zero_()
    return out


def fused_plan(reader, writer, metas_in, metas_out) -> dict[int, tuple]:
    """The fused rows that move whole: {index of the row's last tensor: (transform, names, indices)}.

    A row moves whole when the reader serves it fused (`reader.fused_row(name)` -> (transform, names))
    and the writer stores the same names fused by an equal transform (`writer.accepts_fused(names,
    transform)`): then the stored tensor is only re-sliced for the target's TP ranks
    (`Transform.rank_from_fused`), never split into canonical tensors and fused again.  The row moves at
    its last tensor's place, where the per-tensor path would have completed it (so files get their tensors
    in the same order).  Rows that change shape (vocab padding) or mix dtypes take the per-tensor path."""
    position = {m.name: i for i, m in enumerate(metas_in)}
    plan, placed = {}, set()
    for i, m in enumerate(metas_in):
        if i in placed:
            continue
        found = reader.fused_row(m.name)
        if found is None:
            continue
        transform, names = found
        indices = [position.get(n) for n in names]
        if (len(names) < 2 or None in indices or transform.fused_rows() is None
                or len({metas_in[k].dtype for k in indices}) > 1 or len({metas_out[k].dtype for k in indices}) > 1
                or any(metas_in[k].shape != metas_out[k].shape for k in indices)
                or not writer.accepts_fused(names, transform)):
            continue
        plan[max(indices)] = (transform, names, indices)
        placed.update(indices)
    return plan


def _move_fused(reader, writer, transform, names: list[str], dtype, src) -> None:
    """One fused row from reader to writer as its whole stored tensor (cast to `dtype`)."""
    tensor = reader.read_fused(names[0])
    if tuple(tensor.shape) != transform.rank_shape():
        raise InteropError(f"{src}: the tensor holding {names[0]} has shape {list(tensor.shape)}, "
                           f"expected {list(transform.rank_shape())}")
    writer.write_fused(names, tensor.to(dtype))


def stream(reader, writer, metas_in, metas_out, index: dict, true_vocab: int, src, notes: list[str], progress=None,
           wants=None) -> tuple[int, int]:
    """Read each source tensor, fit and cast it, hand it to the writer; returns (tensors, bytes) written.
    A fused row both sides store alike moves whole (`fused_plan`).
    `wants(name)`, when given, says which tensors the writer needs (a worker's share): the others are
    not read.  `progress.update(n)` gets every tensor's source bytes, read or not."""
    tensors = nbytes = 0
    plan = fused_plan(reader, writer, metas_in, metas_out)
    in_plan = {k for _, _, indices in plan.values() for k in indices}
    for i, (m_in, m_out) in enumerate(zip(metas_in, metas_out)):
        if wants is None or wants(m_out.name):
            if i in plan:
                transform, names, _ = plan[i]
                _move_fused(reader, writer, transform, names, m_out.dtype, src)
            elif i in in_plan:
                pass  # moves with its row, at the row's last tensor
            elif not _passed_through(reader, writer, m_in, m_out):
                vocab = index[base_param_name(m_in.name)].split == "vocab"
                tensor = _read_padded(reader, m_in, m_out) if vocab else None
                if tensor is None:
                    tensor = reader.read(m_in.name)
                    if tuple(tensor.shape) != m_in.shape:
                        raise InteropError(f"{src}: {m_in.name} has shape {list(tensor.shape)}, "
                                           f"expected {list(m_in.shape)}")
                    if vocab:
                        tensor = fit_vocab(tensor, m_out.shape[0], true_vocab, m_in.name, notes)
                writer.write(m_out.name, tensor.to(m_out.dtype))
            tensors += 1
            nbytes += m_out.nbytes
        if progress:
            progress.update(m_in.nbytes)
    return tensors, nbytes


def write_units(reader, writer, task: Task, notes: list[str], progress=None) -> dict:
    """One process's share of a split conversion (a `--workers` worker, a torchrun rank): stream the tensors the
    writer's units want, confirm the source, finish the units' files; the writer is aborted on any failure.
    Returns the units' results, which the describing files need (`BaseWriter.finish_global`)."""
    try:
        stream(reader, writer, task.metas_in, task.metas_out, task.index(), task.true_vocab, task.src,
               notes, progress, wants=writer.wants)
        reader.confirm()
        return writer.finish_units(reader.source.state)
    except BaseException:
        writer.abort()
        raise
