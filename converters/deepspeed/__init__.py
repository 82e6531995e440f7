"""DeepSpeed checkpoints -> canonical tensors (a source only): one `deepspeed` format, two layouts.

- a pipeline engine of Megatron-DeepSpeed's GPTModelPipe (`layer_XX-model_YY-model_states.pt`): `pipeline.py`
- an engine of a Hugging Face module, as the HF Trainer saves it (`checkpoint-N/` with config.json and
  `mp_rank_00_model_states.pt` or ZeRO 3's `zero_pp_rank_D_mp_rank_00_model_states.pt`): `engine.py`,
  ZeRO's partitions in `zero.py`

The Reader picks by what is on disk.
"""
from __future__ import annotations

from ...contract import BaseReader
from . import engine, pipeline


def detect(path) -> bool:
    return pipeline.detect(path) or engine.detect(path)


class Reader(BaseReader):
    """The format's reader: opening one gives the reader of the layout on disk, an `engine.Reader` for an HF
    module's engine files, a `pipeline.Reader` otherwise (its errors say what a DeepSpeed checkpoint needs;
    each subclasses `BaseReader` itself)."""

    options = ("allow_identical_ranks",)  # the pipeline layout's tp ranks (an engine file has no ranks to compare)

    def __new__(cls, path, allow_identical_ranks: bool | None = None):
        if engine.detect(path):
            return engine.Reader(path)
        return pipeline.Reader(path, allow_identical_ranks=bool(allow_identical_ranks))
