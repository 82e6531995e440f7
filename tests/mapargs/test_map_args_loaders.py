"""map-args output against the target frameworks' own loader rules, real launch scripts, and the seeds' configs.

MindSpeed-Core-MS is not installable here: its loader's rules are read from
Ascend/MindSpeed-Core-MS r0.1.0 `mindspeed_ms/core/config.py` (init_configs_from_yaml ->
init_configs_from_dict -> the `@XConfig.validator` functions) and encoded in `ms_validate` below.
MindFormers 2.1.0 (pip --no-deps) is used as it is: its MindFormerConfig loads the mindformers-legacy
(run_*.yaml) output and refuses keys its sections lack (the package __init__ needs datasets, mindpet, ...
that are absent on CPU, so the config module is imported past it). 2.1.0 no longer has the r1.3
dynamic-graph `init_configs_from_yaml` of seed 000 (the `mindformers` target): MindFormers r1.3.0
(mindspore-lab/mindformers f90b5b9, mindformers/experimental/parallel_core/pynative/config.py) registers a
subset of the same validators as MindSpeed-Core-MS r0.1.0, so the rules below are its rules too.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from interop import argsfile, mapargs
from interop.cli.main import main
from interop.mappings import megatron_args as M
from helpers.mapargs_loaders import FIXTURES, run, _bool, MS_RULES, MS_BOOLS, ms_validate, PARSER, UPSTREAM, _flags, parse_megatron, mindformer_config

REAL_SCRIPTS = ["megatron_gpt345m_tp2pp2.sh", "megatron_gpt3_175b.sh", "mscorems_llama2_7b.sh",
                "mindspeedllm_llama2_13b.sh", "mindspeedllm_mixtral_8x7b.sh"]




# ---------------------------------------------------------------- MindSpeed-Core-MS r0.1.0 loader rules















for _section, _keys in MS_BOOLS.items():
    MS_RULES.update({(_section, k): _bool for k in _keys})






def test_the_validator_catches_what_the_issue_saw():
    """The rules are not vacuous: the YAML interop used to write fails them."""
    old = {"training_config": {"loss_scale_value": 4096.0, "loss_scale_factor": 2, "loss_scale_window": 1000.0,
                               "profile_framework": False, "use_distributed_optimizer": True, "wrap_with_ddp": False},
           "model_config": {"use_flash_attention": True, "fa_config": {"pre_tokens": None, "input_layout": "BSH"}},
           "dataset_config": {"dataset_dir": None}}
    problems = ms_validate(old)
    for part in ("loss_scale_window=1000.0", "profile_framework=False", "pre_tokens=None", "input_layout='BSH'",
                 "use_distributed_optimizer reset", "dataset_dir=None"):
        assert any(part in p for p in problems), part


@pytest.mark.parametrize("script", REAL_SCRIPTS + ["llama2_small.sh", "gpt3_small.sh"])
@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
def test_real_scripts_give_yaml_the_loader_accepts(script, target):
    result = mapargs.map_args(FIXTURES / script, target, env={"1": "/c", "2": "/t", "3": "/v", "4": "/m", "5": "/d"},
                              values={"vocab_size": "32000"})
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc, target) == []
    assert "null" not in json.dumps(doc.get("model_config", {}).get("fa_config", {}))


@pytest.mark.parametrize("target,layout,kept", [("mindspeed", "SBH", True), ("mindspeed", "BSH", False),
                                                ("mindformers", "BNSD", True), ("mindformers", "SBH", False)])
def test_flash_attention_layout_follows_each_loader(tmp_path, target, layout, kept):
    f = tmp_path / "a.sh"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                 f"--vocab-size 64 --use-flash-attn --pre-tockens 65536 --next-tockens 0 --shape-order {layout}\n")
    result = mapargs.map_args(f, target)
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc, target) == []
    assert (doc["model_config"]["fa_config"].get("input_layout") == layout) == kept
    assert kept or any(e.flag == "--shape-order" and e.lost for e in result.entries)


def test_mindspeed_values_that_used_to_load_wrong():
    """SwiGLU without biases, distributed optimizer, Megatron checkpoint format, Transformer Engine."""
    result = mapargs.map_args(FIXTURES / "mscorems_llama2_7b.sh", "mindspeed")
    doc = yaml.safe_load(result.text)
    mc, tc = doc["model_config"], doc["training_config"]
    assert mc["gated_linear_unit"] is True and mc["mlp_has_bias"] is False and mc["hidden_act"] == "swiglu"
    assert mc["transformer_impl"] == "local" and tc["ckpt_format"] == "ckpt"
    assert tc["use_distributed_optimizer"] is True and tc["wrap_with_ddp"] is True
    assert tc["loss_scale_window"] == 1000 and isinstance(tc["loss_scale_window"], int)
    assert tc["profile_framework"] == "None"
    assert doc["dataset_config"]["micro_batch_num"] == 64  # 256 / (1 * 8 / (1 * 2))


def test_megatron_checkpoint_format_is_named(tmp_path):
    code, out, err = run(FIXTURES / "mindspeedllm_llama2_13b.sh", "--to", "mindspeed")
    assert code == 0 and "unmapped: --ckpt-format='torch': training_config.ckpt_format: MindSpore saves" in err


# ---------------------------------------------------------------- the default target, --set

def test_args_txt_works_as_written(tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                 "--max-position-embeddings 32 --vocab-size 1000\n")
    code, out, err = run(f)
    assert code == 0 and err.splitlines()[0] == "target: mindspeed (default; --to to choose)"
    assert yaml.safe_load(out)["model_config"]["num_layers"] == 2


def test_set_gives_missing_values_and_the_error_names_the_flag():
    code, _, err = run(FIXTURES / "seed000_pretrain_gpt_7B.yaml")
    assert code == 2 and err.count("error:") == 1 and "--set seq_length=N" in err
    code, out, err = run(FIXTURES / "seed000_pretrain_gpt_7B.yaml", "--set", "seq_length=4096",
                         "--set", "vocab_size=32000")
    doc = yaml.safe_load(out)
    assert code == 0 and doc["model_config"]["seq_length"] == 4096 and doc["model_config"]["vocab_size"] == 32000
    assert doc["model_config"]["compute_dtype"] == "bfloat16" and ms_validate(doc) == []
    code, _, err = run(FIXTURES / "seed000_pretrain_gpt_7B.yaml", "--set", "no_such_thing=1")
    assert code == 2 and "--set no_such_thing: not a Megatron argument" in err


# ---------------------------------------------------------------- --to megatron: upstream flags only



def test_the_args_table_is_megatron_core_v016s_parser():
    """Flags, dests and choices of our upstream rows are the real parser's (two documented spellings aside)."""
    ours = {f: a for a in M.ALL if a.origin == "megatron" for f in a.flags}
    assert set(ours) == UPSTREAM
    renamed = {"--norm-epsilon": "layernorm_epsilon"}  # kept as norm_epsilon (CHECKPOINT_ALIASES)
    for flag, arg in ours.items():
        assert PARSER[flag]["dest"] == renamed.get(flag, arg.dest), flag
        real = PARSER[flag]["choices"]
        if real and flag not in ("--attention-backend", "--exit-signal"):  # enums there (AttnBackend, signals)
            assert set(map(str, arg.choices or ())) == set(real), flag








@pytest.mark.parametrize("script", REAL_SCRIPTS)
def test_megatron_output_has_only_core_v016_flags(script, tmp_path):
    code, out, err = run(FIXTURES / script, "--to", "megatron", "-e", "1=/c", "--report", tmp_path / "r.json")
    assert code == 0, err
    assert set(_flags(out)) <= UPSTREAM, set(_flags(out)) - UPSTREAM
    args = parse_megatron(out)  # Megatron's own argparse accepts it (types, choices, nargs)
    source = M.complete(mapargs.load(FIXTURES / script, {"1": "/c"}).explicit)
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "seq_length", "lr", "min_lr", "bf16", "fp16", "swiglu",
                 "normalization", "position_embedding_type", "untie_embeddings_and_output_weights"):
        value = getattr(args, dest)  # None: not given, Megatron's default applies
        assert value == source[dest] or (value in (None, False) and source[dest] == M.ARGS[dest].default), dest
    report = json.loads((tmp_path / "r.json").read_text())
    for entry in report["unmapped"]:  # every fork flag not written is named
        assert entry["why"]


def test_mindformers_bf16_becomes_bf16_and_batch_is_said(tmp_path):
    code, out, err = run(FIXTURES / "seed000_pretrain_gpt_7B.yaml", "--to", "megatron", "--set", "seq_length=2048")
    flags = _flags(out)
    assert code == 0 and "--bf16" in flags and "--compute-dtype" not in flags and "--micro-batch-num" not in flags
    assert "--global-batch-size" in flags and "assumed data-parallel size of 1" in err
    assert out.split("--global-batch-size ")[1].split()[0] == "2"  # micro_batch_num 2 * batch 1 * dp 1
    args = parse_megatron(out)
    assert args.bf16 and args.global_batch_size == 2 and args.num_layers == 6 and args.ffn_hidden_size == 11008


def test_readme_example_and_back_keeps_the_global_batch(tmp_path):
    yaml_file = tmp_path / "llama2.yaml"
    code, _, _ = run(FIXTURES / "mscorems_llama2_7b.sh", "--to", "mindspeed", "-o", yaml_file)
    code, out, err = run(yaml_file, "--to", "megatron", "--set", "world_size=8")
    assert code == 0 and "--global-batch-size 256" in out and "--micro-batch-num" not in out
    assert "--add-dense-bias" not in out and "--compute-dtype" not in out and "--bf16" in out
    args = parse_megatron(out)
    assert (args.global_batch_size, args.micro_batch_size, args.pipeline_model_parallel_size) == (256, 1, 2)
    assert args.use_distributed_optimizer and args.swiglu and args.add_bias_linear is False


# ---------------------------------------------------------------- fork flags and values

def test_fork_values_pass_with_a_note():
    result = mapargs.map_args(FIXTURES / "mindspeedllm_mixtral_8x7b.sh", "megatron")
    notes = {e.flag: e for e in result.entries}
    assert notes["--moe-token-dispatcher-type"].why.endswith("read as 'alltoall'")
    assert "--moe-token-dispatcher-type alltoall" in result.text
    result = mapargs.map_args(FIXTURES / "mindspeedllm_llama2_13b.sh", "megatron")
    assert any(e.flag == "--tokenizer-type" and "fork" in e.why for e in result.entries)
    assert "PretrainedFormHF" not in result.text  # not an upstream choice: named, not written


def test_pretrained_from_hf_maps_to_huggingface_tokenizer(tmp_path):
    f = tmp_path / "a.sh"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 "
                 "--tokenizer-type PretrainedFromHF --moe-token-dispatcher-type alltoall_seq\n")
    code, out, err = run(f, "--to", "megatron")
    assert code == 0 and "--tokenizer-type HuggingFaceTokenizer" in out and "note: --tokenizer-type" in err


def test_num_layer_list_as_first_and_last_stage(tmp_path):
    f = tmp_path / "a.sh"
    base = "--num-layers 62 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 --vocab-size 64 "
    f.write_text(base + "--pipeline-model-parallel-size 4 --num-layer-list 16,16,16,14\n")
    code, out, err = run(f, "--to", "megatron")
    assert code == 0 and "--decoder-first-pipeline-num-layers 16" in out
    assert "--decoder-last-pipeline-num-layers 14" in out and "num-layer-list" not in out + err
    args = parse_megatron(out)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (16, 14)
    doc = yaml.safe_load(run(f, "--to", "mindspeed")[1])
    assert doc["parallel_config"]["num_layer_list"] == [16, 16, 16, 14]
    f.write_text(base + "--pipeline-model-parallel-size 4 --num-layer-list 15,17,16,14\n")
    code, out, err = run(f, "--to", "megatron")
    assert code == 0 and "unmapped: --num-layer-list='15,17,16,14': uneven middle pipeline stages" in err
    f.write_text(base + "--pipeline-model-parallel-size 4 --num-layer-list 16,16,16\n")
    code, _, err = run(f, "--to", "megatron")
    assert code == 2 and "--num-layer-list must give one layer count per pipeline stage" in err


# ---------------------------------------------------------------- the seeds' native configs

def test_seed001_nested_llm_yaml():
    result = mapargs.map_args(FIXTURES / "seed001_model_38BV3.yaml", "megatron",
                              values={"num_layer_list": "16,16,16,14"})
    full = M.complete(result.source.explicit)
    assert (full["num_layers"], full["hidden_size"], full["num_attention_heads"], full["num_query_groups"]) == \
        (62, 6144, 48, 8)
    assert full["ffn_hidden_size"] == 27648 and full["swiglu"] and full["normalization"] == "RMSNorm"
    assert full["norm_epsilon"] == 1e-5 and full["rotary_base"] == 10000 and full["bf16"]
    assert (full["tensor_model_parallel_size"], full["pipeline_model_parallel_size"]) == (8, 4)
    assert full["padded_vocab_size"] == 165664 and full["untie_embeddings_and_output_weights"]
    args = parse_megatron(result.text)
    assert args.num_layers == 62 and args.padded_vocab_size == 165664 and args.decoder_last_pipeline_num_layers == 14
    code, _, err = run(FIXTURES / "seed001_model_38BV3.yaml")
    assert code == 2 and "--set num_layer_list=" in err and err.count("error:") == 1


def test_seed001_launch_script_names_what_it_lacks():
    code, _, err = run(FIXTURES / "seed001_pretrain_gpt.sh")
    assert code == 2 and err.count("error:") == 1 and "--set num_layers=N" in err


def test_seed002_r03_gpt2_yaml():
    code, _, err = run(FIXTURES / "seed002_run_gpt2_13b.yaml")
    assert code == 2 and "--set num_layers=N" in err
    result = mapargs.map_args(FIXTURES / "seed002_run_gpt2_13b.yaml", "megatron",
                              values={"num_layers": "40", "hidden_size": "5120", "num_attention_heads": "40",
                                      "seq_length": "1024"})
    full = M.complete(result.source.explicit)
    assert (full["tensor_model_parallel_size"], full["pipeline_model_parallel_size"]) == (2, 4)
    assert full["data_parallel_size"] == 4 and full["micro_batch_num"] == 24 and full["use_distributed_optimizer"]


def test_mindformers_legacy_writes_r03_gpt2_keys():
    text = mapargs.map_args(FIXTURES / "gpt3_small.sh", "mindformers-legacy", env={"1": "/c"}).text
    assert text.startswith("# MindFormers r0.3")
    model = yaml.safe_load(text)["model"]["model_config"]
    assert {"embedding_size", "num_heads", "seq_length", "expand_ratio", "hidden_dropout_prob",
            "attention_probs_dropout_prob"} <= set(model)
    assert not {"hidden_size", "max_position_embeddings"} & set(model)


def test_seed003_colossalai_config_is_parsed_not_run(tmp_path):
    marker = tmp_path / "ran"
    f = tmp_path / "config.py"
    f.write_text((FIXTURES / "seed003_gpt2_hybrid_config.py").read_text()
                 + f"\nopen({str(marker)!r}, 'w').write('x')\n")
    result = mapargs.map_args(f, "megatron", values={"num_layers": "48", "num_attention_heads": "32",
                                                     "max_position_embeddings": "1024"})
    full = M.complete(result.source.explicit)
    assert (full["pipeline_model_parallel_size"], full["tensor_model_parallel_size"], full["fp16"]) == (2, 2, True)
    assert full["hidden_size"] == 1600 and full["seq_length"] == 1024 and not marker.exists()


def test_seed004_ds_config_and_strategy():
    source = mapargs.load(FIXTURES / "ds_config.json")
    assert source.format == "deepspeed"
    full = M.complete(source.explicit)
    assert full["micro_batch_size"] == 1 and full["fp16"] and full["clip_grad"] == 1.0
    assert full["use_distributed_optimizer"] and full["initial_loss_scale"] == 65536.0
    strategy = mapargs.load(FIXTURES / "seed004_ds_3d_llama2_strategy.py")
    assert strategy.format == "atorch"
    assert strategy.explicit == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    assert any("--model_parallel_size default" in w for w in strategy.warnings)
    assert any(e.flag == "parallel_mode.data" and "--set data_parallel_size" in e.why for e in strategy.entries)


@pytest.mark.parametrize("target", ["colossalai", "deepspeed"])
def test_interop_reads_back_its_own_colossalai_and_deepspeed_files(target, tmp_path):
    out = tmp_path / "written.out"  # no telling extension: detected by content
    code, _, err = run(FIXTURES / "llama2_small.sh", "--to", target, "-o", out)
    assert code == 0, err
    assert mapargs.load(out).format == target
    code, text, err = run(out, "--to", "megatron")
    assert code == 2 and "missing required value" in err  # neither format holds the model's size
    assert mapargs.load(out).explicit["tensor_model_parallel_size"] == 2


def test_unknown_content_says_use_from(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"something": 1}')
    code, _, err = run(f)
    assert code == 2 and "use --from" in err
    g = tmp_path / "x.yaml"
    g.write_text("foo: 1\n")
    code, _, err = run(g)
    assert code == 2 and "use --from" in err


# ---------------------------------------------------------------- transformers 5 config.json

def test_transformers5_config_keeps_rope_base_and_dtype(tmp_path):
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=128, rope_theta=500000.0, dtype="bfloat16")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    result = mapargs.map_args(tmp_path / "config.json", "megatron")
    assert "--rotary-base 500000" in result.text and "--bf16" in result.text
    assert not [e for e in result.entries if "rope" in e.flag or "dtype" in e.flag], (saved, result.entries)
    back = json.loads(mapargs.map_args(tmp_path / "config.json", "hf").text)
    assert back["rope_theta"] == 500000 and back["rope_parameters"]["rope_theta"] == 500000.0


# ---------------------------------------------------------------- hostile args files (issue 10)

@pytest.mark.parametrize("text", [
    "--num-layers " + "9" * 5000,
    "A=" + "(" * 3000 + ")" * 3000 + "\n--num-layers 2",
    "--seq-length $((" + "(" * 2000 + "1" + ")" * 2000 + "))",
])
def test_hostile_args_files_one_line(tmp_path, text):
    f = tmp_path / "args.txt"
    f.write_text(text)
    code, out, err = run(f)
    assert code == 2 and err.count("\n") <= 2 and "error:" in err and "Traceback" not in err
    assert len(err) < 600


@pytest.mark.parametrize("name,text", [
    ("deep.json", "[" * 100000 + "]" * 100000),
    ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000),
])
def test_deeply_nested_documents_one_line(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    code, out, err = run(f)
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- MindFormers 2.1.0's own MindFormerConfig



@pytest.mark.parametrize("script", ["gpt3_small.sh", "megatron_gpt345m_tp2pp2.sh"])
def test_mindformers_legacy_yaml_loads_in_mindformers_2_1(script, tmp_path, caplog):
    out = tmp_path / "run_gpt2.yaml"
    code, _, err = run(FIXTURES / script, "--to", "mindformers-legacy", "-e", "1=/c", "-o", out)
    assert code == 0, err
    config = mindformer_config(out)  # raises on a key its sections do not know
    source = M.complete(mapargs.load(FIXTURES / script, {"1": "/c"}).explicit)
    assert config.run_mode == "train"
    assert config.parallel_config.model_parallel == source["tensor_model_parallel_size"]
    assert config.parallel_config.pipeline_stage == source["pipeline_model_parallel_size"]
    assert config.parallel_config.data_parallel == source["data_parallel_size"]
    assert config.parallel_config.micro_batch_num == source["micro_batch_num"]
    assert config.model.model_config.num_layers == source["num_layers"]
    assert config.model.model_config.embedding_size == source["hidden_size"]
    assert config.lr_schedule.learning_rate == source["lr"]
    assert config.runner_wrapper.scale_sense.scale_window == source["loss_scale_window"]


def test_mindformer_config_is_a_real_check(tmp_path):
    """The loader refuses a key its section lacks: the test above can fail."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_mode: train\nparallel_config:\n  data_parallel: 2\n  no_such_key: 1\n")
    with pytest.raises(KeyError):
        mindformer_config(bad)


def test_seed002_fixture_is_what_mindformers_reads():
    config = mindformer_config(FIXTURES / "seed002_run_gpt2_13b.yaml")
    assert config.parallel_config.pipeline_stage == 4 and config.parallel_config.micro_batch_num == 24


def test_hf_output_loads_in_transformers_with_its_values(tmp_path):
    """transformers' own AutoConfig reads the written config.json: a Llama-3 rope base and bf16 survive."""
    import transformers
    args = tmp_path / "args.txt"
    args.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
                    "--num-query-groups 2 --ffn-hidden-size 160 --max-position-embeddings 128 --vocab-size 1000 "
                    "--make-vocab-size-divisible-by 8 --normalization RMSNorm --swiglu --position-embedding-type rope "
                    "--rotary-base 500000 --disable-bias-linear --untie-embeddings-and-output-weights --bf16\n")
    (tmp_path / "hf").mkdir()
    code, _, err = run(args, "--to", "hf", "-o", tmp_path / "hf" / "config.json")
    assert code == 0, err
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert type(config).__name__ == "LlamaConfig"
    assert config.rope_parameters["rope_theta"] == 500000 and str(config.dtype) == "torch.bfloat16"
    assert (config.num_hidden_layers, config.num_key_value_heads, config.intermediate_size, config.vocab_size) == \
        (2, 2, 160, 1000)
    assert config.tie_word_embeddings is False and config.attention_bias is False and config.mlp_bias is False


@pytest.mark.parametrize("text,message", [
    ("--num-layers -2 --hidden-size 8 --num-attention-heads 2 --max-position-embeddings 8",
     "must be a positive number: --num-layers -2"),
    ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --max-position-embeddings 8 "
     "--tensor-model-parallel-size 0", "must be a positive number: --tensor-model-parallel-size 0"),
    ("--num-layers $((9999999999*9999999999*9999999999)) --hidden-size 8", "beyond bash's 64 bits"),
])
def test_nonsense_sizes_are_refused(tmp_path, text, message):
    f = tmp_path / "args.txt"
    f.write_text(text + "\n")
    code, out, err = run(f, "--to", "megatron")
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""


def test_fused_rmsnorm_is_mindspeeds_fused_rmsnorm():
    doc = yaml.safe_load(mapargs.map_args(FIXTURES / "mscorems_llama2_7b.sh", "mindspeed").text)
    assert doc["model_config"]["normalization"] == "FusedRMSNorm"  # as mindspeed_ms init_configs_from_args maps it
    back, _, _ = mapargs.read_target(yaml.safe_dump(doc), "mindspeed")
    assert back["normalization"] == "RMSNorm" and back["use_fused_rmsnorm"] is True
    full = M.complete(mapargs.load(FIXTURES / "seed001_model_38BV3.yaml").explicit)
    assert full["use_flash_attn"] and full["use_fused_rmsnorm"] and full["use_fused_swiglu"]


# ---------------------------------------------------------------- DeepSpeed's own DeepSpeedConfig

class _DataParallel:
    """The `mpu` DeepSpeedConfig asks for the data-parallel size (ATorch passes its 3D groups)."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


@pytest.mark.parametrize("script", ["llama2_small.sh", "gpt3_small.sh", "megatron_gpt345m_tp2pp2.sh",
                                    "mindspeedllm_mixtral_8x7b.sh"])
def test_deepspeed_output_passes_deepspeed_config(script, monkeypatch):
    """deepspeed.runtime.config.DeepSpeedConfig (0.19.8) checks batch sizes against the data-parallel size
    (asked from `mpu` once a rank exists: rank 0 stands in for an initialised process group)."""
    ds = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed (scripts/setup.sh)")
    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)
    result = mapargs.map_args(FIXTURES / script, "deepspeed", env={"1": "/c"})
    doc = json.loads(result.text)
    config = ds.DeepSpeedConfig(doc["ds_config"], mpu=_DataParallel(doc["parallel_mode"]["data"]))
    source = M.complete(result.source.explicit)
    assert config.train_batch_size == source["global_batch_size"]
    assert config.train_micro_batch_size_per_gpu == source["micro_batch_size"]
    assert config.gradient_accumulation_steps == source["micro_batch_num"]
    assert config.zero_optimization_stage == (1 if source["use_distributed_optimizer"] else 0)
    assert config.gradient_clipping == source["clip_grad"]
    assert bool(config.float16_config.enabled) == source["fp16"] and bool(config.bfloat16_config.enabled) == source["bf16"]


def test_seed004_ds_config_passes_deepspeed_config():
    ds = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed (scripts/setup.sh)")
    doc = json.loads((FIXTURES / "ds_config.json").read_text())
    config = ds.DeepSpeedConfig(doc)
    full = M.complete(mapargs.load(FIXTURES / "ds_config.json").explicit)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == \
        (full["micro_batch_size"], full["micro_batch_num"])


def test_mutated_inputs_exit_0_or_one_error_line(tmp_path):
    """Seeded byte mutations of every fixture, to every target: a result or one `error:` line, never a traceback."""
    import random
    rng = random.Random(20261123)
    files = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".sh", ".yaml", ".json", ".py"))
    inserts = [b"(", b"[", b"{", b"$((", b"${", b"'", b'"', b"\\", b"--", b"9" * 60, b"\n", b": ", b"- ", b"null",
               b"1e999", b"[1, 2]", b"true"]
    for case in range(150):
        source = rng.choice(files)
        data = bytearray(source.read_bytes())
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(data))
            roll = rng.random()
            if roll < 0.3:
                data[pos] = rng.randrange(256)
            elif roll < 0.5:
                del data[pos:pos + rng.randint(1, 40)]
            else:
                data[pos:pos] = rng.choice(inserts)
        f = tmp_path / f"case{case}{source.suffix}"
        f.write_bytes(bytes(data))
        target = rng.choice(mapargs.TARGETS)
        result = CliRunner().invoke(main, ["map-args", str(f), "--to", target, "-e", "1=/c", "--set", "vocab_size=64"])
        assert result.exit_code in (0, 2), (case, source.name, target, result.exception)
        if result.exit_code == 2:
            assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr, (case, result.stderr)


@pytest.mark.parametrize("target", mapargs.TARGETS)
def test_every_written_file_is_recognised_by_content(target, tmp_path):
    """Issue 10: reading a written file back never depends on its extension."""
    out = tmp_path / "written.out"
    code, _, err = run(FIXTURES / "llama2_small.sh", "--to", target, "-o", out)
    assert code == 0, err
    assert mapargs.detect(out) == target


@pytest.mark.parametrize("script", ["mscorems_llama2_7b.sh", "mindspeedllm_mixtral_8x7b.sh",
                                    "megatron_gpt345m_tp2pp2.sh", "llama2_small.sh"])
def test_mindspeed_yaml_holds_the_scripts_values(script):
    """The semantic values a run depends on, read from the YAML as MindSpeed-Core-MS would."""
    result = mapargs.map_args(FIXTURES / script, "mindspeed", env={"1": "/c"}, values={"vocab_size": "32000"})
    doc = yaml.safe_load(result.text)
    mc, tc, oc, pc, dc = (doc[k] for k in ("model_config", "training_config", "optimizer_config",
                                          "parallel_config", "dataset_config"))
    a = M.complete(result.source.explicit)
    assert (mc["num_layers"], mc["hidden_size"], mc["num_attention_heads"], mc["ffn_hidden_size"]) == \
        (a["num_layers"], a["hidden_size"], a["num_attention_heads"], a["ffn_hidden_size"])
    assert mc["num_query_groups"] == a["num_query_groups"] and mc["group_query_attention"] == a["group_query_attention"]
    assert mc["normalization"] in ({"RMSNorm": ("RMSNorm", "FusedRMSNorm")}.get(a["normalization"], (a["normalization"],)))
    assert mc["gated_linear_unit"] == a["swiglu"] and (mc["hidden_act"] == "swiglu") == a["swiglu"]
    assert mc["add_bias_linear"] == mc["mlp_has_bias"] == a["add_bias_linear"] and mc["qkv_has_bias"] == a["add_qkv_bias"]
    assert mc["rotary_base"] == a["rotary_base"] and mc["compute_dtype"] == a["params_dtype"]
    assert (tc["bf16"], tc["fp16"]) == (a["bf16"], a["fp16"])
    assert (pc["tensor_model_parallel_size"], pc["pipeline_model_parallel_size"], pc["expert_model_parallel_size"],
            pc["context_parallel_size"]) == (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"],
                                              a["expert_model_parallel_size"], a["context_parallel_size"])
    assert (oc["lr_decay_style"], oc["learning_rate"], oc["min_lr"]) == (a["lr_decay_style"], a["lr"], a["min_lr"])
    assert dc["batch_size"] == a["micro_batch_size"]
    if a["micro_batch_num"] is not None:
        assert dc["micro_batch_num"] == a["micro_batch_num"]
    assert tc["use_distributed_optimizer"] == a["use_distributed_optimizer"]


def test_colossalai_output_loads_in_colossalai(tmp_path):
    """ColossalAI 0.5.0's own loader (`colossalai.context.Config.from_file`, which imports the file) reads a
    `--to colossalai` config, and the values are what its legacy ParallelContext parses
    (colossalai/legacy/context/parallel_context.py `_set_parallel_size_from_config`: an int or a dict's
    `size`; the tensor mode one of colossalai/legacy/constants.py ALLOWED_MODES -- that package needs peft,
    so its rules are encoded here).  A config without fp16 imports no AMP module (0.5.0 keeps AMP_TYPE in
    colossalai.legacy.amp); one with fp16 imports it from where the release has it."""
    context = pytest.importorskip("colossalai.context", reason="colossalai is not installed (scripts/setup.sh)")
    allowed_modes = [None, "1d", "2d", "2.5d", "3d", "sequence"]

    def size(entry):
        return entry if isinstance(entry, int) else entry["size"]

    out = tmp_path / "llama2_colossalai.py"  # ColossalAI takes .py files only
    code, _, err = run(FIXTURES / "llama2_small.sh", "--to", "colossalai", "-o", out)
    assert code == 0, err
    config = context.Config.from_file(str(out))
    launch = context.Config(config.CONFIG)  # the script calls colossalai.launch_from_torch(config=CONFIG)
    assert launch.parallel.tensor.mode in allowed_modes
    assert (size(launch.parallel.pipeline), size(launch.parallel.tensor)) == (1, 2)
    assert config.SEQ_LEN == 4096 and config.BATCH_SIZE == 16 and launch.NUM_MICRO_BATCHES == 16
    assert "AMP_TYPE" not in out.read_text()
    fp16 = mapargs.to_target(mapargs.load(FIXTURES / "gpt3_small.sh", {"1": "/c"}).explicit, "colossalai")[0]
    assert "from colossalai.legacy.amp import AMP_TYPE" in fp16 and "mode=AMP_TYPE.NAIVE" in fp16
