"""The target loaders' rules the map-args tests check against: MindSpeed-Core-MS r0.1.0's init_configs_from_yaml, MindFormers 2.1.0's MindFormerConfig, Megatron-LM core_v0.16.1's parser."""
from __future__ import annotations
import argparse
import json
import os
import tempfile
from pathlib import Path
import pytest
from click.testing import CliRunner
from interop import argsfile
from interop.cli.main import main
from interop.mappings import megatron_args as M


FIXTURES = Path(__file__).parents[1] / "fixtures" / "args"


def run(*args):
    result = CliRunner().invoke(main, ["map-args", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def _pos_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bool(v):
    return isinstance(v, bool)


def _str(v):
    return isinstance(v, str)


def _nonneg_float(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _opt(check):
    return lambda v: v is None or check(v)


def _one_of(*allowed):
    return lambda v: v in allowed


DTYPE = _one_of("float16", "float32", "bfloat16")


# (section, key) -> check, as the validators of mindspeed_ms/core/config.py r0.1.0 apply them on setattr.
MS_RULES = {
    ("parallel_config", "tensor_model_parallel_size"): _pos_int,
    ("parallel_config", "pipeline_model_parallel_size"): _pos_int,
    ("parallel_config", "context_parallel_size"): _pos_int,
    ("parallel_config", "context_parallel_algo"): _one_of("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo"),
    ("parallel_config", "expert_model_parallel_size"): _pos_int,
    ("parallel_config", "virtual_pipeline_model_parallel_size"): _opt(_pos_int),
    ("parallel_config", "sequence_parallel"): _bool,
    ("parallel_config", "num_layer_list"): _opt(lambda v: isinstance(v, list)),
    ("dataset_config", "dataset_dir"): _str,
    ("dataset_config", "shuffle"): _opt(_bool),
    ("dataset_config", "batch_size"): _pos_int,
    ("dataset_config", "micro_batch_num"): _pos_int,
    ("dataset_config", "eos_token_id"): _nonneg_int,
    ("training_config", "seed"): _opt(_pos_int),
    ("training_config", "output_dir"): _str,
    ("training_config", "training_iters"): _nonneg_int,
    ("training_config", "log_interval"): _opt(_pos_int),
    ("training_config", "eval_interval"): _opt(_pos_int),
    ("training_config", "save_interval"): _opt(_pos_int),
    ("training_config", "loss_scale"): _opt(lambda v: isinstance(v, (int, float)) and v > 0),
    ("training_config", "loss_scale_value"): _opt(lambda v: isinstance(v, (int, float)) and v > 0),
    ("training_config", "loss_scale_factor"): _opt(_pos_int),
    ("training_config", "loss_scale_window"): _opt(_pos_int),
    ("training_config", "loss_reduction"): _one_of("mean", "sum"),
    ("training_config", "wrap_with_ddp"): _bool,
    ("training_config", "bucket_size"): _opt(_pos_int),
    ("training_config", "ckpt_format"): _str,
    ("training_config", "keep_checkpoint_max"): _opt(_pos_int),
    ("training_config", "profile_save_path"): _str,
    ("training_config", "profile_step_start"): _opt(_pos_int),
    ("training_config", "profile_step_end"): _opt(_pos_int),
    ("training_config", "profile_level"): _one_of("level0", "level1", "level2"),
    ("training_config", "profile_framework"): _one_of("all", "time", "None"),
    ("training_config", "profile_aicore_metrics"): _opt(lambda v: isinstance(v, int) and -1 <= v <= 6),
    ("training_config", "profile_dynamic_profiler_config_path"): _str,
    ("model_config", "vocab_size"): _pos_int,
    ("model_config", "num_layers"): _pos_int,
    ("model_config", "num_attention_heads"): _pos_int,
    ("model_config", "seq_length"): _pos_int,
    ("model_config", "hidden_size"): _pos_int,
    ("model_config", "ffn_hidden_size"): _pos_int,
    ("model_config", "num_query_groups"): _pos_int,
    ("model_config", "hidden_act"): _str,
    ("model_config", "normalization"): _str,
    ("model_config", "norm_epsilon"): lambda v: isinstance(v, float) and v > 0,
    ("model_config", "params_dtype"): DTYPE,
    ("model_config", "compute_dtype"): DTYPE,
    ("model_config", "embedding_init_dtype"): DTYPE,
    ("model_config", "recompute_method"): _opt(_one_of("uniform", "block")),
    ("model_config", "recompute_granularity"): _opt(_one_of("selective", "full")),
    ("model_config", "transformer_impl"): _opt(_one_of("local", "transformer_engine")),
    ("model_config", "attn_post_norm_scale"): lambda v: isinstance(v, (int, float)) and 0 <= v <= 1,
    ("model_config", "ffn_post_norm_scale"): lambda v: isinstance(v, (int, float)) and 0 <= v <= 1,
    ("model_config", "rotary_base"): lambda v: isinstance(v, int),  # validate_rotary_config: int
    ("optimizer_config", "optimizer_type"): _str,
    ("optimizer_config", "learning_rate"): lambda v: isinstance(v, float) and v > 0,
    ("optimizer_config", "weight_decay"): _nonneg_float,
    ("optimizer_config", "clip_grad"): _nonneg_float,
    ("optimizer_config", "end_weight_decay"): _nonneg_float,
    ("optimizer_config", "lr_decay_iters"): _opt(lambda v: isinstance(v, int)),
    ("optimizer_config", "lr_warmup_iters"): _nonneg_int,
    ("optimizer_config", "lr_warmup_samples"): _nonneg_int,
    ("optimizer_config", "lr_warmup_init"): _nonneg_float,
    ("optimizer_config", "lr_warmup_fraction"): _opt(lambda v: isinstance(v, float)),
    ("optimizer_config", "lr_decay_samples"): _opt(lambda v: isinstance(v, int)),
    ("optimizer_config", "min_lr"): _nonneg_float,
    ("optimizer_config", "lr_decay_style"): _one_of("constant", "WSD", "linear", "cosine", "inverse-square-root"),
    ("optimizer_config", "weight_decay_incr_style"): _one_of("constant", "linear", "cosine"),
}


MS_BOOLS = {"model_config": ["group_query_attention", "qkv_has_bias", "out_proj_has_bias", "use_flash_attention",
                             "mlp_has_bias", "fp32_residual_connection", "add_bias_linear", "attention_softmax_in_fp32",
                             "apply_rope_fusion", "use_sandwich_norm", "apply_swiglu_fusion"],
            "training_config": ["accumulate_allreduce_grads_in_fp32", "overlap_grad_reduce", "delay_grad_reduce",
                                "use_distributed_optimizer", "fp16", "bf16", "resume_training", "crc_check",
                                "no_load_optim", "no_load_rng", "new_dataset", "profile", "profile_with_stack",
                                "profile_memory", "profile_communication", "profile_parallel_strategy",
                                "profile_l2_cache", "profile_hbm_ddr", "profile_pcie", "profile_data_process",
                                "profile_data_simplification", "profile_op_time", "profile_offline_analyse"],
            "optimizer_config": ["use_checkpoint_opt_param_scheduler", "overlap_param_gather",
                                 "override_opt_param_scheduler"]}


FA_LAYOUTS = {"mindspeed": ("BNSD", "SBH"), "mindformers": ("BNSD",)}  # check_fa_config of each release


def ms_validate(doc: dict, target: str = "mindspeed") -> list[str]:
    """The problems mindspeed_ms init_configs_from_yaml would raise, plus the silent resets it applies."""
    problems = [f"{s}.{k}={doc[s][k]!r}" for (s, k), ok in MS_RULES.items()
                if s in doc and k in doc[s] and not ok(doc[s][k])]
    mc, tc = doc.get("model_config", {}), doc.get("training_config", {})
    if mc.get("use_flash_attention") and mc.get("fa_config"):  # check_fa_config
        fa = mc["fa_config"]
        problems += [f"fa_config.{k}={v!r}" for k, v in fa.items()
                     if k in ("pre_tokens", "next_tokens") and not isinstance(v, int)
                     or k == "input_layout" and v not in FA_LAYOUTS[target]]
    if tc.get("use_distributed_optimizer") and not tc.get("wrap_with_ddp"):
        problems.append("use_distributed_optimizer reset to False (wrap_with_ddp is False)")
    if tc.get("bucket_size") is not None and not tc.get("wrap_with_ddp"):
        problems.append("bucket_size needs wrap_with_ddp")
    for key in ("loss_scale_factor", "loss_scale_window"):
        if tc.get(key) is not None and tc.get("loss_scale_value") is None:
            problems.append(f"{key} without loss_scale_value")
    return problems


# Every flag of Megatron-LM core_v0.16.1's real parser (megatron/training/arguments.py add_megatron_arguments,
# built from the tag's source; see PROVENANCE.tsv), with its dest and choices.
PARSER = json.loads((FIXTURES / "megatron_core_v0.16.1_parser.json").read_text())


UPSTREAM = set(PARSER) - {"--help"}


def _flags(text):
    return [w for w in text.replace("\\\n", " ").split() if w.startswith("--")]


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM core_v0.16.1's parser as recorded in the fixture: same flags, actions, nargs, types, choices."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    types = {"int": int, "float": float}
    for flag, a in PARSER.items():
        kwargs = {"dest": a["dest"]}
        if a["action"] == "_StoreTrueAction":
            kwargs["action"] = "store_true"
        elif a["action"] == "_StoreFalseAction":
            kwargs["action"] = "store_false"
        elif a["action"] == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
            if flag.startswith("--no-"):
                continue  # added with its positive spelling
        else:
            kwargs.update(type=types.get(a["type"], str), nargs=a["nargs"])
            if a["choices"] and a["type"] in (None, "str", "int"):
                kwargs["choices"] = [types.get(a["type"], str)(c) for c in a["choices"]]
        try:
            parser.add_argument(flag, **kwargs)
        except argparse.ArgumentError:
            pass  # a second spelling of a flag already added
    return parser


def parse_megatron(text: str) -> argparse.Namespace:
    tokens = argsfile.parse_text(text).tokens
    return megatron_parser().parse_args(tokens)


def mindformer_config(path):
    """MindFormers 2.1.0's MindFormerConfig(path) (mindformers/tools/register/config.py): it loads a run_*.yaml,
    applies its template for run_mode and raises KeyError on a key a section does not have. Imported with
    stand-ins for the package __init__s (which pull in datasets, tokenizers, ... a CPU test machine lacks);
    sys.modules is restored afterwards, so a real `import mindformers` elsewhere is unaffected."""
    import importlib
    import importlib.util
    import sys
    import types
    spec = importlib.util.find_spec("mindformers")
    if spec is None:
        pytest.skip("mindformers 2.1.0 is not installed (scripts/setup.sh installs it with --no-deps)")
    root = Path(spec.origin).parent
    saved = {k: v for k, v in sys.modules.items() if k == "mindformers" or k.startswith("mindformers.")}
    for k in saved:
        sys.modules.pop(k)
    log_dir = os.environ.get("LOCAL_DEFAULT_PATH")
    os.environ["LOCAL_DEFAULT_PATH"] = tempfile.mkdtemp(prefix="mindformers-log-")  # its logger's files
    try:
        for name in ("mindformers", "mindformers.tools", "mindformers.core", "mindformers.tools.register"):
            module = types.ModuleType(name)
            module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = module
        sys.modules["mindformers.tools"].logger = importlib.import_module("mindformers.tools.logger").logger
        try:
            config_class = importlib.import_module("mindformers.tools.register.config").MindFormerConfig
        except ImportError as exc:
            pytest.skip(f"mindformers 2.1.0 cannot be imported here: {exc}")
        return config_class(str(path))
    finally:
        for k in [k for k in sys.modules if k == "mindformers" or k.startswith("mindformers.")]:
            sys.modules.pop(k)
        sys.modules.update(saved)
        if log_dir is None:
            os.environ.pop("LOCAL_DEFAULT_PATH", None)
        else:
            os.environ["LOCAL_DEFAULT_PATH"] = log_dir
