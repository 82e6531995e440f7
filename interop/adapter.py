"""LoRA adapters in the common format: what an adapter is (`AdapterSpec`), its canonical tensors, their TP split.

A LoRA adapter on a linear weight W [out, in] is two tensors, A [r, in] and B [out, r]; the adapted layer
computes W x + scaling * B (A x), scaling = alpha / r (PEFT's `lora_alpha / r`, Megatron-Bridge's
`alpha / dim`, MindFormers' `lora_alpha / lora_rank`).  Canonical names follow the weight's: the adapter of
`layers.3.attn.q.weight` is `layers.3.attn.q.lora_a` [r, in] and `layers.3.attn.q.lora_b` [out, r], torch
Linear orientation, unfused (a fused target such as Megatron's `linear_qkv` is its transform's business).

Tensor parallelism cuts them like the weight they adapt, so that rank t computes its own part of W x + B A x:

    weight split   A [r, in]         B [out, r]        (why)
    column (0)     replicated        column (axis 0)   rank t's output rows are B_t (A x)
    row (1)        row (axis 1)      replicated        rank t's partial sum is B (A_t x_t), reduced with W_t x_t
    replicated     replicated        replicated

A common-format adapter is a store (`interop.store`) whose manifest has `"adapter"` (this spec's `to_dict`)
beside `"spec"` (the BASE model's ModelSpec) and whose tensors are the adapter's only, sharded by the table
above; optimizer state rides along as for weights (`optim.exp_avg.layers.3.attn.q.lora_a`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import InteropError
from .params import Param, param_index, param_table
from .spec import ModelSpec

LORA_A, LORA_B = "lora_a", "lora_b"
WEIGHT = ".weight"
# TP split of (A, B) by the split of the weight they adapt
SPLITS = {"column": ("replicated", "column"), "row": ("row", "replicated"), "replicated": ("replicated", "replicated")}
# Projections that read the same input, which a format may fuse into one weight with ONE LoRA A (Megatron's
# linear_qkv, linear_fc1): `interop.lora_stack` stacks their A's when asked (--lora-stack-ranks)
INPUT_GROUPS = (("attn.q", "attn.k", "attn.v"), ("mlp.gate", "mlp.up"), ("mlp.shared.gate", "mlp.shared.up"))
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_EXPERT = re.compile(r"experts\.\d+\.")


def lora_names(weight: str) -> tuple[str, str]:
    """`layers.0.attn.q.weight` -> (`layers.0.attn.q.lora_a`, `layers.0.attn.q.lora_b`)."""
    if not weight.endswith(WEIGHT):
        raise ValueError(f"{weight!r} is not a weight's canonical name")
    stem = weight[:-len(WEIGHT)]
    return f"{stem}.{LORA_A}", f"{stem}.{LORA_B}"


def weight_of(name: str) -> str:
    """`layers.0.attn.q.lora_a` (or `.lora_b`) -> `layers.0.attn.q.weight`."""
    stem, _, which = name.rpartition(".")
    if which not in (LORA_A, LORA_B):
        raise ValueError(f"{name!r} is not a LoRA tensor's canonical name")
    return stem + WEIGHT


def target_of(weight: str) -> tuple[int, str] | None:
    """(layer, target) of a decoder layer's weight: `layers.3.attn.q.weight` -> (3, "attn.q"); a routed
    expert's number is `*` (`layers.1.mlp.experts.5.up.weight` -> (1, "mlp.experts.*.up")).  None elsewhere."""
    m = _LAYER.match(weight)
    if m is None:
        return None
    return int(m.group(1)), _EXPERT.sub("experts.*.", m.group(2))


def _number(value, what: str, where: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= 0 if positive else value < 0):
        raise InteropError(f"{where}LoRA {what} must be a {'positive' if positive else 'non-negative'} number, "
                           f"got {value!r}")
    return value


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: rank, alpha, dropout, the modules it adapts.

    `targets`: canonical module names within a decoder layer (`attn.q`, `attn.k`, `attn.v`, `attn.o`, `mlp.gate`,
    `mlp.up`, `mlp.down`; a routed expert's `mlp.experts.*.up`), sorted.  `layers`: the decoder layers adapted
    (None: every layer that has the target).  `base_name`: where the base model came from, as the source said
    it (PEFT's `base_model_name_or_path`): informational, the base itself is the store's ModelSpec.
    Rank and alpha are required everywhere: a format that omits either is refused, never defaulted."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    layers: tuple[int, ...] | None = None
    base_name: str | None = None
    shared_a: bool | None = None

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InteropError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        _number(self.alpha, "alpha", "", True)
        _number(self.dropout, "dropout", "", False)
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise InteropError(f"a LoRA adapter needs target modules, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))
        if self.layers is not None:
            if not self.layers or not all(type(i) is int and i >= 0 for i in self.layers):
                raise InteropError(f"LoRA layers must be layer numbers (or none: every layer), got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        if self.shared_a is not None and not isinstance(self.shared_a, bool):
            raise InteropError(f"LoRA shared_a must be true, false or absent, got {self.shared_a!r}")

    @property
    def scaling(self) -> float:
        """What B A x is multiplied by: alpha / rank."""
        return self.alpha / self.rank

    def adapts(self, weight: str) -> bool:
        """Whether this adapter has A and B for canonical weight `weight` (of the base model)."""
        found = target_of(weight)
        return found is not None and found[1] in self.targets and (self.layers is None or found[0] in self.layers)

    def params(self, base: ModelSpec) -> list[Param]:
        """The adapter's canonical tensors for `base`, in the base's parameter order: A then B per target,
        each split for TP by `SPLITS` (and placed on its weight's layer and expert)."""
        out = []
        for p in param_table(base):
            if not self.adapts(p.name):
                continue
            if p.split not in SPLITS or len(p.shape) != 2:
                raise InteropError(f"LoRA target {p.name} is split {p.split!r}: no adapter layout for it")
            split_a, split_b = SPLITS[p.split]
            a, b = lora_names(p.name)
            out += [Param(a, (self.rank, p.shape[1]), split_a, p.layer, p.expert),
                    Param(b, (p.shape[0], self.rank), split_b, p.layer, p.expert)]
        return out

    def index(self, base: ModelSpec) -> dict[str, Param]:
        return {p.name: p for p in self.params(base)}

    def fused_a(self, base: ModelSpec) -> list[tuple[str, ...]]:
        """The A tensors that ONE A holds where a format fuses their projections: per layer, each input group
        (`INPUT_GROUPS`) of which the adapter adapts every part the base has, two or more."""
        have = {target_of(p.name) for p in param_table(base)} - {None}
        out = []
        for i in range(base.num_layers):
            for group in INPUT_GROUPS:
                present = [t for t in group if (i, t) in have]
                names = tuple(lora_names(f"layers.{i}.{t}.weight")[0] for t in present)
                if len(present) > 1 and all(self.adapts(f"layers.{i}.{t}.weight") for t in present):
                    out.append(names)
        return out

    def check_base(self, base: ModelSpec, where: str = "") -> None:
        """One line naming the first target (or layer) the base model does not have."""
        found = {target_of(p.name) for p in param_table(base) if len(p.shape) == 2} - {None}  # linear weights
        targets, layers = {t for _, t in found}, {i for i, _ in found}
        for t in self.targets:
            if t not in targets:
                raise InteropError(f"{where}LoRA target module {t} is not in the base model "
                                   f"({base.arch}, {base.num_layers} layers; it has {', '.join(sorted(targets))})")
        for i in self.layers or ():
            if i not in layers:
                raise InteropError(f"{where}LoRA adapts layer {i}; the base model has {base.num_layers} layers")

    def check_tensors(self, base: ModelSpec, shapes: dict, where: str = "") -> None:
        """The adapter tensors a source holds (`shapes`: canonical name -> shape) against `base`: one line
        naming the first one missing, extra or shaped unlike the base's weight says."""
        self.check_base(base, where)
        expected = self.index(base)
        for name, shape in shapes.items():
            if name not in expected:
                raise InteropError(f"{where}LoRA tensor {name} has no weight to adapt in the base model")
            if tuple(shape) != expected[name].shape:
                raise InteropError(f"{where}LoRA tensor {name} has shape {list(shape)}; the base model's "
                                   f"{weight_of(name)} and rank {self.rank} need {list(expected[name].shape)}")
        for name in expected:
            if name not in shapes:
                raise InteropError(f"{where}LoRA tensor {name} is missing (target {target_of(weight_of(name))[1]})")

    def to_dict(self) -> dict:
        return {"type": "lora", "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "layers": None if self.layers is None else list(self.layers),
                "base_name": self.base_name, "shared_a": self.shared_a}

    @classmethod
    def from_dict(cls, data, where: str = "") -> "AdapterSpec":
        """From `to_dict`'s fields; rank or alpha missing is refused (never defaulted)."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict) or data.get("type", "lora") != "lora":
            raise InteropError(f"{prefix}'adapter' must be an object of type 'lora'")
        for key in ("rank", "alpha", "targets"):
            if data.get(key) is None:
                raise InteropError(f"{prefix}the LoRA adapter does not state its {key}")
        targets, layers = data["targets"], data.get("layers")
        if not isinstance(targets, list) or (layers is not None and not isinstance(layers, list)):
            raise InteropError(f"{prefix}LoRA targets and layers must be lists")
        try:
            return cls(data["rank"], data["alpha"], tuple(targets), data.get("dropout", 0.0),
                       None if layers is None else tuple(layers), data.get("base_name"), data.get("shared_a"))
        except InteropError as exc:
            raise InteropError(f"{prefix}{exc}") from None


def tensor_index(spec: ModelSpec, adapter: AdapterSpec | None = None) -> dict[str, Param]:
    """The parameters a checkpoint holds: the model's, or (`adapter`) that LoRA adapter's on base model `spec`."""
    return param_index(spec) if adapter is None else adapter.index(spec)


def merged(weight, a, b, scaling: float, dtype=None):
    """W + scaling * B A computed in fp32 and cast once (to `dtype`, default W's)."""
    import torch
    out = torch.addmm(weight.float(), b.float(), a.float(), alpha=scaling)
    return out.to(dtype or weight.dtype)


# ---------------------------------------------------------------- a format's adapter names, from its weight names

@dataclass(frozen=True)
class LoraNames:
    """How a format names the A and B of the weight it stores as `<stem>.weight`: `prefix + stem + a`
    (PEFT: `base_model.model.` + stem + `.lora_A.weight`; Megatron-Bridge: stem + `.adapter.linear_in.weight`)."""

    a: str
    b: str
    prefix: str = ""

    def of(self, key: str) -> tuple[str, str] | None:
        """The native names of A and B for a weight stored under `key` (None: `key` is not a `.weight`)."""
        if not key.endswith(WEIGHT):
            return None
        stem = self.prefix + key[:-len(WEIGHT)]
        return stem + self.a, stem + self.b

    def weight_key(self, native: str) -> str | None:
        """The inverse of `of`: the key of the weight a native A or B name adapts (None: not such a name)."""
        if not native.startswith(self.prefix):
            return None
        for suffix in (self.a, self.b):
            if native.endswith(suffix):
                return native[len(self.prefix):-len(suffix)] + WEIGHT
        return None


def _b_layouts():
    from .transforms import Copy, GatedMLP, GroupedQKV, Interleave, PlainConcat, Transpose
    # B's rows are the weight's output rows, so B is stored as the weight's rows are; a weight stored transposed
    # (GPT2's Conv1D) still has a Linear B (PEFT fan_in_fan_out transposes only the delta)
    return {Copy: Copy, PlainConcat: PlainConcat, GatedMLP: GatedMLP, GroupedQKV: GroupedQKV, Interleave: Interleave,
            Transpose: PlainConcat}


def adapter_table(table, names: LoraNames) -> list[tuple]:
    """A format's weight name table -> its LoRA name table: per weight row (key, transform, parts) whose layout
    a LoRA can follow, an A row (one part: `Copy`; a fused weight: `SharedInput`, one A for all parts) and a B
    row (the weight's row layout).  Rows are expanded for an adapter with `adapter_rows`."""
    from .transforms import Copy, SharedInput
    layouts, out = _b_layouts(), []
    for key, transform, parts in table:
        native = names.of(key)
        if native is None or transform not in layouts or not all(p.endswith(WEIGHT) for p in parts):
            continue
        out.append((native[0], SharedInput if len(parts) > 1 else Copy, [lora_names(p)[0] for p in parts]))
        out.append((native[1], layouts[transform], [lora_names(p)[1] for p in parts]))
    return out


def stated_shared_a(rows, base: ModelSpec, adapter: AdapterSpec) -> bool | None:
    """What a format's `adapter_rows` say of `adapter.shared_a`: True where every fused group (`fused_a`) is one
    stored A (`SharedInput`: Megatron's linear_qkv, PEFT on GPT2's c_attn), False where none is (PEFT's q_proj,
    k_proj, v_proj; or no such group), None where the format fuses some and not others."""
    from .transforms import SharedInput
    one = {n for row in rows if isinstance(row.transform, SharedInput) for n in row.parts}
    fused = [all(n in one for n in group) for group in adapter.fused_a(base)]
    if not any(fused):
        return False
    return True if all(fused) else None


def optimizer_dropped_notes(metas, why: str) -> list[str]:
    """The note of a writer that stores an adapter's weights only: which optimizer moments it leaves out, and why."""
    from .params import TensorKey
    dropped = sorted({k.kind for k in (TensorKey.parse(m.name) for m in metas) if k.is_optim})
    return [f"the adapter's optimizer state not written ({', '.join(dropped)}): {why}"] if dropped else []


def sharing_notes(rows, base: ModelSpec, adapter: AdapterSpec, what: str) -> list[str]:
    """A writer's note where its rows hold the adapter's fused groups otherwise than `adapter.shared_a` says:
    the values are exact either way (a shared A is equal in every part; parts written as one A were checked
    equal), what changes is whether training them there keeps them tied."""
    held = stated_shared_a(rows, base, adapter)
    if adapter.shared_a is None or held is None or held == adapter.shared_a or not adapter.fused_a(base):
        return []
    if adapter.shared_a:
        return [f"{what} keeps an A per projection: each fused module's shared A (q, k, v; gate, up) is written to "
                "every part, equal (training there unties them)"]
    return [f"{what} keeps one A per fused module: the adapter's separate (here equal) A's of q, k, v (gate, up) "
            "are written as one (training there ties them)"]


def adapter_rows(table, names: LoraNames, base: ModelSpec, adapter: AdapterSpec, what: str, **expand_args):
    """The LoRA rows of format table `table` for `adapter` on `base` (`interop.rows.expand`'s keywords pass
    through); every adapter tensor must have a row, else one line naming the first (a fused target whose parts
    the adapter does not all adapt: q alone where the format fuses q, k and v)."""
    from .rows import expand
    rows = expand(adapter_table(table, names), base, present=adapter.index(base), **expand_args)
    if "layers" not in expand_args:
        held = {n for row in rows for n in row.parts}
        for name in adapter.index(base):
            if name not in held:
                raise InteropError(f"{what} has no place for LoRA tensor {name}: it stores one adapter for a fused "
                                   "weight, so the adapter must adapt all of that weight's parts (q, k and v; "
                                   "gate and up)")
    return rows
