"""MindSpore `.ckpt` checkpoints (MindSpeed-Core-MS or MindFormers names) <-> canonical tensors.

The dialects, one class each in `dialects.py` (name tables in `interop.mappings.mindspore_names`):

  mindspeed          what MindSpeed-Core-MS r0.1.0 training loads: `rank_{r}/network.ckpt` per global rank
                     (tools/converter/convert_pt2ckpt.py's layout), the model's parameter names, Adam moments
                     as `exp_avg.<name>`, step / epoch / optimizer / scheduler scalars beside the tensors.
  mindformers        one `model.ckpt`, or with tp/pp > 1 `rank_N/checkpoint_N.ckpt` plus `strategy/` JSON
                     files, as `mindspore.transform_checkpoints` reads them.
  mindformers-mcore  MindFormers' mcore-style models (qwen3, qwen3_moe): Megatron-core's names, the same files.

Files are written and read with `interop.io.ms_ckpt`: no mindspore needed, one tensor at a time.
"""
from .files import detect
from .reader import Reader
from .writer import Writer

__all__ = ["Reader", "Writer", "detect"]
