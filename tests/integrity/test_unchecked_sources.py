"""A conversion whose source holds tensor bytes no checksum covers says so in its summary, naming `verify`
(issue 30: damage there is undetectable by reading); a source whose every record has a CRC-32 does not."""
from __future__ import annotations

import torch

from interop.convert import convert

from helpers.hf_models import save


def _unchecked(summary) -> list[str]:
    return [line for line in summary.lines() if line.startswith("  unchecked:")]


def test_safetensors_and_bare_ckpt_sources_say_verify_finds_damage(tmp_path):
    save("llama", tmp_path / "hf")
    to_ms = convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore")
    assert _unchecked(to_ms) == [f"  unchecked: HF safetensors files carry no checksums; damaged tensor bytes there "
                                 f"show only in `interop verify {tmp_path / 'hf'} {tmp_path / 'ms'}`"]
    from_ms = convert(tmp_path / "ms", tmp_path / "meg", dst_format="megatron")
    assert "MindSpore .ckpt files without a crc_num trailer" in _unchecked(from_ms)[0]


def test_sources_with_record_checksums_say_nothing(tmp_path):
    model = save("llama", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "meg", dst_format="megatron", tp=2)
    assert _unchecked(convert(tmp_path / "meg", tmp_path / "back", dst_format="hf")) == []  # zip record CRC-32s
    (tmp_path / "bin").mkdir()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    assert _unchecked(convert(tmp_path / "bin", tmp_path / "st", dst_format="hf")) == []
