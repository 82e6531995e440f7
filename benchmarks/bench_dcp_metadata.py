"""torch_dist `.metadata` at DeepSeek-V3 scale: write and read one with tens of thousands of chunks.

The chunks are laid out as interop's torch_dist writer lays out a stacked-experts checkpoint (per layer and
per expert, `[1, 1, ...]` chunks of `[layers, experts, ...]` tensors): `--layers 61 --experts 256` and two
stacked tensors per layer-expert give 31k chunks, with one storage entry each.

    .venv/bin/python benchmarks/bench_dcp_metadata.py --layers 61 --experts 256
"""
from __future__ import annotations

import argparse
import io
import pickle
import time
import uuid

import torch

from interop.io import dcp_metadata as dm
from interop.io.megatron_dist import _MetadataUnpickler


def build(layers: int, experts: int, hidden: int = 7168, ffn: int = 2048) -> dm.Metadata:
    entries, storage = {}, {}
    offset = 0
    for key, shape in ((f"decoder.layers.mlp.experts.experts.linear_fc1.weight", (2 * ffn, hidden)),
                       (f"decoder.layers.mlp.experts.experts.linear_fc2.weight", (hidden, ffn))):
        size = torch.Size([layers, experts, *shape])
        chunks = []
        for layer in range(layers):
            for e in range(experts):
                at = torch.Size([layer, e, 0, 0])
                chunks.append(dm.ChunkStorageMetadata(at, torch.Size([1, 1, *shape])))
                nbytes = 2 * shape[0] * shape[1]
                storage[dm.MetadataIndex(key, at)] = dm._StorageInfo(f"__{layer + 1}_0.distcp", offset, nbytes)
                offset += nbytes
        entries[key] = dm.TensorStorageMetadata(dm.TensorProperties(dtype=torch.bfloat16), size, chunks)
    return dm.Metadata(entries, None, storage, dm.StorageMeta(checkpoint_id="/x", save_id=str(uuid.uuid4())),
                       dm.CURRENT_DCP_VERSION)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    meta = build(args.layers, args.experts)
    chunks = sum(len(e.chunks) for e in meta.state_dict_metadata.values())
    buf = io.BytesIO()
    t = time.perf_counter()
    dm.dump(meta, buf)
    wrote = time.perf_counter() - t
    t = time.perf_counter()
    back = _MetadataUnpickler(io.BytesIO(buf.getvalue())).load()
    read = time.perf_counter() - t
    assert len(back.storage_data) == len(meta.storage_data)
    print(f"{chunks} chunks, {len(buf.getvalue()) / 1e6:.1f} MB: write {wrote:.2f} s, read {read:.2f} s")


if __name__ == "__main__":
    main()
