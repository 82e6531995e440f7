"""What a Megatron `torch` checkpoint's rank files hold as the model: each virtual chunk's state dict
(`model`, or `model0..N-1`), flattened to dotted keys with the legacy spellings normalised, the naming
scheme (megatron-core, its Transformer Engine variant, legacy) and how the routed experts are stored; and the
check that every stored tensor is a row of the model's table, with its shard's shape."""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from ...distinct_ranks import RankPrint, check_distinct, record_sums
from ...errors import InteropError
from ...mappings.megatron_names import MINDSPEED_LLM_UNREAD, TIED_HEAD, scheme_of
from ...spec import ModelSpec
from .rank_files import RankFiles
from .rows import flatten, ignored_why, legacy_key

_GROUPED_KEY = re.compile(r"\.mlp\.experts\.weight[12]$")
_TE_GROUPED_KEY = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")


class ModelState:
    """`chunks` {stage: [model key per virtual chunk]}, `ep_dicts` {(t, p, v, e): {key: tensor}} of every rank
    file, `state_dicts` {(t, p, v): ...} of the folders the dense tensors are read from, `scheme`, `experts`
    (sequential, te_grouped, grouped) and `moe_norm_apart` (the TE spec's MoE layers keep pre_mlp_layernorm)."""

    def __init__(self, ranks: RankFiles):
        self.chunks = self._model_chunks(ranks)
        self.scheme = self._scheme(ranks)

    def _model_chunks(self, ranks: RankFiles) -> dict[int, list[str]]:
        """{stage: [model key per virtual chunk]}: `model`, or `model0`..`modelN-1`."""
        out = {}
        for p in range(ranks.pp):
            obj = ranks.files[(0, p)].obj
            keys = ["model"] if "model" in obj else sorted((k for k in obj if re.fullmatch(r"model\d+", k)),
                                                         key=lambda k: int(k[5:]))
            if not keys:
                raise InteropError(f"{ranks.files[(0, p)].path}: no model state (no 'model' or 'model0' entry)")
            out[p] = keys
        if len({len(v) for v in out.values()}) != 1:
            raise InteropError(f"{ranks.dir}: pipeline stages hold different numbers of virtual chunks")
        self.ep_dicts = {}
        for (t, p, e), f in ranks.ep_files.items():
            if not isinstance(f.obj, dict):
                raise InteropError(f"{f.path}: expected a dict, found {type(f.obj).__name__}")
            for v, key in enumerate(out[p]):
                sd = f.obj.get(key)
                if not isinstance(sd, dict):
                    raise InteropError(f"{f.path}: entry {key!r} is not a state dict")
                self.ep_dicts[(t, p, v, e)] = flatten(sd)
        self.state_dicts = {(t, p, v): sd for (t, p, v, e), sd in self.ep_dicts.items() if e == ranks.plan.dense_ep[t]}
        return out

    def _scheme(self, ranks: RankFiles) -> str:
        keys = [k for sd in self.state_dicts.values() for k in sd]
        for suffix, why in MINDSPEED_LLM_UNREAD.items():
            if any(k.endswith(suffix) for k in keys):
                raise InteropError(f"{ranks.dir}: {why}")
        scheme = scheme_of(keys)
        if scheme is None:
            raise InteropError(f"{ranks.dir}: neither megatron-core nor legacy parameter names "
                               f"(e.g. {keys[0] if keys else 'no keys at all'})")
        if scheme == "legacy":
            for k, sd in self.ep_dicts.items():
                self.ep_dicts[k] = OrderedDict((legacy_key(n), x) for n, x in sd.items())
            self.state_dicts = {(t, p, v): sd for (t, p, v, e), sd in self.ep_dicts.items() if e == ranks.plan.dense_ep[t]}
        # how the routed experts are stored (the args' moe_grouped_gemm says which module the run built)
        self.experts = "sequential"
        if any(_GROUPED_KEY.search(k) for k in keys):
            self.experts = "grouped"
        elif any(_TE_GROUPED_KEY.search(k) for k in keys):
            self.experts = "te_grouped"
        self.moe_norm_apart = scheme == "mcore_te" and any(k.endswith(".pre_mlp_layernorm.weight") for k in keys)
        return scheme


def shard_of(row, t: int, e: int, ranks: RankFiles) -> tuple[int, int]:
    """(shard, shards) of `row` in folder (t, e): a routed expert's over the expert tp ranks, the rest over tp."""
    return (ranks.plan.folders[(t, e)], ranks.etp) if row.ep is not None else (t, ranks.tp)


def check_tensors(model: "ModelState", ranks: RankFiles, rows, spec: ModelSpec, notes: list[str],
                  compare_tied: bool = True) -> None:
    """Every stored tensor is mapped, a tied copy (`compare_tied`: read and checked equal to the embedding),
    or reported; shapes agree with the args."""
    expected = {}
    for r in rows:
        for e in (range(ranks.ep) if r.ep is None else [r.ep]):
            expected[(r.stage, r.chunk, e, r.key)] = r
    ignored: dict[str, int] = {}
    tied = set()  # the last stage's copies of the embedding: the tied head's, the MTP modules'
    for (t, p, v, e), sd in model.ep_dicts.items():
        where = ranks.ep_files[(t, p, e)].path
        for key, value in sd.items():
            row = expected.get((p, v, e, key))
            if row is None:
                why = ignored_why(key)
                if why is not None and key.endswith("_extra_state") and value is None:
                    why = "empty _extra_state slots (no Transformer Engine / fp8 metadata in them)"
                if why is None and spec.tied_embeddings and key == TIED_HEAD[model.scheme]:
                    raise InteropError(f"{where}: holds an output layer ({key}) but the args say the embedding is "
                                       "tied (untie_embeddings_and_output_weights false): pass --model-config "
                                       "with tie_word_embeddings false to read it")
                if why is None:
                    raise InteropError(f"{where}: tensor {key} does not belong to this {spec.arch} model "
                                       "(args describe a different model?)")
                ignored[why] = ignored.get(why, 0) + 1
                continue
            if not isinstance(value, torch.Tensor):
                raise InteropError(f"{where}: {key} is not a tensor")
            want = row.transform.rank_shape(*shard_of(row, t, e, ranks))
            if tuple(value.shape) != tuple(want):
                raise InteropError(f"{where}: {key} has shape {list(value.shape)}, args imply {list(want)}")
            peer = model.ep_dicts.get((0, p, v, e), {}).get(key)
            if isinstance(peer, torch.Tensor) and value.dtype != peer.dtype:  # its pieces are joined as one
                raise InteropError(f"{where}: {key} is stored as {value.dtype} here, as {peer.dtype} by tp rank 0: "
                                   "one dtype expected")
            if not row.transform.reads_back and e == ranks.plan.dense_ep[t]:
                copy = "the MTP modules' embedding" if key.startswith("embedding.") else "the tied embedding"
                tied.add(copy)
                if compare_tied:
                    _check_tied_copy(model, ranks, rows, (t, p, v, e), key, copy)
        for (p2, v2, e2, key), row in expected.items():
            if (p2, v2, e2) == (p, v, e) and key not in sd:
                raise InteropError(f"{where}: tensor {key} is missing")
    for why, n in sorted(ignored.items()):
        notes.append(f"ignored {n} entries: {why}")
    how = "checked equal to the input embedding" if compare_tied else "compared by the parent process"
    for copy in sorted(tied):
        notes.append(f"dropped the last stage's copy of {copy} ({how})")
    if ranks.ep > 1:
        notes.append(f"read the tensors outside the routed experts from expert-parallel rank 0's files (each of the "
                     f"{ranks.ep} EP ranks holds a copy)")
    if model.experts != "sequential":
        notes.append(f"routed experts read from {'the legacy GroupedMLP (weight1/weight2)' if model.experts == 'grouped' else 'TEGroupedMLP (linear_fc1.weightN)'}")


def _check_tied_copy(model: "ModelState", ranks: RankFiles, rows, at: tuple, key: str, copy: str) -> None:
    """The last stage's copy of a tied embedding, bit for bit the embedding shard of its tp rank: Megatron
    keeps the two equal by an all-reduce, so one that differs is an untied head the args call tied, and
    dropping it would lose the model's head."""
    t, p, v, e = at
    embedding = next(r for r in rows if r.parts == ("embed.word.weight",) and r.transform.reads_back)
    here, there = ranks.ep_files[(t, p, e)], ranks.ep_files[(t, embedding.stage, e)]
    head = here.read(model.ep_dicts[at][key])
    word = there.read(model.ep_dicts[(t, embedding.stage, embedding.chunk, e)][embedding.key])
    if head.shape != word.shape or head.dtype != word.dtype or not torch.equal(
            head.contiguous().view(torch.uint8), word.contiguous().view(torch.uint8)):
        if copy != "the tied embedding":
            raise InteropError(f"{here.path}: {key}, the last stage's copy of {copy}, differs from "
                               f"{embedding.key} in {there.path}: megatron-core keeps the two equal")
        raise InteropError(f"{here.path}: {key}, the last stage's copy of the tied embedding, differs from "
                           f"{embedding.key} in {there.path}: the head is not tied (pass --model-config with "
                           "tie_word_embeddings false to read it as the output layer)")


def check_distinct_ranks(model: "ModelState", ranks: RankFiles, rows, notes: list[str], allow: bool) -> None:
    """No rank file is a copy of another (`interop.distinct_ranks`, by the records' CRC-32s in the zip
    directories: nothing read): the tensor-parallel ranks of a stage by their split dense tensors, the
    expert-parallel ranks holding one expert tp shard by their routed experts.  `allow`: --allow-identical-ranks."""
    split = {(r.stage, r.chunk, r.key) for r in rows if r.ep is None and r.transform.reads_back
             and not r.transform.replicated}
    experts = {(r.stage, r.chunk, r.ep, r.key) for r in rows if r.ep is not None and r.transform.reads_back}
    groups: dict[tuple, list[RankPrint]] = {}
    for (t, p, v, e), sd in model.ep_dicts.items():
        f = ranks.ep_files[(t, p, e)]
        if ranks.tp > 1 and e == ranks.plan.dense_ep[t]:
            sums = record_sums(f, ((k, x) for k, x in sd.items() if (p, v, k) in split))
            groups.setdefault(("tp", p, v), []).append(
                RankPrint(str(f.path), f"tensor-parallel rank {t}", sums, f"every split tensor ({len(sums or ())})"))
        if ranks.ep > 1:
            sums = record_sums(f, ((k, x) for k, x in sd.items() if (p, v, e, k) in experts))
            groups.setdefault(("ep", p, v, ranks.plan.folders[(t, e)]), []).append(
                RankPrint(str(f.path), f"expert-parallel rank {e}", sums, f"every routed expert ({len(sums or ())})"))
    for key in sorted(groups):
        check_distinct(sorted(groups[key], key=lambda m: m.path), notes, allow)
