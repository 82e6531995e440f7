"""Megatron LoRA adapters in torch_dist under Megatron-Bridge's PEFT names (converters/megatron/lora_dist.py).

What Megatron-Bridge's source implies (NVIDIA-NeMo/Megatron-Bridge at 067f987df03b8355b03192d88d70f1709fedf51a):
- src/megatron/bridge/peft/adapter_wrapper.py `AdapterWrapper.sharded_state_dict`: the adapter's tensors are keyed
  `<module prefix>adapter.`; src/megatron/bridge/peft/utils.py `ParallelLinearAdapter`: its linears are
  `linear_in` (A) and `linear_out` (B), output scaled by alpha / dim;
- utils.py: for a column-parallel base (input_is_parallel False: linear_qkv, linear_fc1) linear_in is a
  ColumnParallelLinear(in, dim) (cut on dim, axis 0) and linear_out a ColumnParallelLinear(dim, out) (cut on out);
  for a row-parallel base (linear_proj, linear_fc2) linear_in is a RowParallelLinear(in, dim) (cut on in, axis 1)
  and linear_out a ColumnParallelLinear(dim, out); `sharded_state_dict` gives linear_fc1's linear_out
  `apply_swiglu_sharded_factory` when the model is gated (global [gate; up], as the base weight);
- src/megatron/bridge/training/checkpointing.py `apply_peft_adapter_filter_to_state_dict` with
  peft/base.py `adapter_key_filter`: an adapter-only checkpoint keeps the `.adapter.` keys, no `_extra_state`.
So every stored tensor is global (megatron-core's layer-stacked keys, `decoder.layers.<module>...` with a leading
layer axis): linear_in [L, r, in], linear_out [L, out, r] in the base weight's global row order, whatever tp.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli
from interop.convert import convert

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
P = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """peft 0.21's adapter on every linear of a tiny GQA Llama, q/k/v sharing one A and gate/up another (the form
    a fused megatron-core linear holds), saved by peft itself."""
    root = tmp_path_factory.mktemp("blora")
    model = build("llama")
    model.save_pretrained(root / "base")
    torch.manual_seed(11)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for layer in wrapped.base_model.model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            for m in (att.k_proj, att.v_proj):
                m.lora_A["default"].weight.copy_(att.q_proj.lora_A["default"].weight)
            mlp.up_proj.lora_A["default"].weight.copy_(mlp.gate_proj.lora_A["default"].weight)
    wrapped.save_pretrained(root / "lora")
    return root, model.config


def test_peft_to_bridge_torch_dist_tp2_and_back_byte_identical(peft_adapter, tmp_path):
    root, cfg = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", tp=2, format="torch_dist")
    folder = next(p for p in (tmp_path / "m").iterdir() if p.is_dir())
    md = FileSystemReader(str(folder)).read_metadata()  # torch's own DCP reader
    L, h, r = cfg.num_hidden_layers, cfg.hidden_size, 4
    d = h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    ffn = cfg.intermediate_size
    want = {
        "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight": (L, r, h),
        "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight": (L, qkv, r),
        "decoder.layers.self_attention.linear_proj.adapter.linear_in.weight": (L, r, cfg.num_attention_heads * d),
        "decoder.layers.self_attention.linear_proj.adapter.linear_out.weight": (L, h, r),
        "decoder.layers.mlp.linear_fc1.adapter.linear_in.weight": (L, r, h),
        "decoder.layers.mlp.linear_fc1.adapter.linear_out.weight": (L, 2 * ffn, r),
        "decoder.layers.mlp.linear_fc2.adapter.linear_in.weight": (L, r, ffn),
        "decoder.layers.mlp.linear_fc2.adapter.linear_out.weight": (L, h, r),
    }
    assert {k: tuple(v.size) for k, v in md.state_dict_metadata.items()} == want  # no _extra_state, no base
    common = torch.load(folder / "common.pt", weights_only=False)
    args = common["args"]
    assert (args.lora_r, args.lora_alpha, args.tensor_model_parallel_size, args.ckpt_format) == (4, 8, 2, "torch_dist")
    # Bridge's loader, without run_config.yaml, reads save_optim / save_rng from the args
    # (training/checkpointing.py _extract_megatron_lm_args_from_state_dict): neither is in an adapter checkpoint
    assert args.no_save_optim and args.no_save_rng

    # the global tensors hold what Bridge's cut implies: A whole, B in the base weight's global row order
    ours = load_file(root / "lora" / "adapter_model.safetensors")
    layer = 3
    dcp = {}
    from torch.distributed.checkpoint import load as dcp_load
    for key, shape in want.items():
        dcp[key] = torch.empty(shape, dtype=torch.float32)
    dcp_load(dcp, storage_reader=FileSystemReader(str(folder)))
    assert torch.equal(dcp["decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"][layer],
                       ours[P.format(layer, "self_attn", "q_proj", "A")])
    out = dcp["decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight"][layer]
    group = cfg.num_attention_heads // cfg.num_key_value_heads * d  # per KV group: its q heads, k, v
    assert torch.equal(out[:group], ours[P.format(layer, "self_attn", "q_proj", "B")][:group])
    assert torch.equal(out[group:group + d], ours[P.format(layer, "self_attn", "k_proj", "B")][:d])
    assert torch.equal(out[group + d:group + 2 * d], ours[P.format(layer, "self_attn", "v_proj", "B")][:d])
    fc1 = dcp["decoder.layers.mlp.linear_fc1.adapter.linear_out.weight"][layer]  # swiglu factory: [gate; up]
    assert torch.equal(fc1[:ffn], ours[P.format(layer, "mlp", "gate_proj", "B")])
    assert torch.equal(fc1[ffn:], ours[P.format(layer, "mlp", "up_proj", "B")])
    assert torch.equal(dcp["decoder.layers.mlp.linear_fc2.adapter.linear_in.weight"][layer],
                       ours[P.format(layer, "mlp", "down_proj", "A")])
    assert torch.equal(dcp["decoder.layers.self_attention.linear_proj.adapter.linear_out.weight"][layer],
                       ours[P.format(layer, "self_attn", "o_proj", "B")])

    convert(tmp_path / "m", tmp_path / "p", dst_format="peft")
    weights = "adapter_model.safetensors"
    assert (tmp_path / "p" / weights).read_bytes() == (root / "lora" / weights).read_bytes()  # peft's own file


def test_rank_not_divisible_by_tp_is_refused(peft_adapter, tmp_path):
    """Bridge cuts linear_in of linear_qkv / linear_fc1 on the rank: r 3 at tp 2 has no such cut."""
    root, _ = peft_adapter
    lora = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["gate_proj", "up_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(root / "base"), lora)
    with torch.no_grad():
        for layer in wrapped.base_model.model.model.layers:
            layer.mlp.up_proj.lora_A["default"].weight.copy_(layer.mlp.gate_proj.lora_A["default"].weight)
    wrapped.save_pretrained(tmp_path / "r3")
    assert_refused(cli("convert", tmp_path / "r3", tmp_path / "out", "--base", root / "base", "--to", "megatron",
                       "--format", "torch_dist", "--tp", "2"), tmp_path / "out", "rank 3", "tp=2")


def test_rank_missing_from_the_args_is_refused(peft_adapter, tmp_path):
    root, _ = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", format="torch_dist")
    path = next((tmp_path / "m").glob("*/common.pt"))
    common = torch.load(path, weights_only=False)
    del common["args"].lora_alpha
    torch.save(common, path)
    assert_refused(cli("convert", tmp_path / "m", tmp_path / "out", "--to", "peft"), tmp_path / "out",
                   "no lora_alpha", "never defaulted")


def test_megatron_core_loads_it_as_bridge_declares_it_at_tp2(peft_adapter, tmp_path):
    """megatron-core's dist_checkpointing.load, given the sharded tensors Bridge's ParallelLinearAdapter declares
    at tp 2 (helpers/bridge_lora_ref.py), reads each rank's cut: linear_in of linear_qkv / linear_fc1 cut on the
    rank, of linear_proj / linear_fc2 on the input; every linear_out cut on its rows (fc1: [gate_t; up_t])."""
    from helpers.bridge_lora_ref import load_at_tp2

    root, cfg = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", tp=2, format="torch_dist")
    folder = next(p for p in (tmp_path / "m").iterdir() if p.is_dir())
    d = cfg.hidden_size // cfg.num_attention_heads
    dims = dict(L=cfg.num_hidden_layers, r=4, h=cfg.hidden_size, heads_d=cfg.num_attention_heads * d,
                ffn=cfg.intermediate_size, fc1=2 * cfg.intermediate_size,
                qkv=(cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d)
    (tmp_path / "out").mkdir()
    ranks = load_at_tp2(folder, dims, tmp_path / "out")
    ours = load_file(root / "lora" / "adapter_model.safetensors")
    key = "decoder.layers.{}.adapter.linear_{}.weight"
    ffn, group = cfg.intermediate_size, cfg.num_attention_heads // cfg.num_key_value_heads * d
    for layer in range(cfg.num_hidden_layers):
        a = lambda mod, proj: ours[P.format(layer, mod, proj, "A")]
        b = lambda mod, proj: ours[P.format(layer, mod, proj, "B")]
        groups = []  # linear_qkv's B rows, grouped per KV group
        for g in range(cfg.num_key_value_heads):
            groups += [b("self_attn", "q_proj")[g * group:(g + 1) * group], b("self_attn", "k_proj")[g * d:(g + 1) * d],
                       b("self_attn", "v_proj")[g * d:(g + 1) * d]]
        qkv_b = torch.cat(groups)
        for t, got in enumerate(ranks):
            def at(module, which):
                return got[(key.format(module, which), layer)]
            assert torch.equal(at("self_attention.linear_qkv", "in"), a("self_attn", "q_proj").chunk(2)[t])
            assert torch.equal(at("self_attention.linear_qkv", "out"), qkv_b.chunk(2)[t])
            assert torch.equal(at("self_attention.linear_proj", "in"), a("self_attn", "o_proj").chunk(2, dim=1)[t])
            assert torch.equal(at("self_attention.linear_proj", "out"), b("self_attn", "o_proj").chunk(2)[t])
            assert torch.equal(at("mlp.linear_fc1", "in"), a("mlp", "gate_proj").chunk(2)[t])
            assert torch.equal(at("mlp.linear_fc1", "out"), torch.cat([b("mlp", "gate_proj").chunk(2)[t],
                                                                       b("mlp", "up_proj").chunk(2)[t]]))
            assert torch.equal(at("mlp.linear_fc2", "in"), a("mlp", "down_proj").chunk(2, dim=1)[t])
            assert torch.equal(at("mlp.linear_fc2", "out"), b("mlp", "down_proj").chunk(2)[t])
        assert ffn == b("mlp", "gate_proj").shape[0]


def test_merging_the_bridge_adapter_equals_merging_peft_s(peft_adapter, tmp_path):
    root, _ = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", tp=2, format="torch_dist")
    convert(root / "base", tmp_path / "a", dst_format="hf", adapter=tmp_path / "m", merge=True)
    convert(root / "base", tmp_path / "b", dst_format="hf", adapter=root / "lora", merge=True)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_distinct_q_k_v_a_is_refused_nothing_left(peft_adapter, tmp_path):
    """peft's q_proj, k_proj, v_proj with three A's: Bridge's linear_qkv holds one linear_in."""
    root, _ = peft_adapter
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(root / "base"), lora).save_pretrained(
        tmp_path / "qkv")
    assert_refused(cli("convert", tmp_path / "qkv", tmp_path / "out", "--base", root / "base", "--to", "megatron",
                       "--format", "torch_dist", "--tp", "2"), tmp_path / "out", "linear_qkv", "--lora-stack-ranks")


def test_bridge_s_own_common_pt_and_run_config_read_with_model_config(peft_adapter, tmp_path):
    """As Bridge saves it: common.pt without args (training/checkpointing.py generate_state_dict: checkpoint_version,
    iteration, ...), the LoRA settings in run_config.yaml (`peft:` the LoRA dataclass, yaml.safe_dump of the
    ConfigContainer, utils/yaml_utils.py); the base from --model-config."""
    import yaml

    root, _ = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", tp=2, format="torch_dist")
    folder = next(p for p in (tmp_path / "m").iterdir() if p.is_dir())
    torch.save({"checkpoint_version": 3.0, "iteration": 1}, folder / "common.pt")
    (folder / "run_config.yaml").write_text(yaml.safe_dump({
        "model": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
        "peft": {"_target_": "megatron.bridge.peft.lora.LoRA", "dim": 4, "alpha": 8, "dropout": 0.0,
                 "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}))
    convert(tmp_path / "m", tmp_path / "p", dst_format="peft", model_config=root / "base" / "config.json")
    weights = "adapter_model.safetensors"
    assert (tmp_path / "p" / weights).read_bytes() == (root / "lora" / weights).read_bytes()
    (folder / "run_config.yaml").write_text(yaml.safe_dump({"peft": {"dim": 4}}))
    assert_refused(cli("convert", tmp_path / "m", tmp_path / "out", "--to", "peft", "--model-config",
                       root / "base" / "config.json"), tmp_path / "out", "no lora_alpha", "never defaulted")


@pytest.mark.parametrize("tp,pp,vpp", [(1, 3, 1), (2, 3, 2)])
def test_any_pipeline_layout_same_global_tensors(peft_adapter, tmp_path, tp, pp, vpp):
    """torch_dist stores global tensors: the pipeline is the args' only (megatron-core reshards on load)."""
    root, _ = peft_adapter
    convert(root / "lora", tmp_path / "m", dst_format="megatron", base=root / "base", tp=tp, pp=pp, vpp=vpp,
            format="torch_dist")
    folder = next(p for p in (tmp_path / "m").iterdir() if p.is_dir())
    args = torch.load(folder / "common.pt", weights_only=False)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    convert(tmp_path / "m", tmp_path / "p", dst_format="peft")
    weights = "adapter_model.safetensors"
    assert (tmp_path / "p" / weights).read_bytes() == (root / "lora" / weights).read_bytes()
