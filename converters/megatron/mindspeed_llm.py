"""MindSpeed-LLM's torch checkpoints, written as its own HF -> Megatron converter writes them (`--fork mindspeed-llm`).

MindSpeed-LLM (the Megatron-LM fork Ascend users train DeepSeek-V3 with) loads the rank files its
`convert_ckpt_v2.py` writes (Ascend/MindSpeed-LLM mindspeed_llm/tasks/checkpoint/convert_hf2mg.py Hf2MgConvert and
model_builder.py MegatronModel, at c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91); they differ from megatron-core's:
- multi-latent attention: `linear_qkv` = [q_a; kv_a] whole on every TP rank, `linear_q_up_proj` /
  `linear_kv_up_proj`, `q_layernorm` / `kv_layernorm` (`mappings/megatron_names.py` MINDSPEED_LLM_MLA, the table
  the reader reads them with);
- routed experts (`--moe-grouped-gemm`, local spec): the legacy GroupedMLP's `experts.weight1` / `weight2`;
- MTP: `final_layernorm.weight` for the model's final norm, `mtp.final_layernorms.K.weight` per module;
- no `_extra_state` entries; the vocabulary unpadded (its recipes train with `--padded-vocab-size` = the vocab and
  `--make-vocab-size-divisible-by 1`; it cuts the rows with torch.chunk, so the vocab must divide by tp);
- the weights only (its converter writes no optimizer; a source's moments are noted as left out);
- `iter_0000001` and a tracker saying 1 (no newline) unless an iteration is asked for or the source has one;
- its args namespace holds, besides Megatron's arguments, the converter's own model fields (`qkv_type`,
  `first_k_dense_replace`, `n_shared_experts`, `num_layer_list`, `mla_mm_split`, ...), which its
  Mg2HfConvert reads back.
tests/formats/test_mindspeed_llm_writer.py compares every tensor with what MindSpeed-LLM's own converter wrote.
"""
from __future__ import annotations

from ...errors import InteropError
from ...mappings.megatron_names import MINDSPEED_LLM_LAYER_ORDER, MINDSPEED_LLM_MTP_ORDER
from ...params import TensorKey, base_param_name
from . import torch_format
from .rows import expand_rows


# args its Mg2HfConvert tests by presence (convert_mg2hf.py: hasattr(self.load_model, "router_bias") pops
# `router.expert_bias`, hasattr(..., "add_qkv_bias") the qkv biases): written only where true
PRESENCE_ARGS = ("router_bias", "add_qkv_bias")


class Writer(torch_format.Writer):
    """Megatron's torch-format writer, in MindSpeed-LLM's names and conventions."""

    options = ("iteration",)
    experts = "grouped"
    extra_state = False
    tracker_newline = False  # convert.py mg_path_process: f.write("1")

    def __init__(self, root, spec, layout, metas, iteration: int | None = None, only=None):
        if spec.vocab % layout.tp:
            raise InteropError(f"--fork mindspeed-llm stores the vocabulary unpadded, cut in tp equal parts: "
                               f"{spec.vocab} tokens do not divide by tp {layout.tp}")
        self.padded_rows = spec.padded_vocab
        super().__init__(root, spec.replace(padded_vocab=spec.vocab), layout, metas, iteration=iteration, only=only)
        if self.optim_kinds:  # weights only, as its converter writes (convert_hf2mg.py: no optimizer entry)
            self.notes.append(f"optimizer state not written ({', '.join(self.optim_kinds)}): MindSpeed-LLM's "
                              "converter writes weights only; keep it with --to megatron (megatron-core's names)")
            self.optim_kinds = []
        if self.padded_rows > spec.vocab:
            self.notes.append(f"stored the {spec.vocab} vocabulary rows unpadded, as MindSpeed-LLM's converter does "
                              f"(train with --padded-vocab-size {spec.vocab} --make-vocab-size-divisible-by 1)")

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim and super().wants(name)

    def _iteration(self, state: dict) -> int:
        """--iteration or the source's when it is a training step, else 1 (convert.py mg_path_process: iter_0000001;
        Megatron-LM's read_metadata refuses an iteration 0 that is not `release`)."""
        iteration = super()._iteration(state)
        return iteration if isinstance(iteration, int) and iteration > 0 else 1

    def _expand_rows(self, te: bool) -> list:
        return expand_rows("mindspeed_llm", self.spec, self.layout, self.experts)

    def _vocab_rows(self, name: str, tensor):
        """The unpadded rows of a vocabulary tensor (the engine padded it for Megatron's divisor)."""
        base = self.row_of[base_param_name(name)].parts[0]
        if self.index[base].split == "vocab" and tensor.shape[0] > self.spec.vocab:
            return tensor[:self.spec.vocab]
        return tensor

    def write(self, name: str, tensor) -> None:
        super().write(name, self._vocab_rows(name, tensor))

    def _model_dict(self, t: int, p: int, v: int, e: int):
        """Rank (t, p, e)'s state dict in the order MindSpeed-LLM's converter fills it (MINDSPEED_LLM_LAYER_ORDER)."""
        out = super()._model_dict(t, p, v, e)
        return type(out)(sorted(out.items(), key=lambda item: _write_order(item[0], p)))

    def _final(self, state: dict) -> tuple:
        args, iteration, scheduler, notes = super()._final(state)
        spec, layout = self.spec, self.layout
        per_stage = [sum(b - a for a, b in chunks) for chunks in layout.stages]
        dense = next((i for i in range(spec.num_layers) if spec.is_moe_layer(i)), spec.num_layers)
        vars(args).update(
            padded_vocab_size=spec.vocab, make_vocab_size_divisible_by=1,
            num_layer_list=",".join(map(str, per_stage)) if len(set(per_stage)) > 1 and layout.vpp == 1 else None,
            decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
            moe_grouped_gemm=spec.is_moe, mla_mm_split=False, noop_layers=None, mtp_num_layers=spec.mtp_layers,
            # the converter's own model fields (model_builder.py, model_cfg.json deepseek3), read by its Mg2HfConvert
            qkv_type="pack_mla" if spec.is_mla else "unpack", num_key_value_heads=spec.kv_groups)
        if spec.is_moe:
            shared = spec.shared_expert_ffn_hidden
            vars(args).update(first_k_dense_replace=dense, router_bias=spec.moe_router_bias,
                              norm_topk_prob=spec.moe_norm_topk,  # its --norm-topk-prob
                              n_shared_experts=shared // spec.moe_ffn_hidden if shared else None)
        for flag in PRESENCE_ARGS:
            if not vars(args).get(flag):
                vars(args).pop(flag, None)
        return args, iteration, scheduler, notes


def _in_layer(rest: str) -> int:
    return next((n for n, start in enumerate(MINDSPEED_LLM_LAYER_ORDER) if rest.startswith(start)),
                len(MINDSPEED_LLM_LAYER_ORDER))


def _write_order(key: str, stage: int) -> tuple:
    """Where convert_hf2mg.py puts `key` in stage `stage`'s state dict: the embedding, the MTP modules, the decoder
    layers, the final norm, the output layer."""
    parts = key.split(".")
    if key.startswith("embedding."):  # the last stage's copy belongs to the first MTP module's preprocess
        return (0,) if stage == 0 else (1, 0, len(MINDSPEED_LLM_MTP_ORDER))
    if key.startswith("mtp.final_layernorms."):
        return (1, int(parts[2]), len(MINDSPEED_LLM_MTP_ORDER) + 2)
    if key.startswith("mtp.layers."):
        k, rest = int(parts[2]), ".".join(parts[3:])
        if rest.startswith("transformer_layer."):
            return (1, k, len(MINDSPEED_LLM_MTP_ORDER) + 1, _in_layer(rest[len("transformer_layer."):]))
        return (1, k, next((n for n, start in enumerate(MINDSPEED_LLM_MTP_ORDER) if rest.startswith(start)), 99))
    if key.startswith("decoder.layers."):
        return (2, int(parts[2]), _in_layer(".".join(parts[3:])))
    return (3, key.startswith("output_layer."))  # the final norm, then the head
