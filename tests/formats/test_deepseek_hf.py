"""DeepSeek-V3 / V2 Hugging Face checkpoints (built with transformers' own classes) read and written: the
tensors come back byte-identical, transformers' own model gives the same logits, and DeepSeek-V3's MTP module
(stored as the release stores it, `model.layers.{L}.*`) is carried both ways, never dropped."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.deepseek_models import config_json, logits, save, v2_config, v3_config
from interop.convert import convert
from interop.errors import InteropError
from interop.store import StoreReader

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
KINDS = {"v3-mtp": (v3_config, True), "v3": (v3_config, False), "v2-lite": (v2_config, False),
         "v2-greedy": (lambda: v2_config(topk_method="greedy", q_lora_rank=24, routed_scaling_factor=1.0), False)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for kind, (config, mtp) in KINDS.items():
        save(config(), root / kind, mtp=mtp)
        out[kind] = root / kind
    return out


def tensors(path):
    return load_file(path / "model.safetensors")


def assert_same(a, b):
    x, y = tensors(a), tensors(b)
    assert sorted(x) == sorted(y)
    for key in x:
        assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_to_interop_to_hf_is_byte_exact_with_transformers_logits(sources, tmp_path, kind):
    src = sources[kind]
    convert(src, tmp_path / "store", dst_format="interop")
    summary = convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    assert_same(src, tmp_path / "hf")
    assert torch.equal(logits(src, TOKENS), logits(tmp_path / "hf", TOKENS))
    written, given = config_json(tmp_path / "hf"), config_json(src)
    for key in ("model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
                "rope_parameters", "num_nextn_predict_layers", "topk_method", "rope_interleave"):
        if not (key in ("n_group", "topk_group") and given.get("topk_method") == "greedy"):  # unread there
            assert written.get(key) == given.get(key), key
    assert StoreReader(tmp_path / "store").source.spec.is_mla and summary.tensors


def test_v3_mtp_module_is_carried_and_the_copies_are_written(sources, tmp_path):
    convert(sources["v3-mtp"], tmp_path / "store", dst_format="interop")
    store = StoreReader(tmp_path / "store")
    names = {m.name for m in store.metas()}
    assert {"mtp.0.enorm.weight", "mtp.0.eh_proj.weight", "mtp.0.final_norm.weight",
            "mtp.0.layer.mlp.experts.7.down.weight", "mtp.0.layer.attn.kv_up.weight"} <= names
    assert store.source.spec.mtp_layers == 1
    held = tensors(sources["v3-mtp"])
    assert torch.equal(store.read("mtp.0.eh_proj.weight"), held["model.layers.3.eh_proj.weight"])
    assert torch.equal(store.read("mtp.0.layer.mlp.router.expert_bias"),
                       held["model.layers.3.mlp.gate.e_score_correction_bias"])
    convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    out = tensors(tmp_path / "hf")
    assert torch.equal(out["model.layers.3.embed_tokens.weight"], out["model.embed_tokens.weight"])
    assert torch.equal(out["model.layers.3.shared_head.head.weight"], out["lm_head.weight"])


def test_transformers_checkpoint_without_mtp_weights_keeps_its_config_and_says_so(sources, tmp_path):
    summary = convert(sources["v3"], tmp_path / "hf", dst_format="hf")
    assert any("num_nextn_predict_layers=1 but the checkpoint holds no MTP" in n for n in summary.notes)
    convert(sources["v3"], tmp_path / "store", dst_format="interop")
    assert StoreReader(tmp_path / "store").source.spec.mtp_layers == 0
    assert config_json(tmp_path / "hf")["num_nextn_predict_layers"] == 1


def _broken(src, dst, edit):
    dst.mkdir()
    held = tensors(src)
    edit(held)
    save_file(held, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.3.eh_proj.weight"), "model.layers.3.eh_proj.weight is missing"),
    (lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"),
     "model.layers.3.mlp.experts.5.up_proj.weight is missing"),
    (lambda t: t.pop("model.layers.3.embed_tokens.weight"), "embed_tokens.weight is missing"),
    (lambda t: t.update({"model.layers.3.shared_head.head.weight": t["lm_head.weight"] * 2}),
     "shared_head.head.weight differs from lm_head.weight"),
    (lambda t: t.pop("model.layers.2.mlp.gate.e_score_correction_bias"), "e_score_correction_bias is missing"),
])
def test_incomplete_deepseek_checkpoint_is_refused_naming_what_is_missing(sources, tmp_path, edit, message):
    src = _broken(sources["v3-mtp"], tmp_path / "src", edit)
    with pytest.raises(InteropError, match=message):
        convert(src, tmp_path / "out", dst_format="interop")
    assert not (tmp_path / "out").exists()


def test_original_deepseek_v3_config_keys_are_read(sources, tmp_path):
    """The release's config.json states rope scaling under `rope_scaling` with `type`, and scoring_func /
    topk_method / moe_layer_freq, which transformers' class does not have."""
    src = _broken(sources["v3-mtp"], tmp_path / "src", lambda t: None)
    config = config_json(src)
    scaling = config.pop("rope_parameters")
    config["rope_theta"] = scaling.pop("rope_theta")
    config["rope_scaling"] = {**{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "yarn"}
    config.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "store", dst_format="interop")
    scaling = StoreReader(tmp_path / "store").source.spec.rope_scaling
    assert scaling["type"] == "yarn" and scaling["mscale_all_dim"] == 1.0 and scaling["factor"] == 4.0
    convert(tmp_path / "store", tmp_path / "hf", dst_format="hf")
    assert torch.equal(logits(sources["v3-mtp"], TOKENS), logits(tmp_path / "hf", TOKENS))
    config["scoring_func"] = "softmax"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match="scoring_func 'softmax' is not supported"):
        convert(src, tmp_path / "hf2", dst_format="hf")


@pytest.mark.parametrize("kind", ["v3-mtp", "v2-lite"])
def test_verify_runs_the_reference_model_and_transformers_and_compares_the_mtp_module(sources, tmp_path, kind):
    from interop.workflows.verify import verify
    convert(sources[kind], tmp_path / "hf", dst_format="hf")
    result = verify(sources[kind], tmp_path / "hf")
    assert result.ok, result.lines()
    labels = [c.label for c in result.checks]
    assert "transformers, converted (hf)" in labels and len(result.checks) == 4 + 2 * (kind == "v3-mtp")
    if kind == "v3-mtp":  # the MTP module's own head on both sides: its logits, its loss on the tokens 2 ahead
        source, converted = result.checks[-2:]
        assert (source.label, converted.label) == ("reference model, source: MTP module 1 (tokens 2 ahead)",
                                                   "reference model, converted: MTP module 1 (tokens 2 ahead)")
        assert converted.max_diff == 0.0 and converted.loss == source.loss and 0 < source.loss < 20
