"""ATorch FSDP's streaming checkpoint -> canonical tensors (a source only).

What ATorch's trainer writes with `save_by_streaming` (atorch/trainer/atorch_trainer.py, atorch 0.2.5:
`checkpoint-N/streaming_ckpt/`, STREAMING_CKPT_DIR): `save_fsdp_flat_param` and `save_fsdp_optim_param`'s files,
one per data-parallel rank (`streaming.py` says what each holds).  The model's parameters keep their HF names
(FSDP with `use_orig_params` around an HF model), so the name table is HF's; the folder names no model, so the
description is a `config.json` in the folder or beside it, or `--model-config`.  Each parameter is cut out of
the flat shards by its offsets, as ATorch's `ConvertFlatParam` does (the fixtures' reference).  The optimizer
state (Adam's moments, the fp32 weights their masters) is carried when the weights are fp32.

ATorch's DS 3D checkpoints (DeepSpeed PipelineModule) are DeepSpeed's format: `--from deepspeed`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import InteropError
from ...hf_named import HFNamedReader, HFNamedState
from ...io.small_files import read_json_object
from ...mappings.hf_config import spec_from_hf_config
from ...model_config import spec_from_file
from ...tensors import NAME_OF_DTYPE, Source
from .streaming import FlatShards, OptimShards, missing_ranks, rank_files

CKPT_DIR = "streaming_ckpt"  # atorch/trainer/atorch_trainer.py STREAMING_CKPT_DIR


def _folder(root: Path) -> Path | None:
    """The folder holding flat_param files: `root` itself or its `streaming_ckpt/`."""
    for folder in (root, root / CKPT_DIR):
        if folder.is_dir() and any(p.name.startswith("flat_param.") for p in folder.iterdir()):
            return folder
    return None


def detect(path) -> bool:
    """A folder (or its streaming_ckpt/) with ATorch's flat_param.RRRRR-WWWWW and flat_meta files."""
    root = Path(path)
    folder = _folder(root) if root.is_dir() else None
    if folder is None:
        return False
    try:
        return bool(rank_files(folder)[0].get("flat_meta"))
    except InteropError:
        return False


class Reader(HFNamedReader):
    """Weights from the flat shards; Adam's moments from `optim_param.*` when the weights are fp32."""

    options = ("model_config",)

    def __init__(self, path, model_config=None):
        root = Path(path)
        folder = _folder(root) if root.is_dir() else None
        if folder is None:
            raise InteropError(f"{root}: not an ATorch streaming checkpoint (no flat_param.* files here or in "
                               f"{CKPT_DIR}/)")
        files, world = rank_files(folder)
        self.flat = FlatShards(folder, files)
        dtype = NAME_OF_DTYPE.get(self.flat.dtype)
        if dtype is None or not self.flat.dtype.is_floating_point:
            raise InteropError(f"{folder}: flat parameters stored as {self.flat.dtype}")
        notes = [f"ATorch FSDP streaming checkpoint: {self.flat.world} ranks' flat shards"]
        config = next((c for c in (folder / "config.json", folder.parent / "config.json") if c.is_file()), None)
        if model_config is not None:
            self.spec = spec_from_file(model_config, dtype)
            notes.append(f"model description taken from {model_config}")
        elif config is not None:
            self.spec = spec_from_hf_config(read_json_object(config, "HF config"), dtype, where=str(config))
            notes.append(f"model description taken from {config}")
        else:
            raise InteropError(f"{folder}: no config.json in or beside the folder (ATorch's streaming save writes "
                               "none); pass --model-config (an HF config.json, a Megatron args file or a MindSpeed "
                               "YAML)")
        keys = {name: (self.flat.dtype, shape) for name, shape in self.flat.shapes.items()}
        self.optim, moments, state = None, (), {}
        lost = missing_ranks(files.get("optim_param", {}), world)
        if "optim_param" in files and lost:
            notes.append(f"optimizer state not converted (optim_param files of ranks {lost} are missing); weights "
                         "converted")
        elif "optim_param" in files:
            self.optim = OptimShards(folder, files["optim_param"], self.flat.shapes)
            if not self.optim.holds_moments():
                notes.append("optimizer state not converted (optim_param files hold no whole exp_avg and "
                             "exp_avg_sq for every parameter); weights converted")
            elif self.flat.dtype != torch.float32 or self.optim.dtype() != torch.float32:
                notes.append(f"optimizer state not converted (weights {dtype}, moments "
                             f"{NAME_OF_DTYPE.get(self.optim.dtype())}: no fp32 masters in the checkpoint); "
                             "weights converted")
            else:
                moments = ("exp_avg", "exp_avg_sq", "fp32_param")
                state["optimizer"] = {"type": "adamw", "step": self.optim.step(), **self.optim.hyper()}
                notes.append(f"converted the optimizer state (exp_avg, exp_avg_sq; the fp32 weights are the "
                             f"masters), step {state['optimizer']['step']}")
        else:
            notes.append("optimizer state not converted (no optim_param files: save_fsdp_optim_param was not "
                         "called); weights converted")
        self.state_names = HFNamedState(self.spec, keys, self._fetch, str(folder), moments)
        self.source = Source(self.spec, None, state, notes + self.state_names.notes,
                             unchecked="ATorch's flat_param / optim_param safetensors files")

    def _fetch(self, kind: str, name: str) -> torch.Tensor:
        if kind in ("", "fp32_param"):
            return self.flat.read(name)
        return self.optim.read(name, kind)

    def dtype_of(self, name: str) -> torch.dtype:
        return self.flat.dtype  # one flat dtype for every parameter

    def close(self) -> None:
        super().close()
        self.flat.close()
        if self.optim is not None:
            self.optim.close()
