"""MindSpore rank files -> global canonical tensors.

The layout comes from the files themselves: which layers each `rank_N` file holds gives the pipeline
stages (and virtual chunks), a column-split tensor's shape gives tp, extra copies per stage are
data-parallel ranks.  The model description comes from `--model-config` (a HF config.json, Megatron
args, MindSpeed / MindFormers YAML) or interop's optional `mindspore_model.json`; the training state
from the scalars beside the tensors.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ...contract import BaseReader
from ...distinct_ranks import RankPrint, check_distinct
from ...errors import InteropError
from ...io.ms_ckpt import CkptFile
from ...io.small_files import read_json_object
from ...layout import ParallelLayout
from ...memory import BufferPool
from ...mappings.mindspore_names import DIALECT_MARKERS, IGNORED_SUFFIXES, LOCAL_EXPERTS, PT_META, PT_META_ARGS
from ...params import param_index, param_table
from ...spec import ModelSpec, vocab_from_rows
from ...tensors import Source, TensorMeta
from . import lora, pt_meta
from .files import SIDECAR, old_mindspeed_tree, rank_folders, single_file
from .dialects import dialect_named, refuse_mla
from .scalars import BadScalar, is_scalar_tag, scalars_to_state

FORMAT = "mindspore"


def _load_json(path: Path, what: str) -> dict:
    return read_json_object(path, what)


def _spec_from_config(path, dtype: str) -> ModelSpec:
    """--model-config: a HF config.json (or interop's {"spec": ...}); any other model description
    (a Megatron args file or launch script, MindSpeed / MindFormers YAML) through Megatron's args."""
    from ...mappings.hf_config import spec_from_hf_config
    path = Path(path)
    if path.suffix.lower() == ".json":
        data = _load_json(path, "model config")
        if "spec" in data:
            return ModelSpec.from_dict(data["spec"], where=str(path))
        return spec_from_hf_config(data, dtype, where=str(path))
    from ...mappings.megatron_spec import spec_from_args
    from ...model_config import megatron_args_from_file
    return spec_from_args(megatron_args_from_file(path), str(path), dtype)


def _guess_dialect(tags: list[str], path: Path) -> str:
    for tag in tags:
        for marker, dialect in DIALECT_MARKERS.items():
            if tag.startswith(marker):
                return dialect
    raise InteropError(f"{path}: cannot tell the MindSpore dialect from its tensor names "
                       f"(known prefixes: {', '.join(DIALECT_MARKERS)})")


_LAYER_TAG = re.compile(r"\blayers\.(\d+)\.")


def _runs(layers: list[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous runs of sorted layer numbers as (start, stop) pairs."""
    runs = []
    for i in layers:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


class Reader(BaseReader):
    """Reads every rank file of a MindSpore checkpoint and hands out global canonical tensors."""

    options = ("model_config", "qkv_layout", "qkv_bias_layout", "src_qkv_layout", "src_qkv_bias_layout",
               "vocab_size", "allow_identical_ranks")

    @classmethod
    def options_for_worker(cls, options: dict) -> dict:
        return dict(options, verify=False)  # the parent checked every file's crc as it opened it

    @classmethod
    def options_for_rank(cls, options: dict, rank: int, ranks: int) -> dict:
        return dict(options, verify_share=(rank, ranks))  # each rank checks its share of the files' crcs

    def __new__(cls, path, model_config=None, qkv_layout: str | None = None, qkv_bias_layout: str | None = None,
                src_qkv_layout: str | None = None, src_qkv_bias_layout: str | None = None, verify: bool = True,
                vocab_size: int | None = None, verify_share: tuple[int, int] = (0, 1),
                allow_identical_ranks: bool | None = None):
        """A MindFormers LoRA adapter (its pet_config beside the `.ckpt`, or a `.ckpt` of LoRA tensors only with
        the run's YAML as --model-config) is read by `lora.Reader`."""
        if lora.holds_adapter(path) or (lora.states_pet_config(model_config) and lora.names_adapter(path)):
            if any(x is not None for x in (qkv_layout, qkv_bias_layout, src_qkv_layout, src_qkv_bias_layout, vocab_size,
                                           allow_identical_ranks)):
                raise InteropError(f"{path}: a MindFormers LoRA adapter takes no MindSpore layout options")
            return lora.Reader(path, model_config)
        return super().__new__(cls)

    def __init__(self, path, model_config=None, qkv_layout: str | None = None, qkv_bias_layout: str | None = None,
                 src_qkv_layout: str | None = None, src_qkv_bias_layout: str | None = None, verify: bool = True,
                 vocab_size: int | None = None, verify_share: tuple[int, int] = (0, 1),
                 allow_identical_ranks: bool | None = None):
        """`qkv_layout` / `qkv_bias_layout`: how a MindFormers w_qkv is joined.  MindSpore -> MindSpore gives
        the source's as `src_qkv_layout` / `src_qkv_bias_layout` (the plain flags are the output's).
        `verify=False` skips what reads tensor bytes to check the files (crc trailers, a tied head's or a
        renamed tensor's stored copy): a `--workers` worker, whose parent made those checks already.
        `verify_share` (rank, ranks) of a distributed conversion: this rank checks the crc of every ranks-th
        file from its own on, rank 0 the stored copies; together the ranks check everything once.
        `allow_identical_ranks`: read rank files that are copies of one another (refused by default)."""
        share, ranks = verify_share
        self.verify = verify and share == 0
        qkv_layout, qkv_bias_layout = src_qkv_layout or qkv_layout, src_qkv_bias_layout or qkv_bias_layout
        path = Path(path)
        if not path.exists():
            raise InteropError(f"{path}: no such file or directory")
        root = path.parent if path.is_file() else path
        sidecar = _load_json(root / SIDECAR, "MindSpore model description") if (root / SIDECAR).is_file() else None
        if sidecar is not None and sidecar.get("format") != FORMAT:
            raise InteropError(f"{root / SIDECAR}: format is {sidecar.get('format')!r}, expected {FORMAT!r}")
        self.files: dict = {}
        self.ep_files: dict = {}  # {(tp rank, stage, ep rank >= 1): file} of a MindSpeed expert-parallel run
        self._cached = (None, None)
        self.positions: list[int] | None = None  # each layer's position, where noop layers' positions are skipped
        self.memory = BufferPool(keep=4)  # the rows read, reused once the writer is done with them
        notes: list[str] = []
        try:
            old = old_mindspeed_tree(path) if path.is_dir() else None
            one = None if old or (path.is_dir() and any(path.glob("rank_*"))) else single_file(path)
            if old:
                paths = old[0]
            elif one is not None:
                paths = {(0, 0): one}
            else:
                by_rank, notes = rank_folders(path)
                paths = {("rank", r): p for r, p in by_rank.items()}
            for i, (key, p) in enumerate(sorted(paths.items())):
                self.files[key] = CkptFile(p, verify=verify and i % ranks == share)
            self._describe(path, sidecar, model_config, qkv_layout, qkv_bias_layout, notes, vocab_size)
            if self.verify:  # (a worker's parent checked)
                self._check_distinct(self.source.notes, bool(allow_identical_ranks))
        except BaseException:
            self.close()
            raise

    # -- what the checkpoint is ----------------------------------------------------------------
    def _describe(self, path: Path, sidecar, model_config, qkv_layout, qkv_bias_layout, notes: list[str],
                  vocab_size: int | None) -> None:
        first = self.files[(0, 0)] if (0, 0) in self.files else self.files[("rank", 0)]
        tags = first.keys()
        float_dtypes = [first.meta(k)[0] for k in tags
                        if first.meta(k)[0] is not None and first.meta(k)[0].is_floating_point and first.meta(k)[1]]
        dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(float_dtypes[0] if float_dtypes else None,
                                                                           "float32")
        refuse_mla(tags, first.path)
        meta = pt_meta.read(path) if path.is_dir() else None
        spec, stated = self._description(path, sidecar, model_config, meta, dtype, vocab_size, notes)
        dialect = dialect_named((sidecar or {}).get("dialect") or _guess_dialect(tags, path))
        qkv_concat = bool((sidecar or {}).get("qkv_concat", any(".w_qkv." in t for t in tags)))
        if qkv_concat and dialect.fuses_qkv:
            qkv_layout, qkv_bias_layout = self._qkv_layouts(first, sidecar, qkv_layout, qkv_bias_layout, notes)
        else:  # nothing fused to read (the flags may be the writer's, in a MindSpore -> MindSpore conversion)
            qkv_layout = qkv_bias_layout = None
        self.rows = dialect.rows(spec, qkv_concat, qkv_layout or "grouped", qkv_bias_layout)
        self.dialect = dialect
        if any(key[0] == "rank" for key in self.files):
            layout = self._place(spec, notes)
        else:
            tp = max(t for t, _ in self.files) + 1
            pp = max(p for _, p in self.files) + 1
            layout = ParallelLayout.build(spec.num_layers, tp, pp)
        if dialect.layout_note(spec):
            notes.append(dialect.layout_note(spec))
        if sidecar is not None and "layout" in sidecar:
            said = ParallelLayout.from_dict(sidecar["layout"])
            if (said.tp, said.pp, said.ep) != (layout.tp, layout.pp, layout.ep):
                raise InteropError(f"{path}: {SIDECAR} says tp={said.tp} pp={said.pp} ep={said.ep}, "
                                   f"the files are tp={layout.tp} pp={layout.pp} ep={layout.ep}")
            layout = said  # it also knows uneven stages
        if meta is not None:
            _, tp, pp, vpp = meta
            if (tp, pp, vpp) != (layout.tp, layout.pp, layout.vpp):
                raise InteropError(f"{path / 'pt_meta'}: its args files are for tp={tp} pp={pp} vpp={vpp}, the rank "
                                   f"files hold tp={layout.tp} pp={layout.pp} vpp={layout.vpp}")
            notes.append(f"layout tp={tp} pp={pp} vpp={vpp} read from the rank files, as pt_meta/ says")
        if qkv_concat and "plain" in (qkv_layout, qkv_bias_layout) and layout.tp > 1:
            raise InteropError(f"{path}: a plainly joined w_qkv split over tp={layout.tp} ranks is not per-head "
                               "shards: merge it with mindspore.transform_checkpoints first")
        first = self.files[(0, 0)]
        if dialect.vocab_whole(spec, spec.padded_vocab, layout.tp):  # its embedding whole on each rank at this tp
            self.rows = dialect.rows(spec, qkv_concat, qkv_layout or "grouped", qkv_bias_layout, layout.tp)
        self.tag_of = self._resolve_names(spec, layout)
        if model_config is not None and sidecar is None and meta is None:
            self.spec, self.layout = spec, layout  # (_home finds an expert's ep rank file by them)
            self._refuse_other_model(model_config, spec, layout)
        embed = self.tag_of[self.rows[0].key]
        if embed not in first:
            raise InteropError(f"{first.path}: no {embed}: not a {dialect.name} {spec.arch} checkpoint "
                               f"(found e.g. {tags[0] if tags else 'nothing'})")
        held = dialect.held_vocab_rows(spec, first.meta(embed)[1][0], layout.tp)  # cut over tp, or whole
        vocab, rows, vocab_notes = vocab_from_rows(held, spec.vocab, stated,
                                                   f"{first.path}: {embed} over tp={layout.tp}",
                                                   stated_by=f"{PT_META}/'s Megatron args")
        notes += vocab_notes
        if (vocab, rows) != (spec.vocab, spec.padded_vocab) or dialect.vocab_whole(spec, rows, layout.tp):
            spec = spec.replace(vocab=vocab, padded_vocab=rows)  # the name table's shapes follow the rows
            self.rows = dialect.rows(spec, qkv_concat, qkv_layout or "grouped", qkv_bias_layout, layout.tp)
            self.tag_of = self._resolve_names(spec, layout)
        self.spec, self.layout = spec, layout
        self.index = param_index(spec)
        self.prefixes = dialect.moments
        self.row_of = {p: row for row in self.rows for p in row.parts}
        scalars = self._check(notes)
        try:
            state, scalar_notes = scalars_to_state(scalars)
        except BadScalar as exc:
            raise InteropError(f"{self.files[(0, 0)].path}: {exc}: the training state is damaged") from None
        notes += scalar_notes
        optimizer = (state.get("megatron") or {}).get("optimizer")
        if optimizer and not self.optim:  # step and param groups stored, the moments not: say what is missing
            notes.append(f"no optimizer moments ({', '.join(p + '*' for p in self.prefixes.values())}) in the rank "
                         f"files although their scalars say an optimizer ran (step {optimizer.get('step')}): "
                         "weights only")
        if sidecar is not None:
            state = _merge_state(sidecar.get("state") or {}, state)
        if meta is not None and sidecar is None:  # (interop's own pt_meta restates what its sidecar records)
            from_meta = pt_meta.state_from(meta[0])
            if from_meta:
                notes.append("pt_meta's Megatron args and counters kept in the training state")
                state.setdefault("megatron", {}).update(
                    {k: v for k, v in from_meta["megatron"].items() if k not in state["megatron"]})
                named = (from_meta["megatron"].get("args") or {}).get("tokenizer_model")
                if isinstance(named, str) and named and "tokenizer_model" not in state:
                    state["tokenizer_model"] = named  # neutral (interop.state): an HF target takes the file
        bare = any(f.crc is None for f in [*self.files.values(), *self.ep_files.values()])
        self.source = Source(spec, layout, state=state, notes=notes,
                             unchecked="MindSpore .ckpt files without a crc_num trailer" if bare else None)

    @staticmethod
    def _description(path: Path, sidecar, model_config, meta, dtype: str, vocab_size, notes: list[str]):
        """(spec, the padded vocabulary it states) from --model-config, interop's sidecar or MindSpeed's own
        pt_meta/ (the whole Megatron args convert_pt2ckpt.py saves); --model-config and pt_meta/ must agree."""
        where = f"{path / PT_META / PT_META_ARGS.format(t=0, p=0)}"
        from_meta = pt_meta.spec_from(meta[0], dtype, where) if meta is not None else None
        if model_config is not None:
            spec, stated = _spec_from_config(model_config, dtype), None
            described = ((from_meta[0], where, f"{PT_META}/") if from_meta is not None else
                         (ModelSpec.from_dict(sidecar["spec"]), path / SIDECAR, SIDECAR) if sidecar is not None
                         else None)
            if described is not None:
                diff = spec.differences(described[0])
                if spec.position == "rope" and any(k == "max_positions" for k, _, _ in diff):
                    # no tensor or computation depends on it under rope (a YAML may leave it to its default)
                    notes.append(f"max_positions: --model-config says {spec.max_positions}, {described[2]} "
                                 f"{described[0].max_positions}; kept --model-config's")
                    diff = [d for d in diff if d[0] != "max_positions"]
                if diff:
                    raise InteropError(f"--model-config {model_config} and {described[1]} describe different models: "
                                       + ", ".join(f"{k} {a} vs {b}" for k, a, b in diff)
                                       + f"; pass the right --model-config, or none to take {described[2]}'s")
        elif sidecar is not None:
            spec, stated = ModelSpec.from_dict(sidecar["spec"]), None
        elif from_meta is not None:
            spec, stated = from_meta
            notes.append(f"model description taken from {PT_META}/'s Megatron args")
        else:
            raise InteropError(f"{path}: a bare MindSpore checkpoint carries no model description; "
                               "pass --model-config (a HF config.json, Megatron args file or MindSpeed / "
                               "MindFormers YAML)")
        if vocab_size:
            spec, stated = spec.replace(vocab=vocab_size, padded_vocab=max(vocab_size, spec.padded_vocab)), None
        return spec, stated

    def _qkv_layouts(self, first: CkptFile, sidecar, qkv_layout, qkv_bias_layout, notes):
        """The fused layouts of a MindFormers qkv_concat file: given, from interop's sidecar, or refused."""
        if qkv_layout is None and sidecar is not None:
            qkv_layout = sidecar.get("qkv_layout") or "grouped"  # interop wrote grouped before it said so
            qkv_bias_layout = qkv_bias_layout or sidecar.get("qkv_bias_layout")
        if qkv_layout is None:
            raise InteropError(f"{first.path}: a MindFormers qkv_concat checkpoint does not say how w_qkv / "
                               "w_gate_hidden are joined: pass --qkv-layout grouped (MindFormers r1.5.0 and later) "
                               "or --qkv-layout plain (r1.3.x); --src-qkv-layout when writing MindSpore too")
        has_bias = any(t.endswith(".attention.w_qkv.bias") for t in first.keys())
        if has_bias and qkv_bias_layout is None and qkv_layout == "grouped" and sidecar is None:
            notes.append("read w_qkv.bias grouped per KV group, as MindFormers' own Llama model uses it; "
                         "MindFormers' convert_weight.py joins the biases plainly: for its output pass "
                         "--qkv-bias-layout plain (--src-qkv-bias-layout when writing MindSpore too)")
        return qkv_layout, qkv_bias_layout

    def _place(self, spec: ModelSpec, notes: list[str]) -> ParallelLayout:
        """Turn {("rank", N): file} into {(t, p): file} and the layout, from the files' contents."""
        by_rank = {key[1]: f for key, f in self.files.items()}
        index = param_index(spec)
        layer_of = {row.key: index[row.parts[0]].layer for row in self.rows}
        layer_of.update({old: layer_of[new] for new, old in self.dialect.converter_names(self.rows, spec).items()})
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, f in sorted(by_rank.items()):
            layers = tuple(sorted({layer_of[t] for t in f.keys() if layer_of.get(t) is not None}))
            groups.setdefault(layers, []).append(r)
        stages = sorted(groups, key=lambda layers: layers[0] if layers else -1)
        held = sorted(i for layers in stages for i in layers)
        if held != list(range(spec.num_layers)):
            noop = self._noop_groups(spec, by_rank, notes)
            if noop is not None:
                groups, stages = noop, sorted(noop, key=lambda layers: layers[0] if layers else -1)
                held = sorted(i for layers in stages for i in layers)
        if held != list(range(spec.num_layers)):
            raise InteropError(f"{Path(by_rank[0].path).parent.parent}: the rank files hold layers {_brief(held)}, "
                               f"not each of the model's {spec.num_layers} layers exactly once per stage")
        chunks = tuple(_runs(list(layers)) for layers in stages)
        if len({len(c) for c in chunks}) != 1:
            raise InteropError(f"{Path(by_rank[0].path).parent.parent}: pipeline stages hold different numbers of "
                               f"layer runs ({[len(c) for c in chunks]}): not a virtual-pipeline layout")
        tp = self._tp_from_shapes(spec, by_rank[groups[stages[0]][0]])
        # (the first stage that holds experts: a stage of dense layers only says nothing)
        ep = max(self._ep_from_experts(spec, by_rank[groups[layers][0]]) for layers in stages)
        used = tp * self.dialect.rank_files(ParallelLayout.build(spec.num_layers, tp, ep=ep)) if ep > 1 else tp
        self.files = {}
        extra = 0
        for p, layers in enumerate(stages):
            ranks = groups[layers]
            if len(ranks) % tp or len(ranks) < used:
                raise InteropError(f"{Path(by_rank[ranks[0]].path).parent.parent}: stage {p} has {len(ranks)} rank "
                                   f"files, not a multiple of tp={tp}" + (f" of at least {used} (ep={ep})" if ep > 1
                                                                           else ""))
            for i, r in enumerate(ranks[:used]):  # rank p*dp*tp + d*tp + t; expert-parallel rank d < ep
                d, t = divmod(i, tp)
                if r - ranks[0] != i:
                    raise InteropError(f"{by_rank[r].path}: rank {r} is not tp rank {t}"
                                       f"{f', ep rank {d}' if ep > 1 else ''} of stage {p}")
                if d == 0:
                    self.files[(t, p)] = by_rank[r]
                else:
                    self.ep_files[(t, p, d)] = by_rank[r]
            for r in ranks[used:]:
                by_rank[r].close()
                extra += 1
        if extra:
            notes.append(f"read the first {used} rank files of each stage{f' (ep={ep})' if ep > 1 else ''}; "
                         f"{extra} data-parallel copies were not read")
        return ParallelLayout(tp, len(stages), chunks, ep)

    def _noop_groups(self, spec: ModelSpec, by_rank: dict, notes: list[str]) -> dict | None:
        """MindSpeed-Core-MS's noop layers: its files number layers by position among num_layers, noop positions
        included (legacy/model/transformer.py at br_master 07c5198, lines 1619-1636: `layers_dict` keys
        `i + offset`, NoopTransformerLayer without weights where `i + offset in config.noop_layers`; its checkpoints
        drop the `_pp.._id..` suffix, dist_checkpointing/checkpointing.py 296; tools/converter/convert_ckpt2pt.py
        at r0.1.0, cal_corr_vpp_layers lines 212-219, reads the same: positions of np.split(arange(num_layers))
        without --noop's).  The model's layers are the positions held, in order; {canonical layers: ranks}, with
        `self.positions` set, or None when the files are not that layout."""
        if not self.dialect.noop_positions:
            return None
        templates = {_LAYER_TAG.sub("layers.#.", name, count=1) for row in self.rows
                     for name in (row.key, self.dialect.converter_names(self.rows, spec).get(row.key, row.key))
                     if _LAYER_TAG.search(name)}
        found = {}
        for r, f in sorted(by_rank.items()):
            found[r] = tuple(sorted({int(m.group(1)) for t in f.keys() if (m := _LAYER_TAG.search(t))
                                     and _LAYER_TAG.sub("layers.#.", t, count=1) in templates}))
        positions = sorted({i for held in found.values() for i in held})
        stages = set(found.values())  # a stage's tp and dp ranks hold the same positions; stages share none
        if len(positions) != spec.num_layers or sum(len(held) for held in stages) != spec.num_layers:
            return None
        index = {pos: i for i, pos in enumerate(positions)}
        self.positions = positions
        skipped = [i for i in range(positions[-1] + 1) if i not in index]
        notes.append(f"layer positions {_brief(skipped)} absent: MindSpeed-Core-MS's noop layers (identity layers "
                     f"without weights); the {spec.num_layers} layers read in their order")
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, held in found.items():
            groups.setdefault(tuple(index[i] for i in held), []).append(r)
        return groups

    def _ep_from_experts(self, spec: ModelSpec, f: CkptFile) -> int:
        """MindSpeed: how many experts one rank file numbers (local_experts 0 .. E/ep - 1) gives ep; MindFormers:
        how many of a stacked experts tensor's rows one rank file holds."""
        if spec.is_moe and self.dialect.ep_cuts_expert_rows:
            for row in self.rows:
                if row.transform.every_expert and row.key in f:
                    whole, held = row.transform.rank_shape()[0], f.meta(row.key)[1]
                    return whole // held[0] if held and held[0] and whole % held[0] == 0 else 1
            return 1
        if not spec.is_moe or not self.dialect.expert_parallel:
            return 1
        held = {}
        for tag in f.keys():
            if LOCAL_EXPERTS in tag:
                stem, _, rest = tag.partition(LOCAL_EXPERTS)
                held.setdefault(stem, set()).add(rest.split(".")[0])
        counts = {len(v) for v in held.values()}
        if len(counts) != 1 or spec.num_experts % next(iter(counts)):
            return 1  # (the missing tensors are then named one by one)
        return spec.num_experts // counts.pop()

    def _home(self, t: int, param, tag: str) -> tuple[CkptFile, str]:
        """The file and tag holding `tag` of `param` for tp rank t: an expert's own ep rank, its local number."""
        stage = self.layout.stage_of(param)
        if param.expert is None or self.layout.ep == 1:
            return self.files[(t, stage)], tag
        if self.dialect.ep_cuts_expert_rows:  # the file of the expert's ep coordinate (stage rank d * tp + t)
            return self._ep_file(param.expert // (self.spec.num_experts // self.layout.ep), stage), tag
        per = self.spec.num_experts // self.layout.ep
        d, local = divmod(param.expert, per)
        tag = tag.replace(f"{LOCAL_EXPERTS}{param.expert}.", f"{LOCAL_EXPERTS}{local}.")
        return (self.files[(t, stage)] if d == 0 else self.ep_files[(t, stage, d)]), tag

    def _ep_file(self, e: int, stage: int) -> CkptFile:
        """MindFormers: the first rank file of `stage` holding expert-parallel rank e's rows (stage rank e)."""
        d, t = divmod(e, self.layout.tp)
        return self.files[(t, stage)] if d == 0 else self.ep_files[(t, stage, d)]

    def _ep_rows(self, transform) -> bool:
        """Whether this row's stored tensor is cut by rows over the ep ranks' files (MindFormers' experts)."""
        return self.layout.ep > 1 and transform.every_expert and self.dialect.ep_cuts_expert_rows

    def native_name(self, name: str) -> str | None:
        """The tag a canonical tensor is stored under (`interop inspect --native`): at ep > 1 an expert's local
        number in its expert-parallel rank's file, which the name then says; the part when the tensor is fused."""
        row = self.row_of.get(name)
        if row is None:
            return None
        ms_name, parts = row.key, row.parts
        param = self.index[name]
        f, tag = self._home(0, param, self.tag_of[ms_name])
        if param.expert is not None and self.layout.ep > 1:
            tag = f"{tag} ({Path(f.path).parent.name})"
        return tag if len(parts) == 1 else f"{tag} [part {parts.index(name) + 1}/{len(parts)}]"

    def _tp_from_shapes(self, spec: ModelSpec, f: CkptFile) -> int:
        index = param_index(spec)
        for row in self.rows:
            name, transform, parts = row.key, row.transform, row.parts
            param = index[parts[0]]
            if param.axis is None or param.layer is None or transform.native_axis is None or name not in f:
                continue
            full = transform.rank_shape()
            local = f.meta(name)[1]
            axis = transform.native_axis
            if len(local) != len(full) or not local[axis] or full[axis] % local[axis]:
                raise InteropError(f"{f.path}: {name} has shape {list(local)}, which no tp splits from {list(full)}")
            return full[axis] // local[axis]
        raise InteropError(f"{f.path}: no layer tensor of a {self.dialect.name} {spec.arch} model to tell tp from")

    def _resolve_names(self, spec: ModelSpec, layout: ParallelLayout) -> dict[str, str]:
        """{row name: the tag the files use}: the model's name, or convert_pt2ckpt.py's where it differs."""
        index = param_index(spec)
        alias = self.dialect.converter_names(self.rows, spec)
        out = {}
        for row in self.rows:
            name, layer = row.key, index[row.parts[0]].layer
            f = self.files[(0, layout.stage_of(index[row.parts[0]]))]
            if self.positions is not None and layer is not None:  # noop layers: the position the files use
                name = _LAYER_TAG.sub(f"layers.{self.positions[layer]}.", name, count=1)
                if alias.get(row.key):
                    alias[row.key] = _LAYER_TAG.sub(f"layers.{self.positions[layer]}.", alias[row.key], count=1)
            out[row.key] = alias[row.key] if name not in f and alias.get(row.key) in f else name
        return out

    def _refuse_other_model(self, model_config, spec: ModelSpec, layout: ParallelLayout) -> None:
        """A bare checkpoint described by --model-config alone: every tensor the description implies that tp
        rank 0's files lack or hold in another shape, and the layers they hold beyond it, in one line (not
        the first contradiction met).  A vocabulary matrix may hold more rows (padding), not fewer."""
        index, differ, seen = param_index(spec), [], set()
        for row in self.rows:
            f, tag = self._home(0, index[row.parts[0]], self.tag_of[row.key])  # an expert in its ep rank's file
            want = tuple(row.transform.rank_shape(0, layout.tp))
            if layout.ep > 1 and row.transform.every_expert and self.dialect.ep_cuts_expert_rows:
                a, b = row.transform.ep_rows(0, layout.ep)
                want = (b - a,) + want[1:]
            vocab = index[row.parts[0]].split == "vocab"
            pattern = re.sub(r"\.\d+\.", ".N.", tag)
            if pattern in seen:
                continue
            if tag not in f:
                seen.add(pattern)
                differ.append(f"{pattern} [{', '.join(map(str, want))}] vs missing")
                continue
            got = tuple(f.meta(tag)[1])
            same = (len(got) == len(want) and got[1:] == want[1:] and got[0] * layout.tp >= spec.vocab) if vocab \
                else got == want
            if not same:
                seen.add(pattern)
                differ.append(f"{pattern} {list(want)} vs {list(got)}")
        held = {int(m.group(1)) for f in self.files.values() for tag in f.keys()
                if (m := re.search(r"\blayers\.(\d+)\.", tag))}
        if layout.pp == 1 and held and len(held) != spec.num_layers:
            differ.insert(0, f"num_layers {spec.num_layers} vs {len(held)}")
        if differ:
            first = self.files[(0, 0)].path
            raise InteropError(f"--model-config {model_config} describes another model than {first} "
                               f"(--model-config vs checkpoint, tp rank 0): {', '.join(differ)}")

    def _check(self, notes: list[str]) -> dict[str, torch.Tensor]:
        """Every expected tensor present with its shard's shape, the optimizer's moments all or none;
        returns the training-state scalars (read from the first file); anything else is an error or noted."""
        # every file by (tp rank, stage, ep rank); dense tensors are in each ep rank's file, an expert in its own
        files = {**{(t, p, 0): f for (t, p), f in self.files.items()}, **self.ep_files}
        eps = range(self.dialect.rank_files(self.layout))  # the data-parallel ranks' files of each (t, p)
        expected: dict[tuple[int, int, int], dict[str, tuple]] = {key: {} for key in files}
        optional: dict[tuple[int, int, int], set] = {key: set() for key in files}
        for row in self.rows:
            name, transform, parts = row.key, row.transform, row.parts
            stage = self.layout.stage_of(self.index[parts[0]])
            shape = transform.rank_shape(0, self.layout.tp)
            if self._ep_rows(transform):  # every file of the stage holds its ep coordinate's rows
                a, b = transform.ep_rows(0, self.layout.ep)
                for key in files:
                    if key[1] == stage:
                        expected[key][self.tag_of[name]] = (b - a,) + tuple(shape[1:])
                continue
            for t in range(self.layout.tp):
                if self.index[parts[0]].expert is not None and self.layout.ep > 1:
                    f, tag = self._home(t, self.index[parts[0]], self.tag_of[name])
                    d = next(k[2] for k, g in files.items() if g is f)
                    expected[(t, stage, d)][tag] = shape
                else:
                    for d in eps:
                        expected[(t, stage, d)][self.tag_of[name]] = shape
        copies = {}  # convert_pt2ckpt.py's name -> the model's, where a file may hold both
        for model, plain in self.dialect.converter_names(self.rows, self.spec).items():
            if self.tag_of[model] == model:
                copies[plain] = model
                stage = self.layout.stage_of(self.index[self.row_of_name(model).parts[0]])
                for t in range(self.layout.tp):
                    for d in eps:
                        optional[(t, stage, d)].add(plain)
        tied = []
        if self.spec.tied_embeddings:
            tied = list(self.dialect.tied_heads)
            for t in range(self.layout.tp):
                for d in eps:
                    optional[(t, self.layout.pp - 1, d)].update(tied)
        moments = [native for native in self.prefixes.values()]
        have_moments = any(tag.startswith(native) for f in self.files.values() for tag in f.keys() for native in moments)
        buffers, scalars = set(), {}
        for key, f in files.items():
            for name, shape in expected[key].items():
                if name not in f:
                    _refuse_expert_parallel(f, name, self.spec)
                    raise InteropError(f"{f.path}: tensor {name} is missing (a {self.dialect.name} {self.spec.arch} "
                                       f"model with {self.spec.num_layers} layers at tp={self.layout.tp} "
                                       f"pp={self.layout.pp})")
                if f.meta(name)[1] != shape:
                    raise InteropError(f"{f.path}: {name} has shape {list(f.meta(name)[1])}, expected {list(shape)}")
                for native in moments if have_moments else []:
                    if native + name not in f:
                        raise InteropError(f"{f.path}: optimizer moment {native + name} is missing while others "
                                           "are present: the optimizer state is incomplete")
                    if f.meta(native + name)[1] != shape:
                        raise InteropError(f"{f.path}: {native + name} has shape "
                                           f"{list(f.meta(native + name)[1])}, expected {list(shape)}")
            allowed = set(expected[key]) | optional[key]
            for tag in f.keys():
                base = next((tag[len(n):] for n in moments if tag.startswith(n)), tag)
                if base in allowed:
                    continue
                dtype, shape = f.meta(tag)
                if dtype is None or is_scalar_tag(tag, shape):
                    if key == (0, 0, 0) and dtype is not None:
                        scalars[tag] = f.read(tag)
                    elif key == (0, 0, 0):
                        scalars.setdefault("__strings__", []).append(tag)
                    continue
                why = next((why for suffix, why in IGNORED_SUFFIXES.items() if tag.endswith(suffix)), None)
                if why:
                    buffers.add(why)
                    continue
                raise InteropError(f"{f.path}: tensor {tag} does not belong to a {self.dialect.name} {self.spec.arch} "
                                   f"model at tp={self.layout.tp} pp={self.layout.pp} (unknown tag layout)")
        self.optim = have_moments
        if self.verify:
            self._check_tied_copies(tied, notes)
            self._check_name_copies(copies, moments if have_moments else [])
        notes += [f"dropped buffers that are not parameters ({why})" for why in sorted(buffers)]
        strings = scalars.pop("__strings__", [])
        if strings:
            notes.append(f"dropped {len(strings)} string entries ({', '.join(sorted(strings)[:5])})")
        return scalars

    def _check_distinct(self, notes: list[str], allow: bool) -> None:
        """No rank file is a copy of another (`interop.distinct_ranks`): the tp ranks of a stage compared by
        their split tensors, the ep ranks of one tp rank by their routed experts.  Files that all end in a
        crc_num trailer are compared by it and their size (nothing read); others by 4 KiB of their first such
        tensor, those that agree there tensor by tensor."""
        groups: dict[tuple, dict[CkptFile, list[str]]] = {}
        for row in self.rows:
            param = self.index[row.parts[0]]
            stage = self.layout.stage_of(param)
            for t in range(self.layout.tp):
                if param.expert is not None and self.layout.ep > 1:
                    f, tag = self._home(t, param, self.tag_of[row.key])
                    groups.setdefault(("ep", stage, t), {}).setdefault(f, []).append(tag)
                elif self.layout.tp > 1 and not row.transform.replicated:
                    groups.setdefault(("tp", stage), {}).setdefault(self.files[(t, stage)], []).append(
                        self.tag_of[row.key])
        ranks = {f: (t, d) for (t, _, d), f in
                 [*(((t, p, 0), f) for (t, p), f in self.files.items()), *self.ep_files.items()]}
        for key, held in sorted(groups.items(), key=lambda kv: kv[0]):
            whole = all(f.crc is not None for f in held)
            by_path = {f.path: (f, tags) for f, tags in held.items()}
            members = []
            for f, tags in held.items():
                t, d = ranks[f]
                name = f"expert-parallel rank {d}" if key[0] == "ep" else f"tensor-parallel rank {t}"
                sums = (f.crc, os.path.getsize(f.path)) if whole else (tuple(tags), f.head(tags[0], 4096))
                what = "the whole file (crc_num trailer and size)" if whole else \
                    f"every {'routed expert' if key[0] == 'ep' else 'split tensor'} ({len(tags)})"
                members.append(RankPrint(f.path, name, sums, what))

            def same(a: RankPrint, b: RankPrint) -> bool:
                (fa, tags), (fb, _) = by_path[a.path], by_path[b.path]
                return whole or all(fa.same_bytes(tag, fb, tag) for tag in tags)
            check_distinct(sorted(members, key=lambda m: ranks[by_path[m.path][0]]), notes, allow, same)

    def _check_tied_copies(self, tied: list[str], notes: list[str]) -> None:
        """A tied head's stored copy must equal the embedding it is tied to: otherwise refuse, not drop it."""
        embed = self.tag_of[self.rows[0].key]
        last = self.layout.pp - 1
        for t in range(self.layout.tp):
            f = self.files[(t, last)]
            for tag in tied:
                if tag not in f:
                    continue
                if not torch.equal(f.read(tag), self.files[(t, 0)].read(embed)):
                    raise InteropError(f"{f.path}: {tag} differs from the tied embedding {embed}: the model is "
                                       "not tied (pass a --model-config with tie_word_embeddings false)")
                if t == 0:
                    notes.append(f"{tag}: the tied head's copy of the embedding, checked equal and not read again")

    def row_of_name(self, ms_name: str):
        return next(row for row in self.rows if row.key == ms_name)

    def _check_name_copies(self, copies: dict[str, str], moments: list[str]) -> None:
        """A tensor stored under both the model's and the converter's name must be the same tensor."""
        for f in self.files.values():
            for plain, model in copies.items():
                for native in [""] + moments:
                    if native + plain in f and not torch.equal(f.read(native + plain), f.read(native + model)):
                        raise InteropError(f"{f.path}: {native + plain} and {native + model} name one parameter "
                                           "but hold different values")

    # -- tensors --------------------------------------------------------------------------------
    def metas(self) -> list[TensorMeta]:
        out = []
        for param in param_table(self.spec):
            f, tag = self._home(0, param, self.tag_of[self.row_of[param.name].key])
            out.append(TensorMeta(param.name, f.meta(tag)[0], param.shape))
        if self.optim:
            for prefix, native in self.prefixes.items():
                for param in param_table(self.spec):
                    f, tag = self._home(0, param, native + self.tag_of[self.row_of[param.name].key])
                    out.append(TensorMeta(prefix + param.name, f.meta(tag)[0], param.shape))
        return out

    def _row(self, name: str):
        """(stored tag, transform, parts) of a canonical (or optimizer-moment) tensor name."""
        native, canonical = "", name
        for prefix, nat in self.prefixes.items():
            if name.startswith(prefix):
                native, canonical = nat, name[len(prefix):]
        row = self.row_of[canonical]
        return native + self.tag_of[row.key], row.transform, row.parts, canonical

    def read(self, name: str) -> torch.Tensor:
        tag, transform, parts, canonical = self._row(name)
        if len(parts) == 1:
            return self._gather(tag, transform, parts)[0]
        if self._cached[0] != tag:  # q, k and v come from one fused tensor: read it once
            self._cached = (None, None)  # (the previous row is not held while this one is read)
            self._cached = (tag, self._gather(tag, transform, parts))
        return self._cached[1][parts.index(canonical)]

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` (e.g. the first rows of a padded vocab buffer) with `name` when its stored tensor
        holds nothing else; False for a fused row."""
        tag, transform, parts, _ = self._row(name)
        if len(parts) != 1 or out.dtype != self._stored(tag, transform, parts)[1] or not out.is_contiguous():
            return False
        self._gather(tag, transform, parts, [out])
        return True

    def _stored(self, tag: str, transform, parts) -> tuple[dict, torch.dtype]:
        """{tp rank: (file, its tag)} of the ranks to read (rank 0 alone when replicated) and their one dtype;
        a rank whose type or shard shape differs is refused (its bytes are never cast to its peers' type)."""
        first = self.index[parts[0]]
        ep_rows = self._ep_rows(transform)  # {ep rank: its file} then, each holding its experts' rows
        ranks = range(self.layout.ep) if ep_rows else [0] if transform.replicated else range(self.layout.tp)
        homes = {t: (self._ep_file(t, self.layout.stage_of(first)), tag) if ep_rows else self._home(t, first, tag)
                 for t in ranks}
        entries = {t: f.entry(name) for t, (f, name) in homes.items()}
        if len({e.type for e in entries.values()}) != 1 or entries[0].dtype is None:
            raise InteropError(f"{homes[0][0].path}: {tag} is stored as "
                               f"{', '.join(e.type for e in entries.values())} by the tp ranks: one tensor type expected")
        for t, e in entries.items():
            want = transform.rank_shape(t, len(homes))
            if ep_rows:
                a, b = transform.ep_rows(t, len(homes))
                want = (b - a,) + tuple(want[1:])
            if e.shape != want:
                raise InteropError(f"{homes[t][0].path}: {homes[t][1]} has shape {list(e.shape)}, expected {list(want)}")
        return homes, entries[0].dtype

    def _gather(self, tag: str, transform, parts: list[str], out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The row's canonical tensors, each TP rank's stored bytes read straight into their place (rank 0's
        when replicated): memory is the row itself, plus one rank's shard where TP cuts columns."""
        homes, dtype = self._stored(tag, transform, parts)
        if out is None:
            if self.index[parts[0]].split == "vocab":  # the largest tensor: drop the layers' idle buffers first
                self.memory.release_idle()
            out = [self.memory.empty(shape, dtype) for shape in transform.shapes]
        if self._ep_rows(transform):  # the whole stored tensor from its ep ranks' rows, then its parts
            whole = self.memory.empty(transform.rank_shape(), dtype)
            for e, (f, name) in homes.items():
                a, b = transform.ep_rows(e, len(homes))
                f.read_into(name, [_raw(whole[a:b])])
            for full, stored in transform.pieces(out, whole):
                full.copy_(stored)
            return out
        tp = len(homes)
        for t, (f, name) in homes.items():
            runs = transform.runs(out, t, tp)
            if runs is None:  # columns: one read into a reused buffer and one strided copy, not a read per row
                shard = self.memory.empty(transform.rank_shape(t, tp), dtype)
                f.read_into(name, [_raw(shard)])
                for full, stored in transform.pieces(out, shard, t, tp):
                    full.copy_(stored)
                del shard
            else:
                f.read_into(name, [_raw(x.view(-1)[a:b]) for x, a, b in runs])
        return out

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """`name`'s bytes as (path, offset, bytes) ranges of the rank files, in row-major order, when each
        rank stores its part as runs of whole rows (vocab blocks, q/k/v groups, gate and up, norms): the
        conversion engine then copies them file to file in the kernel.  None for a split on columns."""
        tag, transform, parts, canonical = self._row(name)
        homes, dtype = self._stored(tag, transform, parts)
        full = [torch.empty(shape, dtype=dtype, device="meta") for shape in transform.shapes]
        target, item = full[parts.index(canonical)], dtype.itemsize
        pieces = []  # (first element of the part, last + 1, file, tag, byte position in the stored tensor)
        for t, (f, stored) in homes.items():
            runs = transform.runs(full, t, len(homes))
            if runs is None:
                return None
            pos = 0
            for x, a, b in runs:
                if x is target:
                    pieces.append((a, b, f, stored, pos))
                pos += (b - a) * item
        ranges, at = [], 0
        for a, b, f, stored, pos in sorted(pieces, key=lambda piece: piece[0]):
            if a != at:
                return None
            for offset, n in f.byte_ranges(stored, pos, pos + (b - a) * item):
                if ranges and ranges[-1][0] == f.path and ranges[-1][1] + ranges[-1][2] == offset:
                    ranges[-1] = (f.path, ranges[-1][1], ranges[-1][2] + n)
                else:
                    ranges.append((f.path, offset, n))
            at = b
        return ranges if at == target.numel() else None

    # -- fused rows (interop.engine.fused_plan) ------------------------------------------------
    def fused_row(self, name: str):
        """(transform, canonical names) of the fused MindSpore tensor holding `name`; None for a lone one."""
        prefix = next((p for p in self.prefixes if name.startswith(p)), "")
        row = self.row_of[name[len(prefix):]]
        transform, parts = row.transform, row.parts
        return (transform, [prefix + p for p in parts]) if len(parts) > 1 else None

    def read_fused(self, name: str) -> torch.Tensor:
        """The whole fused tensor holding `name` (as at tp 1) from every TP rank's, never split into parts."""
        prefix = next((p for p in self.prefixes if name.startswith(p)), "")
        row = self.row_of[name[len(prefix):]]
        ms_name, transform, parts = row.key, row.transform, row.parts
        tag = (self.prefixes[prefix] if prefix else "") + self.tag_of[ms_name]
        homes, dtype = self._stored(tag, transform, parts)
        out = self.memory.empty(transform.rank_shape(), dtype)
        for t, (f, stored) in homes.items():  # each rank's rows read straight into their place
            f.read_into(stored, [_raw(out[a:b]) for a, b in transform.fused_rows(t, len(homes))])
        return out

    def close(self) -> None:
        self._cached = (None, None)
        self.memory.release_idle()
        for f in list(self.files.values()) + list(self.ep_files.values()):
            f.close()


def _merge_state(base: dict, scalars: dict) -> dict:
    """interop's recorded state, updated with what the files' own scalars say (they win)."""
    out = dict(base)
    if "iteration" in scalars:
        out["iteration"] = scalars["iteration"]
    for key in ("mindspeed", "megatron"):
        if key in scalars:
            out[key] = {**(out.get(key) or {}), **scalars[key]}
    return out


def _brief(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 12 else f"{layers[:6]} ... {layers[-3:]}"


def _refuse_expert_parallel(f: CkptFile, name: str, spec: ModelSpec) -> None:
    """A MindSpeed rank file of an expert-parallel run numbers only its own experts from 0: say so."""
    marker = ".local_experts."
    if marker not in name:
        return
    stem = name.split(marker)[0] + marker
    held = {t[len(stem):].split(".")[0] for t in f.keys() if t.startswith(stem)}
    if held and len(held) < spec.num_experts and spec.num_experts % len(held) == 0:
        raise InteropError(f"{f.path}: holds {len(held)} of the {spec.num_experts} experts per MoE layer: an "
                           f"expert-parallel (ep={spec.num_experts // len(held)}) MindSpeed checkpoint, which is "
                           "not read yet (only ep 1)")


def _raw(x: torch.Tensor):
    """A contiguous tensor's memory as a writable byte array (numpy has no bfloat16: viewed as bytes)."""
    return x.view(torch.uint8).numpy() if x.dim() else x.reshape(1).view(torch.uint8).numpy()
