"""Make tests/fixtures/atorch_fsdp/: ATorch 0.2.5 FSDP "streaming" checkpoints, written by ATorch's own savers.

Run (2 or 3 CPU processes over gloo):

    .venv/bin/pip install --no-deps atorch==0.2.5 grpcio   # atorch imports grpc at module level
    .venv/bin/python scripts/make_atorch_fsdp_fixtures.py tests/fixtures/atorch_fsdp

What ATorch's trainer does with `save_by_streaming` (atorch/trainer/atorch_trainer.py `save_model` /
`save_optimizer`): `save_fsdp_flat_param(model, out/streaming_ckpt)` and
`save_fsdp_optim_param(model, optimizer, out/streaming_ckpt)` (atorch/utils/fsdp_save_util.py), on a model wrapped
as the Llama 2 example's strategy asks (dlrover atorch/examples/llama2/fsdp_llama2.py: `atorch_wrap_cls`
LlamaDecoderLayer, `use_orig_params`, `sync_module_states`, `limit_all_gathers`, `forward_prefetch`; AdamW with its
two weight-decay groups).  Those save functions are ATorch's, run unchanged.  Shims, each needed only because this
machine has no GPU or a newer library:
  1. the FSDP wrap is made here with the arguments ATorch's FSDPOptimization.apply_wrapper passes
     (atorch/auto/opt_lib/zero_optimization.py: transformer_auto_wrap_policy over atorch_wrap_cls,
     BackwardPrefetch.BACKWARD_PRE, the data process group), because its `transform` refuses a machine without CUDA
     ("FSDP only support GPU !"); device_id is the CPU, and `sync_module_states` is left out (torch's FSDP requires
     GPU tensors for it; every rank builds the same weights from seed 0 instead).
  2. fsdp_save_util imports `safetensors.torch._tobytes` (safetensors <= 0.4), gone from the 0.8 that transformers 5
     requires: `_tobytes` below (a contiguous tensor's bytes, little-endian, as 0.4's) is set on safetensors.torch
     before atorch is imported.
  3. the reference consolidation, ATorch's `ConvertFlatParam`, calls torch.cuda.synchronize(current_device()) once
     per tensor (a GPU fence, a no-op for CPU tensors): both are replaced by no-ops for that call only.
The models: a tiny Llama (vocab 250, hidden 30, 3 heads of 10 over 1 KV group, ffn 61, 2 layers): hidden 30
puts FSDP's 16-byte alignment padding between parameters (the `P` of save_fsdp_flat_param's docstring) and the
world size's padding at the end of the last rank's shard (`D`).
  fp32_dp3: fp32, untied, 3 ranks (every unit's flat parameter padded to a multiple of 3), 2 AdamW steps, weights
    and optimizer state (exp_avg, exp_avg_sq, step); then the same run goes on 2 more updates: resume.json holds
    their losses (mean over the ranks), what a run resumed from this checkpoint must reproduce.
  bf16_tied_dp2: bf16 (the model cast as ATorch's `("half", "bf16")` does), tied embeddings, 2 ranks, 2 AdamW steps
    (moments in bf16 too).
Each case's folder: streaming_ckpt/ (ATorch's files) and config.json (the model's, saved by this script: in streaming
mode ATorch's trainer writes none); expected.safetensors: ATorch's ConvertFlatParam(streaming_ckpt)["params"];
expected_optim.safetensors: each `name-state` ATorch's ShardOptim gathers for the whole parameter
(load_tensor_by_param_and_state_name(name, state, 0, numel): its own resharding reader); the script checks both
against the parameters and optimizer state gathered in memory (FSDP.summon_full_params; each rank's optimizer.state pieces, gathered).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CASES = {
    "fp32_dp3": dict(world=3, dtype="float32", tied=False, resume=True),
    "bf16_tied_dp2": dict(world=2, dtype="bfloat16", tied=True),
}
CKPT = "streaming_ckpt"  # atorch/trainer/atorch_trainer.py STREAMING_CKPT_DIR


def _tobytes(tensor, name: str) -> bytes:
    """Shim 2: the bytes safetensors 0.4's `_tobytes` returned for a CPU tensor."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()


def import_atorch_saver():
    import safetensors.torch
    if not hasattr(safetensors.torch, "_tobytes"):
        safetensors.torch._tobytes = _tobytes
    from atorch.utils import fsdp_save_util
    return fsdp_save_util


def config(case: dict):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=250, hidden_size=30, intermediate_size=61, num_hidden_layers=2,
                       num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                       tie_word_embeddings=case["tied"])


def batch(step: int, rank: int):
    """Data-parallel rank `rank`'s 2 rows of 12 tokens at update `step` (0-based)."""
    import torch
    return torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1000 + step * 7 + rank))


def optim_groups(model):
    """dlrover atorch/examples/llama2/fsdp_llama2.py optim_param_func."""
    no_decay = ["bias", "LayerNorm.weight", "layernorm.weight", "norm.weight"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 1e-1},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def worker(out: Path, name: str) -> None:
    import functools

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import atorch
    from atorch.distributed.distributed import create_parallel_group, parallel_group
    saver = import_atorch_saver()

    case = CASES[name]
    atorch.init_distributed("gloo")
    create_parallel_group(([("data", case["world"])], None))
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = config(case)
    model = LlamaForCausalLM(cfg).to(getattr(torch, case["dtype"]))
    model = FSDP(model, process_group=parallel_group("data"), device_id=torch.device("cpu"),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}),
                 limit_all_gathers=True, use_orig_params=True, forward_prefetch=True,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    opt = torch.optim.AdamW(optim_groups(model), lr=1e-2, betas=(0.9, 0.95))
    for step in range(2):
        ids = batch(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ckpt = out / CKPT
    saver.save_fsdp_flat_param(model, str(ckpt))
    saver.save_fsdp_optim_param(model, opt, str(ckpt))
    # each rank's own Adam moments (with use_orig_params: its 1-D piece of each parameter it holds), gathered
    # by object: torch's FSDP.optim_state_dict / full_optim_state_dict return exp_avg equal to exp_avg_sq on CPU here
    local = {n.replace("_fsdp_wrapped_module.", ""): {s: v.clone() for s, v in opt.state[p].items() if v.dim()}
             for n, p in model.named_parameters() if p in opt.state}
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local)
    with FSDP.summon_full_params(model, writeback=False):
        truth = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in model.named_parameters()}
    if case.get("resume"):  # the run goes on from the saved state: its losses at updates 3 and 4, averaged over dp
        losses = []
        for step in (2, 3):
            loss = model(input_ids=batch(step, rank), labels=batch(step, rank)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        if rank == 0:
            (out / "resume.json").write_text(json.dumps({"mean_loss": losses}) + "\n")
    if rank == 0:
        save_file(truth, str(out / "truth.safetensors"))
        names = sorted({n for piece in pieces for n in piece})
        moments = {f"{n}-{s}": torch.cat([piece[n][s] for piece in pieces if n in piece])
                   for n in names for s in ("exp_avg", "exp_avg_sq")}
        save_file(moments, str(out / "truth_optim.safetensors"))
        cfg.save_pretrained(str(out))
    dist.barrier()
    dist.destroy_process_group()


def reference(out: Path) -> tuple[int, int]:
    """ATorch's own consolidations, checked against the in-memory truth; returns (tensors, moments) compared."""
    import torch
    from safetensors.torch import load_file, save_file

    saver = import_atorch_saver()
    ConvertFlatParam, ShardOptim = saver.ConvertFlatParam, saver.ShardOptim

    fence, device = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: 0)
    try:
        params = ConvertFlatParam(str(out / CKPT))["params"]
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = fence, device
    save_file({k: v.contiguous() for k, v in params.items()}, str(out / "expected.safetensors"))
    truth = load_file(str(out / "truth.safetensors"))
    assert sorted(truth) == sorted(params), (sorted(truth), sorted(params))
    for k, v in truth.items():
        assert v.dtype == params[k].dtype and torch.equal(v, params[k]), k
    optim = ShardOptim(str(out / CKPT))
    moments = {}
    for group in optim.osd_meta:
        for p in group["params"]:
            numel = params[p].numel()
            for s in ("exp_avg", "exp_avg_sq"):
                moments[f"{p}-{s}"] = optim.load_tensor_by_param_and_state_name(p, s, 0, numel).contiguous()
    save_file(moments, str(out / "expected_optim.safetensors"))
    truth_optim = load_file(str(out / "truth_optim.safetensors"))
    assert sorted(truth_optim) == sorted(moments), (sorted(truth_optim), sorted(moments))
    for k, v in truth_optim.items():
        assert torch.equal(v, moments[k]), k
    (out / "truth.safetensors").unlink()
    (out / "truth_optim.safetensors").unlink()
    return len(params), len(moments)


def main(root: Path) -> None:
    import safetensors
    import torch
    import transformers
    from importlib.metadata import version

    lines = [f"tool: atorch {version('atorch')} (pip install --no-deps atorch==0.2.5; dlrover atorch/ at that release), "
             f"torch {torch.__version__} FSDP1 over gloo on CPU, transformers {transformers.__version__}, "
             f"safetensors {safetensors.__version__}",
             f"command: .venv/bin/python scripts/make_atorch_fsdp_fixtures.py {root}",
             "savers: atorch.utils.fsdp_save_util.save_fsdp_flat_param + save_fsdp_optim_param into streaming_ckpt/ "
             "(what AtorchTrainer.save_model / save_optimizer call with save_by_streaming)",
             "shims (see the script's docstring): 1. FSDP wrapped here with FSDPOptimization.apply_wrapper's arguments "
             "(its transform refuses CPU); 2. `safetensors.torch._tobytes` (gone in safetensors 0.8) supplied; 3. torch.cuda.synchronize / "
             "current_device no-ops while ConvertFlatParam runs on CPU",
             "expected.safetensors: atorch ConvertFlatParam(streaming_ckpt)['params']; expected_optim.safetensors: "
             "atorch ShardOptim(streaming_ckpt).load_tensor_by_param_and_state_name(name, state, 0, numel), 1-D; "
             "both equal (torch.equal) to FSDP.summon_full_params / every rank's optimizer.state pieces in rank order, in memory"]
    for port, (name, case) in enumerate(CASES.items(), start=29731):
        out = root / name
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case["world"]),
                        "--master_port", str(port), __file__, "--worker", str(out), name], check=True,
                       env=dict(os.environ))
        n, m = reference(out)
        lines.append(f"{name}: {json.dumps(case)}; {n} parameters, {m} moments checked")
    (root / "PROVENANCE").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3])
    else:
        main(Path(sys.argv[1]))
