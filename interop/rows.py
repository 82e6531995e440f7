"""A format's name table expanded for one model: the rows it stores, each one native tensor.

A name table (`mappings/*_names.py`) lists (native template, transform class, canonical part templates).
`expand` turns it into `Row`s for a ModelSpec, the same way for every format:

  - `{i}` is a layer: the row repeats per layer; in the native name numbered from `first` (Megatron
    numbers layers locally per pipeline stage), in the canonical parts globally;
  - parts with `{e}` are a routed expert's and exist in MoE layers only: one row per expert (`{e}` the
    global number, `{j}` its number on its expert-parallel rank), or, when the transform stores every
    expert in one tensor (`Transform.every_expert`), one row per expert-parallel rank listing its
    experts' parts expert by expert;
  - `{m}` is a multi-token-prediction module (native layer num_layers + k, canonical `mtp.{k}.`): the row
    repeats per module; `{k}` in a native name is the module's own number (Megatron's `mtp.layers.{k}.`);
  - a row whose canonical tensors the model lacks (a bias, an untied head) is skipped, and the first row
    that claims a native name wins (so a gated fc1 row comes before the plain one).

Formats add only their own rules around it: where a row lives (`stage`, `chunk`), a rename, a check.
"""
from __future__ import annotations

from .errors import InteropError
from .mappings.facts import no_place
from .params import param_index
from .spec import ModelSpec


class Row:
    """One stored tensor: its native name `key`, its transform bound to the row's parts, the canonical parts
    in stored order; where it lives for a pipelined format (`stage`, virtual `chunk`), and `ep`, the
    expert-parallel rank holding a routed expert's row (None: every rank holds it)."""
    __slots__ = ("key", "transform", "parts", "stage", "chunk", "ep")

    def __init__(self, key: str, transform, parts, stage: int = 0, chunk: int = 0, ep: int | None = None):
        self.key, self.transform, self.parts = key, transform, tuple(parts)
        self.stage, self.chunk, self.ep = stage, chunk, ep

    def __repr__(self) -> str:
        return f"Row({self.key!r}, {self.transform!r}, {list(self.parts)})"


def _expanded(key: str, transform, parts, i, local, spec: ModelSpec, ep: int):
    """(native name, canonical names, ep rank) of one template row at layer `i` (native number `local`)."""
    if "{e}" not in " ".join(parts):
        yield key.format(i=local), [n.format(i=i) for n in parts], None
        return
    if i is not None and not spec.is_moe_layer(i):
        return
    per_rank = spec.num_experts // ep
    if transform.every_expert:
        for r in range(ep):
            names = [n.format(i=i, e=e) for e in range(r * per_rank, (r + 1) * per_rank) for n in parts]
            yield key.format(i=local), names, r
        return
    for e in range(spec.num_experts):
        yield key.format(i=local, j=e % per_rank, e=e), [n.format(i=i, e=e) for n in parts], e // per_rank


def _mtp_modules(template, spec: ModelSpec):
    """A row of an MTP module (`{m}`: its native layer number, num_layers + k, DeepSeek-V3's; `{k}`: its module
    number, in the canonical parts and in Megatron's names) once per module; any other row as it is."""
    key, transform, parts = template
    if "{m}" not in key and "{k}" not in key:
        yield template
        return
    for k in range(spec.mtp_layers):
        native = key.replace("{m}", str(spec.num_layers + k)).replace("{k}", str(k))
        yield native, transform, [p.replace("{k}", str(k)) for p in parts]


def expand(table, spec: ModelSpec, *, layers=None, first: int = 0, ep: int = 1, keep=None, stage: int = 0,
           chunk: int = 0, present: dict | None = None, numbers=None) -> list[Row]:
    """`table`'s rows for `spec`, in table order, then layer, then expert.

    `layers`: the global layers to expand `{i}` over (default: all); `first`: the layer the native names
    number 0; `numbers`: instead, the native number of each of `layers` (a format that skips numbers:
    MindSpeed-LLM's noop layers); `ep`: the expert-parallel size; `keep(template, layer)`: False leaves that row
    out (a format's placement rule; layer None for a row outside the layers); `stage` / `chunk` are recorded."""
    present = present if present is not None else param_index(spec)
    layers = range(spec.num_layers) if layers is None else layers
    native = dict(zip(layers, numbers)) if numbers is not None else {i: i - first for i in layers}
    rows, taken = [], set()
    for key, transform, parts in (row for template in table for row in _mtp_modules(template, spec)):
        for i in (layers if "{i}" in key else [None]):
            if keep is not None and not keep(key, i):
                continue
            local = None if i is None else native[i]
            for name, names, r in _expanded(key, transform, parts, i, local, spec, ep):
                if (name, r) not in taken and all(n in present for n in names):
                    rows.append(Row(name, transform.bind(spec, [present[n] for n in names]), names, stage, chunk, r))
                    taken.add((name, r))
    return rows


def check_placed(rows: list[Row], spec: ModelSpec, what: str, why: str = "") -> None:
    """Every canonical tensor of the model has a row: else one line naming the first without (`what` names
    the table, `why` the likely reason)."""
    held = {name for row in rows for name in row.parts}
    homeless = [name for name in param_index(spec) if name not in held]
    if homeless:
        raise InteropError(no_place(f"{what} names", homeless[0]) or
                           f"{what} names have no place for {homeless[0]}{f' ({why})' if why else ''}")


class RowCollector:
    """A writer's canonical tensors gathered per row until the row is complete: a fused row's parts (q, k, v;
    gate, up) arrive one at a time, and the row is stored once, when its last part comes."""

    def __init__(self):
        self.pending: dict = {}

    def add(self, key, parts, name: str, tensor):
        """`tensor` as part `name` of row `key` (its canonical `parts`, in stored order): the row's tensors
        in that order when this was the last one missing, else None (held until then)."""
        got = self.pending.setdefault(key, {})
        got[name] = tensor
        if len(got) < len(parts):
            return None
        del self.pending[key]
        return [got[p] for p in parts]

    def check_done(self, where: str = "") -> None:
        """One line when a row never got all its parts (the input lacked a tensor)."""
        if self.pending:
            raise InteropError(f"{where}incomplete input: {sorted(self.pending)[0]} never got all its parts")
