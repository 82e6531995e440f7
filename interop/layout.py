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


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    # stages[p][v] = (first layer, end layer) of virtual chunk v on pipeline stage p
    stages: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def vpp(self) -> int:
        return len(self.stages[0])

    @property
    def num_layers(self) -> int:
        return sum(stop - start for chunks in self.stages for start, stop in chunks)

    @classmethod
    def build(cls, num_layers: int, tp: int = 1, pp: int = 1, vpp: int = 1,
              first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> "ParallelLayout":
        if tp < 1 or pp < 1 or vpp < 1:
            raise InteropError(f"tp, pp and vpp must be >= 1 (got tp={tp}, pp={pp}, vpp={vpp})")
        uneven = first_stage_layers is not None or last_stage_layers is not None
        if uneven and vpp > 1:
            raise InteropError("uneven first/last pipeline stages cannot be combined with virtual pipeline chunks")
        if uneven:
            counts = _uneven_counts(num_layers, pp, first_stage_layers, last_stage_layers)
            bounds, start = [], 0
            for n in counts:
                bounds.append(((start, start + n),))
                start += n
            return cls(tp, pp, tuple(bounds))
        chunks = pp * vpp
        if num_layers % chunks:
            raise InteropError(f"{num_layers} layers cannot be split evenly over pp={pp} x vpp={vpp} chunks")
        per = num_layers // chunks
        stages = tuple(
            tuple(((v * pp + p) * per, (v * pp + p + 1) * per) for v in range(vpp)) for p in range(pp)
        )
        return cls(tp, pp, stages)

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
        return {"tp": self.tp, "pp": self.pp, "stages": [[list(c) for c in chunks] for chunks in self.stages]}

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelLayout":
        try:
            stages = tuple(tuple((int(a), int(b)) for a, b in chunks) for chunks in data["stages"])
            layout = cls(int(data["tp"]), int(data["pp"]), stages)
        except (KeyError, TypeError, ValueError) as exc:
            raise InteropError(f"invalid parallel layout {data!r}: {exc}") from None
        if len(stages) != layout.pp or len({len(c) for c in stages}) != 1:
            raise InteropError(f"invalid parallel layout {data!r}: stages do not match pp")
        return layout

    def describe(self) -> str:
        parts = []
        for p, chunks in enumerate(self.stages):
            ranges = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in chunks)
            parts.append(f"pp{p}: layers {ranges}")
        vpp = f" vpp={self.vpp}" if self.vpp > 1 else ""
        return f"tp={self.tp} pp={self.pp}{vpp} ({'; '.join(parts)})"


def _uneven_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per stage when the first and/or last stage differ, the rest split evenly."""
    if pp == 1:
        return [num_layers]
    fixed = [first, last]
    middle_stages = pp - sum(x is not None for x in fixed)
    rest = num_layers - sum(x for x in fixed if x is not None)
    if rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
        raise InteropError(
            f"{num_layers} layers do not fit pp={pp} with first stage {first} and last stage {last} layers")
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts
