"""Commands that need no tensors start without importing torch (issue 17: start-up well under 0.5 s).

Each check runs in a fresh interpreter, because this test process itself has torch loaded.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from interop.cli.convert import DTYPE_CHOICES


def torch_free(argv: list[str]) -> dict:
    """Run `interop *argv` in a fresh interpreter; report its exit code and whether torch got imported."""
    code = textwrap.dedent(f"""
        import json, sys
        from interop.cli.main import main
        try:
            main({argv!r})
            rc = 0
        except SystemExit as exc:
            rc = exc.code
        print(json.dumps({{"rc": rc, "torch": "torch" in sys.modules}}), file=sys.stderr)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(run.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["map-args", "--help"], ["convert", "--help"],
                                  ["train", "--help"], ["parity", "--help"], ["demo", "--help"], ["verify", "--help"]])
def test_help_and_version_do_not_import_torch(argv):
    result = torch_free(argv)
    assert result == {"rc": 0, "torch": False}


def test_map_args_does_not_import_torch(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 8 "
                      "--seq-length 128 --max-position-embeddings 128 --tensor-model-parallel-size 2\n")
    result = torch_free(["map-args", str(script), "--to", "mindspeed", "-o", str(tmp_path / "out.yaml")])
    assert result == {"rc": 0, "torch": False}
    assert (tmp_path / "out.yaml").is_file()


def test_inspect_of_a_store_does_not_import_torch(hf_checkpoints, tmp_path):
    from interop.convert import convert
    convert(hf_checkpoints["gpt2"], tmp_path / "ckpt", dst_format="interop", tp=2, pp=3)
    assert torch_free(["inspect", str(tmp_path / "ckpt"), "--no-tensors"]) == {"rc": 0, "torch": False}
    assert torch_free(["inspect", str(tmp_path / "ckpt"), "--json"]) == {"rc": 0, "torch": False}


def test_cli_dtype_choices_match_the_engine():
    from interop.convert import DTYPE_CHOICES as ENGINE
    assert tuple(ENGINE) == DTYPE_CHOICES


def test_package_import_is_torch_free():
    run = subprocess.run([sys.executable, "-c", "import sys, interop, interop.cli.main; print('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert run.stdout.strip() == "False", run.stderr


def test_verbose_shows_the_traceback_behind_the_error_line(tmp_path):
    argv = ["convert", str(tmp_path / "missing"), str(tmp_path / "out"), "--to", "hf"]
    quiet = subprocess.run([sys.executable, "-m", "interop", *argv], capture_output=True, text=True)
    assert quiet.returncode == 2 and quiet.stderr.strip().count("\n") == 0 and "Traceback" not in quiet.stderr
    loud = subprocess.run([sys.executable, "-m", "interop", "-v", *argv], capture_output=True, text=True)
    assert loud.returncode == 2 and "Traceback" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip()


def test_shell_completion_script():
    """The completion line the README and `interop --help` give works (click's own mechanism)."""
    import os
    from pathlib import Path
    script = Path(sys.executable).parent / "interop"  # the console script the install puts beside python
    run = subprocess.run([str(script)], capture_output=True, text=True, env={**os.environ, "_INTEROP_COMPLETE": "bash_source"})
    assert "_interop_completion" in run.stdout and "complete " in run.stdout
    words = subprocess.run([str(script)], capture_output=True, text=True,
                           env={**os.environ, "_INTEROP_COMPLETE": "bash_complete", "COMP_WORDS": "interop con",
                                "COMP_CWORD": "1"})
    assert "plain,convert" in words.stdout
