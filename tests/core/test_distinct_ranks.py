"""interop.distinct_ranks: the one helper every sharded reader asks whether a rank file copies another.

Equal sums refuse the later file, naming both and the flag; sums None (no checksum) are never compared; where
the sums are a sample, only a pair `confirm` finds byte-identical counts; `allow` turns the refusal into a note.
A torch file's sums are its split tensors' zip record CRC-32s and sizes (read from the directory)."""
import pytest
import torch

from interop.distinct_ranks import RankPrint, check_distinct, record_sums
from interop.errors import InteropError
from interop.io.torch_file import LazyTorchFile


def _member(path, rank, sums):
    return RankPrint(path, f"tensor-parallel rank {rank}", sums, "every split tensor (2)")


def test_equal_sums_refuse_the_later_file_naming_both_and_the_flag():
    group = [_member("a.pt", 0, (1, 2)), _member("b.pt", 1, (3, 4)), _member("c.pt", 2, (1, 2))]
    with pytest.raises(InteropError) as exc:
        check_distinct(group, [], allow=False)
    line = str(exc.value)
    assert line.startswith("c.pt: every split tensor (2) is byte-identical to tensor-parallel rank 0's (a.pt)")
    assert "--allow-identical-ranks" in line and "\n" not in line


def test_unknown_sums_and_unconfirmed_samples_pass():
    notes = []
    check_distinct([_member("a", 0, None), _member("b", 1, None)], notes, allow=False)
    check_distinct([_member("a", 0, b"head"), _member("b", 1, b"head")], notes, allow=False,
                   confirm=lambda a, b: False)  # the samples agree, the files do not
    assert notes == []
    with pytest.raises(InteropError, match="b: every split tensor"):
        check_distinct([_member("a", 0, b"head"), _member("b", 1, b"head")], [], allow=False,
                       confirm=lambda a, b: True)


def test_allow_notes_instead():
    notes = []
    check_distinct([_member("a", 0, (1,)), _member("b", 1, (1,))], notes, allow=True)
    assert notes == ["b: every split tensor (2) byte-identical to tensor-parallel rank 0's (read as given: "
                     "--allow-identical-ranks)"]


def test_record_sums_of_torch_files(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    torch.save({"w": w, "b": torch.zeros(3)}, tmp_path / "a.pt")
    torch.save({"w": w.clone(), "b": torch.zeros(3)}, tmp_path / "b.pt")
    torch.save({"w": torch.randn(4, 3), "b": torch.zeros(3)}, tmp_path / "c.pt")
    a, b, c = (LazyTorchFile(tmp_path / f"{n}.pt") for n in "abc")
    sums = [record_sums(f, f.obj.items()) for f in (a, b, c)]
    assert sums[0] == sums[1] != sums[2]
    assert {key for key, _, _ in sums[0]} == {"w", "b"}
    assert record_sums(a, [("scalar", 3)]) is None  # nothing a checksum covers
