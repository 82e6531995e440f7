"""megatron-core's `dist_checkpointing.load` of a LoRA adapter at tp 2, with the sharded tensors Megatron-Bridge's
`ParallelLinearAdapter` declares (NVIDIA-NeMo/Megatron-Bridge 067f987, src/megatron/bridge/peft/utils.py: linear_in /
linear_out as megatron-core ColumnParallelLinear / RowParallelLinear by `input_is_parallel`, their own
`sharded_state_dict` under `<module>.adapter.`, `apply_swiglu_sharded_factory` on linear_fc1's linear_out), in a
layer-stacked block (TransformerBlock's sharded offsets `(0, layer, num_layers)`).  Rebuilt from megatron-core's
own layers here because Megatron-Bridge is not installed; runs in 2 spawned gloo processes on CPU."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from helpers.megatron_ref import free_port, patch_cpu

MODULES = {  # module: (input_is_parallel, in, out) in terms of the dims
    "self_attention.linear_qkv": (False, "h", "qkv"),
    "self_attention.linear_proj": (True, "heads_d", "h"),
    "mlp.linear_fc1": (False, "h", "fc1"),
    "mlp.linear_fc2": (True, "ffn", "h"),
}


def _adapter_sd(module: str, dims: dict, config, layer: int):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    parallel, n_in, n_out = MODULES[module]
    r, n_in, n_out = dims["r"], dims[n_in], dims[n_out]
    init = torch.nn.init.zeros_
    if parallel:  # utils.py: input_is_parallel -> RowParallelLinear(in, dim)
        linear_in = RowParallelLinear(n_in, r, config=config, input_is_parallel=True, skip_bias_add=True, bias=False,
                                      init_method=init)
    else:
        linear_in = ColumnParallelLinear(n_in, r, config=config, bias=False, gather_output=True, init_method=init)
    linear_out = ColumnParallelLinear(r, n_out, config=config, bias=False, gather_output=parallel, init_method=init)
    prefix = f"decoder.layers.{module}.adapter."
    offsets = ((0, layer, dims["L"]),)
    metadata = ensure_metadata_has_dp_cp_group(None)  # what a GPTModel passes down
    sd = dict(linear_in.sharded_state_dict(f"{prefix}linear_in.", offsets, metadata))
    out_sd = dict(linear_out.sharded_state_dict(f"{prefix}linear_out.", offsets, metadata))
    if module == "mlp.linear_fc1":  # gated: utils.py split_swiglu
        out_sd[f"{prefix}linear_out.weight"] = apply_swiglu_sharded_factory(out_sd[f"{prefix}linear_out.weight"],
                                                                            offsets)
    sd.update(out_sd)
    # checkpointing.py apply_peft_adapter_filter_to_state_dict: no _extra_state in an adapter checkpoint
    return {k: v for k, v in sd.items() if "_extra_state" not in k}


def _worker(rank: int, world: int, port: int, folder: str, dims: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                     params_dtype=torch.float32, gradient_accumulation_fusion=False)
        want = {f"{layer}/{k}": v for module in MODULES for layer in range(dims["L"])
                for k, v in _adapter_sd(module, dims, config, layer).items()}
        got = dist_checkpointing.load({"model": want}, folder)["model"]
        loaded = {(k.split("/", 1)[1], int(k.split("/", 1)[0])): v.clone() for k, v in got.items()}
        torch.save(loaded, Path(out) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def load_at_tp2(folder, dims: dict, out) -> list[dict]:
    """Each tp rank's local adapter tensors {(key, layer): tensor} as megatron-core loads them for Bridge's
    modules at tp 2 from the torch_dist iteration folder `folder`."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, free_port(), str(folder), dims, str(out)), nprocs=2, join=True)
    return [torch.load(Path(out) / f"rank{t}.pt") for t in range(2)]
