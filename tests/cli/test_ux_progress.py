"""Fail before the work, show the work: parity checks every framework first and survives a late failure;
`train` announces the run and each save, and refuses a --config describing another model than --load."""
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from interop.cli.main import main
from interop.trainer.config import TrainConfig, load_config
from interop.trainer.init import init_checkpoint, read_spec
from interop.workflows.parity import parity
from helpers.specs import GPT2, LLAMA, write_spec

CFG = TrainConfig(steps=3, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    root = tmp_path_factory.mktemp("ux-progress")
    return {name: init_checkpoint(read_spec(write_spec(root / f"{name}.yaml", spec)), root / name, seed=5)
            for name, spec in (("llama", LLAMA), ("gpt2", GPT2))}


def test_parity_checks_every_framework_before_any_run(start):
    """The README's mistake (megatron on a vocabulary Megatron pads) and a bad layout: one line, exit 2,
    and no run started (no progress line)."""
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--frameworks", "torch,hf,megatron",
                                       "--layouts", "1x1,3x1", "--steps", "2"])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "layout 3x1x1: tp=3 does not divide" in err[0] and "framework megatron:" in err[0] and "padded" in err[0]
    assert "parity [" not in result.stderr


def test_parity_late_failure_keeps_the_other_runs(start, tmp_path, monkeypatch):
    import interop.workflows.frameworks as frameworks

    def broken(ckpt, cfg):
        raise RuntimeError("the framework crashed midway\nsecond line")

    monkeypatch.setattr(frameworks, "hf_losses", broken)
    png = tmp_path / "p.png"
    logged = []
    result = parity(start["llama"], CFG, layouts=[(1, 1, 1), (1, 2, 1)], frameworks=["torch", "hf"], plot=png,
                    log=logged.append)
    assert list(result.runs) == ["torch 1x1", "torch 1x2"] and result.failed == {"hf": "the framework crashed midway"}
    assert not result.ok and result.max_diff < 1e-5
    table = result.table()
    assert "hf: FAILED (the framework crashed midway)" in table and "1 run(s) failed" in table
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert logged[0] == "parity [1/3] torch 1x1: 3 steps ..." and "done in" in logged[1]
    assert any(line.startswith("parity [3/3] hf: FAILED after") for line in logged)


def test_parity_cli_prints_progress_on_stderr(start):
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--frameworks", "torch", "--layouts", "1x1,2x1",
                                       "--steps", "2", "--seq-length", "16"])
    assert result.exit_code == 0, result.output
    assert "parity [1/2] torch 1x1: 2 steps" in result.stderr and "parity [2/2] torch 2x1: done in" in result.stderr
    assert "parity [" not in result.stdout  # the table stays clean on stdout


def test_train_announces_the_run_and_each_save(start, tmp_path):
    args = ["train", "--load", str(start["llama"]), "--save", str(tmp_path / "run"), "--steps", "4",
            "--global-batch-size", "4", "--seq-length", "16", "--save-interval", "2"]
    def interop(*argv):  # a child process: the ranks print to the real stdout
        return subprocess.run([sys.executable, "-m", "interop", *argv], capture_output=True, text=True)

    first = interop(*args, "--stop-at", "2", "--pp", "2")
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "model: llama, 4 layers" in out and "M parameters" in out
    assert "layout: tp=1 pp=2" in out and f"start: weights of {start['llama']}" in out
    assert "data: synthetic stream" in out and f"checkpoints: {tmp_path / 'run'}/step_NNNNNN, every 2 steps" in out
    assert f"saved step 2: {tmp_path / 'run' / 'step_000002'}" in out
    second = interop(*args, "--resume")
    assert second.returncode == 0, second.stderr
    assert "start: resumed from step 2 at tp=1 pp=2 dp=1" in second.stdout and "continuing at tp=1 pp=1 dp=1" in second.stdout
    assert "saved step 4" in second.stdout


def test_config_describing_another_model_is_refused(start, tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump({"model_config": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                                       "group_query_attention": False, "seq_length": 16},
                                      "training_config": {"training_iters": 2}}))
    result = CliRunner().invoke(main, ["train", "--config", str(config), "--load", str(start["llama"])])
    assert result.exit_code == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "describes another model than --load" in err[0]
    assert "num_layers 32 vs 4" in err[0] and "hidden 4096 vs" in err[0] and "kv_groups 32 vs" in err[0]
    # the same model described: accepted (the llama start has 4 layers, hidden 64, 4 heads / 2 groups)
    from interop.store import StoreReader
    s = StoreReader(start["llama"]).spec
    args = tmp_path / "args.txt"
    args.write_text(f"--num-layers {s.num_layers} --hidden-size {s.hidden} --num-attention-heads {s.heads} "
                    f"--group-query-attention --num-query-groups {s.kv_groups} --train-iters 1 --seq-length 16 "
                    "--micro-batch-size 2\n")
    cfg = load_config(args)
    assert cfg.config_model == {"num_layers": s.num_layers, "hidden": s.hidden, "heads": s.heads, "kv_groups": s.kv_groups}
    result = CliRunner().invoke(main, ["train", "--config", str(args), "--load", str(start["llama"])])
    assert result.exit_code == 0, result.output


def test_yaml_without_gqa_flag_leaves_groups_out(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model_config": {"num_layers": 2, "num_query_groups": 1}}))
    assert load_config(config).config_model == {"num_layers": 2}
