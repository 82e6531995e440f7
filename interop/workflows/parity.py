"""Parity: the same weights and batches through the reference trainer at several layouts and other frameworks.

Every run starts from the checkpoint's weights with a fresh AdamW, sees the same global
batches and applies the same update rule (`optim.py`); the per-step losses are compared
with the first run's.  fp32 reductions in different orders differ by ~1e-7, so a
difference above the tolerance (default 1e-5) means the runs do not compute the same thing.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from interop.errors import InteropError
from interop.store import is_store

from ..trainer.config import TrainConfig
from .tolerance import check_tolerance

FRAMEWORKS = ("torch", "hf", "mindspore", "megatron")  # and megatron:epN (megatron-core at expert parallelism N)


@dataclass
class ParityResult:
    runs: dict[str, list[float]]  # label -> per-step losses
    tolerance: float
    plot: str | None = None
    notes: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # label -> why that run failed (the others still count)

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
        return bool(self.runs) and not self.failed and self.max_diff <= self.tolerance

    def table(self) -> str:
        failures = [f"{label}: FAILED ({why})" for label, why in self.failed.items()]
        if not self.runs:
            return "\n".join(failures + ["no run finished: FAIL"])
        labels = list(self.runs)
        width = max(12, *(len(x) for x in labels))
        lines = ["step  " + "  ".join(f"{x:>{width}}" for x in labels) + "  max |diff|"]
        steps = len(self.runs[self.reference])
        for i in range(steps):
            row = [self.runs[x][i] for x in labels]
            lines.append(f"{i + 1:>4}  " + "  ".join(f"{v:>{width}.7f}" for v in row)
                         + f"  {max(row) - min(row):.2e}")
        lines += failures
        verdict = "OK" if self.ok else "FAIL"
        lines.append(f"largest difference {self.max_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}"
                     + (f", {len(self.failed)} run(s) failed" if self.failed else ""))
        return "\n".join(lines)


def parse_layouts(text: str) -> list[tuple[int, ...]]:
    """'1x1,2x1,1x2,2x2' -> [(tp, pp, dp)]; an optional third number is dp ('1x1x2'), a fourth the
    expert parallelism carved out of dp ('1x1x2x2': tp 1, pp 1, dp 2, ep 2)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            parts = [int(x) for x in item.lower().split("x")]
        except ValueError:
            raise InteropError(f"layout {item!r} is not TPxPP (e.g. 2x1), TPxPPxDP or TPxPPxDPxEP") from None
        if len(parts) not in (2, 3, 4) or min(parts) < 1:
            raise InteropError(f"layout {item!r} is not TPxPP (e.g. 2x1), TPxPPxDP or TPxPPxDPxEP")
        out.append(tuple(parts) + (1,) * max(0, 3 - len(parts)))
    if not out:
        raise InteropError("no layouts given")
    return out


def _megatron_ep(framework: str) -> int:
    """'megatron:ep2' -> 2: megatron-core with a mixture-of-experts model's experts over 2 processes (dp 2)."""
    tail = framework.split(":", 1)[1]
    if not (tail.startswith("ep") and (tail[2:].isascii() and tail[2:].isdigit()) and int(tail[2:]) >= 1):
        raise InteropError(f"framework {framework!r}: write megatron:epN (N expert-parallel processes)")
    return int(tail[2:])


def _unpack(layout) -> tuple[int, int, int, int]:
    """(tp, pp, dp) or (tp, pp, dp, ep) -> (tp, pp, dp, ep)."""
    return tuple(layout) + (1,) * (4 - len(layout))


def _label(layout) -> str:
    tp, pp, dp, ep = _unpack(layout)
    return f"{tp}x{pp}" + (f"x{dp}" if dp > 1 or ep > 1 else "") + (f" ep{ep}" if ep > 1 else "")


def _as_store(ckpt, tmp: Path) -> str:
    """Parity starts from a common-format checkpoint; anything else is converted to one first."""
    if is_store(ckpt):
        return str(ckpt)
    from interop.convert import convert
    if not Path(ckpt).exists():
        raise InteropError(f"{ckpt}: checkpoint not found")
    convert(ckpt, tmp / "start", dst_format="interop")
    return str(tmp / "start")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def preflight(start, cfg: TrainConfig, layouts, frameworks) -> None:
    """Everything that would make a run fail, checked before any run starts (one line naming each problem):
    every torch layout is planned as `interop train` plans it, every framework is installed and can hold
    the model."""
    from interop.store import StoreReader
    from ..trainer.launch import cleanup, prepare
    spec = StoreReader(start, verify=False).spec
    problems = []
    if "torch" in frameworks:
        for layout in layouts:
            tp, pp, dp, ep = _unpack(layout)
            try:
                cleanup(prepare(cfg.replace(load=start, save=None, resume=False, init_spec=None, tp=tp, pp=pp, dp=dp,
                                            ep=ep)))
            except InteropError as exc:
                problems.append(f"layout {tp}x{pp}x{dp}" + (f"x{ep}" if ep > 1 else "") + f": {exc}")
    if "hf" in frameworks:
        if importlib.util.find_spec("transformers") is None:
            problems.append("framework hf: transformers is not installed")
        else:
            from interop.mappings.hf_config import hf_config_from_spec
            try:
                hf_config_from_spec(spec)
            except InteropError as exc:
                problems.append(f"framework hf: {exc}")
            trained = cfg.trained_spec(spec)
            if trained.mtp_layers and trained.mtp_loss_weight > 0:
                problems.append(f"framework hf: transformers' model has no MTP modules, and the reference trainer "
                                f"trains this model's {spec.mtp_layers} (loss weight {trained.mtp_loss_weight:g}), so "
                                f"the losses would part after the first step; compare with hf at "
                                f"--mtp-loss-scaling-factor 0, or the layouts alone (--frameworks torch)")
            if spec.is_moe and spec.moe_aux_loss_coeff > 0:
                problems.append(f"framework hf: the model has a load-balancing loss (coefficient "
                                f"{spec.moe_aux_loss_coeff}), which the reference trainer computes as Megatron does, "
                                f"per micro-batch and layer, and transformers otherwise (trainer/moe.py); "
                                f"compare with hf at moe_aux_loss_coeff 0")
    if cfg.adapter:  # a LoRA run: the reference trainer's layouts against HF PEFT
        others = [f for f in frameworks if f not in ("torch", "hf")]
        if others:
            problems.append(f"framework {others[0]}: LoRA parity runs the reference trainer and hf (PEFT) only")
        if cfg.lora_dropout:
            problems.append(f"LoRA dropout {cfg.lora_dropout}: each run draws its own masks; compare at dropout 0")
        if "hf" in frameworks and importlib.util.find_spec("peft") is None:
            problems.append("framework hf: peft is not installed (a LoRA run trains a PEFT adapter)")
        elif "hf" in frameworks:
            from ..converters.peft import shares_a
            adapter = StoreReader(cfg.adapter, verify=False).source.adapter
            if adapter.shared_a is not None and adapter.fused_a(spec) and shares_a(spec, adapter) != adapter.shared_a:
                problems.append(f"framework hf: PEFT's LoRA on transformers' {spec.arch} model has "
                                f"{'an A per projection' if adapter.shared_a else 'one A per fused linear'} where "
                                f"this adapter has {'one A per fused module' if adapter.shared_a else 'an A each'} "
                                f"(shared_a {str(adapter.shared_a).lower()}): training there would "
                                f"{'untie' if adapter.shared_a else 'tie'} them; compare "
                                f"{'--no-lora-shared-a' if adapter.shared_a else '--lora-shared-a'}")
    if "mindspore" in frameworks and importlib.util.find_spec("mindspore") is None:
        problems.append("framework mindspore: mindspore is not installed")
    if any(f == "megatron" or f.startswith("megatron:") for f in frameworks):
        from .megatron_framework import precondition
        why = precondition(spec)
        if why:
            problems.append(f"framework megatron: {why}")
    for f in (f for f in frameworks if f.startswith("megatron:")):
        try:
            spec.check_ep(_megatron_ep(f))
        except InteropError as exc:
            problems.append(f"framework {f}: {exc}")
        else:
            ep = _megatron_ep(f)
            if cfg.global_batch_size % (cfg.micro_batch_size * ep):
                problems.append(f"framework {f}: the global batch {cfg.global_batch_size} is not a multiple of "
                                f"micro batch {cfg.micro_batch_size} x dp {ep} (megatron-core runs dp = ep)")
    if problems:
        raise InteropError("; ".join(problems) + (" (drop it from --frameworks / --layouts)" if len(problems) == 1
                                                   else " (drop them from --frameworks / --layouts)"))


def _with_adapter(start, cfg: TrainConfig, tmp: Path) -> TrainConfig:
    """A LoRA run from fresh --lora-* flags: the adapter drawn once (from --seed), so every run starts from it."""
    if cfg.adapter or cfg.lora_rank is None and cfg.lora_alpha is None and cfg.lora_targets is None:
        return cfg
    from interop.store import StoreReader
    from ..trainer.lora import init_adapter
    from ..trainer.train import lora_flags
    spec = StoreReader(start, verify=False).spec
    return cfg.replace(adapter=str(init_adapter(spec, lora_flags(cfg, spec), tmp / "adapter", seed=cfg.seed)))


def parity(ckpt, cfg: TrainConfig, layouts=((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)),
           frameworks=("torch", "hf"), tolerance: float = 1e-5, plot=None, log=_stderr) -> ParityResult:
    """Run `cfg.steps` updates of every layout (torch) and framework from `ckpt`; compare the losses.

    Every layout and framework is checked before the first run (`preflight`).  A run that still fails
    midway is reported in `result.failed` with its reason; the others are compared and plotted.
    `log` gets one progress line per run (stderr by default; None for silence)."""
    check_tolerance(tolerance)
    from .frameworks import hf_losses, mindspore_losses
    from .megatron_framework import megatron_losses
    from ..trainer.launch import TrainingFailed, train
    log = log or (lambda message: None)
    megatron_eps = {f: _megatron_ep(f) for f in frameworks if f.startswith("megatron:")}
    unknown = [f for f in frameworks if f not in FRAMEWORKS and f not in megatron_eps]
    if unknown:
        raise InteropError(f"unknown framework {unknown[0]!r} (known: {', '.join(FRAMEWORKS)}; megatron:epN)")
    if cfg.steps < 1:
        raise InteropError("parity needs --steps >= 1")
    if not frameworks:
        raise InteropError("nothing to compare: give at least one framework")
    # Default: two micro-batches per replica, so pipelined layouts really interleave them.
    replicas = max([_unpack(layout)[2] for layout in layouts] + list(megatron_eps.values()))
    gbs = cfg.global_batch_size or 2 * cfg.micro_batch_size * replicas
    cfg = cfg.replace(global_batch_size=gbs, quiet=True)
    jobs = []  # each job runs `cfg` (read when it runs: a LoRA run's starting adapter is set in by then)
    if "torch" in frameworks:
        for layout in layouts:
            tp, pp, dp, ep = _unpack(layout)
            jobs.append((f"torch {_label(layout)}", lambda start, cfg, tp=tp, pp=pp, dp=dp, ep=ep: [
                r["loss"] for r in train(cfg.replace(load=start, save=None, resume=False, init_spec=None, tp=tp, pp=pp,
                                                     dp=dp, ep=ep))]))
    others = {"hf": hf_losses, "mindspore": mindspore_losses, "megatron": megatron_losses}
    jobs += [(name, lambda start, cfg, fn=others[name]: fn(start, cfg.replace(load=start)))
             for name in ("hf", "mindspore", "megatron") if name in frameworks]
    jobs += [(f"megatron ep{ep}", lambda start, cfg, ep=ep: megatron_losses(start, cfg.replace(load=start), ep=ep))
             for ep in megatron_eps.values()]
    result = ParityResult({}, tolerance)
    with tempfile.TemporaryDirectory(prefix="interop-parity-") as tmp:
        start = _as_store(ckpt, Path(tmp))
        cfg = _with_adapter(start, cfg, Path(tmp))
        preflight(start, cfg, layouts, frameworks)
        for i, (label, run) in enumerate(jobs, 1):
            log(f"parity [{i}/{len(jobs)}] {label}: {cfg.steps} steps ...")
            began = time.perf_counter()
            try:
                losses = run(start, cfg)
            except (InteropError, TrainingFailed, RuntimeError) as exc:
                result.failed[label] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log(f"parity [{i}/{len(jobs)}] {label}: FAILED after {time.perf_counter() - began:.1f} s: "
                    f"{result.failed[label]}")
                continue
            result.runs[label] = losses
            log(f"parity [{i}/{len(jobs)}] {label}: done in {time.perf_counter() - began:.1f} s, "
                f"final loss {losses[-1]:.6f}")
    if plot and result.runs:
        result.plot = str(plot_losses(result, plot))
    return result


def plot_training(metrics: list[dict], path, title: str = "train") -> Path:
    """A training run's loss per step (`interop train --plot`), from the metrics the trainer returns."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    steps, losses = [m["step"] for m in metrics], [m["loss"] for m in metrics]
    ax.plot(steps, losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: steps {steps[0]}..{steps[-1]}, final loss {losses[-1]:.6f}" if steps else title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_losses(result: ParityResult, path, title: str = "parity", marks: dict | None = None) -> Path:
    """Loss curves of every run (top) and each run's |difference| from the reference (bottom, log scale; a run
    equal to the reference at a step is drawn in the shaded band at the bottom, on a row of its own), with a
    table of each run's largest difference beside the legend.  `marks` {step: label} draws a labelled vertical
    line on both (e.g. where a run stopped and resumed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = ["-", "--", ":", "-."]
    color = {label: f"C{i % 10}" for i, label in enumerate(result.runs)}  # one colour per run on both plots
    for i, (label, losses) in enumerate(result.runs.items()):
        steps = range(1, len(losses) + 1)
        top.plot(steps, losses, styles[i % len(styles)], marker="o", markersize=3, label=label, color=color[label])
    # A log axis has no 0: a step whose loss equals the reference's exactly is drawn in the band below 1e-11,
    # each run on a row of its own (floor x 2^k) with a marker of its own, so identical runs never hide each other.
    floor = 1e-12
    markers = "os^vD<>pPX*h"
    exact = False
    others = [(label, diffs) for label, diffs in result.diffs().items() if label != result.reference]
    for k, (label, diffs) in enumerate(others):
        exact = exact or any(d == 0 for d in diffs)
        row = floor * 2 ** k
        bottom.semilogy(range(1, len(diffs) + 1), [d if d > 0 else row for d in diffs], linestyle=styles[k % len(styles)],
                        marker=markers[k % len(markers)], markersize=5, label=label, color=color[label])
    bottom.axhline(result.tolerance, color="red", linewidth=1, label=f"tolerance {result.tolerance:.0e}")
    table = "\n".join(f"{label:<12} {max(diffs, default=0.0):.2e}" for label, diffs in others)
    fig.text(0.80, 0.04, f"largest |diff| per run\n{table}", family="monospace", fontsize="small", va="bottom")
    for i, (at, text) in enumerate(sorted((marks or {}).items())):
        for ax in (top, bottom):
            ax.axvline(at, color="black", linewidth=1, linestyle="--" if i % 2 == 0 else "-.",
                       label=text if ax is top else None)
    if exact:
        bottom.axhspan(floor / 2, floor * 2 ** len(others), color="gray", alpha=0.15,
                       label="exactly 0 (a row per run in this band)")
    top.set_ylabel("loss")
    title_text = f"{title}: largest difference {result.max_diff:.2e}"
    if result.failed:
        title_text += f"; failed: {', '.join(result.failed)}"
    top.set_title(title_text)
    # legends outside the axes, right of the plots: never over the curves
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    bottom.set_ylabel(f"|loss - {result.reference}|")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
