"""MindSpore's JSON strategy files for MindFormers rank files, as `mindspore.transform_checkpoints` reads them."""
from __future__ import annotations

from ...layout import ParallelLayout
from ...params import param_index
from ...spec import ModelSpec


def stage_strategy(spec: ModelSpec, layout: ParallelLayout, rows, stage: int, index: dict | None = None,
                   dp: int = 1, ep_rows: bool = False) -> dict:
    """One pipeline stage's strategy: dev_matrix [tp] ([dp, tp] over dp data-parallel ranks' files), tensor_map
    per dim.

    tensor_map counts devices from the right of dev_matrix: 0 = split over tp, -1 = whole.  `index`: the
    canonical tensors the rows hold (default the model's; a LoRA adapter's are `AdapterSpec.index`).
    `ep_rows` (MindFormers' mcore-style MoE at ep > 1): a stacked experts tensor's rows are cut over the ep axis
    of dev_matrix [dp * tp / ep, ep] (its moe/ffn.py layout ("ep", None) on device_matrix.py's MoE layout).
    """
    index = param_index(spec) if index is None else index
    devices = [layout.tp] if dp == 1 else [dp, layout.tp]
    items = {}
    for row in rows:
        name, transform, parts = row.key, row.transform, row.parts
        param = index[parts[0]]
        if layout.stage_of(param) != stage:
            continue
        ndim = len(transform.rank_shape())  # stacked experts: [E, out, in]
        axis = transform.native_axis
        matrix = devices
        tensor_map = [0 if (d == axis and layout.tp > 1) else -1 for d in range(ndim)]
        if ep_rows and transform.every_expert and layout.ep > 1:
            matrix, tensor_map = [dp * layout.tp // layout.ep, layout.ep], [0] + [-1] * (ndim - 1)
        items[name] = {"field": 0, "opt_weight_shard_size": 0, "opt_weight_shard_step": 0,
                       "dev_matrix": matrix, "tensor_map": tensor_map, "param_split_shape": [],
                       "indices_offset": []}
    return {"current_stage": stage, "parallel_strategy_item": {"interop": {"stage": stage}},
            "parallel_layout_item": items}
