"""Safe: nothing in a checkpoint runs code, and reads stay inside the checkpoint.

Every hostile input is refused with one `error:` line (exit 2) by `interop convert` and
`interop inspect`, and the marker file its payload would create never appears.
"""
import json
import os
import pickle
import shutil
import struct

import pytest
import torch

from helpers.hostile import assert_one_error, run
from interop.errors import InteropError
from interop.io.megatron_dist import DCP_METADATA, DistCheckpoint, _MetadataUnpickler
from interop.io.paths import inside
from interop.io.safe_pickle import safe_torch_load
from interop.store import StoreReader

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")




@pytest.fixture(scope="module")
def sources(hf_checkpoints, tmp_path_factory):
    """The tiny HF llama as torch_dist and as the common format (tp 2, pp 2)."""
    root = tmp_path_factory.mktemp("safe-sources")
    assert run("convert", hf_checkpoints["llama"], root / "dist", "--to", "megatron", "--format", "torch_dist",
               "--tp", "2")[0] == 0
    assert run("convert", hf_checkpoints["llama"], root / "store", "--to", "interop", "--tp", "2", "--pp", "2")[0] == 0
    return {"dist": root / "dist", "store": root / "store", "hf": hf_checkpoints["llama"]}


def copy(src, tmp_path, name="src"):
    dst = tmp_path / name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def stack_global_call(module: str, name: str, arg: str) -> bytes:
    """`module`/`name` looked up with STACK_GLOBAL (protocol 4 resolves dotted names) and called with `arg`."""
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + _str(arg) + b"\x85R0"  # STACK_GLOBAL, TUPLE1, REDUCE, POP


def global_call(module: str, name: str, arg: str) -> bytes:
    """The same with the text GLOBAL opcode."""
    return b"\x80\x04c" + f"{module}\n{name}\n".encode() + _str(arg) + b"\x85R0"


class _Call:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


HOSTILE_GLOBALS = [
    ("torch.distributed.checkpoint.filesystem", "os.system"),  # the reported hole: filesystem imports os
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.planner", "os.system"),
    ("torch", "os.system"),
    ("megatron.core.dist_checkpointing.strategies.torch", "os.system"),
]


@pytest.mark.parametrize("module,name", HOSTILE_GLOBALS)
@pytest.mark.parametrize("opcode", ["stack_global", "global"])
def test_metadata_payload_prepended_is_refused(sources, tmp_path, module, name, opcode):
    src = copy(sources["dist"], tmp_path)
    meta = src / "release" / DCP_METADATA
    marker = tmp_path / "marker"
    make = stack_global_call if opcode == "stack_global" else global_call
    meta.write_bytes(make(module, name, f"touch {marker}") + meta.read_bytes())
    assert_one_error(*run("inspect", src), DCP_METADATA)
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), DCP_METADATA, "refused")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_metadata_payload_embedded_is_refused(sources, tmp_path):
    """A callable hidden inside a genuine Metadata (in planner_data), pickled the ordinary way (`posix.system`)."""
    src = copy(sources["dist"], tmp_path)
    meta = src / "release" / DCP_METADATA
    marker = tmp_path / "marker"
    with open(meta, "rb") as f:
        md = _MetadataUnpickler(f).load()
    md.planner_data = {"x": _Call(os.system, f"touch {marker}")}
    meta.write_bytes(pickle.dumps(md))
    assert b"system" in meta.read_bytes()
    assert_one_error(*run("inspect", src), "refused global")
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "refused global")
    assert not marker.exists()


def test_metadata_unpickler_never_resolves_dotted_or_module_names():
    for module, name in [("torch.distributed.checkpoint.filesystem", "os"), ("torch", "load"),
                         ("torch.distributed.checkpoint.metadata", "Metadata.__class__"),
                         ("torch.distributed.checkpoint.metadata", "torch"), ("builtins", "getattr"),
                         ("torch.serialization", "load"), ("pathlib", "Path.write_text")]:
        payload = b"\x80\x04" + _str(module) + _str(name) + b"\x93."
        with pytest.raises(pickle.UnpicklingError, match="refused global"):
            _MetadataUnpickler(__import__("io").BytesIO(payload)).load()


def test_mcore015_metadata_keeps_its_state():
    """megatron-core 0.15 pickles `MCoreMetadata(Metadata)` with `mcore_data` as the top-level object
    (megatron/core/dist_checkpointing/strategies/torch.py, MCoreSavePlanner.create_global_plan).  The
    fixture was written by megatron-core 0.15.0's own `dist_checkpointing.save` (fixtures/.../GENERATE.py)."""
    ckpt = DistCheckpoint(os.path.join(FIXTURES, "mcore015_torch_dist"))
    raw = open(os.path.join(FIXTURES, "mcore015_torch_dist", DCP_METADATA), "rb").read()
    assert b"MCoreMetadata" in raw
    md = ckpt._reader.read_metadata()
    assert type(md).__name__ == "_MCoreMetadata" and md.mcore_data == {}
    assert sorted(ckpt.keys()) == ["decoder.layers.mlp.linear_fc2.weight", "embedding.word_embeddings.weight"]
    assert torch.equal(ckpt.read("decoder.layers.mlp.linear_fc2.weight"),
                       torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))
    assert torch.equal(ckpt.read("embedding.word_embeddings.weight", None),
                       torch.arange(10, dtype=torch.bfloat16).reshape(5, 2))


def test_mcore_metadata_stand_in_keeps_mcore_data(tmp_path, monkeypatch):
    """The same class pickled with mcore_data filled (as 0.15 does for reformulated tensors), under its
    real module and class name (a stand-in module registered for the pickler only)."""
    import dataclasses
    import sys
    import types
    from torch.distributed.checkpoint.metadata import Metadata
    module = "megatron.core.dist_checkpointing.strategies.torch"
    fake = types.ModuleType(module)

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict = None

    MCoreMetadata.__module__, MCoreMetadata.__qualname__ = module, "MCoreMetadata"
    fake.MCoreMetadata = MCoreMetadata
    src = copy(os.path.join(FIXTURES, "mcore015_torch_dist"), tmp_path)
    with open(src / DCP_METADATA, "rb") as f:
        md = _MetadataUnpickler(f).load()
    fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)}
    shape = {"embedding.word_embeddings.weight": {"nd_reformulated_orig_global_shape": (5, 2)}}
    monkeypatch.setitem(sys.modules, module, fake)
    data = pickle.dumps(MCoreMetadata(mcore_data=shape, **fields))
    monkeypatch.delitem(sys.modules, module)
    assert module.encode() in data and b"MCoreMetadata" in data
    (src / DCP_METADATA).write_bytes(data)
    ckpt = DistCheckpoint(src)
    assert ckpt._reader.read_metadata().mcore_data == shape and ckpt.mcore_data == shape
    assert torch.equal(ckpt.read("embedding.word_embeddings.weight"),
                       torch.arange(10, dtype=torch.bfloat16).reshape(5, 2))


# --- reads stay inside the checkpoint ------------------------------------------------------------------

OUTSIDE_NAMES = ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors"]


def test_inside_helper(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (tmp_path / "ckpt" / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    assert inside(tmp_path / "ckpt", "a/b.safetensors", "w") == tmp_path / "ckpt" / "a" / "b.safetensors"
    for bad in OUTSIDE_NAMES + ["link.safetensors", "", None, 3]:
        with pytest.raises(InteropError, match="w: file name"):
            inside(tmp_path / "ckpt", bad, "w")


def _rename_store_file(manifest: dict, old: str, new: str) -> None:
    manifest["files"][new] = manifest["files"].pop(old)
    for t in manifest["tensors"].values():
        for shard in t["shards"]:
            if shard["file"] == old:
                shard["file"] = new


@pytest.mark.parametrize("name", OUTSIDE_NAMES + ["symlink"])
def test_store_file_names_stay_inside(sources, tmp_path, name):
    src = copy(sources["store"], tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(src / "model-tp00-pp00.safetensors", outside)
    manifest = json.loads((src / "interop.json").read_text())
    if name == "symlink":
        (src / "model-tp00-pp00.safetensors").unlink()
        (src / "model-tp00-pp00.safetensors").symlink_to(outside)
    else:
        _rename_store_file(manifest, "model-tp00-pp00.safetensors", name)
    (src / "interop.json").write_text(json.dumps(manifest))
    assert_one_error(*run("inspect", src), "outside the checkpoint")
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "outside the checkpoint")


def test_store_files_cannot_name_system_files(sources, tmp_path):
    """`files` alone (no shard uses it) naming /etc/shadow: refused, never opened."""
    src = copy(sources["store"], tmp_path)
    manifest = json.loads((src / "interop.json").read_text())
    manifest["files"]["/etc/shadow"] = {"bytes": 0, "crc32": "00000000"}
    (src / "interop.json").write_text(json.dumps(manifest))
    assert_one_error(*run("inspect", src), "/etc/shadow", "outside the checkpoint")


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_hf_index_names_stay_inside(sources, tmp_path, name):
    src = copy(sources["hf"], tmp_path)
    shutil.copy(src / "model.safetensors", tmp_path / "outside.safetensors")
    from interop.io.safetensors import SafetensorsFile
    with SafetensorsFile(src / "model.safetensors") as f:
        keys = f.keys()
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in keys}}))
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "interop"), "outside the checkpoint")


@pytest.mark.parametrize("name", ["/etc/passwd", "../__0_0.distcp", "symlink"])
def test_dcp_relative_path_stays_inside(sources, tmp_path, name):
    src = copy(sources["dist"], tmp_path)
    meta = src / "release" / DCP_METADATA
    with open(meta, "rb") as f:
        md = _MetadataUnpickler(f).load()
    if name == "symlink":
        shutil.move(src / "release" / "__0_0.distcp", tmp_path / "__0_0.distcp")
        (src / "release" / "__0_0.distcp").symlink_to(tmp_path / "__0_0.distcp")
    else:
        shutil.copy(src / "release" / "__0_0.distcp", tmp_path / "__0_0.distcp")
        for info in md.storage_data.values():
            info.relative_path = name
        meta.write_bytes(pickle.dumps(md))
    assert_one_error(*run("inspect", src), "outside the checkpoint")
    assert_one_error(*run("convert", src, tmp_path / "out", "--to", "hf"), "outside the checkpoint")


# --- the .pt unpickler (Megatron rank files, common.pt, map-args) ---------------------------------------

def _hostile_pt(path, payload: bytes):
    """A genuine torch.save zip whose data.pkl is `payload` (the globals it names decide its fate)."""
    import zipfile
    torch.save({"x": 1}, path)
    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records.items():
            z.writestr(name, payload if name.endswith("data.pkl") else data)


def _x(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _p2_call(module: str, name: str, arg: str) -> bytes:
    """Protocol 2, as torch.save writes: {"k": module.name(arg)} (GLOBAL, TUPLE1, REDUCE, SETITEM)."""
    return b"\x80\x02}" + _x("k") + b"c" + f"{module}\n{name}\n".encode() + _x(arg) + b"\x85Rs"


@pytest.mark.parametrize("module,name", [("os", "system"), ("posix", "system"), ("builtins", "eval"),
                                         ("pathlib", "Path.write_text"), ("io", "open"),
                                         ("torch.serialization", "os.system"), ("numpy", "load"),
                                         ("megatron.core.enums", "os.system")])
def test_pt_pickle_calling_code_is_refused(tmp_path, module, name):
    marker = tmp_path / "marker"
    path = tmp_path / "common.pt"
    _hostile_pt(path, _p2_call(module, name, f"touch {marker}") + b".")
    with pytest.raises(InteropError, match="refused to load"):
        safe_torch_load(path)
    assert not marker.exists()
    code, out = run("map-args", path, "--to", "mindspeed")
    assert_one_error(code, out)
    assert not marker.exists()


def test_pt_allowed_objects_are_inert(tmp_path):
    """What the allow-list admits (BytesIO, paths, Namespace, placeholders for unknown classes) can be
    constructed but does nothing: a PosixPath built from the pickle touches no file."""
    import argparse
    import io
    import pathlib
    marker = tmp_path / "marker"
    obj = {"p": pathlib.PosixPath(marker), "b": io.BytesIO(b"abc"), "a": argparse.Namespace(x=1)}
    torch.save(obj, tmp_path / "ok.pt")
    got = safe_torch_load(tmp_path / "ok.pt")
    assert got["p"] == marker and got["b"].getvalue() == b"abc" and got["a"].x == 1
    assert not marker.exists()


def test_pt_placeholder_does_not_import_its_module(tmp_path):
    """An unknown CamelCase class becomes an inert placeholder: its module is never imported."""
    import sys
    path = tmp_path / "p.pt"
    _hostile_pt(path, _p2_call("interop_never_imported_mod", "Thing", "a") + b".")
    got = safe_torch_load(path)["k"]
    assert type(got).interop_name == "interop_never_imported_mod.Thing" and got.args == ("a",)
    assert "interop_never_imported_mod" not in sys.modules


def test_store_reader_refuses_before_reading(sources, tmp_path):
    """The trainer's loader (StoreReader) refuses an escaping manifest at open, like convert does."""
    src = copy(sources["store"], tmp_path)
    manifest = json.loads((src / "interop.json").read_text())
    _rename_store_file(manifest, "model-tp00-pp00.safetensors", "/etc/passwd")
    (src / "interop.json").write_text(json.dumps(manifest))
    with pytest.raises(InteropError, match="outside the checkpoint"):
        StoreReader(src)
    from interop.trainer.checkpoint import open_checkpoint
    with pytest.raises(InteropError, match="outside the checkpoint"):
        open_checkpoint(src)


def test_hostile_global_bytes_are_what_we_think():
    """The payload helpers produce a pickle that plain pickle would indeed run (so the tests above test something)."""
    calls = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            calls.append((module, name))
            return lambda arg: arg

    for make in (stack_global_call, global_call):
        Recorder(__import__("io").BytesIO(make("torch.distributed.checkpoint.filesystem", "os.system", "x")
                                          + pickle.dumps(1))).load()
    assert calls == [("torch.distributed.checkpoint.filesystem", "os.system")] * 2
    assert struct.calcsize("<I") == 4


def test_metadata_from_older_torch_still_reads(sources, tmp_path):
    """torch <= 2.2 pickled TensorProperties from `torch.distributed._shard.sharded_tensor.metadata`:
    that exact pair is allowed too, and reads give the same tensors."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    src = copy(sources["dist"], tmp_path)
    meta = src / "release" / DCP_METADATA
    with open(meta, "rb") as f:
        md = _MetadataUnpickler(f).load()
    for entry in md.state_dict_metadata.values():
        if hasattr(entry, "properties"):
            entry.properties = TensorProperties(dtype=entry.properties.dtype)
    meta.write_bytes(pickle.dumps(md))
    assert b"sharded_tensor.metadata" in meta.read_bytes()
    old, new = DistCheckpoint(sources["dist"] / "release"), DistCheckpoint(src / "release")
    for key in old.keys():
        assert torch.equal(old.read(key), new.read(key)), key
