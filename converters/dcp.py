"""PyTorch DCP checkpoints of a Hugging Face model (accelerate's FSDP SHARDED_STATE_DICT) -> canonical tensors.

On disk (accelerate utils/fsdp_utils.py `save_fsdp_model` / `save_fsdp_optimizer`, FSDP1 and FSDP2 alike):

    out/config.json                                  the HF model description (the Trainer's save_model), or
                                                     --model-config
    out/pytorch_model_fsdp_0/.metadata + __R_0.distcp    `dist_cp.save({"model": state_dict})`: keys
                                                     `model.<HF name>`, each tensor global in the metadata
    out/optimizer_0/.metadata + __R_0.distcp         `{"optimizer": get_optimizer_state_dict(...)}`:
                                                     `optimizer.state.<HF name>.exp_avg|exp_avg_sq|step`,
                                                     `optimizer.param_groups.*` byte objects

As a target: the same layout (`pytorch_model_fsdp_0/` of `model.<HF name>` global tensors and config.json),
which `torch.distributed.checkpoint.load` reads into an FSDP / FSDP2 model at any data parallelism and
accelerate's `load_fsdp_model` loads.

The DCP files are read and written without a process group (`interop.io.megatron_dist.DcpCheckpoint`).  A Megatron
torch_dist folder (with metadata.json) is not this format.
"""
from __future__ import annotations

from pathlib import Path

import torch

import json

from ..errors import InteropError
from ..hf_named import HFNamedState, hf_rows
from ..io.megatron_dist import DCP_METADATA, METADATA_JSON, DcpCheckpoint, DistWriter
from ..io.small_files import read_json_object
from ..mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from ..model_config import spec_from_file
from ..params import OPTIM_PREFIXES
from ..spec import ModelSpec
from ..tensors import NAME_OF_DTYPE, Source, TensorMeta

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"
MODEL_PREFIX = "model."  # accelerate: state_dict={"model": ...}
OPTIM_PREFIX = "optimizer.state."
# A tied model's state dict in torch (FSDP's get_model_state_dict, what accelerate saves and loads) names the
# head too: the target stores the embedding under both names, as FSDP itself does.
TIED_HEAD, EMBEDDING = "lm_head.weight", "embed.word.weight"


def _model_dir(root: Path) -> Path | None:
    for folder in (root / MODEL_DIR, root):
        if (folder / DCP_METADATA).is_file() and not (folder / METADATA_JSON).is_file():
            return folder
    return None


def detect(path) -> bool:
    """A DCP folder (not Megatron's torch_dist) whose tensors are all `model.<name>`."""
    root = Path(path)
    folder = _model_dir(root) if root.is_dir() else None
    if folder is None:
        return False
    try:
        keys = DcpCheckpoint(folder).keys()
    except InteropError:
        return False
    return bool(keys) and all(k.startswith(MODEL_PREFIX) for k in keys)


class Reader:
    """accelerate's FSDP DCP checkpoint: weights, and AdamW's moments when `optimizer_0/` is beside."""

    def __init__(self, path, model_config=None):
        root = Path(path)
        folder = _model_dir(root) if root.is_dir() else None
        if folder is None:
            raise InteropError(f"{root}: not a PyTorch DCP checkpoint (no .metadata here or in {MODEL_DIR}/)")
        self.model = DcpCheckpoint(folder)
        stray = [k for k in self.model.keys() if not k.startswith(MODEL_PREFIX)]
        if stray:
            raise InteropError(f"{folder}: {stray[0]} is not under `model.` (accelerate's FSDP layout)")
        keys = {k[len(MODEL_PREFIX):]: self.model.meta(k) for k in self.model.keys()}
        floats = [d for d, _ in keys.values() if d.is_floating_point]
        dtype = NAME_OF_DTYPE.get(floats[0]) if floats else None
        if dtype is None:
            raise InteropError(f"{folder}: weights stored as {floats[0] if floats else 'nothing'}")
        notes = []
        base = folder.parent if folder.name == MODEL_DIR else folder
        if model_config is not None:
            self.spec = spec_from_file(model_config, dtype)
            notes.append(f"model description taken from {model_config}")
        elif (base / "config.json").is_file():
            self.spec = spec_from_hf_config(read_json_object(base / "config.json", "HF config"), dtype,
                                            where=str(base / "config.json"))
        else:
            raise InteropError(f"{folder}: no config.json beside the DCP folder; pass --model-config (an HF "
                               "config.json, a Megatron args file or a MindSpeed YAML)")
        self.optim = None
        optim_dir = base / OPTIM_DIR
        moments: tuple[str, ...] = ()
        state: dict = {}
        if (optim_dir / DCP_METADATA).is_file():
            self.optim = DcpCheckpoint(optim_dir)
            held = set(self.optim.keys())
            if dtype != "float32":
                notes.append(f"optimizer state not converted (weights are {dtype}: the fp32 masters are not "
                             "in the checkpoint); weights converted")
            elif all(f"{OPTIM_PREFIX}{k}.{m}" in held for k in keys for m in ("exp_avg", "exp_avg_sq")):
                moments = ("exp_avg", "exp_avg_sq", "fp32_param")
                step = self.optim.read(f"{OPTIM_PREFIX}{next(iter(keys))}.step")
                state["optimizer"] = {"type": "adamw", "step": int(step.item()), **self._hyper()}
                notes.append(f"converted the optimizer state (exp_avg, exp_avg_sq; the fp32 weights are the "
                             f"masters) from {OPTIM_DIR}/, step {state['optimizer']['step']}")
            else:
                notes.append(f"optimizer state not converted ({OPTIM_DIR}/ holds no Adam moments for every "
                             "parameter); weights converted")
        else:
            notes.append(f"optimizer state not converted (no {OPTIM_DIR}/ beside the model); weights converted")
        self.state_names = HFNamedState(self.spec, keys, self._fetch, str(folder), moments)
        self.source = Source(self.spec, None, state, notes + self.state_names.notes)

    def _hyper(self) -> dict:
        """lr, betas, eps, weight_decay of the first param group (byte objects of the optimizer folder)."""
        out = {}
        for key, name in (("betas", "betas"), ("eps", "eps"), ("weight_decay", "weight_decay"), ("lr", "lr")):
            full = f"optimizer.param_groups.0.{key}"
            if full in self.optim.objects():
                value = self.optim.read_object(full)
                out[name] = list(value) if isinstance(value, (tuple, list)) else value
        return out

    def _fetch(self, kind: str, hf_key: str) -> torch.Tensor:
        if kind in ("", "fp32_param"):
            return self.model.read(MODEL_PREFIX + hf_key)
        return self.optim.read(f"{OPTIM_PREFIX}{hf_key}.{kind}")

    def metas(self):
        return self.state_names.metas(lambda hf_key: self.model.meta(MODEL_PREFIX + hf_key)[0])

    def read(self, name: str) -> torch.Tensor:
        return self.state_names.read(name)

    def native_name(self, name: str) -> str:
        return MODEL_PREFIX + self.state_names.native_name(name)

    def close(self) -> None:
        self.state_names.close()


class Writer:
    """accelerate's FSDP SHARDED_STATE_DICT layout: global tensors under `model.<HF name>`, one file."""

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # HF names hold the true vocabulary

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta]):
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("a DCP checkpoint holds global tensors (FSDP shards them when it loads): use "
                               "--tp 1 --pp 1 --ep 1")
        self.root, self.spec = Path(root), spec
        self.config = hf_config_from_spec(spec)  # a model HF cannot describe is refused before anything is written
        meta_of = {m.name: m for m in metas}
        self.dropped_optim = sorted({m.name.split(".")[1] for m in metas if m.name.startswith(OPTIM_PREFIXES)})
        self.files = DistWriter(self.root / MODEL_DIR)
        self.row_of, self.pending = {}, {}
        for hf_key, transform, parts in hf_rows(spec):
            self.files.declare(MODEL_PREFIX + hf_key, meta_of[parts[0]].dtype, transform.rank_shape(), lead=0)
            for p in parts:
                self.row_of[p] = (hf_key, transform, parts)
        self.tied = spec.tied_embeddings
        if self.tied:
            self.files.declare(MODEL_PREFIX + TIED_HEAD, meta_of[EMBEDDING].dtype, meta_of[EMBEDDING].shape, lead=0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(OPTIM_PREFIXES):  # weights only (a note says so)
            return
        hf_key, transform, parts = self.row_of[name]
        got = self.pending.setdefault(hf_key, {})
        got[name] = tensor
        if len(got) == len(parts):
            del self.pending[hf_key]
            fused = transform.fuse([got[p] for p in parts])
            self.files.write(MODEL_PREFIX + hf_key, None, fused.contiguous())
        if self.tied and name == EMBEDDING:
            self.files.write(MODEL_PREFIX + TIED_HEAD, None, tensor.contiguous())

    def finish(self, state: dict | None = None) -> None:
        self.files.write_metadata()
        (self.root / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")

    @property
    def notes(self) -> list[str]:
        if not self.dropped_optim:
            return []
        return [f"optimizer state not written ({', '.join(self.dropped_optim)}): the DCP target holds the model "
                f"({MODEL_DIR}/) only"]

    def abort(self) -> None:
        self.files.abort()
