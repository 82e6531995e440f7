"""The map-args table engine: Megatron values <-> a target document through rows (`mappings/*.ROWS`).

A row (`key_mapping.R`) names the Megatron dests it reads, the document path it writes, the
target's default and, where the spellings differ, the two conversions.  Every table target writes
and reads through these two functions, so a new row is a new mapped key and nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InteropError
from .mappings import megatron_args as M
from .mappings.key_mapping import OMIT, Unmappable

MISSING = object()  # a path the document does not have


@dataclass
class Unmapped:
    """One thing that did not map: the flag (or target key), its value, and why."""

    flag: str
    value: object
    why: str
    lost: bool = True  # False: the target re-derives the same value, nothing is lost
    group: str | None = None  # said with the others of its group as one count (the list is in --report)


def short(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


def get_path(doc: dict, path: str):
    node = doc
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def set_path(doc: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def leaves(doc: dict, prefix: str = ""):
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


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
        set_path(doc, row.path, value)
    return doc, why


def read_table(doc: dict, rows, target: str) -> tuple[dict, list[Unmapped]]:
    """Megatron values from a target document, and the document's keys no row reads.

    A row's `back` may add "_note" (the value read is not what the file says: reported as lost) or
    "_said" (read another way with the same meaning: the rule, reported as a note)."""
    values: dict = {}
    notes: list[Unmapped] = []
    for row in rows:
        value = get_path(doc, row.path)
        if value is MISSING:
            value = row.default
        if value is None:
            continue
        if row.unset and value == row.default:
            continue  # the target's own default standing in for Megatron's "not set"
        if row.back is not None:
            try:
                back = dict(row.back(value, doc))
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError):
                raise InteropError(f"{target} file: {row.path}: cannot read {short(repr(value))}") from None
            note, said = back.pop("_note", None), back.pop("_said", None)
            if note:  # the value read is not the file's: a loss
                notes.append(Unmapped(row.path, value, note))
            if said:  # read another way, the same run: the rule, for the user to see
                notes.append(Unmapped(row.path, value, said, lost=False))
            values.update(back)
        elif row.source:
            values[row.source[0]] = value
    read = {row.path for row in rows}
    entries = [Unmapped(path, value, f"no Megatron equivalent for this {target} key")
               for path, value in leaves(doc) if path not in read and not any(p.startswith(path + ".") for p in read)
               and not any(path.startswith(p + ".") for p in read)]  # inside a value a row reads whole
    return values, notes + entries


def typed(dest: str, value, where: str):
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
            raise InteropError(f"{where}: {M.flag_of(dest)} expects {want}, the file gives {short(repr(item))}")
        out.append(ok)
    return out if arg.kind in M.LISTS and isinstance(value, list) else out[0]
