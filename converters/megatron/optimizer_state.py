"""A Megatron `torch` checkpoint's optimizer state mapped to its parameters: the rank files' own (Adam's moments
beside the weights) or the distributed optimizer's `distrib_optim.pt` buffers, cut per parameter
(`distrib.py` has the buffer layout); with expert parallelism the chained dense and expert optimizers."""
from __future__ import annotations

import math

import torch

from ...errors import InteropError
from ...io.torch_file import LazyTorchFile
from ...spec import ModelSpec
from . import distrib
from .checkpoint import DISTRIB_OPTIM_FILE
from .model_state import ModelState
from .optimizer import EXPERT, KINDS, chained_entry, distrib_hyper, expert_data_parallel, split_experts, unpack
from .rank_files import RankFiles
from .rows import ignored_why


class OptimizerState:
    """`moments` {optim kind: {(t, p, v, e): {key: stored tensor}}} ({} when not converted), `files` the files they
    are read from ({(t, p, e): file}: the rank files, or their distrib_optim.pt), `hyper` the hyperparameters
    and `note` what was converted or why not."""

    def __init__(self, ranks: RankFiles, model: ModelState, rows, spec: ModelSpec, args: dict, first: dict):
        self.ranks, self.model, self.rows, self.spec, self.args = ranks, model, rows, spec, args
        self.moments: dict[str, dict] = {}
        self.files = ranks.ep_files
        self.hyper, self.note = self._load(first)

    def _load(self, first: dict) -> tuple[dict | None, str | None]:
        """Map the optimizer's state to parameters: (hyperparameters, note).

        With expert parallelism, megatron-core's optimizer is a ChainedOptimizer of two (optimizer/__init__.py
        `get_megatron_optimizer`): the dense parameters' and the routed experts' (their own param groups and,
        with the distributed optimizer, their own buffers over the expert-data-parallel group), saved as a list
        of the two state dicts; EP rank e's files hold the experts of that rank (`optimizer.split_experts`).
        At ep 1 the experts are ordinary parameters (`allreduce` True: tensor_parallel/layers.py), one optimizer."""
        distributed = any((self.ranks.dir / d / DISTRIB_OPTIM_FILE).is_file() for d in self.ranks.rank_dirs.values())
        without = [f for f in self.ranks.ep_files.values() if not isinstance(f.obj, dict) or "optimizer" not in f.obj]
        if len(without) == len(self.ranks.ep_files) and not distributed:
            return None, None
        if without:  # some rank files have an optimizer, this one none: all or nothing, and said
            return None, (f"optimizer state not converted ({without[0].path} holds none, other rank files do); "
                          "weights converted")
        found, hyper, expert_groups = {k: {} for k in KINDS}, None, None
        for (t, p, e), f in self.ranks.ep_files.items():
            params = [((v, key), key, tuple(x.shape)) for v in range(len(self.model.chunks[p]))
                      for key, x in self.model.ep_dicts[(t, p, v, e)].items()
                      if isinstance(x, torch.Tensor) and ignored_why(key) is None]
            parts = split_experts(params, e == self.ranks.plan.dense_ep[t]) if self.ranks.ep > 1 else [(None, params)]
            for which, mine in parts:
                if distributed:
                    got = self._distributed(t, p, e, which, mine, f)
                else:
                    saved = chained_entry(f.obj.get("optimizer"), which)
                    got = saved if isinstance(saved, str) else unpack(saved, mine, f.read)
                if isinstance(got, str):
                    return None, f"optimizer state not converted ({f.path}: {got}); weights converted"
                by_param, got_hyper = got
                if which == EXPERT:
                    expert_groups = got_hyper["param_groups"]
                else:
                    hyper = got_hyper
                for (v, key), kinds in by_param.items():
                    for kind, stored in kinds.items():
                        found[kind].setdefault((t, p, v, e), {})[key] = stored
        kinds = [k for k in KINDS if found[k]]
        for kind in kinds:
            for r in self.rows:
                for rank in range((self.ranks.etp if r.ep is not None else self.ranks.tp)):
                    t, e = self.ranks.plan.of(r.ep, rank)
                    if r.transform.reads_back and r.key not in found[kind].get((t, r.stage, r.chunk, e), {}):
                        return None, (f"optimizer state not converted ({self.ranks.ep_files[(t, r.stage, e)].path}: no {kind} "
                                      f"for {r.key}); weights converted")
        self.moments = {k: found[k] for k in kinds}
        if not kinds:
            return None, "optimizer state not converted (the optimizer holds no Adam state yet)"
        if expert_groups is not None:
            hyper = dict(hyper, expert_param_groups=expert_groups)
        how = f" from {DISTRIB_OPTIM_FILE} (distributed optimizer)" if distributed else ""
        experts = " (dense and expert optimizers)" if self.ranks.ep > 1 else ""
        return hyper, f"converted the optimizer state ({', '.join(kinds)}){experts}{how}, step {hyper.get('step')}"

    def _distributed(self, t: int, p: int, e: int, which, params, rank_file) -> tuple[dict, dict] | str:
        """The distributed optimizer's per-parameter state of rank (t, p, e), cut from its `distrib_optim.pt`
        (`distrib.py` has the buffer layout), and the hyperparameters from the rank file.  `which`: None (one
        optimizer), DENSE or EXPERT (the chained optimizer's entries; the experts' buffers are laid out over the
        expert-data-parallel group, one buffer per model chunk holding experts)."""
        path = self.ranks.dir / self.ranks.ep_files[(t, p, e)].path.parent.name / DISTRIB_OPTIM_FILE
        if not path.is_file():
            return f"{DISTRIB_OPTIM_FILE} is missing beside it"
        dfile = self.files.get((t, p, e)) if self.files is not self.ranks.ep_files else None
        dfile = dfile or LazyTorchFile(path)
        state = chained_entry(dfile.obj, which)
        if isinstance(state, str):
            return f"{path.name}: {state}"
        if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
            return f"{path.name} is not megatron-core's coalesced parameter state (buckets_coalesced)"
        args = self.args
        dp = args.get("data_parallel_size")
        if not isinstance(dp, int) or dp < 1:
            return f"the args do not say data_parallel_size, which lays out the buffers of {path.name}"
        if which == EXPERT:
            dp = expert_data_parallel(dp, self.ranks.tp, self.ranks.ep, self.ranks.etp)
            if isinstance(dp, str):
                return dp
        if self.ranks.pp > 1 and self.spec.tied_embeddings:
            return f"{path.name}: a tied embedding over several pipeline stages has a bucket of its own (not supported)"
        if self.files is self.ranks.ep_files:
            self.files = {}
        self.files[(t, p, e)] = dfile
        out = {}
        chunks = [v for v in range(len(self.model.chunks[p])) if any(c == v for (c, _), _, _ in params)]
        if which != EXPERT:
            chunks = list(range(len(self.model.chunks[p])))
        extra = sorted(set(k for k in state if isinstance(k, int)) - set(range(len(chunks))))
        if extra:
            return f"{path.name}: buffer {extra[0]} is beyond the {len(chunks)} model chunks' buffers"
        for g, v in enumerate(chunks):
            mine = [(key, math.prod(shape)) for (c, _), key, shape in params if c == v]
            buffers = state.get(g)
            if not isinstance(buffers, dict) or len(buffers) != 1:
                return f"{path.name}: model chunk {v} has {len(buffers or {})} buffers (one dtype is understood)"
            world = next(iter(buffers.values()))
            buffer = distrib.layout(mine, dp, distrib.bucket_size(args, p, v))
            if world.get("numel_unpadded") != sum(buffer.unpadded):
                return (f"{path.name}: chunk {v} holds {world.get('numel_unpadded')} elements, megatron-core's "
                        f"layout of its parameters at dp {dp} {sum(buffer.unpadded)}")
            offsets = distrib.coalesced_offsets(buffer)
            for theirs in distrib.KINDS:
                have = world.get(theirs)
                need = max((offsets[key] + buffer.slots[key].numel for (c, key), _, _ in params if c == v), default=0)
                if not isinstance(have, torch.Tensor) or have.dim() != 1 or have.numel() < need:
                    got = f"{have.numel():,} elements" if isinstance(have, torch.Tensor) else type(have).__name__
                    raise InteropError(f"{path}: chunk {v}'s {theirs} buffer holds {got}, its parameters need "
                                       f"{need:,}: the file is cut short or damaged")
            for (c, key), _, shape in params:
                if c != v:
                    continue
                first, n = offsets[key], buffer.slots[key].numel
                out[(v, key)] = {ours: world[theirs][first:first + n].view(shape)
                                 for theirs, ours in distrib.KINDS.items()}
        saved = chained_entry(rank_file.obj.get("optimizer"), which)
        return out, distrib_hyper(saved if not isinstance(saved, str) else None)
