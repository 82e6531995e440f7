"""Run MindSpeed-LLM's own HF -> Megatron converter (convert_ckpt_v2.py's Hf2MgConvert) on CPU over a tiny
DeepSeek-V3 and record what it writes, tensor by tensor, as the oracle of interop's `mindspeed-llm` writer.

    git clone https://gitee.com/ascend/MindSpeed-LLM /tmp/msllm   # or github.com/Ascend/MindSpeed-LLM
    PYTHONPATH=tests .venv/bin/python scripts/make_mindspeed_llm_fixtures.py /tmp/msllm tests/fixtures/mindspeed_llm

Only `mindspeed_llm/tasks/checkpoint/` (torch, safetensors, numpy) and `configs/checkpoint/model_cfg.json` are
used: the package's `__init__` (which patches megatron for NPUs) is bypassed by importing those modules under
empty parent packages.  The HF source is tests/helpers/deepseek_models.py's tiny DeepSeek-V3 (vocab 1000, 4 layers,
the first dense, MTP), rebuilt by the test from the same seed; its tensors' sha256 are recorded too, so a changed
builder fails loudly instead of comparing against another model.  Written per case (`<case>.json`): the folders,
the tracker, each rank file's top-level entries, `checkpoint_version`, `iteration`, its args namespace and every
model tensor (key in stored order, shape, dtype, sha256 of its bytes).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.deepseek_models import save, v3_config

# name -> (HF config changes, Hf2MgConvert arguments)
CASES = {
    "ds3_tp2_pp2_ep2_list13": (dict(num_hidden_layers=4, num_experts_per_tok=4),
                               dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2,
                                    target_expert_parallel_size=2, num_layer_list="1,3", mtp_num_layers=1,
                                    moe_grouped_gemm=True)),
}


def converter_module(root: Path):
    """MindSpeed-LLM's convert_hf2mg module, its package __init__ files skipped."""
    for name in ("mindspeed_llm", "mindspeed_llm.tasks", "mindspeed_llm.tasks.checkpoint"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
    return importlib.import_module("mindspeed_llm.tasks.checkpoint.convert_hf2mg")


def cli_args(hf: Path, out: Path, **given) -> argparse.Namespace:
    """convert_ckpt_v2.py's get_args() defaults with `given` (the flags' dest names)."""
    args = dict(load_model_type="hf", save_model_type="mg", load_dir=str(hf), save_dir=str(out),
                model_type_hf="deepseek3", target_tensor_parallel_size=1, target_pipeline_parallel_size=1,
                target_expert_parallel_size=1, expert_tensor_parallel_size=None,
                num_layers_per_virtual_pipeline_stage=None, moe_grouped_gemm=False, noop_layers=None,
                mtp_num_layers=0, num_layer_list=None, moe_tp_extend_ep=False, mla_mm_split=False,
                schedules_method=None, first_k_dense_replace=None, num_layers=None, transformer_impl="local",
                hf_cfg_dir=None, input_tp_rank=None, input_pp_rank=None, hidden_size=4096, save_layer_by_layer=False,
                lora_load=None, lora_r=None, lora_alpha=None, lora_target_modules=[], save_lora_to_hf=False)
    args.update(given)
    return argparse.Namespace(**args)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def plain(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else (
        [plain(x) for x in v] if isinstance(v, (list, tuple)) else repr(v))


def fingerprint(out: Path) -> dict:
    folders = {}
    for f in sorted(out.glob("iter_*/*/model_optim_rng.pt")):
        obj = torch.load(f, map_location="cpu", weights_only=False)
        folders[f"{f.parent.parent.name}/{f.parent.name}"] = {
            "entries": sorted(obj), "checkpoint_version": obj["checkpoint_version"], "iteration": obj["iteration"],
            "args": {k: plain(v) for k, v in sorted(vars(obj["args"]).items())},
            "model": [[k, list(v.shape), str(v.dtype).replace("torch.", ""), sha(v)] for k, v in obj["model"].items()]}
    return {"tracker": (out / "latest_checkpointed_iteration.txt").read_text(), "files": folders}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mindspeed_llm", type=Path, help="a MindSpeed-LLM checkout")
    parser.add_argument("out", type=Path)
    a = parser.parse_args()
    module = converter_module(a.mindspeed_llm)
    commit = subprocess.run(["git", "-C", str(a.mindspeed_llm), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    a.out.mkdir(parents=True, exist_ok=True)
    for case, (changes, given) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            hf, mg = Path(tmp) / "hf", Path(tmp) / "mg"
            save(v3_config(**changes), hf, mtp=True)
            module.Hf2MgConvert(cli_args(hf, mg, **given)).run()
            record = {"tool": "Ascend/MindSpeed-LLM convert_ckpt_v2.py (Hf2MgConvert)", "commit": commit,
                      "hf_config_changes": changes, "arguments": given,
                      "hf": {k: sha(v) for k, v in sorted(load_file(hf / "model.safetensors").items())},
                      **fingerprint(mg)}
        (a.out / f"{case}.json").write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
        print(f"{case}: {len(record['files'])} rank files")


if __name__ == "__main__":
    main()
