"""MindSpore's JSON strategy files for MindFormers rank files, as `mindspore.transform_checkpoints` reads them."""
from __future__ import annotations

from ...layout import ParallelLayout
from ...params import param_index
from ...spec import ModelSpec


def stage_strategy(spec: ModelSpec, layout: ParallelLayout, rows, stage: int, index: dict | None = None) -> dict:
    """One pipeline stage's strategy: dev_matrix [tp], tensor_map per dim.

    tensor_map counts devices from the right of dev_matrix: 0 = split over tp, -1 = whole.  `index`: the
    canonical tensors the rows hold (default the model's; a LoRA adapter's are `AdapterSpec.index`).
    """
    index = param_index(spec) if index is None else index
    items = {}
    for row in rows:
        name, transform, parts = row.key, row.transform, row.parts
        param = index[parts[0]]
        if layout.stage_of(param) != stage:
            continue
        ndim = len(transform.rank_shape())  # stacked experts: [E, out, in]
        axis = transform.native_axis
        tensor_map = [0 if (d == axis and layout.tp > 1) else -1 for d in range(ndim)]
        items[name] = {"field": 0, "opt_weight_shard_size": 0, "opt_weight_shard_step": 0,
                       "dev_matrix": [layout.tp], "tensor_map": tensor_map, "param_split_shape": [],
                       "indices_offset": []}
    return {"current_stage": stage, "parallel_strategy_item": {"interop": {"stage": stage}},
            "parallel_layout_item": items}
