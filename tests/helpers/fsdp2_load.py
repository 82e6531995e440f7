"""Run under torch.distributed.run (gloo, CPU): build the HF model of DIR/config.json, shard it with FSDP2
(`fully_shard` per layer and whole), load DIR/pytorch_model_fsdp_0 with torch.distributed.checkpoint.load
as accelerate's load_fsdp_model does, and save the full state dict (rank 0) to OUT.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/fsdp2_load.py DIR OUT
"""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    for block in model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers:
        fully_shard(block)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=f"{folder}/pytorch_model_fsdp_0")
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
