"""interop.io.ms_ckpt against mindspore itself: exact bytes, exact tensors, clear errors."""
import numpy as np
import pytest
import torch

from interop.errors import InteropError
from interop.io.ms_ckpt import CkptFile, CkptWriter, MsSafetensorsFile, load_ckpt, ms_safetensors_writer, save_ckpt
from interop.io.safetensors import SafetensorsWriter

UNSIGNED = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}
APPEND = {"epoch": 3, "lr": 0.5, "flag": True, "note": "héllo"}


def sample_tensors():
    """One small tensor of every dtype mindspore writes."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
        out[f"w.{dt}"] = torch.randn(3, 5, generator=g).to(dt)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        out[f"w.{dt}"] = torch.randint(-100, 100, (4, 2), generator=g).to(dt)
    for dt in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        out[f"w.{dt}"] = torch.randint(0, 250, (2, 3, 2), generator=g).to(dt)
    out["mask"] = torch.rand(7, generator=g) > 0.5
    out["scalar"] = torch.tensor(2.5)
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def ms():
    return pytest.importorskip("mindspore")


def to_ms(ms, t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return ms.Tensor(t.float().numpy()).astype(ms.bfloat16)
    if t.dtype in UNSIGNED:
        return ms.Tensor(t.to(torch.int64).numpy().astype(UNSIGNED[t.dtype]))
    return ms.Tensor(t.numpy())


def ms_save(ms, path, tensors, **kw):
    ms.save_checkpoint([{"name": k, "data": to_ms(ms, v)} for k, v in tensors.items()], str(path), **kw)


# ---------------------------------------------------------------- against mindspore


def test_bytes_identical_to_save_checkpoint_every_dtype_and_scalars(ms, tmp_path):
    tensors = sample_tensors()
    ms_save(ms, tmp_path / "ref.ckpt", tensors, append_dict=dict(APPEND))
    size = save_ckpt(tmp_path / "ours.ckpt", {**tensors, **APPEND})
    ours = (tmp_path / "ours.ckpt").read_bytes()
    assert ours == (tmp_path / "ref.ckpt").read_bytes()
    assert size == len(ours)


def test_mindspore_loads_what_we_write(ms, tmp_path):
    tensors = sample_tensors()
    save_ckpt(tmp_path / "ours.ckpt", {**tensors, **APPEND})
    loaded = ms.load_checkpoint(str(tmp_path / "ours.ckpt"))
    assert list(loaded) == [*tensors, *APPEND]
    for name, t in tensors.items():
        p = loaded[name]
        assert tuple(p.shape) == tuple(t.shape), name
        assert p.asnumpy().tobytes() == raw(t), name
    assert loaded["note"] == "héllo"
    assert str(loaded["epoch"].dtype) == "Int64" and int(loaded["epoch"].asnumpy()) == 3
    assert str(loaded["lr"].dtype) == "Float32" and float(loaded["lr"].asnumpy()) == 0.5
    assert str(loaded["flag"].dtype) == "Bool" and loaded["flag"].shape == ()


def test_we_read_what_mindspore_writes(ms, tmp_path):
    tensors = sample_tensors()
    ms_save(ms, tmp_path / "ref.ckpt", tensors, append_dict=dict(APPEND))
    with CkptFile(tmp_path / "ref.ckpt") as f:
        assert f.keys() == [*tensors, *APPEND]
        for name, t in tensors.items():
            assert f.meta(name) == (t.dtype, tuple(t.shape))
            got = f.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape and raw(got) == raw(t), name
        assert f.read("note") == "héllo"
        assert f.meta("epoch") == (torch.int64, ())
        assert torch.equal(f.read("epoch"), torch.tensor(3))
        assert torch.equal(f.read("lr"), torch.tensor(0.5))
        assert torch.equal(f.read("flag"), torch.tensor(True))


def test_split_of_a_large_tensor(ms, tmp_path, monkeypatch):
    """Tensors over the slice size become several Values with the same tag and full dims."""
    from mindspore.train import serialization
    monkeypatch.setattr(serialization, "SLICE_SIZE", 1)  # KiB: 1024-byte Values
    big = torch.randn(33, 70, generator=torch.Generator().manual_seed(1))  # 9240 bytes -> 10 Values
    small = torch.arange(6, dtype=torch.int32)
    for crc in (False, True):
        ref, ours = tmp_path / f"ref{crc}.ckpt", tmp_path / f"ours{crc}.ckpt"
        ms_save(ms, ref, {"big": big, "small": small}, crc_check=crc)
        save_ckpt(ours, {"big": big, "small": small}, crc=crc, slice_bytes=1024)
        assert ours.read_bytes() == ref.read_bytes()
        with CkptFile(ours) as f:
            assert [n for _, n in f.entry("big").chunks] == [1024] * 9 + [24]
            assert torch.equal(f.read("big"), big) and torch.equal(f.read("small"), small)
            assert torch.equal(f.view("big"), big)  # in pieces: falls back to a copy
        assert np.array_equal(ms.load_checkpoint(str(ours))["big"].asnumpy(), big.numpy())


def test_crc_trailer_written_and_checked(ms, tmp_path):
    tensors = sample_tensors()
    ms_save(ms, tmp_path / "ref.ckpt", tensors, crc_check=True)
    save_ckpt(tmp_path / "ours.ckpt", tensors, crc=True)
    data = (tmp_path / "ours.ckpt").read_bytes()
    assert data == (tmp_path / "ref.ckpt").read_bytes()
    assert data[-17:-10] == b"crc_num"
    with CkptFile(tmp_path / "ours.ckpt") as f:
        assert f.crc == int.from_bytes(data[-10:], "big")
        assert f.keys() == list(tensors)
    ms.load_checkpoint(str(tmp_path / "ours.ckpt"), crc_check=True)


def test_encrypted_file_refused(ms, tmp_path):
    path = tmp_path / "enc.ckpt"
    for mode in ("AES-GCM", "AES-CBC", "SM4-CBC"):
        ms_save(ms, path, {"w": torch.ones(2, 3)}, enc_key=b"0123456789abcdef", enc_mode=mode)
        with pytest.raises(InteropError, match=r"enc\.ckpt: the checkpoint is encrypted"):
            CkptFile(path)
        path.unlink()


def test_ms_safetensors_flavour(ms, tmp_path):
    tensors = {k: v for k, v in sample_tensors().items() if v.dtype not in UNSIGNED}
    # mindspore's own crc cannot take 16-bit floats (numpy buffers of them), so check crc on the rest
    no_half = {k: v for k, v in tensors.items() if v.dtype not in (torch.float16, torch.bfloat16)}
    for name, subset, crc in (("ref.safetensors", tensors, False), ("crc.safetensors", no_half, True)):
        ms.save_checkpoint([{"name": k, "data": to_ms(ms, v)} for k, v in subset.items()],
                           str(tmp_path / name), format="safetensors", crc_check=crc)
        with MsSafetensorsFile(tmp_path / name) as f:
            assert ("crc_num" in f.metadata) == crc
            for key, t in subset.items():
                got = f.read(key)
                assert got.dtype == t.dtype and got.shape == t.shape and raw(got) == raw(t), key

    w = ms_safetensors_writer(tmp_path / "ours.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    with MsSafetensorsFile(tmp_path / "ours.safetensors") as f:
        assert f.metadata == {"format": "ms"}
    loaded = ms.load_checkpoint(str(tmp_path / "ours.safetensors"), format="safetensors")
    for name, t in tensors.items():
        assert loaded[name].asnumpy().tobytes() == raw(t), name


def test_ms_safetensors_crc_mismatch_and_foreign_file(ms, tmp_path):
    path = tmp_path / "ref.safetensors"
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones((4, 4), np.float32))}], str(path),
                       format="safetensors", crc_check=True)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(data))
    with pytest.raises(InteropError, match=r"ref\.safetensors: crc check failed"):
        MsSafetensorsFile(path)
    plain = tmp_path / "plain.safetensors"
    w = SafetensorsWriter(plain, [("w", torch.float32, (2,))])
    w.write("w", torch.zeros(2))
    w.close()
    with pytest.raises(InteropError, match=r"plain\.safetensors: not a MindSpore safetensors file"):
        MsSafetensorsFile(plain)


# ---------------------------------------------------------------- without mindspore


def test_round_trip_and_lazy_listing(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "x.ckpt"
    save_ckpt(path, {**tensors, **APPEND}, crc=True)
    with CkptFile(path, verify=False) as f:  # only headers touched
        assert [f.meta(k) for k in tensors] == [(t.dtype, tuple(t.shape)) for t in tensors.values()]
        assert f.entry("note").type == "str"
    got = load_ckpt(path)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and raw(got[name]) == raw(t), name
    assert got["note"] == "héllo" and torch.equal(got["epoch"], torch.tensor(3))


def test_view_is_zero_copy_and_copy_on_write(tmp_path):
    import ctypes
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    aligned = []
    for n in range(1, 5):  # the tag length moves the content offset; one of four is 4-aligned
        path = tmp_path / f"x{n}.ckpt"
        save_ckpt(path, {"w" * n: w})
        before = path.read_bytes()
        with CkptFile(path) as f:
            offset = f.entry("w" * n).chunks[0][0]
            v = f.view("w" * n)
            assert torch.equal(v, w)
            anchor = ctypes.c_char.from_buffer(f._mm)
            in_map = v.data_ptr() == ctypes.addressof(anchor) + offset
            del anchor
            assert in_map == (offset % 4 == 0)  # aligned: a view of the mapping; else a copy
            aligned.append(in_map)
            v.zero_()
            assert torch.equal(f.read("w" * n), w)  # copy-on-write: the file is unchanged
            del v
        assert path.read_bytes() == before
    assert aligned.count(True) == 1


def test_empty_tensor_is_kept(tmp_path):
    save_ckpt(tmp_path / "e.ckpt", {"e": torch.zeros(0, 3), "s": torch.tensor(1, dtype=torch.int32)})
    got = load_ckpt(tmp_path / "e.ckpt")
    assert got["e"].shape == (0, 3) and torch.equal(got["s"], torch.tensor(1, dtype=torch.int32))


def test_writer_rejects_duplicates_and_unknown_types(tmp_path):
    with pytest.raises(ValueError, match="written twice"):
        with CkptWriter(tmp_path / "d.ckpt") as w:
            w.write("a", torch.zeros(1))
            w.write("a", torch.zeros(1))
    assert not (tmp_path / "d.ckpt").exists()  # aborted writes leave nothing behind
    with pytest.raises(TypeError, match="no type for torch.complex64"):
        save_ckpt(tmp_path / "c.ckpt", {"c": torch.zeros(2, dtype=torch.complex64)})


# ---------------------------------------------------------------- bad input


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.ckpt"
    save_ckpt(path, {"w": torch.randn(16, 16), "b": torch.zeros(16)}, crc=True)
    return path


def write_bad(tmp_path, data: bytes):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(data)
    return path


def test_truncated_file(tmp_path, good):
    data = good.read_bytes()[:-17]  # no crc trailer left to catch it
    path = write_bad(tmp_path, data[: len(data) - 100])
    with pytest.raises(InteropError, match=r"^.*bad\.ckpt: corrupt or truncated checkpoint near byte \d+: .*truncated"):
        CkptFile(path)


def test_crc_mismatch(tmp_path, good):
    data = bytearray(good.read_bytes())
    data[200] ^= 0x01  # inside w's content: the wire format still parses
    path = write_bad(tmp_path, bytes(data))
    with pytest.raises(InteropError, match=r"bad\.ckpt: crc check failed \(file says [0-9a-f]{8}, contents give "
                                           r"[0-9a-f]{8}\): the checkpoint is damaged"):
        CkptFile(path)
    with CkptFile(path, verify=False) as f:  # asked not to check: reads the damaged bytes
        assert f.keys() == ["w", "b"]


def test_garbage_bytes(tmp_path):
    path = write_bad(tmp_path, b"PK\x03\x04 this is a zip, not a checkpoint")
    with pytest.raises(InteropError, match=r"bad\.ckpt: not a MindSpore checkpoint \(first byte 50"):
        CkptFile(path)
    path = write_bad(tmp_path, b"\x0a\x05\x0a\x01x\xff\xff" + bytes(range(40)))
    with pytest.raises(InteropError, match=r"bad\.ckpt: corrupt or truncated checkpoint near byte"):
        CkptFile(path)


def test_unknown_layouts(tmp_path):
    path = tmp_path / "x.ckpt"
    save_ckpt(path, {"a": torch.zeros(2), "b": torch.zeros(2)})
    one = path.read_bytes()[: len(path.read_bytes()) // 2]
    dup = write_bad(tmp_path, one + path.read_bytes()[len(one):] + one)  # a, b, a again
    with pytest.raises(InteropError, match=r"tag 'a' appears twice"):
        CkptFile(dup)
    save_ckpt(path, {"a": torch.zeros(2)})
    odd = write_bad(tmp_path, path.read_bytes().replace(b"Float32", b"Float99"))
    with pytest.raises(InteropError, match=r"bad\.ckpt: tensor 'a' has unsupported tensor_type 'Float99'"):
        CkptFile(odd)
    short = write_bad(tmp_path, path.read_bytes().replace(b"\x08\x02", b"\x08\x03"))  # dims say 3 elements
    with pytest.raises(InteropError, match=r"tensor 'a' has 8 bytes but dims \[3\] of Float32 need 12"):
        CkptFile(short)


def test_missing_file(tmp_path):
    with pytest.raises(InteropError, match=r"nope\.ckpt: cannot open"):
        CkptFile(tmp_path / "nope.ckpt")


def test_head_and_same_bytes_across_files_and_slices(tmp_path):
    """What interop.distinct_ranks compares rank files by where no crc_num trailer covers them: a tensor's first
    bytes, and a block-by-block comparison that sees a difference in the last block of a sliced Value."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=g)
    other = w.clone()
    other[-1, -1] += 1
    save_ckpt(tmp_path / "a.ckpt", {"w": w, "b": torch.zeros(3)}, slice_bytes=4096)  # w as 4 Values
    save_ckpt(tmp_path / "b.ckpt", {"w": w.clone(), "b": torch.zeros(3)})
    save_ckpt(tmp_path / "c.ckpt", {"w": other, "b": torch.zeros(3)}, slice_bytes=4096)
    with CkptFile(tmp_path / "a.ckpt") as a, CkptFile(tmp_path / "b.ckpt") as b, CkptFile(tmp_path / "c.ckpt") as c:
        assert a.head("w", 4096) == b.head("w", 4096) == c.head("w", 4096) == raw(w)[:4096]
        assert a.head("b", 4096) == raw(torch.zeros(3))
        assert a.same_bytes("w", b, "w", block=1000) and a.same_bytes("b", c, "b")
        assert not a.same_bytes("w", c, "w", block=1000) and not a.same_bytes("w", c, "b")
