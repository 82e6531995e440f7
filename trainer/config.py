"""Training configuration: one flat dataclass, read from a MindSpeed-Core-MS YAML or a Megatron args file.

The YAML has the shape `interop map-args` writes (sections model_config,
training_config, optimizer_config, parallel_config, dataset_config, keys as in the
MindSpeed-Core-MS table); the args file holds Megatron command-line flags
(`--tensor-model-parallel-size 2 --lr 3e-4 ...`), or a launch script, read by `interop.argsfile`.
Only the keys that drive training are read; the model itself comes from the checkpoint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from interop.errors import InteropError
from interop.io.small_files import read_small_text, require_small_file

from .optim import OptimConfig


@dataclass
class TrainConfig:
    load: str | None = None  # checkpoint to start from (common format)
    save: str | None = None  # directory for step_NNNNNN/ checkpoints and metrics.jsonl
    init_spec: str | None = None  # start from fresh random weights for this ModelSpec (YAML/JSON)
    resume: bool = False  # continue from the newest checkpoint in `save` (else `load`)
    tp: int = 1
    pp: int = 1
    first_stage_layers: int | None = None  # uneven pipelines: layers on the first / last stage,
    last_stage_layers: int | None = None  # the rest split evenly (Megatron's decoder_*_pipeline_num_layers)
    dp: int | None = None  # None: 1 when we launch the ranks, world / (tp * pp) under torchrun
    ep: int = 1  # expert parallelism (MoE): experts split over ep data-parallel replicas (dp a multiple of ep)
    steps: int = 10  # length of the run (the lr schedule spans it)
    stop_at: int | None = None  # stop after this update, as if interrupted (saves first when --save)
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # None: micro_batch_size * dp (one micro-batch per step)
    seq_length: int = 32
    data: str | None = None  # .npy / .bin token ids; None: the synthetic stream
    seed: int = 1234
    save_interval: int | None = None
    log_interval: int = 1
    quiet: bool = False  # no per-step lines (parity runs)
    bf16: bool = False
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    decay_steps: int | None = None
    decay_style: str = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    router_bias_update_rate: float = 1e-3  # MoE router expert bias step per update (Megatron's default)
    config_file: str | None = None  # the --config file read, and the model it describes ({ModelSpec field: value}):
    config_model: dict | None = None  # checked against the checkpoint's model, which is the one trained

    def optim(self) -> OptimConfig:
        names = {f.name for f in dataclasses.fields(OptimConfig)}
        return OptimConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# MindSpeed-Core-MS section.key -> TrainConfig field
YAML_KEYS = {
    ("training_config", "seed"): "seed",
    ("training_config", "training_iters"): "steps",
    ("training_config", "save_interval"): "save_interval",
    ("training_config", "log_interval"): "log_interval",
    ("training_config", "load_checkpoint"): "load",
    ("training_config", "output_dir"): "save",
    ("training_config", "bf16"): "bf16",
    ("training_config", "resume_training"): "resume",
    ("optimizer_config", "learning_rate"): "lr",
    ("optimizer_config", "min_lr"): "min_lr",
    ("optimizer_config", "lr_warmup_iters"): "warmup",
    ("optimizer_config", "lr_decay_iters"): "decay_steps",
    ("optimizer_config", "lr_decay_style"): "decay_style",
    ("optimizer_config", "weight_decay"): "weight_decay",
    ("optimizer_config", "eps"): "eps",
    ("optimizer_config", "clip_grad"): "clip_grad",
    ("parallel_config", "tensor_model_parallel_size"): "tp",
    ("parallel_config", "pipeline_model_parallel_size"): "pp",
    ("parallel_config", "expert_model_parallel_size"): "ep",
    ("dataset_config", "batch_size"): "micro_batch_size",
    ("dataset_config", "data_path"): "data",
    ("model_config", "seq_length"): "seq_length",
}

# What each framework assumes when its file does not say (Megatron-LM's argparse defaults;
# the MindSpeed-Core-MS table's defaults), so a file means what it means in its own framework.
MEGATRON_DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "decay_style": "linear",
                     "clip_grad": 1.0, "min_lr": 0.0, "warmup": 0}
MINDSPEED_DEFAULTS = {"lr": 1e-3, "min_lr": 0.0, "warmup": 0, "decay_style": "constant", "weight_decay": 0.0}

# Megatron flag -> TrainConfig field (flags without a value are booleans)
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
    "--expert-model-parallel-size": "ep",
    "--decoder-first-pipeline-num-layers": "first_stage_layers", "--decoder-last-pipeline-num-layers": "last_stage_layers",
    "--micro-batch-size": "micro_batch_size", "--global-batch-size": "global_batch_size",
    "--train-iters": "steps", "--seq-length": "seq_length", "--seed": "seed",
    "--lr": "lr", "--min-lr": "min_lr", "--lr-warmup-iters": "warmup", "--lr-decay-iters": "decay_steps",
    "--lr-decay-style": "decay_style", "--weight-decay": "weight_decay", "--adam-beta1": "beta1",
    "--adam-beta2": "beta2", "--adam-eps": "eps", "--clip-grad": "clip_grad",
    "--moe-router-bias-update-rate": "router_bias_update_rate",
    "--save-interval": "save_interval", "--log-interval": "log_interval",
    "--load": "load", "--save": "save", "--data-path": "data", "--bf16": "bf16",
}


# The model a config file describes (ModelSpec field <- MindSpeed model_config key / Megatron flag).
YAML_MODEL_KEYS = {"num_layers": "num_layers", "hidden_size": "hidden", "ffn_hidden_size": "ffn_hidden",
                   "num_attention_heads": "heads", "num_query_groups": "kv_groups", "vocab_size": "vocab",
                   "max_position_embeddings": "max_positions"}
MEGATRON_MODEL_FLAGS = {"--num-layers": "num_layers", "--hidden-size": "hidden", "--ffn-hidden-size": "ffn_hidden",
                        "--num-attention-heads": "heads", "--num-query-groups": "kv_groups", "--vocab-size": "vocab",
                        "--max-position-embeddings": "max_positions"}


def _config_model(values: dict, gqa: bool | None) -> dict:
    """{ModelSpec field: int} from a file's model keys; query groups count only with grouped-query attention."""
    model = {}
    for field, value in values.items():
        try:
            model[field] = int(value)
        except (TypeError, ValueError):
            continue
    if gqa is None:  # unknown whether the groups count: leave them out
        model.pop("kv_groups", None)
    elif not gqa:  # multi-head attention: one group per head, whatever num_query_groups says
        model.pop("kv_groups", None)
        if "heads" in model:
            model["kv_groups"] = model["heads"]
    return model


def _typed(field: str, value, where: str):
    kind = {f.name: f.type for f in dataclasses.fields(TrainConfig)}[field]
    try:
        if "bool" in kind:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if "int" in kind:
            return int(value)
        if "float" in kind:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise InteropError(f"{where}: {value!r} is not a valid value for {field}") from None


def from_yaml(path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(read_small_text(path, "training config")) or {}
    except (yaml.YAMLError, RecursionError) as exc:
        raise InteropError(f"{path}: cannot read YAML ({exc})") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a mapping of config sections")
    out = dict(MINDSPEED_DEFAULTS)
    for (section, key), field in YAML_KEYS.items():
        value = (data.get(section) or {}).get(key)
        if value is not None and value != "":
            out[field] = _typed(field, value, f"{path}: {section}.{key}")
    betas = (data.get("optimizer_config") or {}).get("betas")
    if betas:
        out["beta1"], out["beta2"] = (float(b) for b in betas)
    clip = out.get("clip_grad")
    if isinstance((data.get("optimizer_config") or {}).get("clip_grad"), dict):
        out["clip_grad"] = float(data["optimizer_config"]["clip_grad"].get("clip_value", clip or 1.0))
    micro_num = (data.get("dataset_config") or {}).get("micro_batch_num")
    if micro_num:
        out["_micro_batch_num"] = int(micro_num)
    model = data.get("model_config") or {}
    gqa = model.get("group_query_attention")
    out["config_model"] = _config_model({f: model.get(k) for k, f in YAML_MODEL_KEYS.items() if model.get(k) is not None},
                                        bool(gqa) if gqa is not None else None)
    return out


def from_args_file(path) -> dict:
    """Megatron flags from an args file or a whole launch script (variables, arrays, continuations)."""
    from interop.argsfile import parse_file
    require_small_file(path, "training config")
    tokens = parse_file(path).tokens
    out, i, model = dict(MEGATRON_DEFAULTS), 0, {}
    while i < len(tokens):
        flag = tokens[i].replace("_", "-") if tokens[i].startswith("--") else tokens[i]
        field = MEGATRON_FLAGS.get(flag)
        has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        if flag in MEGATRON_MODEL_FLAGS and has_value:
            model[MEGATRON_MODEL_FLAGS[flag]] = tokens[i + 1]
        if field == "bf16":
            out[field] = True
        elif field is not None:
            if not has_value:
                raise InteropError(f"{path}: {flag} needs a value")
            out[field] = _typed(field, tokens[i + 1], f"{path}: {flag}")
        i += 2 if has_value else 1
    gqa = any(t.replace("_", "-") == "--group-query-attention" for t in tokens)
    out["config_model"] = _config_model(model, gqa)
    return out


def load_config(path=None, **overrides) -> TrainConfig:
    """Defaults, then the config file (YAML or Megatron args), then explicit overrides (None = not given)."""
    values = {}
    if path is not None:
        suffix = Path(path).suffix
        values = from_yaml(path) if suffix in (".yaml", ".yml") else from_args_file(path)
    micro_num = values.pop("_micro_batch_num", None)
    if path is not None:
        values["config_file"] = str(path)
    cfg = TrainConfig(**values).replace(**overrides)
    if micro_num and cfg.global_batch_size is None:
        cfg.global_batch_size = cfg.micro_batch_size * micro_num * (cfg.dp or 1)
    return cfg
