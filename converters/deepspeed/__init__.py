"""DeepSpeed checkpoints -> canonical tensors (a source only): one `deepspeed` format, two layouts.

- a pipeline engine (`layer_XX-model_YY-model_states.pt`) of Megatron-DeepSpeed's GPTModelPipe, or of an HF
  model's own modules: `pipeline.py`
- an engine of a Hugging Face module, as the HF Trainer saves it (`checkpoint-N/` with config.json and
  `mp_rank_00_model_states.pt` or ZeRO 3's `zero_pp_rank_D_mp_rank_00_model_states.pt`): `engine.py`,
  ZeRO's partitions in `zero.py`

The Reader picks by what is on disk.
"""
from __future__ import annotations

from ...contract import BaseReader
from ...errors import InteropError
from . import engine, pipeline


def detect(path) -> bool:
    return pipeline.detect(path) or engine.detect(path)


class Reader(BaseReader):
    """The format's reader: opening one gives the reader of the layout on disk, an `engine.Reader` for an HF
    module's engine files, a `pipeline.Reader` otherwise (its errors say what a DeepSpeed checkpoint needs;
    each subclasses `BaseReader` itself)."""

    options = ("model_config", "allow_identical_ranks")  # (allow_identical_ranks: the pipeline layout's tp ranks)

    def __new__(cls, path, model_config=None, allow_identical_ranks: bool | None = None):
        if engine.detect(path):
            if model_config is not None:
                raise InteropError("--model-config does not apply to a DeepSpeed engine checkpoint (its config.json "
                                   "beside describes the model)")
            return engine.Reader(path)
        return pipeline.Reader(path, model_config=model_config, allow_identical_ranks=bool(allow_identical_ranks))
