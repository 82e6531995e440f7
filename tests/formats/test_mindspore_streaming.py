"""MindSpore -> HF streams: the `.ckpt` index reads headers only, tensors go to the target once, memory stays at
a layer plus the largest tensor, and `--workers 2` writes the bytes one worker writes.

Measured at 7B (tp8/pp4 MindSpeed folders -> HF, README benchmark section) before this: peak RSS 0.17 of the
model with one worker, and 1.6 GB in a `--workers` parent that reads no tensor.  Two causes: the index was
built over an mmap of each rank file, so every header touched kept its pages (and the pages around it)
mapped in every process that opened the checkpoint; and a tensor was gathered from its tp shards by reading
each shard into its own buffer and concatenating (the largest tensor twice).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import interop.workers as parallel
from interop.convert import convert
from interop.io import ms_ckpt
from interop.io.ms_ckpt import CkptFile, save_ckpt
from interop.io.safetensors import SafetensorsWriter

from helpers.same_output import assert_same_output


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(os.fspath(path)) for line in f)


def test_indexing_maps_nothing_and_reads_only_the_headers(tmp_path, monkeypatch):
    tensors = {f"layers.{i}.w": torch.full((1024, 1024), float(i)) for i in range(8)}  # 4 MiB each
    tensors["step_num"] = torch.tensor(7)
    path = tmp_path / "rank.ckpt"
    size = save_ckpt(path, tensors)
    read = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, pos: read.append(n) or real(fd, n, pos))
    with CkptFile(path, verify=False) as f:
        assert f.meta("layers.3.w") == (torch.float32, (1024, 1024))
        assert not _mapped(path)  # an mmap'd index keeps every header's pages in the process's RSS
        assert sum(read) < size / 100  # a window at each Value's start, none of the tensors between
        indexed = sum(read)
        assert torch.equal(f.read("layers.3.w"), tensors["layers.3.w"])
        assert not _mapped(path)  # reads are preads into the caller's memory
        assert sum(read) == indexed  # (preadv: the tensor's own bytes, not counted here)


def test_read_into_and_byte_ranges_follow_the_chunks(tmp_path):
    """A tensor cut into several Values (mindspore's 512 MiB slices, here 1000 bytes) reads into targets whose
    boundaries fall inside chunks, and its byte ranges name exactly its content."""
    w = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "x.ckpt"
    save_ckpt(path, {"w": w}, slice_bytes=1000)
    with CkptFile(path) as f:
        assert len(f.entry("w").chunks) == 4
        a, b = torch.empty(333), torch.empty(667)
        f.read_into("w", [a.numpy(), b.numpy()])
        assert torch.equal(torch.cat([a, b]), w)
        ranges = f.byte_ranges("w", 1200, 2900)
        with open(path, "rb") as raw:
            got = b"".join(os.pread(raw.fileno(), n, offset) for offset, n in ranges)
        assert got == w.numpy().tobytes()[1200:2900]
        with pytest.raises(ValueError):
            f.read_into("w", [torch.empty(999).numpy()])


H, FFN, HEADS, VOCAB, LAYERS, TP = 1024, 2816, 8, 32000, 2, 4


def _write_hf(path: Path) -> dict[str, torch.Tensor]:
    """A Llama whose vocab rows are the largest tensor by far (64 MiB bf16; a layer ~24 MiB)."""
    path.mkdir()
    entries = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        entries += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (H, H)),
                    (p + "self_attn.k_proj.weight", (H, H)), (p + "self_attn.v_proj.weight", (H, H)),
                    (p + "self_attn.o_proj.weight", (H, H)), (p + "post_attention_layernorm.weight", (H,)),
                    (p + "mlp.gate_proj.weight", (FFN, H)), (p + "mlp.up_proj.weight", (FFN, H)),
                    (p + "mlp.down_proj.weight", (H, FFN))]
    entries += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    writer = SafetensorsWriter(path / "model.safetensors", [(k, torch.bfloat16, s) for k, s in entries],
                               {"format": "pt"})
    gen, out = torch.Generator().manual_seed(0), {}
    for key, shape in entries:
        out[key] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        writer.write(key, out[key])
    writer.close()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    return out


@pytest.fixture(scope="module")
def mindspeed(tmp_path_factory):
    """MindSpeed rank folders (tp4, so that each vocab tensor is gathered from four files), and the source."""
    root = tmp_path_factory.mktemp("ms_stream")
    tensors = _write_hf(root / "hf")
    convert(root / "hf", root / "ms", dst_format="mindspore", tp=TP, pp=1)
    return root, tensors


CHILD = """
import json, sys
import interop.workers
from interop.convert import convert

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

args = json.loads(sys.argv[1])
interop.workers.MIN_BYTES_PER_WORKER = 1
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current RSS
convert(args["src"], args["dst"], dst_format="hf", workers=args["workers"], max_shard_size=args["shard"])
workers = [peak - start for peak, start in zip(interop.workers.last_peak_rss, interop.workers.last_start_rss)]
print(json.dumps({"added": status("VmHWM") - base, "workers": workers}))
"""


def _measured(src: Path, dst: Path, workers: int, shard: str = "5GB") -> dict:
    """Peak RSS the conversion adds in a fresh interpreter (torch and interop imported before the baseline), and
    with workers what each adds over its RSS as it began."""
    args = json.dumps({"src": str(src), "dst": str(dst), "workers": workers, "shard": shard})
    out = subprocess.run([sys.executable, "-c", CHILD, args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_a_layer_plus_the_largest_tensor(mindspeed, tmp_path):
    """One process: the conversion adds at most the largest tensor plus one layer to the RSS.  Before, the vocab
    rows alone took twice their size (four shards read, then concatenated), plus the mapped headers."""
    root, tensors = mindspeed
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    layer = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("model.layers.0."))
    got = _measured(root / "ms", tmp_path / "hf", workers=1)
    assert got["added"] <= largest + layer, (got["added"] / 2**20, largest / 2**20, layer / 2**20)
    from safetensors.torch import load_file
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.keys() == tensors.keys()
    for key, t in tensors.items():
        assert torch.equal(out[key], t), key


def test_two_workers_write_the_same_bytes_and_the_parent_reads_no_tensor(mindspeed, tmp_path, monkeypatch):
    root, tensors = mindspeed
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)
    one = convert(root / "ms", tmp_path / "one", dst_format="hf", workers=1, max_shard_size="40MB")
    read = []  # what this process (the workers' parent) reads; the workers are other processes
    real = ms_ckpt.CkptFile.read_into
    monkeypatch.setattr(ms_ckpt.CkptFile, "read_into",
                        lambda self, tag, targets: read.append((tag, self.entry(tag).nbytes)) or real(self, tag, targets))
    started = []
    real_run = parallel.run
    monkeypatch.setattr(parallel, "run", lambda tasks, *a, **k: started.append(len(tasks)) or real_run(tasks, *a, **k))
    two = convert(root / "ms", tmp_path / "two", dst_format="hf", workers=2, max_shard_size="40MB")
    assert started == [2]
    assert_same_output(tmp_path / "one", tmp_path / "two")
    assert (one.tensors, one.bytes, one.notes) == (two.tensors, two.bytes, two.notes)
    assert sum(n for _, n in read) <= 64, read  # the training-state scalars only
    from safetensors.torch import load_file
    out = {}
    for f in sorted((tmp_path / "two").glob("*.safetensors")):
        out.update(load_file(f))
    assert out.keys() == tensors.keys() and all(torch.equal(out[k], t) for k, t in tensors.items())


def test_each_worker_and_the_parent_stay_bounded(mindspeed, tmp_path):
    """With two workers: the parent (which only indexes) adds next to nothing; each worker holds at most a
    layer plus the largest tensor over its RSS as it began.  Before, each worker (which reads either
    the embedding or the output layer) held that tensor twice."""
    root, tensors = mindspeed
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    layer = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("model.layers.0."))
    got = _measured(root / "ms", tmp_path / "hf", workers=2, shard="40MB")
    assert len(got["workers"]) == 2
    assert got["added"] <= 16 << 20, got["added"] / 2**20
    for added in got["workers"]:
        assert 0 < added <= largest + layer, (added / 2**20, largest / 2**20, layer / 2**20)


def test_workers_do_not_check_the_crc_again(mindspeed, tmp_path, monkeypatch):
    """Rank files with mindspore's crc trailer (`save_checkpoint(crc_check=True)`): the parent checks every
    file's crc32 as it opens them (one read of every byte); the workers open the source with `verify=False`
    and read only what they convert.  Shown with trailers that are wrong: this process's check is told to
    pass them, and a worker that checked again (in its own process, unpatched) would refuse them."""
    import shutil

    from interop.converters.mindspore.reader import Reader
    from interop.errors import InteropError
    from interop.io.ms_ckpt import CRC_MAGIC, load_ckpt
    root, tensors = mindspeed
    src = tmp_path / "crc"
    shutil.copytree(root / "ms", src)
    for f in src.glob("rank_*/*.ckpt"):
        save_ckpt(f, load_ckpt(f), crc=True)
        with open(f, "r+b") as raw:  # a wrong crc in the trailer
            raw.seek(-1, os.SEEK_END)
            last = raw.read(1)
            raw.seek(-1, os.SEEK_END)
            raw.write(bytes([last[0] ^ 1]))
    with pytest.raises(InteropError, match="crc check failed"):
        Reader(src)
    Reader(src, verify=False).close()  # no crc read at all
    checked = []
    monkeypatch.setattr(ms_ckpt, "_crc32_range", lambda fd, a, b: checked.append(b - a) or
                        int.from_bytes(os.pread(fd, 10, b + len(CRC_MAGIC)), "big"))
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)
    convert(src, tmp_path / "two", dst_format="hf", workers=2, max_shard_size="40MB")
    assert len(checked) == TP  # the parent checked each rank file once
    convert(root / "ms", tmp_path / "plain", dst_format="hf", workers=1, max_shard_size="40MB")
    assert_same_output(tmp_path / "plain", tmp_path / "two")
