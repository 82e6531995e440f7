"""Format-specific options are declared by the formats (issue 14: "the CLI is a thin click layer").

Each format lists its Reader's / Writer's keywords in a light module registered in the
`interop.format_options` entry point group; `interop convert` / `inspect` build their flags from it.
These tests hold the declarations to the constructors they describe, and the CLI to the declarations.
"""
from __future__ import annotations

import inspect as pyinspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from interop import formats
from interop.cli.main import main
from interop.errors import InteropError

ROOT = Path(__file__).resolve().parents[2]
# The flags `interop convert` offered before the formats declared them (cli/convert.py, issue 14): all kept.
FORMAT_FLAGS = ["--format", "--iteration", "--distributed-optimizer", "--no-distributed-optimizer",
                "--model-config", "--dialect", "--qkv-concat", "--qkv-layout", "--qkv-bias-layout",
                "--src-qkv-layout", "--src-qkv-bias-layout", "--dp", "--tokenizer", "--max-shard-size", "--dcp-layout"]


def _keywords(cls) -> set:
    """The keywords opening `cls` takes (its __init__'s, or its __new__'s: Megatron's classes pick a layout's)."""
    return set(pyinspect.signature(cls).parameters) if cls is not None else set()


def test_every_declared_option_is_a_keyword_of_its_formats_reader_or_writer():
    """A declaration cannot promise what the format does not take: each name is a keyword of that format's
    Reader (if offered by inspect, of the Reader) or Writer."""
    declared = formats.declared_options()
    assert set(declared) == {"atorch", "dcp", "hf", "megatron", "mindspore", "state_dict"}
    for fmt, options in declared.items():
        module = formats.converter(fmt)
        reader, writer = _keywords(module.Reader), _keywords(getattr(module, "Writer", None))
        for option in options:
            assert option.name in reader | writer, (fmt, option.name)
            if "inspect" in option.helps:
                assert option.name in reader, (fmt, option.name)


def test_the_registry_is_pyprojects():
    """The installed metadata lists the option modules pyproject names (a stale install would hide flags)."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][formats.OPTIONS_GROUP]
    assert formats._option_modules() == dict(sorted(listed.items()))


def test_convert_help_shows_every_format_flag_with_its_help_and_an_example():
    out = CliRunner().invoke(main, ["convert", "--help"], terminal_width=200).output
    for flag in FORMAT_FLAGS:
        assert flag in out, flag
    assert "interop convert ./llama-hf ./llama-mf --to mindspore --dialect mindformers --qkv-concat" in out
    for option in formats.options("convert"):
        assert " ".join(option.helps["convert"].split())[:40] in " ".join(out.split()), option.flag
    shared = {o.name: o.helps["convert"] for o in formats.options("convert")}
    assert "Megatron torch format" in shared["dp"] and "MindSpeed" in shared["dp"]  # both formats' meanings


def test_inspect_offers_the_readers_options_only():
    out = CliRunner().invoke(main, ["inspect", "--help"]).output
    assert "--model-config" in out and "--iteration" in out and "describe" in out
    assert "--dialect" not in out and "--tokenizer" not in out


def test_the_example_with_a_format_option_works(hf_checkpoints, tmp_path):
    """The --help example: a format's own flags reach its writer (MindFormers fused w_qkv)."""
    result = CliRunner().invoke(main, ["convert", str(hf_checkpoints["llama"]), str(tmp_path / "mf"), "--to",
                                       "mindspore", "--dialect", "mindformers", "--qkv-concat", "-q"])
    assert result.exit_code == 0, result.output
    from interop.io.ms_ckpt import CkptFile
    names = set(CkptFile(next((tmp_path / "mf").rglob("*.ckpt"))).keys())
    assert any(".w_qkv." in n for n in names) and any(".w_gate_hidden." in n for n in names)


@pytest.mark.parametrize("args,message", [
    (["--to", "hf", "--dialect", "mindformers"], "--dialect does not apply to a interop -> hf conversion"),
    (["--to", "interop", "--tokenizer", "x"], "--tokenizer does not apply to a interop -> interop conversion"),
    (["--to", "hf", "--format", "zip"], "'zip' is not one of"),
])
def test_a_format_option_where_it_does_not_apply_is_one_error_line(hf_checkpoints, tmp_path, args, message):
    from interop.convert import convert
    convert(hf_checkpoints["gpt2"], tmp_path / "store", dst_format="interop")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "store"), str(tmp_path / "out"), *args, "-q"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_formats_declaring_one_keyword_differently_are_refused(monkeypatch):
    a = (formats.FormatOption("dp", {"convert": "A's dp."}, kind="int"),)
    b = (formats.FormatOption("dp", {"convert": "B's dp."}, kind="text"),)
    monkeypatch.setattr(formats, "declared_options", lambda: {"a": a, "b": b})
    with pytest.raises(InteropError, match="declares --dp unlike another format"):
        formats.options("convert")
    monkeypatch.setattr(formats, "declared_options", lambda: {"a": a, "b": (b[0].__class__("dp", b[0].helps, "int"),)})
    assert formats.options("convert")[0].helps["convert"] == "A's dp. B's dp."


def test_reading_the_registry_imports_no_converter():
    code = ("import sys; from interop.formats import options; options('convert'); options('inspect');"
            "print(sorted(m for m in sys.modules if m.startswith('interop.converters') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
