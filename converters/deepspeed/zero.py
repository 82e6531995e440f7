"""Where each parameter's fp32 master and Adam moments lie in DeepSpeed ZeRO's flat partitions.

The rules are those of DeepSpeed's own consolidation (deepspeed/utils/zero_to_fp32.py, 0.19.8):

- ZeRO 1/2 (`single_partition_of_fp32_groups`, deepspeed/runtime/zero/stage_1_and_2.py; bf16_optimizer.py
  alike): per parameter group, the ranks' partitions concatenated are one flat vector holding the group's
  parameters in `param_shapes` order, each followed by its `param_alignment_paddings` entry when the file
  has them; the vector's tail is padding.
- ZeRO 3 (`fp32_flat_groups`, deepspeed/runtime/zero/stage3.py): every parameter is cut in dp equal pieces
  of ceil(numel / dp) (the last one padded); rank d's piece of each parameter lies in rank d's flat
  sub-groups, concatenated, one parameter after another in the order of `param_shapes` merged over groups.

The Adam moments (`exp_avg`, `exp_avg_sq`) have the shapes of the fp32 groups and lie alike.
Every read takes only the slices it needs from the files.
"""
from __future__ import annotations

import math

import torch

from ...errors import InteropError
from ...io.torch_file import LazyTorchFile

MOMENTS = ("exp_avg", "exp_avg_sq")
# The global gradient norm DeepSpeed clips to when ds_config names none (deepspeed/runtime/constants.py
# GRADIENT_CLIPPING_DEFAULT, 0.19.8): a resumed run must clip alike.
GRADIENT_CLIPPING_DEFAULT = 1.0


def update_rule(optimizer: dict) -> str:
    """The neutral optimizer type of a ds_config `optimizer` section: DeepSpeed's "Adam" is AdamW (decoupled
    weight decay) unless `adam_w_mode` is false (engine.py `_configure_basic_optimizer`, ADAM_W_MODE_DEFAULT);
    without a section the client's optimizer ran (the HF Trainer's: torch AdamW)."""
    kind = str(optimizer.get("type", "adamw")).lower()
    params = optimizer.get("params") or {}
    return "adamw" if kind == "adam" and params.get("adam_w_mode", True) is not False else kind


class ZeroPartitions:
    """fp32 masters and moments by parameter name, from the dp ranks' optimizer files.

    files: rank d's LazyTorchFile.  param_shapes: the engine's (a list of {name: shape} per group)."""

    def __init__(self, files: list[LazyTorchFile], param_shapes: list[dict], where: str):
        self.files, self.where = files, where
        osds = []
        for f in files:
            osd = f.obj.get("optimizer_state_dict") if isinstance(f.obj, dict) else None
            if not isinstance(osd, dict):
                raise InteropError(f"{f.path}: no optimizer_state_dict (not a ZeRO optimizer file)")
            osds.append(osd)
        self.stage3 = "fp32_flat_groups" in osds[0]
        key = "fp32_flat_groups" if self.stage3 else "single_partition_of_fp32_groups"
        if not all(isinstance(o.get(key), list) for o in osds):
            raise InteropError(f"{where}: the optimizer files do not all hold {key}")
        self.flats = {"fp32_param": [o[key] for o in osds]}
        has_moments = True
        for kind in MOMENTS:
            per_rank = []
            for o in osds:
                base = o.get("optimizer_state_dict" if self.stage3 else "base_optimizer_state") or {}
                state = base.get("state") or {}
                groups = [state.get(g, {}).get(kind) for g in range(len(o[key]))]
                has_moments &= all(isinstance(t, torch.Tensor) for t in groups)
                per_rank.append(groups)
            self.flats[kind] = per_rank
        self.kinds = ("exp_avg", "exp_avg_sq", "fp32_param") if has_moments else ("fp32_param",)
        self.step = self._step(osds[0]) if has_moments else 0
        self.lr = self._lr(osds[0])
        dp = len(files)
        self.pieces: dict[str, tuple[torch.Size, list]] = {}  # name -> (shape, [(rank, group, lo, hi)])
        if self.stage3:
            self._place_stage3(param_shapes, dp)
        else:
            self._place_stage12(param_shapes, dp, osds[0].get("param_alignment_paddings"))

    def _step(self, osd: dict) -> int:
        base = osd.get("optimizer_state_dict" if self.stage3 else "base_optimizer_state") or {}
        step = ((base.get("state") or {}).get(0) or {}).get("step", 0)
        if isinstance(step, torch.Tensor):
            step = self.files[0].read(step).item()
        return int(step)

    def _lr(self, osd: dict) -> float | None:
        """The learning rate the optimizer last stepped with (its first param group's), if stated."""
        base = osd.get("optimizer_state_dict" if self.stage3 else "base_optimizer_state") or {}
        groups = base.get("param_groups") or [{}]
        lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
        return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None

    def _place_stage12(self, param_shapes: list[dict], dp: int, paddings) -> None:
        sizes = [t.numel() for t in self.flats["fp32_param"][0]]
        if len(param_shapes) != len(sizes):
            raise InteropError(f"{self.where}: {len(param_shapes)} parameter groups in param_shapes, "
                               f"{len(sizes)} ZeRO fp32 groups")
        for g, (shapes, size) in enumerate(zip(param_shapes, sizes)):
            offset = 0
            for j, (name, shape) in enumerate(shapes.items()):
                shape = torch.Size(shape)
                n = shape.numel()
                spans = []
                for d in range(dp):
                    lo, hi = max(offset, d * size), min(offset + n, (d + 1) * size)
                    if lo < hi:
                        spans.append((d, g, lo - d * size, hi - d * size))
                self.pieces[name] = (shape, spans)
                offset += n + (paddings[g][j] if paddings else 0)
            if offset > size * dp:
                raise InteropError(f"{self.where}: ZeRO group {g} holds {size * dp} elements, its parameters {offset}")

    def _place_stage3(self, param_shapes: list[dict], dp: int) -> None:
        sizes = [t.numel() for t in self.flats["fp32_param"][0]]
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                shape = torch.Size(shape)
                part = math.ceil(shape.numel() / dp)
                spans = []
                for d in range(dp):
                    for g in range(len(sizes)):  # the sub-groups rank d's piece [offset, offset + part) crosses
                        lo, hi = max(offset, bounds[g]), min(offset + part, bounds[g + 1])
                        if lo < hi:
                            spans.append((d, g, lo - bounds[g], hi - bounds[g]))
                self.pieces[name] = (shape, spans)
                offset += part
        if offset != bounds[-1]:
            raise InteropError(f"{self.where}: the ZeRO 3 partitions hold {bounds[-1]} elements per rank, "
                               f"the parameters need {offset}")

    def names(self) -> list[str]:
        return list(self.pieces)

    def read(self, kind: str, name: str) -> torch.Tensor:
        """Parameter `name`'s `kind` (fp32_param, exp_avg, exp_avg_sq), whole, fp32."""
        shape, spans = self.pieces[name]
        flats = self.flats[kind]
        parts = [self.files[d].read(flats[d][g][lo:hi]) for d, g, lo, hi in spans]
        return torch.cat(parts)[:shape.numel()].view(shape)
