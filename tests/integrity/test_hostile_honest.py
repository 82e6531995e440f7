"""Honest: every mistake in a file or flag is one `error: <file>: <what is wrong>` line with exit 2,
refused before anything is sized by it, and nothing is written (issue 10).

Model descriptions (ModelSpec) and layouts (ParallelLayout) validate every field when built; layout
flags are refused at the door of `convert` and `train`; `--model-config` and config sidecars are
read only from small regular files; sizes are checked against the bytes on disk.
"""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import yaml

from helpers.hostile import assert_refused, cli
from interop.errors import InteropError
from interop.io import small_files
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.weights_on_disk import check_weights_on_disk, min_parameter_count

LLAMA = dict(arch="llama", num_layers=4, hidden=32, ffn_hidden=64, heads=4, kv_groups=2, head_dim=8, vocab=120,
             padded_vocab=128, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
             rope_base=10000.0, tied_embeddings=False, qkv_bias=False, linear_bias=False, dtype="float32")


# ---------------------------------------------------------------- ModelSpec: every field, at construction

@pytest.mark.parametrize("field, value, fragment", [
    ("hidden", "32", "hidden must be an integer, got '32'"),
    ("num_layers", True, "num_layers must be an integer, got True"),
    ("heads", 4.0, "heads must be an integer"),
    ("vocab", None, "vocab must be an integer"),
    ("ffn_hidden", [64], "ffn_hidden must be an integer"),
    ("num_layers", 0, "num_layers must be between 1 and 10,000, got 0"),
    ("num_layers", 100_000_000, "num_layers must be between 1 and 10,000, got 100,000,000"),
    ("hidden", -32, "hidden must be between 1"),
    ("head_dim", 2**40, "head_dim must be between 1"),
    ("kv_groups", 3, "heads (4) must be a multiple of kv_groups (3)"),
    ("padded_vocab", 100, "padded_vocab (100) must be >= vocab (120)"),
    ("norm_eps", "1e-5", "norm_eps must be a number"),
    ("norm_eps", float("nan"), "norm_eps must be a number"),
    ("norm_eps", -1.0, "norm_eps must be a number in [0, 1)"),
    ("rope_base", 0, "rope_base must be a positive number"),
    ("rope_base", float("inf"), "rope_base must be a positive number"),
    ("tied_embeddings", 1, "tied_embeddings must be true or false, got 1"),
    ("qkv_bias", "false", "qkv_bias must be true or false"),
    ("arch", "bert", "arch must be one of"),
    ("dtype", "int8", "dtype must be one of"),
    ("activation", ["swiglu"], "activation must be one of"),
    ("mlp_bias", "yes", "mlp_bias must be true, false or null"),
])
def test_spec_field_refused(field, value, fragment):
    with pytest.raises(InteropError) as info:
        ModelSpec(**{**LLAMA, field: value})
    message = str(info.value)
    assert message.startswith("invalid model spec: ") and fragment in message and "\n" not in message


@pytest.mark.parametrize("data, fragment", [
    ([1, 2], "expected an object of fields, found list"),
    ({k: v for k, v in LLAMA.items() if k != "hidden"}, "missing fields ['hidden']"),
    ({**LLAMA, "evil": 1}, "unknown fields ['evil']"),
    ({**LLAMA, "hidden": "32"}, "hidden must be an integer"),
])
def test_spec_from_dict_names_the_file(data, fragment):
    with pytest.raises(InteropError) as info:
        ModelSpec.from_dict(data, where="spec.yaml")
    assert str(info.value).startswith("spec.yaml: invalid model spec: ") and fragment in str(info.value)


def test_a_valid_spec_still_builds():
    spec = ModelSpec(**LLAMA)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


# ---------------------------------------------------------------- ParallelLayout: every field, at construction

@pytest.mark.parametrize("data, fragment", [
    ({"tp": "2", "pp": 1, "stages": [[[0, 4]]]}, "tp and pp must be positive integers"),
    ({"tp": True, "pp": 1, "stages": [[[0, 4]]]}, "tp and pp must be positive integers"),
    ({"tp": 1, "pp": 0, "stages": []}, "tp and pp must be positive integers"),
    ({"tp": 2**20, "pp": 2, "stages": [[[0, 2]], [[2, 4]]]}, "ranks"),
    ({"tp": 1, "pp": 2, "stages": [[[0, 4]]]}, "1 stages listed for pp=2"),
    ({"tp": 1, "pp": 2, "stages": [[[0, 2]], [[1, 4]]]}, "stage 1 chunk 0 holds layers [1, 4), expected to start at layer 2"),
    ({"tp": 1, "pp": 2, "stages": [[[0, 2]], [[3, 4]]]}, "expected to start at layer 2"),
    ({"tp": 1, "pp": 1, "stages": [[[0, -2]]]}, "holds layers [0, -2)"),
    ({"tp": 1, "pp": 1, "stages": [[[0, 2.5]]]}, "not a pair of layer numbers"),
    ({"tp": 1, "pp": 2, "stages": [[[0, 1], [2, 3]], [[1, 2]]]}, "same number"),
    ({"tp": 1, "pp": 1, "stages": [[[0, 0]]]}, "no layers"),
    ({"tp": 1, "pp": 1, "stages": "0-4"}, "stages must be lists"),
    ({"tp": 1, "pp": 1}, "expected an object with tp, pp and stages"),
    ([1, 1], "expected an object with tp, pp and stages"),
])
def test_layout_from_dict_refused(data, fragment):
    with pytest.raises(InteropError) as info:
        ParallelLayout.from_dict(data, where="interop.json")
    assert str(info.value).startswith("interop.json: invalid parallel layout") and fragment in str(info.value)


def test_layouts_megatron_writes_still_build():
    """Interleaved (chunk v*pp+p) and uneven layouts tile the layers; an empty chunk (a stage holding only
    embeddings) is allowed when read from disk."""
    for layout in (ParallelLayout.build(8, 2, 2, 2), ParallelLayout.build(10, 1, 4, 1, 1, 3)):
        assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert ParallelLayout(1, 2, (((0, 0),), ((0, 4),))).num_layers == 4


# ---------------------------------------------------------------- layout flags at the door

LAYOUT_FLAGS = [  # 6 layers
    (["--pp", "2", "--first-stage-layers", "-2"], "--first-stage-layers must be a positive number of layers, got -2"),
    (["--pp", "2", "--last-stage-layers", "0"], "--last-stage-layers must be a positive number of layers, got 0"),
    (["--pp", "7", "--first-stage-layers", "1"], "6 layers do not fit pp=7"),
    (["--pp", "2", "--first-stage-layers", "4", "--last-stage-layers", "4"], "6 layers do not fit pp=2"),
    (["--pp", "3", "--first-stage-layers", "5"], "6 layers do not fit pp=3"),
    (["--pp", "1", "--first-stage-layers", "3"], "6 layers do not fit pp=1"),
    (["--pp", "12"], "6 layers cannot be split evenly over pp=12"),
    (["--pp", "2", "--vpp", "2"], "6 layers cannot be split evenly over pp=2 x vpp=2"),
    (["--pp", "2", "--vpp", "3", "--first-stage-layers", "3"], "cannot be combined with virtual pipeline"),
    (["--tp", "0"], "--tp must be"),
    (["--vpp", "-1"], "--vpp must be a positive integer, got -1"),
    (["--tp", "2048", "--pp", "1024"], "ranks"),
]


@pytest.mark.parametrize("flags, fragment", LAYOUT_FLAGS)
def test_convert_refuses_layout_flags(hf_checkpoints, tmp_path, flags, fragment):
    dst = tmp_path / "out"
    assert_refused(cli("convert", hf_checkpoints["llama"], dst, "--to", "interop", *flags), dst, fragment)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "llama.yaml"
    path.write_text(yaml.safe_dump({**LLAMA, "num_layers": 6}))
    return path


@pytest.mark.parametrize("flags, fragment", [f for f in LAYOUT_FLAGS if "--vpp" not in f[0]])
def test_train_refuses_layout_flags(spec_file, tmp_path, flags, fragment):
    save = tmp_path / "run"
    assert_refused(cli("train", "--init-spec", spec_file, "--save", save, "--steps", "1", *flags), None, fragment)
    assert not save.exists() or not any(save.iterdir())


# ---------------------------------------------------------------- --model-config and config files: small regular files

@pytest.fixture(scope="module")
def sources(hf_checkpoints, tmp_path_factory):
    """A Megatron torch checkpoint and a bare MindSpore .ckpt, both of which take --model-config."""
    root = tmp_path_factory.mktemp("sources")
    assert cli("convert", hf_checkpoints["llama"], root / "megatron", "--to", "megatron", "-q")[0] == 0
    assert cli("convert", hf_checkpoints["llama"], root / "ms", "--to", "mindspore", "-q")[0] == 0
    shutil.copy(next((root / "ms").rglob("*.ckpt")), root / "bare.ckpt")
    return {"megatron": root / "megatron", "mindspore": root / "bare.ckpt"}


def hostile_file(tmp_path, kind: str):
    """A path that is not a small regular file, and the words its refusal names."""
    if kind == "/dev/zero":
        return "/dev/zero", "must be a regular file, this is a character device"
    if kind == "symlink to /dev/zero":
        (tmp_path / "config.json").symlink_to("/dev/zero")
        return tmp_path / "config.json", "character device"
    if kind == "fifo":
        os.mkfifo(tmp_path / "config.json")
        return tmp_path / "config.json", "this is a FIFO"
    if kind == "directory":
        (tmp_path / "config.json").mkdir()
        return tmp_path / "config.json", "this is a directory"
    if kind == "huge":
        with open(tmp_path / "config.json", "wb") as f:  # sparse: costs no disk
            f.truncate(small_files.LIMIT + 1)
        return tmp_path / "config.json", f"is {small_files.LIMIT + 1:,} bytes"
    raise ValueError(kind)


HOSTILE_FILES = ["/dev/zero", "symlink to /dev/zero", "fifo", "directory", "huge"]


def _unblock_fifo(path) -> threading.Thread:
    """If a reader wrongly blocked on the FIFO, a writer opening it lets the test fail instead of hanging."""
    def open_and_close():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
    return threading.Timer(30, open_and_close)


@pytest.mark.parametrize("kind", HOSTILE_FILES)
@pytest.mark.parametrize("reader", ["megatron", "mindspore"])
def test_model_config_must_be_a_small_regular_file(sources, tmp_path, reader, kind):
    path, fragment = hostile_file(tmp_path, kind)
    guard = _unblock_fifo(path) if kind == "fifo" else None
    if guard:
        guard.start()
    dst = tmp_path / "out"
    try:
        result = cli("convert", sources[reader], dst, "--from", reader, "--to", "hf", "--model-config", path)
    finally:
        if guard:
            guard.cancel()
    assert_refused(result, dst, f"{path}: the model config", fragment)


@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_train_files_must_be_small_regular_files(tmp_path, kind):
    path, fragment = hostile_file(tmp_path, kind)
    for flag in ("--init-spec", "--config"):
        assert_refused(cli("train", flag, path, "--steps", "1"), None, str(path), fragment)


BAD_JSON = {  # name -> (text of a config.json, words of the refusal)
    "a list": ("[1, 2]", "must be a JSON object, found an array"),
    "deeply nested": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "5,000 digits": ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "more than 4,300 digits"),
    "not JSON": ("{not json", "not valid JSON"),
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSON))
@pytest.mark.parametrize("reader", ["megatron", "mindspore"])
def test_model_config_bad_json(sources, tmp_path, reader, case):
    text, fragment = BAD_JSON[case]
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    dst = tmp_path / "out"
    result = cli("convert", sources[reader], dst, "--from", reader, "--to", "hf", "--model-config", path)
    assert_refused(result, dst, str(path), fragment)


# ---------------------------------------------------------------- an HF config.json with wrong values

HF_CONFIG_CASES = {  # name -> (changes to the tiny Llama's config.json, words of the refusal)
    "string hidden_size": ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    "bool layers": ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    "negative heads": ({"num_attention_heads": -8}, "num_attention_heads must be a positive integer"),
    "float vocab": ({"vocab_size": 250.5}, "vocab_size must be a positive integer"),
    "string eps": ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number"),
    "string tie": ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    "string kv heads": ({"num_key_value_heads": "4"}, "num_key_value_heads must be a positive integer"),
    "heads not dividing hidden": ({"num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": None},
                                  "hidden size (64) is not a multiple of the attention heads (7)"),
    "100,000,000 layers": ({"num_hidden_layers": 100_000_000}, "num_layers must be between 1 and 10,000"),
    "kv not dividing heads": ({"num_key_value_heads": 3}, "heads (8) must be a multiple of kv_groups (3)"),
    "rope_theta string": ({"rope_theta": "big", "rope_parameters": None}, "rope_theta must be a number"),
}


@pytest.mark.parametrize("case", sorted(HF_CONFIG_CASES))
def test_hf_config_values(hf_checkpoints, tmp_path, case):
    changes, fragment = HF_CONFIG_CASES[case]
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "interop"), dst, str(src / "config.json"), fragment)


@pytest.mark.parametrize("case", ["a list", "deeply nested", "5,000 digits"])
def test_hf_config_structure(hf_checkpoints, tmp_path, case):
    text, fragment = BAD_JSON[case]
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    (src / "config.json").write_text(text)
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "interop"), dst, str(src / "config.json"), fragment)


def test_mindspore_sidecar_must_be_an_object(hf_checkpoints, tmp_path):
    src = tmp_path / "ms"
    assert cli("convert", hf_checkpoints["llama"], src, "--to", "mindspore", "-q")[0] == 0
    (src / "mindspore_model.json").write_text("[]")
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "hf"), dst, "mindspore_model.json", "must be a JSON object")


# ---------------------------------------------------------------- sizes against the bytes on disk

@pytest.mark.parametrize("spec", [
    LLAMA, {**LLAMA, "tied_embeddings": True},
    dict(LLAMA, arch="gpt2", norm="layernorm", activation="gelu_tanh", position="learned", qkv_bias=True,
         linear_bias=True, kv_groups=4, tied_embeddings=True)])
def test_min_parameter_count_is_the_table_without_padding(spec):
    spec = ModelSpec(**{**spec, "padded_vocab": spec["vocab"]})
    assert min_parameter_count(spec) == sum(
        __import__("math").prod(p.shape) for p in param_table(spec))


def test_check_weights_on_disk(tmp_path):
    spec = ModelSpec(**LLAMA)
    need = -(-min_parameter_count(spec) // 2)
    (tmp_path / "weights").write_bytes(b"\0" * need)
    check_weights_on_disk(spec, tmp_path)  # exactly enough: MXFP4 weights, two a byte (gpt-oss's release)
    with pytest.raises(InteropError, match=f"needs at least {need:,} bytes of weights, but the checkpoint's files "
                                           f"hold {need - 1:,} bytes"):
        (tmp_path / "weights").write_bytes(b"\0" * (need - 1))
        check_weights_on_disk(spec, tmp_path)


@pytest.mark.parametrize("change", [{"hidden": 64 * 100_000}, {"num_layers": 9_000}, {"ffn_hidden": 10**9}])
def test_manifest_asking_for_more_than_its_files_hold(hf_checkpoints, tmp_path, change):
    """A manifest whose spec was inflated fails fast, before anything is allocated by it."""
    src = tmp_path / "ckpt"
    assert cli("convert", hf_checkpoints["llama"], src, "--to", "interop", "-q")[0] == 0
    manifest = json.loads((src / "interop.json").read_text())
    manifest["spec"].update(change)
    (src / "interop.json").write_text(json.dumps(manifest))
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "hf"), dst, str(src))


def test_manifest_asking_for_100_million_layers(hf_checkpoints, tmp_path):
    src = tmp_path / "ckpt"
    assert cli("convert", hf_checkpoints["llama"], src, "--to", "interop", "-q")[0] == 0
    manifest = json.loads((src / "interop.json").read_text())
    manifest["spec"]["num_layers"] = 100_000_000
    (src / "interop.json").write_text(json.dumps(manifest))
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "hf"), dst, "num_layers must be between 1 and 10,000")


# ---------------------------------------------------------------- files that try to run something

def code_running_files(tmp_path, marker):
    """Config files whose parsing would run `touch MARKER` if anything in them were executed."""
    args = tmp_path / "args.sh"
    args.write_text(f"NL=$(touch {marker})\n--num-layers `touch {marker}` --hidden-size $NL\n")
    yml = tmp_path / "config.yaml"
    yml.write_text(f"model_config: !!python/object/apply:os.system ['touch {marker}']\n")
    return {"args file": args, "yaml": yml}


@pytest.mark.parametrize("kind", ["args file", "yaml"])
def test_model_config_that_tries_to_run_code(sources, tmp_path, kind):
    marker = tmp_path / "MARKER"
    path = code_running_files(tmp_path, marker)[kind]
    dst = tmp_path / "out"
    result = cli("convert", sources["megatron"], dst, "--from", "megatron", "--to", "hf", "--model-config", path)
    assert_refused(result, dst, str(path), marker=marker)


@pytest.mark.parametrize("kind", ["args file", "yaml"])
def test_train_files_that_try_to_run_code(tmp_path, kind):
    marker = tmp_path / "MARKER"
    path = code_running_files(tmp_path, marker)[kind]
    flag = "--init-spec" if kind == "yaml" else "--config"
    # the args file's command substitutions stay unexpanded text, which map-args' flag parser (the one
    # --config and --model-config share) refuses as a layer count; the YAML's python tag is refused by the
    # safe loader
    words = [str(path)] if kind == "yaml" else [str(path), "--num-layers expects an integer"]
    assert_refused(cli("train", flag, path, "--steps", "1"), None, *words, marker=marker)


@pytest.mark.parametrize("case", ["a list", "deeply nested", "5,000 digits", "not JSON"])
def test_hf_weight_index_structure(hf_checkpoints, tmp_path, case):
    text, fragment = BAD_JSON[case]
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    (src / "model.safetensors.index.json").write_text(text)
    dst = tmp_path / "out"
    assert_refused(cli("convert", src, dst, "--to", "interop"), dst, str(src / "model.safetensors.index.json"),
                   fragment)
