"""Where each zip record's data lies (`interop.io.zip_records`): the torch.save reader and the torch_dist chunk
reader both take a tensor's bytes from there."""
import io
import os
import zipfile

import pytest
import torch

from interop.io.zip_records import BadLocalHeader, zip_records


def test_each_records_data_offset_size_and_crc_are_where_torch_save_put_them(tmp_path):
    path = tmp_path / "t.pt"
    tensor = torch.arange(12, dtype=torch.float32)
    torch.save({"w": tensor}, path)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        records = list(zip_records(z, f.fileno()))
        data = next(r for r in records if r.name.endswith("/data/0"))
        assert data.stored and data.size == 48 and data.crc == z.getinfo(data.name).CRC
        assert raw[data.offset:data.offset + data.size] == tensor.numpy().tobytes()


def test_a_zip_inside_a_file_is_read_from_its_base_and_a_bad_local_header_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save(torch.ones(3), buf)
    path = tmp_path / "chunk.distcp"
    path.write_bytes(b"x" * 100 + buf.getvalue())
    fd = os.open(path, os.O_RDONLY)
    try:
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            data = next(r for r in zip_records(z, fd, 100) if r.name.endswith("/data/0"))
            assert os.pread(fd, data.size, 100 + data.offset) == torch.ones(3).numpy().tobytes()
            with pytest.raises(BadLocalHeader, match="bad local header"):
                list(zip_records(z, fd, 99))
    finally:
        os.close(fd)
