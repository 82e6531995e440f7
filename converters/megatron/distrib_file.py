"""Writes `distrib_optim.pt`, the distributed optimizer's state in the torch format, per (tp, pp) rank.

What megatron-core's `DistributedOptimizer.save_parameter_state` writes and `load_parameter_state` reads
(megatron/core/optimizer/distrib_optimizer.py, `get_parameter_state_dp_zero` /
`load_parameter_state_from_dp_zero`, the same in 0.12 .. 0.16):

    {"buckets_coalesced": True,
     chunk: {(param dtype, grad dtype): {"param": fp32 [n], "exp_avg": fp32 [n], "exp_avg_sq": fp32 [n],
                                         "numel_unpadded": n}}}

one entry per model chunk (its one grad buffer), n = the buffer's buckets without their end padding;
each parameter at its place in the buffer (`distrib.layout`, which depends on dp and the bucket size),
zeros between.  The load scatters each bucket over the dp ranks, so the file is only right for the dp
it is laid out for.

The rank pieces arrive one by one (any order) and go to a scratch file beside the rank file; `finish`
builds one chunk's world tensors at a time from it (the memory megatron-core itself needs to save it).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import InteropError
from ...io.torch_file import TorchFileWriter
from . import distrib
from .checkpoint import DISTRIB_OPTIM_FILE

SCRATCH = "distrib_optim.scratch"


def grad_dtype(param_dtype: torch.dtype, args: dict) -> torch.dtype:
    """The grad buffer's dtype megatron-core keys the state by: fp32 when gradients are reduced in fp32
    (Megatron-LM's `--accumulate-allreduce-grads-in-fp32`, which `--bf16` turns on unless
    `--grad-reduce-in-bf16`: megatron/training/arguments.py `validate_args`), else the param's."""
    if args.get("grad_reduce_in_bf16"):
        return param_dtype
    if param_dtype in (torch.float32, torch.bfloat16) or args.get("accumulate_allreduce_grads_in_fp32"):
        return torch.float32
    return param_dtype


class DistribOptimFile:
    """One rank's `distrib_optim.pt`: pieces in, the coalesced world tensors out."""

    def __init__(self, folder: Path, scratch: str = SCRATCH):
        self.folder = folder
        self.scratch = folder / scratch
        self.fd = os.open(self.scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0  # fp32 elements written to the scratch file
        self.where: dict[tuple, tuple[int, int]] = {}  # (megatron kind, chunk, key) -> (first element, numel)

    def add(self, kind: str, chunk: int, key: str, piece: torch.Tensor) -> None:
        """Keep `piece` (a rank's tensor of `key`) as the `kind` (param / exp_avg / exp_avg_sq) of `key`."""
        flat = piece.detach().reshape(-1).to(torch.float32).contiguous()
        os.pwrite(self.fd, flat.view(torch.uint8).numpy().tobytes(), self.size * 4)
        self.where[(kind, chunk, key)] = (self.size, flat.numel())
        self.size += flat.numel()

    def has(self, kind: str, chunk: int, key: str) -> bool:
        return (kind, chunk, key) in self.where

    def finish(self, chunks: list[list[tuple[str, int]]], dp: int, bucket_sizes: list[int | None],
               dtype_key: tuple) -> None:
        """Write the file: `chunks` lists each model chunk's (key, numel) in state-dict order."""
        out = TorchFileWriter(self.folder / DISTRIB_OPTIM_FILE)
        try:
            out.finish(self.build(out, chunks, dp, bucket_sizes, dtype_key))
        except BaseException:
            out.abort()
            raise

    def build(self, out: TorchFileWriter, chunks: list[list[tuple[str, int]]], dp: int,
              bucket_sizes: list[int | None], dtype_key: tuple) -> dict:
        """The file's object (its world tensors added to `out`), for `finish` or a chained optimizer's list."""
        stored = torch.from_file(str(self.scratch), shared=False, size=self.size, dtype=torch.float32) \
            if self.size else torch.empty(0)
        try:
            obj = {"buckets_coalesced": True}
            for v, params in enumerate(chunks):
                buffer = distrib.layout(params, dp, bucket_sizes[v])
                offsets = distrib.coalesced_offsets(buffer)
                total = sum(buffer.unpadded)
                entry = {}
                for kind in distrib.KINDS:
                    world = torch.zeros(total, dtype=torch.float32)
                    for key, numel in params:
                        if (kind, v, key) not in self.where:
                            raise InteropError(f"incomplete input: no {kind} for {key} (model chunk {v})")
                        first, n = self.where[(kind, v, key)]
                        assert n == numel, (key, n, numel)
                        world[offsets[key]:offsets[key] + n] = stored[first:first + n]
                    entry[kind] = out.add(world)
                entry["numel_unpadded"] = total
                obj[v] = {dtype_key: entry}
            return obj
        finally:
            del stored
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.scratch.unlink(missing_ok=True)
