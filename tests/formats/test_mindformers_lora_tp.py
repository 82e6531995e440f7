"""MindFormers LoRA adapters at tp / pp > 1 (converters/mindspore/lora.py): `rank_{p*tp+t}/checkpoint_{p*tp+t}.ckpt`
per rank plus `strategy/strategy_stage{p}.json`, as MindFormers' weights are, A and B cut like the weight they adapt.

How MindFormers cuts them (mindformers 2.1.0, mindpet 1.0.4 installed here; checked below against the real code):
- legacy models (LlamaForCausalLM): mindformers/pet/tuners/lora_adapter.py lines 121-145 give mindpet's
  LoRADense (mindpet/delta/lora.py `shard`, lines 133-166, takes them from its caller) the Linear's matmul
  strategy ((dp, mp_in), (mp_out, mp_in)) as lora_a_matmul ((dp, mp_in), (1, mp_in)) and lora_b_matmul
  ((dp, 1), (mp_out, 1)); with transpose_b the second input IS the parameter, so A [r, in] is cut on `in` only
  where the weight is (wo, w2: row-parallel, models/llama/llama_transformer.py:314, llama_layer.py:474) and
  B [out, r] on `out` only where the weight is (wq / wk / wv: llama_transformer.py:300-302; w1 / w3:
  llama_layer.py:471, 475);
- mcore-style models: parallel_core/training_graph/tensor_parallel/lora_layers.py ColumnParallelLinearWithLoRA
  (lines 152-167: lora_A a LinearNoTP, lora_B a ColumnParallelLinear) and RowParallelLinearWithLoRA (lines
  320-335: lora_A a RowParallelLinear, lora_B a LinearNoTP); layers.py `sharded_state_dict` (lines 453, 716,
  792) states each one's local shape and axis_fragmentations.
That is `interop.adapter.SPLITS`; B of the fused linear_qkv / linear_fc1 is cut in contiguous rows of its
fused layout like the fused weight (the strategy's tensor_map, applied by mindspore.transform_checkpoints).
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli, run
from interop.convert import convert
from interop.io.ms_ckpt import CkptFile, load_ckpt, save_ckpt

peft = pytest.importorskip("peft")
ms = pytest.importorskip("mindspore")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A PEFT adapter on HF Llama (vocab 250, 8 heads / 4 KV groups) and MindFormers legacy at tp 2 and tp 1."""
    root = tmp_path_factory.mktemp("mflora-tp")
    model = build("llama")
    model.save_pretrained(root / "base")
    torch.manual_seed(2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, init_lora_weights=False, target_modules=TARGETS)
    peft.get_peft_model(model, lora).save_pretrained(root / "lora")
    code, out = run("convert", root / "lora", root / "mf2", "--to", "mindspore", "--base", root / "base", "--tp", "2")
    assert code == 0, out
    convert(root / "lora", root / "mf1", dst_format="mindspore", base=root / "base")
    return root


def _strategy(folder):
    return json.loads((folder / "strategy" / "strategy_stage0.json").read_text())["parallel_layout_item"]


def _run_yaml(adapter, path):
    """The run's YAML: the base's model_config (written by `interop map-args` from its config.json) and the
    pet_config of the PEFT adapter."""
    code, out = run("map-args", adapter / "base" / "config.json", "--to", "mindformers", "-o", path)
    assert code == 0, out
    doc = yaml.safe_load(path.read_text())
    doc["model_config"]["pet_config"] = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.05,
                                         "target_modules": ".*wq|.*wk|.*wv|.*wo|.*w1|.*w2|.*w3"}
    path.write_text(yaml.safe_dump(doc))


def _same_peft(a, b):
    x, y = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_peft_to_mindformers_tp2_and_back_is_byte_identical(adapter, tmp_path):
    assert sorted(p.relative_to(adapter / "mf2").as_posix() for p in (adapter / "mf2").rglob("*.ckpt")) == \
        ["rank_0/checkpoint_0.ckpt", "rank_1/checkpoint_1.ckpt"]
    single = load_ckpt(adapter / "mf1" / "model.ckpt")
    for t in range(2):
        path = adapter / "mf2" / f"rank_{t}" / f"checkpoint_{t}.ckpt"
        loaded = ms.load_checkpoint(str(path))  # MindSpore's own loader takes each rank file
        assert sorted(loaded) == sorted(single)
        shapes = {k: tuple(v.shape) for k, v in loaded.items()}
        p = "model.layers.3."
        assert shapes[p + "attention.wq.mindpet_delta_lora_a"] == (4, 64)  # column: A whole
        assert shapes[p + "attention.wk.mindpet_delta_lora_b"] == (16, 4)  # GQA k: 4 groups x 8 rows, half each
        assert shapes[p + "attention.wo.mindpet_delta_lora_a"] == (4, 32)  # row: A's columns cut
        assert shapes[p + "attention.wo.mindpet_delta_lora_b"] == (64, 4)  # row: B whole
        assert shapes[p + "feed_forward.w2.mindpet_delta_lora_a"] == (4, 48)
        b = torch.from_numpy(loaded[p + "feed_forward.w1.mindpet_delta_lora_b"].asnumpy())
        assert torch.equal(b, single[p + "feed_forward.w1.mindpet_delta_lora_b"][48 * t:48 * (t + 1)])
    pet = yaml.safe_load((adapter / "mf2" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
    assert (pet["lora_rank"], pet["lora_alpha"]) == (4, 8)
    convert(adapter / "mf2", tmp_path / "back", dst_format="peft")
    _same_peft(adapter / "lora", tmp_path / "back")
    convert(adapter / "mf2", tmp_path / "one", dst_format="mindspore")  # tp 2 -> tp 1: the tp 1 write, exactly
    assert {k: v.tolist() for k, v in load_ckpt(tmp_path / "one" / "model.ckpt").items()} == \
        {k: v.tolist() for k, v in single.items()}
    for n in (1, 2):  # merged into the base from either: the same bytes
        convert(adapter / "base", tmp_path / f"merged{n}", dst_format="hf", adapter=adapter / f"mf{n}", merge=True)
    merged = [load_file(tmp_path / f"merged{n}" / "model.safetensors") for n in (1, 2)]
    assert sorted(merged[0]) == sorted(merged[1])
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


def test_tp4_one_kv_group_per_rank_and_resharded_to_tp2(adapter, tmp_path):
    """tp 4 over 4 KV groups: wk's B is one group's 8 rows per rank; MindSpore -> MindSpore to tp 2 gives the
    tp 2 write's bytes; PEFT comes back byte for byte."""
    convert(adapter / "lora", tmp_path / "mf4", dst_format="mindspore", base=adapter / "base", tp=4)
    with CkptFile(tmp_path / "mf4" / "rank_3" / "checkpoint_3.ckpt") as f:
        assert f.meta("model.layers.0.attention.wk.mindpet_delta_lora_b")[1] == (8, 4)
        assert f.meta("model.layers.0.feed_forward.w2.mindpet_delta_lora_a")[1] == (4, 24)
    convert(tmp_path / "mf4", tmp_path / "mf2", dst_format="mindspore", tp=2)
    for t in range(2):
        got = load_ckpt(tmp_path / "mf2" / f"rank_{t}" / f"checkpoint_{t}.ckpt")
        want = load_ckpt(adapter / "mf2" / f"rank_{t}" / f"checkpoint_{t}.ckpt")
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _strategy(tmp_path / "mf2") == _strategy(adapter / "mf2")
    convert(tmp_path / "mf4", tmp_path / "back", dst_format="peft")
    _same_peft(adapter / "lora", tmp_path / "back")


def test_legacy_lora_dense_strategies_are_the_written_split(adapter, tmp_path, monkeypatch):
    """MindFormers' own LoraModel around LlamaForCausalLM at model_parallel 2 (semi-auto parallel; its device
    count check asks the communication group, which a CPU test has not got: told 2): each LoRADense's
    lora_a_matmul / lora_b_matmul strategy on its parameter (the MatMul's second input, transpose_b) cuts
    exactly the axes our strategy file cuts, into the shapes our rank files hold; the names are the same."""
    monkeypatch.chdir(tmp_path)  # MindFormers writes ./output/log on import
    pytest.importorskip("mindformers")
    import mindformers.modules.transformer.op_parallel_config as op_parallel_config
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
    from mindformers.pet.models.lora import LoraModel
    from mindformers.pet.pet_config import LoraConfig
    from mindpet.delta.lora import LoRADense
    monkeypatch.setattr(op_parallel_config.D, "get_group_size", lambda *a, **k: 2)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
    try:
        config = LlamaConfig(batch_size=1, seq_length=8, hidden_size=64, num_layers=6, num_heads=8, n_kv_heads=4,
                             vocab_size=250, intermediate_size=96, compute_dtype="float32",
                             layernorm_compute_type="float32", softmax_compute_type="float32",
                             rotary_dtype="float32", param_init_type="float32", use_flash_attention=False,
                             qkv_concat=False, use_past=False, fused_rms_norm=False,
                             parallel_config=TransformerOpParallelConfig(data_parallel=1, model_parallel=2))
        pet = yaml.safe_load((adapter / "mf2" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
        model = LoraModel(LoraConfig(lora_rank=4, lora_alpha=8, target_modules=pet["target_modules"]),
                          LlamaForCausalLM(config))
        cells = [c for _, c in model.cells_and_names() if isinstance(c, LoRADense)]
        mf = {}
        for c in cells:
            mf[c.mindpet_delta_lora_a.name] = (c.lora_a_matmul.in_strategy[1], tuple(c.mindpet_delta_lora_a.shape))
            mf[c.mindpet_delta_lora_b.name] = (c.lora_b_matmul.in_strategy[1], tuple(c.mindpet_delta_lora_b.shape))
    finally:
        ms.reset_auto_parallel_context()
    strategy = _strategy(adapter / "mf2")
    assert len(cells) == 6 * 7 and sorted(mf) == sorted(strategy)
    with CkptFile(adapter / "mf2" / "rank_1" / "checkpoint_1.ckpt") as f:
        for name, (cuts, full) in mf.items():
            assert strategy[name]["tensor_map"] == [0 if n == 2 else -1 for n in cuts], (name, cuts)
            assert f.meta(name)[1] == tuple(d // n for d, n in zip(full, cuts)), name


def test_transform_checkpoints_merges_them_into_what_mindformers_llama_loads(adapter, tmp_path):
    """mindspore.transform_checkpoints, given our strategy file, merges the tp 2 rank files into exactly the tp 1
    adapter; with the base written for MindFormers, its LoraModel(LlamaForCausalLM) loads them strictly."""
    ms.transform_checkpoints(str(adapter / "mf2"), str(tmp_path / "merged"), "ckpt",
                             str(adapter / "mf2" / "strategy" / "strategy_stage0.json"), None)
    merged = ms.load_checkpoint(next(str(p) for p in (tmp_path / "merged" / "rank_0").glob("*.ckpt")))
    single = load_ckpt(adapter / "mf1" / "model.ckpt")
    assert sorted(merged) == sorted(single)
    for key, want in single.items():
        assert torch.equal(torch.from_numpy(merged[key].asnumpy()), want), key
    pytest.importorskip("mindformers")
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.pet.models.lora import LoraModel
    from mindformers.pet.pet_config import LoraConfig
    convert(adapter / "base", tmp_path / "base-ms", dst_format="mindspore", options={"dialect": "mindformers"})
    config = LlamaConfig(batch_size=1, seq_length=8, hidden_size=64, num_layers=6, num_heads=8, n_kv_heads=4,
                         vocab_size=250, intermediate_size=96, compute_dtype="float32", layernorm_compute_type="float32",
                         softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
                         use_flash_attention=False, qkv_concat=False, use_past=False, fused_rms_norm=False)
    pet = yaml.safe_load((adapter / "mf2" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
    model = LoraModel(LoraConfig(lora_rank=4, lora_alpha=8, target_modules=pet["target_modules"]),
                      LlamaForCausalLM(config))
    params = {**ms.load_checkpoint(str(tmp_path / "base-ms" / "model.ckpt")), **merged}
    not_loaded, unused = ms.load_param_into_net(model, params, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)


def test_a_runs_tp2_adapter_with_data_parallel_copies_reads_with_its_yaml(adapter, tmp_path):
    """A MindFormers run's own output: rank_0..rank_3 at dp 2 x tp 2 (rank d * tp + t), LoRA tensors only, no
    pet_config beside them and no interop sidecar: the run's YAML says the base and the LoRA settings, the
    shapes say tp, the data-parallel copies are left unread (a note says so)."""
    _run_yaml(adapter, tmp_path / "run.yaml")
    for r in range(4):
        (tmp_path / "run" / f"rank_{r}").mkdir(parents=True)
        shutil.copy(adapter / "mf2" / f"rank_{r % 2}" / f"checkpoint_{r % 2}.ckpt",
                    tmp_path / "run" / f"rank_{r}" / f"llama_rank_{r}-1_10.ckpt")
    code, out = run("convert", tmp_path / "run", tmp_path / "back", "--to", "peft", "--model-config",
                    tmp_path / "run.yaml")
    assert code == 0 and "2 data-parallel copies were not read" in out, out
    _same_peft(adapter / "lora", tmp_path / "back")


def test_a_missing_or_misshapen_rank_is_one_line(adapter, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapter / "mf2", bad)
    shutil.rmtree(bad / "rank_1")
    assert_refused(cli("convert", bad, tmp_path / "out", "--to", "peft"), tmp_path / "out", "tp=2",
                   "rank_1 (tp rank 1 of stage 0) is missing")
    shutil.copytree(adapter / "mf2" / "rank_1", bad / "rank_1")
    (bad / "rank_1" / "checkpoint_1.ckpt").unlink()
    shutil.copy(adapter / "mf1" / "model.ckpt", bad / "rank_1" / "checkpoint_1.ckpt")  # a tp 1 file as rank 1
    assert_refused(cli("convert", bad, tmp_path / "out", "--to", "peft"), tmp_path / "out", "rank_1", "at tp=2")
    half = {k: v.half() for k, v in load_ckpt(adapter / "mf2" / "rank_1" / "checkpoint_1.ckpt").items()}
    save_ckpt(bad / "rank_1" / "checkpoint_1.ckpt", half)  # rank 1 in another dtype: never cast to rank 0's
    assert_refused(cli("convert", bad, tmp_path / "out", "--to", "peft"), tmp_path / "out", "rank_1",
                   "one tensor type expected")
    assert_refused(cli("convert", adapter / "lora", tmp_path / "out", "--to", "mindspore", "--base",
                       adapter / "base", "--tp", "3"), tmp_path / "out", "3")


MCORE_BASE = dict(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=4, head_dim=8, vocab=250,
                  padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
                  position="rope", tied_embeddings=False, qk_norm=True)
QWEN3 = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, max_position_embeddings=64, compute_dtype="float32",
             params_dtype="float32", layernorm_compute_dtype="float32", softmax_compute_dtype="float32",
             rotary_dtype="float32", seq_length=8)


def test_mcore_style_lora_tp2_is_cut_as_mindformers_states_and_loads(tmp_path, mcore):
    """--dialect mindformers-mcore at tp 2: MindFormers' LoraModel(TrainingQwen3ForCausalLM) states each LoRA
    parameter's shard in `sharded_state_dict()` (from config.tensor_model_parallel_size; building at tp 2 needs
    communication groups, so the model is built at tp 1 and its config then says 2): our rank files have those
    local shapes and our strategy cuts those axes.  transform_checkpoints merges the rank files into the tp 1
    adapter, which the tp 1 model loads strictly with the base; and the tp 2 files read back exactly."""
    from helpers.ms_moe_store import moe_store
    from interop.adapter import AdapterSpec
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    base_path, spec, _ = moe_store(tmp_path / "base", base=MCORE_BASE, seed=3)
    adapter = AdapterSpec(rank=4, alpha=8, targets=("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up",
                                                    "mlp.down"))
    params = adapter.params(spec)
    torch.manual_seed(9)
    tensors = {p.name: torch.randn(p.shape) for p in params}
    for i in range(spec.num_layers):  # one A per fused linear (linear_qkv, linear_fc1)
        for group in (("attn.q", "attn.k", "attn.v"), ("mlp.gate", "mlp.up")):
            for t in group[1:]:
                tensors[f"layers.{i}.{t}.lora_a"] = tensors[f"layers.{i}.{group[0]}.lora_a"]
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in params], adapter=adapter)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    convert(base_path, tmp_path / "base-ms", dst_format="mindspore", dialect="mindformers-mcore")
    convert(tmp_path / "a", tmp_path / "lora1", dst_format="mindspore", dialect="mindformers-mcore")
    convert(tmp_path / "a", tmp_path / "lora2", dst_format="mindspore", dialect="mindformers-mcore", tp=2)
    ms.transform_checkpoints(str(tmp_path / "lora2"), str(tmp_path / "merged"), "ckpt",
                             str(tmp_path / "lora2" / "strategy" / "strategy_stage0.json"), None)
    merged = ms.load_checkpoint(next(str(p) for p in (tmp_path / "merged" / "rank_0").glob("*.ckpt")))
    single = load_ckpt(tmp_path / "lora1" / "model.ckpt")
    assert sorted(merged) == sorted(single)
    for key, want in single.items():
        assert torch.equal(torch.from_numpy(merged[key].asnumpy()), want), key
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
    from mindformers.pet.models.lora import LoraModel
    from mindformers.pet.pet_config import LoraConfig
    pet = yaml.safe_load((tmp_path / "lora2" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
    model = LoraModel(LoraConfig(lora_rank=pet["lora_rank"], lora_alpha=pet["lora_alpha"], lora_dropout=0.0,
                                 target_modules=pet["target_modules"]),
                      TrainingQwen3ForCausalLM(Qwen3Config(**QWEN3)))
    saved = {**ms.load_checkpoint(str(tmp_path / "base-ms" / "model.ckpt")), **merged}
    not_loaded, unused = ms.load_param_into_net(model, saved, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)
    gpt = next(c for _, c in model.cells_and_names() if type(c).__name__ == "GPTModel")
    configs = {id(c.config): c.config for _, c in model.cells_and_names()
               if type(getattr(c, "config", None)).__name__ == "TransformerConfig"}
    for config in configs.values():
        config.tensor_model_parallel_size = 2
    stated = {k: v for k, v in gpt.sharded_state_dict().items() if ".lora_" in k}
    strategy = _strategy(tmp_path / "lora2")
    assert sorted(stated) == sorted(strategy) == sorted(single) and len(stated) == 2 * 4 * 2
    for t in range(2):
        with CkptFile(tmp_path / "lora2" / f"rank_{t}" / f"checkpoint_{t}.ckpt") as f:
            for name, shard in stated.items():
                assert f.meta(name)[1] == tuple(shard.local_shape), name
                assert strategy[name]["tensor_map"] == [0 if n == 2 else -1 for n in shard.axis_fragmentations], name
    assert tuple(stated["decoder.layers.1.self_attention.linear_qkv.lora_B.weight"].local_shape) == (64, 4)
    assert tuple(stated["decoder.layers.1.mlp.linear_fc2.lora_A.weight"].local_shape) == (4, 48)
    convert(tmp_path / "lora2", tmp_path / "back", dst_format="interop")
    back = StoreReader(tmp_path / "back")
    assert back.source.adapter == dataclasses.replace(adapter, shared_a=True)
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


@pytest.mark.parametrize("tp,pp,uneven", [(2, 2, False), (1, 3, True)])
def test_pipeline_stages_round_trip_and_merge_by_mindspore(adapter, tmp_path, tp, pp, uneven):
    """--pp (uneven with --first-stage-layers / --last-stage-layers): rank p * tp + t holds stage p's layers only,
    one strategy file per stage; MindSpore's merge_pipeline_strategys + transform_checkpoints give exactly the
    tp 1 adapter; PEFT comes back byte for byte."""
    convert(adapter / "lora", tmp_path / "mf", dst_format="mindspore", base=adapter / "base", tp=tp, pp=pp,
            first_stage_layers=1 if uneven else None, last_stage_layers=1 if uneven else None)
    stages = [[0], [1, 2, 3, 4], [5]] if uneven else [[0, 1, 2], [3, 4, 5]]
    for p, layers in enumerate(stages):
        for t in range(tp):
            r = p * tp + t
            loaded = ms.load_checkpoint(str(tmp_path / "mf" / f"rank_{r}" / f"checkpoint_{r}.ckpt"))
            assert {int(k.split(".")[2]) for k in loaded} == set(layers), (p, t)
    assert sorted(p.name for p in (tmp_path / "mf" / "strategy").iterdir()) == \
        [f"strategy_stage{p}.json" for p in range(pp)]
    ms.merge_pipeline_strategys(str(tmp_path / "mf" / "strategy"), str(tmp_path / "merged_strategy.json"))
    ms.transform_checkpoints(str(tmp_path / "mf"), str(tmp_path / "merged"), "ckpt",
                             str(tmp_path / "merged_strategy.json"), None)
    merged = ms.load_checkpoint(next(str(p) for p in (tmp_path / "merged" / "rank_0").glob("*.ckpt")))
    single = load_ckpt(adapter / "mf1" / "model.ckpt")
    assert sorted(merged) == sorted(single)
    assert all(torch.equal(torch.from_numpy(merged[k].asnumpy()), v) for k, v in single.items())
    code, out = run("inspect", tmp_path / "mf")
    assert code == 0 and f"layout: tp={tp} pp={pp}" in out, out
    convert(tmp_path / "mf", tmp_path / "back", dst_format="peft")
    _same_peft(adapter / "lora", tmp_path / "back")


def test_a_runs_pipelined_adapter_with_data_parallel_copies(adapter, tmp_path):
    """tp 2, pp 2, dp 2 as a MindFormers run numbers its ranks (p * dp * tp + d * tp + t), no sidecar: stages
    from the layers each file holds, tp from the shapes, the data-parallel copies unread."""
    convert(adapter / "lora", tmp_path / "mf", dst_format="mindspore", base=adapter / "base", tp=2, pp=2)
    _run_yaml(adapter, tmp_path / "run.yaml")
    for p in range(2):
        for d in range(2):
            for t in range(2):
                r = p * 4 + d * 2 + t
                (tmp_path / "run" / f"rank_{r}").mkdir(parents=True)
                shutil.copy(tmp_path / "mf" / f"rank_{p * 2 + t}" / f"checkpoint_{p * 2 + t}.ckpt",
                            tmp_path / "run" / f"rank_{r}" / f"llama_rank_{r}-2_20.ckpt")
    code, out = run("convert", tmp_path / "run", tmp_path / "back", "--to", "peft", "--model-config",
                    tmp_path / "run.yaml")
    assert code == 0 and "4 data-parallel copies were not read" in out, out
    _same_peft(adapter / "lora", tmp_path / "back")


def test_some_layers_adapted_at_pp2(adapter, tmp_path):
    """PEFT's layers_to_transform: a stage with adapted layers round-trips; a stage with none is refused in one
    line (its files would hold nothing, and no reader could place them)."""
    torch.manual_seed(4)
    for layers, name in (([1, 4], "ok"), ([0, 1], "none")):
        lora = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS,
                               layers_to_transform=layers)
        peft.get_peft_model(build("llama"), lora).save_pretrained(tmp_path / name)
    convert(tmp_path / "ok", tmp_path / "ok-mf", dst_format="mindspore", base=adapter / "base", tp=2, pp=2)
    convert(tmp_path / "ok-mf", tmp_path / "ok-back", dst_format="peft")
    _same_peft(tmp_path / "ok", tmp_path / "ok-back")
    assert_refused(cli("convert", tmp_path / "none", tmp_path / "out", "--to", "mindspore", "--base", adapter / "base",
                       "--pp", "2"), tmp_path / "out", "stage 1", "none of the adapted layers 0, 1")
