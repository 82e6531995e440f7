"""`interop map-args`: Megatron arguments <-> MindSpeed-Core-MS / MindFormers YAML, HF config, ...

The pipeline is: read the source into Megatron's terms (an args file or launch
script, a Megatron checkpoint's stored args, or any file this module writes),
complete it with Megatron's defaults and derived values, write the target
through its table in `interop.mappings`, and then read the result back. The
read-back is what makes the report honest: every argument the user gave that
does not come back unchanged is listed (flag, value, why), and `--strict`
turns such a loss into an error.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from . import argsfile
from .errors import InteropError
from .mappings import colossalai, deepspeed, hf_args, mindformers, mindformers_legacy, mindspeed
from .mappings import megatron_args as M

TARGETS = ("mindspeed", "mindformers", "mindformers-legacy", "hf", "megatron", "colossalai", "deepspeed")
_MISSING = object()


@dataclass
class Entry:
    """One thing that did not map: the flag (or target key), its value, and why."""

    flag: str
    value: object
    why: str
    lost: bool = True  # False: the target re-derives the same value, nothing is lost


@dataclass
class Source:
    """A source read into Megatron's terms: the values it gives, and what it could not say."""

    path: str
    format: str
    explicit: dict
    entries: list[Entry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Result:
    text: str
    source: Source
    target: str
    entries: list[Entry]
    warnings: list[str]

    def report(self) -> dict:
        return {
            "source": self.source.path,
            "source_format": self.source.format,
            "target": self.target,
            "unmapped": [asdict(e) for e in self.entries],
            "warnings": self.warnings,
        }


# ---------------------------------------------------------------- Megatron tokens

def _convert(arg: M.Arg, flag: str, raw: str, where: str):
    kind = {M.INTS: M.INT, M.FLOATS: M.FLOAT, M.STRS: M.STR}.get(arg.kind, arg.kind)
    if ("${" in raw or raw.startswith("$(")) and kind != M.STR:
        raise InteropError(f"{where}: {flag} {raw}: the variable is not set in the file (pass -e NAME=VALUE)")
    try:
        value = int(raw) if kind == M.INT else float(raw) if kind == M.FLOAT else raw
    except ValueError:
        want = "an integer" if kind == M.INT else "a number"
        raise InteropError(f"{where}: {flag} expects {want}, got {raw!r}") from None
    if arg.choices and value not in arg.choices:
        raise InteropError(f"{where}: {flag} must be one of {', '.join(map(str, arg.choices))}, got {raw!r}")
    return value


def _is_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)  # a negative number is a value
        return True
    except ValueError:
        return False


def parse_tokens(tokens: list[str], where: str = "args") -> tuple[dict, list[Entry], list[str]]:
    """Megatron's argparse, for our purpose: (explicit values by dest, unknown flags, warnings)."""
    explicit: dict = {}
    unknown: list[Entry] = []
    warnings: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            if token.startswith("${") or token.startswith("$("):
                warnings.append(f"{token}: not set in the file, ignored (pass -e NAME=VALUE)")
            else:
                unknown.append(Entry(token, None, "stray word, not a flag value (an unquoted value with spaces?)"))
            continue
        flag, eq, inline = token.partition("=")
        arg = M.FLAGS.get(flag)
        if arg is None:
            values = [inline] if eq else []
            while not eq and i < len(tokens) and _is_value(tokens[i]):
                values.append(tokens[i])
                i += 1
            value = values[0] if len(values) == 1 else (values or True)
            unknown.append(Entry(flag, value, "not a Megatron-LM (core_v0.16) or MindSpeed argument"))
            continue
        if arg.kind in M.BOOLS:
            if eq:
                raise InteropError(f"{where}: {flag} is a switch and takes no value, got {inline!r}")
            value = {M.TRUE: True, M.FALSE: False}.get(arg.kind, flag != arg.flags[-1])
        elif arg.kind in M.LISTS:
            raws = [inline] if eq else []
            while not eq and i < len(tokens) and _is_value(tokens[i]):
                raws.append(tokens[i])
                i += 1
            if not raws:
                raise InteropError(f"{where}: {flag} needs a value")
            value = [_convert(arg, flag, r, where) for r in raws]
        else:
            if eq:
                raw = inline
            elif i < len(tokens) and _is_value(tokens[i]):
                raw = tokens[i]
                i += 1
            else:
                raise InteropError(f"{where}: {flag} needs a value")
            value = _convert(arg, flag, raw, where)
        explicit[arg.dest] = value
    return explicit, unknown, warnings


def format_args(explicit: dict) -> tuple[str, list[Entry]]:
    """The flags that say `explicit` to Megatron (defaults and re-derivable values left out)."""
    full = M.complete(explicit)
    flags = M.normalize({d: v for d, v in full.items() if v != M.ARGS[d].default and d in M.ARGS})
    lines, entries, env = [], [], []
    for arg in M.ALL:
        if arg.dest not in flags or M.ARGS[arg.dest] is not arg:
            continue
        value = flags[arg.dest]
        if value == arg.default:
            continue
        if not arg.flags:
            if arg.dest == "world_size":
                env.append(f"WORLD_SIZE={value}")
            else:
                entries.append(Entry(arg.dest, value, "Megatron has no flag for it and the other flags do not imply it"))
            continue
        if arg.kind == M.TRUE:
            if value:
                lines.append(arg.flag)
        elif arg.kind == M.FALSE:
            if value is False:
                lines.append(arg.flag)
        elif arg.kind == M.BOOLOPT:
            lines.append(arg.flags[0] if value else arg.flags[1])
        elif value is None:
            entries.append(Entry(arg.flag, None, "Megatron cannot unset it from the command line"))
        elif isinstance(value, list):
            lines.append(" ".join([arg.flag] + [shlex.quote(str(v)) for v in value]))
        else:
            lines.append(f"{arg.flag} {shlex.quote(repr(value) if isinstance(value, float) else str(value))}")
    header = ["# Megatron-LM arguments written by `interop map-args`; read them with `interop map-args FILE`."]
    body = " \\\n".join(lines)
    return "\n".join(header + env + ([body] if body else [])) + "\n", entries


# ---------------------------------------------------------------- target tables

def _get(doc: dict, path: str):
    node = doc
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _set(doc: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def write_table(full: dict, rows) -> tuple[dict, dict]:
    """(target document, {dest: why} for values the target cannot express)."""
    doc: dict = {}
    why: dict = {}
    for row in rows:
        values = [full.get(s) for s in row.source]
        if row.to is None:
            value = values[0]
        elif len(row.source) == 1 and values[0] is None:
            value = None
        else:
            try:
                value = row.to(*values)
            except M.Unmappable as exc:
                for s in row.source:
                    why.setdefault(s, f"{row.path}: {exc}")
                value = M.OMIT if row.default is None else row.default
        if value is M.OMIT:
            continue
        if value is None and len(row.source) == 1 and M.ARGS[row.source[0]].kind in M.BOOLS:
            value = False  # a switch Megatron leaves at None is off, whatever the target's default
        _set(doc, row.path, row.default if value is None else value)
    return doc, why


def read_table(doc: dict, rows, target: str) -> tuple[dict, list[Entry]]:
    """Megatron values from a target document, and the document's keys no row reads."""
    values: dict = {}
    for row in rows:
        value = _get(doc, row.path)
        if value is _MISSING:
            value = row.default
        if value is None:
            continue
        if row.unset and value == row.default:
            continue  # the target's own default standing in for Megatron's "not set"
        if row.back is not None:
            values.update(row.back(value, doc))
        elif row.source:
            values[row.source[0]] = value
    read = {row.path for row in rows}
    entries = [Entry(path, value, f"no Megatron equivalent for this {target} key")
               for path, value in _leaves(doc) if path not in read and not any(p.startswith(path + ".") for p in read)]
    return values, entries


def _leaves(doc: dict, prefix: str = ""):
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


# ---------------------------------------------------------------- targets

def _table(target: str, full: dict):
    if target == "mindspeed":
        return mindspeed.ROWS
    if target == "mindformers":
        return mindformers.ROWS
    if target == "mindformers-legacy":
        return mindformers_legacy.ROWS
    if target == "colossalai":
        return colossalai.ROWS
    if target == "deepspeed":
        return deepspeed.ROWS
    if target == "hf":
        return hf_args.rows_for(full)
    raise InteropError(f"--to must be one of {', '.join(TARGETS)}, got {target!r}")


def render(doc: dict, target: str) -> str:
    if target in ("mindspeed", "mindformers", "mindformers-legacy"):
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
    if target in ("hf", "deepspeed"):
        return json.dumps(doc, indent=2) + "\n"
    if target == "colossalai":
        return colossalai.render(doc)
    raise InteropError(f"cannot render {target!r}")


def parse_document(text: str, target: str, where: str) -> dict:
    try:
        if target in ("mindspeed", "mindformers", "mindformers-legacy"):
            doc = yaml.safe_load(text)
        elif target in ("hf", "deepspeed"):
            doc = json.loads(text)
        elif target == "colossalai":
            doc = colossalai.parse(text)
        else:
            raise InteropError(f"cannot read {target!r}")
    except (yaml.YAMLError, json.JSONDecodeError, SyntaxError, ValueError) as exc:
        raise InteropError(f"{where}: not a readable {target} file ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise InteropError(f"{where}: expected a mapping at the top of the {target} file")
    return doc


def to_target(explicit: dict, target: str) -> tuple[str, dict, dict]:
    """(text, document, {dest: why unmappable}) for the completed args."""
    full = M.complete(explicit)
    if target == "megatron":
        text, entries = format_args(explicit)
        return text, {}, {e.flag: e.why for e in entries}
    if target == "hf":
        hf_args.require(full)
    doc, why = write_table(full, _table(target, full))
    return render(doc, target), doc, why


def read_target(text: str, target: str, where: str = "input") -> tuple[dict, list[Entry], list[str]]:
    """Megatron values from a file this module writes (or a hand-written one of that format)."""
    if target == "megatron":
        launch = argsfile.parse_text(text)
        explicit, unknown, warnings = parse_tokens(launch.tokens, where)
        if launch.world_size:
            explicit["world_size"] = launch.world_size
        return explicit, unknown, warnings
    doc = parse_document(text, target, where)
    rows = hf_args.rows_for_doc(doc, where) if target == "hf" else _table(target, {})
    values, entries = read_table(doc, rows, target)
    return M.normalize(values), entries, []


# ---------------------------------------------------------------- sources

def _detect(path: Path) -> str:
    if path.is_dir():
        return "megatron-checkpoint"
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InteropError(f"{path}: cannot read JSON ({exc})") from None
        if isinstance(doc, dict) and ("ds_config" in doc or "parallel_mode" in doc):
            return "deepspeed"
        return "hf"
    if suffix in (".yaml", ".yml"):
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise InteropError(f"{path}: cannot read YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(doc, dict):
            raise InteropError(f"{path}: expected a mapping at the top of the YAML file")
        if "data_parallel" in (doc.get("parallel_config") or {}) or "model" in doc:
            return "mindformers-legacy"
        if "grad_clip_kwargs" in (doc.get("training_config") or {}) or \
                "learning_rate_scheduler_kwargs" in (doc.get("optimizer_config") or {}):
            return "mindformers"
        return "mindspeed"
    if suffix == ".py":
        return "colossalai"
    return "megatron"


def load(path: str | Path, env: dict | None = None, fmt: str = "auto") -> Source:
    """Read any supported source into Megatron's terms."""
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: no such file or directory")
    fmt = _detect(path) if fmt == "auto" else fmt
    if fmt == "megatron-checkpoint":
        return _load_checkpoint(path)
    if fmt == "megatron":
        launch = argsfile.parse_file(path, env)
        explicit, unknown, warnings = parse_tokens(launch.tokens, str(path))
        if launch.world_size and "world_size" not in explicit:
            explicit["world_size"] = launch.world_size
        if not launch.tokens:
            raise InteropError(f"{path}: found no Megatron arguments (no `... pretrain_*.py --flags` line, no --flags)")
        unset = [n for n in launch.unresolved if not n.startswith("$(")]
        if unset:
            warnings.append(f"variables not set in the file: {', '.join(unset)} (pass -e NAME=VALUE)")
        return Source(str(path), fmt, explicit, unknown, warnings)
    if fmt not in TARGETS:
        raise InteropError(f"--from must be auto, megatron-checkpoint or one of {', '.join(TARGETS)}, got {fmt!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InteropError(f"{path}: cannot read ({exc})") from None
    explicit, entries, warnings = read_target(text, fmt, str(path))
    return Source(str(path), fmt, explicit, entries, warnings)


def _torch_load(path: Path):
    """The checkpoint's stored args, through the project's allow-listing unpickler (never plain torch.load)."""
    from .io.safe_pickle import safe_torch_load

    try:
        return safe_torch_load(path)
    except InteropError:
        raise
    except Exception as exc:  # a pickle we refuse or cannot read is the user's file, not our bug
        raise InteropError(f"{path}: cannot read the checkpoint's stored args ({exc.__class__.__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _checkpoint_file(path: Path) -> Path:
    """The file that holds `args`: common.pt (torch_dist) or model_optim_rng.pt (legacy)."""
    if path.is_file():
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        text = tracker.read_text().strip()
        path = path / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if (path / "common.pt").exists():
        return path / "common.pt"
    for name in ("mp_rank_00", "mp_rank_00_000"):
        if (path / name / "model_optim_rng.pt").exists():
            return path / name / "model_optim_rng.pt"
    raise InteropError(f"{path}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, common.pt "
                       "or mp_rank_00*/model_optim_rng.pt)")


def _load_checkpoint(path: Path) -> Source:
    file = _checkpoint_file(path)
    state = _torch_load(file)
    args = state.get("args") if isinstance(state, dict) else None
    if args is None:
        raise InteropError(f"{file}: the checkpoint stores no args; give an args file or config.json instead")
    stored = dict(vars(args)) if not isinstance(args, dict) else dict(args)
    explicit, ignored = {}, []
    for key, value in stored.items():
        dest = M.CHECKPOINT_ALIASES.get(key, key)
        arg = M.ARGS.get(dest)
        if arg is None:
            ignored.append(key)
            continue
        value = _plain(value)
        if value != arg.default:
            explicit[dest] = value
    entries = [Entry("(checkpoint args)", sorted(ignored), f"{len(ignored)} stored args interop does not model",
                     lost=False)] if ignored else []
    return Source(str(path), "megatron-checkpoint", explicit, entries, [])


def _plain(value):
    """Checkpoint values as plain data: dtypes and enums by name, tuples as lists."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    text = str(value)
    if text.startswith("torch."):
        return {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}.get(text, text)
    return getattr(value, "name", text)


# ---------------------------------------------------------------- the whole job

def check(source: Source) -> tuple[dict, list[str]]:
    """Completed args, or an InteropError naming contradicting or missing flags."""
    full = M.complete(source.explicit)
    missing = M.missing_required(full)
    if missing:
        raise InteropError(f"{source.path}: missing required value: {', '.join(missing)}")
    errors = M.contradictions(full, source.explicit)
    if errors:
        raise InteropError(f"{source.path}: {'; '.join(errors)}")
    return full, M.contradictions(full, source.explicit, M.SOFT_CHECKS)


def losses(explicit: dict, target: str, read_back: dict, why: dict) -> list[Entry]:
    """What the given values lose on the way to `target` and back: the round trip decides.

    Values the user did not give are the target's business (its defaults apply).
    """
    before, after = M.complete(explicit), M.complete(read_back)
    held = {s for row in _table(target, before) for s in row.source} if target != "megatron" else set(M.ARGS)
    entries = []
    for dest, value in explicit.items():
        lost = before.get(dest) != after.get(dest)
        value = True if M.ARGS[dest].kind == M.FALSE and value is False else value  # the switch was given
        if dest in why and lost:
            entries.append(Entry(M.flag_of(dest), value, why[dest]))
        elif dest not in held:
            reason = f"no {target} field for it" + ("" if lost else f" ({target} re-derives the same value)")
            entries.append(Entry(M.flag_of(dest), value, reason, lost))
        elif lost:
            entries.append(Entry(M.flag_of(dest), value, f"{target} reads it back as {after.get(dest)!r}"))
    return entries


def map_args(path: str | Path, to: str, env: dict | None = None, fmt: str = "auto", strict: bool = False) -> Result:
    """Read `path`, write it as `to`, and say what did not survive. The Python face of the CLI."""
    if to not in TARGETS:
        raise InteropError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    source = load(path, env, fmt)
    _, soft = check(source)
    text, _, why = to_target(source.explicit, to)
    back, _, _ = read_target(text, to, f"{to} output")
    entries = source.entries + losses(source.explicit, to, back, why)
    result = Result(text, source, to, entries, source.warnings + soft)
    if strict:
        lost = [e for e in entries if e.lost]
        if lost:
            shown = ", ".join(f"{e.flag}={e.value!r}" for e in lost[:5]) + (" ..." if len(lost) > 5 else "")
            raise InteropError(f"--strict: {len(lost)} value(s) do not map to {to}: {shown}")
    return result
