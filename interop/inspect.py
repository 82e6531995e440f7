"""What is in a checkpoint: its format, model spec, layout, tensors and totals."""
from __future__ import annotations

from .converters.registry import converter, detect_format
from .tensors import NAME_OF_DTYPE


def describe(path, fmt: str | None = None, options: dict | None = None) -> dict:
    """A JSON-able description of any checkpoint interop can read; no tensor data is read.

    `options` are reader options such as `model_config` or `iteration`."""
    fmt = fmt or detect_format(path)
    reader = converter(fmt).Reader(path, **{k: v for k, v in (options or {}).items() if v is not None})
    try:
        source = reader.source
        tensors = [{"name": m.name, "shape": list(m.shape), "dtype": NAME_OF_DTYPE.get(m.dtype, str(m.dtype)),
                    "bytes": m.nbytes} for m in reader.metas()]
    finally:
        reader.close()
    return {
        "path": str(path), "format": fmt, "spec": source.spec.to_dict(),
        "layout": source.layout.describe() if source.layout else "unsharded (tp=1 pp=1)",
        "state": source.state, "notes": source.notes, "tensors": tensors,
        "total": {"tensors": len(tensors), "bytes": sum(t["bytes"] for t in tensors),
                  "parameters": sum(_numel(t["shape"]) for t in tensors if not t["name"].startswith("optim."))},
    }


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def render(info: dict, show_tensors: bool = True) -> str:
    spec = info["spec"]
    lines = [f"{info['path']}: {info['format']} checkpoint", f"  layout: {info['layout']}",
             "  model:  " + ", ".join(f"{k}={v}" for k, v in spec.items())]
    state = info["state"]
    if state:
        summary = {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool))}
        if summary:
            lines.append("  state:  " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    lines += [f"  note:   {n}" for n in info["notes"]]
    if show_tensors:
        width = max((len(t["name"]) for t in info["tensors"]), default=4)
        lines.append(f"  {'name':<{width}}  {'shape':<20} {'dtype':<9} {'bytes':>12}")
        for t in info["tensors"]:
            lines.append(f"  {t['name']:<{width}}  {str(t['shape']):<20} {t['dtype']:<9} {t['bytes']:>12,}")
    total = info["total"]
    lines.append(f"  total: {total['tensors']} tensors, {total['parameters']:,} parameters, "
                 f"{total['bytes'] / 1e6:.1f} MB")
    return "\n".join(lines)
