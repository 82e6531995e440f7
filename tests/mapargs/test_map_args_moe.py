"""map-args carries mixture-of-experts flags both ways, checked against each target's own loader.

Real MoE launch scripts (tests/fixtures/args/PROVENANCE.tsv): MindSpeed-LLM's Mixtral 8x7B
(examples/mcore/mixtral/pretrain_mixtral_8x7b_ptd.sh) and DeepSeek-V3 671B
(examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh: shared expert, sigmoid router with expert
bias, grouped routing, the first three layers dense, MindSpeed's --n-shared-experts / --first-k-dense-replace).

Targets and where their MoE keys come from:
- MindSpeed-Core-MS r0.1.0 `MoEConfig` (mindspeed_ms/core/config.py, the top-level `moe_config` section;
  MindFormers r1.3.0's dynamic graph has the same class, mindformers/experimental/parallel_core/pynative/
  config.py): not installable here, so its validators are encoded in `moe_validate` below;
- MindFormers' static-graph `moe_config` (expert_num, num_experts_chosen, ...): MindFormers 2.1.0's own
  MindFormerConfig loads the output (it raises on a key its MoEConfig template lacks);
- Hugging Face: transformers' MixtralConfig / Qwen2MoeConfig read the config.json, and a tiny
  Qwen2MoeForCausalLM built from it has its sparse blocks on the layers Megatron's pattern says.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from interop import mapargs
from interop.mappings import megatron_args as M
from helpers.mapargs_loaders import UPSTREAM, _flags, mindformer_config, ms_validate, parse_megatron, run

FIXTURES = Path(__file__).parents[1] / "fixtures" / "args"
MIXTRAL, DEEPSEEK = FIXTURES / "mindspeedllm_mixtral_8x7b.sh", FIXTURES / "mindspeedllm_deepseek3_671b.sh"
ENV = {"1": "/c"}
# MoE values both real scripts give, under Megatron's names
MOE_DESTS = ("num_experts", "moe_router_topk", "moe_grouped_gemm", "moe_aux_loss_coeff",
             "moe_router_load_balancing_type", "moe_token_dispatcher_type")


def _source(script):
    return M.complete(mapargs.load(script, ENV).explicit)


def _back(text, target):
    """The Megatron values a target's file says (map-args' reader of that format)."""
    values, _, _ = mapargs.read_target(text, target)
    return M.complete(values)


def _parsed(args, dest):
    """A flag Megatron's parser left at None was not written: Megatron's default applies (the table's)."""
    value = getattr(args, dest)
    return M.ARGS[dest].default if value is None else value


def _as_list(v):
    return v if isinstance(v, list) else [v]


def moe_validate(doc: dict) -> list[str]:
    """The `moe_config` checks of MindSpeed-Core-MS r0.1.0 / MindFormers r1.3.0 MoEConfig validators."""
    moe = doc.get("moe_config") or {}
    rules = {"num_experts": lambda v: isinstance(v, int) and v > 0,
             "moe_grouped_gemm": lambda v: isinstance(v, bool),
             "moe_router_topk": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
             "moe_router_load_balancing_type": lambda v: v in ("aux_loss", "none"),
             "moe_token_dispatcher_type": lambda v: v == "alltoall",
             "moe_pad_expert_input_to_capacity": lambda v: isinstance(v, bool),
             "moe_aux_loss_coeff": lambda v: isinstance(v, float),
             "moe_token_drop_policy": lambda v: v in ("probs", "position")}
    return [f"moe_config.{k}={v!r}" for k, v in moe.items() if k in rules and not rules[k](v)] + [
        f"moe_config.{k}: not a MoEConfig argument" for k in moe if k not in rules and k not in (
            "use_self_defined_alltoall", "moe_expert_capacity_factor", "moe_z_loss_coeff", "moe_input_jitter_eps")]


def test_moe_validator_is_a_real_check():
    assert set(moe_validate({"moe_config": {"moe_token_dispatcher_type": "allgather", "moe_router_topk": 0,
                                            "expert_num": 8}})) == {
        "moe_config.moe_router_topk=0", "moe_config.moe_token_dispatcher_type='allgather'",
        "moe_config.expert_num: not a MoEConfig argument"}


@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
@pytest.mark.parametrize("script", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek3"])
def test_moe_config_section_both_ways(script, target):
    """Megatron -> the `moe_config` section the loader accepts -> Megatron: the MoE values come back."""
    result = mapargs.map_args(script, target, env=ENV, values={"vocab_size": "32000"})
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc, target) == [] and moe_validate(doc) == []
    source, back = _source(script), _back(result.text, target)
    moe = doc["moe_config"]
    assert moe["num_experts"] == source["num_experts"] and moe["moe_router_topk"] == source["moe_router_topk"]
    assert moe["moe_aux_loss_coeff"] == source["moe_aux_loss_coeff"][0] and moe["moe_grouped_gemm"] is True
    assert doc["parallel_config"]["expert_model_parallel_size"] == source["expert_model_parallel_size"]
    for dest in MOE_DESTS:
        assert _as_list(back[dest]) == _as_list(source[dest]), dest
    # what the section has no key for is named, never dropped silently
    lost = {e.flag for e in result.entries if e.lost}
    if script is DEEPSEEK:
        assert {"--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-ffn-hidden-size",
                "--n-shared-experts", "--first-k-dense-replace", "--expert-tensor-parallel-size"} <= lost
    assert not {"--num-experts", "--moe-router-topk", "--moe-aux-loss-coeff", "--moe-grouped-gemm",
                "--moe-router-load-balancing-type", "--expert-model-parallel-size"} & lost


def test_alltoall_seq_fork_value_is_noted_and_mapped():
    """MindSpeed's `alltoall_seq` dispatcher: read as upstream 'alltoall' with a note, which MoEConfig accepts."""
    result = mapargs.map_args(MIXTRAL, "mindspeed", env=ENV)
    notes = {e.flag: e.why for e in result.entries}
    assert notes["--moe-token-dispatcher-type"].endswith("read as 'alltoall'")
    assert yaml.safe_load(result.text)["moe_config"]["moe_token_dispatcher_type"] == "alltoall"


@pytest.mark.parametrize("target", ["mindspeed", "mindformers", "mindformers-legacy", "hf"])
def test_a_dense_model_gets_no_moe_keys(target):
    result = mapargs.map_args(FIXTURES / "mscorems_llama2_7b.sh", target, env={"1": "/c", "2": "/t"},
                              values={"vocab_size": "32000"})
    assert "moe" not in result.text and "expert" not in result.text.replace("expert_model_parallel_size: 1", "")


@pytest.mark.parametrize("script", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek3"])
def test_mindformers_moe_config_loads_in_mindformers(script, tmp_path):
    """MindFormers 2.1.0's MindFormerConfig loads the run_*.yaml with its `moe_config` (it raises on a key its
    MoEConfig lacks), with Megatron's values under MindFormers' names; and back."""
    out = tmp_path / "run.yaml"
    code, _, err = run(script, "--to", "mindformers-legacy", "-e", "1=/c", "-o", out)
    assert code == 0, err
    config = mindformer_config(out)
    source = _source(script)
    moe = config.moe_config
    assert moe.expert_num == source["num_experts"] and moe.num_experts_chosen == source["moe_router_topk"]
    assert moe.aux_loss_factor == source["moe_aux_loss_coeff"][0] and moe.use_gmm is True
    assert moe.moe_intermediate_size == (source["moe_ffn_hidden_size"] or source["ffn_hidden_size"])
    assert config.parallel_config.expert_parallel == source["expert_model_parallel_size"]
    back = _back(out.read_text(), "mindformers-legacy")
    if script is DEEPSEEK:  # sigmoid router with expert bias, grouped top-k, one shared expert of the expert size
        assert moe.use_gating_sigmoid is True and moe.balance_via_topk_bias is True
        assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (8, 4, 2.5)
        assert moe.shared_expert_num == 1
        for dest in ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                     "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size"):
            assert back[dest] == source[dest], dest
    else:
        assert moe.use_gating_sigmoid is False and moe.shared_expert_num == 0  # the template's default: none
    for dest in ("num_experts", "moe_router_topk", "moe_grouped_gemm", "moe_aux_loss_coeff"):
        assert _as_list(back[dest]) == _as_list(source[dest]), dest


def test_mixtral_script_to_hf_and_back(tmp_path):
    """The Mixtral script -> config.json that transformers' MixtralConfig reads with the same experts,
    top-k, expert size and aux loss (switched on for training); read back, the same Megatron values."""
    from transformers import AutoConfig, MixtralConfig

    (tmp_path / "hf").mkdir()
    out = tmp_path / "hf" / "config.json"
    code, _, err = run(MIXTRAL, "--to", "hf", "-e", "1=/c", "-o", out)
    assert code == 0, err
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    source = _source(MIXTRAL)
    assert isinstance(config, MixtralConfig)
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 14336)
    assert config.router_aux_loss_coef == 0.02 and config.output_router_logits is True
    back = _back(out.read_text(), "hf")
    for dest in ("num_experts", "moe_router_topk", "moe_aux_loss_coeff", "ffn_hidden_size", "num_layers"):
        assert _as_list(back[dest]) == _as_list(source[dest]), dest
    # --moe-layer-freq -1 is every layer (i % -1 == 0), Mixtral's pattern: not a loss
    assert "--moe-layer-freq" not in {e.flag for e in mapargs.map_args(MIXTRAL, "hf", env=ENV).entries if e.lost}


def test_deepseek_script_to_hf_is_deepseek_v3(tmp_path):
    """Multi-latent attention, the sigmoid router with its expert bias and grouped routing make it HF's
    DeepSeek-V3 (tests/mapargs/test_map_args_deepseek.py checks every value); its dense first layers become
    first_k_dense_replace, its shared expert n_shared_experts."""
    result = mapargs.map_args(DEEPSEEK, "hf", env=ENV)
    doc = json.loads(result.text)
    assert doc["model_type"] == "deepseek_v3" and doc["first_k_dense_replace"] == 3 and doc["n_shared_experts"] == 1
    lost = {e.flag for e in result.entries if e.lost}
    assert not {"--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-num-groups"} & lost


def _tiny(config_cls, **kw):
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32)
    return config_cls(**{**base, **kw}).to_dict()


def _moe_layers(config_dict) -> list[int]:
    """Which layers transformers' own Qwen2-MoE model builds with a sparse MoE block."""
    import transformers

    config = transformers.Qwen2MoeConfig(**{k: v for k, v in config_dict.items()
                                            if k not in ("model_type", "architectures", "transformers_version")})
    model = transformers.Qwen2MoeForCausalLM(config)
    return [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock"]


def test_hf_moe_configs_to_megatron_and_back(tmp_path):
    """transformers' own Mixtral and Qwen2-MoE configs -> Megatron flags core_v0.16's parser accepts -> config.json
    again: same experts, top-k, sizes; Qwen2-MoE's dense layers (decoder_sparse_step 2 + mlp_only_layers)
    become --moe-layer-freq, and the config written back puts the sparse blocks on the same layers of
    transformers' own model."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    cases = {"mixtral": _tiny(MixtralConfig, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01),
             "qwen2_moe": _tiny(Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3],
                                norm_topk_prob=True)}
    for name, doc in cases.items():
        src = tmp_path / f"{name}.json"
        src.write_text(json.dumps(doc))
        code, out, err = run(src, "--to", "megatron", "--from", "hf")
        assert code == 0, err
        assert set(_flags(out)) <= UPSTREAM
        args = parse_megatron(out)
        assert args.num_experts == 4 and _parsed(args, "moe_router_topk") == 2
        if name == "qwen2_moe":
            assert args.moe_ffn_hidden_size == 8 and args.moe_shared_expert_intermediate_size == 24
            assert args.moe_shared_expert_gate is True and args.add_qkv_bias is True
            assert M.moe_layer_pattern(args.moe_layer_freq, 4) == [0, 1, 0, 0]
        else:
            assert args.ffn_hidden_size == 32 and args.moe_aux_loss_coeff == [0.01]
        (tmp_path / "megatron.txt").write_text(out)
        again = json.loads(mapargs.map_args(tmp_path / "megatron.txt", "hf").text)
        assert again["model_type"] == name
        for key in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "intermediate_size", "router_aux_loss_coef", "norm_topk_prob"):
            if key in doc and key in again:
                assert again[key] == doc[key], (name, key)
        if name == "qwen2_moe":
            assert _moe_layers(again) == _moe_layers(doc) == [1]


def test_fork_moe_spellings_become_upstream_flags(tmp_path):
    """MindSpeed-LLM's --n-shared-experts / --first-k-dense-replace: written as the upstream flags they stand
    for (what Megatron-LM core_v0.16's parser takes), and not reported as lost."""
    result = mapargs.map_args(DEEPSEEK, "megatron", env=ENV)
    args = parse_megatron(result.text)
    assert args.moe_shared_expert_intermediate_size == 2048  # 1 shared expert of --moe-ffn-hidden-size 2048
    assert M.moe_layer_pattern(args.moe_layer_freq, 64) == [0] * 3 + [1] * 61
    lost = {e.flag for e in result.entries if e.lost}
    assert not {"--n-shared-experts", "--first-k-dense-replace", "--moe-layer-freq"} & lost
    for dest in MOE_DESTS + ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                             "moe_router_group_topk", "moe_router_topk_scaling_factor", "expert_model_parallel_size",
                             "expert_tensor_parallel_size", "moe_ffn_hidden_size"):
        assert _as_list(_parsed(args, dest)) == _as_list(_source(DEEPSEEK)[dest]), dest


@pytest.mark.parametrize("freq,layers,pattern", [
    (1, 3, [1, 1, 1]), (-1, 3, [1, 1, 1]), ("2", 4, [1, 0, 1, 0]), ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]),
    ("[1,0]", 3, None), ("__import__('os')", 3, None), ("[1]*10000000000", 3, None)])
def test_moe_layer_pattern_reads_megatrons_forms_without_eval(freq, layers, pattern):
    assert M.moe_layer_pattern(freq, layers) == pattern
