"""Make tests/fixtures/fsdp_dcp/: accelerate-style FSDP2 SHARDED_STATE_DICT checkpoints (PyTorch DCP).

Run (2 CPU processes over gloo; torch's FSDP2 `fully_shard`, transformers):

    .venv/bin/python scripts/make_fsdp_dcp_fixtures.py tests/fixtures/fsdp_dcp
    .venv/bin/python scripts/make_fsdp_dcp_fixtures.py tests/fixtures/fsdp1_dcp fsdp1

`fsdp1`: the same with FSDP1 (`FullyShardedDataParallel(use_orig_params=True)`, SHARDED_STATE_DICT:
ShardedTensors, and `FSDP.optim_state_dict` as accelerate's save_fsdp_optimizer takes it for FSDP1).

A tiny HF Llama (vocab 250, hidden 32, 4 heads over 2 KV groups, 2 layers, ffn 64, untied) sharded with
FSDP2 at dp 2, trained 2 AdamW steps, then saved as accelerate's `save_fsdp_model` /
`save_fsdp_optimizer` save a SHARDED_STATE_DICT (accelerate 1.15 utils/fsdp_utils.py):
`dist_cp.save({"model": get_model_state_dict(model)}, FileSystemWriter(out/pytorch_model_fsdp_0))` and
`dist_cp.save({"optimizer": get_optimizer_state_dict(model, opt)}, FileSystemWriter(out/optimizer_0))`.
accelerate's own entry point needs an Accelerator on a device; this script makes the same calls.
`expected.pt` is torch's own consolidation of the model folder (`dcp_to_torch_save`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"


def worker(out: Path, kind: str = "fsdp2") -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(2):
        g = torch.Generator().manual_seed(1000 + step * 2 + rank)
        ids = torch.randint(0, 250, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    if kind == "fsdp1":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(out / MODEL_DIR)))
            dcp.save({"optimizer": FSDP.optim_state_dict(model, opt)},
                     storage_writer=dcp.FileSystemWriter(str(out / OPTIM_DIR)))
    else:
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(str(out / MODEL_DIR)))
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
                 storage_writer=dcp.FileSystemWriter(str(out / OPTIM_DIR)))
    if rank == 0:
        cfg.save_pretrained(str(out))
    dist.barrier()
    dist.destroy_process_group()


def main(root: Path, kind: str = "fsdp2") -> None:
    import torch
    import transformers
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29671",
                    __file__, "--worker", str(root), kind], check=True, env=dict(os.environ))
    dcp_to_torch_save(str(root / MODEL_DIR), str(root / "expected.pt"))
    (root / "PROVENANCE").write_text(
        f"tool: torch {torch.__version__} {'FSDP1 (use_orig_params)' if kind == 'fsdp1' else 'FSDP2 fully_shard'} + torch.distributed.checkpoint (gloo, 2 processes), "
        f"transformers {transformers.__version__}; layout of accelerate 1.15 save_fsdp_model / save_fsdp_optimizer "
        "with SHARDED_STATE_DICT\n"
        f"command: .venv/bin/python scripts/make_fsdp_dcp_fixtures.py {root}{' fsdp1' if kind == 'fsdp1' else ''}\n"
        "expected.pt: torch.distributed.checkpoint.format_utils.dcp_to_torch_save(pytorch_model_fsdp_0)\n")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), *sys.argv[3:])
    else:
        main(Path(sys.argv[1]), *sys.argv[2:])
