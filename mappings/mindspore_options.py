"""The MindSpore format's own options: keywords of `converters/mindspore`'s Reader and Writer, declared
here (torch-free) so that `interop convert --help` lists them without importing the converter."""
from __future__ import annotations

from ..formats import FormatOption
from .megatron_options import ALLOW_IDENTICAL_RANKS, MODEL_CONFIG_HELP, VOCAB_SIZE_HELP
from .mindspore_names import DIALECTS

LAYOUTS = ("grouped", "plain")  # MindFormers w_qkv / w_gate_hidden: per group (r1.5.0 on) or q|k|v (r1.3.x)

OPTIONS = (
    FormatOption("model_config", {"convert": MODEL_CONFIG_HELP, "inspect": MODEL_CONFIG_HELP}, kind="path"),
    FormatOption("vocab_size", {"convert": VOCAB_SIZE_HELP, "inspect": VOCAB_SIZE_HELP}, kind="int"),
    FormatOption("dialect", {"convert": "MindSpore naming dialect."}, choices=tuple(DIALECTS)),
    FormatOption("qkv_concat", {"convert": "MindFormers: fuse q/k/v into w_qkv and gate/up into w_gate_hidden."},
                 kind="flag"),
    FormatOption("qkv_layout", {"convert": "MindFormers w_qkv / w_gate_hidden: grouped (r1.5.0 and later) or plain "
                                           "(r1.3.x)."}, choices=LAYOUTS),
    FormatOption("qkv_bias_layout", {"convert": "MindFormers w_qkv.bias when it differs from the weights "
                                                "(convert_weight.py: plain)."}, choices=LAYOUTS),
    FormatOption("src_qkv_layout", {"convert": "MindSpore -> MindSpore: the source's w_qkv layout (--qkv-layout is "
                                               "then the output's)."}, choices=LAYOUTS),
    FormatOption("src_qkv_bias_layout", {"convert": "MindSpore -> MindSpore: the source's w_qkv.bias layout."},
                 choices=LAYOUTS),
    FormatOption("dp", {"convert": "MindSpeed: the run's data-parallel size (x context-parallel); numbers rank_N."},
                 kind="int"),
    FormatOption("noop_layers", {"convert": "MindSpeed: noop layer positions (e.g. 62,63): the layers numbered by "
                                            "position among the real and noop ones, as its --noop-layers run saves."}),
    ALLOW_IDENTICAL_RANKS,
)
