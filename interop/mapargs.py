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
"""
from __future__ import annotations

import ast
import json
import math
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from . import argsfile
from .errors import InteropError
from .io.megatron_save import TRACKER, iteration_name, read_tracker
from .mappings import colossalai, deepspeed, hf_args, mindformers, mindformers_legacy, mindspeed
from .mappings import megatron_args as M
from .mappings.key_mapping import OMIT, Unmappable

TARGETS = ("mindspeed", "mindformers", "mindformers-legacy", "hf", "megatron", "colossalai", "deepspeed")
DEFAULT_TARGET = "mindspeed"  # the seed tutorial's direction: Megatron -> MindSpeed-Core-MS
# Formats read but not written: seed 001's nested `llm:` YAML and an ATorch strategy script.
READ_ONLY = ("mindspeed-nested", "atorch")
MAX_TEXT = 16 * 1024 * 1024  # config files are small; anything bigger is not one
_MISSING = object()


@dataclass
class Unmapped:
    """One thing that did not map: the flag (or target key), its value, and why."""

    flag: str
    value: object
    why: str
    lost: bool = True  # False: the target re-derives the same value, nothing is lost


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
            "unmapped": [asdict(e) for e in self.entries],
            "warnings": self.warnings,
        }


# ---------------------------------------------------------------- Megatron tokens

def _short(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


def _convert(arg: M.Arg, flag: str, raw: str, where: str):
    """(value, note): a value outside Megatron's choices is a fork's, kept with a note, never refused."""
    kind = {M.INTS: M.INT, M.FLOATS: M.FLOAT, M.STRS: M.STR}.get(arg.kind, arg.kind)
    if ("${" in raw or raw.startswith("$(")) and kind != M.STR:
        shown = raw if len(raw) <= 40 else raw[:37] + "..."
        if "$((" in raw:
            raise InteropError(f"{where}: {flag} {shown}: arithmetic interop cannot evaluate (a variable the file "
                               "does not set: pass -e NAME=VALUE; or beyond bash's 64 bits)")
        raise InteropError(f"{where}: {flag} {shown}: the variable is not set in the file (pass -e NAME=VALUE)")
    try:
        value = int(raw) if kind == M.INT else float(raw) if kind == M.FLOAT else raw
        if kind == M.FLOAT and not math.isfinite(value):
            raise ValueError(raw)
    except ValueError:
        want = "an integer" if kind == M.INT else "a number"
        raise InteropError(f"{where}: {flag} expects {want}, got {_short(raw)}") from None
    if arg.choices and str(value) not in map(str, arg.choices):
        if kind != M.STR:
            raise InteropError(f"{where}: {flag} must be one of {', '.join(map(str, arg.choices))}, got {_short(raw)}")
        if (arg.dest, value) in M.FORK_VALUES:
            upstream, why = M.FORK_VALUES[(arg.dest, value)]
            return upstream, f"{why}: read as {upstream!r}"
        return value, (f"not one of Megatron-LM core_v0.16's choices ({', '.join(map(str, arg.choices))}): "
                       "a fork's value, kept as given")
    return value, None


def _is_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)  # a negative number is a value
        return True
    except ValueError:
        return False


def parse_tokens(tokens: list[str], where: str = "args") -> tuple[dict, list[Unmapped], list[str]]:
    """Megatron's argparse, for our purpose: (explicit values by dest, unknown flags, warnings)."""
    explicit: dict = {}
    unknown: list[Unmapped] = []
    warnings: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            if token.startswith("${") or token.startswith("$("):
                warnings.append(f"{token}: not set in the file, ignored (pass -e NAME=VALUE)")
            else:
                unknown.append(Unmapped(token, None, "stray word, not a flag value (an unquoted value with spaces?)"))
            continue
        flag, eq, inline = token.partition("=")
        arg = M.FLAGS.get(flag)
        if arg is None:
            values = [inline] if eq else []
            while not eq and i < len(tokens) and _is_value(tokens[i]):
                values.append(tokens[i])
                i += 1
            value = values[0] if len(values) == 1 else (values or True)
            unknown.append(Unmapped(flag, value, "not a Megatron-LM (core_v0.16) or MindSpeed argument"))
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
            pairs = [_convert(arg, flag, r, where) for r in raws]
            value = [v for v, _ in pairs]
            unknown.extend(Unmapped(flag, v, note, lost=False) for v, note in pairs if note)
        else:
            if eq:
                raw = inline
            elif i < len(tokens) and _is_value(tokens[i]):
                raw = tokens[i]
                i += 1
            else:
                raise InteropError(f"{where}: {flag} needs a value")
            value, note = _convert(arg, flag, raw, where)
            if note:
                unknown.append(Unmapped(flag, raw, note, lost=False))
        explicit[arg.dest] = value
    return explicit, unknown, warnings


def _megatron_view(explicit: dict) -> tuple[dict, list[Unmapped], list[str]]:
    """Values said the way upstream Megatron-LM core_v0.16 can say them: fork-only values become
    upstream flags where they have a meaning, and are named where they have none."""
    full = M.complete(explicit)
    values = dict(explicit)
    entries, warnings = [], []
    counts = M.layer_list(values.pop("num_layer_list", None))
    if counts:
        middle = counts[1:-1]
        if len(counts) >= 2 and len(set(middle)) <= 1:
            values["decoder_first_pipeline_num_layers"] = counts[0]
            values["decoder_last_pipeline_num_layers"] = counts[-1]
        else:
            entries.append(Unmapped("--num-layer-list", ",".join(map(str, counts)),
                                 "uneven middle pipeline stages: Megatron-LM's --decoder-first/last-pipeline-num-layers "
                                 "set only the first and last stage"))
    # MindSpeed-LLM's MoE spellings, as the upstream values they stand for (megatron_args.DERIVED)
    if values.get("n_shared_experts") and full["moe_shared_expert_intermediate_size"]:
        values["moe_shared_expert_intermediate_size"] = full["moe_shared_expert_intermediate_size"]
        values.pop("n_shared_experts")
    if values.get("first_k_dense_replace") and str(full["moe_layer_freq"]) != str(values.get("moe_layer_freq", 1)):
        values["moe_layer_freq"] = full["moe_layer_freq"]
        values.pop("first_k_dense_replace")
    if full["micro_batch_num"] is not None and "global_batch_size" not in values and full["micro_batch_size"]:
        dp = full["data_parallel_size"]
        if dp is None:
            dp = 1
            values["world_size"] = (full["tensor_model_parallel_size"] * full["pipeline_model_parallel_size"]
                                    * full["context_parallel_size"])
            warnings.append(f"micro_batch_num {full['micro_batch_num']}: --global-batch-size written for an assumed "
                            f"data-parallel size of 1 (WORLD_SIZE={values['world_size']}; no world size given: "
                            "--set world_size=N, or -e WORLD_SIZE=N for a script)")
        values["global_batch_size"] = full["micro_batch_num"] * full["micro_batch_size"] * dp
        values.pop("micro_batch_num", None)
    return values, entries, warnings


def format_args(explicit: dict) -> tuple[str, list[Unmapped], list[str]]:
    """The flags that say `explicit` to Megatron-LM core_v0.16 (defaults and re-derivable values left out).

    Only upstream flags are written; a MindSpeed-only value or a fork's choice is named instead.
    """
    values, entries, warnings = _megatron_view(explicit)
    full = M.complete(values)
    flags = M.normalize({d: v for d, v in full.items() if d in M.ARGS and v != M.ARGS[d].default})
    lines, env = [], []
    for arg in M.ALL:
        if arg.dest not in flags or M.ARGS[arg.dest] is not arg:
            continue
        value = flags[arg.dest]
        if value == arg.default:
            continue
        if arg.dest == "world_size":
            env.append(f"WORLD_SIZE={value}")
            continue
        if arg.origin == "megatron<0.16" and arg.dest == "virtual_pipeline_model_parallel_size":
            continue  # said by --num-layers-per-virtual-pipeline-stage (normalize inverts it)
        if not arg.flags or arg.origin != "megatron":
            if arg.dest in explicit or arg.dest in M.DERIVED_BY_DEST:
                where = "a MindSpeed / MindSpeed-LLM argument" if arg.origin == "mindspeed" else "computed"
                entries.append(Unmapped(M.flag_of(arg.dest), value,
                                     f"Megatron-LM core_v0.16 has no flag for it ({where}) and the other flags "
                                     "do not imply it"))
            continue
        if arg.choices and arg.kind in (M.STR, M.STRS) and any(
                str(v) not in map(str, arg.choices) for v in (value if isinstance(value, list) else [value])):
            entries.append(Unmapped(arg.flag, value, "not one of Megatron-LM core_v0.16's choices "
                                                  f"({', '.join(map(str, arg.choices))})"))
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
            entries.append(Unmapped(arg.flag, None, "Megatron cannot unset it from the command line"))
        elif isinstance(value, list):
            lines.append(" ".join([arg.flag] + [shlex.quote(str(v)) for v in value]))
        else:
            lines.append(f"{arg.flag} {shlex.quote(repr(value) if isinstance(value, float) else str(value))}")
    header = ["# Megatron-LM (core_v0.16) arguments written by `interop map-args`; read them with "
              "`interop map-args FILE`."]
    body = " \\\n".join(lines)
    return "\n".join(header + env + ([body] if body else [])) + "\n", entries, warnings


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


def write_table(full: dict, rows, nullable=None) -> tuple[dict, dict]:
    """(target document, {dest: why} for values the target cannot express).

    nullable: the paths whose loader accepts null; given, a None anywhere else is left out.
    """
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
            except Unmappable as exc:
                for s in row.source:
                    why.setdefault(s, f"{row.path}: {exc}")
                value = OMIT if row.default is None else row.default
        if value is OMIT:
            continue
        if value is None and len(row.source) == 1 and M.ARGS[row.source[0]].kind in M.BOOLS:
            value = False  # a switch Megatron leaves at None is off, whatever the target's default
        value = row.default if value is None else value
        if value is None and nullable is not None and row.path not in nullable:
            continue
        _set(doc, row.path, value)
    return doc, why


def read_table(doc: dict, rows, target: str) -> tuple[dict, list[Unmapped]]:
    """Megatron values from a target document, and the document's keys no row reads."""
    values: dict = {}
    notes: list[Unmapped] = []
    for row in rows:
        value = _get(doc, row.path)
        if value is _MISSING:
            value = row.default
        if value is None:
            continue
        if row.unset and value == row.default:
            continue  # the target's own default standing in for Megatron's "not set"
        if row.back is not None:
            try:
                back = dict(row.back(value, doc))
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError):
                raise InteropError(f"{target} file: {row.path}: cannot read {_short(repr(value))}") from None
            note = back.pop("_note", None)
            if note:
                notes.append(Unmapped(row.path, value, note))
            values.update(back)
        elif row.source:
            values[row.source[0]] = value
    read = {row.path for row in rows}
    entries = [Unmapped(path, value, f"no Megatron equivalent for this {target} key")
               for path, value in _leaves(doc) if path not in read and not any(p.startswith(path + ".") for p in read)
               and not any(path.startswith(p + ".") for p in read)]  # inside a value a row reads whole
    return values, notes + entries


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
    if target == "mindspeed-nested":
        return mindspeed.NESTED_ROWS
    raise InteropError(f"--to must be one of {', '.join(TARGETS)}, got {target!r}")


NULLABLE = {"mindspeed": mindspeed.NULLABLE, "mindformers": mindformers.NULLABLE}
# Megatron values a target runs the same way (so reading one back as the other loses nothing).
SAME_VALUES = {"mindspeed": mindspeed.SAME_VALUES, "mindformers": mindspeed.SAME_VALUES}
YAML_TARGETS = ("mindspeed", "mindformers", "mindformers-legacy", "mindspeed-nested")


def render(doc: dict, target: str) -> str:
    if target in YAML_TARGETS:
        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
        return (mindformers_legacy.HEADER + text) if target == "mindformers-legacy" else text
    if target in ("hf", "deepspeed"):
        return json.dumps(doc, indent=2) + "\n"
    if target == "colossalai":
        return colossalai.render(doc)
    raise InteropError(f"cannot render {target!r}")


def parse_document(text: str, target: str, where: str) -> dict:
    try:
        if target in YAML_TARGETS:
            doc = yaml.safe_load(text)
        elif target in ("hf", "deepspeed"):
            doc = json.loads(text)
        elif target == "colossalai":
            doc = colossalai.parse(text)
        else:
            raise InteropError(f"cannot read {target!r}")
    except (yaml.YAMLError, json.JSONDecodeError, SyntaxError, ValueError) as exc:
        raise InteropError(f"{where}: not a readable {target} file ({str(exc).splitlines()[0][:200]})") from None
    except RecursionError:
        raise InteropError(f"{where}: nested too deeply to be a {target} file") from None
    if not isinstance(doc, dict):
        raise InteropError(f"{where}: expected a mapping at the top of the {target} file")
    return doc


def _to_target(explicit: dict, target: str) -> tuple[str, dict, dict, list[str]]:
    """(text, document, {dest: why unmappable}, warnings) for the completed args."""
    full = M.complete(explicit)
    if target == "megatron":
        text, entries, warnings = format_args(explicit)
        return text, {}, {e.flag: e.why for e in entries}, warnings
    if target == "hf":  # through ModelSpec, as `interop convert --to hf` writes it
        doc, why = hf_args.to_hf(full)
    else:
        doc, why = write_table(full, _table(target, full), NULLABLE.get(target))
    return render(doc, target), doc, why, _target_warnings(full, doc, target)


def to_target(explicit: dict, target: str) -> tuple[str, dict, dict]:
    """(text, document, {dest: why unmappable}) for the completed args."""
    return _to_target(explicit, target)[:3]


# Values the MindSpore loaders need that Megatron may leave unknown: (path, Megatron flag to give it).
REQUIRED_KEYS = {
    "mindspeed": [("model_config.vocab_size", "vocab_size"), ("model_config.seq_length", "seq_length")],
    "mindformers": [("model_config.vocab_size", "vocab_size"), ("model_config.seq_length", "seq_length")],
    "mindformers-legacy": [("model.model_config.vocab_size", "vocab_size"),
                           ("model.model_config.seq_length", "seq_length")],
}


def _target_warnings(full: dict, doc: dict, target: str) -> list[str]:
    warnings = []
    missing = [(path, flag) for path, flag in REQUIRED_KEYS.get(target, []) if _get(doc, path) is _MISSING]
    if missing:
        warnings.append(f"{', '.join(p for p, _ in missing)} not written: the source does not give "
                        f"{', '.join(f for _, f in missing)} (the {target} model needs it; give it with "
                        f"{' '.join(f'--set {f}=N' for _, f in missing)})")
    if target == "hf" and full.get("vocab_size") is None and full.get("padded_vocab_size"):
        warnings.append(f"vocab_size: written as Megatron's padded {full['padded_vocab_size']}: the source does not "
                        "give the tokenizer's true vocabulary (give it with --set vocab_size=N)")
    batch_row = {"mindspeed": "dataset_config.micro_batch_num", "mindformers": "dataset_config.micro_batch_num",
                 "mindformers-legacy": "parallel_config.micro_batch_num"}.get(target)
    if batch_row and full["micro_batch_num"] is None and full["global_batch_size"]:
        warnings.append(f"{batch_row}: written as 1: global batch {full['global_batch_size']} / (micro batch "
                        f"{full['micro_batch_size']} * data-parallel size) needs the world size (--set world_size=N, "
                        "or -e for the script's variables)")
    return warnings


def read_target(text: str, target: str, where: str = "input") -> tuple[dict, list[Unmapped], list[str]]:
    """Megatron values from a file this module writes (or a hand-written one of that format)."""
    if target == "megatron":
        launch = argsfile.parse_text(text)
        explicit, unknown, warnings = parse_tokens(launch.tokens, where)
        if launch.world_size:
            explicit["world_size"] = launch.world_size
        return explicit, unknown, warnings
    doc = parse_document(text, target, where)
    if target == "deepspeed" and "ds_config" not in doc and "parallel_mode" not in doc:
        doc = {"ds_config": doc}  # a plain DeepSpeed config, as DeepSpeed and ATorch read it
    if target == "hf":  # through ModelSpec, as the HF reader reads it
        values, notes = hf_args.from_hf(doc, where)
        entries = [Unmapped(*note) for note in notes]
    else:
        try:
            values, entries = read_table(doc, _table(target, {}), target)
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
    values = {dest: _typed(dest, value, where) for dest, value in values.items()}
    warnings = []
    if target == "mindformers-legacy":
        values, warnings = mindformers_legacy.complete_read(values, doc)
    return M.normalize(values), entries, warnings


def _typed(dest: str, value, where: str):
    """A value read from a document, as the type its Megatron argument has; anything else is the file's mistake."""
    arg = M.ARGS.get(dest)
    if arg is None:
        return value
    kind = {M.INTS: M.INT, M.FLOATS: M.FLOAT, M.STRS: M.STR}.get(arg.kind, arg.kind)
    items = value if arg.kind in M.LISTS and isinstance(value, list) else [value]
    out = []
    for item in items:
        ok = item
        if kind == M.INT:
            if isinstance(item, float) and item.is_integer() and abs(item) < 2 ** 63:
                ok = int(item)
            elif not isinstance(item, int) or isinstance(item, bool):
                ok = None
        elif kind == M.FLOAT:
            if isinstance(item, str):
                try:
                    ok = float(item)  # YAML 1.1 reads 1e-5 as a string
                except ValueError:
                    ok = None
            elif not isinstance(item, (int, float)) or isinstance(item, bool) or not math.isfinite(item):
                ok = None
        elif kind in M.BOOLS:
            ok = item if isinstance(item, bool) else None
        elif kind == M.STR:
            ok = str(item) if isinstance(item, (str, int, float)) and not isinstance(item, bool) else None
        if ok is None and item is not None:
            want = {M.INT: "an integer", M.FLOAT: "a number", M.STR: "a string"}.get(kind, "true or false")
            raise InteropError(f"{where}: {M.flag_of(dest)} expects {want}, the file gives {_short(repr(item))}")
        out.append(ok)
    return out if arg.kind in M.LISTS and isinstance(value, list) else out[0]


# ---------------------------------------------------------------- sources

def _read_text(path: Path, what: str = "file") -> str:
    try:
        if not path.is_file():
            raise InteropError(f"{path}: not a regular file")
        if path.stat().st_size > MAX_TEXT:
            raise InteropError(f"{path}: {path.stat().st_size} bytes is too big for a config {what}")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InteropError(f"{path}: cannot read {what} ({exc.__class__.__name__}: {str(exc)[:200]})") from None


def _looks_like_yaml(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return bool(re.match(r"^[A-Za-z_][\w.-]*:(\s|$)", line))
    return False


def _classify_yaml(doc: dict) -> str | None:
    sections = {k for k in doc if isinstance(k, str)}
    model = doc.get("model_config") if isinstance(doc.get("model_config"), dict) else {}
    if "llm" in model or {"accelerate_config", "train_config"} & sections:
        return "mindspeed-nested"
    parallel = doc.get("parallel_config") if isinstance(doc.get("parallel_config"), dict) else {}
    if "model" in sections or "data_parallel" in parallel or {"runner_config", "context", "lr_schedule"} & sections:
        return "mindformers-legacy"
    training = doc.get("training_config") if isinstance(doc.get("training_config"), dict) else {}
    optimizer = doc.get("optimizer_config") if isinstance(doc.get("optimizer_config"), dict) else {}
    dataset = doc.get("dataset_config") if isinstance(doc.get("dataset_config"), dict) else {}
    if "grad_clip_kwargs" in training or "learning_rate_scheduler_kwargs" in optimizer or "dataset_dir" in dataset:
        return "mindformers"
    if {"model_config", "training_config", "parallel_config", "optimizer_config", "dataset_config"} & sections:
        return "mindspeed"
    return None


DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "zero_optimization", "fp16", "bf16", "gradient_clipping", "steps_per_print", "ds_config",
                  "parallel_mode", "optimizer", "scheduler"}


def detect(path: Path) -> str:
    """The source format, from the file's content (never its name); a file that fits none says --from."""
    if path.is_dir():
        return "megatron-checkpoint"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise InteropError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "megatron-checkpoint"  # a torch.save zip or pickle: model_optim_rng.pt / common.pt
    text = _read_text(path, "args file")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InteropError(f"{path}: cannot read JSON ({str(exc)[:200]})") from None
        except RecursionError:
            raise InteropError(f"{path}: JSON nested too deeply to be a config") from None
        if isinstance(doc, dict) and ("model_type" in doc or "architectures" in doc):
            return "hf"
        if isinstance(doc, dict) and DEEPSPEED_KEYS & set(doc):
            return "deepspeed"
        raise InteropError(f"{path}: a JSON file that is neither a Hugging Face config.json (no model_type) nor a "
                           "DeepSpeed config: use --from")
    python = _python_kind(text)
    if python:
        return python
    if _looks_like_yaml(text):
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InteropError(f"{path}: cannot read YAML ({str(exc).splitlines()[0][:200]})") from None
        except RecursionError:
            raise InteropError(f"{path}: YAML nested too deeply to be a config") from None
        if isinstance(doc, dict):
            kind = _classify_yaml(doc)
            if kind is None:
                raise InteropError(f"{path}: a YAML mapping with none of the sections interop reads "
                                   f"({', '.join(map(str, list(doc)[:5]))}): use --from")
            return kind
    return "megatron"


def _python_kind(text: str) -> str | None:
    """colossalai for a module with a CONFIG = dict(...), atorch for a load_strategy with parallel_mode."""
    if "CONFIG" not in text and "parallel_mode" not in text:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and node.elts[0].value == "parallel_mode":
            return "atorch"
    if any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CONFIG" for t in n.targets)
           for n in tree.body):
        return "colossalai"
    return None


def _set_values(pairs: dict, where: str = "--set") -> dict:
    """--set NAME=VALUE pairs (a Megatron dest or flag) as Megatron values."""
    explicit: dict = {}
    for name, raw in (pairs or {}).items():
        dest = name.lstrip("-").replace("-", "_")
        arg = M.ARGS.get(dest)
        if arg is None:
            raise InteropError(f"{where} {name}: not a Megatron argument interop knows")
        if dest == "world_size":
            if not raw.isdigit():
                raise InteropError(f"{where} world_size: expects an integer, got {_short(raw)}")
            explicit[dest] = int(raw)
            continue
        flag = arg.flag or "--" + dest.replace("_", "-")
        if arg.kind in M.BOOLS:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise InteropError(f"{where} {name}: a switch takes true or false, got {_short(raw)}")
            explicit[dest] = raw.lower() in ("true", "1")
            continue
        if arg.kind in M.LISTS:
            explicit[dest] = [_convert(arg, flag, r, where)[0] for r in raw.split(",")]
        else:
            explicit[dest] = _convert(arg, flag, raw, where)[0]
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
                           f"{_short(str(exc))}") from None
    if values:
        source.explicit.update(_set_values(values))
    if source.format in MINDSPORE_FAMILY and "max_position_embeddings" not in source.explicit \
            and source.explicit.get("seq_length"):
        # These models size their position table by seq_length: it is max_position_embeddings.
        source.explicit["max_position_embeddings"] = source.explicit["seq_length"]
    return source


MINDSPORE_FAMILY = ("mindspeed", "mindformers", "mindformers-legacy", "mindspeed-nested")


def _load(path: Path, env: dict | None, fmt: str) -> ArgsSource:
    fmt = detect(path) if fmt == "auto" else fmt
    if fmt == "megatron-checkpoint":
        return _load_checkpoint(path)
    if fmt == "megatron":
        launch = argsfile.parse_file(path, env)
        explicit, unknown, warnings = parse_tokens(launch.tokens, str(path))
        if launch.world_size and "world_size" not in explicit:
            explicit["world_size"] = launch.world_size
        if not launch.tokens and not launch.launcher:
            raise InteropError(f"{path}: found no Megatron arguments (no `... pretrain_*.py --flags` line, no --flags): "
                               "if it is another format, use --from")
        if not launch.tokens:
            warnings.append("the script passes no Megatron flags to its training program (its model and parallel "
                            "settings live elsewhere, e.g. a YAML file: map that one)")
        unset = [n for n in launch.unresolved if not n.startswith("$(")]
        if unset:
            warnings.append(f"variables not set in the file: {', '.join(unset)} (pass -e NAME=VALUE)")
        return ArgsSource(str(path), fmt, explicit, unknown, warnings)
    if fmt == "atorch":
        explicit, entries, warnings = deepspeed.read_strategy(_read_text(path), str(path))
        return ArgsSource(str(path), fmt, explicit, [Unmapped(*e) for e in entries], warnings)
    if fmt not in TARGETS + READ_ONLY:
        raise InteropError(f"--from must be auto, megatron-checkpoint or one of "
                           f"{', '.join(TARGETS + READ_ONLY)}, got {fmt!r}")
    text = _read_text(path)
    explicit, entries, warnings = read_target(text, fmt, str(path))
    return ArgsSource(str(path), fmt, explicit, entries, warnings)


def _checkpoint_file(path: Path) -> Path:
    """The file that holds `args`: common.pt (torch_dist) or model_optim_rng.pt (legacy)."""
    if path.is_file():
        return path
    if (path / TRACKER).exists():
        path = path / iteration_name(read_tracker(path))
    if (path / "common.pt").exists():
        return path / "common.pt"
    for name in ("mp_rank_00", "mp_rank_00_000"):
        if (path / name / "model_optim_rng.pt").exists():
            return path / name / "model_optim_rng.pt"
    raise InteropError(f"{path}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, common.pt "
                       "or mp_rank_00*/model_optim_rng.pt)")


def _load_checkpoint(path: Path) -> ArgsSource:
    from .io.safe_pickle import safe_torch_load, to_plain  # torch: only a checkpoint needs it
    file = _checkpoint_file(path)
    state = safe_torch_load(file)  # the allow-listing unpickler, never plain torch.load
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
        value = to_plain(value)
        if value != arg.default:
            explicit[dest] = value
    entries = [Unmapped("(checkpoint args)", sorted(ignored), f"{len(ignored)} stored args interop does not model",
                     lost=False)] if ignored else []
    return ArgsSource(str(path), "megatron-checkpoint", explicit, entries, [])


# ---------------------------------------------------------------- the whole job

def check(source: ArgsSource) -> tuple[dict, list[str]]:
    """Completed args, or an InteropError naming contradicting or missing flags."""
    full = M.complete(source.explicit)
    missing = M.missing_required(full)
    if source.format in MINDSPORE_FAMILY:
        missing = ["--seq-length" if m == "--max-position-embeddings" else m for m in missing]
    if missing:
        given = " ".join(f"--set {m.lstrip('-').replace('-', '_')}=N" for m in missing)
        raise InteropError(f"{source.path}: missing required value: {', '.join(missing)} (the {source.format} "
                           f"file does not give it; give it with {given}, or -e NAME=VALUE for a script's variables)")
    errors = M.contradictions(full, source.explicit)
    if errors:
        raise InteropError(f"{source.path}: {'; '.join(errors)}")
    return full, M.contradictions(full, source.explicit, M.SOFT_CHECKS)


def _held(target: str, before: dict) -> set:
    if target == "megatron":
        return {d for d, a in M.ARGS.items() if a.origin == "megatron" and a.flags}
    if target == "hf":
        return hf_args.held(before)
    return {s for row in _table(target, before) for s in row.source}


def losses(explicit: dict, target: str, read_back: dict, why: dict) -> list[Unmapped]:
    """What the given values lose on the way to `target` and back: the round trip decides.

    Values the user did not give are the target's business (its defaults apply); a given value
    the target re-derives exactly (a batch size from the micro-batch count) is not a loss.
    """
    before = M.complete(explicit)
    held = _held(target, before)
    launch = {"world_size": explicit["world_size"]} if "world_size" in explicit and "world_size" not in held else {}
    after = M.complete(M.normalize({**launch, **read_back}))  # launched on as many ranks as before
    same = SAME_VALUES.get(target, {})
    entries = []
    for dest, value in explicit.items():
        if dest in launch:
            entries.append(Unmapped(M.flag_of(dest), value, f"the launcher's rank count: no {target} field for it "
                                                         f"(launch the job on {value} ranks; the batch split assumes it)"))
            continue
        if target == "megatron" and dest == "num_layer_list" and "--num-layer-list" not in why:
            continue  # said as --decoder-first/last-pipeline-num-layers
        lost = before.get(dest) != after.get(dest) and not (
            dest in same and {before.get(dest), after.get(dest)} <= same[dest]) and not (
            dest in M.SAME_MEANING and M.SAME_MEANING[dest](before, after))
        value = True if M.ARGS[dest].kind == M.FALSE and value is False else value  # the switch was given
        flag = M.flag_of(dest)
        if dest in why or flag in why:
            entries.append(Unmapped(flag, value, why.get(dest) or why[flag]))
        elif not lost:
            continue
        elif dest not in held:
            entries.append(Unmapped(flag, value, f"no {target} field for it"))
        else:
            entries.append(Unmapped(flag, value, f"{target} reads it back as {after.get(dest)!r}"))
    for dest, text in why.items():  # a value not given but lost all the same (a default the target cannot hold)
        if dest in M.ARGS and dest not in explicit and before.get(dest) != after.get(dest):
            entries.append(Unmapped(M.flag_of(dest), before.get(dest), text))
    return entries


def map_args(path: str | Path, to: str = DEFAULT_TARGET, env: dict | None = None, fmt: str = "auto",
             strict: bool = False, values: dict | None = None) -> Result:
    """Read `path`, write it as `to`, and say what did not survive. The Python face of the CLI."""
    if to not in TARGETS:
        raise InteropError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    source = load(path, env, fmt, values)
    _, soft = check(source)
    text, _, why, target_warnings = _to_target(source.explicit, to)
    back, _, _ = read_target(text, to, f"{to} output")
    entries = source.entries + losses(source.explicit, to, back, why)
    result = Result(text, source, to, entries, source.warnings + soft + target_warnings)
    if strict:
        lost = [e for e in entries if e.lost]
        if lost:
            shown = ", ".join(f"{e.flag}={e.value!r}" for e in lost[:5]) + (" ..." if len(lost) > 5 else "")
            raise InteropError(f"--strict: {len(lost)} value(s) do not map to {to}: {shown}")
    return result
