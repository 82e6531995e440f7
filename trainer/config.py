"""Training configuration: one flat dataclass, read from any config file `interop map-args` reads.

A MindSpeed-Core-MS YAML (the shape `interop map-args` writes), a Megatron args file or launch
script (`--tensor-model-parallel-size 2 --lr 3e-4 ...`), ...: map-args' loaders read it into
Megatron's arguments (each format's keys are mapped once, in `mappings/`), and `RUN_ARGS` picks
the ones that drive training.  The model itself comes from the checkpoint; the model the file
describes is only checked against it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from interop.errors import InteropError
from interop.io.small_files import require_small_file

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
    mtp_loss_scaling_factor: float | None = None  # the MTP modules' loss weight; None: the model's (mtp_loss_weight)
    # LoRA (interop.adapter): train an adapter on the frozen base, starting from `adapter` (a common-format adapter)
    # or fresh (drawn from `seed`) with rank / alpha / targets (canonical `attn.q,attn.v` or Megatron's `linear_qkv`)
    adapter: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    lora_dropout: float = 0.0
    # q/k/v (gate/up) share one A, as a LoRA on Megatron's fused linear_qkv / GPT2's c_attn; None: as the adapter
    # resumed or given says (its `shared_a`), separate for a fresh one
    lora_shared_a: bool | None = None
    config_file: str | None = None  # the --config file read, and the model it describes ({ModelSpec field: value}):
    config_model: dict | None = None  # checked against the checkpoint's model, which is the one trained

    def optim(self) -> OptimConfig:
        names = {f.name for f in dataclasses.fields(OptimConfig)}
        return OptimConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def trained_spec(self, spec):
        """The model as this run trains it: the MTP loss weight overridden where the run gives one (Megatron's
        --mtp-loss-scaling-factor is a training argument; 0 trains the model as if it had no MTP modules)."""
        if self.mtp_loss_scaling_factor is None or not spec.mtp_layers:
            return spec
        return spec.replace(mtp_loss_weight=self.mtp_loss_scaling_factor)


# TrainConfig field <- Megatron argument (dest).  A config file is read into Megatron's terms by map-args'
# own loaders (`interop.mapargs.load`: a MindSpeed-Core-MS / MindFormers YAML through its table, with that
# framework's defaults; a Megatron args file or launch script through Megatron's flags), so each format's
# keys are mapped once, in `mappings/`.
RUN_ARGS = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "expert_model_parallel_size": "ep",
    "decoder_first_pipeline_num_layers": "first_stage_layers", "decoder_last_pipeline_num_layers": "last_stage_layers",
    "micro_batch_size": "micro_batch_size", "global_batch_size": "global_batch_size", "train_iters": "steps",
    "seq_length": "seq_length", "seed": "seed", "lr": "lr", "min_lr": "min_lr", "lr_warmup_iters": "warmup",
    "lr_decay_iters": "decay_steps", "lr_decay_style": "decay_style", "weight_decay": "weight_decay",
    "adam_beta1": "beta1", "adam_beta2": "beta2", "adam_eps": "eps", "clip_grad": "clip_grad",
    "moe_router_bias_update_rate": "router_bias_update_rate", "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
    "save_interval": "save_interval", "log_interval": "log_interval", "load": "load", "save": "save",
    "data_path": "data", "bf16": "bf16", "resume_training": "resume",
    "lora_r": "lora_rank", "lora_alpha": "lora_alpha", "lora_target_modules": "lora_targets",
    "lora_dropout": "lora_dropout", "lora_load": "adapter",
}
# The trainer's own YAML key for its token file (MindSpeed-Core-MS's table has no data path).
YAML_DATA_KEY = "dataset_config.data_path"
# The model a config file describes, as ModelSpec fields (checked against the checkpoint's).
MODEL_FIELDS = ("num_layers", "hidden", "ffn_hidden", "heads", "kv_groups", "vocab", "max_positions")


def _megatron_defaults() -> dict:
    """Megatron-LM's defaults for the update rule (its argparse's), for an args file that does not say."""
    from interop.mappings import megatron_args as M
    optim = {f.name for f in dataclasses.fields(OptimConfig)}
    return {field: M.ARGS[dest].default for dest, field in RUN_ARGS.items()
            if field in optim and M.ARGS[dest].default is not None}


def _config_model(explicit: dict, fmt: str) -> dict:
    """{ModelSpec field: int} the file states; query groups count only with grouped-query attention."""
    from interop.mapargs import MINDSPORE_FAMILY
    from interop.mappings.megatron_spec import SPEC_NUMBERS
    values = {field: explicit.get(SPEC_NUMBERS[field]) for field in MODEL_FIELDS}
    if values["vocab"] is None:  # MindSpeed's model_config.vocab_size is the padded size: either one matches
        values["vocab"] = explicit.get("padded_vocab_size")
    if fmt in MINDSPORE_FAMILY:  # their seq_length sizes the position table: the run's length, not the model's
        values.pop("max_positions")
    model = {}
    for field, value in values.items():
        try:
            model[field] = int(value)
        except (TypeError, ValueError):
            continue
    gqa = explicit.get("group_query_attention")
    if gqa is None:  # unknown whether the groups count: leave them out
        model.pop("kv_groups", None)
    elif not gqa:  # multi-head attention: one group per head, whatever num_query_groups says
        model.pop("kv_groups", None)
        if "heads" in model:
            model["kv_groups"] = model["heads"]
    return model


def _typed(field: str, value, where: str):
    kind = {f.name: f.type for f in dataclasses.fields(TrainConfig)}[field]
    if field == "lora_targets" and isinstance(value, list):  # --lora-target-modules: the modules, one by one
        value = ",".join(map(str, value))
    if field == "data" and isinstance(value, list):  # Megatron's --data-path is a list (a weighted blend)
        if len(value) != 1:
            raise InteropError(f"{where}: the trainer reads one token file, got {len(value)}: {value}")
        value = value[0]
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


def from_file(path) -> dict:
    """TrainConfig values (and the model described) from any config file map-args reads."""
    from interop import mapargs
    require_small_file(path, "training config")
    source = mapargs.load(path)
    explicit = dict(source.explicit)
    if source.format in mapargs.YAML_TARGETS:
        data = {e.flag: e.value for e in source.entries}.get(YAML_DATA_KEY)
        if data is not None:
            explicit["data_path"] = data
    out = _megatron_defaults() if source.format == "megatron" else {}
    from interop.mappings import megatron_args as M
    for dest in ("lora_r", "lora_alpha"):  # MindSpeed-LLM's defaults for a LoRA run (--lora-target-modules given)
        if explicit.get("lora_target_modules") and explicit.get(dest) is None:
            explicit[dest] = M.ARGS[dest].default
    for dest, field in RUN_ARGS.items():
        value = explicit.get(dest)
        if value is not None and value != "":
            out[field] = _typed(field, value, f"{path}: {dest}")
    modules = explicit.get("lora_target_modules") or []
    modules = modules if isinstance(modules, list) else str(modules).replace(",", " ").split()
    if source.format == "megatron" and {"linear_qkv", "linear_fc1"} & set(map(str, modules)):
        out["lora_shared_a"] = True  # MindSpeed-LLM's LoRA on megatron-core's fused linears: one A per linear
    if explicit.get("micro_batch_num"):
        out["_micro_batch_num"] = int(explicit["micro_batch_num"])
    out["config_model"] = _config_model(explicit, source.format)
    return out


def load_config(path=None, **overrides) -> TrainConfig:
    """Defaults, then the config file (YAML or Megatron args), then explicit overrides (None = not given)."""
    values = {}
    if path is not None:
        values = from_file(path)
    micro_num = values.pop("_micro_batch_num", None)
    if path is not None:
        values["config_file"] = str(path)
    cfg = TrainConfig(**values).replace(**overrides)
    if micro_num and cfg.global_batch_size is None:
        cfg.global_batch_size = cfg.micro_batch_size * micro_num * (cfg.dp or 1)
    check(cfg)
    return cfg


MAX_SEQ_LENGTH = 16384  # the reference trainer materialises attention: seq_length^2 scores per head
# field -> (smallest allowed, largest allowed or None), for the counts and sizes a run is built from
COUNTS = {"steps": (1, None), "micro_batch_size": (1, None), "global_batch_size": (1, None),
          "seq_length": (1, MAX_SEQ_LENGTH), "stop_at": (1, None), "tp": (1, None), "pp": (1, None), "dp": (1, None),
          "ep": (1, None), "save_interval": (1, None), "log_interval": (1, None), "warmup": (0, None),
          "decay_steps": (0, None), "lora_rank": (1, None)}  # uneven-pipeline layer counts: checked with the layout
# field -> (smallest allowed, below this) for the optimizer's numbers: finite, and where they make sense
REALS = {"lr": (0.0, math.inf), "min_lr": (0.0, math.inf), "weight_decay": (0.0, math.inf), "clip_grad": (0.0, math.inf),
         "beta1": (0.0, 1.0), "beta2": (0.0, 1.0), "eps": (0.0, math.inf), "router_bias_update_rate": (0.0, math.inf),
         "lora_dropout": (0.0, 1.0), "mtp_loss_scaling_factor": (0.0, math.inf)}


def check(cfg: TrainConfig) -> None:
    """Checked at the door, before any work: a count below its least (`--steps 0`, `--stop-at -1`), a length
    past what the trainer can hold, or a NaN / Inf / negative rate is one line naming the value."""
    for name, (least, most) in COUNTS.items():
        value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if value < least:
            kind = "a positive integer" if least == 1 else "an integer >= 0"
            raise InteropError(f"{flag} must be {kind}, got {value}")
        if most is not None and value > most:
            raise InteropError(f"{flag} {value}: more than {most:,}, the most the reference trainer runs "
                               "(attention is materialised, seq_length^2 per head)")
    for name, (least, below) in REALS.items():
        value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if value is None:  # not given: the model's own
            continue
        if not (math.isfinite(value) and least <= value < below):
            bound = f"in [{least}, {below})" if math.isfinite(below) else f"a finite number >= {least}"
            raise InteropError(f"{flag} must be {bound}, got {value}")
