"""Make tests/fixtures/deepspeed-hf-pipe/: a real DeepSpeed pipeline checkpoint whose layers are plain Hugging
Face modules (no Megatron-DeepSpeed): what a user gets wrapping an HF Llama in a `deepspeed.pipe.PipelineModule`.

Run (4 CPU processes over gloo; deepspeed 0.19.8, DS_ACCELERATOR=cpu):

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_ds_hf_pipeline_fixture.py tests/fixtures/deepspeed-hf-pipe

The specs: index 0 an `nn.Embedding` (state `weight`), 1..L transformers' `LlamaDecoderLayer` (state
`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, `input_layernorm.weight`, ...; its forward given the rotary
cos/sin it needs), L+1 the final `LlamaRMSNorm` (`weight`), L+2 the untied head, an `nn.Linear` (`weight`).
Each is saved by DeepSpeed as `layer_{index:02d}-model_states.pt` (no model-parallel axis), so the embedding,
the final norm and the head files each hold just `weight`.  pp 2 x dp 2, ZeRO stage 1, two Adam steps.
A tiny HF Llama (vocab 250, hidden 32, 4 heads / 2 KV groups, ffn 64, 4 layers, untied); its config.json is
saved beside `latest` (DeepSpeed stores no model description: a user keeps the HF config).
`expected.safetensors`: the trained weights under their HF names, gathered from every rank's parameters in
memory (not from the files).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import cpu_ranks  # scripts/cpu_ranks.py (this folder is on the path of a script run)
import torch.nn.functional as F

PP, DP, STEPS = 2, 2, 2


def hf_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def run(out: Path) -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = hf_config()
    torch.manual_seed(0)
    full = LlamaForCausalLM(cfg).state_dict()

    class Embedding(torch.nn.Embedding):
        def __init__(self):
            super().__init__(cfg.vocab_size, cfg.hidden_size)
            self.weight.data.copy_(full["model.embed_tokens.weight"])

    class DecoderLayer(LlamaDecoderLayer):
        def __init__(self, i):
            super().__init__(cfg, i)
            self.load_state_dict({k[len(f"model.layers.{i}."):]: v for k, v in full.items()
                                  if k.startswith(f"model.layers.{i}.")})
            object.__setattr__(self, "rope", LlamaRotaryEmbedding(cfg))  # not a submodule: no state

        def forward(self, h):
            positions = torch.arange(h.shape[1]).unsqueeze(0)
            return super().forward(h, position_embeddings=self.rope(h, positions))

    class Norm(LlamaRMSNorm):
        def __init__(self):
            super().__init__(cfg.hidden_size, cfg.rms_norm_eps)
            self.weight.data.copy_(full["model.norm.weight"])

    class Head(torch.nn.Linear):
        def __init__(self):
            super().__init__(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.weight.data.copy_(full["lm_head.weight"])

    specs = [LayerSpec(Embedding)] + [LayerSpec(DecoderLayer, i) for i in range(cfg.num_hidden_layers)]
    specs += [LayerSpec(Norm), LayerSpec(Head)]
    def loss(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    topo = PipeDataParallelTopology(num_pp=PP, num_dp=DP)
    model = PipelineModule(layers=specs, loss_fn=loss, topology=topo, partition_method="type:DecoderLayer")
    config = {"train_batch_size": 2 * DP, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 100}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(100 + topo.get_coord(rank).data)  # data-parallel ranks see other batches
    for _ in range(STEPS):
        batches = [(ids, ids) for ids in (torch.randint(0, cfg.vocab_size, (1, 16), generator=gen) for _ in range(2))]
        engine.train_batch(data_iter=iter(batches))
    engine.save_checkpoint(str(out), tag=f"global_step{STEPS}")
    torch.distributed.barrier()
    mine = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        torch.save(gathered, out / "_ranks.pt")


def expected(out: Path) -> None:
    """The trained weights under HF names: spec index 0 the embedding, 1..L the layers, L+1 the norm, L+2 the head."""
    from safetensors.torch import save_file
    layers = hf_config().num_hidden_layers
    got = {}
    for params in torch.load(out / "_ranks.pt"):
        for name, value in params.items():
            idx, key = name.split(".", 1)
            idx = int(idx)
            hf = ("model.embed_tokens." if idx == 0 else f"model.layers.{idx - 1}." if idx <= layers else
                  "model.norm." if idx == layers + 1 else "lm_head.") + key
            if hf in got and not torch.equal(got[hf], value):
                raise SystemExit(f"data-parallel replicas disagree on {hf}")
            got[hf] = value
    (out / "_ranks.pt").unlink()
    save_file({k: v.contiguous() for k, v in got.items()}, out / "expected.safetensors")


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    if cpu_ranks.is_rank():
        run(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    cpu_ranks.launch(__file__, PP * DP, 29541)
    expected(out)
    hf_config().save_pretrained(str(out))
    cpu_ranks.remove_deepspeed_copies(out)
    import transformers
    versions = {"deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__,
                "transformers": transformers.__version__}
    (out / "PROVENANCE").write_text(
        "Made by scripts/make_ds_hf_pipeline_fixture.py (see its docstring) with " + json.dumps(versions) + ":\n"
        f"  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_ds_hf_pipeline_fixture.py {sys.argv[1]}\n"
        f"A DeepSpeed PipelineModule of HF Llama modules (nn.Embedding, LlamaDecoderLayer x 4, LlamaRMSNorm, "
        f"nn.Linear head, untied), pp {PP} x dp {DP}, ZeRO stage 1, {STEPS} AdamW steps, tag global_step{STEPS}.\n"
        "config.json: the HF model's (saved beside by the script). DeepSpeed's zero_to_fp32.py copies removed.\n"
        "expected.safetensors: the trained weights under HF names, gathered from every rank's parameters in memory.\n")


if __name__ == "__main__":
    main()
