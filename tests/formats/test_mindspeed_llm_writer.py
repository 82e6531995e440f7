"""MindSpeed-LLM's DeepSeek-V3 torch checkpoints, written (`--to megatron --fork mindspeed-llm`) and read.

The oracle is MindSpeed-LLM's own HF -> Megatron converter, run on CPU by scripts/make_mindspeed_llm_fixtures.py
(Ascend/MindSpeed-LLM convert_ckpt_v2.py -> mindspeed_llm/tasks/checkpoint/convert_hf2mg.py Hf2MgConvert,
model_builder.py MegatronModel, configs/checkpoint/model_cfg.json `deepseek3`, at commit
c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91) over helpers/deepseek_models.py's tiny DeepSeek-V3 (vocab 1000, the
first layer dense, 8 experts, fp32, --moe-grouped-gemm) in three layouts: tp 2, pp 2 with --num-layer-list 1,3, ep 2, --mtp-num-layers 1
(mp_rank_TT_PPP_EEE); tp 1, pp 2, --num-layers-per-virtual-pipeline-stage 1 with MTP (model0 / model1); tp 2,
ep 2 without MTP (mp_rank_TT_EEE); DeepSeek-V2-Lite (no query compression: `linear_qkv` = [q_proj; kv_a], whole on
every rank; --model-type-hf deepseek2-lite) at tp 2, pp 2, ep 2; --noop-layers 1,5 at pp 2 (stage 0's real layers
numbered 0 and 2) and --noop-layers 4,5 over 6 layers at pp 2 with 2-layer virtual chunks (stage 0's second chunk
`model1` empty), written by interop with the same --noop-layers; --mla-mm-split at tp 2, pp 2 (`linear_qk_nope` /
`linear_qk_rope` / `linear_kv_nope` / `linear_v`: bands of each head's rows of q_up / kv_up, cut by heads).  tests/fixtures/mindspeed_llm/<case>.json holds what it wrote: the folders
(iter_0000001/...), the tracker ("1"), each rank file's entries (args, checkpoint_version 3.0, iteration 1,
model or model0..), every tensor in stored order with shape, dtype and sha256, and its args namespace.  Facts it
pins (convert_hf2mg.py): `linear_qkv` = cat(q_a_proj, kv_a_proj_with_mqa) whole on every TP rank
(set_model_layer_attn), `linear_proj` chunked on dim 1, `linear_q_up_proj` / `linear_kv_up_proj` on dim 0,
`q_layernorm` / `kv_layernorm`; `experts.weight1` = the experts' [gate_t; up_t].T viewed [E, h, 2F], chunked over
ep on dim 0 then over tp on dim 2, `weight2` [E, F, h] over ep then tp on dim 1 (set_model_layer_mlp); MTP first on
the last stage (enorm, hnorm, eh_proj on dim 0, the embedding copy when pp > 1, its layer under
`mtp.layers.0.transformer_layer.`, `mtp.final_layernorms.0`), the model's final norm `final_layernorm`
(set_model_postprocess with mtp_num_layers); no `_extra_state`; the vocabulary unpadded; dtype kept.
The same script ran MindSpeed-LLM's Mg2HfConvert on interop's output: `mg2hf_of_interop` (it reads interop's args
namespace and gives back every HF tensor equal, but the MTP `shared_head.head` copy it never writes).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.deepseek_models import save, v2_config, v3_config
from interop.convert import convert

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mindspeed_llm"
CASES = sorted(f.stem for f in FIXTURES.glob("*.json"))
# args fields MindSpeed-LLM's converter writes that describe the model and the layout (its Mg2HfConvert reads
# them back); the rest of its namespace is the HF config.json's keys as they are, the converter's own paths, and
# model_cfg.json's `base` training defaults (seq_length 4096, add_position_embedding true, ...), not the model's.
MODEL_ARGS = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "num_experts",
              "first_k_dense_replace", "n_shared_experts", "router_bias", "norm_topk_prob", "multi_latent_attention",
              "qkv_type", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "qk_layernorm", "mla_mm_split", "mtp_num_layers", "moe_grouped_gemm", "num_layer_list", "swiglu",
              "normalization", "norm_epsilon", "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
              "transformer_impl", "max_position_embeddings", "noop_layers", "num_layers_per_virtual_pipeline_stage")


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module", params=CASES)
def oracle(request):
    return json.loads((FIXTURES / f"{request.param}.json").read_text())


def layout_of(oracle: dict) -> dict:
    """interop's layout for Hf2MgConvert's arguments over the case's model (its layer positions: the model's
    layers and the noop layers)."""
    given = oracle["arguments"]
    tp, pp, ep = (given.get(f"target_{x}_parallel_size", 1) for x in ("tensor", "pipeline", "expert"))
    per_chunk = given.get("num_layers_per_virtual_pipeline_stage")
    first = int(given["num_layer_list"].split(",")[0]) if given.get("num_layer_list") else None
    positions = oracle["hf_config_changes"]["num_hidden_layers"] + len(noop_of(given).split(",") if noop_of(given) else [])
    return dict(tp=tp, pp=pp, ep=ep, vpp=positions // pp // per_chunk if per_chunk else 1, first_stage_layers=first)


def noop_of(given: dict) -> str | None:
    return given.get("noop_layers")


def options_of(given: dict) -> dict:
    """--fork mindspeed-llm, with the case's --noop-layers and --mla-mm-split."""
    return {"fork": "mindspeed-llm", **({"noop_layers": noop_of(given)} if noop_of(given) else {}),
            **({"mla_mm_split": True} if given.get("mla_mm_split") else {})}


@pytest.fixture(scope="module")
def written(tmp_path_factory, oracle):
    """The fixture's HF model (checked to be the one MindSpeed-LLM converted) and interop's MindSpeed-LLM output."""
    root = tmp_path_factory.mktemp("msl")
    given = oracle["arguments"]
    changes = dict(oracle["hf_config_changes"])
    config = {"v3": v3_config, "v2": v2_config}[changes.pop("hf_config", "v3")](**changes)
    save(config, root / "hf", mtp=bool(given.get("mtp_num_layers")))
    summary = convert(root / "hf", root / "msl", dst_format="megatron", **layout_of(oracle), options=options_of(given))
    return root, summary


def test_the_source_is_the_model_mindspeed_llm_converted(written, oracle):
    root, _ = written
    assert {k: sha(v) for k, v in sorted(load_file(root / "hf" / "model.safetensors").items())} == oracle["hf"]


def test_every_rank_file_is_what_mindspeed_llms_converter_writes(written, oracle):
    """Folders, tracker, entries, checkpoint_version, iteration and every tensor (key order, shape, dtype, bytes)."""
    root, _ = written
    out = root / "msl"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == oracle["tracker"]
    assert sorted(str(f.parent.relative_to(out)) for f in out.glob("*/*/model_optim_rng.pt")) == sorted(oracle["files"])
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    for folder, want in oracle["files"].items():
        obj = torch.load(out / folder / "model_optim_rng.pt", weights_only=False)
        assert list(obj) == want["entries"]
        assert (obj["checkpoint_version"], obj["iteration"]) == (want["checkpoint_version"], want["iteration"])
        got = {m: [[k, list(v.shape), str(v.dtype).replace("torch.", ""), sha(v)] for k, v in obj[m].items()]
               for m in obj if m.startswith("model")}
        assert got == want["models"], folder


def test_the_args_state_what_mindspeed_llms_converter_states(written, oracle):
    root, _ = written
    last = sorted(root.glob("msl/iter_0000001/*/model_optim_rng.pt"))[-1]
    args = vars(torch.load(last, weights_only=False)["args"])
    keys = [k for k in MODEL_ARGS if k in oracle["args"]]
    assert {k: args.get(k) for k in keys} == {k: oracle["args"][k] for k in keys}
    assert [k for k in ("router_bias", "add_qkv_bias") if k in args] == \
        [k for k in ("router_bias", "add_qkv_bias") if k in oracle["args"]]  # its Mg2HfConvert tests them by hasattr
    if oracle["arguments"].get("num_layers_per_virtual_pipeline_stage"):
        assert args["num_layers_per_virtual_pipeline_stage"] == oracle["args"]["num_layers_per_virtual_pipeline_stage"]
    assert (args["padded_vocab_size"], args["make_vocab_size_divisible_by"]) == (1000, 1)  # its recipes' flags
    assert any("1000 vocabulary rows unpadded" in n for n in written[1].notes)  # Megatron's divisor would pad
    if oracle["arguments"].get("noop_layers"):
        noop = oracle["arguments"]["noop_layers"]
        assert any(f"noop layers at positions {noop}: num_layers {args['num_layers']}" in n for n in written[1].notes)
        if oracle["arguments"].get("num_layers_per_virtual_pipeline_stage"):  # stage 0's second chunk: noop only
            assert written[1].layout == "tp=1 pp=2 vpp=2 (pp0: layers 0-1, none; pp1: layers 2-3, 4-5)"


def test_mindspeed_llms_own_reader_took_interops_output(oracle):
    """Recorded by the fixture script: MindSpeed-LLM's Mg2HfConvert on interop's output (no --model-config: the args
    namespace interop wrote) gives every HF tensor back equal; it never writes the MTP head copy."""
    mtp = oracle["arguments"].get("mtp_num_layers")
    head = f"model.layers.{oracle['hf_config_changes']['num_hidden_layers']}.shared_head.head.weight"
    assert oracle["mg2hf_of_interop"] == {"missing": [head] if mtp else [],
                                          "extra": [], "differ": []}


def test_hf_through_mindspeed_llm_and_back_is_byte_identical(written, oracle, tmp_path):
    """HF -> MindSpeed-LLM (tp 2, pp 2 as 1 + 3 layers, ep 2) -> HF, read from its own args (no --model-config),
    and on through megatron-core's names: every tensor equal, the MTP module kept."""
    root, _ = written
    from interop.converters import megatron as meg
    reader = meg.Reader(root / "msl")
    try:
        mm = oracle["arguments"].get("mla_mm_split")  # its up projections as bands of each head's rows
        assert reader.source.state["megatron"]["scheme"] == ("mindspeed_llm_mm" if mm else "mindspeed_llm")
        want = meg.Writer.build_layout(reader.source.spec.num_layers, layout_of(oracle), options_of(oracle["arguments"]))
        assert (reader.source.layout.stages, reader.source.layout.ep) == (want.stages, want.ep)
    finally:
        reader.close()
    convert(root / "msl", tmp_path / "hf", dst_format="hf")
    a, b = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    convert(root / "msl", tmp_path / "mcore", dst_format="megatron", tp=2)
    convert(tmp_path / "mcore", tmp_path / "again", dst_format="hf")
    c = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(a) == sorted(c) and [k for k in a if not torch.equal(a[k], c[k])] == []


def test_mindspeed_llms_own_output_is_read_with_the_hf_config(written, oracle, tmp_path):
    """MindSpeed-LLM's converter output itself: interop's files (tensor for tensor the same, checked above) holding
    its args namespace instead (an HF config's scalar fields and the converter's, not Megatron's arguments): read
    with --model-config to the HF tensors it came from; without, one line naming --model-config."""
    import argparse
    import shutil

    from helpers.hostile import assert_one_error, run

    root, _ = written
    theirs = tmp_path / "theirs"
    shutil.copytree(root / "msl", theirs)
    for f in theirs.glob("iter_*/*/model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        obj["args"] = argparse.Namespace(**oracle["args"])
        torch.save(obj, f)
    convert(theirs, tmp_path / "hf", dst_format="hf", options={"model_config": str(root / "hf" / "config.json")})
    a, b = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert_one_error(*run("convert", theirs, tmp_path / "out", "--to", "hf"), "pass --model-config")
    assert not (tmp_path / "out").exists()
    for key, value, flag in (("moe_tp_extend_ep", True, "--moe-tp-extend-ep"),
                             ("schedules_method", "dualpipev", "--schedules-method dualpipev")):
        for f in theirs.glob("iter_*/*/model_optim_rng.pt"):  # args of layouts not read: refused, naming the flag
            obj = torch.load(f, weights_only=False)
            obj["args"] = argparse.Namespace(**dict(oracle["args"], **{key: value}))
            torch.save(obj, f)
        assert_one_error(*run("convert", theirs, tmp_path / "out", "--to", "hf", "--model-config",
                              root / "hf" / "config.json"), flag)


def test_megatron_to_mindspeed_llm_moves_the_fused_rows_whole(tmp_path):
    """megatron-core (tp 2, ep 2: its vocabulary padded) -> MindSpeed-LLM (tp 1): the same files as from HF."""
    root = tmp_path
    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), root / "hf", mtp=True)
    convert(root / "hf", tmp_path / "mcore", dst_format="megatron", tp=2, ep=2)
    convert(tmp_path / "mcore", tmp_path / "msl", dst_format="megatron", options={"fork": "mindspeed-llm"})
    convert(root / "hf", tmp_path / "direct", dst_format="megatron", options={"fork": "mindspeed-llm"})
    x, y = (torch.load(tmp_path / d / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
            for d in ("msl", "direct"))
    assert list(x["model"]) == list(y["model"])
    assert [k for k in x["model"] if not torch.equal(x["model"][k], y["model"][k])] == []


def test_refusals_are_one_line_and_leave_nothing(tmp_path):
    """A vocabulary tp does not divide (MindSpeed-LLM cuts it with torch.chunk, unpadded), the torch_dist format or
    the distributed optimizer with --fork mindspeed-llm: one error line each."""
    from helpers.hostile import assert_one_error, run

    save(v3_config(num_hidden_layers=2, num_experts_per_tok=4, vocab_size=1001), tmp_path / "odd", mtp=True)
    cases = [((tmp_path / "odd", "--tp", "2"), "1001 tokens do not divide by tp 2"),
             ((tmp_path / "odd", "--format", "torch_dist"), "leave out --format torch_dist"),
             ((tmp_path / "odd", "--distributed-optimizer"), "leave out --distributed-optimizer")]
    for (src, *flags), why in cases:
        assert_one_error(*run("convert", src, tmp_path / "out", "--to", "megatron", "--fork", "mindspeed-llm",
                              *flags), why)
        assert not (tmp_path / "out").exists()


def test_a_sources_optimizer_state_is_left_out_and_said(tmp_path):
    """MindSpeed-LLM's converter writes weights only: a Megatron training checkpoint's Adam moments are noted as
    not written, the weights equal the megatron-core output's."""
    src = Path(__file__).parents[1] / "fixtures" / "megatron" / "0.16.1" / "fp16opt" / "torch"
    summary = convert(src, tmp_path / "msl", dst_format="megatron", options={"fork": "mindspeed-llm"})
    assert any(n.startswith("optimizer state not written (exp_avg, exp_avg_sq") for n in summary.notes)
    convert(src, tmp_path / "mcore", dst_format="megatron")
    (msl,), (mcore,) = ([torch.load(f, weights_only=False) for f in (tmp_path / d).glob("iter_*/mp_rank_00/*.pt")]
                        for d in ("msl", "mcore"))
    assert "optimizer" not in msl and "optimizer" in mcore
    weights = {k: v for k, v in mcore["model"].items() if v is not None}
    assert sorted(msl["model"]) == sorted(weights) and all(torch.equal(msl["model"][k], weights[k]) for k in weights)
    assert msl["iteration"] == mcore["iteration"] > 0  # a training step keeps its number


def test_layouts_not_read_are_refused_naming_their_flag(tmp_path):
    """A gap in a megatron-core checkpoint's local layer numbers (only MindSpeed-LLM's noop layers make one), and an
    --mla-mm-split checkpoint missing one band (linear_qk_rope: q_up would be half read): one line each."""
    import shutil

    from helpers.hostile import assert_one_error, run

    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "msl", dst_format="megatron", pp=2,
            options={"fork": "mindspeed-llm", "mla_mm_split": True})
    convert(tmp_path / "hf", tmp_path / "mcore", dst_format="megatron", pp=2)
    for what, change, why in (
            ("msl", lambda m: {k: v for k, v in m.items() if not k.endswith("1.self_attention.linear_qk_rope.weight")},
             "decoder.layers.1.self_attention.linear_qk_rope.weight is missing"),
            ("mcore", lambda m: {k.replace("decoder.layers.1.", "decoder.layers.2."): v for k, v in m.items()},
             "are not 0..n-1")):
        copy = tmp_path / f"{what}-changed"
        shutil.copytree(tmp_path / what, copy)
        for f in copy.glob("*/mp_rank_00_001/model_optim_rng.pt"):
            obj = torch.load(f, weights_only=False)
            obj["model"] = change(obj["model"])
            torch.save(obj, f)
        assert_one_error(*run("convert", copy, tmp_path / "out", "--to", "hf"), why)
        assert not (tmp_path / "out").exists()


def test_mla_mm_split_read_again_is_kept_when_asked_and_said_when_not(tmp_path):
    """An --mla-mm-split checkpoint (tp 2) written as MindSpeed-LLM at tp 1 with the flag: each band the heads' rows
    of all tp 2 ranks joined; without it the up projections whole and a note naming the flag; for megatron-core, a
    target without --fork mindspeed-llm, or a model without query compression (its converter splits q_up only
    where there is one: V2-Lite's q_b_proj is never set), one error line."""
    from helpers.hostile import assert_one_error, run

    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), tmp_path / "hf", mtp=True)
    mm = {"fork": "mindspeed-llm", "mla_mm_split": True}
    convert(tmp_path / "hf", tmp_path / "tp2", dst_format="megatron", tp=2, options=mm)
    convert(tmp_path / "tp2", tmp_path / "tp1", dst_format="megatron", options=mm)
    convert(tmp_path / "hf", tmp_path / "direct", dst_format="megatron", options=mm)
    x, y = (torch.load(tmp_path / d / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
            for d in ("tp1", "direct"))
    assert list(x["model"]) == list(y["model"]) and all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])
    assert vars(x["args"])["mla_mm_split"] is True
    summary = convert(tmp_path / "tp2", tmp_path / "whole", dst_format="megatron", options={"fork": "mindspeed-llm"})
    assert any("--mla-mm-split layout was not kept" in n for n in summary.notes)
    whole = torch.load(tmp_path / "whole" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert "decoder.layers.0.self_attention.linear_q_up_proj.weight" in whole["model"]
    save(v2_config(num_hidden_layers=2, topk_method="greedy"), tmp_path / "v2")
    for src, flags, why in ((tmp_path / "hf", ("--to", "megatron"), "write it with --fork mindspeed-llm"),
                            (tmp_path / "v2", ("--to", "megatron", "--fork", "mindspeed-llm"), "no query compression")):
        assert_one_error(*run("convert", src, tmp_path / "out", *flags, "--mla-mm-split"), why)
        assert not (tmp_path / "out").exists()


def test_noop_layers_read_again_are_kept_when_asked_and_said_when_not(tmp_path):
    """MindSpeed-LLM's noop output (ds3_pp2_noop15's layout) written as MindSpeed-LLM again: with --noop-layers 1,5
    the same tensors under the same keys; without, its 4 real layers as num_layers 4 and a note naming the flag
    (the noop positions are a training layout of the source's pipeline: a new --pp may not hold them, so they are
    kept only when asked; identity layers, so nothing computed is lost either way)."""
    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), tmp_path / "hf", mtp=True)
    noop = {"fork": "mindspeed-llm", "noop_layers": "1,5"}
    convert(tmp_path / "hf", tmp_path / "msl", dst_format="megatron", pp=2, options=noop)
    convert(tmp_path / "msl", tmp_path / "kept", dst_format="megatron", pp=2, options=noop)
    for f in sorted((tmp_path / "msl").glob("iter_*/*/model_optim_rng.pt")):
        a, b = (torch.load(d / f.relative_to(tmp_path / "msl"), weights_only=False)
                for d in (tmp_path / "msl", tmp_path / "kept"))
        assert list(a["model"]) == list(b["model"]) and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert (vars(b["args"])["num_layers"], vars(b["args"])["noop_layers"]) == (6, "1,5")
    summary = convert(tmp_path / "msl", tmp_path / "dropped", dst_format="megatron", pp=2,
                      options={"fork": "mindspeed-llm"})
    assert any("the source's noop layers (1,5" in n and "pass --noop-layers 1,5" in n for n in summary.notes)
    args = vars(torch.load(tmp_path / "dropped" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
                           weights_only=False)["args"])
    assert (args["num_layers"], args["noop_layers"]) == (4, None)
    summary = convert(tmp_path / "msl", tmp_path / "mcore", dst_format="megatron", pp=2)  # megatron-core: none
    args = vars(torch.load(tmp_path / "mcore" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
                           weights_only=False)["args"])
    assert (args["num_layers"], args.get("noop_layers")) == (4, None)


def test_noop_layers_bad_input_is_one_line(tmp_path):
    """Positions outside the model's, repeated, not splitting evenly over the stages (convert_hf2mg.py
    _valid_parameter: num_layers % pp), a stage of noop layers only, with --first-stage-layers (its num_layer_list:
    "num_layer_list and noop_layers cannot be configured at the same time"), or for megatron-core: one error line,
    nothing written."""
    from helpers.hostile import assert_one_error, run

    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), tmp_path / "hf", mtp=True)
    msl = ("--to", "megatron", "--fork", "mindspeed-llm")
    cases = [((*msl, "--noop-layers", "6"), "6 is not a position"),
             ((*msl, "--noop-layers", "1,1"), "a position is repeated"),
             ((*msl, "--noop-layers", "x"), "expected layer positions"),
             ((*msl, "--pp", "2", "--noop-layers", "1"), "5 layer positions"),
             ((*msl, "--pp", "2", "--noop-layers", "0,1,2,3"), "pipeline stage 0 would hold noop layers only"),
             ((*msl, "--pp", "2", "--first-stage-layers", "1", "--noop-layers", "1,5"),
              "num_layer_list and noop_layers cannot be configured at the same time"),
             (("--to", "megatron", "--noop-layers", "1,5"), "write it with --fork mindspeed-llm")]
    for flags, why in cases:
        assert_one_error(*run("convert", tmp_path / "hf", tmp_path / "out", *flags), why)
        assert not (tmp_path / "out").exists()


def test_split_over_workers_and_an_asked_iteration(tmp_path):
    """--workers 2 writes the same rank files as one process (keys in order, tensors; the zip records' order may
    differ, as for every Megatron output); --iteration 5 names iter_0000005 and a tracker of 5."""
    save(v3_config(num_hidden_layers=4, num_experts_per_tok=4), tmp_path / "hf", mtp=True)
    layout = dict(tp=2, pp=2, ep=2, first_stage_layers=1)
    convert(tmp_path / "hf", tmp_path / "one", dst_format="megatron", options={"fork": "mindspeed-llm"}, **layout)
    convert(tmp_path / "hf", tmp_path / "two", dst_format="megatron", options={"fork": "mindspeed-llm"}, workers=2,
            **layout)
    files = sorted(f.relative_to(tmp_path / "one") for f in (tmp_path / "one").rglob("*") if f.is_file())
    assert files == sorted(f.relative_to(tmp_path / "two") for f in (tmp_path / "two").rglob("*") if f.is_file())
    for f in files:
        if f.suffix != ".pt":
            assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes()
            continue
        a, b = (torch.load(tmp_path / d / f, weights_only=False) for d in ("one", "two"))
        assert list(a["model"]) == list(b["model"]) and vars(a["args"]) == vars(b["args"])
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    convert(tmp_path / "hf", tmp_path / "it5", dst_format="megatron", options={"fork": "mindspeed-llm", "iteration": 5})
    assert (tmp_path / "it5" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert torch.load(tmp_path / "it5" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt",
                      weights_only=False)["iteration"] == 5
