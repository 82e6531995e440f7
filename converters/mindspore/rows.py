"""One model's MindSpore tensors: each name, its transform (bound to the row), and its canonical parts.

What a TP rank stores, and how the parts are fused, is the transform's (`interop.transforms`).
"""
from __future__ import annotations

from ...errors import InteropError
from ...mappings.mindspore_names import (DIALECTS, MINDFORMERS_MCORE_MLA_MARKERS, MINDSPEED_LAYERNORM_NORMS,
                                         MINDSPEED_LAYERNORM_PARAMS, MINDSPEED_MODEL_RENAMES, MOE_TABLES,
                                         PLAIN_LAYOUT, QKV_LAYOUTS, TABLES)
from ...params import param_index
from ...spec import ModelSpec
from ...transforms import Transform

# The fused layouts MindFormers' mcore-style models take by default (mappings/mindspore_names.py MINDFORMERS_MCORE)
MCORE_LAYOUT_NOTE = ("linear_qkv grouped per KV group, linear_fc1 rows interleaved gate/up: MindFormers' defaults "
                     "use_contiguous_weight_layout_attention=False, use_interleaved_weight_layout_mlp=True")


def _model_name(name: str, spec: ModelSpec) -> str:
    """The name MindSpeed-Core-MS's model gives a parameter (LayerNorm gamma/beta, embedding_table)."""
    name = MINDSPEED_MODEL_RENAMES.get(name, name)
    if spec.norm == "layernorm" and any(norm in name for norm in MINDSPEED_LAYERNORM_NORMS):
        stem, _, leaf = name.rpartition(".")
        name = f"{stem}.{MINDSPEED_LAYERNORM_PARAMS.get(leaf, leaf)}"
    return name


def ms_rows(spec: ModelSpec, dialect: str, qkv_concat: bool = False, qkv_layout: str = "grouped",
            qkv_bias_layout: str | None = None) -> list[tuple[str, Transform, list[str]]]:
    """The dialect's name table expanded for this model: (MindSpore name, bound transform, canonical parts).

    `qkv_layout` / `qkv_bias_layout` (MindFormers qkv_concat only): "plain" stores the fused tensor as
    [q; k; v] / [gate; up] instead of grouped per KV group / interleaved; the bias follows the weights
    unless `qkv_bias_layout` says otherwise.
    """
    rows, homeless = _expand(spec, dialect, qkv_concat, qkv_layout, qkv_bias_layout)
    if homeless:  # e.g. Qwen3's q/k norms outside mindformers-mcore: the other tables name none
        holders = [d for d in DIALECTS if d != dialect and _holds(spec, d)]
        hint = f": --dialect {holders[0]} holds it" if holders else ""
        raise InteropError(f"MindSpore {dialect} names have no place for {homeless[0]}{hint}")
    return rows


def _holds(spec: ModelSpec, dialect: str) -> bool:
    """Whether `dialect`'s names hold every tensor of the model (for the hint of a dialect that does not)."""
    try:
        return not _expand(spec, dialect, False, "grouped", None)[1]
    except InteropError:
        return False


def _expand(spec: ModelSpec, dialect: str, qkv_concat: bool, qkv_layout: str, qkv_bias_layout: str | None):
    """(the rows, the canonical tensors no row holds)."""
    key = (dialect, spec.arch, bool(qkv_concat))
    if key not in TABLES:
        raise InteropError(f"no MindSpore name table for dialect {dialect!r}, arch {spec.arch!r}"
                           f"{' with qkv_concat' if qkv_concat else ''}")
    for layout in (qkv_layout, qkv_bias_layout):
        if layout is not None and layout not in QKV_LAYOUTS:
            raise InteropError(f"--qkv-layout must be one of {', '.join(QKV_LAYOUTS)}, got {layout!r}")
    present = param_index(spec)
    rows, taken = [], set()
    for ms_name, transform, parts in TABLES[key] + moe_table(spec, dialect, qkv_concat):
        layout = (qkv_bias_layout or qkv_layout) if ms_name.endswith(".bias") else qkv_layout
        if dialect == "mindformers" and layout == "plain":
            transform = PLAIN_LAYOUT.get(transform, transform)
        for i in (range(spec.num_layers) if "{i}" in ms_name else [None]):
            for e in (range(spec.num_experts) if "{e}" in ms_name else [None]):
                name = ms_name.format(i=i, e=e)
                names = ([p.format(i=i, e=x) for x in range(spec.num_experts) for p in parts] if transform.every_expert
                         else [p.format(i=i, e=e) for p in parts])
                if name not in taken and all(n in present for n in names):
                    bound = transform.bind(spec, [present[n] for n in names])
                    rows.append((_model_name(name, spec) if dialect == "mindspeed" else name, bound, names))
                    taken.add(name)
    held = {name for _, _, names in rows for name in names}
    return rows, [name for name in present if name not in held]


def moe_table(spec: ModelSpec, dialect: str, qkv_concat: bool) -> list:
    """The MoE rows for this model, or [] for a dense one; one line for what the dialect cannot hold."""
    if not spec.is_moe:
        return []
    shared = spec.shared_expert_ffn_hidden is not None
    if (dialect, shared) not in MOE_TABLES or (dialect != "mindspeed" and spec.arch != "llama"):
        raise InteropError(f"MindSpore {dialect} names hold no {'shared expert' if shared else spec.arch + ' MoE'} "
                           "(MindSpeed-Core-MS r0.1.0 has routed experts only; MindFormers MoE is its Llama's)")
    if dialect == "mindformers-mcore":  # dense layers (first_k_dense_replace), sigmoid scores: the same names
        return MOE_TABLES[(dialect, shared)]
    if spec.moe_layers is not None and sorted(spec.moe_layers) != list(range(spec.num_layers)):
        raise InteropError(f"MindSpore {dialect} models make every layer MoE; this one has experts in layers "
                           f"{sorted(spec.moe_layers)} only")
    if dialect == "mindspeed" and spec.moe_router_score != "softmax":
        raise InteropError(f"MindSpeed-Core-MS r0.1.0's router scores with softmax, not {spec.moe_router_score}")
    if dialect == "mindformers" and qkv_concat:
        raise InteropError("MindFormers MoE with --qkv-concat (stacked w_gate_hidden) is not written or read: "
                           "convert without --qkv-concat")
    if dialect == "mindformers" and shared and spec.shared_expert_ffn_hidden % spec.moe_ffn_hidden:
        raise InteropError(f"MindFormers' Llama builds shared experts of intermediate_size x shared_expert_num: "
                           f"{spec.shared_expert_ffn_hidden} is no multiple of the experts' {spec.moe_ffn_hidden}")
    return MOE_TABLES[(dialect, shared)]


def check_layout(spec: ModelSpec, dialect: str, tp: int, where: str = "") -> None:
    """One line for a tensor-parallel layout the dialect's MoE files cannot hold."""
    if dialect == "mindformers-mcore" and spec.is_moe and tp > 1:
        raise InteropError(f"{where}MindFormers' mcore-style experts (FFNGroupedGEMM weight1 / weight2) are placed by "
                           f"expert parallelism, not cut by tensor parallelism: MoE is read and written at --tp 1 "
                           f"(one model.ckpt), not tp={tp}")


def refuse_mla(tags, where: str) -> None:
    """Multi-latent attention (MindFormers deepseek3's default) has no place in the canonical tensors."""
    for tag in tags:
        if any(marker in tag for marker in MINDFORMERS_MCORE_MLA_MARKERS):
            raise InteropError(f"{where}: {tag} is multi-latent attention (DeepSeek-V3 MLA), which interop does not "
                               "convert")


def converter_names(rows, spec: ModelSpec, dialect: str) -> dict[str, str]:
    """{model name: the name convert_pt2ckpt.py writes} where they differ (read either)."""
    if dialect != "mindspeed":
        return {}
    present = {name for name, _, _ in rows}
    out = {}
    for name, _, _ in TABLES[(dialect, spec.arch, False)]:
        for i in (range(spec.num_layers) if "{i}" in name else [None]):
            plain = name.format(i=i)
            model = _model_name(plain, spec)
            if model != plain and model in present:
                out[model] = plain
    return out
