"""Make tests/fixtures/torchtitan/: a checkpoint written by torchtitan 0.3.0's own CheckpointManager (DCP).

Run (CPU, one process over gloo; torchtitan and its imports installed without dependencies, torch untouched):

    .venv/bin/pip install --no-deps torchtitan==0.3.0 spmd-types==0.3.1 torch-checkpointing==0.1.1 tyro==1.0.16 \
        torchdata==0.11.0 docstring-parser triton==3.9.0
    .venv/bin/python scripts/make_torchtitan_fixture.py tests/fixtures/torchtitan

A tiny Llama 3 built from torchtitan's own model config (its `_build_llama3_layers`, fused wqkv, ComplexRoPE;
dim 32, 4 heads / 2 KV heads, ffn 64, 2 layers, vocab 250, untied) with the flex attention backend (0.3.0
refuses sdpa), AdamW from its `default_adamw` with a LambdaLR from `LRSchedulersContainer`, two optimizer
steps on synthetic gradients (no forward: flex attention is not needed for the optimizer state), then
`CheckpointManager.save(curr_step=2)` with `last_save_model_only=False`: `step-2/` holds the model (its own
names at the top level), the flattened optimizer state, lr_scheduler, dataloader (none) and train_state (what
torchtitan's Trainer.state_dict gives: step, ntokens_seen).  Beside it: config.json, the HF description of the
same model (torchtitan stores none), and expected_hf.safetensors, torchtitan's own HF export of the weights
(`Llama3StateDictAdapter.to_hf`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

DIM, HEADS, KV, LAYERS, VOCAB, FFN, STEP = 32, 4, 2, 2, 250, 64, 2


class TrainState:
    """What torchtitan's Trainer stores as `train_state` (trainer.py Trainer.state_dict)."""

    def __init__(self):
        self.step, self.ntokens_seen = STEP, STEP * 8 * 16

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def main(out: Path) -> None:
    import torchtitan
    import torchtitan.models.llama3 as llama3
    from safetensors.torch import save_file
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from transformers import LlamaConfig

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29757", rank=0, world_size=1)
    config = llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=llama3.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=llama3.RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=llama3.Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV, hidden_dim=FFN,
            rope=llama3.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000, scaling="none"),
            attn_backend="flex"))
    torch.manual_seed(0)
    model = config.build()
    opt = default_adamw(lr=1e-2, weight_decay=0.01).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None).build(optimizers=opt, training_steps=10)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        opt.step()
        schedulers.step()
        opt.zero_grad()
    manager = CheckpointManager.Config(enable=True, folder=str(out), interval=1, last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=schedulers,
        states={"train_state": TrainState()}, sd_adapter=None)
    manager.save(curr_step=STEP, last_step=False)
    manager.close()
    hf = Llama3StateDictAdapter(config, None).to_hf({k: v.detach().clone() for k, v in model.state_dict().items()})
    save_file({k: v.contiguous() for k, v in hf.items()}, out / "expected_hf.safetensors")
    LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False).save_pretrained(str(out))
    (out / "PROVENANCE").write_text(json.dumps({
        "tool": f"torchtitan {torchtitan.__version__ if hasattr(torchtitan, '__version__') else '0.3.0'} "
                "CheckpointManager (DCP), torch " + torch.__version__,
        "command": f".venv/bin/python scripts/make_torchtitan_fixture.py {sys.argv[1]}",
        "expected_hf.safetensors": "torchtitan's Llama3StateDictAdapter.to_hf of the model's state dict",
        "config.json": "transformers LlamaConfig of the same model (torchtitan stores no description)"}, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
