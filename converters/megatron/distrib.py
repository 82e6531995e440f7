"""The distributed optimizer's bucketed buffers <-> per-parameter tensors.

megatron-core's DDP lays every model chunk's parameters (of one dtype) out in one flat buffer
(megatron/core/distributed/param_and_grad_buffer.py, `_ParamAndGradBuffer.__init__`, the same rules
in 0.12 .. 0.16):

- parameters in REVERSE order of the chunk's `parameters()` (its state-dict order; each tp rank's buffer
  holds its own shards, each pipeline stage's its own layers).  The order is the layer spec's module order:
  the local spec's `input_layernorm` comes first in a layer, the Transformer Engine spec's norm is
  `linear_qkv.layer_norm_weight`, which TE's LayerNormLinear registers before its `weight`, after
  `linear_proj` (attention.py registers linear_proj before SelfAttention's linear_qkv); `module_order`
  orders either table's keys;
- with the distributed optimizer, each parameter starts at a multiple of 64 elements;
- a bucket closes after the parameter that brings it to `bucket_size` elements; its end is padded
  to a multiple of lcm(dp, 128); the next parameter starts there;
- `bucket_size` is None (one bucket) without `--overlap-grad-reduce`, on pipeline stages after the
  first, and for virtual chunks after the first; else `--ddp-bucket-size` or max(4e7, 1e6 * dp)
  (distributed_data_parallel.py).  A tied embedding on a pipeline of several stages gets a bucket
  of its own: not modelled here (refused by the caller).

The optimizer's fp32 master (`param`), `exp_avg` and `exp_avg_sq` live at the same offsets.  In
`distrib_optim.pt` (torch format, `get_parameter_state_dp_zero`, "buckets_coalesced") each buffer's
buckets are concatenated without their end padding; in torch_dist's `dp_reshardable` layout each
bucket is a tensor of its padded size.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

KINDS = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's -> interop's


class Slot(NamedTuple):
    bucket: int
    start: int  # within the bucket
    numel: int


class Buffer(NamedTuple):
    slots: dict  # parameter key -> Slot
    unpadded: list  # per bucket: elements up to the last parameter's end
    padded: list  # per bucket: elements with the end padding


def bucket_size(args: dict, stage: int, chunk: int) -> int | None:
    """The DDP bucket size megatron-core used for this pipeline stage's model chunk (None: one bucket)."""
    if not args.get("overlap_grad_reduce") or stage > 0 or chunk > 0:
        return None
    dp = int(args.get("data_parallel_size") or 1)
    return int(args.get("ddp_bucket_size") or max(40000000, 1000000 * dp))


def layout(params: list[tuple[str, int]], dp: int, size: int | None, high_busbw: bool = False) -> Buffer:
    """Where each (key, numel) of a chunk (in state-dict order) sits in the distributed optimizer's buffer.
    `high_busbw`: Megatron-LM's --ddp-pad-buckets-for-high-nccl-busbw, which pads bucket ends to lcm(dp, 128, 2**16)."""
    def pad(n: int, d: int) -> int:
        return int(math.ceil(n / d) * d)

    end_divisor = math.lcm(dp, 128, 2 ** 16) if high_busbw else math.lcm(dp, 128)

    slots, unpadded, padded = {}, [], []
    start = bucket_start = 0
    end = 0
    open_bucket = False
    for key, numel in reversed(params):
        start = pad(start, 64)
        end = start + numel
        slots[key] = Slot(len(unpadded), start - bucket_start, numel)
        open_bucket = True
        if size is not None and end - bucket_start >= size:
            unpadded.append(end - bucket_start)
            padded.append(pad(end, end_divisor) - bucket_start)
            bucket_start = start = bucket_start + padded[-1]
            open_bucket = False
        else:
            start = end
    if open_bucket:
        unpadded.append(end - bucket_start)
        padded.append(pad(end, end_divisor) - bucket_start)
    return Buffer(slots, unpadded, padded)


def coalesced_offsets(buffer: Buffer) -> dict[str, int]:
    """Each parameter's first element in a `distrib_optim.pt` world tensor (buckets without end padding)."""
    firsts = [sum(buffer.unpadded[:b]) for b in range(len(buffer.unpadded))]
    return {key: firsts[s.bucket] + s.start for key, s in buffer.slots.items()}


_LAYER = re.compile(r"(?:^|\.)(?<!mtp\.)layers\.(\d+)\.")  # a decoder layer; MTP modules follow the final norm


def module_order(keys: list[str]) -> list[str]:
    """megatron-core's local-spec parameter order (its state-dict order) for keys listed by kind
    (all layers' q/k/v, then all layers' fc1, ...): the embedding, then layer by layer, then the rest."""
    layers = [m and int(m.group(1)) for m in map(_LAYER.search, keys)]
    first = next((i for i, n in enumerate(layers) if n is not None), len(keys))
    return [k for _, _, k in sorted(((0 if i < first else 1 if n is not None else 2, n or 0, k)
                                     for i, (k, n) in enumerate(zip(keys, layers))), key=lambda x: x[:2])]


def chunk_starts(buffer: Buffer, bucket: int, dp: int) -> set[int]:
    """Where the DCP chunks of a `dp_reshardable` bucket tensor start: megatron-core saves each dp rank's piece of
    every parameter, and of every gap between them, as a chunk of its own (distrib_optimizer.py,
    `sharded_param_state_dp_reshardable`), so the parameters' first and end elements and the dp shards' edges,
    short of the bucket's unpadded end."""
    end, shard = buffer.unpadded[bucket], buffer.padded[bucket] // dp
    mine = [s for s in buffer.slots.values() if s.bucket == bucket]
    edges = {0} | {s.start for s in mine} | {s.start + s.numel for s in mine} | {r * shard for r in range(dp)}
    return {e for e in edges if e < end}
