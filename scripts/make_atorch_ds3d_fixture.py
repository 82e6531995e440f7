"""Make tests/fixtures/atorch_ds3d/: an ATorch 0.2.5 DS 3D (DeepSpeed pipeline + ATorch tensor parallel) checkpoint.

Run (4 CPU processes over gloo: tensor 2 x data 1 x pipeline 2; deepspeed 0.19.8, DS_ACCELERATOR=cpu):

    .venv/bin/pip install --no-deps atorch==0.2.5 grpcio
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_atorch_ds3d_fixture.py tests/fixtures/atorch_ds3d

What dlrover atorch/examples/llama2/ds_3d_llama2.py does, through ATorch's own `auto_accelerate` with the
`deepspeed_3d_parallel` strategy: `record_module_init()` around `LlamaModel(config)`, its `get_llama_tpinfo()`
(q/k/v/gate/up ColumnParallelLinear, o/down RowParallelLinear, embed_tokens VocabParallelEmbedding), ZeRO stage 1
(its ds_3d_llama2_entry.sh ds_config; fp32 here, not fp16), AdamW with its two weight-decay groups, its
batch_fn and vocab-parallel loss; then `engine.save_checkpoint`.  ATorch builds the PipelineModule from the
model's modules in order (atorch/utils/ds_pipe_utils.py PipeModuleFromRecordedMeta, tie_first): the embedding
(tied: the logits are computed from it), the decoder layers, the final norm, transformers 5's model-level
`rotary_emb` (no parameters, no persistent buffers: an empty layer file), and the tied logit helper (a function:
no file).  Shims, each because this machine has no GPU or runs transformers 5:
  1. ATorch's randomizer (atorch/modules/distributed_modules/randomizer.py) keeps CUDA RNG states:
     torch.cuda.get_rng_state / set_rng_state / manual_seed act on the CPU generator, so the tensor group still
     builds its master weights from one forked state;
  2. no `shrink` of self_attn's num_heads / num_key_value_heads / hidden_size: transformers 5's LlamaAttention
     has none of these attributes (it infers the local heads from the sharded projections);
  3. custom_patcher (ATorch's documented hook): each decoder layer computes its rotary cos/sin with a
     LlamaRotaryEmbedding it does not register (transformers 5 passes them from the model), the model-level
     rotary_emb layer passes its inputs through;
  4. no "module_replace" (flash attention);
  5. `safetensors.torch._tobytes` (safetensors <= 0.4, imported by atorch/utils/fsdp_save_util.py on the way to
     auto_accelerate; gone from the 0.8 transformers 5 needs) supplied: a contiguous tensor's bytes;
  6. ATorch's get_ds_dtype reads DeepSpeedConfig.fp16_enabled / bfloat16_enabled, gone in DeepSpeed 0.19.8: its
     answer for this config (neither fp16 nor bf16), torch.float32, is given instead.
Vocabulary 251 (ATorch pads the embedding to 252 rows for tp 2), hidden 32, 4 heads over 2 KV groups, ffn 48,
2 layers.  config.json: the HF config (tie_word_embeddings false, as Llama 2's: ATorch ties anyway).
expected.safetensors: the trained weights under HF names, tp shards gathered in memory from every rank's
parameters (not from the files), rows cut at dim 0 / columns at dim 1 as ATorch's layers split them; the embedding
with ATorch's padded row.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import cpu_ranks  # scripts/cpu_ranks.py (this folder is on the path of a script run)

TP, DP, PP, STEPS = 2, 1, 2, 2
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def hf_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=251, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def cuda_rng_on_cpu() -> None:
    """Shim 1."""
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _tobytes(tensor, name: str) -> bytes:
    """Shim 5 (never called here: nothing is saved through it)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def run(out: Path) -> None:
    import functools

    import safetensors.torch
    cuda_rng_on_cpu()
    if not hasattr(safetensors.torch, "_tobytes"):
        safetensors.torch._tobytes = _tobytes
    import atorch
    from atorch.auto import auto_accelerate
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig
    from atorch.modules.distributed_modules.cross_entropy import vocab_parallel_cross_entropy
    from atorch.tensor_parallel.manual_tp import TPInfo
    from atorch.utils.meta_model_utils import record_module_init
    from transformers import LlamaModel
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    atorch.init_distributed("gloo")
    torch.manual_seed(0)
    cfg = hf_config()
    tpinfo = TPInfo()
    tpinfo.shard_col(*COLUMN)
    tpinfo.shard_row(*ROW)
    tpinfo.shard_vocab("embed_tokens")

    def layer_patcher(fw, module):
        rope = LlamaRotaryEmbedding(cfg)

        @functools.wraps(fw)
        def forward(inputs):
            hidden, mask, positions = inputs
            out = fw(hidden, position_ids=positions, position_embeddings=rope(hidden, positions))
            return (out[0] if isinstance(out, tuple) else out), mask, positions
        return forward

    def passthrough(fw, module):
        return lambda inputs: inputs

    patcher = {f"layers.{i}": layer_patcher for i in range(cfg.num_hidden_layers)}
    patcher["rotary_emb"] = passthrough

    def batch_fn(data):
        return (data["input_ids"], data["attention_mask"], data["position_ids"]), (data["labels"], data["loss_mask"])

    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "steps_per_print": 50,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    ds3d = DeepSpeed3DParallelConfig(tpinfo=tpinfo, custom_patcher=patcher, ds_config=ds_config, batch_fn=batch_fn)

    def loss_func(logits, labels):
        labels, loss_mask = labels
        losses = vocab_parallel_cross_entropy(logits.float(), labels).view(-1)
        return torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()

    def optim_param_func(model):
        no_decay = ["bias", "LayerNorm.weight", "layernorm.weight", "norm.weight"]
        return [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                 "weight_decay": 1e-1},
                {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                 "weight_decay": 0.0}]

    import atorch.auto.accelerate as accelerate_module
    accelerate_module.get_ds_dtype = lambda ds_config: torch.float32  # shim 6
    with record_module_init():
        meta_model = LlamaModel(cfg)
    strategy = [("parallel_mode", ([("tensor", TP), ("data", DP), ("pipeline", PP)], None)),
                ("deepspeed_3d_parallel", ds3d)]
    status, result, _ = auto_accelerate(meta_model, torch.optim.AdamW, optim_args={"lr": 1e-2},
                                        optim_param_func=optim_param_func, loss_func=loss_func,
                                        load_strategy=strategy, ignore_dryrun_on_load_strategy=True)
    assert status, result
    engine = result.model
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        batches = []
        for _ in range(2):
            ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=gen)
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                            "position_ids": torch.arange(12).unsqueeze(0), "labels": ids,
                            "loss_mask": torch.ones(1, 12)})
        engine.train_batch(iter(batches))
    engine.save_checkpoint(str(out), tag=f"global_step{STEPS}")
    torch.distributed.barrier()
    mine = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (atorch.distributed.distributed.parallel_rank("tensor"), mine))
    if torch.distributed.get_rank() == 0:
        torch.save(gathered, out / "_ranks.pt")


def expected(out: Path) -> None:
    """HF names from the PipelineModule's parameter names (`tied_modules.embed_tokens.weight`, `<index>.<key>`:
    index 1..L the layers, L+1 the norm), the tp shards concatenated as ATorch's layers cut them."""
    from safetensors.torch import save_file
    layers = hf_config().num_hidden_layers
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, params in torch.load(out / "_ranks.pt"):
        for name, value in params.items():
            if name.startswith("tied_modules."):
                hf = "embed_tokens.weight"
            else:
                idx, key = name.split(".", 1)
                idx = int(idx)
                hf = f"layers.{idx - 1}.{key}" if idx <= layers else "norm." + key
            seen = shards.setdefault("model." + hf, {})
            if tp_rank in seen and not torch.equal(seen[tp_rank], value):
                raise SystemExit(f"replicas of tp rank {tp_rank} disagree on {hf}")
            seen[tp_rank] = value
    got = {}
    for hf, by_rank in shards.items():
        parts = [by_rank[t] for t in sorted(by_rank)]
        axis = (0 if hf.endswith("embed_tokens.weight") or any(f".{c}." in hf for c in COLUMN) else
                1 if any(f".{r}." in hf for r in ROW) else None)
        if axis is None:
            if not all(torch.equal(p, parts[0]) for p in parts):
                raise SystemExit(f"tp ranks disagree on replicated {hf}")
            got[hf] = parts[0]
        else:
            got[hf] = torch.cat(parts, dim=axis)
    (out / "_ranks.pt").unlink()
    save_file({k: v.contiguous() for k, v in got.items()}, out / "expected.safetensors")


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    if cpu_ranks.is_rank():
        run(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    cpu_ranks.launch(__file__, TP * DP * PP, 29561)
    expected(out)
    hf_config().save_pretrained(str(out))
    cpu_ranks.remove_deepspeed_copies(out)
    from importlib.metadata import version
    versions = {p: version(p) for p in ("atorch", "deepspeed", "torch", "transformers")}
    (out / "PROVENANCE").write_text(
        "Made by scripts/make_atorch_ds3d_fixture.py (see its docstring: what it runs, and its 6 shims) with "
        + json.dumps(versions) + ":\n"
        f"  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python scripts/make_atorch_ds3d_fixture.py {sys.argv[1]}\n"
        f"ATorch auto_accelerate deepspeed_3d_parallel of a tiny HF LlamaModel, tensor {TP} x data {DP} x pipeline "
        f"{PP}, ZeRO stage 1, {STEPS} AdamW steps, tag global_step{STEPS}.\n"
        "config.json: the HF model's (saved beside by the script). DeepSpeed's script copies removed.\n"
        "expected.safetensors: the trained weights under HF names, gathered from every rank's parameters in "
        "memory and joined as ATorch's layers split them (embedding with its padded row).\n")


if __name__ == "__main__":
    main()
