"""Checkpoints saved by real megatron-core releases (0.12 .. 0.19), read exactly.

`tests/fixtures/megatron/<version>/<optim>/` were made by `scripts/make_megatron_fixtures.py`
(see PROVENANCE there): a tiny Llama-style GPTModel trained 2 bf16 updates by that release's own
DDP, optimizer (`fp16opt`: the mixed-precision optimizer with fp32 masters; `distopt`: the
distributed optimizer at dp 2) and OptimizerParamScheduler, saved as Megatron-LM saves `--ckpt-format
torch` and `torch_dist`.  `expected.safetensors` holds the live optimizer's per-parameter state under
megatron-core's parameter names (weights, fp32 masters, Adam moments), `expected.json` the scalars and
the losses of the next two updates: the values come from the tool, not from interop's readers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from interop.converters.megatron import Reader
from interop.convert import convert
from interop.layout import ParallelLayout
from interop.params import param_index

from interop.converters.megatron.rows import expand_rows

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron"
CASES = sorted((v.name, k) for v in FIXTURES.iterdir() if v.is_dir()
               for k in ("fp16opt", "distopt") if (v / k / "expected.json").is_file())
VERSIONS = sorted({v for v, _ in CASES})


def test_every_release_is_there():
    """The matrix the fixtures cover (regenerate with the script if one is missing)."""
    assert [v.rsplit(".", 1)[0] for v in VERSIONS] == ["0.12", "0.13", "0.14", "0.15", "0.16", "0.17", "0.18", "0.19"]
    assert all((FIXTURES / v / k / "expected.json").is_file() for v in VERSIONS for k in ("fp16opt", "distopt"))


def _expected(version, kind):
    root = FIXTURES / version / kind
    return root, json.loads((root / "expected.json").read_text()), load_file(str(root / "expected.safetensors"))


def _mcore_tensor(reader, row, prefix, spec, index):
    """The megatron-core tensor of `row` (tp 1) rebuilt from what the reader returns for its canonical parts."""
    return row.transform.fuse([reader.read(prefix + n) for n in row.parts])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("version,kind", CASES)
def test_release_checkpoint_is_read_exactly(version, kind, fmt):
    root, expected, tensors = _expected(version, kind)
    reader = Reader(root / fmt)
    try:
        spec, index = reader.source.spec, param_index(reader.source.spec)
        kinds = ("exp_avg", "exp_avg_sq", "fp32_param")
        names = {m.name for m in reader.metas()}
        assert all(f"optim.{k}.embed.word.weight" in names for k in kinds), reader.source.notes
        rows = [r for r in expand_rows("mcore", spec, ParallelLayout.build(spec.num_layers)) if r.transform.reads_back]
        assert {r.key for r in rows} == {k.split("/", 1)[1] for k in tensors if k.startswith("weight/")}
        for row in rows:
            assert torch.equal(_mcore_tensor(reader, row, "", spec, index), tensors[f"weight/{row.key}"]), row.key
            for k in kinds:
                got = _mcore_tensor(reader, row, f"optim.{k}.", spec, index)
                assert got.dtype == torch.float32 and torch.equal(got, tensors[f"{k}/{row.key}"]), (k, row.key)
        state = reader.source.state
        meg = state["megatron"]
        assert state["iteration"] == expected["iteration"]
        assert state["consumed_samples"] == expected["consumed_samples"]
        assert meg["opt_param_scheduler"] == expected["opt_param_scheduler"]
        assert [meg["optimizer"]["step"]] == expected["step"]
        assert meg["num_floating_point_operations_so_far"] == expected["num_floating_point_operations_so_far"]
        assert any(f"step {expected['step'][0]}" in n and "converted the optimizer state" in n
                   for n in reader.source.notes)
    finally:
        reader.close()


def _resume(ckpt: Path, kind: str, pythonpath: str | None = None, sharding: str | None = None,
            python: str | None = None, bucket_size: int | None = None) -> list[float]:
    """megatron-core (the installed one, or `pythonpath`'s, run by `python`) loads `ckpt` and trains 2 updates."""
    import os

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [python or sys.executable, str(ROOT / "scripts" / "make_megatron_fixtures.py"), str(ckpt), "--resume",
           "--only", kind]
    if sharding:
        cmd += ["--sharding", sharding]
    if bucket_size:
        cmd += ["--bucket-size", str(bucket_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.parametrize("version", VERSIONS)
def test_interop_torch_dist_resumes_in_megatron_core(version, tmp_path):
    """A release's mixed-precision checkpoint (torch format) -> common format at tp 2 -> torch_dist: the
    installed megatron-core loads weights, fp32 masters, moments, step and scheduler and trains the next
    two updates with the source run's losses."""
    pytest.importorskip("megatron.core")
    root, expected, _ = _expected(version, "fp16opt")
    convert(root / "torch", tmp_path / "store", dst_format="interop", tp=2)
    convert(tmp_path / "store", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    losses = _resume(tmp_path / "dist" / "iter_0000002", "fp16opt")
    assert losses == expected["next_losses"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distributed_optimizer_both_ways_resumes_at_dp2(fmt, tmp_path):
    """megatron-core 0.16.1's distributed optimizer at dp 2 (distrib_optim.pt, or torch_dist dp_reshardable
    buckets) -> common format at tp 2 -> torch_dist in the distributed optimizer's per-parameter layout
    (`fully_reshardable`): megatron-core at dp 2 loads it and trains the next two updates with exactly the
    losses it trains from its own checkpoint.  (Both differ slightly from the uninterrupted run's: megatron-core
    without Transformer Engine restores torch Adam's step from the param groups.)"""
    pytest.importorskip("megatron.core")
    root = FIXTURES / "0.16.1" / "distopt"
    summary = convert(root / fmt, tmp_path / "store", dst_format="interop", tp=2)
    assert any("converted the optimizer state" in n and "distributed optimizer" in n for n in summary.notes)
    convert(tmp_path / "store", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    from interop.io.megatron_dist import DistCheckpoint
    ckpt = DistCheckpoint(tmp_path / "dist" / "iter_0000002")
    assert ckpt.common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert "optimizer.state.param.output_layer.weight" in ckpt
    ours = _resume(tmp_path / "dist" / "iter_0000002", "distopt", sharding="fully_reshardable")
    own = _resume(root / "torch_dist" / "iter_0000002", "distopt", sharding="dp_reshardable")
    assert ours == own
    assert ours[0] == json.loads((root / "expected.json").read_text())["next_losses"][0]


def _copy_torch(tmp_path, kind="fp16opt"):
    import shutil

    dst = tmp_path / "m"
    shutil.copytree(FIXTURES / "0.16.1" / kind / "torch", dst)
    return dst, dst / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"


@pytest.mark.parametrize("key,value,message", [
    ("hidden_size", "16", "args.hidden_size is '16', not an integer"),
    ("num_layers", 10 ** 5000, "model_optim_rng.pt: "),  # refused by the loader already, or by check_args
    ("norm_epsilon", [1e-5], "args.norm_epsilon is [1e-05], not a number"),
], ids=["string", "huge", "list"])
def test_non_numeric_args_are_one_line(tmp_path, key, value, message):
    """Hostile or damaged stored args (issue 10): one `error:` line naming the file and the arg, exit 2."""
    from click.testing import CliRunner

    from interop.cli.main import main

    root, rank = _copy_torch(tmp_path)
    obj = torch.load(rank, weights_only=False)
    setattr(obj["args"], key, value)
    torch.save(obj, rank)
    result = CliRunner().invoke(main, ["convert", str(root), str(tmp_path / "out"), "--to", "interop"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_rank_tensor_of_another_dtype_is_refused(tmp_path):
    """A tp rank whose tensor has another dtype than its peers' (issue 10): refused, not joined."""
    import shutil

    from interop.errors import InteropError

    src = tmp_path / "tp2"
    convert(FIXTURES / "0.16.1" / "fp16opt" / "torch", src, dst_format="megatron", tp=2)
    rank = next(src.glob("iter_*/mp_rank_01/model_optim_rng.pt"))
    obj = torch.load(rank, weights_only=False)
    obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"].half()
    torch.save(obj, rank)
    with pytest.raises(InteropError, match="linear_fc2.weight is stored as torch.float16 here, as torch.bfloat16 by tp rank 0: one dtype"):
        convert(src, tmp_path / "out", dst_format="interop")
    assert not (tmp_path / "out").exists()
    shutil.rmtree(src)


def test_distributed_optimizer_to_torch_format_is_said(tmp_path):
    """To the torch format the distributed optimizer's state goes as the non-distributed optimizer's (rank
    files, no distrib_optim.pt), said in a note and in the args written; nothing is lost on the way."""
    from interop.io.torch_file import LazyTorchFile

    root, expected, tensors = _expected("0.16.1", "distopt")
    summary = convert(root / "torch_dist", tmp_path / "m", dst_format="megatron")
    assert any("written as the non-distributed optimizer's" in n for n in summary.notes)
    rank = LazyTorchFile(next((tmp_path / "m").glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    assert rank.obj["args"].use_distributed_optimizer is False
    reader = Reader(tmp_path / "m")
    spec, index = reader.source.spec, param_index(reader.source.spec)
    for row in (r for r in expand_rows("mcore", spec, ParallelLayout.build(spec.num_layers)) if r.transform.reads_back):
        for k in ("exp_avg", "exp_avg_sq", "fp32_param"):
            assert torch.equal(_mcore_tensor(reader, row, f"optim.{k}.", spec, index), tensors[f"{k}/{row.key}"])
    assert reader.source.state["megatron"]["opt_param_scheduler"] == expected["opt_param_scheduler"]


@pytest.mark.parametrize("version", [v for v in VERSIONS if not v.startswith("0.16.")])
def test_older_release_loads_interop_torch_dist(version, tmp_path):
    """Each older release's own `dist_checkpointing.load` resumes interop's torch_dist output (of that
    release's mixed-precision checkpoint, via the common format at tp 2) with the source run's next two
    losses.  Opt-in (CI keeps one live megatron-core): INTEROP_MCORE_RELEASES=DIR, where DIR/mcore-0.NN
    holds `pip install --target DIR/mcore-0.NN megatron-core==0.NN.* --no-deps`."""
    import os

    base = os.environ.get("INTEROP_MCORE_RELEASES")
    target = Path(base or "/nonexistent") / f"mcore-{version.rsplit('.', 1)[0]}"
    if not (target / "megatron" / "core").is_dir():
        pytest.skip(f"set INTEROP_MCORE_RELEASES to a folder with mcore-{version.rsplit('.', 1)[0]}/ to run this")
    python = None
    if int(version.split(".")[1]) >= 17:  # its wheel wants Python >= 3.12 (and a torch with triton)
        python = os.environ.get("INTEROP_MCORE_PYTHON312")
        if not python:
            pytest.skip(f"megatron-core {version} needs Python 3.12: set INTEROP_MCORE_PYTHON312 to one with torch")
    root, expected, _ = _expected(version, "fp16opt")
    convert(root / "torch", tmp_path / "store", dst_format="interop", tp=2)
    convert(tmp_path / "store", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    got = _resume(tmp_path / "dist" / "iter_0000002", "fp16opt", pythonpath=str(target), python=python)
    assert got == expected["next_losses"]


def test_fully_reshardable_is_read_back(tmp_path):
    """interop's own distributed-optimizer torch_dist (0.16's `fully_reshardable`: fp32 masters under `param`)
    reads back exactly, with the step from the param groups."""
    root, expected, tensors = _expected("0.16.1", "distopt")
    convert(root / "torch", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    reader = Reader(tmp_path / "dist")
    assert any("fully_reshardable" in n and f"step {expected['step'][0]}" in n for n in reader.source.notes)
    spec, index = reader.source.spec, param_index(reader.source.spec)
    for row in (r for r in expand_rows("mcore", spec, ParallelLayout.build(spec.num_layers)) if r.transform.reads_back):
        for k in ("exp_avg", "exp_avg_sq", "fp32_param"):
            assert torch.equal(_mcore_tensor(reader, row, f"optim.{k}.", spec, index), tensors[f"{k}/{row.key}"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mixed_precision_masters_to_mindspore(fmt, tmp_path):
    """megatron-core 0.16.1's bf16 mixed-precision checkpoint (fp32_from_fp16_params) -> MindSpore (issue 10:
    a KeyError traceback before): MindSpeed's weights are the fp32 masters (as its convert_pt2ckpt.py writes
    them), MindFormers' drop them with a note; the Adam moments are written exactly."""
    from interop.formats import converter

    root = FIXTURES / "0.16.1" / "fp16opt" / fmt
    src = Reader(root)
    for dialect in ("mindspeed", "mindformers"):
        out_dir = tmp_path / dialect
        summary = convert(root, out_dir, dst_format="mindspore", tp=2, options={"dialect": dialect})
        out = converter("mindspore").Reader(out_dir)
        if dialect == "mindspeed":
            assert any("weights written from the optimizer's fp32 master copies" in n for n in summary.notes)
            for m in src.metas():
                if not m.name.startswith("optim."):
                    assert torch.equal(out.read(m.name), src.read("optim.fp32_param." + m.name)), m.name
        else:
            assert any("dropped the optimizer's fp32 master copies" in n for n in summary.notes)
        names = {m.name for m in out.metas()}
        assert not any(n.startswith("optim.fp32_param.") for n in names)
        for name in (m.name for m in src.metas() if m.name.startswith(("optim.exp_avg.", "optim.exp_avg_sq."))):
            assert torch.equal(out.read(name), src.read(name)), (dialect, name)


def test_distributed_optimizer_flag_on_the_command_line(tmp_path):
    """`--distributed-optimizer` reaches the torch_dist writer (a mixed-precision source written in the
    distributed optimizer's layout); with the torch format it is one error line, exit 2, nothing written."""
    from click.testing import CliRunner

    from interop.cli.main import main
    from interop.io.megatron_dist import DistCheckpoint

    src = FIXTURES / "0.16.1" / "fp16opt" / "torch"
    run = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "dist"), "--to", "megatron", "-q",
                                    "--format", "torch_dist", "--distributed-optimizer"])
    assert run.exit_code == 0, run.output
    ckpt = DistCheckpoint(next((tmp_path / "dist").glob("iter_*")))
    assert ckpt.common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    bad = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "pt"), "--to", "megatron", "-q",
                                    "--distributed-optimizer"])
    # the torch format's distrib_optim.pt is laid out for one dp: without --dp, one line naming it
    assert bad.exit_code == 2 and bad.output.startswith("error: ") and "--dp N" in bad.output, bad.output
    assert len(bad.output.strip().splitlines()) == 1 and not (tmp_path / "pt").exists()
    good = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "pt"), "--to", "megatron", "-q",
                                     "--distributed-optimizer", "--dp", "2"])
    assert good.exit_code == 0, good.output
    assert (tmp_path / "pt" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    assert not list((tmp_path / "pt").rglob("*.scratch"))
    for extra in (["--dp", "2"], ["--dp", "2", "--format", "torch_dist", "--distributed-optimizer"]):  # nothing to lay out
        stray = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x"), "--to", "megatron", "-q", *extra])
        assert stray.exit_code == 2 and stray.output.startswith("error: --dp applies to"), stray.output
        assert not (tmp_path / "x").exists()


def _distrib_optim(folder: Path) -> dict:
    return torch.load(folder / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt", weights_only=True)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distrib_optim_pt_is_written_as_megatron_core_saves_it(fmt, tmp_path):
    """megatron-core 0.16.1's distributed optimizer at dp 2 (distrib_optim.pt, or torch_dist dp_reshardable)
    -> common format at tp 2 -> the torch format with `--distributed-optimizer --dp 2`: the distrib_optim.pt
    written equals the one megatron-core's own `save_parameter_state` wrote (keys, dtype key, every element
    of the coalesced buffers), and megatron-core at dp 2 (`load_state_dict` of the rank file, then
    `load_parameter_state`, as Megatron-LM's load_checkpoint does) trains the next two updates with exactly
    the losses it trains from its own torch checkpoint."""
    pytest.importorskip("megatron.core")
    root = FIXTURES / "0.16.1" / "distopt"
    convert(root / fmt, tmp_path / "store", dst_format="interop", tp=2)
    summary = convert(tmp_path / "store", tmp_path / "pt", dst_format="megatron",
                      options={"format": "torch", "distributed_optimizer": True, "dp": 2})
    assert any("distrib_optim.pt) for dp 2, one bucket per model chunk" in n for n in summary.notes), summary.notes
    ours, theirs = _distrib_optim(tmp_path / "pt"), _distrib_optim(root / "torch")
    assert ours.keys() == theirs.keys() == {"buckets_coalesced", 0} and ours["buckets_coalesced"] is True
    assert ours[0].keys() == theirs[0].keys() == {(torch.bfloat16, torch.float32)}
    for dtypes, entry in theirs[0].items():
        assert ours[0][dtypes]["numel_unpadded"] == entry["numel_unpadded"]
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert ours[0][dtypes][k].dtype == torch.float32 and torch.equal(ours[0][dtypes][k], entry[k]), k
    rank = torch.load(tmp_path / "pt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert rank["args"].use_distributed_optimizer is True and rank["args"].data_parallel_size == 2
    assert [g["step"] for g in rank["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    got = _resume(tmp_path / "pt" / "iter_0000002", "distopt")
    own = _resume(root / "torch" / "iter_0000002", "distopt")
    assert got == own
    assert got[0] == json.loads((root / "expected.json").read_text())["next_losses"][0]


@pytest.mark.parametrize("version", VERSIONS)
def test_distrib_optim_pt_equals_each_releases_own(version, tmp_path):
    """Each release's distributed-optimizer run (dp 2) -> common format at tp 2 -> distrib_optim.pt for dp 2: equal,
    element for element and key for key, to the one that release's `save_parameter_state` wrote."""
    root = FIXTURES / version / "distopt"
    convert(root / "torch", tmp_path / "store", dst_format="interop", tp=2)
    convert(tmp_path / "store", tmp_path / "pt", dst_format="megatron", options={"distributed_optimizer": True, "dp": 2})
    ours, theirs = _distrib_optim(tmp_path / "pt"), _distrib_optim(root / "torch")
    assert ours.keys() == theirs.keys() and ours[0].keys() == theirs[0].keys()
    for dtypes, entry in theirs[0].items():
        assert ours[0][dtypes].keys() == entry.keys() and ours[0][dtypes]["numel_unpadded"] == entry["numel_unpadded"]
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[0][dtypes][k], entry[k]), (version, k)


def test_distrib_optim_pt_at_a_new_dp_resumes_as_torch_dist_does(tmp_path):
    """The mixed-precision run at dp 1 (no distrib_optim.pt) -> distrib_optim.pt laid out for dp 2: megatron-core's
    distributed optimizer at dp 2 loads it and trains the same two updates as from the same state written as
    torch_dist `fully_reshardable` (which megatron-core reshards itself), weights, masters and moments included."""
    pytest.importorskip("megatron.core")
    src = FIXTURES / "0.16.1" / "fp16opt" / "torch"
    convert(src, tmp_path / "pt", dst_format="megatron", options={"distributed_optimizer": True, "dp": 2})
    convert(src, tmp_path / "dist", dst_format="megatron",
            options={"format": "torch_dist", "distributed_optimizer": True})
    via_pt = _resume(tmp_path / "pt" / "iter_0000002", "distopt")
    via_dist = _resume(tmp_path / "dist" / "iter_0000002", "distopt", sharding="fully_reshardable")
    assert via_pt == via_dist


def test_distrib_optim_pt_in_several_buckets_resumes_as_torch_dist_does(tmp_path):
    """A run with --overlap-grad-reduce --ddp-bucket-size 2000 (its args say so): distrib_optim.pt laid out in
    megatron-core's buckets of 2000 elements (each padded to lcm(dp, 128)); megatron-core's distributed optimizer
    with those buckets at dp 2 loads it and trains the same two updates as from torch_dist `fully_reshardable`."""
    pytest.importorskip("megatron.core")
    convert(FIXTURES / "0.16.1" / "distopt" / "torch", tmp_path / "store", dst_format="interop")
    manifest = json.loads((tmp_path / "store" / "interop.json").read_text())
    manifest["state"]["megatron"]["args"].update(overlap_grad_reduce=True, ddp_bucket_size=2000)
    (tmp_path / "store" / "interop.json").write_text(json.dumps(manifest))
    summary = convert(tmp_path / "store", tmp_path / "pt", dst_format="megatron",
                      options={"distributed_optimizer": True, "dp": 2})
    assert any("for dp 2, buckets of 2000 elements" in n for n in summary.notes), summary.notes
    convert(tmp_path / "store", tmp_path / "dist", dst_format="megatron",
            options={"format": "torch_dist", "distributed_optimizer": True})
    via_pt = _resume(tmp_path / "pt" / "iter_0000002", "distopt", bucket_size=2000)
    via_dist = _resume(tmp_path / "dist" / "iter_0000002", "distopt", sharding="fully_reshardable", bucket_size=2000)
    assert via_pt == via_dist


def test_distrib_optim_pt_refusals(tmp_path):
    """What distrib_optim.pt cannot hold is one line, nothing written: a tied embedding over several pipeline
    stages (megatron-core gives it a bucket of its own); a source without Adam moments gets a note, no file."""
    from interop.errors import InteropError
    from interop.trainer.config import TrainConfig
    from interop.trainer.init import init_checkpoint, read_spec
    from interop.trainer.launch import train
    from helpers.specs import GPT2, write_spec

    start = init_checkpoint(read_spec(write_spec(tmp_path / "gpt2.yaml", GPT2)), tmp_path / "start", seed=1)
    summary = convert(start, tmp_path / "no-moments", dst_format="megatron",
                      options={"distributed_optimizer": True, "dp": 2})
    assert any("no optimizer state in the source: no distrib_optim.pt written" in n for n in summary.notes)
    assert not list((tmp_path / "no-moments").rglob("distrib_optim.pt"))
    train(TrainConfig(load=str(start), save=str(tmp_path / "A"), steps=1, save_interval=1, micro_batch_size=2,
                      global_batch_size=2, seq_length=8, quiet=True))
    with pytest.raises(InteropError, match="tied embedding over several pipeline stages"):
        convert(tmp_path / "A" / "step_000001", tmp_path / "pp2", dst_format="megatron", pp=2,
                options={"distributed_optimizer": True, "dp": 2})
    assert not (tmp_path / "pp2").exists()
