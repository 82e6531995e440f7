"""Exact: exit 0 means every output tensor is the input tensor; anything else is one `error:` line.

Damaged and hand-edited checkpoints (overlapping or missing shards and chunks, deflated
zip records, lying safetensors headers and tensor records, edited manifests) are either
read exactly or refused; `.pt` files interop writes carry CRC-32s that are checked.
"""
import errno
import json
import pickle
import shutil
import struct
import subprocess
import zipfile

import pytest
import torch

from helpers.hostile import assert_one_error, run
from interop.errors import InteropError
from interop.io.megatron_dist import DCP_METADATA, DistCheckpoint, _MetadataUnpickler
from interop.io.safetensors import SafetensorsFile
from interop.io.torch_file import LazyTorchFile, TensorRef, TorchFileWriter, _StorageRef
from interop.store import StoreReader




def tensors_of(store) -> dict:
    reader = StoreReader(store)
    try:
        return {m.name: reader.read(m.name).clone() for m in reader.metas()}
    finally:
        reader.close()


@pytest.fixture(scope="module")
def sources(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("exact-sources")
    hf = hf_checkpoints["llama"]
    for args in (("store", "--to", "interop", "--tp", "2", "--pp", "2"),
                 ("dist", "--to", "megatron", "--format", "torch_dist", "--tp", "2"),
                 ("torch", "--to", "megatron", "--tp", "2", "--pp", "2")):
        code, out = run("convert", hf, root / args[0], *args[1:])
        assert code == 0, out
    return {"store": root / "store", "dist": root / "dist", "torch": root / "torch", "hf": hf}


def copy(src, tmp_path, name="src"):
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def assert_exact(src, tmp_path):
    code, out = run("convert", src, tmp_path / "out", "--to", "interop")
    assert code == 0, out
    return tensors_of(tmp_path / "out")


# --- Megatron .pt: deflated records, CRCs, records that lie -----------------------------------------------

def _deflate(path):
    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in records:
            z.writestr(name, data)


def test_deflated_megatron_records_are_read_exactly(sources, tmp_path):
    src = copy(sources["torch"], tmp_path)
    files = sorted(src.rglob("model_optim_rng.pt"))
    for f in files:
        _deflate(f)
        with zipfile.ZipFile(f) as z:
            assert any(i.compress_type == zipfile.ZIP_DEFLATED and "/data/" in i.filename for i in z.infolist())
    got = assert_exact(src, tmp_path)
    code, out = run("convert", sources["torch"], tmp_path / "plain", "--to", "interop")
    assert code == 0, out
    expected = tensors_of(tmp_path / "plain")
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_written_pt_has_crcs_alignment_and_loads_with_mmap(sources):
    for f in sorted(sources["torch"].rglob("model_optim_rng.pt")):
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None
            infos = z.infolist()
            assert all(i.CRC != 0 for i in infos if i.file_size)
        raw = f.read_bytes()
        for i in infos:
            if "/data/" in i.filename:
                name_len, extra_len = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
                assert (i.header_offset + 30 + name_len + extra_len) % 64 == 0, i.filename
        torch.load(f, map_location="cpu", weights_only=False, mmap=True)
        if shutil.which("unzip"):
            result = subprocess.run(["unzip", "-t", str(f)], capture_output=True, text=True)
            assert result.returncode == 0 and "No errors detected" in result.stdout, result.stdout


def _largest_record(path):
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    return info, info.header_offset + 30 + name_len + extra_len


def test_flipped_byte_in_interop_written_pt_fails_crc(sources, tmp_path):
    src = copy(sources["torch"], tmp_path)
    f = sorted(src.rglob("model_optim_rng.pt"))[0]
    info, start = _largest_record(f)
    assert info.file_size > 4096  # read lazily, verified when read
    raw = bytearray(f.read_bytes())
    raw[start + info.file_size // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), "CRC-32")


def test_pt_tensor_past_its_storage_is_refused(tmp_path):
    """A `_rebuild_tensor_v2` whose size runs past the storage record, or a storage claiming more
    elements than its record holds: refused, never read from the next record's bytes."""
    for case in ("shape", "storage"):
        path = tmp_path / f"{case}.pt"
        w = TorchFileWriter(path)
        ref = w.add(torch.arange(4.0))
        w.add(torch.arange(100.0))
        if case == "shape":
            ref = TensorRef(ref.storage, (50,))
        else:
            ref = TensorRef(_StorageRef(ref.storage.key, torch.float32, 50), (50,))
        w.finish({"t": ref})
        with pytest.raises(InteropError, match="past the end|cannot load safely"):
            f = LazyTorchFile(path)
            f.read(f.obj["t"])


def test_pt_writer_full_disk_is_an_oserror(tmp_path, monkeypatch):
    """ENOSPC from a write: an OSError the caller can report, never an abort; abort() closes the file."""
    import interop.io.zipfile_writer as zw
    w = TorchFileWriter(tmp_path / "x.pt")
    w.add(torch.ones(4))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zw.os, "write", full)
    with pytest.raises(OSError) as info:
        w.add(torch.ones(4))
    assert info.value.errno == errno.ENOSPC
    w.abort()
    assert w._zip.fd is None


def test_pt_writer_zip64(tmp_path, monkeypatch):
    """Records and offsets past 4 GiB use zip64 fields (forced here by a small limit): torch and zipfile read them."""
    import interop.io.zipfile_writer as zw
    monkeypatch.setattr(zw, "_ZIP64_LIMIT", 16)
    w = TorchFileWriter(tmp_path / "x.pt")
    refs = [w.add(torch.arange(50.0)), w.add(torch.ones(3, dtype=torch.bfloat16))]
    w.finish({"a": refs[0], "b": refs[1]})
    with zipfile.ZipFile(tmp_path / "x.pt") as z:
        assert z.testzip() is None
    got = torch.load(tmp_path / "x.pt", weights_only=True, mmap=True)
    assert torch.equal(got["a"], torch.arange(50.0)) and torch.equal(got["b"], torch.ones(3, dtype=torch.bfloat16))
    f = LazyTorchFile(tmp_path / "x.pt")
    assert torch.equal(f.read(f.obj["a"]), torch.arange(50.0))


# --- the common format: coverage, integrity, schema --------------------------------------------------------

def _edit_manifest(src, edit):
    manifest = json.loads((src / "interop.json").read_text())
    edit(manifest)
    (src / "interop.json").write_text(json.dumps(manifest))


def _split_tensor(m):
    return next(t for t in m["tensors"].values() if len(t["shards"]) == 2 and t["shards"][0]["offset"][0] == 0
                and t["shards"][1]["offset"][0] > 0)


def _repeat(m):
    t = _split_tensor(m)
    t["shards"][1] = dict(t["shards"][0])


def _overlap(m):
    t = _split_tensor(m)
    t["shards"][1]["offset"][0] -= 1
    t["shards"][1]["shape"][0] += 1


def _uncovered(m):
    t = _split_tensor(m)
    t["shards"].pop()


def _extra_shard(m):
    t = _split_tensor(m)
    t["shards"].append(dict(t["shards"][0]))


@pytest.mark.parametrize("edit,words", [(_repeat, "also a shard"), (_overlap, "elements"), (_uncovered, "elements"),
                                        (_extra_shard, "also a shard")])
def test_store_shards_must_cover_exactly_once(sources, tmp_path, edit, words):
    src = copy(sources["store"], tmp_path)
    _edit_manifest(src, edit)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "interop.json", words)
    assert not (tmp_path / "out").exists()


def test_store_overlap_with_equal_count_is_refused(sources, tmp_path):
    """Two shards swapped onto the same rows while the element count still adds up."""
    src = copy(sources["store"], tmp_path)

    def edit(m):
        t = _split_tensor(m)
        t["shards"][1]["offset"][0] = 0  # both at rows 0..n/2, the second half uncovered
    _edit_manifest(src, edit)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "overlap")


def test_manifest_without_files_fails_verification(sources, tmp_path):
    src = copy(sources["store"], tmp_path)
    _edit_manifest(src, lambda m: m.pop("files"))
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "'files'")


def test_shard_file_not_listed_fails_verification(sources, tmp_path):
    src = copy(sources["store"], tmp_path)
    _edit_manifest(src, lambda m: m["files"].pop("model-tp01-pp01.safetensors"))
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "not listed under 'files'")


def test_manifest_missing_a_tensor_is_refused(sources, tmp_path):
    src = copy(sources["store"], tmp_path)
    _edit_manifest(src, lambda m: m["tensors"].pop("layers.3.mlp.up.weight"))
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), "layers.3.mlp.up.weight", "missing")
    assert not (tmp_path / "out").exists()


def _set(path, value):
    def edit(m):
        *keys, last = path
        for k in keys:
            m = m[k] if not isinstance(m, list) else m[int(k)]
        if value is _DELETE:
            del m[last]
        else:
            m[last] = value
    return edit


_DELETE = object()
T = "layers.0.attn.q.weight"
SCHEMA_CASES = {
    "not an object": lambda m: (m.clear(), m.update({"format": "interop", "version": 1, "spec": [], "layout": {},
                                                     "tensors": {}, "files": {}})),
    "tensors is a list": _set(["tensors"], []),
    "no spec": _set(["spec"], _DELETE),
    "no layout": _set(["layout"], _DELETE),
    "unknown tensor": lambda m: m["tensors"].__setitem__("layers.0.bogus.weight", m["tensors"][T]),
    "string shape": _set(["tensors", T, "shape"], "64,64"),
    "float dim": _set(["tensors", T, "shape", 0], 64.0),
    "negative offset": _set(["tensors", T, "shards", 0, "offset", 0], -1),
    "float offset": _set(["tensors", T, "shards", 0, "offset", 0], 0.5),
    "unknown dtype": _set(["tensors", T, "dtype"], "float8"),
    "shards not a list": _set(["tensors", T, "shards"], {}),
    "shard without key": _set(["tensors", T, "shards", 0, "key"], _DELETE),
    "negative bytes": _set(["files", "model-tp00-pp00.safetensors", "bytes"], -5),
    "bad crc": _set(["files", "model-tp00-pp00.safetensors", "crc32"], 7),
    "huge num_layers": _set(["spec", "num_layers"], 100_000_000),
    "state a list": _set(["state"], [1]),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_manifest_schema_is_one_line(sources, tmp_path, case):
    src = copy(sources["store"], tmp_path)
    _edit_manifest(src, SCHEMA_CASES[case])
    assert_one_error(*run("inspect", src), "interop.json")
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "interop.json")


def test_manifest_json_list_is_one_line(sources, tmp_path):
    src = copy(sources["store"], tmp_path)
    (src / "interop.json").write_text("[1, 2]")
    assert_one_error(*run("inspect", src), "interop.json", "JSON object")


def test_shard_entry_disagreeing_with_its_file_is_refused(sources, tmp_path):
    """The manifest says one shape, the safetensors file holds another: refused, not reshaped."""
    src = copy(sources["store"], tmp_path)

    def edit(m):
        shards = [(sh, tuple(sh["shape"])) for t in m["tensors"].values() for sh in t["shards"]
                  if sh["file"] == "model-tp00-pp00.safetensors"]
        first = shards[0][0]
        other = next(sh for sh, shape in shards if shape != tuple(first["shape"]))
        first["key"], other["key"] = other["key"], first["key"]  # swapped: each entry still used once
    _edit_manifest(src, edit)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "the manifest says")


# --- DCP chunks --------------------------------------------------------------------------------------------

def _edit_metadata(src, edit):
    meta = src / "release" / DCP_METADATA
    with open(meta, "rb") as f:
        md = _MetadataUnpickler(f).load()
    edit(md)
    meta.write_bytes(pickle.dumps(md))


def _stacked(md):
    return next(v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.chunks) > 2)


def _drop_chunk(md):
    _stacked(md).chunks.pop()


def _repeat_chunk(md):
    chunks = _stacked(md).chunks
    chunks[-1] = chunks[0]


def _chunk_outside(md):
    chunk = _stacked(md).chunks[0]
    chunk.sizes = torch.Size([chunk.sizes[0] + 1000, *chunk.sizes[1:]])


def _negative_length(md):
    next(iter(md.storage_data.values())).length = -1


def _transformed(md):
    next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]


@pytest.mark.parametrize("edit", [_drop_chunk, _repeat_chunk, _chunk_outside, _negative_length, _transformed])
def test_dcp_chunks_must_cover_exactly_once(sources, tmp_path, edit):
    src = copy(sources["dist"], tmp_path)
    _edit_metadata(src, edit)
    with pytest.raises(InteropError, match=r"\.metadata"):
        DistCheckpoint(src / "release")
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), ".metadata")
    assert_one_error(*run("inspect", src), ".metadata")


def test_dcp_overlap_with_equal_count_is_refused(sources, tmp_path):
    from interop.io.dcp_metadata import MetadataIndex  # what `.metadata` is read into (no DCP import)
    src = copy(sources["dist"], tmp_path)

    def edit(md):
        entry = _stacked(md)
        key = next(k for k, v in md.state_dict_metadata.items() if v is entry)
        last = entry.chunks[-1]
        moved = torch.Size([0, *last.offsets[1:]])  # onto the first layer; the last layer uncovered
        md.storage_data[MetadataIndex(key, moved)] = md.storage_data[MetadataIndex(key, last.offsets)]
        last.offsets = moved
    _edit_metadata(src, edit)
    with pytest.raises(InteropError, match="overlap"):
        DistCheckpoint(src / "release")


# --- safetensors headers -----------------------------------------------------------------------------------

def _write_safetensors(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header", [
    {"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}},
    {"a": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}},
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [-8, 8]}},
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]}},
    {"a": {"dtype": "F32", "shape": True, "data_offsets": [0, 4]}},
    {"a": ["F32"]},
    {"__metadata__": [1], "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
])
def test_safetensors_header_lies_are_refused(tmp_path, header):
    path = tmp_path / "x.safetensors"
    _write_safetensors(path, header, bytes(16))
    with pytest.raises(InteropError, match="x.safetensors"):
        SafetensorsFile(path)


def test_safetensors_header_list_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(InteropError, match="not a JSON object"):
        SafetensorsFile(path)


def test_rank_file_with_another_dtype_than_its_peers_is_refused(sources, tmp_path):
    """tp rank 1 stores one weight in float16 while rank 0 has float32: refused, not cast."""
    src = copy(sources["torch"], tmp_path)
    path = next(src.rglob("mp_rank_01_000/model_optim_rng.pt"))
    state = torch.load(path, weights_only=False)
    key = next(k for k in state["model"] if k.endswith("linear_fc1.weight"))
    state["model"][key] = state["model"][key].half()
    torch.save(state, path)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), key, "one dtype expected")


def test_dcp_chunk_of_another_dtype_is_refused(sources, tmp_path):
    """`.metadata` says float16, the stored chunk is float32: DCP alone would cast it silently."""
    src = copy(sources["dist"], tmp_path)
    key = []

    def edit(md):
        name, entry = next((k, v) for k, v in md.state_dict_metadata.items()
                           if getattr(getattr(v, "properties", None), "dtype", None) == torch.float32)
        entry.properties.dtype = torch.float16
        key.append(name)
    _edit_metadata(src, edit)
    ckpt = DistCheckpoint(src / "release")
    with pytest.raises(InteropError, match="holds torch.float32"):
        ckpt.read(key[0])
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), "holds torch.float32")


def test_one_stored_entry_never_serves_two_tensors(sources, tmp_path):
    """A manifest pointing a tensor's shard at another tensor's entry of the same shape: refused."""
    src = copy(sources["store"], tmp_path)

    def edit(m):
        q, k = m["tensors"]["layers.0.attn.q.weight"], m["tensors"]["layers.1.attn.q.weight"]
        k["shards"][0]["key"] = q["shards"][0]["key"]
    _edit_manifest(src, edit)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), "is also a shard of")


def test_tiling_error_unit():
    from interop.shards import Box, tiling_error
    half = [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]
    assert tiling_error((4, 4), half) is None
    assert "overlap" in tiling_error((4, 4), [half[0], half[0]])  # repeated: equal count, half uncovered
    assert "elements" in tiling_error((4, 4), half[:1])
    assert "elements" in tiling_error((4, 4), half + [Box((0, 0), (1, 4))])
    assert "outside" in tiling_error((4, 4), [Box((0, 0), (2, 4)), Box((3, 0), (2, 4))])
    swept = tiling_error((4, 4), [Box((0, 0), (4, 2)), Box((1, 1), (2, 2)), Box((0, 3), (4, 1))])  # 16 elements
    assert "shards at [0, 0] and [1, 1] overlap" == swept
    assert tiling_error((), [Box((), ())]) is None and tiling_error((), []) is not None
