"""Device check: the reference trainer's GPU path (CUDA tensors, NCCL) against its CPU path and transformers.

A one-GPU machine runs a world of 1 on the GPU with NCCL (`trainer/train.py` `_device`) and larger worlds on the
CPU with gloo, so one `interop parity` per family puts the GPU run (1x1) beside CPU runs at tp 2, pp 2 (and ep 2
for MoE) and transformers' own model: the per-step losses of 10 fp32 updates must agree within 1e-5.  A resumed
GPU run must equal an uninterrupted one, and a bf16 GPU run must train.

  python scripts/gpu_parity.py build DIR        # here: the tiny models, made by this machine's transformers
  python scripts/gpu_parity.py run DIR OUT      # on the GPU machine: results.json, one plot per family, log
  python scripts/gpu_parity.py run DIR OUT gemma3,resume                    # only these checks

Nothing is downloaded; the models are the tests' (tests/helpers).  Results of a run go to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model builders; interop itself is installed

# family -> (layouts, frameworks, TrainConfig changes); transformers has no MTP and no router bias update
MOE = "1x1,2x1,1x2,1x1x2x2"
DENSE = "1x1,2x1,1x2"
CASES = {
    "llama3": (DENSE, "torch,hf", {}),
    "qwen3": (DENSE, "torch,hf", {}),
    "olmo2": (DENSE, "torch,hf", {}),
    "phi3": (DENSE, "torch,hf", {}),
    "gemma2": (DENSE, "torch,hf", {}),
    "gemma3": (DENSE, "torch,hf", {}),
    "gpt_oss": (MOE, "torch,hf", {"lr": 1e-3, "warmup": 2}),  # as tests/formats/test_family_gpt_oss.py
    "mixtral": (MOE, "torch,hf", {}),
    "deepseek_v3": (MOE, "torch,hf", {"mtp_loss_scaling_factor": 0.0, "router_bias_update_rate": 0.0}),
    "deepseek_v3_mtp": ("1x1,2x1,1x2,1x1x2x2,2x2", "torch", {"eps": 1e-6}),  # as tests/trainer/test_mtp_trainer.py
    "glm4_moe": (MOE, "torch,hf", {"mtp_loss_scaling_factor": 0.0, "router_bias_update_rate": 0.0}),
}


def build(root: Path) -> None:
    from helpers import deepseek_models, family_models, glm_models, moe_models
    root.mkdir(parents=True, exist_ok=True)
    for kind in ("llama3", "qwen3", "olmo2", "phi3", "gemma2", "gemma3", "gpt_oss"):
        model = family_models.build(kind)
        if kind == "gpt_oss":  # transformers sums its load-balancing loss unlike Megatron (trainer/moe.py)
            model.config.router_aux_loss_coef = 0.0
        model.save_pretrained(root / kind)
    mixtral = moe_models.hf_model("mixtral")
    mixtral.config.router_aux_loss_coef = 0.0
    mixtral.save_pretrained(root / "mixtral")
    deepseek_models.save(deepseek_models.v3_config(num_hidden_layers=4), root / "deepseek_v3", mtp=True)
    glm_models.save(glm_models.config(), root / "glm4_moe", mtp=True)
    print(f"built {len(list(root.iterdir()))} models in {root}")


def run(root: Path, out: Path, only: set[str] | None = None) -> int:
    import torch
    from interop.trainer.config import TrainConfig
    from interop.trainer.launch import train
    from interop.workflows.parity import parity, parse_layouts
    out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "nccl": torch.cuda.nccl.version() if torch.cuda.is_available() else None, "families": {}}
    import transformers
    results["transformers"] = transformers.__version__
    print(json.dumps(results), flush=True)
    failed = 0
    for family, (layouts, frameworks, changes) in CASES.items():
        if only and family not in only:
            continue
        src = root / family.removesuffix("_mtp")
        cfg = TrainConfig(**{"steps": 10, "seq_length": 16, "micro_batch_size": 2, "global_batch_size": 4, "lr": 3e-3,
                             **changes})
        start = time.time()
        try:
            result = parity(src, cfg, layouts=parse_layouts(layouts), frameworks=frameworks.split(","),
                            plot=out / f"{family}.png", log=None)
            entry = {"ok": result.ok, "max_diff": result.max_diff, "runs": result.runs, "failed": result.failed,
                     "notes": result.notes}
            print(f"== {family}: {'ok' if result.ok else 'FAIL'} max |diff| {result.max_diff:.2e} "
                  f"({time.time() - start:.0f} s)\n{result.table()}", flush=True)
        except Exception as e:  # one family's failure must not hide the others'
            entry = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(f"== {family}: ERROR {entry['error']}\n{entry['trace']}", flush=True)
        failed += not entry["ok"]
        results["families"][family] = entry
        (out / "results.json").write_text(json.dumps(results, indent=1))
    # Resume: saved at update 5 by the GPU run, resumed on the GPU (1x1) and on the CPU (tp 2): both continue the
    # uninterrupted GPU run (DeepSeek-V3 with MTP: MLA, experts, the MTP module and their AdamW moments).
    try:
        if only and "resume" not in only:
            raise StopIteration
        from interop.convert import convert
        work = out / "resume"
        convert(root / "deepseek_v3", work / "store", dst_format="interop")
        base = TrainConfig(load=str(work / "store"), steps=10, save_interval=5, seq_length=16, micro_batch_size=2,
                           global_batch_size=4, lr=3e-3, quiet=True)
        whole = [r["loss"] for r in train(base.replace(save=str(work / "A")))]
        saved = str(work / "A" / "step_000005")
        gpu = [r["loss"] for r in train(base.replace(load=saved, save=str(work / "B"), resume=True))]
        cpu = [r["loss"] for r in train(base.replace(load=saved, save=str(work / "C"), resume=True, tp=2))]
        diffs = {"gpu 1x1": max(abs(a - b) for a, b in zip(whole[5:], gpu)),
                 "cpu tp2": max(abs(a - b) for a, b in zip(whole[5:], cpu))}
        results["resume"] = {"whole": whole, "gpu": gpu, "cpu_tp2": cpu, "max_diff": diffs,
                             "ok": len(gpu) == len(cpu) == 5 and max(diffs.values()) <= 1e-5}
        bf16 = [r["loss"] for r in train(base.replace(bf16=True))]
        bf16_diff = max(abs(a - b) for a, b in zip(whole, bf16))  # bf16 autocast: ~1e-2 off the fp32 curve
        results["bf16"] = {"losses": bf16, "max_diff_vs_fp32": bf16_diff, "ok": len(bf16) == 10 and bf16_diff < 0.1}
        print(f"== resume: {diffs}; bf16 vs fp32 max |diff| {bf16_diff:.3f}", flush=True)
        failed += not (results["resume"]["ok"] and results["bf16"]["ok"])
    except StopIteration:
        pass
    except Exception as e:
        results["resume"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(f"== resume: ERROR {results['resume']['trace']}", flush=True)
        failed += 1
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{failed} of {len(CASES) + 1} checks failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2]), Path(sys.argv[3]), set(sys.argv[4].split(",")) if sys.argv[4:] else None))
    else:
        sys.exit(__doc__)
