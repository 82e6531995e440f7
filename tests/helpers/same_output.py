"""A small HF checkpoint written without transformers, and the byte comparison of two conversion outputs."""
from __future__ import annotations
import zipfile
from pathlib import Path
import torch
from interop.io.megatron_dist import _MetadataUnpickler
from interop.io.safetensors import SafetensorsWriter


H, FFN, HEADS, KV, VOCAB, LAYERS = 64, 96, 8, 4, 256, 4


EXPERTS = 4


def _write_hf(path: Path, experts: int = 0) -> None:
    """A small HF Llama, or Mixtral with `experts` (bf16, random), written directly: no transformers import."""
    import json
    path.mkdir()
    d = H // HEADS
    entries = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        entries += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (H, H)),
                    (p + "self_attn.k_proj.weight", (KV * d, H)), (p + "self_attn.v_proj.weight", (KV * d, H)),
                    (p + "self_attn.o_proj.weight", (H, H)), (p + "post_attention_layernorm.weight", (H,))]
        if experts:
            entries.append((p + "block_sparse_moe.gate.weight", (experts, H)))
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                entries += [(q + "w1.weight", (FFN, H)), (q + "w2.weight", (H, FFN)), (q + "w3.weight", (FFN, H))]
        else:
            entries += [(p + "mlp.gate_proj.weight", (FFN, H)), (p + "mlp.up_proj.weight", (FFN, H)),
                        (p + "mlp.down_proj.weight", (H, FFN))]
    entries += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    writer = SafetensorsWriter(path / "model.safetensors", [(k, torch.bfloat16, s) for k, s in entries],
                               {"format": "pt"})
    gen = torch.Generator().manual_seed(0)
    for key, shape in entries:
        writer.write(key, torch.randn(shape, generator=gen).to(torch.bfloat16))
    writer.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    if experts:
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      num_experts_per_tok=2, sliding_window=None)
    (path / "config.json").write_text(json.dumps(config))


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _same_torch_file(a: Path, b: Path) -> None:
    """Same zip records at the same offsets with the same bytes; the random serialization id aside."""
    assert a.stat().st_size == b.stat().st_size
    with zipfile.ZipFile(a) as x, zipfile.ZipFile(b) as y:
        xs, ys = x.infolist(), y.infolist()
        assert [(i.filename, i.header_offset, i.file_size) for i in xs] == \
               [(i.filename, i.header_offset, i.file_size) for i in ys]
        for info in xs:
            if not info.filename.endswith(".data/serialization_id"):
                assert x.read(info.filename) == y.read(info.filename), (a, info.filename)


def _same_dcp_metadata(a: Path, b: Path) -> None:
    """Same chunks, same files and byte ranges, in the same order; storage_meta (save id, path) aside."""
    with open(a, "rb") as f:
        x = _MetadataUnpickler(f).load()
    with open(b, "rb") as f:
        y = _MetadataUnpickler(f).load()
    assert list(x.storage_data.items()) == list(y.storage_data.items())
    assert list(x.state_dict_metadata.items()) == list(y.state_dict_metadata.items())
    assert x.version == y.version and x.planner_data == y.planner_data


def assert_same_output(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert list(fa) == list(fb)
    for name, path in fa.items():
        if path.name == ".metadata":
            _same_dcp_metadata(path, fb[name])
        elif path.suffix == ".pt" and zipfile.is_zipfile(path):
            _same_torch_file(path, fb[name])
        else:
            assert path.read_bytes() == fb[name].read_bytes(), name
