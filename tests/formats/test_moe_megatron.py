"""Megatron mixture-of-experts checkpoints: real megatron-core 0.16.1 MoE models (CPU, gloo, tp 1 / ep 2) saved
as Megatron-LM saves them are read by interop exactly (torch format EP rank folders, torch_dist's global expert
axis, the legacy GroupedMLP's weight1/weight2), and what interop writes at ep 2, ep 1 and tp 2 loads into real
megatron-core models with the source model's loss.  See moe_megatron_ref for the reference run.

TEGroupedMLP needs Transformer Engine (absent here): its torch-format names `mlp.experts.linear_fc1.weight<j>`
are encoded from megatron/core/extensions/transformer_engine.py (TEGroupedLinear._sharded_state_dict_grouped,
`{prefix}weight{gemm_idx}`) and tested on a checkpoint built from the sequential one by renaming.
"""
import argparse
import shutil

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

import helpers.moe_megatron_ref as MR  # noqa: E402
from interop.convert import convert  # noqa: E402
from interop.converters import megatron as meg  # noqa: E402
from interop.errors import InteropError  # noqa: E402
from interop.layout import ParallelLayout  # noqa: E402
from interop.params import param_table  # noqa: E402
from interop.spec import ModelSpec  # noqa: E402
from interop.tensors import TensorMeta  # noqa: E402

TOL = 1e-5
E_LOCAL = MR.DIMS["num_experts"] // 2


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return MR.reference_once(tmp_path_factory)


def read_all(path, **options) -> dict:
    reader = meg.Reader(path, **options)
    try:
        return {m.name: reader.read(m.name).clone() for m in reader.metas()}, reader.source
    finally:
        reader.close()


def test_torch_format_has_megatron_lms_ep_rank_folders(ref):
    root, _ = ref
    for kind in MR.KINDS:
        names = sorted(p.name for p in (root / "torch" / kind / "iter_0000001").iterdir())
        assert names == ["mp_rank_00_000", "mp_rank_00_001"]
        model = torch.load(root / "torch" / kind / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
                           weights_only=False)["model"]
        layer = 1  # MoE in every kind
        assert f"decoder.layers.{layer}.mlp.router.weight" in model
        assert f"decoder.layers.{layer}.mlp.experts.local_experts.{E_LOCAL - 1}.linear_fc1.weight" in model
        assert f"decoder.layers.{layer}.mlp.experts.local_experts.{E_LOCAL}.linear_fc1.weight" not in model  # local numbers
        grouped = torch.load(root / "grouped" / kind / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
                             weights_only=False)["model"]
        h, f = MR.DIMS["hidden_size"], MR.DIMS["moe_ffn_hidden_size"]
        assert grouped[f"decoder.layers.{layer}.mlp.experts.weight1"].shape == (h, E_LOCAL * 2 * f)
        assert grouped[f"decoder.layers.{layer}.mlp.experts.weight2"].shape == (E_LOCAL * f, h)


def test_torch_dist_stores_experts_over_the_global_expert_axis(ref):
    from interop.io.megatron_dist import DistCheckpoint

    root, _ = ref
    ckpt = DistCheckpoint(root / "torch_dist" / "qwen2moe" / "iter_0000001")
    L, E, h, f = MR.DIMS["num_layers"], MR.DIMS["num_experts"], MR.DIMS["hidden_size"], MR.DIMS["moe_ffn_hidden_size"]
    assert ckpt.meta("decoder.layers.mlp.experts.experts.linear_fc1.weight")[1] == (L, E, 2 * f, h)
    assert ckpt.meta("decoder.layers.mlp.experts.experts.linear_fc2.weight")[1] == (L, E, h, f)
    assert ckpt.meta("decoder.layers.mlp.router.weight")[1] == (L, E, h)
    assert ckpt.meta("decoder.layers.mlp.shared_experts.gate_weight")[1] == (L, 1, h)
    # a local-spec MoE layer's pre-MLP norm under the fused name, as megatron-core's sharded keys map it
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in ckpt and "decoder.layers.pre_mlp_layernorm.weight" not in ckpt


@pytest.mark.parametrize("kind", list(MR.KINDS))
def test_mcore_checkpoints_read_exactly_in_every_layout(ref, kind):
    """torch (ep 2 folders), torch_dist and the legacy GroupedMLP's torch save of one model read the same
    tensors, and those are the model's: expert e of ep rank r is local expert e - r * E/ep there."""
    root, _ = ref
    torch_t, source = read_all(root / "torch" / kind)
    dist_t, dist_source = read_all(root / "torch_dist" / kind)
    grouped_t, _ = read_all(root / "grouped" / kind)
    spec = source.spec
    k = MR.KINDS[kind]
    assert spec.num_experts == 4 and spec.moe_topk == 2 and spec.moe_ffn_hidden == MR.DIMS["moe_ffn_hidden_size"]
    assert source.layout.ep == 2 and dist_source.spec == spec
    assert spec.shared_expert_ffn_hidden == k["moe_shared_expert_intermediate_size"]
    assert spec.shared_expert_gate == k["moe_shared_expert_gate"] and spec.moe_router_bias == k["moe_router_enable_expert_bias"]
    assert spec.moe_layers == ([1] if kind == "deepseek" else None)
    assert spec.moe_norm_topk == (kind != "qwen2moe")
    assert torch_t.keys() == dist_t.keys() == grouped_t.keys() == {p.name for p in param_table(spec)}
    for name in torch_t:
        assert torch.equal(torch_t[name], dist_t[name]), name
        assert torch.equal(torch_t[name], grouped_t[name]), name
    stored = torch.load(root / "torch" / kind / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
                        weights_only=False)["model"]
    fc1 = stored["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    f = MR.DIMS["moe_ffn_hidden_size"]
    assert torch.equal(torch_t["layers.1.mlp.experts.3.gate.weight"], fc1[:f])
    assert torch.equal(torch_t["layers.1.mlp.experts.3.up.weight"], fc1[f:])
    assert any("expert-parallel rank 0" in n for n in source.notes)


@pytest.mark.parametrize("kind", list(MR.KINDS))
def test_interop_output_loads_into_mcore_with_the_same_loss(ref, kind):
    """ep 2 (torch folders and torch_dist), ep 1 (tp 1 and tp 2 with expert tensor parallelism): megatron-core's
    own loaders take interop's output, and the model computes the source model's loss."""
    _, results = ref
    entry = results[kind]
    for label in ("dist-ep2", "torch-ep2", "dist-ep1", "torch-ep1", "dist-tp2", "torch-tp2"):
        assert abs(entry[f"loaded:{label}"] - entry["loss"]) < TOL, (label, entry)
    assert abs(entry["loaded:mcore-dist-ep2"] - entry["loss"]) < TOL


def test_interop_ep2_output_is_laid_out_as_mcore_saves_it(ref):
    root, _ = ref
    for fmt, label in (("torch", "torch-ep2"), ("torch_dist", "dist-ep2")):
        ours = root / "interop" / f"qwen2moe-{label}" / "iter_0000001"
        theirs = root / fmt / "qwen2moe" / "iter_0000001"
        if fmt == "torch":
            assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
            for folder in ("mp_rank_00_000", "mp_rank_00_001"):
                a = torch.load(ours / folder / "model_optim_rng.pt", weights_only=False)
                b = torch.load(theirs / folder / "model_optim_rng.pt", weights_only=False)
                assert set(a["model"]) == set(b["model"])  # same keys, _extra_state included
                assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"] if b["model"][k] is not None)
                assert a["args"].expert_model_parallel_size == 2 and a["args"].num_experts == 4
        else:
            from interop.io.megatron_dist import DistCheckpoint

            a, b = DistCheckpoint(ours), DistCheckpoint(theirs)
            assert set(b.keys()) <= set(a.keys())
            for key in b.keys():
                assert a.meta(key) == b.meta(key), key
                assert torch.equal(a.read(key, 1), b.read(key, 1)), key


# --- without megatron-core processes: spec-level round trips -----------------------------------------------

MIXTRAL = dict(arch="llama", num_layers=2, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=64,
               padded_vocab=128, max_positions=32, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
               tied_embeddings=False, qkv_bias=False, linear_bias=False, dtype="float32",
               num_experts=4, moe_topk=2, moe_ffn_hidden=8)


def _write(root, spec, layout, fmt, seed=0):
    torch.manual_seed(seed)
    tensors = {p.name: torch.randn(p.shape) for p in param_table(spec)}
    writer = meg.Writer(root, spec, layout, [TensorMeta(n, torch.float32, tuple(t.shape)) for n, t in tensors.items()],
                        format=fmt, iteration=5)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    return tensors


@pytest.mark.parametrize("src_fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("dst_fmt", ["torch", "torch_dist"])
def test_mixtral_shaped_ep2_tp2_to_ep1_is_bit_exact(tmp_path, src_fmt, dst_fmt):
    spec = ModelSpec(**MIXTRAL)
    tensors = _write(tmp_path / "src", spec, ParallelLayout.build(2, tp=2, ep=2), src_fmt)
    if src_fmt == "torch":
        names = sorted(p.name for p in (tmp_path / "src" / "iter_0000005").iterdir())
        assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    convert(tmp_path / "src", tmp_path / "ep1", dst_format="megatron", tp=1, ep=1, format=dst_fmt)
    convert(tmp_path / "ep1", tmp_path / "ep4", dst_format="megatron", tp=2, pp=2, ep=4, format=src_fmt)
    for path in (tmp_path / "ep1", tmp_path / "ep4"):
        got, source = read_all(path)
        assert source.spec == spec.replace(padded_vocab=source.spec.padded_vocab)
        assert got.keys() == tensors.keys()
        for name, t in tensors.items():
            assert torch.equal(got[name][:t.shape[0]] if name.startswith(("embed", "lm_head")) else got[name], t), name
    assert meg.Reader(tmp_path / "ep4").source.layout.ep == 4


def test_two_part_folder_names_are_pp_or_ep_as_the_args_say(tmp_path):
    """TP 2 PP 1 EP 2 and TP 2 PP 2 EP 1 give the same folder names (docs/megatron-layouts.md s.1)."""
    spec = ModelSpec(**MIXTRAL)
    tensors = _write(tmp_path / "ep", spec, ParallelLayout.build(2, tp=2, ep=2), "torch")
    _write(tmp_path / "pp", spec, ParallelLayout.build(2, tp=2, pp=2), "torch")
    names = lambda p: sorted(c.name for c in (p / "iter_0000005").iterdir())  # noqa: E731
    assert names(tmp_path / "ep") == names(tmp_path / "pp")
    assert meg.Reader(tmp_path / "ep").source.layout.ep == 2 and meg.Reader(tmp_path / "pp").source.layout.pp == 2
    got, _ = read_all(tmp_path / "ep")
    assert all(torch.equal(got[n], t) for n, t in tensors.items() if not n.startswith(("embed", "lm_head")))


def test_te_spec_with_te_grouped_experts_reads_like_sequential(tmp_path):
    """A Transformer-Engine-spec MoE checkpoint (what Megatron-LM's convert.py writes for MoE, docs/megatron-layouts.md
    s.4 and s.6.2): the input norm fused into `linear_qkv.layer_norm_weight`, a MoE layer's `pre_mlp_layernorm`
    apart, and TEGroupedMLP's keys (`linear_fc1.weight<j>`, local j) holding what SequentialMLP's
    `local_experts.<j>.linear_fc1.weight` hold (transformer_engine.py TEGroupedLinear, sharded dict interchangeable)."""
    spec = ModelSpec(**MIXTRAL)
    tensors = _write(tmp_path / "seq", spec, ParallelLayout.build(2, ep=2), "torch")
    shutil.copytree(tmp_path / "seq", tmp_path / "te")
    for path in (tmp_path / "te" / "iter_0000005").glob("*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        renamed = {}
        for key, value in state["model"].items():
            if ".local_experts." in key:
                head, tail = key.split(".local_experts.")
                j, fc, leaf = tail.split(".", 2)
                key = f"{head}.{fc}.{'weight' + j if leaf == 'weight' else leaf}"
                if leaf == "_extra_state":
                    continue
            key = key.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
            renamed[key] = value
        state["model"] = renamed
        torch.save(state, path)
    got, source = read_all(tmp_path / "te")
    assert any("TEGroupedMLP" in n for n in source.notes) and source.state["megatron"]["scheme"] == "mcore_te"
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[n][:t.shape[0]], t) for n, t in tensors.items())


def test_bad_expert_parallelism_is_one_line(tmp_path):
    spec = ModelSpec(**MIXTRAL)
    _write(tmp_path / "src", spec, ParallelLayout.build(2, ep=2), "torch")
    with pytest.raises(InteropError, match="ep=3 does not divide the 4 experts"):
        convert(tmp_path / "src", tmp_path / "bad", dst_format="megatron", ep=3)
    assert not (tmp_path / "bad").exists()
    shutil.rmtree(tmp_path / "src" / "iter_0000005" / "mp_rank_00_001")
    with pytest.raises(InteropError, match="mp_rank_00_001 is missing"):
        meg.Reader(tmp_path / "src")


def test_moe_args_round_trip_through_the_spec(tmp_path):
    from interop.mappings.megatron_spec import args_from_spec, spec_from_args
    from interop.mappings import megatron_args as M

    spec = ModelSpec(**dict(MIXTRAL, moe_layers=[1], shared_expert_ffn_hidden=16, shared_expert_gate=True,
                            moe_norm_topk=False))
    args = args_from_spec(spec, ParallelLayout.build(2, tp=2, ep=2))
    assert args["moe_layer_freq"] == [0, 1] and args["moe_router_pre_softmax"] is True
    assert args["expert_model_parallel_size"] == 2 and args["sequence_parallel"] is True
    full = M.complete({k: v for k, v in args.items() if k in M.ARGS})
    assert spec_from_args(full, "test", "float32") == spec
    assert spec_from_args(dict(full, moe_layer_freq="([0]*1+[1]*1)"), "test", "float32").moe_layers == [1]
    # DeepSeek's routed scaling is a fact now (mappings/megatron_deepseek.py); a group score other than
    # megatron-core's sum of two is refused
    assert spec_from_args(dict(full, moe_router_topk_scaling_factor=2.5), "test", "float32").moe_routed_scaling == 2.5
    with pytest.raises(InteropError, match="moe_router_topk // moe_router_group_topk"):
        spec_from_args(dict(full, moe_router_num_groups=2, moe_router_group_topk=2), "test", "float32")
    assert isinstance(argparse.Namespace(**args), argparse.Namespace)


def test_grouped_experts_transform_at_expert_tensor_parallel_2():
    """The legacy GroupedMLP at tp 2: rank t's weight1.view(E_l, h, -1)[j] is [gate_j,t; up_j,t].T and
    weight2.view(E_l, -1, h)[j] is down_j's rank-t columns, transposed (experts.py GroupedMLP's views)."""
    from interop.params import param_index
    from interop.transforms import GroupedExperts

    spec = ModelSpec(**MIXTRAL)
    index = param_index(spec)
    fc1 = [index[f"layers.0.mlp.experts.{e}.{w}.weight"] for e in (2, 3) for w in ("gate", "up")]
    fc2 = [index[f"layers.0.mlp.experts.{e}.down.weight"] for e in (2, 3)]
    torch.manual_seed(0)
    for params in (fc1, fc2):
        transform = GroupedExperts.bind(spec, params)
        parts = [torch.randn(p.shape) for p in params]
        ranks = [transform.to_rank(parts, t, 2) for t in range(2)]
        f, h = spec.moe_ffn_hidden // 2, spec.hidden
        for t, stored in enumerate(ranks):
            for j in range(2):
                if params is fc1:
                    assert stored.shape == (h, 2 * 2 * f)
                    want = torch.cat([parts[2 * j][t * f:(t + 1) * f], parts[2 * j + 1][t * f:(t + 1) * f]]).t()
                    assert torch.equal(stored.view(2, h, -1)[j], want)
                else:
                    assert stored.shape == (2 * f, h)
                    assert torch.equal(stored.view(2, -1, h)[j], parts[j][:, t * f:(t + 1) * f].t())
        back = transform.from_ranks(ranks)
        assert all(torch.equal(a, b) for a, b in zip(back, parts))


def test_expert_tensor_parallelism_other_than_tp_in_the_torch_format(tmp_path):
    """--etp: Megatron-LM's torch format at etp != tp has one folder per saving rank (expert-data-parallel rank 0:
    local ranks r < etp * ep, named mp_rank_{r % tp}_{r // etp % ep}, holding expert tp shard r % etp), not the
    tp x ep grid; interop writes and reads exactly that, and refuses the layouts whose Megatron-LM save loses shards."""
    spec = ModelSpec(**MIXTRAL)
    tensors = _write(tmp_path / "src", spec, ParallelLayout.build(2, tp=2, ep=2, etp=1), "torch")
    assert sorted(p.name for p in (tmp_path / "src" / "iter_0000005").iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    state = torch.load(tmp_path / "src" / "iter_0000005" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert state["args"].expert_tensor_parallel_size == 1 and state["args"].tensor_model_parallel_size == 2
    f, h = spec.moe_ffn_hidden, spec.hidden
    assert state["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (2 * f, h)  # whole
    assert state["model"]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, spec.heads * spec.head_dim // 2)
    convert(tmp_path / "src", tmp_path / "e4", dst_format="megatron", tp=2, ep=4, etp=1)
    assert sorted(p.name for p in (tmp_path / "e4" / "iter_0000005").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]
    for path in (tmp_path / "src", tmp_path / "e4"):
        got, source = read_all(path)
        assert source.layout.etp == 1 and source.layout.tp == 2
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[n][:t.shape[0]], t) for n, t in tensors.items())
    for tp, ep, etp, why in ((2, 1, 1, "writes no file for tp rank 1"), (1, 1, 2, "writes two ranks' files")):
        with pytest.raises(InteropError, match=why):
            convert(tmp_path / "src", tmp_path / "bad", dst_format="megatron", tp=tp, ep=ep, etp=etp)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(InteropError, match="etp=3 does not divide"):
        convert(tmp_path / "src", tmp_path / "bad", dst_format="megatron", tp=2, etp=3)


def test_layout_carries_etp():
    """ParallelLayout.etp: tp unless given (megatron-core's default), stored only when it differs, and refused in one
    line when nonsense."""
    plain = ParallelLayout.build(2, tp=2, ep=2)
    assert plain.etp == 2 and "etp" not in plain.to_dict() and plain == ParallelLayout.build(2, tp=2, ep=2, etp=2)
    split = ParallelLayout.build(2, tp=2, ep=2, etp=1)
    assert split.to_dict()["etp"] == 1 and ParallelLayout.from_dict(split.to_dict()) == split
    assert "etp=1" in split.describe() and split != plain
    with pytest.raises(InteropError, match="--etp must be a positive integer"):
        ParallelLayout.build(2, tp=2, etp=0)
    with pytest.raises(InteropError, match="--etp 2 needs a mixture-of-experts model"):
        ModelSpec(**{k: v for k, v in MIXTRAL.items() if not k.startswith(("num_experts", "moe_"))}).check_etp(2, 1)


def test_expert_tensor_parallel_1_at_tp_2_against_megatron_core(ref, tmp_path):
    """megatron-core at tp 2 / etp 1: with ep 2 it loads interop's torch-format output (folders mp_rank_00_000 and
    mp_rank_01_001) and, at ep 1, interop's torch_dist output, with the source model's loss; its own torch-format save
    at tp 2 / ep 2 / etp 1 reads back exactly the source's tensors (moe_etp_ref)."""
    import helpers.moe_etp_ref as E

    root, results = ref
    kind = "qwen2moe"
    convert(root / "torch" / kind, tmp_path / "etp-torch", dst_format="megatron", tp=2, ep=2, etp=1)
    convert(root / "torch" / kind, tmp_path / "etp-dist", dst_format="megatron", tp=2, ep=1, etp=1, format="torch_dist")
    got = E.run(tmp_path, kind, tmp_path / "etp-torch" / "iter_0000001", tmp_path / "etp-dist" / "iter_0000001")
    loss = results[kind]["loss"]
    assert abs(got["loss:torch"] - loss) < TOL and abs(got["loss:dist"] - loss) < TOL, (got, loss)
    assert sorted(p.name for p in (tmp_path / "mcore-etp" / "iter_0000001").iterdir()) == ["mp_rank_00_000",
                                                                                          "mp_rank_01_001"]
    theirs, source = read_all(tmp_path / "mcore-etp")
    want, _ = read_all(root / "torch" / kind)
    assert source.layout.etp == 1 and source.layout.ep == 2 and source.layout.tp == 2
    assert theirs.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(theirs[name], t), name


def test_grouped_gemm_sources_are_written_as_sequential_experts_with_a_note(ref, tmp_path):
    """The legacy GroupedMLP source (args moe_grouped_gemm=True): the torch format gets SequentialMLP keys and
    args that build SequentialMLP (said in a note); torch_dist keeps the flag (its layout serves both)."""
    root, _ = ref
    summary = convert(root / "grouped" / "mixtral", tmp_path / "torch", dst_format="megatron", ep=2)
    assert any("written as SequentialMLP" in n for n in summary.notes)
    state = torch.load(tmp_path / "torch" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert state["args"].moe_grouped_gemm is False
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in state["model"]
    convert(root / "grouped" / "mixtral", tmp_path / "dist", dst_format="megatron", format="torch_dist")
    dist_t, source = read_all(tmp_path / "dist")
    grouped_t, _ = read_all(root / "grouped" / "mixtral")
    assert source.state["megatron"]["args"]["moe_grouped_gemm"] is True
    assert all(torch.equal(dist_t[n], t) for n, t in grouped_t.items())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_hf_moe_to_megatron_ep2_tp2_and_back_is_bit_exact(tmp_path, fmt):
    """HF Mixtral and Qwen2-MoE (shared expert with gate, a dense layer between MoE layers) -> Megatron
    tp 2 / ep 2 -> HF: the same tensors, and transformers computes the same logits."""
    pytest.importorskip("transformers")
    import test_moe_hf as H
    from helpers.hf_models import assert_same_hf

    for kind in H.KINDS:
        model = H.build(kind)
        model.save_pretrained(tmp_path / kind)
        with torch.no_grad():
            logits = model(H.TOKENS).logits
        convert(tmp_path / kind, tmp_path / f"{kind}-meg", dst_format="megatron", tp=2, ep=2, format=fmt)
        convert(tmp_path / f"{kind}-meg", tmp_path / f"{kind}-hf", dst_format="hf")
        assert_same_hf(tmp_path / kind, tmp_path / f"{kind}-hf")
        assert torch.equal(H.hf_logits(tmp_path / f"{kind}-hf"), logits)
