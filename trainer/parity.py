"""Parity: the same weights and batches through the reference trainer at several layouts and other frameworks.

Every run starts from the checkpoint's weights with a fresh AdamW, sees the same global
batches and applies the same update rule (`optim.py`); the per-step losses are compared
with the first run's.  fp32 reductions in different orders differ by ~1e-7, so a
difference above the tolerance (default 1e-5) means the runs do not compute the same thing.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from interop.errors import InteropError
from interop.store import is_store

from .config import TrainConfig

FRAMEWORKS = ("torch", "hf", "mindspore", "megatron")


@dataclass
class ParityResult:
    runs: dict[str, list[float]]  # label -> per-step losses
    tolerance: float
    plot: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def reference(self) -> str:
        return next(iter(self.runs))

    def diffs(self) -> dict[str, list[float]]:
        ref = self.runs[self.reference]
        return {k: [abs(a - b) for a, b in zip(v, ref)] for k, v in self.runs.items()}

    @property
    def max_diff(self) -> float:
        return max((d for v in self.diffs().values() for d in v), default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def table(self) -> str:
        labels = list(self.runs)
        width = max(12, *(len(x) for x in labels))
        lines = ["step  " + "  ".join(f"{x:>{width}}" for x in labels) + "  max |diff|"]
        steps = len(self.runs[self.reference])
        for i in range(steps):
            row = [self.runs[x][i] for x in labels]
            lines.append(f"{i + 1:>4}  " + "  ".join(f"{v:>{width}.7f}" for v in row)
                         + f"  {max(row) - min(row):.2e}")
        verdict = "OK" if self.ok else "FAIL"
        lines.append(f"largest difference {self.max_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}")
        return "\n".join(lines)


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    """'1x1,2x1,1x2,2x2' -> [(tp, pp, dp)]; an optional third number is dp ('1x1x2')."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            parts = [int(x) for x in item.lower().split("x")]
        except ValueError:
            raise InteropError(f"layout {item!r} is not TPxPP (e.g. 2x1) or TPxPPxDP") from None
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise InteropError(f"layout {item!r} is not TPxPP (e.g. 2x1) or TPxPPxDP")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else 1))
    if not out:
        raise InteropError("no layouts given")
    return out


def _as_store(ckpt, tmp: Path) -> str:
    """Parity starts from a common-format checkpoint; anything else is converted to one first."""
    if is_store(ckpt):
        return str(ckpt)
    from interop.convert import convert
    if not Path(ckpt).exists():
        raise InteropError(f"{ckpt}: checkpoint not found")
    convert(ckpt, tmp / "start", dst_format="interop")
    return str(tmp / "start")


def parity(ckpt, cfg: TrainConfig, layouts=((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)),
           frameworks=("torch", "hf"), tolerance: float = 1e-5, plot=None) -> ParityResult:
    """Run `cfg.steps` updates of every layout (torch) and framework from `ckpt`; compare the losses."""
    from .frameworks import hf_losses, mindspore_losses
    from .megatron_framework import megatron_losses
    from .launch import train
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        raise InteropError(f"unknown framework {unknown[0]!r} (known: {', '.join(FRAMEWORKS)})")
    if cfg.steps < 1:
        raise InteropError("parity needs --steps >= 1")
    # Default: two micro-batches per replica, so pipelined layouts really interleave them.
    gbs = cfg.global_batch_size or 2 * cfg.micro_batch_size * max(dp for _, _, dp in layouts)
    cfg = cfg.replace(global_batch_size=gbs, quiet=True)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="interop-parity-") as tmp:
        start = _as_store(ckpt, Path(tmp))
        if "torch" in frameworks:
            for tp, pp, dp in layouts:
                run_cfg = cfg.replace(load=start, save=None, resume=False, init_spec=None, tp=tp, pp=pp, dp=dp)
                label = f"torch {tp}x{pp}" + (f"x{dp}" if dp > 1 else "")
                runs[label] = [r["loss"] for r in train(run_cfg)]
        base = cfg.replace(load=start)
        if "hf" in frameworks:
            runs["hf"] = hf_losses(start, base)
        if "mindspore" in frameworks:
            runs["mindspore"] = mindspore_losses(start, base)
        if "megatron" in frameworks:
            runs["megatron"] = megatron_losses(start, base)
    if not runs:
        raise InteropError("nothing to compare: give at least one framework")
    result = ParityResult(runs, tolerance)
    if plot:
        result.plot = str(plot_losses(result, plot))
    return result


def plot_losses(result: ParityResult, path, title: str = "parity") -> Path:
    """Loss curves of every run (top) and each run's |difference| from the reference (bottom, log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    styles = ["-", "--", ":", "-."]
    for i, (label, losses) in enumerate(result.runs.items()):
        steps = range(1, len(losses) + 1)
        top.plot(steps, losses, styles[i % len(styles)], marker="o", markersize=3, label=label)
    for label, diffs in result.diffs().items():
        if label != result.reference:
            bottom.semilogy(range(1, len(diffs) + 1), [max(d, 1e-12) for d in diffs], marker=".", label=label)
    bottom.axhline(result.tolerance, color="red", linewidth=1, label=f"tolerance {result.tolerance:.0e}")
    top.set_ylabel("loss")
    top.set_title(f"{title}: largest difference {result.max_diff:.2e}")
    top.legend()
    bottom.set_ylabel(f"|loss - {result.reference}|")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
