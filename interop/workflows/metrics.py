"""Reading runs back: the losses a run logged to `SAVE/metrics.jsonl`, and two runs' curves compared.

A resumed run appends to the same file (entries after its checkpoint are dropped
first), so "stopped at 10, resumed at another layout" reads back as one curve, to be
laid over the uninterrupted run's with the same table and plot as parity.
"""
from __future__ import annotations

import json
from pathlib import Path

from interop.errors import InteropError

from .parity import ParityResult, plot_losses


def read_losses(save_dir) -> list[float]:
    """Per-step losses of the run saved in `save_dir`, steps 1..n (the last entry wins for a step)."""
    path = Path(save_dir) / "metrics.jsonl"
    if not path.is_file():
        raise InteropError(f"{path}: no metrics (was the run started with --save {save_dir}?)")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record["loss"]
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        raise InteropError(f"{path}: steps {steps[:1]}..{steps[-1:]} have gaps")
    return [by_step[s] for s in steps]


def compare_runs(runs: dict, tolerance: float = 1e-6, plot=None, marks: dict | None = None) -> ParityResult:
    """{label: save dir} -> the runs' curves side by side (the first is the reference), optionally plotted
    (`marks` {step: label}: vertical lines, e.g. where a run stopped and resumed)."""
    result = ParityResult({label: read_losses(path) for label, path in runs.items()}, tolerance)
    lengths = {len(v) for v in result.runs.values()}
    if len(lengths) != 1:
        raise InteropError(f"the runs logged different numbers of steps: { {k: len(v) for k, v in result.runs.items()} }")
    if plot:
        result.plot = str(plot_losses(result, plot, title="loss curves", marks=marks))
    return result
