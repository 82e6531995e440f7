"""LoRA settings as map-args rows: Megatron-side flags (MindSpeed-LLM's `--lora-*`, `megatron_args.LORA`) <->
Hugging Face PEFT's adapter_config.json (`PEFT_ROWS`) and MindFormers' `pet_config` (`PET_ROWS`).

PEFT: peft 0.21 `LoraConfig` (r, lora_alpha, lora_dropout, target_modules: module names matched against the end
of each module's name, or one regular expression; modules_to_save; defaults r 8, alpha 8, dropout 0.0).
MindFormers 2.1.0: `model.model_config.pet_config` (mindformers/models/build_model.py build_network ->
mindformers/pet/pet_config.py LoraConfig: pet_type "lora", lora_rank 8, lora_alpha 16, lora_dropout 0.01,
target_modules a regular expression `re.match`ed against each cell's name, default r".*dense*|.*linear*").
Module names per framework: `lora_modules.py`.
"""
from __future__ import annotations

import re

from . import lora_modules as L
from .key_mapping import OMIT, KeyMapping, R, Unmappable

# ---------------------------------------------------------------- target modules, both ways


def _modules(targets) -> list[str]:
    """Megatron-side target names -> Megatron-core modules (legacy spellings read); a name it cannot place refused."""
    out = []
    for name in targets or []:
        module = L.megatron_module(str(name))
        if module is None:
            raise Unmappable(f"{name!r}: not a module interop maps (it maps {', '.join(L.MODULES)}, and the legacy "
                             f"{', '.join(L.MEGATRON_ALIASES)}; wildcards and other modules are not mapped)")
        if module not in out:
            out.append(module)
    return out


def _read_names(names, table: dict, fused: dict, framework: str) -> dict:
    """Megatron values from a framework's module names (`table`: a module's parts; `fused`: names that are a whole
    module), with a `_note` for names it cannot place and for a fused module only part of which is named."""
    found = {str(n).rsplit(".", 1)[-1] for n in names}
    whole, partial = L.from_parts(found, table)
    whole += [fused[n] for n in sorted(found) if n in fused and fused[n] not in whole]
    # Megatron-core's own names: MindFormers' mcore-style cells, and MindSpeed-LLM writes them in its PEFT files
    whole += [n for n in sorted(found) if n in L.MODULES and n not in whole]
    known = {p for parts in table.values() for p in parts} | set(fused) | set(L.MODULES)
    unknown = sorted(found - known)
    notes = []
    for module in partial:
        if module in whole:
            continue
        named = sorted(found & set(table[module]))
        notes.append(f"{', '.join(named)} without {', '.join(sorted(set(table[module]) - found))}: Megatron-core's "
                     f"{module} is one fused module, adapted whole: read as {module} (Megatron-Bridge's CanonicalLoRA "
                     "adapts the parts apart)")
        whole.append(module)
    if unknown:
        notes.append(f"{', '.join(unknown)}: no Megatron-core module for it in {framework} (interop maps "
                     f"{', '.join(L.MODULES)})")
    out = {"lora_target_modules": [m for m in L.MODULES if m in whole]}
    if notes:
        out["_note"] = "; ".join(notes)
    return out


def hf_targets(targets):
    modules = _modules(targets)
    return [name for m in modules for name in L.HF[m]] if modules else OMIT


def hf_targets_back(value, doc):
    if isinstance(value, str):
        if value == "all-linear":
            return {"lora_target_modules": list(L.MODULES),
                    "_said": "PEFT's all-linear: every linear layer but the output head, Megatron-core's four modules"}
        return {"_note": "a regular expression: interop reads a list of module names (write the names out)"}
    return _read_names(value, L.HF, L.HF_FUSED, "Hugging Face")


def mindformers_targets(targets):
    modules = _modules(targets)
    return "|".join(f".*{name}" for m in modules for name in L.MINDFORMERS[m]) if modules else OMIT


CELL = re.compile(r"^\^?(?:\.\*)?(\w+)\$?$")  # one alternative of MindFormers' pattern: [.*]cell_name[$]


def mindformers_targets_back(value, doc):
    if value == L.MINDFORMERS_DEFAULT:
        return {"lora_target_modules": list(L.MODULES),
                "_said": f"{value!r} (MindFormers' default pattern) matches its mcore-style models' four cells (and no "
                         "cell of its Llama)"}
    names, unread = [], []
    for alt in str(value).split("|"):
        found = CELL.match(alt.strip())
        (names if found else unread).append(found.group(1) if found else alt)
    out = _read_names(names, L.MINDFORMERS, L.MINDFORMERS_FUSED, "MindFormers")
    if unread:  # a cell's own name with a wildcard in it: which cells it matches depends on the model
        note = f"{', '.join(map(repr, unread))}: not a cell name (interop reads alternatives like '.*linear_qkv')"
        out["_note"] = f"{out['_note']}; {note}" if "_note" in out else note
    return out


# Megatron-side modules_to_save (MindSpeed-LLM --lora-modules-to-save) <-> HF module names.
SAVED = {"word_embeddings": "embed_tokens", "output_layer": "lm_head"}


def hf_saved(names):
    if not names:
        return OMIT
    unknown = [n for n in names if n not in SAVED]
    if unknown:
        raise Unmappable(f"{', '.join(unknown)}: interop maps {', '.join(SAVED)} only")
    return [SAVED[n] for n in names]


def hf_saved_back(value, doc):
    inverse = {v: k for k, v in SAVED.items()}
    names = [str(n).rsplit(".", 1)[-1] for n in (value or [])]
    unknown = [n for n in names if n not in inverse]
    out = {"lora_modules_to_save": [inverse[n] for n in names if n in inverse]} if len(unknown) < len(names) else {}
    if unknown:
        out["_note"] = f"{', '.join(unknown)}: interop maps {', '.join(inverse)} only"
    return out


def fixed(path, value, why):
    """A key the target writes as `value` (plain LoRA) and reads another value of as a loss saying `why`."""
    return KeyMapping((), path, value, lambda: value,
                      lambda v, doc: {} if v == value else {"_note": f"{v!r}: {why}"})


def ignored(path):
    """A key read and set aside: it says nothing a trained adapter's run depends on (its initialisation, dtypes)."""
    return KeyMapping((), path, None, lambda: OMIT, lambda v, doc: {})


# ---------------------------------------------------------------- Hugging Face PEFT adapter_config.json

PEFT_ROWS = [
    fixed("peft_type", "LORA", "not a LoRA adapter: interop maps LoRA only"),
    fixed("task_type", "CAUSAL_LM", "interop maps causal language models' adapters only"),
    R("lora_r", "r", 8),
    R("lora_alpha", "lora_alpha", 8),
    R("lora_dropout", "lora_dropout", 0.0),
    R("lora_target_modules", "target_modules", to=hf_targets, back=hf_targets_back),
    R("lora_modules_to_save", "modules_to_save", to=hf_saved, back=hf_saved_back),
    fixed("bias", "none", "LoRA biases: MindSpeed-LLM trains none (bias='none')"),
    fixed("use_rslora", False, "rank-stabilised scaling (alpha / sqrt(r)): MindSpeed-LLM scales by alpha / r"),
    fixed("use_dora", False, "DoRA (weight-decomposed LoRA): MindSpeed-LLM trains plain LoRA"),
    KeyMapping((), "base_model_name_or_path", None, lambda: OMIT,
               lambda v, doc: {"_said": "the base model: give its checkpoint as the run's --load"} if v else {}),
    *[ignored(k) for k in ("init_lora_weights", "inference_mode", "peft_version", "revision", "fan_in_fan_out",
                           "qalora_group_size")],
]
# Keys PEFT writes at values that mean plain LoRA on every layer: left out of the report at these values (any
# other value is reported as lost, like every key no row reads).
PEFT_PLAIN = {"auto_mapping": None, "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": {}, "alpha_pattern": {}, "megatron_config": None, "megatron_core": "megatron.core",
              "trainable_token_indices": None, "loftq_config": {}, "eva_config": None, "corda_config": None,
              "lora_ga_config": None, "velora_config": None, "alora_invocation_tokens": None, "use_qalora": False,
              "monteclora_config": None, "layer_replication": None, "lora_bias": False, "target_parameters": None,
              "use_bdlora": None, "arrow_config": None, "kasa_config": None, "ensure_weight_tying": False}


# ---------------------------------------------------------------- MindFormers pet_config

PET = "model.model_config.pet_config"
PET_DEFAULTS = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.01}  # MindFormers' LoraConfig defaults


def _when_lora(value, targets):
    """A pet_config key is written only for a run that trains LoRA (MindSpeed-LLM: targets named)."""
    return value if targets else OMIT


def _pet_type_back(value, doc):
    if value != "lora":
        return {"_note": f"pet_type {value!r}: interop maps LoRA only"}
    pet = doc["model"]["model_config"]["pet_config"]
    keys = {"lora_r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
    out = {dest: PET_DEFAULTS[dest] for dest, key in keys.items() if key not in pet}  # MindFormers' own defaults
    if "target_modules" not in pet:
        out.update(mindformers_targets_back(L.MINDFORMERS_DEFAULT, doc))
    return out


PET_ROWS = [
    R("lora_target_modules", f"{PET}.pet_type", to=lambda t: "lora" if t else OMIT, back=_pet_type_back),
    R(("lora_r", "lora_target_modules"), f"{PET}.lora_rank", to=_when_lora, back=lambda v, doc: {"lora_r": v}),
    R(("lora_alpha", "lora_target_modules"), f"{PET}.lora_alpha", to=_when_lora,
      back=lambda v, doc: {"lora_alpha": v}),
    R(("lora_dropout", "lora_target_modules"), f"{PET}.lora_dropout", to=_when_lora,
      back=lambda v, doc: {"lora_dropout": v}),
    R("lora_target_modules", f"{PET}.target_modules", to=mindformers_targets, back=mindformers_targets_back),
    *[ignored(f"{PET}.{k}") for k in ("lora_a_init", "lora_b_init", "param_init_type", "compute_dtype")],
]
