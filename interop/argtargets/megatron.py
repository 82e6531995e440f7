"""Megatron-LM's own arguments as a map-args format: a launch script or args file in, upstream flags out.

Reading is Megatron's argparse for our purpose (`parse_tokens`: each flag of `megatron_args` with its
kind); writing says the values with upstream Megatron-LM core_v0.16 flags only (`format_args`), naming
a MindSpeed-only value or a fork's choice instead of writing it.
"""
from __future__ import annotations

import math
import shlex
from pathlib import Path

from .. import argsfile
from ..errors import InteropError
from ..argtable import Unmapped, short
from ..mappings import megatron_args as M
from . import ArgsTarget


def convert(arg: M.Arg, flag: str, raw: str, where: str):
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
        raise InteropError(f"{where}: {flag} expects {want}, got {short(raw)}") from None
    if arg.choices and str(value) not in map(str, arg.choices):
        if kind != M.STR:
            raise InteropError(f"{where}: {flag} must be one of {', '.join(map(str, arg.choices))}, got {short(raw)}")
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
            pairs = [convert(arg, flag, r, where) for r in raws]
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
            value, note = convert(arg, flag, raw, where)
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


# Whose parser takes a fork's flag: what the report says of a flag the target does not write.
ORIGINS = {"mindspeed": "a MindSpeed / MindSpeed-LLM argument", "mindspeed-llm": "a MindSpeed-LLM argument",
           "mindspeed-mm": "a MindSpeed-MM argument"}
HEADER = "# Megatron-LM (core_v0.16) arguments written by `interop map-args`; read them with `interop map-args FILE`."


def format_args(explicit: dict, forks: tuple = (), header: str = HEADER) -> tuple[str, list[Unmapped], list[str]]:
    """The flags that say `explicit` to Megatron-LM core_v0.16 (defaults and re-derivable values left out).

    Only upstream flags are written, and those of the `forks` (Arg.origin) the target's parser adds; a value
    only another fork's flag says, or a fork's choice, is named instead.
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
        if not arg.flags or (arg.origin != "megatron" and arg.origin not in forks):
            if arg.dest in explicit or arg.dest in M.DERIVED_BY_DEST:
                where = ORIGINS.get(arg.origin, "computed") if arg.flags else "computed"
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
    body = " \\\n".join(lines)
    return "\n".join([header] + env + ([body] if body else [])) + "\n", entries, warnings


class MegatronArgs(ArgsTarget):
    """A Megatron / MindSpeed-LLM launch script or args file: what no other format recognises."""

    name = "megatron"
    syntax = "args"
    writable = True
    forks: tuple = ()  # the fork flags (Arg.origin) its parser takes besides Megatron-LM's
    header = HEADER

    def recognises(self, doc) -> bool:
        return True  # any args file or launch script no other format of this syntax claims

    def load(self, path: Path, env: dict | None) -> tuple[dict, list[Unmapped], list[str]]:
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
        return explicit, unknown, warnings

    def write(self, explicit: dict) -> tuple[str, dict, dict, list[str]]:
        text, entries, warnings = format_args(explicit, self.forks, self.header)
        return text, {}, {e.flag: e.why for e in entries}, warnings

    def read(self, text: str, where: str) -> tuple[dict, list[Unmapped], list[str]]:
        launch = argsfile.parse_text(text)
        explicit, unknown, warnings = parse_tokens(launch.tokens, where)
        if launch.world_size:
            explicit["world_size"] = launch.world_size
        return explicit, unknown, warnings

    def held(self, before: dict) -> set:
        return {d for d, a in M.ARGS.items() if (a.origin == "megatron" or a.origin in self.forks) and a.flags}

    def holds(self, dest: str, before: dict, after: dict) -> bool:
        # An even-middled --num-layer-list is said as --decoder-first/last-pipeline-num-layers (an uneven one
        # is in `write`'s why, reported before this is asked).
        return dest == "num_layer_list"


TARGET = MegatronArgs()
