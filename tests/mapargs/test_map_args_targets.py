"""map-args targets as registered modules (issue 23), the pipeline split and schedules every loader accepts
(issue 22), and facts carried faithfully on the way (issue 27, item 12)."""
from __future__ import annotations

import ast
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from interop import argtargets, mapargs
from interop.mappings import megatron_args as M
from helpers.mapargs_loaders import FIXTURES, mindformer_config, ms_validate, parse_megatron, run

ROOT = Path(__file__).resolve().parents[2]
SHARED_SCRIPTS = ["megatron_gpt345m_tp2pp2.sh", "megatron_gpt3_175b.sh", "mscorems_llama2_7b.sh"]  # the shared launch scripts
POSITIONALS = {"1": "/c", "2": "/t", "3": "/v", "4": "/m", "5": "/d"}


def script(tmp_path, text, name="train.sh"):
    f = tmp_path / name
    f.write_text(text)
    return f


# ---------------------------------------------------------------- issue 23: targets registered like formats

def test_every_target_is_a_registered_module_declaring_itself():
    registered = {ep.name: ep.value for ep in entry_points(group=argtargets.GROUP)}
    assert set(registered) == set(argtargets.names()) and "mindspeed" in registered and "hf" in registered
    for name, module in registered.items():
        target = argtargets.get(name)
        assert type(target).__module__ == module and target.name == name and target.syntax in argtargets.SYNTAXES
    modules = {f"interop.argtargets.{p.stem}" for p in (ROOT / "interop" / "argtargets").glob("*.py")
               if p.stem != "__init__"}
    assert modules == set(registered.values())  # no target module left unregistered
    assert mapargs.TARGETS == tuple(n for n in registered if argtargets.get(n).writable)
    assert {"mindspeed-nested", "atorch", "megatron-checkpoint"} == set(registered) - set(mapargs.TARGETS)


def test_the_engine_compares_no_target_name():
    """interop/mapargs.py asks the target; the only target name in it is the default --to."""
    tree = ast.parse((ROOT / "interop" / "mapargs.py").read_text())
    names = set(argtargets.names())
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in names]
    default = [n.lineno for n in tree.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "DEFAULT_TARGET" for t in n.targets)]
    assert found == [(default[0], mapargs.DEFAULT_TARGET)], found


NEW_TARGET = '''
from interop.argtargets import JsonTarget
from interop.mappings.key_mapping import R


class Toy(JsonTarget):
    """A made-up trainer's JSON: three rows and how to recognise it."""
    name = "toy"
    precedence = 5
    rows = [R("num_layers", "model.depth"), R("hidden_size", "model.width"),
            R("tensor_model_parallel_size", "parallel.tp", 1)]

    def recognises(self, doc):
        return "model" in doc and "depth" in (doc.get("model") or {})


TARGET = Toy()
'''


def test_a_new_target_is_one_module_and_one_registration(tmp_path, monkeypatch):
    """ARCHITECTURE.md's worked example: a module with TARGET, one entry point; --to, read-back, detection and the
    loss report all follow with no change to the engine."""
    (tmp_path / "toy_target.py").write_text(NEW_TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    registered = dict(argtargets._registered())
    monkeypatch.setattr(argtargets, "_registered", lambda: {**registered, "toy": "toy_target"})
    argtargets.get.cache_clear()
    try:
        src = script(tmp_path, "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 "
                               "--tensor-model-parallel-size 2 --lr 0.001\n")
        result = mapargs.map_args(src, "toy")
        assert json.loads(result.text) == {"model": {"depth": 4, "width": 64}, "parallel": {"tp": 2}}
        assert {e.flag: e.why for e in result.entries if e.lost} == {
            f: "no toy field for it" for f in ("--num-attention-heads", "--max-position-embeddings", "--lr")}
        out = tmp_path / "written.json"
        out.write_text(result.text)
        assert mapargs.detect(out) == "toy"
        assert mapargs.load(out).explicit == {"num_layers": 4, "hidden_size": 64, "tensor_model_parallel_size": 2}
    finally:
        argtargets.get.cache_clear()
        sys.modules.pop("toy_target", None)


# ---------------------------------------------------------------- issue 22: the pipeline split

UNEVEN = ("torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py --num-layers 62 --hidden-size 512 "
          "--num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32001 "
          "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 64 {split}\n")
SPLITS = {"megatron": "--decoder-first-pipeline-num-layers 16 --decoder-last-pipeline-num-layers 14",
          "mindspeed": "--num-layer-list 16,16,16,14",
          "first only": "--decoder-first-pipeline-num-layers 14 --num-layers-per-virtual-pipeline-stage 1"}


@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
@pytest.mark.parametrize("flags", ["megatron", "mindspeed"])
def test_an_uneven_pipeline_is_written_where_the_target_has_a_key(tmp_path, target, flags):
    src = script(tmp_path, UNEVEN.format(split=SPLITS[flags]))
    out = tmp_path / f"{target}.yaml"
    code, _, err = run(src, "--to", target, "-o", out)
    assert code == 0, err
    doc = yaml.safe_load(out.read_text())
    assert doc["parallel_config"]["num_layer_list"] == [16, 16, 16, 14]
    assert ms_validate(doc, target) == []  # the loader's rules (mindspeed_ms/core/config.py r0.1.0, r1.3's)
    assert "pipeline-num-layers" not in err and "num-layer-list" not in err  # nothing lost: the split is kept
    code, back, err = run(out, "--to", "megatron")
    args = parse_megatron(back)
    assert code == 0 and (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (16, 14)


def test_first_stage_only_is_megatrons_even_rest(tmp_path):
    src = script(tmp_path, UNEVEN.format(split="--decoder-first-pipeline-num-layers 14"))
    doc = yaml.safe_load(mapargs.map_args(src, "mindspeed").text)
    assert doc["parallel_config"]["num_layer_list"] == [14, 16, 16, 16]  # (62 - 14) / 3 on the other stages


def test_an_even_pipeline_writes_no_split(tmp_path):
    src = script(tmp_path, UNEVEN.format(split="").replace("--num-layers 62", "--num-layers 64"))
    assert yaml.safe_load(mapargs.map_args(src, "mindspeed").text)["parallel_config"]["num_layer_list"] is None
    assert "num_layer_list" not in yaml.safe_load(mapargs.map_args(src, "mindformers").text)["parallel_config"]


def test_a_target_without_a_key_reports_the_split_lost(tmp_path):
    src = script(tmp_path, UNEVEN.format(split=SPLITS["megatron"]))
    result = mapargs.map_args(src, "mindformers-legacy")
    lost = {e.flag: e.why for e in result.entries if e.lost}
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        assert "gives a pipeline stage its own layer count" in lost[flag]
    with pytest.raises(Exception, match="--decoder-first-pipeline-num-layers"):
        mapargs.map_args(src, "mindformers-legacy", strict=True)


@pytest.mark.parametrize("name", SHARED_SCRIPTS)
@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
@pytest.mark.parametrize("split", [None, "16,16,16,14"])
def test_shared_scripts_load_in_the_target_loader_with_the_split_kept(name, target, split):
    """Every output of the shared launch scripts passes the loader's rules, an uneven split (--set) included."""
    values = {"vocab_size": "32001"}
    if split:
        values.update(num_layers="62", pipeline_model_parallel_size="4", num_layer_list=split)
    result = mapargs.map_args(FIXTURES / name, target, env=POSITIONALS, values=values)
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc, target) == []
    pipeline = doc["parallel_config"].get("num_layer_list")
    assert pipeline == ([16, 16, 16, 14] if split else None)


@pytest.mark.parametrize("name", SHARED_SCRIPTS)
def test_shared_scripts_load_in_mindformers_2_1(name, tmp_path):
    out = tmp_path / "run_gpt2.yaml"
    code, _, err = run(FIXTURES / name, "--to", "mindformers-legacy", *[f"-e{k}={v}" for k, v in POSITIONALS.items()],
                       "--set", "vocab_size=32001", "-o", out)
    assert code == 0, err
    config = mindformer_config(out)  # MindFormers 2.1.0's own loader: a key a section lacks raises
    source = M.complete(mapargs.load(FIXTURES / name, POSITIONALS).explicit)
    assert config.parallel_config.pipeline_stage == source["pipeline_model_parallel_size"]
    assert config.model.model_config.num_layers == source["num_layers"]


# ---------------------------------------------------------------- issue 22: a schedule the target refuses

def seed002_yaml(tmp_path, power=None):
    """Seed 002's run_gpt2_13b.yaml with the r0.3 runner.yaml it inherits (optimizer, lr_schedule)."""
    runner = (FIXTURES / "seed002_gpt2_runner_r03.yaml").read_text()
    if power is not None:
        runner = runner.replace("  type: polynomial\n", f"  type: polynomial\n  power: {power}\n")
    f = tmp_path / "run_gpt2_13b.yaml"
    f.write_text((FIXTURES / "seed002_run_gpt2_13b.yaml").read_text() + "\n" + runner)
    return f


SEED002_MODEL = {"num_layers": "40", "hidden_size": "5120", "num_attention_heads": "40", "seq_length": "1024",
                 "vocab_size": "50257"}


def test_the_seed_yaml_with_its_runner_is_what_mindformers_reads(tmp_path):
    config = mindformer_config(seed002_yaml(tmp_path))
    assert config.lr_schedule.type == "polynomial" and config.parallel_config.pipeline_stage == 4


@pytest.mark.parametrize("target", ["mindspeed", "megatron"])
def test_polynomial_of_power_one_is_linear_decay(tmp_path, target):
    """PolynomialWithWarmUpLR (alias `polynomial`, power 1.0 by default) decays linearly from learning_rate to lr_end:
    Megatron's and MindSpeed-Core-MS's `linear`, the same schedule; total_steps -1 is "the whole run"."""
    result = mapargs.map_args(seed002_yaml(tmp_path), target, values=SEED002_MODEL)
    said = [(e.flag, e.lost) for e in result.entries if "lr_schedule" in e.flag or "lr-decay" in e.flag]
    assert said == [("lr_schedule.type", False)]  # the rule, as a note: nothing lost
    if target == "mindspeed":
        doc = yaml.safe_load(result.text)
        assert ms_validate(doc) == []  # validate_lr_decay_style: constant, WSD, linear, cosine, inverse-square-root
        oc = doc["optimizer_config"]
        assert (oc["lr_decay_style"], oc["learning_rate"], oc["min_lr"], oc["lr_decay_iters"]) == \
            ("linear", 0.0001, 0.00001, None)
    else:
        args = parse_megatron(result.text)
        style = args.lr_decay_style or M.ARGS["lr_decay_style"].default  # not written: Megatron's default, linear
        assert (style, args.lr, args.min_lr, args.lr_decay_iters) == ("linear", 0.0001, 0.00001, None)


def test_polynomial_of_another_power_is_written_as_the_target_accepts_with_a_note(tmp_path):
    result = mapargs.map_args(seed002_yaml(tmp_path, power=2.0), "mindspeed", values=SEED002_MODEL)
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc) == [] and doc["optimizer_config"]["lr_decay_style"] == "linear"
    note = next(e for e in result.entries if e.flag == "lr_schedule.type")
    assert note.lost and "power 2.0" in note.why and "curve differs" in note.why


def test_a_fork_schedule_is_never_written_for_mindspeed(tmp_path):
    src = script(tmp_path, "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 "
                           "--vocab-size 1000 --lr-decay-style polynomial\n")
    result = mapargs.map_args(src, "mindspeed")
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc) == [] and doc["optimizer_config"]["lr_decay_style"] == "constant"
    lost = {e.flag: e.why for e in result.entries if e.lost}
    assert "'polynomial' is not one of constant, WSD, linear, cosine, inverse-square-root" in lost["--lr-decay-style"]


# ---------------------------------------------------------------- issue 27, item 12: facts carried faithfully

BATCH = ("torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py --num-layers 32 --hidden-size 4096 "
         "--num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 --tensor-model-parallel-size 2 "
         "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 1024 --vocab-size {vocab} "
         "--transformer-impl transformer_engine --lr 3e-4 --train-iters 1000 --bf16\n")


@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
def test_the_global_batch_comes_back_from_yaml(tmp_path, target):
    """32 ranks / (tp 2 * pp 4) = dp 4: micro_batch_num 256 in the YAML, and 1024 again on the way back."""
    out = tmp_path / "train.yaml"
    code, _, err = run(script(tmp_path, BATCH.format(vocab=32000)), "--to", target, "-o", out)
    doc = yaml.safe_load(out.read_text())
    assert code == 0 and doc["dataset_config"]["micro_batch_num"] == 256 and ms_validate(doc, target) == []
    assert "note: world_size=32: the launcher's rank count" in err and "unmapped: world_size" not in err
    code, back, err = run(out, "--to", "megatron")
    assert code == 0 and parse_megatron(back).global_batch_size == 1024 and "WORLD_SIZE=32" in back
    assert "assumed data-parallel size" not in err


def test_a_yaml_without_the_launch_still_says_its_assumption(tmp_path):
    out = tmp_path / "train.yaml"
    run(script(tmp_path, BATCH.format(vocab=32000)), "--to", "mindspeed", "-o", out)
    out.write_text("".join(line for line in out.read_text().splitlines(True) if not line.startswith("# launch:")))
    code, back, err = run(out, "--to", "megatron")
    assert code == 0 and parse_megatron(back).global_batch_size == 256 and "assumed data-parallel size of 1" in err


def test_report_lists_the_vocabulary_only_when_the_yaml_cannot_hold_it(tmp_path):
    report = tmp_path / "r.json"
    code, _, err = run(script(tmp_path, BATCH.format(vocab=32000)), "--to", "mindspeed", "--report", report)
    assert code == 0 and "--vocab-size" not in {e["flag"] for e in json.loads(report.read_text())["unmapped"]}
    code, out, err = run(script(tmp_path, BATCH.format(vocab=32001)), "--to", "mindspeed", "--report", report)
    lost = {e["flag"]: e for e in json.loads(report.read_text())["unmapped"]}
    assert yaml.safe_load(out)["model_config"]["vocab_size"] == 32256  # padded to 128 * tp 2: the embedding's rows
    assert lost["--vocab-size"]["lost"] and lost["--vocab-size"]["value"] == 32001
    assert "holds Megatron's padded size" in lost["--vocab-size"]["why"]


@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
def test_transformer_engine_becomes_local_with_a_note(tmp_path, target):
    code, out, err = run(script(tmp_path, BATCH.format(vocab=32000)), "--to", target)
    assert code == 0 and yaml.safe_load(out)["model_config"]["transformer_impl"] == "local"
    assert "note: --transformer-impl='transformer_engine': MindSpore has no Transformer Engine: written as 'local'" \
        in err


def test_hf_says_the_training_values_as_one_count(tmp_path):
    report = tmp_path / "r.json"
    code, out, err = run(FIXTURES / "mscorems_llama2_7b.sh", "--to", "hf", "--report", report)
    grouped = [e for e in json.loads(report.read_text())["unmapped"] if e.get("group")]
    lines = [line for line in err.splitlines() if "training values a Hugging Face config.json has no field" in line]
    assert code == 0 and len(grouped) > 30 and len(lines) == 1
    assert lines[0].startswith(f"unmapped: {len(grouped)} training values") and f"the list: {report}" in lines[0]
    assert [line for line in err.splitlines() if line.endswith(": no hf field for it")] == []
    assert {"--lr", "--train-iters", "--save"} <= {e["flag"] for e in grouped}
    assert "--report FILE" in run(FIXTURES / "mscorems_llama2_7b.sh", "--to", "hf")[2]


# ---------------------------------------------------------------- issue 22: the seeds' configs, every loader

MODEL = {"num_layers": "48", "hidden_size": "1600", "num_attention_heads": "32", "max_position_embeddings": "1024",
         "seq_length": "1024", "vocab_size": "50257"}
SEEDS = {  # each seed's config, with the values it does not state (the error names them)
    "seed000_pretrain_gpt_7B.yaml": {"seq_length": "4096", "vocab_size": "32000"},
    "seed001_model_38BV3.yaml": {"num_layer_list": "16,16,16,14", "vocab_size": "165664", "seq_length": "4096"},
    "seed002": SEED002_MODEL,
    "seed003_gpt2_hybrid_config.py": MODEL,
    "seed004_ds_3d_llama2_strategy.py": MODEL,
    "ds_config.json": MODEL,
}


def seed_file(name, tmp_path):
    return seed002_yaml(tmp_path) if name == "seed002" else FIXTURES / name


@pytest.mark.parametrize("name", SEEDS)
@pytest.mark.parametrize("target", ["mindspeed", "mindformers"])
def test_seed_configs_load_in_the_target_loader(name, target, tmp_path):
    result = mapargs.map_args(seed_file(name, tmp_path), target, values=SEEDS[name])
    doc = yaml.safe_load(result.text)
    assert ms_validate(doc, target) == []
    split = doc["parallel_config"].get("num_layer_list")
    assert split == ([16, 16, 16, 14] if "num_layer_list" in SEEDS[name] else None)


@pytest.mark.parametrize("name", SEEDS)
def test_seed_configs_load_in_mindformers_2_1(name, tmp_path):
    out = tmp_path / "run.yaml"
    code, _, err = run(seed_file(name, tmp_path), "--to", "mindformers-legacy", "-o", out,
                       *[f"--set={k}={v}" for k, v in SEEDS[name].items()])
    assert code == 0, err
    config = mindformer_config(out)
    source = M.complete(mapargs.load(seed_file(name, tmp_path), values=SEEDS[name]).explicit)
    assert config.model.model_config.num_layers == source["num_layers"]
    assert config.parallel_config.pipeline_stage == source["pipeline_model_parallel_size"]
    if "num_layer_list" in SEEDS[name]:  # r0.3 has no key for it: said, never dropped silently
        assert "unmapped: --num-layer-list='16,16,16,14': no MindFormers r0.3 GPT2Config" in err


def test_a_yaml_read_back_reports_nothing_it_holds(tmp_path):
    """The YAML's explicit `no_load_optim: false` is Megatron's unset --no-load-optim (off): the same run, no loss."""
    out = tmp_path / "train.yaml"
    run(script(tmp_path, BATCH.format(vocab=32000)), "--to", "mindspeed", "-o", out)
    code, _, err = run(out, "--to", "megatron")
    assert code == 0 and [line for line in err.splitlines() if line.startswith("unmapped:")] == []
    doc = yaml.safe_load(out.read_text())
    doc["training_config"]["no_load_optim"] = True  # a given switch is still carried, and checked
    out.write_text(yaml.safe_dump(doc))
    code, back, err = run(out, "--to", "megatron")
    assert code == 0 and parse_megatron(back).no_load_optim is True and "unmapped:" not in err


# The LR aliases MindFormers registers (mindformers/core/lr/build_lr.py register_mf_lr: the r0.3-era tree of
# seed002_gpt2_runner_r03's provenance, and 2.1.0's); build_lr refuses any other lr_schedule.type.
MINDFORMERS_LR_ALIASES = {"constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"}


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_mindformers_legacy_writes_a_registered_schedule(tmp_path, style):
    src = script(tmp_path, "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 "
                           f"--seq-length 32 --vocab-size 1000 --lr 0.001 --lr-warmup-iters 10 --lr-decay-style {style}\n")
    result = mapargs.map_args(src, "mindformers-legacy")
    written = yaml.safe_load(result.text.split("\n", 1)[1])["lr_schedule"]["type"]
    assert written in MINDFORMERS_LR_ALIASES and not [e for e in result.entries if "lr" in e.flag]
    back = tmp_path / "run.yaml"
    back.write_text(result.text)
    assert M.complete(mapargs.load(back).explicit)["lr_decay_style"] == style
