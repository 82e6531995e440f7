"""Exact: what a damaged or crafted HF checkpoint holds is read as torch.load reads it, or refused.

- `pytorch_model.bin` goes through the one torch.save reader (`interop.io.torch_file.LazyTorchFile`): DEFLATE
  records are decompressed (read raw, they would be garbage with exit 0), a flipped byte fails the record's
  CRC-32.
- A key twice in a safetensors header or in a weight index, or a tensor in two weight files: refused (JSON keeps
  the last copy silently; which one is the model's would be a guess).
"""
import json
import shutil
import struct
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli, run


@pytest.fixture(scope="module")
def bin_model(tmp_path_factory):
    """The tiny llama saved as pytorch_model.bin (torch.save, stored records with CRC-32s)."""
    root = tmp_path_factory.mktemp("bin") / "llama"
    model = build("llama")
    root.mkdir()
    model.config.save_pretrained(root)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "pytorch_model.bin")
    return root


def _deflated(src, dst):
    """`src` zip rewritten with every record DEFLATE-compressed (torch.load reads these)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def test_deflated_bin_is_read_decompressed(bin_model, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(bin_model, src)
    _deflated(bin_model / "pytorch_model.bin", src / "pytorch_model.bin")
    assert torch.load(src / "pytorch_model.bin", weights_only=True).keys()  # torch itself reads it
    code, output = run("convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0, output
    expected = torch.load(bin_model / "pytorch_model.bin", weights_only=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key


def _record(path, suffix):
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        with open(path, "rb") as f:
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
        return info.header_offset + 30 + name_len + extra_len, info


def test_bin_flipped_byte_fails_its_crc(bin_model, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(bin_model, src)
    offset, info = _record(src / "pytorch_model.bin", "data")
    assert info.CRC != 0 and info.compress_type == zipfile.ZIP_STORED
    with open(src / "pytorch_model.bin", "r+b") as f:
        f.seek(offset + info.file_size // 2)
        byte = f.read(1)
        f.seek(offset + info.file_size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    result = cli("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "CRC-32")


def _safetensors_with_header(path, header: bytes, data: bytes):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_safetensors_header_key_twice_is_refused(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = sorted(k for k in header if k != "__metadata__")[0]
    entry = json.dumps(header[key])
    text = raw[8:8 + n].decode().rstrip()
    assert text.endswith("}")
    doubled = (text[:-1] + f",{json.dumps(key)}:{entry}}}").encode()  # the same key again, at the end
    _safetensors_with_header(src / "model.safetensors", doubled, raw[8 + n:])
    result = cli("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "appears twice", key)


def test_index_key_twice_is_refused(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "hf", "--max-shard-size", "100KB")[0] == 0
    index = src / "model.safetensors.index.json"
    text = index.read_text()
    first = next(iter(json.loads(text)["weight_map"].items()))
    text = text.replace('"weight_map": {', '"weight_map": {' + json.dumps(first[0]) + ": " + json.dumps(first[1]) + ", ", 1)
    index.write_text(text)
    result = cli("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "appears twice")


def test_tensor_in_two_weight_files_is_refused(hf_checkpoints, tmp_path):
    """A second shard also holding a tensor (here a NaN copy): which is the model's is not ours to pick."""
    from safetensors.torch import save_file
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "hf", "--max-shard-size", "100KB")[0] == 0
    shards = sorted(src.glob("model-*.safetensors"))
    first, second = load_file(shards[0]), load_file(shards[1])
    key = sorted(first)[0]
    second[key] = torch.full_like(first[key], float("nan"))
    save_file(second, shards[1], metadata={"format": "pt"})
    result = cli("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "two weight files", key)


def test_safetensors_tensor_of_another_dtype_is_kept_with_a_note(hf_checkpoints, tmp_path):
    """An f16 embedding among f32 weights: kept as stored (--dtype keep, the default), and said so."""
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    sd = load_file(src / "model.safetensors")
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].half()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    code, output = run("convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0 and "weights in 2 dtypes" in output and "kept as stored" in output, output
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["model.embed_tokens.weight"].dtype == torch.float16
    assert torch.equal(out["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert out["model.norm.weight"].dtype == torch.float32
