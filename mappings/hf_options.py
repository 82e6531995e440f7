"""The Hugging Face format's own options: keywords of `converters/hf.py`'s Writer, declared here
(torch-free) so that `interop convert --help` lists them without importing the converter."""
from __future__ import annotations

from ..formats import FormatOption

OPTIONS = (
    FormatOption("tokenizer", {"convert": "HF output: a tokenizer directory, or one tokenizer file (Megatron's "
                                          "--tokenizer-model sentencepiece model, or a tokenizer.json). An HF "
                                          "source's own tokenizer is carried without it."}, kind="path"),
    FormatOption("renormalize_topk", {"convert": "HF output of a MoE model whose router leaves the top-k "
                                                 "probabilities unnormalised (moe_router_pre_softmax): write HF "
                                                 "Mixtral anyway, whose router renormalises them (a note; the "
                                                 "outputs change)."}, kind="flag"),
    FormatOption("max_shard_size", {"convert": "HF output: largest weight file, e.g. 5GB or 500MB (transformers' "
                                               "style); sharded output gets model.safetensors.index.json. [5GiB]"}),
    FormatOption("family", {"convert": "HF output: the model_type to write where several HF families hold the "
                                       "model's facts (phi3 stores a Llama / Mistral model with fused qkv_proj and "
                                       "gate_up_proj); a family that cannot hold the model is refused. [the one "
                                       "the facts pick]"}),
)
