"""A canonical checkpoint of a tiny MoE model with random weights, for the MindSpore MoE tests."""
import json
import torch
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreWriter
from interop.tensors import TensorMeta


BASE = dict(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=4, head_dim=8, vocab=250,
            padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope",
            tied_embeddings=False, num_experts=4, moe_topk=2, moe_ffn_hidden=96)


def moe_store(path, base=BASE, seed=5, **changes):
    """A canonical checkpoint of a tiny model (`base`: a tiny MoE Llama) with random weights, and its spec
    beside it as `<name>-spec.json`: (path, spec, {name: tensor})."""
    spec = ModelSpec(**{**base, **changes})
    g = torch.Generator().manual_seed(seed)
    tensors = {p.name: torch.randn(p.shape, generator=g) for p in param_table(spec)}
    path.mkdir()
    writer = StoreWriter(path, spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(n, torch.float32, tuple(t.shape)) for n, t in tensors.items()])
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    (path.parent / f"{path.name}-spec.json").write_text(json.dumps({"spec": spec.to_dict()}))
    return path, spec, tensors
