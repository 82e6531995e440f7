"""The Megatron format's own options: keywords of `converters/megatron`'s Reader and Writer, declared
here (torch-free) so that `interop convert --help` lists them without importing the converter."""
from __future__ import annotations

from ..formats import FormatOption

# A model description for a checkpoint that carries none: the Megatron and MindSpore readers take it
# (interop.model_config reads every format map-args reads).
MODEL_CONFIG_HELP = ("Model description for a checkpoint that carries none (HF config.json, Megatron args file or "
                     "MindSpeed / MindFormers YAML).")

# The true vocabulary: the embedding's rows in the files are the padded size, whatever the args say.
VOCAB_SIZE_HELP = ("The true vocabulary (tokens): the embedding rows in the files beyond it are padding, whatever "
                   "the checkpoint's args say its padded_vocab_size is.")

# Rank files that are copies of another rank's (interop.distinct_ranks): the Megatron torch, MindSpore and
# DeepSpeed pipeline readers take it (DeepSpeed declares no options module: this text names it).
ALLOW_IDENTICAL_RANKS = FormatOption(
    "allow_identical_ranks", {"convert": "Megatron torch, MindSpore or DeepSpeed pipeline source: read a rank file "
                                         "whose split tensors (or routed experts) are all byte-identical to another "
                                         "rank's (refused by default: a copied file, not a model)."}, kind="flag")

OPTIONS = (
    FormatOption("format", {"convert": "Megatron on-disk format to write (default: torch)."},
                 choices=("torch", "torch_dist")),
    FormatOption("iteration", {"convert": "Megatron iteration to read (default: the tracker's).",
                               "inspect": "Megatron iteration to describe (default: the tracker's)."}, kind="int"),
    FormatOption("distributed_optimizer", {"convert": "Megatron output: write the optimizer in the distributed "
                                                      "optimizer's layout: torch_dist fully_reshardable (default "
                                                      "there: as the source was saved), or the torch format's "
                                                      "distrib_optim.pt laid out for --dp N."}, kind="switch"),
    FormatOption("model_config", {"convert": MODEL_CONFIG_HELP, "inspect": MODEL_CONFIG_HELP}, kind="path"),
    FormatOption("vocab_size", {"convert": VOCAB_SIZE_HELP, "inspect": VOCAB_SIZE_HELP}, kind="int"),
    ALLOW_IDENTICAL_RANKS,
    FormatOption("transformer_impl", {"convert": "Megatron output: the layer spec whose names it is written in, local "
                                                 "(default) or transformer_engine (Megatron-LM's default on GPUs: its "
                                                 "norms fused into the next linear; multi-latent attention's "
                                                 "torch_dist names differ between the two)."},
                 choices=("local", "transformer_engine")),
    FormatOption("fork", {"convert": "Megatron output: whose converter's layout to write: megatron-lm (default) or "
                                     "mindspeed-llm (MindSpeed-LLM's convert_ckpt_v2: torch rank files with MLA's "
                                     "fused linear_qkv, grouped experts weight1/weight2, the vocabulary unpadded)."},
                 choices=("megatron-lm", "mindspeed-llm")),
    FormatOption("noop_layers", {"convert": "Megatron output with --fork mindspeed-llm: MindSpeed-LLM's --noop-layers, "
                                            "identity layers without weights at these layer positions (e.g. 1,5), "
                                            "counted in num_layers, the positions split evenly over the stages."}),
    FormatOption("mla_mm_split", {"convert": "Megatron output with --fork mindspeed-llm: MindSpeed-LLM's "
                                             "--mla-mm-split, multi-latent attention's up projections stored as "
                                             "linear_qk_nope / linear_qk_rope and linear_kv_nope / linear_v."},
                 kind="flag"),
    FormatOption("dp", {"convert": "Megatron torch format with --distributed-optimizer: the dp distrib_optim.pt is "
                                   "laid out for."}, kind="int"),
)
