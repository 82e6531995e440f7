"""ParallelLayout: which (tp, pp) ranks exist and which layers each pipeline stage owns.

A stage may hold several virtual-pipeline chunks (Megatron's interleaved schedule):
with L layers, pp stages and vpp chunks per stage, chunk c = v * pp + p holds the
c-th run of L / (pp * vpp) layers, so L=8, pp=2, vpp=2 gives stage 0 layers [0,1]
and [4,5], stage 1 layers [2,3] and [6,7].
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InteropError
from .params import Param

MAX_RANKS = 1 << 20  # tp * pp; far beyond any cluster, small enough to list


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_layout_flags(tp=1, pp=1, vpp=1, first_stage_layers=None, last_stage_layers=None, ep=1, etp=None) -> None:
    """Refuse layout flags that are nonsense whatever the model (`--first-stage-layers -2`, `--tp 0`),
    before any file is opened: the same rule for `interop convert` and `interop train`."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--vpp", vpp), ("--ep", ep), ("--etp", tp if etp is None else etp)):
        if not _is_int(value) or value < 1:
            raise InteropError(f"{flag} must be a positive integer, got {value!r}")
    if tp * pp > MAX_RANKS:
        raise InteropError(f"--tp {tp} x --pp {pp} is more than {MAX_RANKS:,} ranks")
    for flag, value in (("--first-stage-layers", first_stage_layers), ("--last-stage-layers", last_stage_layers)):
        if value is not None and (not _is_int(value) or value < 1):
            raise InteropError(f"{flag} must be a positive number of layers, got {value!r} "
                               "(Megatron requires at least one layer on the first and last stages)")
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and vpp > 1:
        raise InteropError("uneven first/last pipeline stages cannot be combined with virtual pipeline chunks")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    # stages[p][v] = (first layer, end layer) of virtual chunk v on pipeline stage p
    stages: tuple[tuple[tuple[int, int], ...], ...]
    ep: int = 1  # expert parallelism: MoE experts split evenly over ep ranks (dense tensors: every ep rank)
    # expert tensor parallelism: each routed expert split over etp ranks (megatron-core's
    # --expert-tensor-parallel-size; None given: tp, its default)
    etp: int | None = None

    check_flags = staticmethod(check_layout_flags)

    def __post_init__(self):
        problem = _layout_problem(self.tp, self.pp, self.stages)
        if problem is None and (not _is_int(self.ep) or not 1 <= self.ep <= MAX_RANKS):
            problem = f"ep must be a positive integer, got {self.ep!r}"
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if problem is None and (not _is_int(self.etp) or not 1 <= self.etp <= MAX_RANKS):
            problem = f"etp must be a positive integer, got {self.etp!r}"
        if problem:
            raise InteropError(f"invalid parallel layout: {problem}")

    @property
    def vpp(self) -> int:
        return len(self.stages[0])

    @property
    def num_layers(self) -> int:
        return sum(stop - start for chunks in self.stages for start, stop in chunks)

    @classmethod
    def build(cls, num_layers: int, tp: int = 1, pp: int = 1, vpp: int = 1,
              first_stage_layers: int | None = None, last_stage_layers: int | None = None,
              ep: int = 1, etp: int | None = None) -> "ParallelLayout":
        check_layout_flags(tp, pp, vpp, first_stage_layers, last_stage_layers, ep, etp)
        if first_stage_layers is not None or last_stage_layers is not None:
            counts = _uneven_counts(num_layers, pp, first_stage_layers, last_stage_layers)
            bounds, start = [], 0
            for n in counts:
                bounds.append(((start, start + n),))
                start += n
            return cls(tp, pp, tuple(bounds), ep, etp)
        chunks = pp * vpp
        if num_layers % chunks:
            raise InteropError(f"{num_layers} layers cannot be split evenly over pp={pp} x vpp={vpp} chunks")
        per = num_layers // chunks
        stages = tuple(
            tuple(((v * pp + p) * per, (v * pp + p + 1) * per) for v in range(vpp)) for p in range(pp)
        )
        return cls(tp, pp, stages, ep, etp)

    def ep_rank_of(self, param: Param, num_experts: int | None) -> int | None:
        """The expert-parallel rank holding a routed expert's tensor; None for every other tensor."""
        if param.expert is None:
            return None
        return param.expert // (num_experts // self.ep)

    def layers_of_stage(self, p: int) -> list[int]:
        return [i for start, stop in self.stages[p] for i in range(start, stop)]

    def stage_of_layer(self, layer: int) -> int:
        for p, chunks in enumerate(self.stages):
            if any(start <= layer < stop for start, stop in chunks):
                return p
        raise InteropError(f"layer {layer} is outside the layout's {self.num_layers} layers")

    def chunk_of_layer(self, layer: int) -> tuple[int, int, int]:
        """(stage, virtual chunk, layer number local to that chunk) of a global layer."""
        for p, chunks in enumerate(self.stages):
            for v, (start, stop) in enumerate(chunks):
                if start <= layer < stop:
                    return p, v, layer - start
        raise InteropError(f"layer {layer} is outside the layout's {self.num_layers} layers")

    def stage_of(self, param: Param) -> int:
        """Embeddings live on the first stage; the final norm and output head on the last."""
        if param.layer is not None:
            return self.stage_of_layer(param.layer)
        return 0 if param.name.startswith("embed.") else self.pp - 1

    def ranks(self) -> list[tuple[int, int]]:
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def to_dict(self) -> dict:
        data = {"tp": self.tp, "pp": self.pp, "stages": [[list(c) for c in chunks] for chunks in self.stages]}
        if self.ep != 1:  # absent for dense layouts, as before expert parallelism existed
            data["ep"] = self.ep
        if self.etp != self.tp:  # absent where experts are split like the dense layers (megatron-core's default)
            data["etp"] = self.etp
        return data

    @classmethod
    def from_dict(cls, data, where: str | None = None) -> "ParallelLayout":
        """A layout from stored fields (a manifest's `layout`); `where` names the file in errors."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict) or not {"tp", "pp", "stages"} <= set(data):
            raise InteropError(f"{prefix}invalid parallel layout: expected an object with tp, pp and stages")
        stages = data["stages"]
        if not isinstance(stages, list) or not all(
                isinstance(chunks, list) and all(isinstance(c, list) and len(c) == 2 for c in chunks) for chunks in stages):
            raise InteropError(f"{prefix}invalid parallel layout: stages must be lists of [first, end] layer pairs")
        try:
            return cls(data["tp"], data["pp"], tuple(tuple((a, b) for a, b in chunks) for chunks in stages),
                       data.get("ep", 1), data.get("etp"))
        except InteropError as exc:
            raise InteropError(f"{prefix}{exc}") from None

    def describe(self) -> str:
        parts = []
        for p, chunks in enumerate(self.stages):
            ranges = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" if b > a else "none" for a, b in chunks)
            parts.append(f"pp{p}: layers {ranges}")
        vpp = f" vpp={self.vpp}" if self.vpp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        ep += f" etp={self.etp}" if self.etp != self.tp else ""
        return f"tp={self.tp} pp={self.pp}{vpp}{ep} ({'; '.join(parts)})"


def _layout_problem(tp, pp, stages) -> str | None:
    """What is wrong with a layout's fields, or None.  Chunks taken in Megatron's order (virtual chunk
    v of every stage, then v + 1) must tile layers 0..L-1 with no gap or overlap; a chunk may be empty
    (a stage that holds only embeddings), a whole layout may not."""
    if not _is_int(tp) or not _is_int(pp) or tp < 1 or pp < 1:
        return f"tp and pp must be positive integers, got tp={tp!r}, pp={pp!r}"
    if tp * pp > MAX_RANKS:
        return f"tp={tp} x pp={pp} is more than {MAX_RANKS:,} ranks"
    if not isinstance(stages, tuple) or len(stages) != pp:
        return f"{len(stages) if isinstance(stages, tuple) else 'no'} stages listed for pp={pp}"
    if not all(isinstance(chunks, tuple) and chunks for chunks in stages) or len({len(c) for c in stages}) != 1:
        return "every stage must list the same number (at least one) of virtual chunks"
    end = 0
    for v in range(len(stages[0])):
        for p in range(pp):
            chunk = stages[p][v]
            if not (isinstance(chunk, tuple) and len(chunk) == 2 and all(_is_int(x) for x in chunk)):
                return f"stage {p} chunk {v} is not a pair of layer numbers: {chunk!r}"
            start, stop = chunk
            if start != end or stop < start:
                return f"stage {p} chunk {v} holds layers [{start}, {stop}), expected to start at layer {end}"
            end = stop
    if end < 1:
        return "no layers"
    return None


def _uneven_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per stage when the first and/or last stage differ, the rest split evenly."""
    fixed = [first, last] if pp > 1 else [first if first is not None else last]
    middle_stages = pp - sum(x is not None for x in fixed)
    rest = num_layers - sum(x for x in fixed if x is not None)
    if rest < 0 or (middle_stages and (rest < middle_stages or rest % middle_stages)) or (not middle_stages and rest):
        raise InteropError(
            f"{num_layers} layers do not fit pp={pp} with first stage {first} and last stage {last} layers "
            "(every stage needs at least one layer, the middle stages an equal number)")
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if pp == 1 and first is not None and last is not None and first != last:
        raise InteropError(f"at pp=1 the first stage is the last: --first-stage-layers {first} and "
                           f"--last-stage-layers {last} disagree")
    return counts
