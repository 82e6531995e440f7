"""Make tests/fixtures/state_dict/: single torch.save files of HF names, as two training systems write them.

Run (torch FSDP2 over gloo, 2 CPU processes; ColossalAI 0.5.0 installed --no-deps with peft):

    .venv/bin/python scripts/make_state_dict_fixtures.py tests/fixtures/state_dict

- `fsdp_full/pytorch_model_fsdp.bin`: accelerate's FULL_STATE_DICT save (accelerate 1.15
  utils/fsdp_utils.py `save_fsdp_model`: `torch.save(state_dict, "pytorch_model_fsdp.bin")` on rank 0), the state
  dict gathered from a FSDP2-sharded tiny HF Llama (vocab 1000, GQA, tied) after two AdamW steps with
  `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, as accelerate's `_get_model_state_dict` does.
- `colossalai/model.pt`: ColossalAI's own unsharded save (`GeneralCheckpointIO().save_model(model, "model.pt")`,
  colossalai/checkpoint_io/general_checkpoint_io.py `save_unsharded_model`) of a tiny HF GPT-2 (vocab 250).

Each folder's `config.json` is the model's (what a user passes as --model-config).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def fsdp_worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(1000 + step * 2 + rank)
        ids = torch.randint(0, 1000, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "pytorch_model_fsdp.bin")
        cfg.save_pretrained(str(out))
    dist.barrier()
    dist.destroy_process_group()


def colossalai_save(out: Path) -> None:
    import torch
    from colossalai.checkpoint_io import GeneralCheckpointIO
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=250, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    out.mkdir(parents=True, exist_ok=True)
    GeneralCheckpointIO().save_model(model, str(out / "model.pt"))
    cfg.save_pretrained(str(out))


def main(root: Path) -> None:
    import colossalai
    import torch
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29681",
                    __file__, "--worker", str(root / "fsdp_full")], check=True, env=dict(os.environ))
    colossalai_save(root / "colossalai")
    (root / "PROVENANCE").write_text(
        f"tool: torch {torch.__version__} FSDP2 (gloo, 2 processes) with accelerate 1.15's FULL_STATE_DICT save "
        f"calls; colossalai {colossalai.__version__} GeneralCheckpointIO.save_model (installed --no-deps, with peft)\n"
        f"command: .venv/bin/python scripts/make_state_dict_fixtures.py {root}\n")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        fsdp_worker(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
