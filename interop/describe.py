"""What is in a checkpoint: its format, model spec, layout, tensors, totals and training state.

`describe(path)` returns a `Description` (a dataclass: layout as tp/pp/vpp fields, one
`TensorInfo` per tensor); `render` / `Description.lines()` is the text `interop inspect` prints,
`to_dict()` its `--json`.  No tensor data is read.  A common-format store is described from its
`interop.json` alone, without importing torch, so `interop inspect` of one starts at once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import InteropError
from .formats import base_spec_of, detect_format, reader_of
from .io.small_files import read_json
from .params import TensorKey

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
MANIFEST = "interop.json"  # the common store's manifest (interop.store.MANIFEST; not imported: it pulls torch)
MANIFEST_LIMIT = 64 << 20  # interop.store.MANIFEST_LIMIT (not imported: it pulls torch)


@dataclass
class TensorInfo:
    name: str
    shape: list[int]
    dtype: str
    bytes: int
    native: str | None = None  # the name in the checkpoint's own format, where the reader can tell


@dataclass
class Description:
    path: str
    format: str
    spec: dict
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    layout: str = "unsharded (tp=1 pp=1)"  # the layout in words
    state: dict = field(default_factory=dict)  # training state found: iteration, optimizer, scheduler, ...
    notes: list[str] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    ep: int = 1  # expert-parallel ranks the routed experts are stored by (the common format at --ep)

    @property
    def total(self) -> dict:
        return {"tensors": len(self.tensors), "bytes": sum(t.bytes for t in self.tensors),
                "parameters": sum(_numel(t.shape) for t in self.tensors if not TensorKey.parse(t.name).is_optim)}

    def training_state(self) -> dict:
        """The resumable state found, in a few words per item (iteration, optimizer, scheduler)."""
        return training_summary(self.state, self.tensors)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        out["training"] = self.training_state()
        return out

    def __getitem__(self, key):  # the dict API describe() had before it returned a dataclass
        return self.to_dict()[key]

    def lines(self, show_tensors: bool = True, native: bool = False) -> list[str]:
        return render(self, show_tensors, native).splitlines()


def training_summary(state: dict, tensors: list[TensorInfo]) -> dict:
    """Which parts of a resumable training state a checkpoint holds."""
    out = {}
    for key in ("iteration", "step"):
        if isinstance(state.get(key), int):
            out["iteration"] = state[key]
            break
    moments = sorted({key.kind for key in map(TensorKey.parse, (t.name for t in tensors)) if key.is_optim})
    optim_state = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else {}
    if moments:
        out["optimizer"] = ", ".join(moments)
    elif optim_state:
        out["optimizer"] = ", ".join(sorted(optim_state)[:6])
    for key in ("scheduler", "lr_scheduler", "opt_param_scheduler"):
        if state.get(key):
            value = state[key]
            out["scheduler"] = ", ".join(f"{k}={v}" for k, v in value.items() if isinstance(v, (int, float, str))) \
                if isinstance(value, dict) else str(value)
            break
    return out


def describe(path, fmt: str | None = None, options: dict | None = None, native: bool = False,
             **format_options) -> Description:
    """A description of any checkpoint interop can read; no tensor data is read.

    Reader options (`model_config=`, `iteration=`, ...) as keywords or in `options`.  `native`
    asks the reader for each tensor's name in the checkpoint's own format."""
    options = {k: v for k, v in {**(options or {}), **format_options}.items() if v is not None}
    if fmt is None and (Path(path) / MANIFEST).is_file():
        fmt = "interop"  # told apart here: the registry's detection would import the store, and with it torch
    fmt = fmt or detect_format(path)
    if fmt == "interop" and not options:
        return _describe_store(Path(path))
    reader_cls = reader_of(fmt)
    base = options.pop("base", None)
    if reader_cls.reads_adapter:  # a LoRA adapter without its base's description (PEFT): described on its base
        options["base"] = base_spec_of(path, base or reader_cls.named_base(path))
    elif base is not None:
        raise InteropError(f"--base applies to a LoRA adapter that does not hold its base's description; {path} is "
                           f"a {fmt} checkpoint")
    reader = reader_cls(path, **options)
    try:
        from .tensors import NAME_OF_DTYPE
        source = reader.source
        tensors = [TensorInfo(m.name, list(m.shape), NAME_OF_DTYPE.get(m.dtype, str(m.dtype)), m.nbytes,
                              reader.native_name(m.name) if native else None) for m in reader.metas()]
    finally:
        reader.close()
    info = Description(str(path), fmt, source.spec.to_dict(), state=source.state, notes=list(source.notes),
                       tensors=tensors)
    if source.adapter is not None:
        info.notes.append(_adapter_note(source.adapter))
    if source.layout:
        info.tp, info.pp, info.vpp, info.layout = (source.layout.tp, source.layout.pp, source.layout.vpp,
                                                   source.layout.describe())
        info.ep = source.layout.ep
    if native and not any(t.native for t in tensors):
        info.notes.append(f"the {fmt} reader does not report native names")
    return info


def _describe_store(root: Path) -> Description:
    """The common store from its manifest alone (the names are its native names), checked as the store's
    reader checks it (`interop.manifest`), which needs no torch."""
    from .manifest import check_files_exist, check_manifest
    manifest_path = root / MANIFEST
    manifest = read_json(manifest_path, "manifest", MANIFEST_LIMIT)
    spec, layout, adapter = check_manifest(root, manifest, manifest_path)
    check_files_exist(root, manifest["files"], manifest_path)
    notes = [] if adapter is None else [_adapter_note(adapter)]
    tensors = [TensorInfo(name, list(t["shape"]), t["dtype"], _numel(t["shape"]) * ITEMSIZE[t["dtype"]])
               for name, t in manifest["tensors"].items()]
    return Description(str(root), "interop", spec.to_dict(), layout.tp, layout.pp, layout.vpp, layout.describe(),
                       state=manifest.get("state") or {}, notes=notes, tensors=tensors, ep=layout.ep)


def _adapter_note(adapter) -> str:
    shared = {True: "; one A per fused module", False: "", None: "; A sharing not stated"}[adapter.shared_a]
    return (f"a LoRA adapter (rank {adapter.rank}, alpha {adapter.alpha:g}, targets {', '.join(adapter.targets)}"
            f"{shared}) on the model described")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def render(info: Description, show_tensors: bool = True, native: bool = False) -> str:
    spec = info.spec
    lines = [f"{info.path}: {info.format} checkpoint", f"  layout: {info.layout}",
             "  model:  " + ", ".join(f"{k}={v}" for k, v in spec.items())]
    if spec.get("num_experts"):
        layers = "every layer" if spec.get("moe_layers") is None else f"layers {spec['moe_layers']}"
        shared = f", shared expert {spec['shared_expert_ffn_hidden']}" if spec.get("shared_expert_ffn_hidden") else ""
        lines.append(f"  experts: {spec['num_experts']} routed, top-{spec['moe_topk']}, each ffn {spec['moe_ffn_hidden']}"
                     f"{shared}, on {layers}")
    training = info.training_state()
    if training:
        lines.append("  training state: " + "; ".join(f"{k} {v}" for k, v in training.items()))
    else:
        lines.append("  training state: none (weights only)")
    scalars = {k: v for k, v in info.state.items() if isinstance(v, (int, float, str, bool))}
    if scalars:
        lines.append("  state:  " + ", ".join(f"{k}={v}" for k, v in scalars.items()))
    lines += [f"  note:   {n}" for n in info.notes]
    if show_tensors:
        width = max((len(t.name) for t in info.tensors), default=4)
        with_native = native and any(t.native for t in info.tensors)
        nwidth = max((len(t.native or "") for t in info.tensors), default=6) if with_native else 0
        head = f"  {'name':<{width}}  " + (f"{info.format + ' name':<{nwidth}}  " if with_native else "")
        lines.append(head + f"{'shape':<20} {'dtype':<9} {'bytes':>12}")
        for t in info.tensors:
            middle = f"{t.native or '':<{nwidth}}  " if with_native else ""
            lines.append(f"  {t.name:<{width}}  {middle}{str(t.shape):<20} {t.dtype:<9} {t.bytes:>12,}")
    total = info.total
    lines.append(f"  total: {total['tensors']} tensors, {total['parameters']:,} parameters, "
                 f"{total['bytes'] / 1e6:.1f} MB")
    return "\n".join(lines)
