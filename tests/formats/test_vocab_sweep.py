"""Every reader x every writer with a vocabulary that every tensor-parallel layout pads.

The source's vocabulary (1001 tokens; and 32001) is padded at the source's tp 2 (Megatron: 1024 rows, a
multiple of 128 x tp; MindSpeed and the common format: 1002, a multiple of tp) and again, differently, at the
target's tp 4 (Megatron 1024, MindSpeed 1004); HF and MindFormers (which keeps such a vocabulary whole) hold the
1001 true rows.  Each source goes to each writer and
back to its own format and layout, and must equal the original: the true rows exactly, the padding zero
as the HF-built original has it (a format that pads more, say Megatron's 1024 for MindSpore's 1002, leaves
its extra zero rows: writers keep a source's padding where their tp divides it, so that Megatron's own
non-zero padding survives a round trip through them).  DeepSpeed is a reader only, with its own real-tool
fixtures (tests/formats/test_deepspeed.py).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from interop.convert import convert
from interop.formats import converter

VOCABS = (1001, 32001)  # 32001: Llama-2's 32000 plus one added token

# name: (format, options to write it, tp)
FORMATS = {
    "hf": ("hf", {}, 1),
    "megatron": ("megatron", {}, 2),
    "megatron-dist": ("megatron", {"format": "torch_dist"}, 2),
    "mindspeed": ("mindspore", {"dialect": "mindspeed"}, 2),
    "mindformers": ("mindspore", {"dialect": "mindformers"}, 2),
    "interop": ("interop", {}, 2),
}
TARGET_TP = 4
# MindFormers' Llama keeps a vocabulary tp does not divide whole, unpadded (its operators' strategies:
# tests/formats/test_mindformers_vocab_tp.py); 1001 and 32001 divide by neither tp here
WHOLE = ("hf", "mindformers")
VOCAB_TENSORS = ("embed.word.weight", "lm_head.weight")  # canonical names: their rows are the vocabulary


def _hf_llama(path, vocab: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                      intermediate_size=64, vocab_size=vocab, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=VOCABS)
def sources(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"sweep{request.param}")
    _hf_llama(root / "hf", request.param)
    for name, (fmt, options, tp) in FORMATS.items():
        if name != "hf":
            convert(root / "hf", root / name, dst_format=fmt, tp=tp, options=options)
    return root, request.param


def _tensors(fmt: str, path) -> tuple[dict, int]:
    reader = converter(fmt).Reader(path)
    try:
        return {m.name: reader.read(m.name).clone() for m in reader.metas()}, reader.source.spec.padded_vocab
    finally:
        reader.close()


@pytest.mark.parametrize("src", list(FORMATS))
def test_every_writer_and_back_equals_the_original(sources, tmp_path, src):
    sources, vocab = sources
    fmt, options, tp = FORMATS[src]
    original, rows = _tensors(fmt, sources / src)
    assert rows > vocab or src in WHOLE  # the source itself holds padding rows (HF, MindFormers: the true vocabulary)
    for dst, (dst_fmt, dst_options, dst_tp) in FORMATS.items():
        target_tp = 1 if dst == "hf" else TARGET_TP
        out, back = tmp_path / f"{dst}", tmp_path / f"{dst}-back"
        convert(sources / src, out, dst_format=dst_fmt, tp=target_tp, options=dst_options)
        _, out_rows = _tensors(dst_fmt, out)
        # HF, MindFormers: the true vocabulary; Megatron: a multiple of 128 x tp; MindSpeed, the common format: of tp
        # (the source's rows where tp divides them)
        step = 1 if dst in WHOLE else 128 * target_tp if dst_fmt == "megatron" else target_tp
        assert out_rows % step == 0 and vocab <= out_rows < max(rows + 1, vocab + step), (src, dst, out_rows)
        convert(out, back, dst_format=fmt, tp=tp, options=options)
        again, again_rows = _tensors(fmt, back)
        assert sorted(again) == sorted(original), (src, dst)
        # a writer keeps padding rows it can (a lossless Megatron -> MindSpore -> Megatron), so a round trip through
        # a format that pads more comes back with those rows: all zero, as the original's are
        assert again_rows == rows or again_rows == out_rows, (src, dst, again_rows)
        for name, tensor in original.items():
            if name in VOCAB_TENSORS:
                assert torch.equal(again[name][:vocab], tensor[:vocab]), (src, dst, name)
                assert not tensor[vocab:].any() and not again[name][vocab:].any(), (src, dst, name)
            else:
                assert torch.equal(again[name], tensor), (src, dst, name)
