"""SafetensorsWriter.write_rows (interop/io/safetensors.py): a stacked tensor written a few rows (an expert) at a
time gives the same file as writing it whole; rows out of plan, past the tensor's end, or a whole tensor written
while one is half done are refused."""
import pytest
import torch
from safetensors.torch import load_file

from interop.io.safetensors import SafetensorsWriter

PLAN = [("a", torch.bfloat16, (3, 4, 5)), ("b", torch.float32, (2,))]


def test_rows_make_the_same_file_as_the_whole_tensor(tmp_path):
    a, b = torch.randn(3, 4, 5).bfloat16(), torch.randn(2)
    whole = SafetensorsWriter(tmp_path / "whole.safetensors", PLAN, {"format": "pt"}, checksum=False)
    whole.write("a", a)
    whole.write("b", b)
    whole.close()
    rows = SafetensorsWriter(tmp_path / "rows.safetensors", PLAN, {"format": "pt"}, checksum=False)
    assert rows.next_key() == "a"
    rows.write_rows("a", a[:1])
    rows.write_rows("a", a[1:].transpose(1, 2).contiguous().transpose(1, 2))  # strided: gathered as a whole tensor is
    assert rows.next_key() == "b"
    rows.write("b", b)
    assert rows.next_key() is None
    rows.close()
    assert (tmp_path / "rows.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    assert torch.equal(load_file(tmp_path / "rows.safetensors")["a"], a)


def test_rows_out_of_plan_are_refused(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", PLAN, checksum=False)
    with pytest.raises(ValueError, match="expected rows 0.. of a"):
        writer.write_rows("b", torch.zeros(2))
    with pytest.raises(ValueError, match="expected rows 0.. of a"):
        writer.write_rows("a", torch.zeros(4, 4, 5, dtype=torch.bfloat16))  # past its 3 rows
    writer.write_rows("a", torch.zeros(2, 4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a"):
        writer.write("a", torch.zeros(3, 4, 5, dtype=torch.bfloat16))  # half done: only its rows
    with pytest.raises(ValueError, match="planned tensors never written"):
        writer.close()
    writer.abort()
