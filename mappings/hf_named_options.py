"""The options of the formats that store HF names (state_dict, atorch; dcp adds its own): `--model-config` for tensors stored under HF names
without a config.json beside them (declared alike with Megatron's, torch-free)."""
from __future__ import annotations

from ..formats import FormatOption
from .megatron_options import MODEL_CONFIG_HELP

OPTIONS = (
    FormatOption("model_config", {"convert": MODEL_CONFIG_HELP, "inspect": MODEL_CONFIG_HELP}, kind="path"),
)

