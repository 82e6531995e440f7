"""Proof that a conversion kept the model: one fixed batch through the source and the converted checkpoint.

Both checkpoints run in the reference model (the trainer's decoder, fed from the common
format: a checkpoint in any other format is converted to a temporary common-format copy
first), and each also runs in its own framework where that is installed: transformers'
`AutoModelForCausalLM` for HF, MindSpore ops over `mindspore.load_checkpoint` for MindSpore
(`mindspore_model.py`), megatron-core's `GPTModel` for Megatron
(`megatron_framework.py`).  Every run's logits are compared with the reference
model's on the source; the largest difference must stay within the tolerance (1e-5 for
fp32; the rounding of a bf16 or fp16 checkpoint's weights allows more, see TOLERANCE).

Everything computes in fp32 on the CPU; the batch is fixed (seeded), so two calls agree.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..formats import detect_format
from ..errors import InteropError

# Largest allowed |logit difference| by the lowest precision among the two checkpoints.  fp32 runs
# differ only by summation order (~1e-7); bf16/fp16 weights rounded from fp32 move tiny models'
# logits by ~1e-3..1e-2 (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
BATCH, SEQ, SEED = 2, 32, 0


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

    @property
    def max_diff(self) -> float:
        return max((c.max_diff for c in self.checks), default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def lines(self) -> list[str]:
        width = max(len(c.label) for c in self.checks)
        out = [f"verify {self.src} -> {self.dst}: {BATCH} x {SEQ} tokens (seed {SEED}), fp32 on CPU"]
        out += [f"  {c.label:<{width}}  loss {c.loss:.7f}  max |logit diff| {c.max_diff:.2e}" for c in self.checks]
        out += [f"  note: {n}" for n in self.notes]
        verdict = "OK" if self.ok else "FAIL"
        out.append(f"  largest logit difference {self.max_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}")
        return out


def verify(src, dst, *, src_format: str | None = None, dst_format: str | None = None, tolerance: float | None = None,
           frameworks: bool = True, dst_model_config=None, options: dict | None = None,
           **format_options) -> VerifyResult:
    """Run the fixed batch through `src` and `dst`; see the module docstring.  Reader options for the
    source (`model_config=`, `iteration=`) as keywords or in `options`; `dst_model_config` describes a
    destination that carries no model description."""
    import torch
    from ..convert import convert
    from ..store import StoreReader, is_store
    src_options = {k: v for k, v in {**(options or {}), **format_options}.items() if v is not None}
    src_format = src_format or detect_format(src)
    dst_format = dst_format or detect_format(dst)
    dst_options = {"model_config": dst_model_config} if dst_model_config else {}
    with tempfile.TemporaryDirectory(prefix="interop-verify-") as tmp:
        stores = {}
        for which, path, fmt, opts in (("source", src, src_format, src_options),
                                       ("converted", dst, dst_format, dst_options)):
            if is_store(path):
                stores[which] = Path(path)
            else:
                stores[which] = Path(tmp) / which
                convert(path, stores[which], src_format=fmt, dst_format="interop", **opts)
        specs = {which: StoreReader(p, verify=False).spec for which, p in stores.items()}
        if _spec_difference(specs["source"], specs["converted"]):
            raise InteropError(f"{dst} describes another model than {src}: "
                               + _spec_difference(specs["source"], specs["converted"]))
        ruled = specs["source"].differences(specs["converted"], ignore=())
        rule_notes = [f"the converted model computes {k}={y}, the source {k}={x} (a rule the target's class "
                      "imposes): the logits show what it changes" for k, x, y in ruled if k in RULES]
        spec = specs["source"]
        lowest = max((s.dtype for s in specs.values()), key=lambda d: TOLERANCE[d])
        tol = tolerance if tolerance is not None else TOLERANCE[lowest]
        tokens = torch.randint(0, spec.vocab, (BATCH, min(SEQ, spec.max_positions)),
                               generator=torch.Generator().manual_seed(SEED))
        reference = reference_logits(stores["source"], tokens)
        result = VerifyResult(str(src), str(dst), tol, notes=rule_notes)
        runs = [(f"reference model, source ({src_format})", reference),
                (f"reference model, converted ({dst_format})", reference_logits(stores["converted"], tokens))]
        if frameworks:
            for which, path, fmt in (("source", src, src_format), ("converted", dst, dst_format)):
                try:
                    logits = framework_logits(fmt, path, stores[which], tokens, Path(tmp) / f"fw-{which}")
                except FrameworkUnavailable as exc:
                    result.notes.append(f"{which}: {exc}")
                    continue
                if logits is not None:
                    runs.append((f"{FRAMEWORK_NAMES[fmt]}, {which} ({fmt})", logits))
        for label, logits in runs:
            result.checks.append(Check(label, lm_loss(logits, tokens), float((logits - reference).abs().max())))
        if spec.mtp_layers:
            count, diff = mtp_difference(stores["source"], stores["converted"])
            result.checks.append(Check(f"MTP modules ({count} tensors, no logits; loss n/a)", float("nan"), diff))
    return result


def mtp_difference(source, converted) -> tuple[int, float]:
    """(tensors, largest |difference|) of the MTP modules (`mtp.*`) between two stores, in float32."""
    from ..store import StoreReader
    a, b = StoreReader(source), StoreReader(converted)
    try:
        names = [m.name for m in a.metas() if m.name.startswith("mtp.")]
        diff = max(float((a.read(n).float() - b.read(n).float()).abs().max()) for n in names)
    finally:
        a.close()
        b.close()
    return len(names), diff


# Facts of how a model computes that a writer may change on request, the tensors staying the same (HF
# Mixtral's renormalised top-k, `--renormalize-topk`): verify runs both and shows the difference.
RULES = ("moe_norm_topk",)


def _spec_difference(a, b) -> str:
    return ", ".join(f"{k} {x} vs {y}" for k, x, y in a.differences(b, ignore=("dtype", "padded_vocab", *RULES)))


def lm_loss(logits, tokens) -> float:
    """Mean cross entropy of predicting token t+1 from tokens <= t (as HF computes it)."""
    import torch.nn.functional as F
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def reference_logits(store, tokens):
    """The trainer's decoder (tp 1, pp 1, one process, no process group) on a common-format checkpoint."""
    import torch
    from ..layout import ParallelLayout
    from ..store import StoreReader
    from ..trainer.checkpoint import load_weights
    from ..trainer.grid import Grid
    from ..trainer.model import Stage
    reader = StoreReader(store)  # checksums verified: a corrupt file is an error, not a difference
    try:
        # MTP modules do not change the logits: they are compared tensor by tensor (`mtp_difference`)
        spec = reader.spec.replace(dtype="float32", mtp_layers=0)
        grid = Grid(1, 1, 1, 0)
        stage = Stage(spec, ParallelLayout.build(spec.num_layers), grid)
        load_weights(stage, reader, grid)
    finally:
        reader.close()
    stage.eval()
    with torch.no_grad():
        return stage.logits(stage.final_norm(stage.blocks(stage.embed(tokens))))[..., :spec.vocab].float()


class FrameworkUnavailable(Exception):
    """The checkpoint's own framework cannot run here (not installed): noted, not a failure."""


FRAMEWORK_NAMES = {"hf": "transformers", "mindspore": "mindspore", "megatron": "megatron-core"}


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
    import json
    import torch
    try:
        import mindspore  # noqa: F401
        from . import mindspore_model
    except ImportError as exc:
        raise FrameworkUnavailable(f"mindspore is not installed ({exc}); ran in the reference model only") from None
    sidecar = Path(path) / "mindspore_model.json"  # interop's optional description; real MindSpeed files lack it
    desc = json.loads(sidecar.read_text()) if sidecar.is_file() else None
    if desc is None or desc["layout"]["tp"] != 1 or desc["layout"]["pp"] != 1:
        from ..convert import convert
        dialect = (desc or {}).get("dialect")
        qkv = (desc or {}).get("qkv_concat") or None
        convert(store, tmp, src_format="interop", dst_format="mindspore", dialect=dialect, qkv_concat=qkv)
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
