"""MindSpeed-LLM's torch checkpoints, written as its own HF -> Megatron converter writes them (`--fork mindspeed-llm`).

MindSpeed-LLM (the Megatron-LM fork Ascend users train DeepSeek-V3 with) loads the rank files its
`convert_ckpt_v2.py` writes (Ascend/MindSpeed-LLM mindspeed_llm/tasks/checkpoint/convert_hf2mg.py Hf2MgConvert and
model_builder.py MegatronModel, at c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91); they differ from megatron-core's:
- multi-latent attention: `linear_qkv` = [q_a; kv_a] whole on every TP rank, `linear_q_up_proj` /
  `linear_kv_up_proj`, `q_layernorm` / `kv_layernorm` (`mappings/megatron_names.py` MINDSPEED_LLM_MLA, the table
  the reader reads them with);
- `--mla-mm-split`: the up projections as bands of each head's rows, `linear_qk_nope` / `linear_qk_rope` (q_up) and
  `linear_kv_nope` / `linear_v` (kv_up), each cut by heads over tp (`interop.transforms.HeadRows`);
- routed experts (`--moe-grouped-gemm`, local spec): the legacy GroupedMLP's `experts.weight1` / `weight2`;
- MTP: `final_layernorm.weight` for the model's final norm, `mtp.final_layernorms.K.weight` per module;
- no `_extra_state` entries; the vocabulary unpadded (its recipes train with `--padded-vocab-size` = the vocab and
  `--make-vocab-size-divisible-by 1`; it cuts the rows with torch.chunk, so the vocab must divide by tp);
- the weights only (its converter writes no optimizer; a source's moments are noted as left out);
- `--noop-layers` (identity layers without weights at the given layer positions, counted in num_layers): the
  positions split evenly over the stages (and virtual chunks), each chunk's real layers numbered by their position
  in it, the noop positions' numbers left out (convert.py generate_pp_local_layer_idx /
  generate_vpp_local_layer_idx; `noop_layout`);
- `iter_0000001` and a tracker saying 1 (no newline) unless an iteration is asked for or the source has one;
- its args namespace holds, besides Megatron's arguments, the converter's own model fields (`qkv_type`,
  `first_k_dense_replace`, `n_shared_experts`, `num_layer_list`, `mla_mm_split`, ...), which its
  Mg2HfConvert reads back.
tests/formats/test_mindspeed_llm_writer.py compares every tensor with what MindSpeed-LLM's own converter wrote.
"""
from __future__ import annotations

from ...errors import InteropError
from ...layout import ParallelLayout
from ...mappings.megatron_names import MINDSPEED_LLM_LAYER_ORDER, MINDSPEED_LLM_MTP_ORDER
from ...params import TensorKey, base_param_name
from . import torch_format
from .rows import expand_rows


# args its Mg2HfConvert tests by presence (convert_mg2hf.py: hasattr(self.load_model, "router_bias") pops
# `router.expert_bias`, hasattr(..., "add_qkv_bias") the qkv biases): written only where true
PRESENCE_ARGS = ("router_bias", "add_qkv_bias")


class Writer(torch_format.Writer):
    """Megatron's torch-format writer, in MindSpeed-LLM's names and conventions."""

    options = ("iteration", "noop_layers", "mla_mm_split")
    experts = "grouped"
    extra_state = False
    tracker_newline = False  # convert.py mg_path_process: f.write("1")

    @staticmethod
    def build_layout(num_layers: int, sizes: dict, options: dict) -> ParallelLayout:
        """The layout of `num_layers` real layers at `sizes`, with the noop positions `--noop-layers` gives."""
        noop = noop_positions(options.get("noop_layers"), num_layers)
        if not noop:
            return ParallelLayout.build(num_layers, **sizes)
        return noop_layout(num_layers, noop, sizes)[0]

    def __init__(self, root, spec, layout, metas, iteration: int | None = None, noop_layers: str | None = None,
                 mla_mm_split: bool | None = None, only=None):
        if mla_mm_split and not (spec.is_mla and spec.q_lora_rank):
            raise InteropError("--mla-mm-split splits multi-latent attention's query and key/value up projections: "
                               "the model has " + ("no query compression (q_lora_rank), which MindSpeed-LLM's "
                                                   "converter does not split" if spec.is_mla else
                                                   "no multi-latent attention"))
        self.mm_split = bool(mla_mm_split)
        if spec.vocab % layout.tp:
            raise InteropError(f"--fork mindspeed-llm stores the vocabulary unpadded, cut in tp equal parts: "
                               f"{spec.vocab} tokens do not divide by tp {layout.tp}")
        self.noop = noop_positions(noop_layers, spec.num_layers)
        self.numbers = None
        if self.noop:
            sizes = dict(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, etp=layout.etp)
            want, self.numbers = noop_layout(spec.num_layers, self.noop, sizes)
            if want.stages != layout.stages:
                raise InteropError(f"--noop-layers {noop_layers}: the layout {layout.describe()} is not the one its "
                                   f"noop positions give ({want.describe()})")
        self.padded_rows = spec.padded_vocab
        super().__init__(root, spec.replace(padded_vocab=spec.vocab), layout, metas, iteration=iteration, only=only)
        if self.optim_kinds:  # weights only, as its converter writes (convert_hf2mg.py: no optimizer entry)
            self.notes.append(f"optimizer state not written ({', '.join(self.optim_kinds)}): MindSpeed-LLM's "
                              "converter writes weights only; keep it with --to megatron (megatron-core's names)")
            self.optim_kinds = []
        if self.padded_rows > spec.vocab:
            self.notes.append(f"stored the {spec.vocab} vocabulary rows unpadded, as MindSpeed-LLM's converter does "
                              f"(train with --padded-vocab-size {spec.vocab} --make-vocab-size-divisible-by 1)")
        if self.noop:
            self.notes.append(f"noop layers at positions {_text(self.noop)}: num_layers "
                              f"{spec.num_layers + len(self.noop)} in the args, the {spec.num_layers} real layers at "
                              f"the other positions (train with --num-layers {spec.num_layers + len(self.noop)} "
                              f"--noop-layers {_text(self.noop)})")

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim and super().wants(name)

    def _iteration(self, state: dict) -> int:
        """--iteration or the source's when it is a training step, else 1 (convert.py mg_path_process: iter_0000001;
        Megatron-LM's read_metadata refuses an iteration 0 that is not `release`)."""
        iteration = super()._iteration(state)
        return iteration if isinstance(iteration, int) and iteration > 0 else 1

    def _expand_rows(self, te: bool) -> list:
        scheme = "mindspeed_llm_mm" if self.mm_split else "mindspeed_llm"
        return expand_rows(scheme, self.spec, self.layout, self.experts, numbers=self.numbers)

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
            moe_grouped_gemm=spec.is_moe, mla_mm_split=self.mm_split, mtp_num_layers=spec.mtp_layers,
            **self._noop_args(vars(args), dense),
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
        source = (state.get("megatron") or {}).get("args") or {}
        if source.get("mla_mm_split") and not self.mm_split:
            notes = notes + ["the source's --mla-mm-split layout was not kept (the up projections written whole, "
                             "linear_q_up_proj / linear_kv_up_proj): pass --mla-mm-split to keep it"]
        source_noop = source.get("noop_layers")
        if source_noop and not self.noop:
            notes = notes + [f"the source's noop layers ({source_noop}: identity layers without weights) were not "
                             f"kept: its {spec.num_layers} real layers are written as num_layers {spec.num_layers}; "
                             f"pass --noop-layers {source_noop} to keep them"]
        return args, iteration, scheduler, notes

    def _noop_args(self, args: dict, dense: int) -> dict:
        """num_layers counting the noop layers and their positions, as its converter states them (the noop
        positions in a per-layer moe_layer_freq list take the first_k_dense_replace rule's value)."""
        if not self.noop:
            return {"noop_layers": None}
        positions = self.spec.num_layers + len(self.noop)
        out = {"noop_layers": _text(self.noop), "num_layers": positions}
        if self.layout.vpp > 1:
            out["num_layers_per_virtual_pipeline_stage"] = positions // self.layout.pp // self.layout.vpp
        freq = args.get("moe_layer_freq")
        if isinstance(freq, list):
            real = iter(freq)
            out["moe_layer_freq"] = [int(i >= dense) if i in self.noop else next(real) for i in range(positions)]
        return out


def _text(noop: tuple) -> str:
    return ",".join(map(str, noop))


def noop_positions(text: str | None, num_layers: int) -> tuple:
    """`--noop-layers`' positions (sorted), checked: distinct numbers below num_layers + their count (the
    positions num_layers counts with them)."""
    if text is None:
        return ()
    try:
        noop = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise InteropError(f"--noop-layers {text}: expected layer positions separated by commas (e.g. 1,5)") from None
    positions = num_layers + len(noop)
    bad = [n for n in noop if not 0 <= n < positions]
    if bad or len(set(noop)) != len(noop):
        why = f"{bad[0]} is not a position" if bad else "a position is repeated"
        raise InteropError(f"--noop-layers {text}: {why} (the model's {num_layers} layers and {len(noop)} noop "
                           f"layers make positions 0..{positions - 1})")
    return tuple(sorted(noop))


def noop_layout(num_layers: int, noop: tuple, sizes: dict) -> tuple[ParallelLayout, dict]:
    """The layout and {(stage, chunk): local layer numbers} of `num_layers` real layers among the noop
    positions: the positions split evenly over pp x vpp chunks in Megatron's interleaved order, each chunk's
    real layers numbered by their position in it (convert_hf2mg.py get_pprank_hf_layeridxs /
    get_vpprank_hf_layeridxs; convert.py generate_pp_local_layer_idx / generate_vpp_local_layer_idx)."""
    if sizes.get("first_stage_layers") is not None or sizes.get("last_stage_layers") is not None:
        raise InteropError("--noop-layers cannot be combined with --first-stage-layers / --last-stage-layers "
                           "(MindSpeed-LLM's converter: num_layer_list and noop_layers cannot be configured at the "
                           "same time)")
    pp, vpp = sizes.get("pp", 1), sizes.get("vpp", 1)
    positions = num_layers + len(noop)
    if positions % (pp * vpp):
        raise InteropError(f"--noop-layers {_text(noop)}: {positions} layer positions ({num_layers} layers and "
                           f"{len(noop)} noop) do not split evenly over pp={pp} x vpp={vpp} chunks")
    per = positions // (pp * vpp)
    stages, numbers, start = [[None] * vpp for _ in range(pp)], {}, 0
    for c in range(pp * vpp):
        p, v = c % pp, c // pp
        numbers[(p, v)] = [i % per for i in range(c * per, (c + 1) * per) if i not in noop]
        stages[p][v] = (start, start + len(numbers[(p, v)]))
        start += len(numbers[(p, v)])
    empty = [p for p in range(pp) if not any(numbers[(p, v)] for v in range(vpp))]
    if empty:
        raise InteropError(f"--noop-layers {_text(noop)}: pipeline stage {empty[0]} would hold noop layers only "
                           f"({per * vpp} positions a stage)")
    layout = ParallelLayout(sizes.get("tp", 1), pp, tuple(tuple(c) for c in stages), sizes.get("ep", 1),
                            sizes.get("etp"))
    return layout, numbers


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
