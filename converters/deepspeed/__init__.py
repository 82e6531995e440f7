"""DeepSpeed checkpoints -> canonical tensors (a source only): one `deepspeed` format, two layouts.

- a pipeline engine of Megatron-DeepSpeed's GPTModelPipe (`layer_XX-model_YY-model_states.pt`): `pipeline.py`
- an engine of a Hugging Face module, as the HF Trainer saves it (`checkpoint-N/` with config.json and
  `mp_rank_00_model_states.pt` or ZeRO 3's `zero_pp_rank_D_mp_rank_00_model_states.pt`): `engine.py`,
  ZeRO's partitions in `zero.py`

The Reader picks by what is on disk.
"""
from __future__ import annotations

from . import engine, pipeline


def detect(path) -> bool:
    return pipeline.detect(path) or engine.detect(path)


class Reader:
    """The engine reader for an HF module's engine files, the pipeline reader otherwise (its errors say
    what a DeepSpeed checkpoint needs)."""

    def __init__(self, path):
        self.impl = engine.Reader(path) if engine.detect(path) else pipeline.Reader(path)

    def __getattr__(self, name):  # source, spec, metas, read, native_name, close: the chosen reader's
        return getattr(self.impl, name)
