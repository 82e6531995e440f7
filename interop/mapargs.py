"""`interop map-args`: Megatron arguments <-> MindSpeed-Core-MS / MindFormers YAML, HF config, ...

The pipeline is: read the source into Megatron's terms (an args file or launch
script, a Megatron checkpoint's stored args, or any file this module writes),
complete it with Megatron's defaults and derived values, write the target
through its table in `interop.mappings` (a HF config.json through ModelSpec,
`mappings/hf_args.py`, as `interop convert --to hf` writes it), and then read
the result back. The
read-back is what makes the report honest: every argument the user gave that
does not come back unchanged is listed (flag, value, why), and `--strict`
turns such a loss into an error.

Each format is a registered target (`interop.argtargets`: one module each, an entry point in the
`interop.mapargs_targets` group); this module is the engine and asks them, never compares their names.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import argtargets
from .argtable import Unmapped, short
from .argtargets.megatron import convert, format_args, parse_tokens  # noqa: F401  (Megatron's flags, re-exported)
from .errors import InteropError
from .mappings import megatron_args as M

DEFAULT_TARGET = "mindspeed"  # the seed tutorial's direction: Megatron -> MindSpeed-Core-MS
TARGETS = argtargets.writable()  # what --to offers, in name order
SOURCES = argtargets.names()  # what --from takes beside auto: the targets and the read-only formats
# The formats whose model sizes its position table by seq_length (MindSpore's), and the YAML ones.
MINDSPORE_FAMILY = tuple(n for n in SOURCES if argtargets.get(n).positions_from_seq_length)
YAML_TARGETS = tuple(n for n in SOURCES if isinstance(argtargets.get(n), argtargets.YamlTarget))


@dataclass
class ArgsSource:
    """A source read into Megatron's terms: the values it gives, and what it could not say."""

    path: str
    format: str
    explicit: dict
    entries: list[Unmapped] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Result:
    text: str
    source: ArgsSource
    target: str
    entries: list[Unmapped]
    warnings: list[str]

    def report(self) -> dict:
        return {
            "source": self.source.path,
            "source_format": self.source.format,
            "target": self.target,
            "unmapped": [{k: v for k, v in asdict(e).items() if k != "group" or v} for e in self.entries],
            "warnings": self.warnings,
        }


def detect(path: Path) -> str:
    """The source format, from the file's content (never its name); a file that fits none says --from."""
    return argtargets.detect(Path(path))


def _writer(target: str) -> argtargets.ArgsTarget:
    offered = argtargets.writable()
    if target not in offered:
        raise InteropError(f"--to must be one of {', '.join(offered)}, got {target!r}")
    return argtargets.get(target)


def to_target(explicit: dict, target: str) -> tuple[str, dict, dict]:
    """(text, document, {dest: why unmappable}) for the completed args."""
    return _writer(target).write(explicit)[:3]


def read_target(text: str, target: str, where: str = "input") -> tuple[dict, list[Unmapped], list[str]]:
    """Megatron values from a file this module writes (or a hand-written one of that format)."""
    if target not in argtargets.names():
        raise InteropError(f"cannot read {target!r}")
    return argtargets.get(target).read(text, where)


# ---------------------------------------------------------------- sources

def _set_values(pairs: dict, where: str = "--set") -> dict:
    """--set NAME=VALUE pairs (a Megatron dest or flag) as Megatron values."""
    explicit: dict = {}
    for name, raw in (pairs or {}).items():
        dest = name.lstrip("-").replace("-", "_")
        arg = M.ARGS.get(dest)
        if arg is None:
            raise InteropError(f"{where} {name}: not a Megatron argument interop knows")
        if dest == "world_size":
            if not (raw.isascii() and raw.isdigit()):
                raise InteropError(f"{where} world_size: expects an integer, got {short(raw)}")
            explicit[dest] = int(raw)
            continue
        flag = arg.flag or "--" + dest.replace("_", "-")
        if arg.kind in M.BOOLS:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise InteropError(f"{where} {name}: a switch takes true or false, got {short(raw)}")
            explicit[dest] = raw.lower() in ("true", "1")
            continue
        if arg.kind in M.LISTS:
            explicit[dest] = [convert(arg, flag, r, where)[0] for r in raw.split(",")]
        else:
            explicit[dest] = convert(arg, flag, raw, where)[0]
    return explicit


def load(path: str | Path, env: dict | None = None, fmt: str = "auto", values: dict | None = None) -> ArgsSource:
    """Read any supported source into Megatron's terms; `values` (--set) are given over the file's."""
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: no such file or directory")
    try:
        source = _load(path, env, fmt)
    except RecursionError:
        raise InteropError(f"{path}: nested too deeply to be a config file") from None
    except MemoryError:
        raise InteropError(f"{path}: too big to be a config file") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        # A value of the wrong shape where a reader expects another (a list for a number, a missing
        # section): the file's mistake, said in one line.
        raise InteropError(f"{path}: not a readable config: {exc.__class__.__name__}: "
                           f"{short(str(exc))}") from None
    if values:
        source.explicit.update(_set_values(values))
    if argtargets.get(source.format).positions_from_seq_length and "max_position_embeddings" not in source.explicit \
            and source.explicit.get("seq_length"):
        # These models size their position table by seq_length: it is max_position_embeddings.
        source.explicit["max_position_embeddings"] = source.explicit["seq_length"]
    return source


def _load(path: Path, env: dict | None, fmt: str) -> ArgsSource:
    fmt = detect(path) if fmt == "auto" else fmt
    if fmt not in argtargets.names():
        raise InteropError(f"--from must be auto or one of {', '.join(argtargets.names())}, got {fmt!r}")
    explicit, entries, warnings = argtargets.get(fmt).load(path, env)
    return ArgsSource(str(path), fmt, explicit, entries, warnings)


# ---------------------------------------------------------------- the whole job

def check(source: ArgsSource, needs_model: bool = True) -> tuple[dict, list[str]]:
    """Completed args, or an InteropError naming contradicting or missing flags.

    The model's sizes are required where the source describes a model and the target holds one (an adapter's
    settings, PEFT's adapter_config.json, neither give nor need them)."""
    full = M.complete(source.explicit)
    missing = M.missing_required(full) if needs_model else []
    if argtargets.get(source.format).positions_from_seq_length:
        missing = ["--seq-length" if m == "--max-position-embeddings" else m for m in missing]
    if missing and argtargets.get(source.format).describes_model:
        given = " ".join(f"--set {m.lstrip('-').replace('-', '_')}=N" for m in missing)
        raise InteropError(f"{source.path}: missing required value: {', '.join(missing)} (the {source.format} "
                           f"file does not give it; give it with {given}, or -e NAME=VALUE for a script's variables)")
    errors = M.contradictions(full, source.explicit)
    if errors:
        raise InteropError(f"{source.path}: {'; '.join(errors)}")
    return full, M.contradictions(full, source.explicit, M.SOFT_CHECKS)


def _held(target: str, before: dict) -> set:
    return argtargets.get(target).held(before)


def _position(dest: str, args: dict):
    """A value as the run sees it: a switch Megatron leaves at None is in its default position (off for
    store_true, on for store_false), so a target's explicit False reads back as the same run."""
    kind, value = M.ARGS[dest].kind, args.get(dest)
    if kind == M.TRUE:
        return bool(value)
    if kind == M.FALSE:
        return value is not False
    return value


def losses(explicit: dict, target: str, read_back: dict, why: dict) -> list[Unmapped]:
    """What the given values lose on the way to `target` and back: the round trip decides.

    Values the user did not give are the target's business (its defaults apply); a given value
    the target re-derives exactly (a batch size from the micro-batch count) is not a loss.
    """
    writer = argtargets.get(target)
    before = M.complete(explicit)
    held = writer.held(before)
    launch = {"world_size": explicit["world_size"]} if "world_size" in explicit and "world_size" not in held else {}
    after = M.complete(M.normalize({**launch, **read_back}))  # launched on as many ranks as before
    entries = []
    for dest, value in explicit.items():
        if dest in launch:
            kept = read_back.get(dest) == value  # beside the document (a YAML's `# launch:` comment, WORLD_SIZE=)
            entries.append(Unmapped(M.flag_of(dest), value, f"the launcher's rank count: no {target} field for it "
                                    f"({'the file gives it back; ' if kept else ''}launch the job on {value} ranks; the "
                                    "batch split assumes it)", lost=not kept))
            continue
        lost = _position(dest, before) != _position(dest, after) and not writer.holds(dest, before, after) and not (
            dest in M.SAME_MEANING and M.SAME_MEANING[dest](before, after))
        value = True if M.ARGS[dest].kind == M.FALSE and value is False else value  # the switch was given
        flag = M.flag_of(dest)
        if dest in why or flag in why:
            entries.append(Unmapped(flag, value, why.get(dest) or why[flag]))
        elif not lost:
            note = writer.note(dest, value)
            if note:
                entries.append(Unmapped(flag, value, note, lost=False))
        elif dest not in held:
            entries.append(Unmapped(flag, value, writer.unheld_why(dest) or f"no {target} field for it",
                                    group=writer.unheld_group))
        else:
            entries.append(Unmapped(flag, value, f"{target} reads it back as {after.get(dest)!r}"))
    for dest, text in why.items():  # a value not given but lost all the same (a default the target cannot hold)
        if dest in M.ARGS and dest not in explicit and before.get(dest) != after.get(dest):
            entries.append(Unmapped(M.flag_of(dest), before.get(dest), text))
    return entries


def map_args(path: str | Path, to: str = DEFAULT_TARGET, env: dict | None = None, fmt: str = "auto",
             strict: bool = False, values: dict | None = None) -> Result:
    """Read `path`, write it as `to`, and say what did not survive. The Python face of the CLI."""
    writer = _writer(to)
    source = load(path, env, fmt, values)
    _, soft = check(source, writer.describes_model)
    text, _, why, target_warnings = writer.write(source.explicit)
    back, _, _ = writer.read(text, f"{to} output")
    entries = source.entries + losses(source.explicit, to, back, why)
    result = Result(text, source, to, entries, source.warnings + soft + target_warnings)
    if strict:
        lost = [e for e in entries if e.lost]
        if lost:
            shown = ", ".join(f"{e.flag}={e.value!r}" for e in lost[:5]) + (" ..." if len(lost) > 5 else "")
            raise InteropError(f"--strict: {len(lost)} value(s) do not map to {to}: {shown}")
    return result
