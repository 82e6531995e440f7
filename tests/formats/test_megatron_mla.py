"""Megatron multi-latent attention and MTP modules (DeepSeek-V2 / V3) in the torch and torch_dist formats.

The oracle is megatron-core 0.16.1's own GPTModel built on CPU (helpers/mcore_mla.py): its local layer spec's
names, tensor-parallel cuts and torch_dist keys, saved as Megatron-LM saves them, read by interop exactly, and
what interop writes (from HF) loaded strictly by fresh models built from the args interop wrote, every tensor equal.
Facts it pins (megatron/core/transformer/multi_latent_attention.py, models/gpt/gpt_layer_specs.py,
transformer/multi_token_prediction.py):
- the local spec's `linear_q_down_proj` / `linear_kv_down_proj` are ColumnParallelLinear: cut on their rows over
  TP although MLA computes them whole (RowsSplit); `linear_q_up_proj` / `linear_kv_up_proj` / `linear_q_proj` are
  cut by heads, `linear_proj` on its input; `q_layernorm` / `kv_layernorm` whole on every rank;
- MTP: `mtp.layers.{k}.{enorm, hnorm, eh_proj, transformer_layer.*, final_layernorm}` on the last stage, `eh_proj`
  column-parallel ([h/tp, 2h]); torch_dist keeps these keys (and the MLA local spec's own names: it has no
  sharded_state_dict_keys_map), an MTP layer's experts on the global expert axis alone.
The Transformer Engine spec (not buildable here) is read from a checkpoint laid out per
get_gpt_layer_with_transformer_engine_spec: input norm apart, the compression norms fused into the up projections
(`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`), the down projections TELinear
'duplicated' (whole on every rank), a dense layer's MLP norm fused into `linear_fc1`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import helpers.mcore_mla as ML  # noqa: E402
from helpers.deepseek_models import save, v2_config, v3_config  # noqa: E402
from interop.convert import convert  # noqa: E402
from interop.converters import megatron as meg  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return ML.reference_once(tmp_path_factory)


@pytest.mark.parametrize("kind", list(ML.KINDS))
@pytest.mark.parametrize("label", ["torch-tp2", "dist", "torch-ep2", "torch-pp2"])
def test_megatron_core_loads_what_interop_writes_every_tensor_equal(ref, kind, label):
    """mcore tp 2 save -> interop HF -> interop Megatron (torch tp 2, torch_dist, torch ep 2) -> a fresh mcore model
    built from interop's args loads it strictly and holds the saved model's tensors (ep 2: the same tensors as
    megatron-core's own resharding of interop's torch_dist; pp 2: so too, the last stage holding the MTP block and
    megatron-core's embedding copy for it, gpt_model.py `pre_process or mtp_process`)."""
    _, results = ref
    assert results[kind][f"differs:{label}"] == []
    mtp = ML.KINDS[kind]["mtp_num_layers"]
    last = set(results[kind]["keys:pp2-last"])
    assert ("embedding.word_embeddings.weight" in last) == bool(mtp) and ("mtp.layers.0.eh_proj.weight" in last) == bool(mtp)


@pytest.mark.parametrize("kind", list(ML.KINDS))
def test_the_args_interop_writes_state_the_mla_and_mtp_facts(ref, kind):
    _, results = ref
    facts = ML.KINDS[kind]
    for label in ("torch-tp2", "dist"):
        args = results[kind][f"args:{label}"]
        assert args["multi_latent_attention"] and args["qk_layernorm"] and args["transformer_impl"] == "local"
        assert (args["q_lora_rank"], args["kv_lora_rank"], args["qk_head_dim"], args["qk_pos_emb_head_dim"],
                args["v_head_dim"]) == (facts["q_lora_rank"], ML.DIMS["kv_lora_rank"], ML.DIMS["qk_head_dim"],
                                        ML.DIMS["qk_pos_emb_head_dim"], ML.DIMS["v_head_dim"])
        assert args["mtp_num_layers"] == facts["mtp_num_layers"]


def test_the_real_models_names_and_tp_cuts(ref):
    """megatron-core's own state dict at tp 2 (rank 0): the names and shapes interop's table encodes."""
    _, results = ref
    keys = results["v3"]["keys"]
    a = "decoder.layers.0.self_attention."
    assert keys[a + "linear_q_down_proj.weight"] == [48 // 2, 64]  # RowsSplit: q_lora_rank / tp
    assert keys[a + "linear_kv_down_proj.weight"] == [(32 + 8) // 2, 64]  # (kv_lora_rank + rope) / tp
    assert keys[a + "linear_q_up_proj.weight"] == [4 // 2 * 24, 48] and keys[a + "q_layernorm.weight"] == [48]
    assert keys[a + "linear_kv_up_proj.weight"] == [4 // 2 * 32, 32] and keys[a + "kv_layernorm.weight"] == [32]
    assert keys["mtp.layers.0.eh_proj.weight"] == [64 // 2, 128]
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.experts.local_experts.7.linear_fc2.weight"} <= set(keys)
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in results["v2lite"]["keys"]


@pytest.mark.parametrize("kind", list(ML.KINDS))
def test_interop_reads_megatron_cores_torch_and_torch_dist_saves_alike(ref, kind):
    """The same model saved by megatron-core in both formats reads to the same HF tensors; transformers loads them;
    DeepSeek-V3's MTP module arrives as the release stores it."""
    root, _ = ref
    a, b = (load_file(root / "interop" / f"{kind}-{x}" / "model.safetensors") for x in ("hf", "hf-from-dist"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    if ML.KINDS[kind]["mtp_num_layers"]:
        assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.shared_head.norm.weight",
                "model.layers.4.self_attn.kv_a_proj_with_mqa.weight"} <= set(a)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "interop" / f"{kind}-hf", dtype=torch.float32)
    assert torch.equal(model.model.layers[0].self_attn.kv_a_layernorm.weight,
                       a["model.layers.0.self_attn.kv_a_layernorm.weight"])


# -- HF DeepSeek (transformers' own models) -> Megatron -> HF, at tp 2 / pp 2 / ep 2 --------------------------------

# Megatron scores a group by the sum of its topk // group_topk best experts: DeepSeek-V3's sum of two is topk 4 of 2
# groups.  V2-Lite: no q compression, greedy softmax routing, no MTP.
HF_KINDS = {"v3-mtp": (lambda: v3_config(num_hidden_layers=4, num_experts_per_tok=4), True),
            "v2-lite": (lambda: v2_config(num_hidden_layers=4, topk_method="greedy"), False)}


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-hf")
    for kind, (config, mtp) in HF_KINDS.items():
        save(config(), root / kind, mtp=mtp)
    return root


@pytest.mark.parametrize("first", [None, 1])  # even stages, or an uneven pipeline of 1 + 3 layers
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_hf_deepseek_through_megatron_at_tp2_pp2_ep2_is_bit_exact_mtp_kept(hf_sources, tmp_path, kind, fmt, first):
    src = hf_sources / kind
    convert(src, tmp_path / "meg", dst_format="megatron", tp=2, pp=2, ep=2, format=fmt, first_stage_layers=first)
    if fmt == "torch":  # the MTP module on the last pipeline stage, beside the output layer
        last = torch.load(tmp_path / "meg" / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt",
                          weights_only=False)["model"]
        first = torch.load(tmp_path / "meg" / "release" / "mp_rank_00_000_000" / "model_optim_rng.pt",
                           weights_only=False)["model"]
        assert ("mtp.layers.0.eh_proj.weight" in last) == (kind == "v3-mtp")
        assert not any(k.startswith("mtp.") for k in first) and "output_layer.weight" in last
    convert(tmp_path / "meg", tmp_path / "hf", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# -- the Transformer Engine spec's names --------------------------------------------------------------------------

def te_layout(model: dict, peers: list[dict], dense_layers: set) -> dict:
    """A local-spec rank state dict re-laid out as get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=
    True, qk_layernorm=True) names and cuts it: the down projections whole (every rank's rows joined), the
    compression norms inside the up projections, a dense layer's MLP norm inside linear_fc1."""
    out = {}
    for key, value in model.items():
        if key.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
            value = torch.cat([p[key] for p in peers])
        for local, te in (("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"),
                          ("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight")):
            key = key.replace("self_attention." + local, "self_attention." + te)
        if any(key == f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in dense_layers):
            key = key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        out[key] = value
    return out


def test_transformer_engine_spec_mla_names_are_read(hf_sources, tmp_path):
    src = hf_sources / "v3-mtp"
    convert(src, tmp_path / "local", dst_format="megatron", tp=2)
    files = sorted((tmp_path / "local" / "release").glob("mp_rank_*/model_optim_rng.pt"))
    saved = [torch.load(f, weights_only=False) for f in files]
    peers = [s["model"] for s in saved]
    te = tmp_path / "te"
    for f, s in zip(files, saved):
        s = dict(s, model=te_layout(s["model"], peers, dense_layers={0}))
        s["args"].transformer_impl = "transformer_engine"
        (te / "release" / f.parent.name).mkdir(parents=True)
        torch.save(s, te / "release" / f.parent.name / f.name)
    (te / "latest_checkpointed_iteration.txt").write_text("release")
    assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in te_layout(peers[0], peers, {0})
    reader = meg.Reader(te)
    try:
        assert reader.source.state["megatron"]["scheme"] == "mcore_te"
    finally:
        reader.close()
    convert(te, tmp_path / "hf", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_group_scoring_megatron_cannot_compute_is_refused_before_writing(tmp_path):
    """DeepSeek-V3's groups score the sum of their two best experts; megatron-core sums topk // group_topk:
    top-2 of 2 groups is refused in one line at once, nothing left behind."""
    from helpers.hostile import assert_one_error, run

    save(v3_config(num_hidden_layers=2, num_experts_per_tok=2), tmp_path / "hf")
    for fmt in ("torch", "torch_dist"):
        assert_one_error(*run("convert", tmp_path / "hf", tmp_path / "out", "--to", "megatron", "--format", fmt),
                         "scores a group by the sum")
        assert not (tmp_path / "out").exists()


def test_verify_of_an_mla_megatron_output_runs_and_says_why_megatron_core_does_not(hf_sources, tmp_path):
    """V2-Lite to Megatron with --verify: the reference model and transformers agree, and megatron-core's own run
    is noted as impossible here (its MLA needs Transformer Engine's core attention), not a traceback."""
    from helpers.hostile import run

    code, output = run("convert", hf_sources / "v2-lite", tmp_path / "meg", "--to", "megatron", "--tp", "2",
                       "--verify")
    assert code == 0, output
    assert "does not build without Transformer Engine" in output and "Traceback" not in output


def test_mtp_sits_on_the_last_virtual_chunk_of_the_last_stage(hf_sources, tmp_path):
    """megatron-core builds the MTP block where is_pipeline_last_stage(ignore_virtual=False) holds
    (multi_token_prediction.py get_mtp_num_layers_to_build): the last stage's last model chunk."""
    src = hf_sources / "v3-mtp"
    convert(src, tmp_path / "meg", dst_format="megatron", tp=1, pp=2, vpp=2)
    last = torch.load(tmp_path / "meg" / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert any(k.startswith("mtp.layers.0.") for k in last["model1"])
    assert not any(k.startswith("mtp.") for k in last["model0"])
    convert(tmp_path / "meg", tmp_path / "hf", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_transformer_engine_spec_mla_names_written_and_read_in_torch_dist(hf_sources, tmp_path):
    """--transformer-impl transformer_engine: a torch_dist checkpoint under the TE spec's state-dict names (the TE
    MLA spec has no sharded_state_dict_keys_map): `linear_q_up_proj.layer_norm_weight`, MoE layers'
    `pre_mlp_layernorm`, a dense layer's `mlp.linear_fc1.layer_norm_weight`; its args say so; read back bit-exact."""
    from interop.converters.megatron import torch_dist

    src = hf_sources / "v3-mtp"
    convert(src, tmp_path / "te", dst_format="megatron", format="torch_dist",
            options={"transformer_impl": "transformer_engine"})
    ckpt = torch_dist.dist.DistCheckpoint(tmp_path / "te" / "release")
    assert {"decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
            "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight"} <= set(ckpt.keys())
    assert vars(ckpt.common["args"])["transformer_impl"] == "transformer_engine"
    reader = meg.Reader(tmp_path / "te")
    try:
        assert reader.source.state["megatron"]["scheme"] == "mcore_te"
    finally:
        reader.close()
    convert(tmp_path / "te", tmp_path / "hf", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_transformer_engine_spec_torch_output_is_the_te_layout(hf_sources, tmp_path):
    """--transformer-impl transformer_engine in the torch format: each rank file holds exactly the TE layout of the
    local one (`te_layout`, from get_gpt_layer_with_transformer_engine_spec), tensor for tensor."""
    src = hf_sources / "v3-mtp"
    convert(src, tmp_path / "local", dst_format="megatron", tp=2)
    convert(src, tmp_path / "te", dst_format="megatron", tp=2, options={"transformer_impl": "transformer_engine"})
    local = [torch.load(f, weights_only=False)["model"]
             for f in sorted((tmp_path / "local" / "release").glob("mp_rank_*/model_optim_rng.pt"))]
    for t, f in enumerate(sorted((tmp_path / "te" / "release").glob("mp_rank_*/model_optim_rng.pt"))):
        saved = torch.load(f, weights_only=False)
        want = {k: v for k, v in te_layout(local[t], local, {0}).items() if isinstance(v, torch.Tensor)}
        got = {k: v for k, v in saved["model"].items() if isinstance(v, torch.Tensor)}
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert saved["args"].transformer_impl == "transformer_engine"


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)])
def test_mindspeed_llm_deepseek3_layout_is_read_bit_exact(tmp_path, tp, pp):
    """MindSpeed-LLM's DeepSeek-V3 torch checkpoint (helpers/mindspeed_llm_deepseek.py lays it out as its
    convert_ckpt_deepseek3.py does: `linear_qkv` = [q_a; kv_a] on every TP rank, `linear_qb` / `linear_kvb`,
    `k_layernorm`, grouped experts, `mtp.final_layernorms.K`, the top-level `final_layernorm`, no args) reads with
    --model-config to the HF tensors it came from, and converts on to megatron-core's names."""
    from helpers.mindspeed_llm_deepseek import write

    config = v3_config(num_hidden_layers=4, num_experts_per_tok=4)
    save(config, tmp_path / "hf", mtp=True)
    write(tmp_path / "hf", tmp_path / "msl", config, tp=tp, pp=pp)
    options = {"model_config": str(tmp_path / "hf" / "config.json")}
    summary = convert(tmp_path / "msl", tmp_path / "back", dst_format="hf", options=options)
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any("legacy GroupedMLP" in n for n in summary.notes)
    convert(tmp_path / "msl", tmp_path / "meg", dst_format="megatron", options=options, tp=2, ep=2)
    convert(tmp_path / "meg", tmp_path / "again", dst_format="hf")
    c = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(a) == sorted(c) and [k for k in a if not torch.equal(a[k], c[k])] == []
