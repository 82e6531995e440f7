"""torch_dist at disk speed: chunks placed by their zip record, read straight into tensors or copied file to file.

A `.distcp` chunk is a `torch.save` zip: `megatron_dist` reads its pickle and directory (a few KB) to find
where the tensor's bytes lie, then reads them with `preadv` (checked against the record's CRC-32) or hands
their byte range to the engine, which copies them with copy_file_range (`converters/megatron/torch_dist.py`
`Reader.byte_ranges`).  These tests show the fast path is taken for what torch's DCP and megatron-core write
(`tests/fixtures/megatron/*/torch_dist`, made by megatron-core 0.12.3 and 0.16.1), reads the same values as
torch.load of the chunk, refuses damaged bytes, and that torch_dist -> HF is a file-to-file copy of every
weight of a Llama (GQA) model.
"""
import io
import zlib
from pathlib import Path

import pytest
import torch

from interop.convert import convert
from interop.errors import InteropError
from interop.io import background
from interop.io import megatron_dist as md
from interop.io.megatron_dist import DistCheckpoint, DistWriter, MetadataIndex

FIXTURES = Path(__file__).parents[1] / "fixtures"
MCORE_DIRS = sorted(p.parent for p in (FIXTURES / "megatron").glob("*/*/torch_dist/iter_*/.metadata")) + \
    [FIXTURES / "mcore015_torch_dist"]
QKV = "decoder.layers.self_attention.linear_qkv.weight"


def _chunks(ckpt: DistCheckpoint):
    for key in ckpt.keys():
        for chunk in ckpt._tensors[key].chunks:
            yield key, chunk


def _torch_load_chunk(ckpt: DistCheckpoint, key: str, chunk) -> torch.Tensor:
    """The chunk as torch.load reads it from its byte range (the reference the fast path must match)."""
    reader = ckpt._reader
    file, info = reader._chunk_file(MetadataIndex(key, chunk.offsets))
    with open(file, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


@pytest.mark.parametrize("path", MCORE_DIRS, ids=lambda p: "/".join(p.parts[-4:]))
def test_what_megatron_core_writes_is_read_by_byte_range(path):
    """Every chunk megatron-core saved (through torch's DCP) is placed (`span`), and reading it by its byte
    range gives exactly what torch.load of the chunk gives."""
    ckpt = DistCheckpoint(path)
    seen = 0
    for key, chunk in _chunks(ckpt):
        span = ckpt.span(key, list(chunk.offsets), list(chunk.sizes))
        assert span is not None, (key, chunk)
        want = _torch_load_chunk(ckpt, key, chunk)
        got = ckpt.read_box(key, list(chunk.offsets), list(chunk.sizes))
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == want.view(torch.uint8).numpy().tobytes(), key
        assert span[2] == want.numel() * want.element_size()
        seen += 1
    assert seen


def test_torchs_own_dcp_save_is_read_by_byte_range(tmp_path):
    """A checkpoint written by torch's `dcp.save` (no process group): every chunk placed and read exactly."""
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(1)
    want = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "c": torch.arange(12, dtype=torch.int64).view(3, 4)}
    dcp.save(want, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    ckpt = DistCheckpoint(tmp_path)
    for key, value in want.items():
        assert ckpt.span(key, [0] * value.dim(), list(value.shape)) is not None
        assert torch.equal(ckpt.read(key), value)


def _written(tmp_path) -> tuple[Path, dict]:
    g = torch.Generator().manual_seed(0)
    want = {QKV: torch.randn(3, 12, 8, generator=g), "embedding.word_embeddings.weight": torch.randn(16, 8, generator=g)}
    md.write_dist_checkpoint(tmp_path / "ckpt", want.items())
    return tmp_path / "ckpt", want


def test_a_flipped_tensor_byte_fails_the_crc_check(tmp_path):
    """Our chunks (like torch.save's) carry a CRC-32: a flipped byte inside a layer's tensor bytes is refused
    with one line; the other layers still read."""
    path, want = _written(tmp_path)
    ckpt = DistCheckpoint(path)
    file, offset, nbytes = ckpt.span(QKV, [1, 0, 0], [1, 12, 8])
    with open(file, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    ckpt = DistCheckpoint(path)
    assert torch.equal(ckpt.read(QKV, 0), want[QKV][0]) and torch.equal(ckpt.read(QKV, 2), want[QKV][2])
    with pytest.raises(InteropError, match="CRC-32"):
        ckpt.read(QKV, 1)


def test_a_truncated_file_is_one_line(tmp_path):
    path, _ = _written(tmp_path)
    ckpt = DistCheckpoint(path)
    file, offset, nbytes = ckpt.span(QKV, [2, 0, 0], [1, 12, 8])
    with open(file, "r+b") as f:
        f.truncate(offset + nbytes // 2)
    with pytest.raises(InteropError):
        DistCheckpoint(path).read(QKV, 2)


def test_the_span_is_the_chunks_zip_record(tmp_path):
    """The byte range handed out is exactly the `data/0` record of the chunk's zip (its CRC matches)."""
    path, want = _written(tmp_path)
    ckpt = DistCheckpoint(path)
    file, offset, nbytes = ckpt.span(QKV, [0, 0, 0], [1, 12, 8])
    raw = Path(file).read_bytes()[offset:offset + nbytes]
    assert raw == want[QKV][0].numpy().tobytes()
    span = ckpt._reader.span(MetadataIndex(QKV, torch.Size([0, 0, 0])))
    assert span.crc == zlib.crc32(raw) != 0
    # boxes that are not one chunk have no span (they are read and assembled)
    assert ckpt.span(QKV, [0, 0, 0], [2, 12, 8]) is None and ckpt.span(QKV, [0, 2, 0], [1, 5, 8]) is None


def test_torch_dist_to_hf_copies_every_weight_file_to_file(hf_checkpoints, tmp_path, monkeypatch):
    """Llama with grouped-query attention: q, k, v come out of the fused QKV and gate, up out of fc1 as byte
    ranges, as do the plain tensors; nothing but the padded vocab is read into memory, and the HF output is the
    original."""
    from helpers.hf_models import assert_same_hf
    from interop.converters.megatron import torch_dist

    hf = hf_checkpoints["llama"]
    convert(hf, tmp_path / "dist", dst_format="megatron", format="torch_dist")
    reader = torch_dist.Reader(tmp_path / "dist")
    names = [m.name for m in reader.metas()]
    assert all(reader.byte_ranges(n) for n in names)
    q = reader.byte_ranges("layers.0.attn.q.weight")
    assert len(q) == 4  # one range per query group (4 kv groups), between them k and v of the group

    read, original = [], torch_dist.Reader.read

    def recorded(self, name):
        read.append(name)
        return original(self, name)
    monkeypatch.setattr(torch_dist.Reader, "read", recorded)
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf")
    # only the vocab tensors are read: Megatron padded their 250 rows to 256, HF holds 250 (a different shape)
    assert sorted(read) == ["embed.word.weight", "lm_head.weight"]
    assert_same_hf(hf, tmp_path / "back")


def test_background_writes_give_the_same_bytes(tmp_path):
    """DistWriter on the helper thread (the engine's `background_writes`) writes the same files as in the
    caller's thread: the same chunks at the same offsets."""
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(40, 64, generator=g) for _ in range(6)]

    def write(path):
        out = DistWriter(path, lambda key, layer: 0 if layer is None else 1 + layer % 2)
        out.declare(QKV, torch.float32, (6, 40, 64))
        out.declare("embedding.word_embeddings.weight", torch.float32, (16, 64))
        out.write_object("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_6", None)
        for i, t in enumerate(layers):
            out.write(QKV, i, t)
        out.write("embedding.word_embeddings.weight", None, torch.ones(16, 64))
        out.finish({"iteration": 1})

    write(tmp_path / "sync")
    with background.background_writes():
        write(tmp_path / "bg")
    for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp"):
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "bg" / name).read_bytes(), name
    a, b = (DistCheckpoint(tmp_path / d)._reader.read_metadata() for d in ("sync", "bg"))
    assert a.state_dict_metadata == b.state_dict_metadata and list(a.storage_data.items()) == list(b.storage_data.items())


def test_a_regular_grid_of_chunks_is_checked_in_one_pass(monkeypatch):
    """mcore's stacked experts ([layers, experts, ...] in [1, 1, ...] chunks) tile their tensor when they sit at
    distinct grid cells, one per cell; that is seen without the pairwise sweep (seconds per key at 256
    experts).  Anything else still goes through the sweep, which refuses overlaps."""
    from interop.io.dcp_metadata import ChunkStorageMetadata as C
    S = torch.Size
    grid = [C(S([layer, e, 0, 0]), S([1, 1, 8, 4])) for layer in range(61) for e in range(256)]
    assert md._regular_grid(S([61, 256, 8, 4]), grid)
    assert not md._regular_grid(S([61, 256, 8, 4]), grid[:-1])  # a cell missing
    assert not md._regular_grid(S([61, 256, 8, 4]), grid[:-1] + grid[:1])  # a cell twice
    assert not md._regular_grid(S([4, 6]), [C(S([0, 0]), S([4, 3])), C(S([0, 2]), S([4, 3]))])  # off the grid
    assert md._regular_grid(S([4, 6]), [C(S([0, 3]), S([4, 3])), C(S([0, 0]), S([4, 3]))])


def test_overlapping_chunks_are_still_refused(tmp_path):
    """A hand-edited .metadata whose two chunks overlap (same shape, off the grid) is refused with one line."""
    import pickle
    path, _ = _written(tmp_path)
    meta = DistCheckpoint(path)._reader.read_metadata()
    chunks = meta.state_dict_metadata[QKV].chunks
    chunks[2].offsets = chunks[1].offsets  # layers 1 and 2 both claim layer 1's place; layer 2 is uncovered
    with open(path / ".metadata", "wb") as f:
        md.dcp_metadata.dump(meta, f)
    with pytest.raises(InteropError, match="overlap"):
        DistCheckpoint(path)
