"""What every hostile-input test asserts: the exit code, exactly one `error: ...` line and no traceback,
no marker file (nothing in the input ran), nothing at the destination and nothing left beside it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from interop.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def cli(*args):
    """(exit code, stderr, stdout) of `interop ARGS` run in this process."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stderr, result.stdout


def run(*args):
    """(exit code, stdout and stderr together) of `interop ARGS` run in this process."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def assert_one_error(code, output, *words):
    """Exit 2, exactly one `error: ...` line holding every one of `words`, no traceback."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), output
    assert "Traceback" not in output
    for word in words:
        assert word in lines[0], (word, output)


def cli_subprocess(*args, timeout=300, env=None):
    """(exit code, stderr, stdout) of `python -m interop ARGS` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "interop", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)
    return proc.returncode, proc.stderr, proc.stdout


def leftovers(dst: Path) -> list[str]:
    """Hidden siblings a run into `dst` could leave (`.DST.tmp-*`, `.DST.old-*`)."""
    dst = Path(dst)
    if not dst.parent.exists():
        return []
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def assert_one_line_error(code: int, stderr: str, expected_code: int, *fragments: str) -> str:
    assert code == expected_code, (code, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_refused(result, dst, *fragments, code: int = 2, marker: Path | None = None) -> str:
    """A refused conversion: one line, `code`, no `dst`, nothing beside it, `marker` (if given) absent."""
    line = assert_one_line_error(result[0], result[1], code, *fragments)
    if dst is not None:
        assert not Path(dst).exists(), f"{dst} was created"
        assert leftovers(dst) == [], leftovers(dst)
    if marker is not None:
        assert not Path(marker).exists(), f"{marker} appeared: something in the input ran"
    return line


def cli_measured(*args, timeout=120):
    """(exit code, stderr, seconds, peak RSS in MiB) of `python -m interop ARGS` in a fresh interpreter: the
    peak is the child's own address space's (`VmHWM` at exit, written to a side file), so a bomb that allocates
    GBs before failing shows here.  Not `wait4`'s ru_maxrss: Linux carries the forking process's peak (pytest's,
    GBs late in a full run) across exec into it."""
    import tempfile
    import time
    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        hwm = Path(tempfile.mkdtemp()) / "hwm"
        shim = ("import atexit, runpy, sys\n"
                "def _hwm():\n"
                "    line = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
                f"    open({str(hwm)!r}, 'w').write(line.split()[1])\n"
                "atexit.register(_hwm)\n"
                "sys.argv = ['interop', *sys.argv[1:]]\n"
                "runpy.run_module('interop', run_name='__main__', alter_sys=True)\n")
        proc = subprocess.Popen([sys.executable, "-c", shim, *map(str, args)], stdout=subprocess.DEVNULL,
                                stderr=err, cwd=REPO)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise AssertionError(f"interop {' '.join(map(str, args))} ran past {timeout} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        seconds = time.monotonic() - start
        err.seek(0)
        peak_kib = int(hwm.read_text()) if hwm.is_file() else usage.ru_maxrss
        return proc.returncode, err.read().decode(errors="replace"), seconds, peak_kib / 1024
