"""What a Megatron `torch` checkpoint's rank files hold as the model: each virtual chunk's state dict
(`model`, or `model0..N-1`), flattened to dotted keys with the legacy spellings normalised, the naming
scheme (megatron-core, its Transformer Engine variant, legacy) and how the routed experts are stored; and the
check that every stored tensor is a row of the model's table, with its shard's shape."""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from ...errors import InteropError
from ...mappings.megatron_names import scheme_of
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


def check_tensors(model: "ModelState", ranks: RankFiles, rows, spec: ModelSpec, notes: list[str]) -> None:
    """Every stored tensor is mapped, a tied copy, or reported; shapes agree with the args."""
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
                tied.add("the MTP modules' embedding" if key.startswith("embedding.") else "the tied embedding")
        for (p2, v2, e2, key), row in expected.items():
            if (p2, v2, e2) == (p, v, e) and key not in sd:
                raise InteropError(f"{where}: tensor {key} is missing")
    for why, n in sorted(ignored.items()):
        notes.append(f"ignored {n} entries: {why}")
    for copy in sorted(tied):
        notes.append(f"dropped the last stage's copy of {copy} (it equals the input embedding)")
    if ranks.ep > 1:
        notes.append(f"read the tensors outside the routed experts from expert-parallel rank 0's files (each of the "
                     f"{ranks.ep} EP ranks holds a copy)")
    if model.experts != "sequential":
        notes.append(f"routed experts read from {'the legacy GroupedMLP (weight1/weight2)' if model.experts == 'grouped' else 'TEGroupedMLP (linear_fc1.weightN)'}")
