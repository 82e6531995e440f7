"""PyTorch DCP checkpoints of a Llama-style model -> canonical tensors, and back: two layouts (`LAYOUTS`).

accelerate (`--dcp-layout accelerate`, the default): HF names under `model.`.

On disk (accelerate utils/fsdp_utils.py `save_fsdp_model` / `save_fsdp_optimizer`, FSDP1 and FSDP2 alike):

    out/config.json                                  the HF model description (the Trainer's save_model), or
                                                     --model-config
    out/pytorch_model_fsdp_0/.metadata + __R_0.distcp    `dist_cp.save({"model": state_dict})`: keys
                                                     `model.<HF name>`, each tensor global in the metadata
    out/optimizer_0/.metadata + __R_0.distcp         `{"optimizer": get_optimizer_state_dict(...)}`:
                                                     `optimizer.state.<HF name>.exp_avg|exp_avg_sq|step`,
                                                     `optimizer.param_groups.*` byte objects

torchtitan (`--dcp-layout torchtitan`): its `step-N/` folder, the model's own names at the top level
(`tok_embeddings`, `layers.N.attention.qkv_linear.wq`, ...: `mappings/torchtitan_names.py`) beside
`optimizer.*`, `lr_scheduler`, `dataloader`, `train_state` (torchtitan components/checkpointer/dcp.py);
q / k stored for interleaved rope; its optimizer state flattened per parameter (`optimizer.state.<name>.exp_avg`,
`optimizer.param_groups.<name>.lr`, 0.3's fused `qkv_linear.wqkv` split as its state dict hook splits the
weight).  No description is stored: config.json beside, or --model-config.

As a target: the same layouts (`pytorch_model_fsdp_0/` of `model.<HF name>` global tensors and config.json),
which `torch.distributed.checkpoint.load` reads into an FSDP / FSDP2 model at any data parallelism and
accelerate's `load_fsdp_model` loads; with the source's Adam moments, accelerate's `optimizer_0/` as well
(`OptimizerFolder`: what `set_optimizer_state_dict` of an FSDP2 model's AdamW resumes from).

The DCP files are read and written without a process group (`interop.io.megatron_dist.DcpCheckpoint`).  A Megatron
torch_dist folder (with metadata.json) is not this format.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..contract import BaseWriter
from ..errors import InteropError
from ..hf_named import HFNamedReader, HFNamedState, hf_rows, named_rows
from ..io.megatron_dist import DCP_METADATA, METADATA_JSON, DcpCheckpoint, DistWriter
from ..io.small_files import read_json_object
from ..mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from ..mappings.torchtitan_names import TABLES as TORCHTITAN, WRITTEN as TORCHTITAN_WRITTEN
from ..model_config import spec_from_file
from ..params import MASTER, TensorKey
from ..rows import RowCollector
from ..spec import ModelSpec
from ..state import TrainingState
from ..tensors import NAME_OF_DTYPE, Source, TensorMeta
from ..transforms import GroupedQKV

OPTIM_DIR = "optimizer_0"  # accelerate: beside the model folder
# torchtitan 0.3's attention trains one fused `qkv_linear.wqkv` ([q heads; k; v] per KV head: models/common/
# attention.py `_split_qkv_on_save`) that its state dict hook splits into wq / wk / wv: the optimizer state is the
# fused parameter's
FUSED_QKV = re.compile(r"(.*\.qkv_linear\.)w([qkv])\.(weight|bias)")
OPTIM_PREFIX = "optimizer.state."
EMBEDDING = "embed.word.weight"


@dataclass(frozen=True)
class Layout:
    """Where a DCP layout keeps the model: the folder (None: the checkpoint folder itself), the key prefix,
    what other top-level keys it holds, and its name table (a torchtitan version, or None for HF names)."""

    model_dir: str | None
    prefix: str
    others: tuple[str, ...]
    table: str | None

    def rows(self, spec: ModelSpec) -> list:
        return hf_rows(spec) if self.table is None else named_rows(TORCHTITAN[self.table][0], spec, "torchtitan")

    @property
    def tied_head(self) -> str:
        """The head's name, which a tied model's state dict in torch also holds (FSDP / DCP store it twice)."""
        return "lm_head.weight" if self.table is None else TORCHTITAN[self.table][1]

    def model_keys(self, keys) -> list[str]:
        return [k for k in keys if k.startswith(self.prefix) and not k.startswith(self.others)]


LAYOUTS = {
    "accelerate": Layout("pytorch_model_fsdp_0", "model.", (), None),
    **{f"torchtitan-{v}": Layout(None, "", ("optimizer.", "lr_scheduler", "dataloader", "train_state"), v)
       for v in TORCHTITAN},
}
WRITTEN = {"accelerate": "accelerate", "torchtitan": f"torchtitan-{TORCHTITAN_WRITTEN}"}


def _dcp_folder(root: Path) -> Path | None:
    for folder in (root / LAYOUTS["accelerate"].model_dir, root):
        if (folder / DCP_METADATA).is_file() and not (folder / METADATA_JSON).is_file():
            return folder
    return None


def _layout_of(checkpoint: DcpCheckpoint) -> str | None:
    """The layout whose names the folder holds: HF names all under `model.`, or a torchtitan version's
    embedding and first q."""
    keys = checkpoint.keys()
    if keys and all(k.startswith("model.") for k in keys):
        return "accelerate"
    for name, layout in LAYOUTS.items():
        if layout.table is not None:
            table = TORCHTITAN[layout.table][0]
            if table[0][0] in keys and table[2][0].format(i=0) in keys:
                return name
    return None


def detect(path) -> bool:
    """A DCP folder (not Megatron's torch_dist) in one of the layouts."""
    root = Path(path)
    folder = _dcp_folder(root) if root.is_dir() else None
    if folder is None:
        return False
    try:
        return _layout_of(DcpCheckpoint(folder)) is not None
    except InteropError:
        return False


class Reader(HFNamedReader):
    """A DCP checkpoint in either layout: weights, and AdamW's moments from accelerate's `optimizer_0/`."""

    options = ("model_config",)

    def __init__(self, path, model_config=None):
        root = Path(path)
        folder = _dcp_folder(root) if root.is_dir() else None
        if folder is None:
            raise InteropError(f"{root}: not a PyTorch DCP checkpoint (no .metadata here or in pytorch_model_fsdp_0/)")
        self.model = DcpCheckpoint(folder)
        name = _layout_of(self.model)
        if name is None:
            raise InteropError(f"{folder}: neither accelerate's FSDP layout (keys model.<HF name>) nor torchtitan's "
                               f"(tok_embeddings.weight, layers.0.attention.qkv_linear.wq.weight); keys e.g. "
                               f"{sorted(self.model.keys())[:3]}")
        self.layout = LAYOUTS[name]
        prefix = self.layout.prefix
        keys = {k[len(prefix):]: self.model.meta(k) for k in self.layout.model_keys(self.model.keys())}
        floats = [d for d, _ in keys.values() if d.is_floating_point]
        dtype = NAME_OF_DTYPE.get(floats[0]) if floats else None
        if dtype is None:
            raise InteropError(f"{folder}: weights stored as {floats[0] if floats else 'nothing'}")
        notes = [f"{name} layout"]
        base = folder.parent if folder.name == self.layout.model_dir else folder
        config = next((c for c in (base / "config.json", folder / "config.json") if c.is_file()), None)
        if model_config is not None:
            self.spec = spec_from_file(model_config, dtype)
            notes.append(f"model description taken from {model_config}")
        elif config is not None:
            self.spec = spec_from_hf_config(read_json_object(config, "HF config"), dtype, where=str(config))
        else:
            raise InteropError(f"{folder}: no config.json beside the DCP folder; pass --model-config (an HF "
                               "config.json, a Megatron args file or a MindSpeed YAML)")
        self.optim = None
        moments: tuple[str, ...] = ()
        state: dict = {}
        optim_dir = base / OPTIM_DIR
        self.fused_qkv: dict[str, tuple[str, int]] = {}  # torchtitan: wq/wk/wv -> (its fused wqkv, part)
        if self.layout.table is not None:
            held = {k[len(OPTIM_PREFIX):] for k in self.model.keys() if k.startswith(OPTIM_PREFIX)}
            if held:
                self.optim = self.model
                for key in keys:
                    m = FUSED_QKV.fullmatch(key)
                    if m and f"{m[1]}wqkv.{m[3]}.exp_avg" in held:
                        self.fused_qkv[key] = (f"{m[1]}wqkv.{m[3]}", "qkv".index(m[2]))
                trained = [self._param(k) for k in keys
                           if not (self.spec.tied_embeddings and k == self.layout.tied_head)]
                if dtype != "float32":
                    notes.append(f"optimizer state not converted (weights are {dtype}: the fp32 masters are not "
                                 "in the checkpoint); weights converted")
                elif all(f"{p}.{m}" in held for p in trained for m in ("exp_avg", "exp_avg_sq")):
                    moments = ("exp_avg", "exp_avg_sq", "fp32_param")
                    step = self.model.read(f"{OPTIM_PREFIX}{trained[0]}.step")
                    hyper = self._hyper(f"optimizer.param_groups.{trained[0]}")
                    state["optimizer"] = {"type": hyper.pop("type"), "step": int(step.item()), **hyper}
                    notes.append("converted torchtitan's optimizer state (exp_avg, exp_avg_sq, per parameter; the "
                                 f"fp32 weights are the masters), step {state['optimizer']['step']}")
                else:
                    notes.append("optimizer state not converted (torchtitan's holds no Adam moments for every "
                                 "parameter); weights converted")
        elif (optim_dir / DCP_METADATA).is_file():
            self.optim = DcpCheckpoint(optim_dir)
            held = set(self.optim.keys())
            if dtype != "float32":
                notes.append(f"optimizer state not converted (weights are {dtype}: the fp32 masters are not "
                             "in the checkpoint); weights converted")
            elif all(f"{OPTIM_PREFIX}{k}.{m}" in held for k in keys for m in ("exp_avg", "exp_avg_sq")
                     if not (self.spec.tied_embeddings and k == self.layout.tied_head)):
                moments = ("exp_avg", "exp_avg_sq", "fp32_param")
                step = self.optim.read(f"{OPTIM_PREFIX}{next(iter(keys))}.step")
                hyper = self._hyper("optimizer.param_groups.0")
                state["optimizer"] = {"type": hyper.pop("type"), "step": int(step.item()), **hyper}
                notes.append(f"converted the optimizer state (exp_avg, exp_avg_sq; the fp32 weights are the "
                             f"masters) from {OPTIM_DIR}/, step {state['optimizer']['step']}")
            else:
                notes.append(f"optimizer state not converted ({OPTIM_DIR}/ holds no Adam moments for every "
                             "parameter); weights converted")
        else:
            notes.append(f"optimizer state not converted (no {OPTIM_DIR}/ beside the model); weights converted")
        self.state_names = HFNamedState(self.spec, keys, self._fetch, str(folder), moments,
                                        rows=self.layout.rows(self.spec), tied_head=self.layout.tied_head)
        self.source = Source(self.spec, None, state, notes + self.state_names.notes)

    def _hyper(self, group: str) -> dict:
        """The update rule and lr, betas, eps, weight_decay of param group `group` (accelerate's first group;
        torchtitan flattens one per parameter), byte objects of the optimizer's DCP folder."""
        out = {"type": "adamw"}  # torch's AdamW, unless the group says its weight decay is not decoupled
        for key in ("decoupled_weight_decay", "betas", "eps", "weight_decay", "lr"):
            full = f"{group}.{key}"
            if full in self.optim.objects():
                value = self.optim.read_object(full)
                out[key] = list(value) if isinstance(value, (tuple, list)) else value
        if out.pop("decoupled_weight_decay", True) is False:
            out["type"] = "adam"
        return out

    def _param(self, key: str) -> str:
        """The optimizer's name for the parameter holding `key` (torchtitan 0.3 trains q, k, v fused)."""
        return self.fused_qkv[key][0] if key in self.fused_qkv else key

    def _fetch(self, kind: str, key: str) -> torch.Tensor:
        if kind in ("", "fp32_param"):
            return self.model.read(self.layout.prefix + key)
        if key not in self.fused_qkv:
            return self.optim.read(f"{OPTIM_PREFIX}{key}.{kind}")
        fused, part = self.fused_qkv[key]
        qkv = [self.model.meta(self.layout.prefix + FUSED_QKV.sub(rf"\1w{p}.\3", key))[1] for p in "qkv"]
        return GroupedQKV(qkv, 0, self.spec.kv_groups).split(self.optim.read(f"{OPTIM_PREFIX}{fused}.{kind}"))[part]

    def dtype_of(self, key: str) -> torch.dtype:
        return self.model.meta(self.layout.prefix + key)[0]

    def native_name(self, name: str) -> str:
        return self.layout.prefix + self.state_names.native_name(name)


# torch.optim.AdamW's param-group entries (torch 2.x) beyond lr, betas, eps and weight_decay: the keys
# get_optimizer_state_dict(model, AdamW) has, so that a strict dcp.load into that template finds each
OPTIM_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None}
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}  # torch.optim.AdamW's
DECOUPLED = {"adamw": True, "adam": False}  # the source's update rule -> torch's decoupled_weight_decay
MOMENTS = ("exp_avg", "exp_avg_sq")


class OptimizerFolder:
    """accelerate's `optimizer_0/`: what `dcp.save({"optimizer": get_optimizer_state_dict(model, AdamW)})`
    writes, so that `dcp.load` into that template and `set_optimizer_state_dict` resume the run:
    `optimizer.state.<HF name>.exp_avg|exp_avg_sq` (global fp32), `.step` (a float32 scalar, as torch's Adam
    keeps it), and `optimizer.param_groups.<g>.<entry>` byte objects, `params` the parameters' HF names (a tied
    head has none: torch keeps one state for the shared tensor).  Two groups, as the HF Trainer and Megatron
    make them: 0 decays, 1 (biases and norms: the 1-D parameters) does not; a run with one group loads group
    0's hyperparameters and ignores group 1.  A scheduler's `initial_lr` is written too (a template without
    it ignores it).  FSDP trains the parameters themselves: in an fp32 model the source's fp32 masters are
    the weights and are not stored again."""

    def __init__(self, folder: Path, rows, meta_of: dict):
        self.files = DistWriter(folder)
        self.groups: tuple[list[str], list[str]] = ([], [])  # decay, no decay
        for row in rows:
            shape = row.transform.rank_shape()
            for kind in MOMENTS:
                self.files.declare(self.key(row.key, kind), meta_of[str(TensorKey(row.parts[0], kind))].dtype, shape,
                                   lead=0)
            self.files.declare(self.key(row.key, "step"), torch.float32, (), lead=0)
            self.groups[len(shape) < 2].append(row.key)

    @staticmethod
    def key(hf_name: str, kind: str) -> str:
        return f"{OPTIM_PREFIX}{hf_name}.{kind}"

    def write(self, hf_name: str, kind: str, tensor: torch.Tensor) -> None:
        self.files.write(self.key(hf_name, kind), None, tensor)

    def finish(self, optimizer: dict, step: int, peak_lr=None) -> list[str]:
        """The steps and the param groups (`initial_lr`: the schedule's peak lr, else the lr); returns notes
        for the entries the source did not state."""
        for hf_name in self.groups[0] + self.groups[1]:
            self.files.write(self.key(hf_name, "step"), None, torch.tensor(float(step)))
        group, defaulted = {}, []
        for entry, default in ADAMW_DEFAULTS.items():
            value = optimizer.get(entry)
            if value is None:
                defaulted.append(f"{entry} {default}")
            group[entry] = default if value is None else tuple(value) if entry == "betas" else value
        group.update(OPTIM_FLAGS, decoupled_weight_decay=DECOUPLED[optimizer["type"]],
                     initial_lr=peak_lr or group["lr"])
        for g, (params, decay) in enumerate(zip(self.groups, (group["weight_decay"], 0.0))):
            for entry, value in dict(group, weight_decay=decay, params=params).items():
                self.files.write_pickled(f"optimizer.param_groups.{g}.{entry}", value)
        self.files.write_metadata()
        if not defaulted:
            return []
        return [f"{OPTIM_DIR}/: the source states no {', '.join(d.split()[0] for d in defaulted)}; torch AdamW's "
                f"defaults written ({', '.join(defaulted)})"]

    def abort(self) -> None:
        self.files.abort()


class Writer(BaseWriter):
    """Global tensors in a DCP layout (`dcp_layout`: accelerate, the default, or torchtitan), one file, and
    config.json; a tied model's head stored under its own name too, as torch's state dict has it.  With the
    source's Adam moments, accelerate's layout gets `optimizer_0/` too (`OptimizerFolder`)."""

    options = ("dcp_layout",)

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # HF and torchtitan hold the true vocabulary

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], dcp_layout: str | None = None):
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("a DCP checkpoint holds global tensors (FSDP shards them when it loads): use "
                               "--tp 1 --pp 1 --ep 1")
        if (dcp_layout or "accelerate") not in WRITTEN:
            raise InteropError(f"--dcp-layout {dcp_layout}: not a DCP layout (known: {', '.join(WRITTEN)})")
        self.layout = LAYOUTS[WRITTEN[dcp_layout or "accelerate"]]
        self.root, self.spec = Path(root), spec
        self.config = hf_config_from_spec(spec)  # a model HF cannot describe is refused before anything is written
        meta_of = {m.name: m for m in metas}
        self.files = DistWriter(self.root / self.layout.model_dir if self.layout.model_dir else self.root)
        self.row_of, self.collected = {}, RowCollector()
        rows = self.layout.rows(spec)
        for row in rows:
            self.files.declare(self.layout.prefix + row.key, meta_of[row.parts[0]].dtype, row.transform.rank_shape(),
                               lead=0)
            for p in row.parts:
                self.row_of[p] = row
        self.tied = spec.tied_embeddings
        if self.tied:
            self.files.declare(self.layout.prefix + self.layout.tied_head, meta_of[EMBEDDING].dtype,
                               meta_of[EMBEDDING].shape, lead=0)
        kinds = sorted({key.kind for key in map(TensorKey.parse, meta_of) if key.is_optim})
        moments = all(str(TensorKey(p, k)) in meta_of for row in rows for p in row.parts for k in MOMENTS)
        self.optim = self.masters = None
        self._notes: list[str] = []
        if kinds and moments and self.layout.model_dir is not None:
            self.optim = OptimizerFolder(self.root / OPTIM_DIR, rows, meta_of)
            self.masters = meta_of[EMBEDDING].dtype if MASTER in kinds else None
        elif kinds:
            why = ("torchtitan's layout is written with the model only" if self.layout.model_dir is None else
                   "the source has no Adam moments for every parameter")
            self._notes.append(f"optimizer state not written ({', '.join(kinds)}): {why}")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        key = TensorKey.parse(name)
        if key.is_optim and (self.optim is None or key.kind not in MOMENTS):
            return  # not written: a note says so, or (fp32 masters) the weights are them
        row = self.row_of[key.param]
        parts = self.collected.add((key.kind, row.key), [str(key.of(p)) for p in row.parts], name, tensor)
        if parts is None:
            return
        fused = row.transform.fuse(parts).contiguous()
        if key.is_optim:
            self.optim.write(row.key, key.kind, fused)
            return
        self.files.write(self.layout.prefix + row.key, None, fused)
        if self.tied and name == EMBEDDING:
            self.files.write(self.layout.prefix + self.layout.tied_head, None, tensor.contiguous())

    def finish_units(self, state: dict | None = None) -> dict:
        self.collected.check_done()
        return {}

    def finish_global(self, state: dict | None, results: dict) -> None:
        self.files.write_metadata()
        (self.root / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        if self.optim is not None:
            self._finish_optim(TrainingState.of(state))

    def _finish_optim(self, state: TrainingState) -> None:
        """optimizer_0/ when the source says which Adam and at which step; else it is dropped, with a note."""
        kind, step = state.optimizer.get("type"), state.optimizer.get("step")
        if kind not in DECOUPLED or not isinstance(step, int):
            self.optim.abort()
            shutil.rmtree(self.root / OPTIM_DIR)
            self.optim = None
            why = f"the source's optimizer is {kind}, not Adam" if kind not in DECOUPLED else "it states no step"
            self._notes.append(f"optimizer state not written ({why}); weights written")
            return
        self._notes += self.optim.finish(state.optimizer, step, state.scheduler.get("lr"))
        if self.masters is not None and self.masters != torch.float32:
            self._notes.append(f"fp32 masters not written: FSDP trains the parameters themselves, here the "
                               f"{NAME_OF_DTYPE[self.masters]} weights")

    @property
    def notes(self) -> list[str]:
        return self._notes

    def abort(self) -> None:
        self.files.abort()
        if self.optim is not None:
            self.optim.abort()
