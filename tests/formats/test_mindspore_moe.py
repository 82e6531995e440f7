"""Mixture-of-experts models in MindSpore checkpoints.

- MindFormers 2.1.0 (installed `--no-deps`): its own LlamaForCausalLM built with a MoEConfig is the oracle.
  interop's output loads into it with strict_load and every tensor equals the canonical one, stacked per
  expert as [E, out, in] (routed experts: `feed_forward.ffn.w1/w2/w3` and `feed_forward.router.dense`; with
  shared experts `feed_forward.routed_experts.*`, `shared_experts.w1/w2/w3`, `shared_experts_gate`,
  `router.router.topk_bias` with balance_via_topk_bias).
- MindSpeed-Core-MS r0.1.0 (not on PyPI; facts from Ascend/MindSpeed-Core-MS tag r0.1.0):
  legacy/model/transformer.py (every layer's mlp is a MoELayer when num_experts > 1), moe/moe_layer.py
  (`router`, `experts`), moe/router.py (`gating`, a bias-free Linear [E, h]), moe/experts.py (SequentialMLP
  `local_experts` numbered from 0 per expert-parallel rank, each a ParallelMLP: `mapping` [gate_r; up_r] per TP
  rank, `projection`).
"""
import json

import numpy as np
import pytest
import torch

from helpers.hostile import run
from interop.convert import convert
from interop.io.ms_ckpt import load_ckpt
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta
from helpers.ms_moe_store import moe_store

ms = pytest.importorskip("mindspore")






def assert_reads_back_without_sidecar(tmp_path, tensors) -> None:
    """`tmp_path/ms` read with the model from --model-config (interop's sidecar removed): every tensor exact."""
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "interop", "--model-config",
                    tmp_path / "common-spec.json", "-q")
    assert code == 0, out
    back = StoreReader(tmp_path / "back")
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name

@pytest.fixture
def mindformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes ./output/log on import
    return pytest.importorskip("mindformers")


def mf_model(shared=0, gating=False, topk_bias=False):
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.moe import MoEConfig
    moe = MoEConfig(expert_num=4, num_experts_chosen=2, routing_policy="TopkRouterV2", shared_expert_num=shared,
                    use_shared_expert_gating=gating, balance_via_topk_bias=topk_bias)
    return LlamaForCausalLM(LlamaConfig(
        batch_size=1, seq_length=8, hidden_size=64, num_layers=2, num_heads=8, n_kv_heads=4, vocab_size=250,
        intermediate_size=96, compute_dtype="float32", layernorm_compute_type="float32",
        softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32", use_flash_attention=False,
        qkv_concat=False, use_past=False, fused_rms_norm=False, moe_config=moe))


@pytest.mark.parametrize("changes,shared,gating,topk_bias", [
    ({}, 0, False, False),
    ({"moe_router_bias": True}, 0, False, True),
    ({"shared_expert_ffn_hidden": 192, "shared_expert_gate": True, "moe_router_bias": True}, 2, True, True),
])
def test_strict_load_into_mindformers_moe_llama(tmp_path, mindformers, changes, shared, gating, topk_bias):
    src, spec, tensors = moe_store(tmp_path / "common", **changes)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    model = mf_model(shared, gating, topk_bias)
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / "ms" / "model.ckpt")),
                                                strict_load=True)
    # the router's running expert-load counts are a training statistic, not a weight: not written
    assert unused == [] and all(n.endswith(".router.router.expert_load") for n in not_loaded), not_loaded
    assert len(not_loaded) == (2 if topk_bias else 0)
    got = {n: p.asnumpy() for n, p in model.parameters_and_names()}
    ff = "model.layers.1.feed_forward." + ("routed_experts." if shared else "")
    for mf, part in (("ffn.w1.weight", "gate"), ("ffn.w2.weight", "down"), ("ffn.w3.weight", "up")):
        want = torch.stack([tensors[f"layers.1.mlp.experts.{e}.{part}.weight"] for e in range(4)]).numpy()
        assert got[ff + mf].shape == want.shape and (got[ff + mf] == want).all(), mf
    assert (got[ff + "router.dense.weight"] == tensors["layers.1.mlp.router.weight"].numpy()).all()
    if topk_bias:
        assert (got[ff + "router.router.topk_bias"] == tensors["layers.1.mlp.router.expert_bias"].numpy()).all()
    if shared:
        for mf, part in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            assert (got[f"model.layers.1.feed_forward.shared_experts.{mf}.weight"]
                    == tensors[f"layers.1.mlp.shared.{part}.weight"].numpy()).all()
        assert (got["model.layers.1.feed_forward.shared_experts_gate.weight"]
                == tensors["layers.1.mlp.shared_gate.weight"].numpy()).all()
    # and back: every canonical tensor exact, without interop's sidecar (the model from --model-config)
    assert_reads_back_without_sidecar(tmp_path, tensors)


def test_mindformers_moe_reads_a_file_with_expert_load_buffers(tmp_path, mindformers):
    """A checkpoint MindFormers saves in training also holds router.router.expert_load: dropped with a note."""
    src, spec, tensors = moe_store(tmp_path / "common", moe_router_bias=True)
    model = mf_model(topk_bias=True)
    convert(src, tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers"})
    ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / "ms" / "model.ckpt")), strict_load=True)
    (tmp_path / "saved").mkdir()
    ms.save_checkpoint(model, str(tmp_path / "saved" / "model.ckpt"))  # MindFormers' own save of the model
    summary = convert(tmp_path / "saved", tmp_path / "back", dst_format="interop",
                      options={"model_config": str(tmp_path / "common-spec.json")})
    assert any("expert-load" in n for n in summary.notes), summary.notes
    back = StoreReader(tmp_path / "back")
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


def test_mindformers_moe_tp2_merged_by_transform_checkpoints(tmp_path):
    """tp 2 rank files + strategy (stacked experts split on their output axis): mindspore's own
    transform_checkpoints merges them into the tp 1 tensors."""
    src, spec, tensors = moe_store(tmp_path / "common")
    convert(src, tmp_path / "ms", dst_format="mindspore", tp=2, options={"dialect": "mindformers"})
    convert(src, tmp_path / "one", dst_format="mindspore", options={"dialect": "mindformers"})
    strategy = tmp_path / "ms" / "strategy" / "strategy_stage0.json"
    layout = json.loads(strategy.read_text())["parallel_layout_item"]
    assert layout["model.layers.0.feed_forward.ffn.w1.weight"]["tensor_map"] == [-1, 0, -1]
    assert layout["model.layers.0.feed_forward.ffn.w2.weight"]["tensor_map"] == [-1, -1, 0]
    (tmp_path / "src_ckpt").mkdir()
    for r in range(2):
        (tmp_path / "src_ckpt" / f"rank_{r}").mkdir()
        (tmp_path / "src_ckpt" / f"rank_{r}" / f"checkpoint_{r}.ckpt").write_bytes(
            (tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes())
    ms.transform_checkpoints(str(tmp_path / "src_ckpt"), str(tmp_path / "merged"), "merged_",
                             str(strategy), None)
    merged = load_ckpt(next((tmp_path / "merged").rglob("*.ckpt")))
    one = load_ckpt(tmp_path / "one" / "model.ckpt")
    assert sorted(merged) == sorted(one)
    for name in one:
        assert torch.equal(merged[name], one[name]), name


# ---------------------------------------------------------------- MindSpeed-Core-MS r0.1.0


def mindspeed_moe_params(tp, pp, p):
    """{name: local shape} of the parameters MindSpeed-Core-MS r0.1.0's legacy GPT model with a MoE config
    builds on stage p at ep 1 (module docstring): attention as the dense model, then per layer the router's
    gating and each local expert's mapping / projection (Column/RowParallelLinear shards)."""
    L, h, heads, kv, d, ffn, E, vocab = 2, 64, 8, 4, 8, 96, 4, 250
    out = {}
    if p == 0:
        out["language_model.embedding.word_embeddings.weight"] = (vocab // tp, h)
    per = L // pp
    for i in range(p * per, (p + 1) * per):
        pre = f"language_model.encoder.layers.{i}."
        out[pre + "input_norm.weight"] = (h,)
        out[pre + "post_attention_norm.weight"] = (h,)
        out[pre + "attention.qkv_proj.weight"] = ((heads + 2 * kv) * d // tp, h)
        out[pre + "attention.out_proj.weight"] = (h, heads * d // tp)
        out[pre + "mlp.router.gating.weight"] = (E, h)
        for e in range(E):
            out[pre + f"mlp.experts.local_experts.{e}.mapping.weight"] = (2 * ffn // tp, h)
            out[pre + f"mlp.experts.local_experts.{e}.projection.weight"] = (h, ffn // tp)
    if p == pp - 1:
        out["language_model.encoder.final_norm.weight"] = (h,)
        out["language_model.output_layer.weight"] = (vocab // tp, h)
    return out


class _Net(ms.nn.Cell):
    def __init__(self, shapes):
        super().__init__(auto_prefix=False)
        self.params = ms.ParameterTuple([ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=n)
                                         for n, s in shapes.items()])


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_mindspeed_moe_loads_into_its_model_and_reads_back(tmp_path, tp, pp):
    src, spec, tensors = moe_store(tmp_path / "common")
    code, out = run("convert", src, tmp_path / "ms", "--to", "mindspore", "--dialect", "mindspeed", "--tp", tp,
                    "--pp", pp, "-q")
    assert code == 0, out
    assert "pt_meta/ not written" in out and not (tmp_path / "ms" / "pt_meta").exists()
    for p in range(pp):
        for t in range(tp):
            params = ms.load_checkpoint(str(tmp_path / "ms" / f"rank_{p * tp + t}" / "network.ckpt"))
            for scalar in ("epoch_num", "step_num"):
                params.pop(scalar)
            not_loaded, unused = ms.load_param_into_net(_Net(mindspeed_moe_params(tp, pp, p)), params,
                                                        strict_load=True)
            assert not_loaded == [] and unused == [], (p, t, not_loaded, unused)
            if p == pp - 1:  # expert 3's mapping: this rank's gate rows, then its up rows
                got = params[f"language_model.encoder.layers.{spec.num_layers - 1}.mlp.experts.local_experts.3"
                             ".mapping.weight"].asnumpy()
                rows = 96 // tp
                gate = tensors[f"layers.{spec.num_layers - 1}.mlp.experts.3.gate.weight"][t * rows:(t + 1) * rows]
                up = tensors[f"layers.{spec.num_layers - 1}.mlp.experts.3.up.weight"][t * rows:(t + 1) * rows]
                assert (got == torch.cat([gate, up]).numpy()).all()
    assert_reads_back_without_sidecar(tmp_path, tensors)


# ---------------------------------------------------------------- what cannot be written: one line each


@pytest.mark.parametrize("dialect,changes,extra,message", [
    ("mindspeed", {"shared_expert_ffn_hidden": 96}, [], "hold no shared expert"),
    ("mindspeed", {"moe_router_score": "sigmoid"}, [], "scores with softmax"),
    ("mindspeed", {"moe_layers": [1]}, [], "every layer MoE"),
    ("mindformers", {}, ["--qkv-concat"], "--qkv-concat"),
    ("mindformers", {"shared_expert_ffn_hidden": 100}, [], "intermediate_size x shared_expert_num"),
])
def test_what_the_dialect_cannot_hold_is_refused(tmp_path, dialect, changes, extra, message):
    src, _, _ = moe_store(tmp_path / "common", **changes)
    code, out = run("convert", src, tmp_path / "ms", "--to", "mindspore", "--dialect", dialect, *extra, "-q")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], out
    assert not (tmp_path / "ms").exists()


def write_at(src, dst, **layout_args):
    """The Writer at a layout convert() has no flag for here (ep), fed from a canonical checkpoint."""
    from interop.converters.mindspore import Writer
    reader = StoreReader(src)
    dp, dialect = layout_args.pop("dp", None), layout_args.pop("dialect", "mindspeed")
    writer = Writer(dst, reader.spec, ParallelLayout.build(reader.spec.num_layers, **layout_args), reader.metas(),
                    dialect=dialect, dp=dp)
    for m in reader.metas():
        writer.write(m.name, reader.read(m.name))
    writer.finish(reader.source.state)
    return writer.notes


@pytest.mark.parametrize("tp,pp,ep,dp", [(1, 1, 2, None), (2, 2, 2, 4), (1, 2, 4, 4)])
def test_mindspeed_expert_parallel_rank_files(tmp_path, tp, pp, ep, dp):
    """ep ranks are the first data-parallel ranks (rank_{p*dp*tp + d*tp + t}, order tp-cp-ep-dp-pp); each holds
    local_experts 0 .. E/ep - 1 = global experts d*E/ep + local (moe_layer.py local_expert_indices), which its
    model loads strictly; dp ranks >= ep of ep rank > 0 get copies; read back exact without the sidecar."""
    src, spec, tensors = moe_store(tmp_path / "common")
    notes = write_at(src, tmp_path / "ms", tp=tp, pp=pp, ep=ep, dp=dp)
    dp = dp or ep
    per = 4 // ep
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                path = tmp_path / "ms" / f"rank_{p * dp * tp + d * tp + t}" / "network.ckpt"
                if not path.exists():
                    assert d % ep == 0  # training.py's fallback to rank p*dp*tp + t: ep rank 0, right experts
                    path = tmp_path / "ms" / f"rank_{p * dp * tp + t}" / "network.ckpt"
                params = ms.load_checkpoint(str(path))
                for scalar in ("epoch_num", "step_num"):
                    params.pop(scalar)
                shapes = {n: s for n, s in mindspeed_moe_params(tp, pp, p).items()
                          if not any(f"local_experts.{e}." in n for e in range(per, 4))}
                not_loaded, unused = ms.load_param_into_net(_Net(shapes), params, strict_load=True)
                assert not_loaded == [] and unused == [], (p, d, t, not_loaded, unused)
                i = (p + 1) * (2 // pp) - 1
                rows = 96 // tp
                for local in range(per):
                    e = (d % ep) * per + local
                    got = params[f"language_model.encoder.layers.{i}.mlp.experts.local_experts.{local}"
                                 ".projection.weight"].asnumpy()
                    want = tensors[f"layers.{i}.mlp.experts.{e}.down.weight"][:, t * rows:(t + 1) * rows]
                    assert (got == want.numpy()).all(), (p, d, t, local)
    assert (dp > ep) == any("copied expert-parallel" in n for n in notes)
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "interop", "--model-config",
                    tmp_path / "common-spec.json", "-q")
    assert code == 0, out
    back = StoreReader(tmp_path / "back")
    assert back.layout.ep == 1
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name
    from interop.converters.mindspore import Reader
    reader = Reader(tmp_path / "ms", model_config=tmp_path / "common-spec.json")
    assert (reader.layout.tp, reader.layout.pp, reader.layout.ep) == (tp, pp, ep)
    reader.close()


def test_expert_parallel_refusals(tmp_path):
    from interop.errors import InteropError
    src, _, _ = moe_store(tmp_path / "common")
    with pytest.raises(InteropError, match="MindFormers MoE output is written at --ep 1"):
        write_at(src, tmp_path / "mf", ep=2, dialect="mindformers")
    with pytest.raises(InteropError, match="--dp 3 is no multiple of --ep 2"):
        write_at(src, tmp_path / "ms", ep=2, dp=3)


@pytest.mark.parametrize("dialect,args", [("mindspeed", ["--tp", "2", "--pp", "2", "--ep", "2", "--dp", "4"]),
                                          ("mindformers", ["--tp", "2"])])
def test_hf_mixtral_through_mindspore_and_back(tmp_path, dialect, args):
    """The headline for MoE: HF Mixtral -> MindSpore (MindSpeed at tp 2 / pp 2 / ep 2, MindFormers at tp 2) -> HF,
    the MindSpore files read without interop's sidecar (the model from the Mixtral config.json): identical."""
    import transformers
    from helpers.hf_models import assert_same_hf
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, rms_norm_eps=1e-5, num_hidden_layers=2,
                                        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    code, out = run("convert", tmp_path / "hf", tmp_path / "ms", "--to", "mindspore", "--dialect", dialect, *args, "-q")
    assert code == 0, out
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "hf", "--model-config",
                    tmp_path / "hf" / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(tmp_path / "hf", tmp_path / "back")


def test_inspect_native_shows_the_local_expert_names_of_each_ep_rank(tmp_path):
    """`interop inspect --native` at ep 2: expert 3 is stored as local expert 1 in ep rank 1's file (rank_1 at
    tp 1 / dp 2), as MindSpeed's moe_layer.py numbers them, each expert's name with its file; the router, in every
    file, keeps its name."""
    from interop.describe import describe
    src, spec, tensors = moe_store(tmp_path / "common")
    write_at(src, tmp_path / "ms", ep=2)
    assert "language_model.encoder.layers.1.mlp.experts.local_experts.1.projection.weight" in load_ckpt(
        tmp_path / "ms" / "rank_1" / "network.ckpt")
    info = describe(tmp_path / "ms", native=True, model_config=str(tmp_path / "common-spec.json"))
    native = {t.name: t.native for t in info.tensors}
    assert native["layers.1.mlp.experts.3.down.weight"] == \
        "language_model.encoder.layers.1.mlp.experts.local_experts.1.projection.weight (rank_1)"
    assert native["layers.1.mlp.experts.1.up.weight"] == \
        "language_model.encoder.layers.1.mlp.experts.local_experts.1.mapping.weight (rank_0) [part 2/2]"
    assert native["layers.0.mlp.router.weight"] == "language_model.encoder.layers.0.mlp.router.gating.weight"
