"""interop map-args: script parsing, Megatron semantics, round trips, honest reports, bad input."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from interop import argsfile, mapargs
from interop.cli.main import main
from interop.converters.megatron.args import explicit_args
from interop.mappings.megatron_spec import args_from_spec, spec_from_args
from interop.layout import ParallelLayout
from interop.mappings import megatron_args as M

FIXTURES = Path(__file__).parents[1] / "fixtures" / "args"
GPT3 = FIXTURES / "gpt3_small.sh"
LLAMA = FIXTURES / "llama2_small.sh"
TARGETS = [t for t in mapargs.TARGETS if t != "megatron"]


def run(*args):
    result = CliRunner().invoke(main, ["map-args", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


# ---------------------------------------------------------------- parsing scripts

def test_script_variables_arrays_continuations_and_launcher():
    launch = argsfile.parse_file(GPT3, {"1": "/ckpt"})
    explicit, unknown, _ = mapargs.parse_tokens(launch.tokens)
    assert explicit["num_layers"] == 24 and explicit["min_lr"] == 1e-5  # ${NUM_LAYERS}, --flag=value
    assert explicit["sequence_parallel"] is True and explicit["save"] == "/ckpt"
    assert launch.world_size == 8 and unknown == []
    assert "tee" not in launch.tokens and "2>&1" not in launch.tokens


def test_e_overrides_the_files_assignment_and_fills_positionals():
    launch = argsfile.parse_file(GPT3, {"NNODES": "2", "1": "/x"})
    assert launch.world_size == 16 and launch.variables["WORLD_SIZE"] == "16"


def test_quoting_defaults_arithmetic_and_unset_variables():
    text = """
    A=3; B=${B:-4}
    S='--x 1'
    python train.py --seq-length $((A*B*128)) --data-path "a b" c $S --load ${UNSET} --split='9,1,0'  # end
    """
    launch = argsfile.parse_text(text)
    assert launch.tokens == ["--seq-length", "1536", "--data-path", "a b", "c", "--x", "1",
                             "--load", "${UNSET}", "--split=9,1,0"]
    assert launch.unresolved == ["UNSET"]


def test_plain_args_file_without_launcher(tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2   # layers\n--hidden-size=64\n--num-attention-heads 4 --max-position-embeddings 8\n")
    source = mapargs.load(f)
    assert source.explicit == {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                               "max_position_embeddings": 8}


# ---------------------------------------------------------------- Megatron semantics

def test_derived_values():
    full = M.complete({"hidden_size": 4096, "num_attention_heads": 32, "swiglu": True, "bf16": True,
                       "tensor_model_parallel_size": 2, "vocab_size": 50257, "world_size": 16,
                       "micro_batch_size": 2, "global_batch_size": 64})
    assert full["ffn_hidden_size"] == 10880 == int(4 * 4096 * 2 / 3 / 64) * 64  # Llama-2 gives 11008 itself
    assert full["kv_channels"] == 128 and full["num_query_groups"] == 32
    assert full["padded_vocab_size"] == 50432 and full["params_dtype"] == "bfloat16"
    assert full["data_parallel_size"] == 8 and full["micro_batch_num"] == 4
    assert M.complete({"hidden_size": 768})["ffn_hidden_size"] == 3072
    assert M.complete({"tokenizer_type": "GPT2BPETokenizer"})["padded_vocab_size"] == 50304


@pytest.mark.parametrize("extra,message", [
    ({"num_attention_heads": 12, "tensor_model_parallel_size": 8},
     "attention heads are not divisible by tensor parallelism: --num-attention-heads 12 --tensor-model-parallel-size 8"),
    ({"num_query_groups": 4}, "--num-query-groups needs --group-query-attention"),
    ({"hidden_size": 1000}, "hidden size is not divisible by the number of attention heads"),
])
def test_contradictions_are_errors_naming_the_flags(tmp_path, extra, message):
    args = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "max_position_embeddings": 64, **extra}
    f = tmp_path / "bad.txt"
    f.write_text(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items()))
    code, out, err = run(f, "--to", "mindspeed")
    assert code == 2 and message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_spec_from_args_and_back():
    """A launch script's args describe the same ModelSpec the Megatron converter reads from a checkpoint."""
    spec = spec_from_args(M.complete(mapargs.load(LLAMA).explicit), "llama")
    assert (spec.arch, spec.kv_groups, spec.head_dim, spec.padded_vocab, spec.dtype) == ("llama", 8, 128, 32000, "bfloat16")
    assert spec.norm_eps == 1e-6 and not spec.tied_embeddings and not spec.linear_bias
    gpt = spec_from_args(M.complete(mapargs.load(GPT3, {"1": "/c"}).explicit), "gpt3")
    assert (gpt.arch, gpt.activation, gpt.ffn_hidden, gpt.padded_vocab, gpt.dtype) == (
        "gpt2", "gelu_tanh", 4096, 50432, "float16")
    for s in (spec, gpt):
        for tp in (1, 2):
            written = args_from_spec(s, ParallelLayout.build(s.num_layers, tp, 1))
            assert spec_from_args(M.complete(explicit_args(written)), "written") == s


# ---------------------------------------------------------------- round trips

def _roundtrip(explicit, target):
    text, _, _ = mapargs.to_target(explicit, target)
    back, entries, _ = mapargs.read_target(text, target)
    return text, back, entries


@pytest.mark.parametrize("script", [GPT3, LLAMA], ids=["gpt3", "llama2"])
@pytest.mark.parametrize("target", ["mindspeed", "hf"])
def test_megatron_x_megatron_is_identity_on_what_x_holds(script, target, tmp_path):
    explicit = mapargs.load(script, {"1": "/ckpt"}).explicit
    text, back, entries = _roundtrip(explicit, target)
    assert entries == []
    f = tmp_path / f"out.{'json' if target == 'hf' else 'yaml'}"
    f.write_text(text)
    args_text = mapargs.map_args(f, "megatron").text  # X -> megatron through the CLI's path
    g = tmp_path / "args.sh"
    g.write_text(args_text)
    again = M.complete(mapargs.load(g).explicit)
    before = M.complete(explicit)
    held = mapargs._held(target, before)  # the Megatron values the target has a field for
    assert {d: again[d] for d in held} == {d: before[d] for d in held}


@pytest.mark.parametrize("script", [GPT3, LLAMA], ids=["gpt3", "llama2"])
@pytest.mark.parametrize("target", TARGETS)
def test_every_target_reads_back_what_it_holds(script, target):
    explicit = mapargs.load(script, {"1": "/ckpt"}).explicit
    text, back, _ = _roundtrip(explicit, target)
    launch = {"world_size": explicit["world_size"]} if "world_size" in explicit else {}  # launched on as many ranks
    before, after = M.complete(explicit), M.complete(M.normalize({**launch, **back}))
    result = mapargs.map_args(script, target, env={"1": "/ckpt"})
    lost = {e.flag for e in result.entries if e.lost}
    for dest, value in explicit.items():  # kept, or reported as lost: never silently different
        assert after[dest] == before[dest] or M.flag_of(dest) in lost, dest


@pytest.mark.parametrize("script", [GPT3, LLAMA], ids=["gpt3", "llama2"])
def test_megatron_to_megatron_is_exact(script, tmp_path):
    explicit = mapargs.load(script, {"1": "/ckpt"}).explicit
    f = tmp_path / "args.sh"
    f.write_text(mapargs.to_target(explicit, "megatron")[0])
    assert mapargs.load(f).explicit == {d: v for d, v in explicit.items() if v != M.ARGS[d].default}


def test_mindspeed_yaml_values_from_the_llama_script():
    doc = yaml.safe_load(mapargs.map_args(LLAMA, "mindspeed").text)
    mc = doc["model_config"]
    assert mc["vocab_size"] == 32000 and mc["num_query_groups"] == 8 and mc["group_query_attention"] is True
    assert mc["position_embedding_type"] == "rope" and mc["hidden_act"] == "swiglu" and mc["params_dtype"] == "bfloat16"
    assert doc["optimizer_config"]["betas"] == [0.9, 0.95]
    assert doc["parallel_config"]["tensor_model_parallel_size"] == 2
    assert doc["dataset_config"] == {"batch_size": 1, "micro_batch_num": 16, "reset_attention_mask": False,
                                     "reset_position_ids": False, "eod_mask_loss": False, "pad_token_id": None,
                                     "eos_token_id": 0, "drop_remainder": True}


def test_other_targets_hold_the_seed_shapes():
    llama = mapargs.load(LLAMA).explicit
    ds = json.loads(mapargs.to_target(llama, "deepspeed")[0])
    assert ds["parallel_mode"] == {"tensor": 2, "data": 4, "pipeline": 1}
    assert ds["ds_config"]["bf16"] == {"enabled": True} and ds["ds_config"]["gradient_accumulation_steps"] == 16
    legacy = yaml.safe_load(mapargs.to_target(mapargs.load(GPT3, {"1": "/c"}).explicit, "mindformers-legacy")[0])
    assert {k: legacy["parallel_config"][k] for k in ("data_parallel", "model_parallel", "pipeline_stage",
                                                       "micro_batch_num")} == {
        "data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2}
    col = mapargs.to_target(mapargs.load(GPT3, {"1": "/c"}).explicit, "colossalai")[0]
    assert "pipeline=2" in col and "mode=AMP_TYPE.NAIVE" in col and "size=2" in col
    mf = yaml.safe_load(mapargs.to_target(llama, "mindformers")[0])
    assert mf["optimizer_config"]["learning_rate_scheduler_kwargs"]["use_cosine"] is True
    assert mf["training_config"]["grad_clip_kwargs"] == {"grad_clip_type": "ClipGlobalNorm", "clip_value": 1.0}


def test_hf_config_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for script, cls in ((LLAMA, "LlamaConfig"), (GPT3, "GPT2Config")):
        data = json.loads(mapargs.map_args(script, "hf", env={"1": "/c"}).text)
        config = getattr(transformers, cls).from_dict(data)
        assert config.vocab_size == data["vocab_size"] and config.num_hidden_layers in (24, 32)


# ---------------------------------------------------------------- other sources

def _args_checkpoint(tmp_path, ns):
    """A one-rank Megatron torch checkpoint holding only `ns` as its args, as map-args reads them."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": ns, "iteration": 1, "checkpoint_version": 3.0},
               ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    return ckpt


def test_checkpoint_directory_args(tmp_path):
    ns = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                            layernorm_epsilon=1e-6, tensor_model_parallel_size=1, padded_vocab_size=512,
                            vocab_size=500, some_new_megatron_arg=3, bf16=True)
    ckpt = _args_checkpoint(tmp_path, ns)
    result = mapargs.map_args(ckpt, "hf")
    data = json.loads(result.text)
    # the tokenizer's true vocabulary, as `convert --to hf` writes it (it strips the padding rows)
    assert data["n_layer"] == 2 and data["vocab_size"] == 500 and data["layer_norm_epsilon"] == 1e-6
    note = next(e for e in result.entries if e.flag == "(checkpoint args)")
    assert note.value == ["some_new_megatron_arg"] and not note.lost


def test_hf_vocab_from_args_that_hold_only_the_padded_size(tmp_path):
    """A real pretrain_gpt.py run with a HF tokenizer saves vocab_size=None: config.json gets the padded rows
    (what the weights have), and a warning says so and how to give the true size."""
    ns = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                            tensor_model_parallel_size=1, padded_vocab_size=512, vocab_size=None)
    ckpt = _args_checkpoint(tmp_path, ns)
    result = mapargs.map_args(ckpt, "hf")
    assert json.loads(result.text)["vocab_size"] == 512
    assert any(w.startswith("vocab_size: written as Megatron's padded 512") and "--set vocab_size=N" in w
               for w in result.warnings), result.warnings
    given = mapargs.map_args(ckpt, "hf", values={"vocab_size": "500"})  # --set vocab_size=500
    assert json.loads(given.text)["vocab_size"] == 500 and not any("vocab" in w for w in given.warnings)


def test_hf_config_json_as_source(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                             "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "vocab_size": 1000, "rms_norm_eps": 1e-5,
                             "hidden_act": "silu", "bos_token_id": 1}))
    result = mapargs.map_args(f, "megatron")
    for flag in ("--swiglu", "--normalization RMSNorm", "--group-query-attention", "--num-query-groups 2",
                 "--position-embedding-type rope", "--disable-bias-linear", "--ffn-hidden-size 160"):
        assert flag in result.text
    assert [e.flag for e in result.entries] == ["bos_token_id"]


# ---------------------------------------------------------------- reports and bad input

def test_unknown_flag_reported_and_strict_fails(tmp_path):
    f = tmp_path / "args.sh"
    f.write_text(GPT3.read_text().replace("--fp16", "--fp16 --my-custom-flag 3"))
    code, out, err = run(f, "--to", "mindspeed", "-e", "1=/c", "--report", tmp_path / "r.json")
    assert code == 0 and "unmapped: --my-custom-flag='3': not a Megatron-LM" in err
    assert yaml.safe_load(out)["model_config"]["num_layers"] == 24
    report = json.loads((tmp_path / "r.json").read_text())
    entry = next(e for e in report["unmapped"] if e["flag"] == "--my-custom-flag")
    assert entry == {"flag": "--my-custom-flag", "value": "3",
                     "why": "not a Megatron-LM (core_v0.16) or MindSpeed argument", "lost": True}
    code, out, err = run(f, "--to", "mindspeed", "-e", "1=/c", "--strict")
    assert code == 2 and err.startswith("error: --strict:") and "--my-custom-flag='3'" in err and out == ""


def test_lossy_target_lists_what_it_drops(tmp_path):
    code, out, err = run(LLAMA, "--to", "colossalai", "-o", tmp_path / "c.py")
    assert code == 0 and "unmapped: --bf16=True: CONFIG.fp16.mode: ColossalAI's AMP is fp16 only" in err
    assert "unmapped: --num-layers=32: no colossalai field for it" in err


@pytest.mark.parametrize("text,message", [
    ("--num-layers two", "--num-layers expects an integer, got 'two'"),
    ("--num-layers 2 --hidden-size", "--hidden-size needs a value"),
    ("--num-layers 2 --swiglu=yes", "--swiglu is a switch and takes no value"),
    ("--hidden-size 1e5000", "--hidden-size expects an integer, got '1e5000'"),
    ("--norm-epsilon inf", "--norm-epsilon expects a number, got 'inf'"),
    ("--num-layers ${LAYERS}", "--num-layers ${LAYERS}: the variable is not set"),
    ("--num-layers 2 --hidden-size 8", "missing required value: --num-attention-heads, --max-position-embeddings"),
])
def test_bad_values_one_line_exit_2(tmp_path, text, message):
    f = tmp_path / "args.txt"
    f.write_text(text + "\n")
    code, out, err = run(f, "--to", "mindspeed")
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unreadable_files_exit_2(tmp_path):
    code, _, err = run(tmp_path / "nope.sh", "--to", "hf")
    assert code == 2 and "nope.sh: no such file or directory" in err
    binary = tmp_path / "bin.sh"
    binary.write_bytes(b"\xff\xfe\x00--num-layers")
    code, _, err = run(binary, "--to", "hf")
    assert code == 2 and "cannot read args file" in err
    bad = tmp_path / "c.yaml"
    bad.write_text("model_config: [unclosed\n")
    code, _, err = run(bad, "--to", "megatron")
    assert code == 2 and "cannot read YAML" in err
    empty = tmp_path / "ckpt"
    empty.mkdir()
    code, _, err = run(empty, "--to", "hf")
    assert code == 2 and "not a Megatron checkpoint" in err


def test_hf_needs_a_vocabulary(tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --max-position-embeddings 8")
    code, _, err = run(f, "--to", "hf")
    assert code == 2 and "vocabulary size is unknown" in err


def test_help_shows_an_example():
    code, out, _ = run("--help")
    assert code == 0 and "interop map-args train_llama2.sh --to mindspeed" in out
