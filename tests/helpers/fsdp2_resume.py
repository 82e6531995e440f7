"""Run under torch.distributed.run (gloo, CPU): for each DIR, build the HF model of DIR/config.json, shard it
with FSDP2 (`fully_shard` per layer and whole), give it a torch AdamW with other hyperparameters than the
checkpoint's (one param group; the HF Trainer's two for DIR#trainer), and load DIR as accelerate's
load_fsdp_model / load_fsdp_optimizer do for FSDP2
(`dcp.load` into `get_model_state_dict` / `get_optimizer_state_dict` templates, then `set_model_state_dict` /
`set_optimizer_state_dict`); then take one training step.  Rank 0 saves, per DIR, what was loaded (full
weights, full optimizer state) and, after the step, the loss and the full weights, to OUT.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/fsdp2_resume.py OUT DIR[#trainer] ...

The step's batch is the one scripts/make_fsdp_dcp_fixtures.py would have used for a third step.
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

TRAINER = "#trainer"  # DIR#trainer: an optimizer with the HF Trainer's param groups, not one group
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def resume(folder: str, trainer_groups: bool) -> dict:
    torch.manual_seed(7)  # a fresh model, unlike the checkpoint's
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config)
    for block in model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers:
        fully_shard(block)
    fully_shard(model)
    if trainer_groups:  # the HF Trainer's two groups: decay, and no decay for biases and norms
        from transformers import Trainer
        decay = set(Trainer.get_decay_parameter_names(None, model))
        params = [{"params": [p for n, p in model.named_parameters() if (n in decay) == d],
                   "weight_decay": 0.5 if d else 0.0} for d in (True, False)]
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=0.5, betas=(0.5, 0.5), eps=0.1, weight_decay=0.5)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=f"{folder}/pytorch_model_fsdp_0")
    set_model_state_dict(model, state["model"])
    optim = {"optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(optim, checkpoint_id=f"{folder}/optimizer_0")
    set_optimizer_state_dict(model, opt, optim["optimizer"])
    out = copy.deepcopy({"model": get_model_state_dict(model, options=FULL),  # the step below updates `step` in place
                         "optimizer": get_optimizer_state_dict(model, opt, options=FULL)})
    g = torch.Generator().manual_seed(1000 + 2 * 2 + dist.get_rank())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss := loss.detach().clone())
    out["loss"] = loss.item() / dist.get_world_size()
    out["after"] = get_model_state_dict(model, options=FULL)
    return out


def main(out: str, folders: list[str]) -> None:
    dist.init_process_group("gloo")
    results = {folder: resume(folder.removesuffix(TRAINER), folder.endswith(TRAINER)) for folder in folders}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
