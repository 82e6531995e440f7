"""One torch.save file of an HF model's state dict -> canonical tensors (a source only).

What training systems write when asked for one consolidated file: accelerate's FSDP FULL_STATE_DICT
(`pytorch_model_fsdp.bin`, accelerate utils/fsdp_utils.py `save_fsdp_model`), ColossalAI's unsharded
`booster.save_model(model, "model.pt")` (colossalai/checkpoint_io/general_checkpoint_io.py), a plain
`torch.save(model.state_dict(), ...)`.  The file names no model, so the description comes from
`--model-config` or a `config.json` beside the file.  The pickle is read safely with tensors left on
disk (`interop.io.torch_file.LazyTorchFile`).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from ..errors import InteropError
from ..hf_named import HFNamedReader, HFNamedState
from ..io.small_files import read_json_object
from ..io.torch_file import LazyTorchFile
from ..mappings.hf_config import spec_from_hf_config
from ..model_config import spec_from_file
from ..tensors import NAME_OF_DTYPE, Source

SUFFIXES = (".bin", ".pt", ".pth")


def detect(path) -> bool:
    """A torch.save zip file (not a folder) with a state-dict suffix."""
    path = Path(path)
    return path.is_file() and path.suffix in SUFFIXES and zipfile.is_zipfile(path)


# colossalai/legacy/utils/checkpointing.py `save_checkpoint`: {"epoch", "model", "optimizer", "lr_scheduler"}, the
# model of ColossalAI's legacy model_zoo GPT (`embedding.`, `blocks.N.`, `norm.`, `head.`).
LEGACY_COLOSSALAI_KEYS = {"epoch", "model"}
LEGACY_GPT_PREFIXES = ("embedding.", "blocks.", "norm.", "head.")


def _refuse_legacy_colossalai(sd: dict, path: Path) -> None:
    """One line for ColossalAI's legacy pipeline checkpoint (the seed's hybrid-parallel GPT): it cannot be read
    whole, because its stages overwrite each other in the file."""
    model = sd.get("model")
    if LEGACY_COLOSSALAI_KEYS <= set(sd) and isinstance(model, dict) and model and \
            all(str(k).startswith(LEGACY_GPT_PREFIXES) for k in model):
        raise InteropError(
            f"{path}: a ColossalAI legacy save_checkpoint of its model_zoo GPT, not read: each pipeline stage numbers "
            "its blocks from 0 (PipelineGPTHybrid's blocks ModuleList) and gather_pipeline_parallel_state_dict merges "
            "the stages' dicts, so a later stage's blocks.N overwrote the earlier ones' and the file does not hold "
            "the whole model (at pp 1 it would, but its model_zoo names are not mapped either)")


class Reader(HFNamedReader):
    """A flat {HF name: tensor} torch.save file."""

    options = ("model_config",)

    def __init__(self, path, model_config=None):
        path = Path(path)
        if not detect(path):
            raise InteropError(f"{path}: not a torch.save file of a state dict (a .bin / .pt / .pth zip file)")
        self.file = LazyTorchFile(path)
        sd = self.file.obj
        if not isinstance(sd, dict) or not sd:
            raise InteropError(f"{path}: holds {type(sd).__name__}, not a state dict of tensors")
        _refuse_legacy_colossalai(sd, path)
        others = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        if others:
            raise InteropError(f"{path}: {others[0]!r} is not a tensor (a training-state file, not a model's "
                               "state dict of HF names)")
        keys = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
        floats = [d for d, _ in keys.values() if d.is_floating_point]
        dtype = NAME_OF_DTYPE.get(floats[0]) if floats else None
        if dtype is None:
            raise InteropError(f"{path}: weights stored as {floats[0] if floats else 'nothing'}")
        notes = []
        if model_config is not None:
            self.spec = spec_from_file(model_config, dtype)
            notes.append(f"model description taken from {model_config}")
        elif (path.parent / "config.json").is_file():
            self.spec = spec_from_hf_config(read_json_object(path.parent / "config.json", "HF config"), dtype,
                                            where=str(path.parent / "config.json"))
            notes.append(f"model description taken from {path.parent / 'config.json'}")
        else:
            raise InteropError(f"{path}: a state dict names no model: pass --model-config (an HF config.json, a "
                               "Megatron args file or a MindSpeed YAML)")
        self.state_names = HFNamedState(self.spec, keys, self._fetch, str(path))
        self.source = Source(self.spec, None, {}, notes + self.state_names.notes)

    def _fetch(self, kind: str, hf_key: str) -> torch.Tensor:
        return self.file.read(self.file.obj[hf_key])

    def dtype_of(self, hf_key: str) -> torch.dtype:
        return self.file.obj[hf_key].dtype
