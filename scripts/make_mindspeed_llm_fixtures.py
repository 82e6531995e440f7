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
model tensor (key in stored order, shape, dtype, sha256 of its bytes).  Then the other way: interop's own
`--fork mindspeed-llm` output of the same model is converted back to HF by MindSpeed-LLM's Mg2HfConvert (which reads
the args namespace interop wrote), and `mg2hf_of_interop` records which HF tensors it left out or changed.
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

from helpers.deepseek_models import save, v2_config, v3_config

CONFIGS = {"v3": v3_config, "v2": v2_config}  # the HF family a case's `hf_config` names
# name -> (HF config changes, Hf2MgConvert arguments); `hf_config` picks the family (default v3)
CASES = {
    "ds3_tp2_pp2_ep2_list13": (dict(num_hidden_layers=4, num_experts_per_tok=4),
                               dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2,
                                    target_expert_parallel_size=2, num_layer_list="1,3", mtp_num_layers=1,
                                    moe_grouped_gemm=True)),
    "ds3_tp1_pp2_vpp2": (dict(num_hidden_layers=4, num_experts_per_tok=4),
                         dict(target_pipeline_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                              mtp_num_layers=1, moe_grouped_gemm=True)),
    "ds3_tp2_ep2_nomtp": (dict(num_hidden_layers=3, num_experts_per_tok=4, num_nextn_predict_layers=0),
                          dict(target_tensor_parallel_size=2, target_expert_parallel_size=2, moe_grouped_gemm=True)),
    # --noop-layers 1,5 (6 positions, 4 real layers): stage 0 holds local layers 0 and 2, stage 1 0 and 1
    "ds3_pp2_noop15": (dict(num_hidden_layers=4, num_experts_per_tok=4),
                       dict(target_pipeline_parallel_size=2, noop_layers="1,5", mtp_num_layers=1,
                            moe_grouped_gemm=True)),
    # --noop-layers 4,5 over 6 layers at pp 2 with 2-layer virtual chunks (8 positions): stage 0's second chunk
    # holds noop layers only (its example layers_each_vpp [[2, 0], [2, 2]])
    "ds3_pp2_vpp2_noop45": (dict(num_hidden_layers=6, num_experts_per_tok=4),
                            dict(target_pipeline_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
                                 noop_layers="4,5", mtp_num_layers=1, moe_grouped_gemm=True)),
    # --mla-mm-split: q_up / kv_up as linear_qk_nope, linear_qk_rope, linear_kv_nope, linear_v, each cut by heads
    "ds3_tp2_pp2_mmsplit": (dict(num_hidden_layers=4, num_experts_per_tok=4),
                            dict(target_tensor_parallel_size=2, target_pipeline_parallel_size=2, mla_mm_split=True,
                                 mtp_num_layers=1, moe_grouped_gemm=True)),
    # DeepSeek-V2-Lite: no query compression, so linear_qkv = [q_proj; kv_a]
    "ds2lite_tp2_pp2_ep2": (dict(hf_config="v2", num_hidden_layers=4, topk_method="greedy"),
                            dict(model_type_hf="deepseek2-lite", target_tensor_parallel_size=2,
                                 target_pipeline_parallel_size=2, target_expert_parallel_size=2,
                                 moe_grouped_gemm=True)),
}


TEMPORARY = ("load_dir", "save_dir", "hf_path")  # the run's temporary folders, recorded as "<tmp>"


def hf_config(changes: dict):
    changes = dict(changes)
    return CONFIGS[changes.pop("hf_config", "v3")](**changes)


def converter_module(root: Path, name: str = "convert_hf2mg"):
    """A MindSpeed-LLM converter module (convert_hf2mg, convert_mg2hf), its package __init__ files skipped."""
    for package_name in ("mindspeed_llm", "mindspeed_llm.tasks", "mindspeed_llm.tasks.checkpoint"):
        package = types.ModuleType(package_name)
        package.__path__ = [str(root.joinpath(*package_name.split(".")))]
        sys.modules[package_name] = package
    return importlib.import_module(f"mindspeed_llm.tasks.checkpoint.{name}")


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
    """The folders and their rank files as MindSpeed-LLM wrote them (one args namespace: every file holds the same)."""
    folders, args = {}, []
    for f in sorted(out.glob("iter_*/*/model_optim_rng.pt")):
        obj = torch.load(f, map_location="cpu", weights_only=False)
        args.append({k: "<tmp>" if k in TEMPORARY else plain(v) for k, v in sorted(vars(obj["args"]).items())})
        folders[f"{f.parent.parent.name}/{f.parent.name}"] = {
            "entries": list(obj), "checkpoint_version": obj["checkpoint_version"], "iteration": obj["iteration"],
            "models": {m: [[k, list(v.shape), str(v.dtype).replace("torch.", ""), sha(v)] for k, v in obj[m].items()]
                       for m in obj if m.startswith("model")}}
    assert all(a == args[0] for a in args)
    return {"tracker": (out / "latest_checkpointed_iteration.txt").read_text(), "args": args[0], "files": folders}


def interop_options(given: dict) -> dict:
    """interop's convert() options for Hf2MgConvert's arguments."""
    return {"fork": "mindspeed-llm", **({"noop_layers": given["noop_layers"]} if given.get("noop_layers") else {}),
            **({"mla_mm_split": True} if given.get("mla_mm_split") else {})}


def interop_layout(given: dict, layers: int) -> dict:
    """interop's convert() layout for Hf2MgConvert's arguments over a model of `layers` layers."""
    positions = layers + len(given["noop_layers"].split(",") if given.get("noop_layers") else [])
    tp, pp, ep = (given.get(f"target_{x}_parallel_size", 1) for x in ("tensor", "pipeline", "expert"))
    counts = [int(n) for n in given["num_layer_list"].split(",")] if given.get("num_layer_list") else None
    vpp = 1
    if given.get("num_layers_per_virtual_pipeline_stage"):
        vpp = positions // pp // given["num_layers_per_virtual_pipeline_stage"]
    return dict(tp=tp, pp=pp, ep=ep, vpp=vpp, first_stage_layers=counts[0] if counts else None)


def mg2hf_of_interop(root: Path, hf: Path, work: Path, changes: dict, given: dict) -> dict:
    """interop writes `hf` as MindSpeed-LLM; MindSpeed-LLM's Mg2HfConvert reads it back: what it lost or changed."""
    from interop.convert import convert

    convert(hf, work / "interop", dst_format="megatron", **interop_layout(given, changes["num_hidden_layers"]),
            options=interop_options(given))
    back = work / "mindspeed_llm_hf"
    converter_module(root, "convert_mg2hf").Mg2HfConvert(cli_args(
        work / "interop", back, load_model_type="mg", save_model_type="hf", hf_cfg_dir=str(hf),
        model_type_hf=given.get("model_type_hf", "deepseek3"),
        mtp_num_layers=given.get("mtp_num_layers", 0), moe_grouped_gemm=given.get("moe_grouped_gemm", False),
        noop_layers=given.get("noop_layers"),
        mla_mm_split=given.get("mla_mm_split", False),
        num_layers_per_virtual_pipeline_stage=given.get("num_layers_per_virtual_pipeline_stage"))).run()
    want, got = load_file(hf / "model.safetensors"), {}
    for f in sorted(back.glob("*.safetensors")):
        got.update(load_file(f))
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "differ": sorted(k for k in set(want) & set(got) if not torch.equal(want[k], got[k]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mindspeed_llm", type=Path, help="a MindSpeed-LLM checkout")
    parser.add_argument("out", type=Path)
    parser.add_argument("--commit", help="the checkout's commit when it is not a git repository")
    a = parser.parse_args()
    module = converter_module(a.mindspeed_llm)
    commit = subprocess.run(["git", "-C", str(a.mindspeed_llm), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or a.commit or "unknown"
    a.out.mkdir(parents=True, exist_ok=True)
    for case, (changes, given) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            hf, mg = Path(tmp) / "hf", Path(tmp) / "mg"
            save(hf_config(changes), hf, mtp=bool(given.get("mtp_num_layers")))
            module.Hf2MgConvert(cli_args(hf, mg, **given)).run()
            record = {"tool": "Ascend/MindSpeed-LLM convert_ckpt_v2.py (Hf2MgConvert)", "commit": commit,
                      "hf_config_changes": changes, "arguments": given,
                      "hf": {k: sha(v) for k, v in sorted(load_file(hf / "model.safetensors").items())},
                      **fingerprint(mg)}
            record["mg2hf_of_interop"] = mg2hf_of_interop(a.mindspeed_llm, hf, Path(tmp), changes, given)
        (a.out / f"{case}.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")
        print(f"{case}: {len(record['files'])} rank files")


if __name__ == "__main__":
    main()
