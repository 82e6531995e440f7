"""The MindSpore dialects as classes: the registry matches the names `--dialect` offers, and each class states
the files, names and options that set it apart (the reader and writer ask it, never compare its name)."""
import pytest

from interop.converters.mindspore.dialects import DIALECTS, MindFormersDialect, dialect_named
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.mappings import mindspore_names
from interop.spec import ModelSpec

LLAMA = dict(arch="llama", num_layers=2, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=61,
             padded_vocab=64, max_positions=32, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope")


def test_the_registry_is_the_names_the_option_offers():
    assert tuple(DIALECTS) == mindspore_names.DIALECTS
    assert isinstance(DIALECTS["mindformers-mcore"], MindFormersDialect)  # a subclass: MindFormers' files
    with pytest.raises(InteropError, match="unknown MindSpore dialect 'nope'"):
        dialect_named("nope")


def test_each_dialect_owns_its_files_and_names(tmp_path):
    spec, layout = ModelSpec(**LLAMA), ParallelLayout.build(2, 2, 2)
    ms, mf, mc = (DIALECTS[n] for n in ("mindspeed", "mindformers", "mindformers-mcore"))
    assert ms.file(tmp_path, 1, 1, layout, 2, 0).relative_to(tmp_path).as_posix() == "rank_5/network.ckpt"
    assert mf.file(tmp_path, 1, 1, layout, 1, 0).relative_to(tmp_path).as_posix() == "rank_3/checkpoint_3.ckpt"
    assert ms.rows(spec)[0].key == "language_model.embedding.word_embeddings.weight"
    assert "model.layers.0.attention.w_qkv.weight" in {r.key for r in mf.rows(spec, qkv_concat=True)}
    assert {r.key for r in mc.rows(spec)} >= {"decoder.layers.1.self_attention.linear_qkv.weight"}
    assert ms.moments["optim.exp_avg."] == "exp_avg." and mc.moments["optim.exp_avg."] == "adam_m."
    assert (ms.virtual_chunks, mf.virtual_chunks, mf.fuses_qkv, mc.fuses_qkv) == (True, False, True, False)
    assert mc.layout_note(spec) and not ms.layout_note(spec)


def test_a_dialect_refuses_what_its_framework_cannot_hold():
    moe = ModelSpec(**LLAMA, num_experts=4, moe_topk=2, moe_ffn_hidden=8)
    with pytest.raises(InteropError, match="--qkv-concat"):
        DIALECTS["mindformers"].rows(moe, qkv_concat=True)
    with pytest.raises(InteropError, match="softmax"):
        DIALECTS["mindspeed"].rows(ModelSpec(**LLAMA, num_experts=4, moe_topk=2, moe_ffn_hidden=8,
                                             moe_router_score="sigmoid"))


def test_mindformers_mcore_takes_the_fewest_data_parallel_ranks_its_expert_layout_needs():
    """MindFormers' moe/ffn.py: ep must divide dp * tp; its stage rank d * tp + t holds ep rank (d * tp + t) % ep."""
    mcore, mindspeed = DIALECTS["mindformers-mcore"], DIALECTS["mindspeed"]
    counts = {(tp, ep): mcore.rank_files(ParallelLayout.build(4, tp, ep=ep)) for tp in (1, 2, 4) for ep in (1, 2, 4, 8)}
    assert counts == {(1, 1): 1, (1, 2): 2, (1, 4): 4, (1, 8): 8, (2, 1): 1, (2, 2): 1, (2, 4): 2, (2, 8): 4,
                      (4, 1): 1, (4, 2): 1, (4, 4): 1, (4, 8): 2}
    assert mindspeed.rank_files(ParallelLayout.build(4, 2, ep=4)) == 4  # MindSpeed: one folder per ep rank
