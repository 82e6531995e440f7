"""The MindSpore dialects, one class each: its files, its name tables, its optimizer moments and what it refuses.

The reader and writer ask their dialect and never compare its name.  A new dialect (a MindSpeed-LLM layout, a
MindFormers release with other names) is a subclass that states what differs, the way a Megatron-Bridge family
subclasses its bridge: its `name` and `title`, its tables (`table`, `moe_table`), where a rank's file lives
(`file`), and the flags below; then one entry in `DIALECTS` and in `mappings/mindspore_names.py`'s
`DIALECTS` / `DIALECT_MARKERS` (the names `--dialect` offers without importing this module).
"""
from __future__ import annotations

import math
from pathlib import Path

from ...errors import InteropError
from ...layout import ParallelLayout
from ...mappings import mindspore_names as names
from ...mappings.megatron_names import with_mtp
from ...params import param_index
from ...rows import Row, check_placed, expand
from ...spec import ModelSpec, padded_to_tp
from .files import mindformers_file, mindspeed_file


class Dialect:
    """What every dialect answers; the defaults are MindFormers-like (one file per rank, no extras)."""

    name = ""  # --dialect, and `dialect` in interop's sidecar
    title = ""  # the framework, in messages
    moments: dict[str, str] = {}  # canonical optimizer prefix -> the prefix of its tags
    tied_heads: tuple[str, ...] = ()  # where a tied model may store its head's copy (checked equal, not read)
    writes_tied_head = False  # the last stage stores the tied head's copy (under `tied_heads`)
    virtual_chunks = False  # its files can hold virtual pipeline chunks (--vpp)
    fuses_qkv = False  # --qkv-concat: one w_qkv / w_gate_hidden
    dp_folders = False  # --dp numbers its rank folders
    expert_parallel = False  # a rank file holds its expert-parallel rank's experts only, numbered locally
    # ep > 1: each rank file holds the rows of its ep coordinate (stage rank % ep) of every stacked experts tensor
    ep_cuts_expert_rows = False
    masters_as_weights = False  # fp32 master copies are written as the weights (else dropped, with a note)
    scalars = False  # training-state scalars beside the tensors (step, epoch, optimizer, scheduler)
    pt_meta = False  # `pt_meta/` for the framework's reverse converter
    strategy = False  # `strategy/` files describing the shards (tp or pp > 1)
    moe_archs: tuple[str, ...] | None = ("llama",)  # the architectures its MoE models have (None: any)
    every_layer_moe = True  # its MoE models make every layer MoE
    noop_positions = False  # its files may number layers by position with noop layers' positions left out
    # where tp does not divide the vocabulary: {name: its transform} of the tensors then stored whole and unpadded on
    # every rank (empty: the vocabulary is padded up to a multiple of tp and cut), and an untied head the framework
    # cuts over tp all the same (then refused)
    whole_vocab: dict = {}
    cut_head: str | None = None
    # ModelSpec facts without tensors of their own that its model cannot compute: (field, the value it computes)
    unheld_facts: tuple[tuple[str, object], ...] = ()

    # -- names ---------------------------------------------------------------------------------
    def table(self, spec: ModelSpec, qkv_concat: bool) -> list:
        key = (self.name, spec.arch, bool(qkv_concat))
        if key not in names.TABLES:
            raise InteropError(f"no MindSpore name table for dialect {self.name!r}, arch {spec.arch!r}"
                               f"{' with qkv_concat' if qkv_concat else ''}")
        return names.TABLES[key]

    def moe_table(self, spec: ModelSpec, qkv_concat: bool) -> list:
        """The MoE rows for this model, or [] for a dense one; one line for what the dialect cannot hold."""
        if not spec.is_moe:
            return []
        shared = spec.shared_expert_ffn_hidden is not None
        if (self.name, shared) not in names.MOE_TABLES or (self.moe_archs is not None
                                                           and spec.arch not in self.moe_archs):
            raise InteropError(f"MindSpore {self.name} names hold no "
                               f"{'shared expert' if shared else spec.arch + ' MoE'} (MindSpeed-Core-MS r0.1.0 has "
                               "routed experts only; MindFormers MoE is its Llama's)")
        if self.every_layer_moe and spec.moe_layers is not None and sorted(spec.moe_layers) != list(
                range(spec.num_layers)):
            raise InteropError(f"MindSpore {self.name} models make every layer MoE; this one has experts in layers "
                               f"{sorted(spec.moe_layers)} only")
        self.check_moe(spec, qkv_concat, shared)
        return names.MOE_TABLES[(self.name, shared)]

    def check_facts(self, spec: ModelSpec) -> None:
        """One line for a fact of the model (`unheld_facts`) its framework's model would compute otherwise."""
        for field, computed in self.unheld_facts:
            if getattr(spec, field) != computed:
                raise InteropError(f"MindSpore {self.name} names hold no {field}={getattr(spec, field)!r} (its "
                                   f"model computes {field}={computed!r}); the formats holding it: hf, megatron "
                                   "(megatron-core names), interop")

    def check_moe(self, spec: ModelSpec, qkv_concat: bool, shared: bool) -> None:
        """One line for a MoE model the dialect's own MoE layer cannot build."""

    def fused_layout(self, name: str, transform, qkv_layout: str, qkv_bias_layout: str | None):
        """The transform a fused tensor is stored with, for the --qkv-layout given."""
        return transform

    def model_name(self, name: str, spec: ModelSpec) -> str:
        """The name the framework's model gives a table's tensor."""
        return name

    def rows(self, spec: ModelSpec, qkv_concat: bool = False, qkv_layout: str = "grouped",
             qkv_bias_layout: str | None = None, tp: int = 1) -> list[Row]:
        """The dialect's name table expanded for this model (`interop.rows.expand`), under the model's names.

        `qkv_layout` / `qkv_bias_layout` (qkv_concat only): "plain" stores the fused tensor as [q; k; v] /
        [gate; up] instead of grouped per KV group / interleaved; the bias follows the weights unless
        `qkv_bias_layout` says otherwise.  A tensor the names cannot hold is refused in one line naming the
        formats and dialects that hold it (`interop.rows.check_placed`).  `tp`: the rank files' tp, where the
        dialect stores a tensor whole at some tp only (`vocab_whole`)."""
        rows = self._expanded(spec, qkv_concat, qkv_layout, qkv_bias_layout)
        if self.vocab_whole(spec, spec.padded_vocab, tp):
            rows = self._vocab_whole(rows, spec, tp)
        check_placed(rows, spec, f"MindSpore {self.name}")  # names the formats that hold what this cannot
        self.check_facts(spec)
        return rows

    def _expanded(self, spec: ModelSpec, qkv_concat: bool, qkv_layout: str, qkv_bias_layout: str | None) -> list[Row]:
        table = self.table(spec, qkv_concat)
        for layout in (qkv_layout, qkv_bias_layout):
            if layout is not None and layout not in names.QKV_LAYOUTS:
                raise InteropError(f"--qkv-layout must be one of {', '.join(names.QKV_LAYOUTS)}, got {layout!r}")
        table = [(name, self.fused_layout(name, transform, qkv_layout, qkv_bias_layout), parts)
                 for name, transform, parts in table + self.moe_table(spec, qkv_concat)]
        if spec.mtp_layers:
            table = self.with_mtp(table)
        rows = expand(table, spec)
        for row in rows:
            row.key = self.model_name(row.key, spec)
        return rows

    def vocab_whole(self, spec: ModelSpec, rows: int, tp: int) -> bool:
        """Whether the embedding (and head) of `rows` rows are stored whole on each of `tp` ranks."""
        return (tp > 1 and rows % tp != 0 and bool(self.whole_vocab)
                and any(key in self.whole_vocab for key, _, _ in self.table(spec, False)))

    def vocab_rows(self, spec: ModelSpec, tp: int) -> int:
        """The embedding rows written at `tp`: the canonical padding when tp divides it; else unpadded where the
        dialect then keeps them whole, or the true vocabulary rounded up to a multiple of tp (`padded_to_tp`)."""
        if self.vocab_whole(spec, spec.padded_vocab, tp):
            return spec.vocab
        return padded_to_tp(spec, tp)

    def held_vocab_rows(self, spec: ModelSpec, held: int, tp: int) -> int:
        """The embedding's rows when tp rank 0 holds `held` of them: cut over tp, or whole where the dialect keeps
        so many rows whole (and they hold the whole vocabulary)."""
        return held if self.vocab_whole(spec, held, tp) and held >= spec.vocab else held * tp

    def _vocab_whole(self, rows: list[Row], spec: ModelSpec, tp: int) -> list[Row]:
        index = param_index(spec)
        for row in rows:
            if row.key == self.cut_head:
                raise InteropError(f"MindSpore {self.name}: an untied {row.key} of {spec.padded_vocab} rows has no "
                                   f"layout at tp={tp} (MindFormers cuts it over tp, a ColumnParallelLinear, and tp "
                                   f"does not divide it): write it at a --tp dividing {spec.padded_vocab}")
            if row.key in self.whole_vocab:
                row.transform = self.whole_vocab[row.key].bind(spec, [index[p] for p in row.parts])
        return rows

    def layout_note(self, spec: ModelSpec) -> str | None:
        """What a reader and a writer say about the fused layouts they take (None: nothing)."""
        return None

    def with_mtp(self, table: list) -> list:
        """`table` with its names for MTP modules (none by default: the model's MTP tensors are then refused)."""
        return table

    def converter_names(self, rows: list[Row], spec: ModelSpec) -> dict[str, str]:
        """{model name: the name the framework's converter writes} where they differ (read either)."""
        return {}

    # -- files ---------------------------------------------------------------------------------
    def file(self, root: Path, t: int, p: int, layout: ParallelLayout, dp: int, d: int) -> Path:
        """Where tp rank t of stage p (expert-parallel rank d, of `dp` data-parallel ranks) is written."""
        return mindformers_file(root, t, p, layout.tp, layout.pp, self.rank_files(layout), d)

    def rank_files(self, layout: ParallelLayout) -> int:
        """How many data-parallel ranks' files each (tp rank, stage) gets: one per expert-parallel rank."""
        return layout.ep

    def weight_notes(self, spec: ModelSpec, masters: bool) -> list[str]:
        """What a writer says about the weights it writes (from fp32 masters or not)."""
        return (["dropped the optimizer's fp32 master copies (MindFormers keeps none); the model weights are "
                 "written"] if masters else [])


class MindSpeedDialect(Dialect):
    """What MindSpeed-Core-MS r0.1.0 training loads: `rank_{r}/network.ckpt` per global rank (its
    tools/converter/convert_pt2ckpt.py layout), the model's parameter names, Adam moments as `exp_avg.<name>`,
    step / epoch / optimizer / scheduler scalars beside the tensors, `pt_meta/` for convert_ckpt2pt.py."""

    name, title = "mindspeed", "MindSpeed-Core-MS"
    moments = names.OPTIM_PREFIXES["mindspeed"]
    tied_heads = (names.MINDSPEED_TIED_HEAD, names.MEGATRON_TIED_HEAD)
    writes_tied_head = virtual_chunks = dp_folders = expert_parallel = masters_as_weights = True
    scalars = pt_meta = noop_positions = True
    moe_archs = None
    # mindspeed_ms/legacy/model (3a86578): its norms multiply by w (norm.py), the embedding is unscaled, the
    # attention scale is 1/sqrt(head_dim), nothing is soft-capped, and a post norm exists only with the
    # pre norms (transformer.py: input_norm / post_attention_norm always, attn_post_norm / ffn_post_norm with
    # use_sandwich_norm).
    unheld_facts = (("pre_norm", True), ("norm_zero_centered", False), ("embed_scale", False),
                    ("softmax_scale", None), ("attn_softcap", None), ("logit_softcap", None),
                    ("rope_local_base", None), ("attn_sinks", False))

    def check_moe(self, spec: ModelSpec, qkv_concat: bool, shared: bool) -> None:
        if spec.moe_router_score != "softmax":
            raise InteropError(f"MindSpeed-Core-MS r0.1.0's router scores with softmax, not {spec.moe_router_score}")

    def model_name(self, name: str, spec: ModelSpec) -> str:
        """MindSpeed-Core-MS's model's name (LayerNorm gamma/beta, embedding_table)."""
        name = names.MINDSPEED_MODEL_RENAMES.get(name, name)
        if spec.norm == "layernorm" and any(norm in name for norm in names.MINDSPEED_LAYERNORM_NORMS):
            stem, _, leaf = name.rpartition(".")
            name = f"{stem}.{names.MINDSPEED_LAYERNORM_PARAMS.get(leaf, leaf)}"
        return name

    def converter_names(self, rows: list[Row], spec: ModelSpec) -> dict[str, str]:
        """convert_pt2ckpt.py keeps Megatron's names where the model renames (LayerNorm, position embedding)."""
        present = {row.key for row in rows}
        out = {}
        for name, _, _ in names.TABLES[(self.name, spec.arch, False)]:
            for i in (range(spec.num_layers) if "{i}" in name else [None]):
                plain = name.format(i=i)
                model = self.model_name(plain, spec)
                if model != plain and model in present:
                    out[model] = plain
        return out

    def file(self, root: Path, t: int, p: int, layout: ParallelLayout, dp: int, d: int) -> Path:
        return mindspeed_file(root, t, p, layout.tp, dp, d)

    def weight_notes(self, spec: ModelSpec, masters: bool) -> list[str]:
        # Mixed precision: the optimizer's fp32 masters are the weights MindSpeed trains from, and what
        # convert_pt2ckpt.py writes as the weights (its `param`, cast to float32).
        if masters:
            return ["weights written from the optimizer's fp32 master copies, as MindSpeed's converter does (the "
                    "low-precision model weights are their rounding)"]
        if spec.dtype != "float32":
            return [f"weights written in {spec.dtype}; MindSpeed's convert_pt2ckpt.py writes float32 "
                    "(pass --dtype fp32 for the same)"]
        return []


class MindFormersDialect(Dialect):
    """MindFormers' legacy models (Llama, GPT2): one `model.ckpt`, or with tp/pp > 1
    `rank_N/checkpoint_N.ckpt` plus `strategy/` JSON files, as `mindspore.transform_checkpoints` reads them."""

    name, title = "mindformers", "MindFormers"
    moments = names.OPTIM_PREFIXES["mindformers"]
    tied_heads = ("lm_head.weight", "head.weight")
    fuses_qkv = strategy = True
    whole_vocab = names.MINDFORMERS_LLAMA_VOCAB_WHOLE

    def check_moe(self, spec: ModelSpec, qkv_concat: bool, shared: bool) -> None:
        if qkv_concat:
            raise InteropError("MindFormers MoE with --qkv-concat (stacked w_gate_hidden) is not written or read: "
                               "convert without --qkv-concat")
        if shared and spec.shared_expert_ffn_hidden % spec.moe_ffn_hidden:
            raise InteropError(f"MindFormers' Llama builds shared experts of intermediate_size x shared_expert_num: "
                               f"{spec.shared_expert_ffn_hidden} is no multiple of the experts' {spec.moe_ffn_hidden}")

    def fused_layout(self, name: str, transform, qkv_layout: str, qkv_bias_layout: str | None):
        layout = (qkv_bias_layout or qkv_layout) if name.endswith(".bias") else qkv_layout
        return names.PLAIN_LAYOUT.get(transform, transform) if layout == "plain" else transform


class MindFormersMcoreDialect(MindFormersDialect):
    """MindFormers' mcore-style models (`mindformers/parallel_core/`: qwen3, qwen3_moe, ...): Megatron-core's
    names without the `model.` prefix, linear_qkv grouped per KV group, linear_fc1 interleaved; the files as
    MindFormers' legacy models have them."""

    name = "mindformers-mcore"
    moments = names.OPTIM_PREFIXES["mindformers-mcore"]
    tied_heads = ("output_layer.weight",)
    fuses_qkv = False
    ep_cuts_expert_rows = True
    whole_vocab = names.MINDFORMERS_MCORE_VOCAB_WHOLE  # VocabParallelEmbedding; output_layer is cut all the same
    cut_head = names.MINDFORMERS_MCORE_HEAD
    every_layer_moe = False  # dense layers (first_k_dense_replace) and sigmoid scores: the same names

    def check_moe(self, spec: ModelSpec, qkv_concat: bool, shared: bool) -> None:
        pass

    def rank_files(self, layout: ParallelLayout) -> int:
        """The fewest data-parallel ranks MindFormers' MoE layout takes: ep must divide dp * tp (moe/ffn.py
        shard), its experts laid out over the device matrix (dp * tp / ep, ep) (device_matrix.py
        init_dp_cp_tp_ep_layout), so stage rank r = d * tp + t holds expert-parallel rank r % ep's experts."""
        return layout.ep // math.gcd(layout.ep, layout.tp)

    def layout_note(self, spec: ModelSpec) -> str:
        attention = ("linear_qkv = [q_down; kv_down] (mla_qkv_concat=True)" if spec.is_mla else
                     "linear_qkv grouped per KV group")
        return (f"{attention}, linear_fc1 rows interleaved gate/up: MindFormers' defaults "
                f"{'mla_qkv_concat=True' if spec.is_mla else 'use_contiguous_weight_layout_attention=False'}, "
                "use_interleaved_weight_layout_mlp=True")

    def table(self, spec: ModelSpec, qkv_concat: bool) -> list:
        """Multi-latent attention as deepseek3 names it (mla_qkv_concat, its default), else the dialect's table."""
        return names.MINDFORMERS_MCORE_MLA if spec.is_mla else super().table(spec, qkv_concat)

    def with_mtp(self, table: list) -> list:
        """deepseek3's MTP modules, `mtp.layers.{k}.*` as megatron-core names them, after the final norm (its
        eh_proj whole over tp: `MINDFORMERS_MCORE_MTP_WHOLE`)."""
        return [(key, names.MINDFORMERS_MCORE_MTP_WHOLE.get(key, transform), parts)
                for key, transform, parts in with_mtp(table)]


DIALECTS = {d.name: d for d in (MindSpeedDialect(), MindFormersDialect(), MindFormersMcoreDialect())}
assert tuple(DIALECTS) == names.DIALECTS, "mappings/mindspore_names.py DIALECTS lists the dialects' names"


def dialect_named(name: str) -> Dialect:
    if name not in DIALECTS:
        raise InteropError(f"unknown MindSpore dialect {name!r} (known: {', '.join(DIALECTS)})")
    return DIALECTS[name]


def refuse_mla(tags, where: str) -> None:
    """MindFormers' multi-latent attention with mla_qkv_concat=False (megatron-core's separate projections) is not
    read: its default concatenated layout is."""
    for tag in tags:
        if any(marker in tag for marker in names.MINDFORMERS_MCORE_MLA_MARKERS):
            raise InteropError(f"{where}: {tag} is MindFormers' multi-latent attention with mla_qkv_concat=False, "
                               "which interop does not read (its default, mla_qkv_concat=True: linear_qkv / linear_qb "
                               "/ linear_kvb, is)")
