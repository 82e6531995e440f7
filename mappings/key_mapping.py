"""The language a map-args target table is written in: one `KeyMapping` per line, Megatron dest(s) <-> a dotted
path in the target's document (`R`), a constant the target needs (`CONST`), renamed values (`rename`).

The tables (`mappings/mindspeed.py`, `mindformers*.py`, `deepspeed.py`, `colossalai.py`) import it; the
map-args engine reads them through it.  A converter raises `Unmappable` for a value the target cannot
express, or answers `OMIT` to write no key at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class Unmappable(Exception):
    """A row's converter met a Megatron value the target cannot express (the message says why)."""


OMIT = object()  # a converter's answer for "write no key at all"


@dataclass(frozen=True)
class KeyMapping:
    """One line of a target table: Megatron dest(s) <-> a dotted path in the target document.

    to(*values) -> target value (identity by default; raise Unmappable when it cannot);
    back(value, doc) -> {dest: value} (by default {source: value});
    default: the target's own default, written where Megatron has no value (None);
    unset=True: reading the default back means "not set" (train_iters 0, output_dir ./output).
    """

    source: tuple
    path: str
    default: object = None
    to: Callable | None = None
    back: Callable | None = None
    unset: bool = False


def R(source, path, default=None, to=None, back=None, unset=False) -> KeyMapping:
    source = (source,) if isinstance(source, str) else tuple(source)
    return KeyMapping(source, path, default, to, back, unset)


def CONST(path, value) -> KeyMapping:
    """A key the target needs that carries no Megatron value (a type name, a fixed mode)."""
    return KeyMapping((), path, value, lambda: value, lambda v, doc: {})


def rename(source, path, pairs: dict, default=None, exact: bool = True) -> KeyMapping:
    """A row whose values are renamed between the sides: pairs = {megatron value: target value}."""
    inverse = {v: k for k, v in pairs.items()}
    dest = source if isinstance(source, str) else source[0]

    def to(value):
        if value in pairs:
            return pairs[value]
        if exact and value is not None:
            raise Unmappable(f"no equivalent for {value!r} (it knows {', '.join(map(str, pairs))})")
        return value

    return R(source, path, default, to, lambda v, doc: {dest: inverse.get(v, v)})
