"""`convert --workers N`: a conversion split over processes by target files writes what one process writes.

Each target is converted with one worker and with two (the size threshold lowered so that a tiny
model splits), and the outputs are compared file by file: byte for byte, except the two fields that
differ between any two runs even with one worker (torch.save's random `.data/serialization_id` record
in Megatron rank files; `.metadata`'s `storage_meta`, a fresh save id and the temporary folder's path),
which are compared as records / as DCP metadata instead.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch

import interop.workers as parallel
from interop.contract import BaseReader
from interop.engine import Task, split_units
from interop.convert import convert
from interop.errors import InteropError
from interop.io.megatron_dist import _MetadataUnpickler
from interop.io.safetensors import SafetensorsWriter

from helpers.hostile import assert_one_error, leftovers, run
from helpers.same_output import LAYERS, EXPERTS, _write_hf, assert_same_output







@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    _write_hf(root / "hf")
    _write_hf(root / "mixtral", experts=EXPERTS)
    convert(root / "hf", root / "megatron", dst_format="megatron", tp=2, pp=2)
    convert(root / "hf", root / "store", dst_format="interop", tp=2, pp=2)
    return root


@pytest.fixture
def split(monkeypatch):
    """Lower the threshold so that a tiny model splits; record how many workers each run started."""
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)
    started = []
    real = parallel.run

    def counting(tasks, *args, **kwargs):
        started.append(len(tasks))
        return real(tasks, *args, **kwargs)

    monkeypatch.setattr(parallel, "run", counting)
    return started










CASES = {  # target: (source, convert options, target files split over the workers)
    "megatron-torch-tp2pp2": ("hf", dict(dst_format="megatron", tp=2, pp=2), 4),
    "hf-sharded": ("megatron", dict(dst_format="hf", max_shard_size="40KB"), None),
    "mindspore-tp2pp2": ("hf", dict(dst_format="mindspore", tp=2, pp=2), 4),
    "torch_dist": ("hf", dict(dst_format="megatron", format="torch_dist"), LAYERS + 1),
    "interop-store-tp2pp2": ("hf", dict(dst_format="interop", tp=2, pp=2), 4),
    # mixture of experts: each (tp, pp) unit writes its expert-parallel ranks' files too
    "moe-megatron-torch-tp2pp2ep2": ("mixtral", dict(dst_format="megatron", tp=2, pp=2, ep=2), 4),
    "moe-torch_dist-ep2": ("mixtral", dict(dst_format="megatron", format="torch_dist", ep=2), LAYERS + 1),
    "moe-mindspore-tp2pp2ep2": ("mixtral", dict(dst_format="mindspore", tp=2, pp=2, ep=2), 4),
    "moe-interop-store-tp2ep2": ("mixtral", dict(dst_format="interop", tp=2, ep=2), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_write_the_same_bytes_as_one(sources, split, tmp_path, case):
    src, options, _ = CASES[case]
    one = convert(sources / src, tmp_path / "one", workers=1, **options)
    assert split == []
    seen = []
    two = convert(sources / src, tmp_path / "two", workers=2, progress=lambda done, total: seen.append((done, total)),
                  **options)
    assert split == [2]
    assert_same_output(tmp_path / "one", tmp_path / "two")
    assert (one.tensors, one.bytes, one.notes) == (two.tensors, two.bytes, two.notes)
    assert seen[-1][0] == seen[-1][1] > 0  # the progress reached the total, once for all workers
    assert leftovers(tmp_path / "two") == []


def test_megatron_output_from_workers_loads(sources, split, tmp_path):
    """What Megatron reads back: the canonical tensors of the source (our reader, at tp2/pp2 from workers)."""
    convert(sources / "hf", tmp_path / "meg", workers=2, dst_format="megatron", tp=2, pp=2)
    convert(tmp_path / "meg", tmp_path / "back", workers=1, dst_format="hf")
    from safetensors.torch import load_file
    x, y = load_file(sources / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_a_failing_worker_leaves_nothing_and_one_error_line(sources, split, tmp_path):
    """A store whose rank file no longer matches its CRC-32: each worker's reader finds it; the CLI prints one
    `error:` line, exit 2, and neither the destination nor a temporary sibling exists afterwards."""
    import shutil
    src = tmp_path / "store"
    shutil.copytree(sources / "store", src)
    victim = src / "model-tp01-pp01.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    dst = tmp_path / "out"
    assert_one_error(*run("convert", src, dst, "--to", "megatron", "--tp", "2", "--pp", "2", "--workers", "2"),
                     "model-tp01-pp01.safetensors")
    assert split == [2]
    assert not dst.exists() and leftovers(dst) == []


def test_small_jobs_and_single_files_stay_in_this_process(sources, monkeypatch, tmp_path):
    """Below MIN_BYTES_PER_WORKER of source per worker (the default threshold) and for a target of one file,
    no worker starts."""
    monkeypatch.setattr(parallel, "run", lambda *a, **k: pytest.fail("a worker started"))
    convert(sources / "hf", tmp_path / "a", workers=4, dst_format="megatron", tp=2, pp=2)  # 0.3 MB: too small
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)
    convert(sources / "megatron", tmp_path / "b", workers=4, dst_format="hf")  # one model.safetensors


def test_worker_count():
    gib = 1 << 30
    assert parallel.worker_count(None, 100, 8) == 1
    assert parallel.worker_count(8, 3 * gib, 8) == 3
    assert parallel.worker_count(8, 100 * gib, 5) == 5
    assert parallel.worker_count(2, 100 * gib, 5) == 2
    with pytest.raises(InteropError, match="--workers"):
        parallel.worker_count(0, gib, 2)
    assert split_units(list(range(5)), 2) == [frozenset({0, 1}), frozenset({2, 3, 4})]
    assert split_units(list(range(4)), 4) == [frozenset({u}) for u in range(4)]


# --- torch_dist without torch.distributed.checkpoint (its import costs 1.5-2 s) ---------------------------

def test_dcp_stand_ins_pickle_to_dcps_bytes_and_load_as_dcps_classes():
    """The light metadata classes are written under DCP's names, byte for byte what DCP's own classes
    pickle to (torch/distributed/checkpoint/metadata.py, filesystem.py); DCP's pickle.load builds its classes."""
    import io
    from torch.distributed.checkpoint import metadata as real
    from torch.distributed.checkpoint.filesystem import _StorageInfo as RealInfo
    from interop.io import dcp_metadata as ours

    def build(m, info):
        size = torch.Size([2, 3])
        entries = {"w": m.TensorStorageMetadata(m.TensorProperties(dtype=torch.bfloat16), size,
                                                [m.ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 3]))
                                                 for i in range(2)]),
                   "obj/shard_0_1": m.BytesStorageMetadata()}
        storage = {m.MetadataIndex("w", torch.Size([i, 0])): info(f"__{i + 1}_0.distcp", 0, 700) for i in range(2)}
        storage[m.MetadataIndex("obj/shard_0_1")] = info("__0_0.distcp", 64, 9)
        return m.Metadata(state_dict_metadata=entries, storage_data=storage,
                          storage_meta=m.StorageMeta(checkpoint_id="/ckpt", save_id="id"), version="1.0.0")

    buffer = io.BytesIO()
    ours.dump(build(ours, ours._StorageInfo), buffer)
    assert buffer.getvalue() == pickle.dumps(build(real, RealInfo))
    loaded = pickle.loads(buffer.getvalue())
    assert type(loaded) is real.Metadata and loaded == build(real, RealInfo)


def test_torch_dist_conversions_do_not_import_dcp(sources, tmp_path):
    import subprocess
    import sys
    code = ("import sys; from interop.convert import convert; "
            f"convert({str(sources / 'hf')!r}, {str(tmp_path / 'dist')!r}, dst_format='megatron', format='torch_dist'); "
            f"convert({str(tmp_path / 'dist')!r}, {str(tmp_path / 'hf')!r}, dst_format='hf'); "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


class _DiesAtOnce(BaseReader):
    """A reader whose worker is killed (as the kernel's OOM killer would) before it says anything."""

    metas = read = None  # never reached

    def __init__(self, *args, **kwargs):
        import os
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_an_error_naming_it():
    with pytest.raises(InteropError, match="worker 0 was killed by signal 9"):
        parallel.run([Task("unused", _DiesAtOnce, None, {}, {}, "unused", None, None, (), (), 0)])
