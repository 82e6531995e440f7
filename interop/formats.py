"""The checkpoint formats `convert`, `inspect` and `verify` speak, by name.

Core knows no format.  Each format registers itself as an entry point in the `interop.formats`
group (pyproject.toml: `name = "module"`); the module has `detect(path) -> bool`, `Reader` and
`Writer`.  Modules are imported on first use, so a format's dependencies never slow down the
others, and the names are read from the installed metadata without importing anything.
Detection tries the formats in name order, and each format's `detect` claims only its own files;
the one overlap left is resolved by that order: deepspeed before megatron (a Megatron-DeepSpeed
save also holds Megatron's tracker file; tests/formats/test_deepspeed.py holds it).

A format's own options (`--dialect`, `--tokenizer`, ...: keywords of its Reader / Writer) are
declared by the format in a light module registered in the `interop.format_options` group
(`OPTIONS`, a tuple of `FormatOption`); the CLI builds its flags from `options(command)` without
importing any converter, and `interop.convert.split_options` routes the values by the keywords
each Reader / Writer declares (`options`, `interop.contract`).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from .errors import InteropError

GROUP = "interop.formats"
SOURCE_ONLY_GROUP = "interop.source_only_formats"  # formats with a Reader and no Writer, declared in the metadata
OPTIONS_GROUP = "interop.format_options"
OPTION_KINDS = ("text", "int", "path", "flag", "switch")


@functools.lru_cache(maxsize=None)
def registered(group: str, what: str) -> dict[str, str]:
    """{name: module} of an entry-point group, by name, read from the installed metadata without importing
    anything; an empty group is an install that predates it, said in one line."""
    found = {ep.name: ep.value for ep in entry_points(group=group)}
    if not found:
        raise InteropError(f"no {what} are registered (entry point group {group!r}): reinstall "
                           "interop (`pip install -e .` or `bash scripts/setup.sh`) so its metadata lists them")
    return dict(sorted(found.items()))


def _registered() -> dict[str, str]:
    return registered(GROUP, "checkpoint formats")


def names() -> tuple[str, ...]:
    """Every registered format's name, in detection order."""
    return tuple(_registered())


def target_names() -> tuple[str, ...]:
    """The formats interop writes (`--to`): every registered one but those declared a source only."""
    source_only = {ep.name for ep in entry_points(group=SOURCE_ONLY_GROUP)}
    return tuple(name for name in names() if name not in source_only)


def converter(name: str):
    """The module of format `name` (detect, Reader, Writer)."""
    modules = _registered()
    if name not in modules:
        raise InteropError(f"unknown format {name!r} (known: {', '.join(modules)})")
    return importlib.import_module(modules[name])


def reader_of(name: str):
    """Format `name`'s Reader class."""
    return converter(name).Reader


def writer_of(name: str):
    """Format `name`'s Writer class; one line for a format that is read only (a source, never a target)."""
    module = converter(name)
    if not hasattr(module, "Writer"):
        raise InteropError(f"interop reads {name} checkpoints but does not write them: choose another --to")
    return module.Writer


def base_spec_of(src, base) -> "ModelSpec":
    """The ModelSpec of an adapter source's base model, from the base's own checkpoint (any format)."""
    if base is None:
        raise InteropError(f"{src}: a LoRA adapter needs its base model: give --base BASE (a checkpoint of the model "
                           "it was trained on)")
    reader = reader_of(detect_format(base))(base)
    try:
        return reader.source.spec
    finally:
        reader.close()


def detect_format(path) -> str:
    """The name of the one format that claims `path`."""
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: no such file or directory")
    for name in names():
        if converter(name).detect(path):
            return name
    raise InteropError(f"{path}: cannot tell its format (known: {', '.join(names())}); name it with --from")


def looks_like(path, named: str) -> InteropError | None:
    """When the reader of `--from named` refused `path`: if another format claims it and reads it, the one line
    saying it is not a `named` checkpoint and what it looks like (its first entries); else None (keep the reader's
    own error)."""
    try:
        found = detect_format(path)
    except InteropError:
        return None
    if found == named:
        return None
    try:  # the files must open as `found` too: a damaged `named` checkpoint (a DeepSpeed save whose tag folder is
        reader_of(found)(path).close()  # missing also holds Megatron's tracker) keeps its reader's own error
    except InteropError:
        return None
    path = Path(path)
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()) if path.is_dir() else [path.name]
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    return InteropError(f"{path}: not {_a(named)} checkpoint; it looks like {_a(found)} checkpoint ({shown}): "
                        f"pass --from {found}, or leave --from out")


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" or name == "hf" else f"a {name}"


# ---------------------------------------------------------------- the formats' own options

@dataclass(frozen=True)
class FormatOption:
    """One option a format's Reader or Writer takes as a keyword (`name`; the flag is --name-with-dashes).

    helps: the command that offers it ("convert", "inspect") -> its help text there.  kind: "text",
    "int", "path", "flag" (--x) or "switch" (--x/--no-x); a value left out is None and reaches no one.
    choices: the values a text takes."""

    name: str
    helps: dict = field(hash=False)
    kind: str = "text"
    choices: tuple = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.lru_cache(maxsize=1)
def _option_modules() -> dict[str, str]:
    return dict(sorted((ep.name, ep.value) for ep in entry_points(group=OPTIONS_GROUP)))


def declared_options() -> dict[str, tuple]:
    """{format: its FormatOptions}, from the light modules the formats register (no converter imported)."""
    return {name: importlib.import_module(module).OPTIONS for name, module in _option_modules().items()}


def options(command: str) -> list[FormatOption]:
    """The options `command` offers, one per flag, in format-name order.  Formats that take the same
    keyword (`--dp`, `--model-config`) must declare it alike; their help texts are joined."""
    merged: dict[str, FormatOption] = {}
    for fmt, declared in declared_options().items():
        for option in declared:
            if option.kind not in OPTION_KINDS:
                raise InteropError(f"format {fmt}: {option.flag} has kind {option.kind!r} (known: "
                                   f"{', '.join(OPTION_KINDS)})")
            if command not in option.helps:
                continue
            seen = merged.get(option.name)
            if seen is None:
                merged[option.name] = FormatOption(option.name, {command: option.helps[command]}, option.kind,
                                                   tuple(option.choices))
                continue
            if (seen.kind, seen.choices) != (option.kind, tuple(option.choices)):
                raise InteropError(f"format {fmt} declares {option.flag} unlike another format does "
                                   f"({option.kind} {option.choices} vs {seen.kind} {seen.choices})")
            text = seen.helps[command]
            if option.helps[command] not in text:
                merged[option.name] = FormatOption(seen.name, {command: f"{text} {option.helps[command]}"},
                                                   seen.kind, seen.choices)
    return list(merged.values())
