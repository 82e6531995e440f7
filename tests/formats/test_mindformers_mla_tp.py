"""MindFormers 2.1.0's deepseek3 (mcore-style: multi-latent attention, MTP, MoE) at tp > 1 and over pipeline stages:
`rank_{p*tp+t}/checkpoint_{p*tp+t}.ckpt` plus `strategy/strategy_stage{p}.json`, as MindFormers' distributed weights
are laid out.

How MindFormers cuts each tensor (its own model says it: `GPTModel.sharded_state_dict()` states every parameter's
local shape and axis_fragmentations from config.tensor_model_parallel_size / expert_model_parallel_size, read below;
building the model at tp 2 needs communication groups a CPU test has not got, so it is built at tp 1 and its configs
then say tp 2, as tests/formats/test_mindformers_lora_tp.py does for LoRA):
- base_models/gpt/gpt_layer_specs.py (MLA, mla_qkv_concat): linear_qkv a SequenceParallelLinear (whole on every rank,
  its q part too without q compression), linear_qb / linear_kvb ColumnParallelLinear (cut by heads), linear_proj
  RowParallelLinear; q_layernorm / k_layernorm whole;
- base_models/gpt/moe_module_specs.py: the shared experts' linear_fc1 / linear_fc2 SequenceParallelLinear (whole);
  transformer/moe/ffn.py: the routed experts' weight1 / weight2 placed by expert parallelism only
  (axis_fragmentations (ep, 1)), so whole at ep 1; the router whole;
- transformer/multi_token_prediction.py: eh_proj a SequenceParallelLinear (whole; megatron-core cuts it);
- tensor_parallel/layers.py VocabParallelEmbedding: enable_embedding_tp = tp > 1 and vocab % tp == 0, decided when
  the model is built (so the tp 1 model's statement says whole): the vocabulary here (1000) is cut at tp 2.
Expert parallelism: ffn.py requires ep | dp * tp and lays weight1 / weight2 out ("ep", None) on the MoE device matrix
(dp * tp / ep, ep) (device_matrix.py init_dp_cp_tp_ep_layout), so stage rank r = d * tp + t holds the rows of
ep rank r % ep's experts; interop writes the fewest data-parallel ranks that takes (dp = ep / gcd(ep, tp)).
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.deepseek_models import save, v2_config, v3_config
from helpers.hostile import run
from helpers.mindformers_mcore import assert_back_to_hf, deepseek3_model, same_hf, strict_load
from interop.convert import convert
from interop.io.ms_ckpt import CkptFile, load_ckpt

ms = pytest.importorskip("mindspore")

KINDS = {"v3-mtp": (lambda: v3_config(num_hidden_layers=4), True),
         "v2-lite": (lambda: v2_config(num_hidden_layers=4, topk_method="greedy"), False)}
DIALECT = {"dialect": "mindformers-mcore"}


def _merged(folder, tmp_path, pp):
    """MindSpore's own merge of the rank files (merge_pipeline_strategys at pp > 1, transform_checkpoints)."""
    strategy = folder / "strategy" / "strategy_stage0.json"
    if pp > 1:
        strategy = tmp_path / "merged_strategy.json"
        ms.merge_pipeline_strategys(str(folder / "strategy"), str(strategy))
    ms.transform_checkpoints(str(folder), str(tmp_path / "merged"), "ckpt", str(strategy), None)
    return next((tmp_path / "merged" / "rank_0").glob("*.ckpt"))


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_tp2_is_cut_as_mindformers_states_merges_and_loads(tmp_path, mcore, kind, ep):
    """tp 2 (with ep 2: the experts' rows cut over the same two ranks): each rank file's tensors have the local
    shapes MindFormers' deepseek3 states and our strategy cuts the axes it states; transform_checkpoints merges the
    rank files into exactly the tp 1 checkpoint, which its model loads strictly; back to HF bit for bit."""
    config, mtp = KINDS[kind]
    hf = save(config(), tmp_path / "hf", mtp=mtp)
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ms2", dst_format="mindspore", tp=2, ep=ep, options=DIALECT)
    assert sorted(p.parent.name for p in (tmp_path / "ms2").rglob("*.ckpt")) == ["rank_0", "rank_1"]
    model = deepseek3_model(hf.config)
    gpt = next(c for _, c in model.cells_and_names() if type(c).__name__ == "GPTModel")
    for config_ in {id(c.config): c.config for _, c in model.cells_and_names()
                    if type(getattr(c, "config", None)).__name__.endswith("TransformerConfig")}.values():
        config_.tensor_model_parallel_size, config_.expert_model_parallel_size = 2, ep
    stated = gpt.sharded_state_dict()
    strategy = json.loads((tmp_path / "ms2" / "strategy" / "strategy_stage0.json").read_text())
    items = strategy["parallel_layout_item"]
    saved = [p.name for _, p in model.parameters_and_names() if not p.name.endswith((".expert_load", ".fi_accu"))]
    assert sorted(items) == sorted(saved)
    cuts = {name: tuple(s.axis_fragmentations) for name, s in stated.items()}
    cuts["embedding.word_embeddings.weight"] = (2, 1)  # enable_embedding_tp: 1000 % 2 == 0 (decided at build)
    for name in saved:  # the router's score-correction bias [E] is not in the statement: whole, as the router
        cuts.setdefault(name, (1,) * len(items[name]["tensor_map"]))
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    for t in range(2):
        with CkptFile(tmp_path / "ms2" / f"rank_{t}" / f"checkpoint_{t}.ckpt") as f:
            assert sorted(f.keys()) == sorted(saved)
            for name in saved:
                assert items[name]["tensor_map"] == [0 if n == 2 else -1 for n in cuts[name]], name
                assert f.meta(name)[1] == tuple(d // n for d, n in zip(whole[name].shape, cuts[name])), name
    attn = "decoder.layers.1.self_attention."
    assert cuts[attn + "linear_qkv.weight"] == (1, 1) and cuts[attn + "linear_kvb.weight"] == (2, 1)
    assert cuts[attn + "linear_proj.weight"] == (1, 2) and cuts["decoder.layers.1.mlp.experts.weight1"] == (ep, 1)
    assert cuts["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (1, 1)
    # the experts over the ep axis of MindFormers' MoE device matrix (dp * tp / ep, ep); the rest over (tp)
    assert items["decoder.layers.1.mlp.experts.weight2"]["dev_matrix"] == ([1, 2] if ep == 2 else [2])
    assert items[attn + "linear_kvb.weight"]["dev_matrix"] == [2]
    if mtp:
        assert cuts["mtp.layers.0.eh_proj.weight"] == (1, 1)
        assert cuts["mtp.layers.0.transformer_layer.self_attention.linear_qb.weight"] == (2, 1)
    merged = ms.load_checkpoint(str(_merged(tmp_path / "ms2", tmp_path, 1)))
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    strict_load(deepseek3_model(hf.config), _merged(tmp_path / "ms2", tmp_path / "again", 1))
    convert(tmp_path / "ms2", tmp_path / "back", dst_format="hf")
    same_hf(tmp_path / "hf", tmp_path / "back")


def test_tp2_pp2_uneven_keeps_mtp_on_the_last_stage_and_merges(tmp_path, mcore):
    """tp 2 x pp 2 with stages of 1 and 3 layers (MindFormers' `offset` [-1, 1]: transformer/utils.py layer_list =
    num_layers // pp + offset): rank p*2+t holds stage p's layers, the MTP module on the last stage; one strategy file
    per stage, MindSpore's merge gives exactly the tp 1 checkpoint, which the model loads; HF comes back bit for bit,
    also without interop's sidecar (the layout from the files)."""
    hf = save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=2, pp=2, first_stage_layers=1,
            options=DIALECT)
    for p, layers in enumerate([{0}, {1, 2, 3}]):
        for t in range(2):
            r = p * 2 + t
            held = load_ckpt(tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt")
            assert {int(k.split(".")[2]) for k in held if k.startswith("decoder.layers.")} == layers
            assert any(k.startswith("mtp.") for k in held) == (p == 1)
    assert sorted(f.name for f in (tmp_path / "ms" / "strategy").iterdir()) == \
        ["strategy_stage0.json", "strategy_stage1.json"]
    merged = ms.load_checkpoint(str(_merged(tmp_path / "ms", tmp_path, 2)))
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    strict_load(deepseek3_model(hf.config), _merged(tmp_path / "ms", tmp_path / "again", 2))
    assert_back_to_hf(tmp_path / "ms", tmp_path / "hf", tmp_path)


@pytest.mark.parametrize("tp,ep,pp,files", [(1, 2, 1, 2), (2, 4, 1, 4), (4, 2, 1, 4), (2, 2, 2, 4)])
def test_expert_parallel_layouts_merge_and_read_back(tmp_path, tp, ep, pp, files):
    """MindFormers' expert parallelism beside tp and pp: ep / gcd(ep, tp) data-parallel ranks' files per stage
    (rank p * dp * tp + d * tp + t holding the rows of ep rank (d * tp + t) % ep's experts); MindSpore's merge gives
    exactly the tp 1 checkpoint; HF comes back bit for bit, with and without interop's sidecar."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=tp, ep=ep, pp=pp,
            first_stage_layers=1 if pp > 1 else None, options=DIALECT)
    assert sorted(int(p.parent.name[5:]) for p in (tmp_path / "ms").rglob("*.ckpt")) == list(range(files))
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    w1, per_stage = "decoder.layers.1.mlp.experts.weight1", files // pp
    rows = whole[w1].shape[0] // ep
    for r in range(per_stage):  # stage 0 holds layer 0 only at pp 2: its experts are on stage 1
        p = pp - 1
        got = load_ckpt(tmp_path / "ms" / f"rank_{p * per_stage + r}" / f"checkpoint_{p * per_stage + r}.ckpt")
        e = r % ep
        assert torch.equal(got[w1], whole[w1][e * rows:(e + 1) * rows]), r
    merged = ms.load_checkpoint(str(_merged(tmp_path / "ms", tmp_path, pp)))
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    assert_back_to_hf(tmp_path / "ms", tmp_path / "hf", tmp_path)


def test_a_runs_expert_parallel_files_with_data_parallel_copies(tmp_path):
    """A MindFormers run at dp 2 x tp 2 with ep 2 (4 ranks: rank d * 2 + t holds ep rank t's experts): no sidecar,
    the layout from the files (tp from the shapes, ep from weight1's rows), the data-parallel copies unread."""
    save(v3_config(num_hidden_layers=3), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=2, ep=2, options=DIALECT)
    for r in range(4):
        (tmp_path / "run" / f"rank_{r}").mkdir(parents=True)
        (tmp_path / "run" / f"rank_{r}" / f"deepseek3_rank_{r}-1_2.ckpt").write_bytes(
            (tmp_path / "ms" / f"rank_{r % 2}" / f"checkpoint_{r % 2}.ckpt").read_bytes())
    code, out = run("convert", tmp_path / "run", tmp_path / "back", "--to", "hf", "--model-config",
                    tmp_path / "hf" / "config.json", "--allow-identical-ranks")
    assert code == 0 and "2 data-parallel copies were not read" in out and "ep=2" in out, out
    same_hf(tmp_path / "hf", tmp_path / "back")
