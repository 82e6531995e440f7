"""Proof that a conversion kept the model: one fixed batch through the source and the converted checkpoint.

Both checkpoints run in the reference model (the trainer's decoder, fed from the common
format: a checkpoint in any other format is converted to a temporary common-format copy
first), and each also runs in its own framework where that is installed: transformers'
`AutoModelForCausalLM` for HF, MindSpore ops over `mindspore.load_checkpoint` for MindSpore
(`mindspore_model.py`), megatron-core's `GPTModel` for Megatron
(`megatron_framework.py`).  Every run's logits are compared with the reference
model's on the source; the largest difference must stay within the tolerance (1e-5, and more
only where a real cast rounded the weights: fp32 -> bf16 or fp16, see TOLERANCE).

Before any model runs, the two checkpoints' weights are compared tensor by tensor: a tensor of
the same dtype on both sides must be bit-identical (an honest conversion moves bytes, it does not
change them: one altered element fails, however small its effect on the logits), and a NaN or Inf
in any weight or logit is a failure.  Only a tensor whose dtype changed is left to the logit
tolerance.

Everything computes in fp32 on the CPU; the batch is fixed (seeded), so two calls agree.  Each
stage reports a line with its time through `log` as it ends, after an estimate of the whole.
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..formats import detect_format, reader_of, writer_of
from ..errors import InteropError
from ..io.small_files import read_json_object
from .tolerance import check_tolerance

# Largest allowed |logit difference| by the lowest precision among the two checkpoints.  fp32 runs
# differ only by summation order (~1e-7); bf16/fp16 weights rounded from fp32 move tiny models'
# logits by ~1e-3..1e-2 (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
BATCH, SEQ, SEED = 2, 32, 0
# For the estimate printed before starting: seconds per GB of fp32 weights for one run (loading the weights and
# the forward pass), measured on a 2-core VM (a 1.9 GB bf16 Llama: 194 s for six runs).
SECONDS_PER_FP32_GB_RUN = 8.5
# A framework's start before its first forward pass (importing it; megatron-core in a child process of its own),
# measured on the same VM under load with tiny models.
FRAMEWORK_START_SECONDS = {"hf": 12, "mindspore": 10, "megatron": 20}


@dataclass
class Check:
    """One run of the batch: which checkpoint, in which model, its loss, and its largest logit difference."""
    label: str
    loss: float
    max_diff: float  # largest |logit difference| from the reference model on the source


@dataclass
class VerifyResult:
    src: str
    dst: str
    tolerance: float
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # frameworks skipped, and why
    tensors: "TensorComparison | None" = None  # the weights compared before any model ran

    @property
    def max_diff(self) -> float:
        diffs = [c.max_diff for c in self.checks]
        return math.nan if any(not math.isfinite(d) for d in diffs) else max(diffs, default=0.0)

    @property
    def ok(self) -> bool:
        """Every logit difference finite and within the tolerance, and no weight changed that kept its dtype."""
        tensors_ok = self.tensors is None or self.tensors.ok
        return tensors_ok and math.isfinite(self.max_diff) and self.max_diff <= self.tolerance

    def lines(self) -> list[str]:
        width = max(len(c.label) for c in self.checks)
        out = [f"verify {self.src} -> {self.dst}: {BATCH} x {SEQ} tokens (seed {SEED}), fp32 on CPU"]
        out += [f"  {c.label:<{width}}  loss {c.loss:.7f}  max |logit diff| {c.max_diff:.2e}" for c in self.checks]
        out += [f"  note: {n}" for n in self.notes]
        if self.tensors is not None:
            out.append(f"  {self.tensors.line()}")
        verdict = "OK" if self.ok else "FAIL"
        out.append(f"  largest logit difference {self.max_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}")
        return out


@dataclass
class TensorComparison:
    """The weights of both checkpoints, compared before any model runs (see the module docstring)."""
    exact: int = 0  # tensors of one dtype on both sides: all bit-identical when `changed` is empty
    cast: int = 0  # tensors whose dtype differs: left to the logit tolerance
    changed: list[str] = field(default_factory=list)  # "name (max |diff| D)" of same-dtype tensors that differ
    not_finite: list[str] = field(default_factory=list)  # "name (side)" holding NaN or Inf

    @property
    def ok(self) -> bool:
        return not self.changed and not self.not_finite

    def line(self) -> str:
        if self.not_finite:
            return f"weights: NaN or Inf in {', '.join(self.not_finite[:3])}" + _more(self.not_finite)
        if self.changed:
            return (f"weights: {len(self.changed)} of {self.exact} tensors of one dtype differ: "
                    f"{', '.join(self.changed[:3])}" + _more(self.changed))
        cast = f"; {self.cast} cast (compared by their logits)" if self.cast else ""
        return f"weights: {self.exact} tensors of one dtype bit-identical{cast}"


def _more(items: list) -> str:
    return f" and {len(items) - 3} more" if len(items) > 3 else ""


def compare_tensors(source, converted) -> TensorComparison:
    """Both common-format copies' weights, one tensor at a time (vocab rows beyond the true vocabulary are
    padding and not compared)."""
    import torch
    from ..params import base_param_name
    from ..store import StoreReader
    result = TensorComparison()
    a, b = StoreReader(source, verify=False), StoreReader(converted, verify=False)
    try:
        vocab = a.spec.vocab
        theirs = {m.name: m for m in b.metas()}
        for meta in a.metas():
            if base_param_name(meta.name) != meta.name:
                continue  # optimizer state: not part of the model
            if meta.name not in theirs:
                result.changed.append(f"{meta.name} (missing)")
                continue
            x, y = a.read(meta.name), b.read(meta.name)
            if a.manifest["tensors"][meta.name].get("split") == "vocab":
                x, y = x[:vocab], y[:vocab]
            for side, t in (("source", x), ("converted", y)):
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    result.not_finite.append(f"{meta.name} ({side})")
            if x.dtype != y.dtype:
                result.cast += 1
                continue
            result.exact += 1
            if x.shape != y.shape:
                result.changed.append(f"{meta.name} (shape {list(x.shape)} vs {list(y.shape)})")
            elif not torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y):
                diff = float((x.double() - y.double()).abs().max())
                result.changed.append(f"{meta.name} (max |diff| {diff:.2e})")
    finally:
        a.close()
        b.close()
    return result


def estimate(spec, frameworks: list[str]) -> tuple[float, float]:
    """(seconds, bytes of memory at the peak) this verification should take, before the models run: two
    reference runs and one per framework in `frameworks` (formats), each loading the model in fp32 (see
    SECONDS_PER_FP32_GB_RUN) after its framework starts (FRAMEWORK_START_SECONDS).  The peak is the model in
    fp32 as a framework loads it: its weights and the state dict they came from."""
    from ..params import param_index
    fp32 = 4 * sum(math.prod(p.shape) for p in param_index(spec).values())
    runs = 2 + len(frameworks)
    seconds = runs * fp32 / 1e9 * SECONDS_PER_FP32_GB_RUN + sum(FRAMEWORK_START_SECONDS[f] for f in frameworks)
    return seconds, 2 * fp32


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


class _Stages:
    """One line per stage through `log`, with the stage's time, as each ends."""

    def __init__(self, log):
        self.log = log

    def run(self, what: str, fn):
        started = time.perf_counter()
        out = fn()
        self.log(f"  {what}: {time.perf_counter() - started:.1f} s")
        return out


def verify(src, dst, *, src_format: str | None = None, dst_format: str | None = None, tolerance: float | None = None,
           frameworks: bool = True, dst_model_config=None, options: dict | None = None, log=None, adapter=None,
           **format_options) -> VerifyResult:
    """Run the fixed batch through `src` and `dst`; see the module docstring.  Reader options for the
    source (`model_config=`, `iteration=`) as keywords or in `options`; `dst_model_config` describes a
    destination that carries no model description.  `adapter`: a LoRA adapter on `src`: the source run is
    `src` + adapter (merged in fp32 into the source's copy, `interop.merge`), what `dst` must equal.  `log(line)` gets the estimate (before anything is
    converted or run) and a line per stage as it ends (the CLI prints them on stderr)."""
    check_tolerance(tolerance)
    import torch
    from ..convert import convert_here, split_options
    from ..store import StoreReader, is_store
    stages = _Stages(log or (lambda line: None))
    src_options = {k: v for k, v in {**(options or {}), **format_options}.items() if v is not None}
    src_format = src_format or detect_format(src)
    dst_format = dst_format or detect_format(dst)
    dst_options = {"model_config": dst_model_config} if dst_model_config else {}
    reader_cls = reader_of(src_format)
    reader = reader_cls(src, **split_options(reader_cls, writer_of("interop"), src_options, src_format, "interop")[0])
    # ^ the model's size, for the estimate (headers only)
    try:
        first_spec = reader.source.spec
    finally:
        reader.close()
    ran = [fmt for fmt in (src_format, dst_format) if frameworks and fmt in FRAMEWORK_NAMES]
    seconds, peak = estimate(first_spec, ran)
    stages.log(f"verify: {2 + len(ran)} runs of the model in fp32 ({_size(peak / 2)} each), one at a time; "
               f"estimated {seconds:.0f} s, peak memory about {_size(peak)}")
    with tempfile.TemporaryDirectory(prefix="interop-verify-") as tmp:
        stores = {}
        for which, path, fmt, opts in (("source", src, src_format, src_options),
                                       ("converted", dst, dst_format, dst_options)):
            merge = {"adapter": adapter, "merge": True} if which == "source" and adapter is not None else {}
            if is_store(path) and not merge:
                stores[which] = Path(path)
            else:
                stores[which] = Path(tmp) / which
                stages.run(f"read the {which} ({fmt}){' with the adapter merged' if merge else ''} into a "
                           "common-format copy",
                           lambda path=path, which=which, fmt=fmt, opts=opts, merge=merge:
                           convert_here(path, stores[which], src_format=fmt, dst_format="interop", **opts, **merge))
                # ^ in this process, also under torchrun: the copies are verify's own, in its own temporary folder
        specs = {which: StoreReader(p, verify=False).spec for which, p in stores.items()}
        if _spec_difference(specs["source"], specs["converted"]):
            raise InteropError(f"{dst} describes another model than {src}: "
                               + _spec_difference(specs["source"], specs["converted"]))
        ruled = specs["source"].differences(specs["converted"], ignore=())
        rule_notes = [f"the converted model computes {k}={y}, the source {k}={x} (a rule the target's class "
                      "imposes): the logits show what it changes" for k, x, y in ruled if k in RULES]
        spec = specs["source"]
        dtypes = {s.dtype for s in specs.values()}
        lowest = max(dtypes, key=lambda d: TOLERANCE[d])
        # No cast between the two: the weights are the same numbers, so only summation order separates the runs.
        tol = tolerance if tolerance is not None else TOLERANCE[lowest if len(dtypes) > 1 else "float32"]
        result = VerifyResult(str(src), str(dst), tol)
        result.tensors = stages.run("compared the weights tensor by tensor",
                                    lambda: compare_tensors(stores["source"], stores["converted"]))
        tokens = torch.randint(0, spec.vocab, (BATCH, min(SEQ, spec.max_positions)),
                               generator=torch.Generator().manual_seed(SEED))
        source_run = stages.run("reference model, source", lambda: reference_run(stores["source"], tokens))
        reference = source_run[0]
        result.notes += rule_notes
        converted_run = stages.run("reference model, converted", lambda: reference_run(stores["converted"], tokens))
        runs = [(f"reference model, source ({src_format})", reference),
                (f"reference model, converted ({dst_format})", converted_run[0])]
        if frameworks:
            for which, path, fmt in (("source", src, src_format), ("converted", dst, dst_format)):
                if fmt not in FRAMEWORK_NAMES:
                    continue
                if which == "source" and adapter is not None:
                    result.notes.append(f"source: {FRAMEWORK_NAMES[fmt]} would run the base without the adapter: "
                                        "not run (the reference model runs base + adapter)")
                    continue
                try:
                    logits = stages.run(f"{FRAMEWORK_NAMES[fmt]}, {which}",
                                        lambda path=path, which=which, fmt=fmt:
                                        framework_logits(fmt, path, stores[which], tokens, Path(tmp) / f"fw-{which}"))
                except FrameworkUnavailable as exc:
                    result.notes.append(f"{which}: {exc}")
                    continue
                runs.append((f"{FRAMEWORK_NAMES[fmt]}, {which} ({fmt})", logits))
        for label, logits in runs:
            result.checks.append(Check(label, lm_loss(logits, tokens), _max_diff(logits, reference)))
        for k, (theirs, ours) in enumerate(zip(source_run[1], converted_run[1])):  # the MTP modules' own heads
            for which, logits in (("source", theirs), ("converted", ours)):
                result.checks.append(Check(f"reference model, {which}: MTP module {k + 1} (tokens {k + 2} ahead)",
                                           lm_loss(logits, tokens, ahead=k + 2), _max_diff(logits, theirs)))
    return result


# Facts of how a model computes that a writer may change on request, the tensors staying the same (HF
# Mixtral's renormalised top-k, `--renormalize-topk`): verify runs both and shows the difference.
RULES = ("moe_norm_topk",)


def _max_diff(logits, reference) -> float:
    """Largest |difference|; NaN when either side holds a NaN or Inf (a failure, never a pass)."""
    import torch
    if not (bool(torch.isfinite(logits).all()) and bool(torch.isfinite(reference).all())):
        return math.nan
    return float((logits - reference).abs().max())


def _spec_difference(a, b) -> str:
    """The model facts that differ (not the dtype, the padding or a RULE)."""
    return ", ".join(f"{k} {x} vs {y}" for k, x, y in a.differences(b, ignore=("dtype", "padded_vocab", *RULES)))


def lm_loss(logits, tokens, ahead: int = 1) -> float:
    """Mean cross entropy of predicting token t+ahead from tokens <= t (ahead 1: as HF computes it)."""
    import torch.nn.functional as F
    return float(F.cross_entropy(logits[:, :-ahead].reshape(-1, logits.shape[-1]), tokens[:, ahead:].reshape(-1)))


def reference_logits(store, tokens):
    """The trainer's decoder (tp 1, pp 1, one process, no process group) on a common-format checkpoint."""
    return reference_run(store, tokens)[0]


def reference_run(store, tokens):
    """(logits, [logits of each MTP module's head]) of the trainer's model (tp 1, pp 1, one process, no process
    group) on a common-format checkpoint: the decoder's, then each multi-token-prediction module's (DeepSeek-V3)."""
    import torch
    from ..layout import ParallelLayout
    from ..store import StoreReader
    from ..trainer.checkpoint import load_weights
    from ..trainer.grid import Grid
    from ..trainer.model import Stage
    reader = StoreReader(store)  # checksums verified: a corrupt file is an error, not a difference
    try:
        spec = reader.spec.replace(dtype="float32")
        grid = Grid(1, 1, 1, 0)
        stage = Stage(spec, ParallelLayout.build(spec.num_layers), grid)
        load_weights(stage, reader, grid)
    finally:
        reader.close()
    stage.eval()
    with torch.no_grad():
        hidden = stage.final_norm(stage.blocks(stage.embed(tokens)))
        heads = stage.mtp_hidden(hidden, tokens) if spec.mtp_layers else []
        return stage.logits(hidden)[..., :spec.vocab].float(), [stage.logits(h)[..., :spec.vocab].float() for h in heads]


class FrameworkUnavailable(Exception):
    """The checkpoint's own framework cannot run here (not installed): noted, not a failure."""


# What runs each format's own check, as each row names it: transformers and megatron-core are those frameworks'
# own models; for MindSpore (MindSpeed or MindFormers files alike) it is interop's model written in MindSpore ops
# over `mindspore.load_checkpoint` (MindFormers' own forward pass does not run on CPU: mindspore_model.py).
FRAMEWORK_NAMES = {"hf": "transformers", "mindspore": "interop's model in mindspore ops", "megatron": "megatron-core"}


def framework_logits(fmt: str, path, store, tokens, tmp: Path):
    """Logits from the checkpoint's own framework, or None for the common format (it has none)."""
    if fmt == "hf":
        return _hf_logits(path, tokens)
    if fmt == "mindspore":
        return _mindspore_logits(path, store, tokens, tmp)
    if fmt == "megatron":
        return _megatron_logits(store, tokens, tmp)
    return None


def _hf_logits(path, tokens):
    import torch
    try:
        import transformers
    except ImportError:
        raise FrameworkUnavailable("transformers is not installed; the HF checkpoint ran in the reference model only") \
            from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def _mindspore_logits(path, store, tokens, tmp: Path):
    """MindSpore reads the checkpoint itself (`mindspore.load_checkpoint`); its forward pass runs tp 1 / pp 1,
    so a sharded checkpoint is first resharded to tp 1 / pp 1 by interop (same dialect)."""
    import torch
    try:
        import mindspore  # noqa: F401
        from . import mindspore_model
    except ImportError as exc:
        raise FrameworkUnavailable(f"mindspore is not installed ({exc}); ran in the reference model only") from None
    sidecar = Path(path) / "mindspore_model.json"  # interop's optional description; real MindSpeed files lack it
    desc = read_json_object(sidecar, "MindSpore model description") if sidecar.is_file() else None
    dialect = (desc or {}).get("dialect")
    from ..store import StoreReader
    reader = StoreReader(store)
    why = mindspore_model.cannot_run(reader.spec)
    reader.close()
    if why:
        raise FrameworkUnavailable(f"{why}; the MindSpore checkpoint ran in the reference model only")
    layout = (desc or {}).get("layout")  # a MindFormers output of another tool may have none: converted below
    if not isinstance(layout, dict) or layout.get("tp") != 1 or layout.get("pp") != 1:
        from ..convert import convert_here
        qkv = (desc or {}).get("qkv_concat") or None
        convert_here(store, tmp, src_format="interop", dst_format="mindspore", dialect=dialect, qkv_concat=qkv)
        path = tmp
    model = mindspore_model.load(path)
    return torch.from_numpy(mindspore_model.logits(model, tokens.numpy()).asnumpy()).float()


def _megatron_logits(store, tokens, tmp: Path):
    from . import megatron_framework
    why = megatron_framework.available()
    if not why:
        from ..store import StoreReader
        reader = StoreReader(store)
        why = megatron_framework.cannot_build(reader.spec)
        reader.close()
    if why:
        raise FrameworkUnavailable(f"{why}; the Megatron checkpoint ran in the reference model only")
    return megatron_framework.forward_logits(store, tokens)
