"""MindFormers' mcore-style models at a tp that does not divide the vocabulary: the word embedding whole and unpadded
on every rank.

MindFormers 2.1.0's VocabParallelEmbedding (parallel_core/training_graph/tensor_parallel/layers.py) decides when it
is built: enable_embedding_tp = tp > 1 and num_embeddings % tp == 0; otherwise it shards the table
layout("None", "None") and its sharded_state_dict states axis_fragmentations (1, 1) with the whole shape (built
below at tp 2, the oracle).  Its output_layer is a ColumnParallelLinear, always cut over tp, so an untied head of
such rows is refused; a tied model (Qwen3's small models) stores no head.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.hostile import run
from helpers.mindformers_mcore import assert_back_to_hf, same_hf
from interop.convert import convert
from interop.errors import InteropError
from interop.io.ms_ckpt import CkptFile, load_ckpt

ms = pytest.importorskip("mindspore")

DIALECT = {"dialect": "mindformers-mcore"}
EMBED = "embedding.word_embeddings.weight"
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-5, num_hidden_layers=2, intermediate_size=24, head_dim=8)


def _hf(path, vocab, tied, family="qwen3"):
    import transformers
    torch.manual_seed(0)
    model, config = {"qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                     "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[family]
    model(config(**SMALL, vocab_size=vocab, tie_word_embeddings=tied)).save_pretrained(path)


def _stated(vocab, tp):
    """(local shape, axis_fragmentations) MindFormers' own VocabParallelEmbedding states at `tp`."""
    from mindformers.parallel_core.training_graph.tensor_parallel.layers import VocabParallelEmbedding
    from mindformers.parallel_core.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp)
    table = VocabParallelEmbedding(vocab, 32, lambda shape: ms.common.initializer.initializer("normal", shape), config)
    stated = table.sharded_state_dict()[table.weight.name]
    return tuple(stated.local_shape), tuple(stated.axis_fragmentations)


@pytest.mark.parametrize("vocab,tp", [(1001, 2), (250, 4), (1000, 2)])
def test_embedding_cut_as_mindformers_states_merged_loaded_and_back(tmp_path, mcore, vocab, tp):
    """Each rank file's embedding has the shape MindFormers' VocabParallelEmbedding states at that tp (whole and
    unpadded where tp does not divide the vocabulary, cut where it does) and the strategy says the same;
    transform_checkpoints merges the rank files into exactly the tp 1 checkpoint, which MindFormers' Qwen3 loads
    strictly; back to HF bit for bit, with and without interop's sidecar."""
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
    _hf(tmp_path / "hf", vocab, tied=True)
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=tp, options=DIALECT)
    local, cut = _stated(vocab, tp)
    assert cut == ((tp, 1) if vocab % tp == 0 else (1, 1))
    item = json.loads((tmp_path / "ms" / "strategy" / "strategy_stage0.json").read_text())["parallel_layout_item"]
    assert item[EMBED]["tensor_map"] == [0 if n == tp else -1 for n in cut]
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    assert tuple(whole[EMBED].shape) == (vocab, 32)  # no padding row anywhere
    for t in range(tp):
        with CkptFile(tmp_path / "ms" / f"rank_{t}" / f"checkpoint_{t}.ckpt") as f:
            assert f.meta(EMBED)[1] == local, t
    strategy = tmp_path / "ms" / "strategy" / "strategy_stage0.json"
    ms.transform_checkpoints(str(tmp_path / "ms"), str(tmp_path / "merged"), "ckpt", str(strategy), None)
    path = next((tmp_path / "merged" / "rank_0").glob("*.ckpt"))
    merged = ms.load_checkpoint(str(path))
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    model = TrainingQwen3ForCausalLM(Qwen3Config(**SMALL, vocab_size=vocab, tie_word_embeddings=True,
                                                 compute_dtype="float32", params_dtype="float32", seq_length=8))
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(path)), strict_load=True)
    assert (not_loaded, unused) == ([], [])
    assert_back_to_hf(tmp_path / "ms", tmp_path / "hf", tmp_path)


def test_an_untied_head_tp_does_not_divide_is_refused_in_one_line(tmp_path):
    """MindFormers cuts output_layer over tp whatever the vocabulary (ColumnParallelLinear.shard layout("tp",
    "None")): 1001 rows at tp 2 have no layout its model builds; nothing is left behind."""
    _hf(tmp_path / "hf", 1001, tied=False)
    code, out = run("convert", tmp_path / "hf", tmp_path / "ms", "--to", "mindspore", "--dialect",
                    "mindformers-mcore", "--tp", "2")
    assert code == 2 and "error:" in out and "output_layer" in out and "--tp" in out, out
    assert len([line for line in out.splitlines() if line.startswith("error:")]) == 1
    assert not (tmp_path / "ms").exists()
    with pytest.raises(InteropError, match="untied output_layer.weight of 1001 rows"):
        convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=2, options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ok", dst_format="mindspore", tp=1, options=DIALECT)  # tp 1 holds it


def test_vocab_rows_each_dialect_writes():
    """mcore: the source's padding where tp divides it, else unpadded (whole); legacy Llama the same (its embedding
    and lm_head whole); MindSpeed pads up to a multiple of tp and cuts: its VocabParallelEmbedding (from
    mindformers/experimental/distri_cores/tensor_parallel/layers.py) raises "The vocabulary size is ..., which is not
    divisible by size of tensor parallel" and holds vocab / tp rows a rank, so its model is built with the padded
    `padded_vocab_size` pt_meta/ states (tests/formats/test_real_vocab.py reads and writes such padded rows)."""
    from interop.converters.mindspore.dialects import dialect_named
    from interop.spec import ModelSpec
    spec = ModelSpec(arch="llama", num_layers=2, hidden=32, ffn_hidden=24, heads=4, kv_groups=4, head_dim=8,
                     vocab=1001, padded_vocab=1001, max_positions=64, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope", tied_embeddings=True)
    for name in ("mindformers-mcore", "mindformers"):
        assert dialect_named(name).vocab_rows(spec, 2) == 1001
        assert dialect_named(name).vocab_rows(spec.replace(padded_vocab=1024), 2) == 1024  # cut
        assert dialect_named(name).vocab_rows(spec.replace(padded_vocab=1024), 3) == 1001  # whole
    assert dialect_named("mindspeed").vocab_rows(spec, 2) == 1002
    assert dialect_named("mindformers").vocab_rows(spec.replace(arch="gpt2"), 2) == 1002  # its GPT2: unchanged


def _legacy_strategies(vocab, monkeypatch):
    """(embedding, lm_head) parameter strategies of MindFormers' legacy LlamaForCausalLM at model_parallel 2 with
    its default vocab_emb_dp=True and with False (semi-auto parallel; the device count told 2, as
    test_mindformers_lora_tp.py does)."""
    import mindformers.modules.transformer.op_parallel_config as op_parallel_config
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
    monkeypatch.setattr(op_parallel_config.D, "get_group_size", lambda *a, **k: 2)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
    out = []
    try:
        for emb_dp in (True, False):
            model = LlamaForCausalLM(LlamaConfig(
                batch_size=1, seq_length=8, hidden_size=32, num_layers=1, num_heads=4, n_kv_heads=4,
                vocab_size=vocab, intermediate_size=24, compute_dtype="float32", layernorm_compute_type="float32",
                softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
                use_flash_attention=False, qkv_concat=False, use_past=False, fused_rms_norm=False,
                parallel_config=TransformerOpParallelConfig(data_parallel=1, model_parallel=2, vocab_emb_dp=emb_dp)))
            out.append((tuple(model.model.tok_embeddings.gather.in_strategy[0]),
                         tuple(model.lm_head.matmul.in_strategy[1])))
    finally:
        ms.reset_auto_parallel_context()
    return out


def test_legacy_llama_keeps_embedding_and_head_whole_where_tp_does_not_divide(tmp_path, monkeypatch):
    """MindFormers' legacy Llama at model_parallel 2 and vocabulary 1001 keeps both the embedding and the lm_head
    whole whatever vocab_emb_dp says (its own operators' strategies, read below); interop writes them so (untied),
    the strategy says so, transform_checkpoints merges into exactly the tp 1 file, which its LlamaForCausalLM loads
    strictly, and HF comes back bit for bit."""
    monkeypatch.chdir(tmp_path)  # MindFormers writes ./output/log on import
    # its llama_loss.py logs "vocab ... not divide by model_parallel" with a format string short of arguments, which
    # logging reports and goes on from, unless pytest's capture handler is installed (it raises then)
    monkeypatch.setattr(logging, "raiseExceptions", False)
    pytest.importorskip("mindformers")
    assert _legacy_strategies(1001, monkeypatch) == [((1, 1), (1, 1))] * 2
    _hf(tmp_path / "hf", 1001, tied=False, family="llama")
    options = {"dialect": "mindformers"}
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=options)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=2, options=options)
    item = json.loads((tmp_path / "ms" / "strategy" / "strategy_stage0.json").read_text())["parallel_layout_item"]
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    for name in ("model.tok_embeddings.embedding_weight", "lm_head.weight"):
        assert item[name]["tensor_map"] == [-1, -1] and tuple(whole[name].shape) == (1001, 32), name
        for t in range(2):
            with CkptFile(tmp_path / "ms" / f"rank_{t}" / f"checkpoint_{t}.ckpt") as f:
                assert f.meta(name)[1] == (1001, 32), (name, t)
    strategy = tmp_path / "ms" / "strategy" / "strategy_stage0.json"
    ms.transform_checkpoints(str(tmp_path / "ms"), str(tmp_path / "merged"), "ckpt", str(strategy), None)
    merged = ms.load_checkpoint(str(next((tmp_path / "merged" / "rank_0").glob("*.ckpt"))))
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(
        batch_size=1, seq_length=8, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=4, vocab_size=1001,
        intermediate_size=24, compute_dtype="float32", layernorm_compute_type="float32", softmax_compute_type="float32",
        rotary_dtype="float32", param_init_type="float32", use_flash_attention=False, qkv_concat=False,
        use_past=False, fused_rms_norm=False))
    not_loaded, unused = ms.load_param_into_net(model, merged, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    same_hf(tmp_path / "hf", tmp_path / "back")


def test_legacy_llama_default_keeps_a_divisible_vocabulary_whole_too(tmp_path, monkeypatch):
    """What remains: with its default vocab_emb_dp=True MindFormers' legacy Llama keeps the embedding and lm_head
    whole at any model_parallel; interop cuts a vocabulary tp divides (vocab_emb_dp=False's layout).  Stated here
    from MindFormers' own strategies so a change on either side shows."""
    monkeypatch.chdir(tmp_path)
    pytest.importorskip("mindformers")
    assert _legacy_strategies(1000, monkeypatch) == [((1, 1), (1, 1)), ((2, 1), (2, 1))]


def test_whole_embedding_over_pipeline_stages_merges_and_reads_back(tmp_path):
    """tp 2 x pp 2 at vocabulary 1001: the whole embedding on stage 0's ranks; MindSpore merges the stages'
    strategies and the rank files into exactly the tp 1 checkpoint; HF comes back bit for bit."""
    _hf(tmp_path / "hf", 1001, tied=True)
    convert(tmp_path / "hf", tmp_path / "ms1", dst_format="mindspore", options=DIALECT)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", tp=2, pp=2, options=DIALECT)
    for r in (0, 1):
        assert load_ckpt(tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt")[EMBED].shape == (1001, 32)
    ms.merge_pipeline_strategys(str(tmp_path / "ms" / "strategy"), str(tmp_path / "strategy.json"))
    ms.transform_checkpoints(str(tmp_path / "ms"), str(tmp_path / "merged"), "ckpt", str(tmp_path / "strategy.json"),
                             None)
    merged = ms.load_checkpoint(str(next((tmp_path / "merged" / "rank_0").glob("*.ckpt"))))
    whole = load_ckpt(tmp_path / "ms1" / "model.ckpt")
    assert sorted(merged) == sorted(whole)
    assert [k for k, v in whole.items() if not torch.equal(torch.from_numpy(merged[k].asnumpy()), v)] == []
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    same_hf(tmp_path / "hf", tmp_path / "back")
