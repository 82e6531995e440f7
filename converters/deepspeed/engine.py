"""A DeepSpeed engine checkpoint of a Hugging Face model (the HF Trainer's `checkpoint-N/`) -> canonical tensors.

On disk (transformers/trainer.py `_save_checkpoint` -> deepspeed/runtime/engine.py `save_checkpoint`):

    checkpoint-N/config.json                          the HF model description (save_pretrained)
    checkpoint-N/model.safetensors                    ZeRO 1/2 only: the module's weights (save_model)
    checkpoint-N/latest                               the tag, e.g. `global_step2`
    checkpoint-N/global_step2/mp_rank_00_model_states.pt            ZeRO 0/1/2: `module` (the HF state dict),
                                                      param_shapes, shared_params, ds_config, global_steps
    checkpoint-N/global_step2/zero_pp_rank_D_mp_rank_00_model_states.pt    ZeRO 3: the same per dp rank,
                                                      `module` holding empty placeholders
    checkpoint-N/global_step2/[bf16_]zero_pp_rank_D_mp_rank_00_optim_states.pt   dp rank D's fp32 masters
                                                      and Adam moments (`zero.py`)

ZeRO 1/2 weights come from `module` (the model's own dtype); ZeRO 3 keeps none there, so its weights
are rebuilt from the fp32 master partitions exactly as DeepSpeed's zero_to_fp32.py does.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ...errors import InteropError
from ...io.small_files import read_small_text
from ...hf_named import HFNamedReader, HFNamedState
from ...io.safe_pickle import to_plain
from ...io.small_files import read_json_object
from ...io.torch_file import LazyTorchFile
from ...mappings.hf_config import spec_from_hf_config
from ...tensors import NAME_OF_DTYPE, Source
from .zero import GRADIENT_CLIPPING_DEFAULT, ZeroPartitions, update_rule

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
STAGE3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
MP_ANY = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt")
LAYER_FILE = re.compile(r"layer_\d+(?:-model_\d+)?-model_states\.pt")


def _holds_engine(folder: Path) -> bool:
    return (folder / MODEL_FILE).is_file() or any(STAGE3_MODEL.fullmatch(p.name) for p in folder.iterdir())


def tag_dir(root: Path) -> Path | None:
    """The folder of the engine files: `root` itself, or the one its `latest` names."""
    if _holds_engine(root):
        return root
    latest = root / LATEST
    if latest.is_file():
        tag = read_small_text(latest, "DeepSpeed 'latest' file", 4096).strip()  # a tag name: bounded
        if tag and "/" not in tag and tag not in (".", "..") and (root / tag).is_dir() and _holds_engine(root / tag):
            return root / tag
    return None


def config_file(folder: Path) -> Path | None:
    """The HF config.json beside the tag folder (the Trainer's checkpoint-N) or in it."""
    for candidate in (folder.parent / "config.json", folder / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def detect(path) -> bool:
    """An engine of a non-pipelined module: engine files, no pipeline layer files, an HF config.json."""
    root = Path(path)
    if not root.is_dir():
        return False
    folder = tag_dir(root)
    return (folder is not None and not any(LAYER_FILE.fullmatch(p.name) for p in folder.iterdir())
            and config_file(folder) is not None)


class Reader(HFNamedReader):
    """DeepSpeed's engine files of an HF model, ZeRO stage 0 to 3, fp32 / bf16 / fp16."""

    def __init__(self, path):
        root = Path(path)
        folder = tag_dir(root) if root.is_dir() else None
        if folder is None:
            raise InteropError(f"{root}: not a DeepSpeed engine checkpoint (no {MODEL_FILE} or "
                               "zero_pp_rank_*_mp_rank_00_model_states.pt, here or in the folder `latest` names)")
        self.dir = folder
        config_path = config_file(folder)
        if config_path is None:
            raise InteropError(f"{folder}: no config.json beside the DeepSpeed files (the HF Trainer saves one in "
                               "checkpoint-N/; copy the model's config.json there)")
        others = sorted({int(m.group(1)) for p in folder.iterdir() if (m := MP_ANY.fullmatch(p.name))} - {0})
        if others:
            raise InteropError(f"{folder}: model-parallel rank {others[0]} files: a DeepSpeed engine with tensor "
                               "parallelism over an HF module is not read (its split depends on the injection policy)")
        stage3_files = {int(m.group(1)): folder / p.name for p in folder.iterdir() if (m := STAGE3_MODEL.fullmatch(p.name))}
        optim_files = {int(m.group(1)): folder / p.name for p in folder.iterdir() if (m := OPTIM_FILE.fullmatch(p.name))}
        notes: list[str] = []
        engine_path = folder / MODEL_FILE if (folder / MODEL_FILE).is_file() else stage3_files.get(0)
        if engine_path is None:
            raise InteropError(f"{folder}: zero_pp_rank_0_mp_rank_00_model_states.pt is missing")
        engine = LazyTorchFile(engine_path).obj
        if not isinstance(engine, dict) or not isinstance(engine.get("param_shapes"), list):
            raise InteropError(f"{engine_path}: not a DeepSpeed engine state (no param_shapes)")
        module = engine.get("module")
        if not isinstance(module, dict):
            raise InteropError(f"{engine_path}: `module` is {type(module).__name__}, not a state dict")
        if engine.get("frozen_param_shapes"):
            raise InteropError(f"{engine_path}: frozen parameters (frozen_param_shapes) are not read")
        ranks = sorted(optim_files)
        if ranks != list(range(len(ranks))):
            missing = min(set(range(max(ranks) + 1)) - set(ranks))
            if stage3_files:  # ZeRO 3: the optimizer files hold the only copy of the weights
                raise InteropError(f"{folder}: zero_pp_rank_{missing}_mp_rank_00_optim_states.pt is missing (ZeRO 3 "
                                   "keeps the weights only in the optimizer files)")
            notes.append(f"optimizer state not converted (the ZeRO file of dp rank {missing} is missing); "
                         "weights converted")
            ranks = []
        config = read_json_object(config_path, "HF config")
        self.engine_file = LazyTorchFile(engine_path)
        self.zero = None
        if ranks:

            self.zero = ZeroPartitions([LazyTorchFile(optim_files[d]) for d in ranks], engine["param_shapes"], folder)
        if self.zero is not None and self.zero.stage3:
            if sorted(stage3_files) != ranks:
                raise InteropError(f"{folder}: ZeRO 3 model-state files of ranks {sorted(stage3_files)}, optimizer "
                                   f"files of ranks {ranks}")
            keys = {name: (torch.float32, shape) for name, (shape, _) in self.zero.pieces.items()}
            for name, source in (engine.get("shared_params") or {}).items():
                if source in keys:
                    keys[name] = keys[source]
            self.shared = dict(engine.get("shared_params") or {})
            dtype = "float32"
            notes.append(f"ZeRO 3: weights rebuilt from the fp32 master partitions of {len(ranks)} data-parallel "
                         "ranks (as DeepSpeed's zero_to_fp32.py does)")
        elif stage3_files:
            raise InteropError(f"{folder}: ZeRO 3 model states without their optimizer files "
                               "(zero_pp_rank_*_optim_states.pt hold the only copy of the weights)")
        else:
            keys = {k: (v.dtype, tuple(v.shape)) for k, v in module.items() if isinstance(v, torch.Tensor)}
            self.shared = {}
            floats = [d for d, _ in keys.values() if d.is_floating_point]
            dtype = NAME_OF_DTYPE.get(floats[0]) if floats else None
            if dtype is None:
                raise InteropError(f"{engine_path}: weights stored as {floats[0] if floats else 'nothing'}")
        self.spec = spec_from_hf_config(config, dtype, where=str(config_path))
        moments = self.zero.kinds if self.zero is not None and len(self.zero.kinds) == 3 else ()
        self.state_names = HFNamedState(self.spec, keys, self._fetch, str(folder), moments)
        notes += self.state_names.notes
        if self.zero is None and not optim_files:
            notes.append("optimizer state not converted (no zero_pp_rank_*_optim_states.pt files); weights converted")
        elif moments:
            notes.append(f"converted the ZeRO {'3' if self.zero.stage3 else '1/2'} optimizer state (exp_avg, "
                         f"exp_avg_sq, fp32 masters) over {len(ranks)} data-parallel partitions, step {self.zero.step}")
        else:
            notes.append("optimizer state not converted (the optimizer holds no Adam state yet); weights converted")
        ds_config = to_plain(engine.get("ds_config")) or {}
        state = {"iteration": engine.get("global_steps"), "consumed_samples": to_plain(engine.get("global_samples")),
                 "deepspeed": {"tag": folder.name, "ds_version": to_plain(engine.get("ds_version")),
                               "ds_config": ds_config}}
        if moments:
            opt = ds_config.get("optimizer") or {}
            params = opt.get("params") or {}
            state["optimizer"] = {"type": update_rule(opt), "step": self.zero.step,
                                  "betas": list(params["betas"]) if "betas" in params else None,
                                  "eps": params.get("eps"), "weight_decay": params.get("weight_decay"),
                                  "lr": self.zero.lr,
                                  "clip_grad": ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)}
        if engine.get("lr_scheduler") is not None:
            notes.append("DeepSpeed's lr_scheduler state is not converted")
        self.source = Source(self.spec, None, state, notes)

    def _fetch(self, kind: str, hf_key: str) -> torch.Tensor:
        if kind == "" and not self.zero_weights:
            return self.engine_file.read(self.engine_file.obj["module"][hf_key])
        return self.zero.read(kind or "fp32_param", self.shared.get(hf_key, hf_key))

    @property
    def zero_weights(self) -> bool:
        """Whether the weights are the fp32 masters (ZeRO 3: `module` holds placeholders)."""
        return self.zero is not None and self.zero.stage3

    def dtype_of(self, hf_key: str) -> torch.dtype:
        return torch.float32 if self.zero_weights else self.engine_file.obj["module"][hf_key].dtype
