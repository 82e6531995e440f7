"""Atomic: a destination appears whole or not at all, nothing the run did not own is replaced or
deleted, and nothing is leaked (issue 10).

Each case asserts the exit code, one `error:` line without a traceback, and what is left at and
beside the destination.
"""
from __future__ import annotations

import builtins
import errno
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.hostile import REPO, assert_one_line_error, assert_refused, cli, leftovers
from interop import atomic
from interop.atomic import atomic_directory, remove_stale_siblings
from interop.errors import InteropError

WRITERS = {  # name -> `interop convert` target flags
    "interop": ["--to", "interop"],
    "hf": ["--to", "hf"],
    "megatron-torch": ["--to", "megatron", "--format", "torch"],
    "megatron-torch_dist": ["--to", "megatron", "--format", "torch_dist"],
    "mindspore": ["--to", "mindspore"],
}


def sharded(writer: str, flag: str) -> list[str]:
    """`flag 2` where the format shards (HF is never sharded)."""
    return [] if writer == "hf" else [flag, "2"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path -> sha256, to prove an input was not touched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- runs in another process, paused on cue

HOOK = r'''
import os, sys, time, pathlib
from interop.cli.main import main
mode, flags, tag, args = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
if mode == "pause":  # stop inside the conversion, after some files were written, until killed
    from interop import store
    original, calls = store.StoreWriter.write, [0]
    def write(self, name, tensor):
        calls[0] += 1
        if calls[0] == 5:
            (flags / tag).write_text(str(os.getpid()))
            time.sleep(600)
        return original(self, name, tensor)
    store.StoreWriter.write = write
else:  # "barrier" / "barrier-fallback": both runs finish writing, then publish at the same moment
    from interop import atomic
    if mode == "barrier-fallback":
        atomic._renameat2 = None
    original = atomic.fsync_tree
    def fsync_tree(root):
        original(root)
        (flags / tag).write_text("ready")
        deadline = time.time() + 240
        while len(list(flags.iterdir())) < 2 and time.time() < deadline:
            time.sleep(0.02)
    atomic.fsync_tree = fsync_tree
main(args, prog_name="interop")
'''


def start(mode: str, flags: Path, tag: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOOK, mode, str(flags), tag, *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before pausing: {proc.communicate()}")
        assert time.time() < deadline, "the run never paused"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["barrier", "barrier-fallback"])
def test_two_runs_into_one_new_destination_exactly_one_wins(hf_checkpoints, tmp_path, mode):
    """Both finish writing, then publish at once: one exits 0, the other exits 2 with one line and
    leaves no temporary directory; the winner's output is whole.  `barrier-fallback` takes the path
    for systems without renameat2 (claim the name with mkdir, then rename onto our own empty dir)."""
    flags, dst = tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    procs = [start(mode, flags, f"run{i}", "convert", hf_checkpoints["llama"], dst, "--to", "interop", "--tp", tp, "-q")
             for i, tp in enumerate((1, 2))]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    code, out, err = next(r for r in results if r[0] == 2)
    assert_refused((code, err), None, str(dst), "appeared while this run was writing")
    winner = next(r for r in results if r[0] == 0)
    tp = 1 if "tp=1" in winner[1] else 2
    carried = ["carried"] if (Path(hf_checkpoints["llama"]) / "generation_config.json").is_file() else []
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["interop.json"] + [f"model-tp{t:02d}-pp00.safetensors" for t in range(tp)] + carried)
    assert leftovers(dst) == []
    code, err, _ = cli("inspect", dst)
    assert code == 0, err


@pytest.mark.parametrize("signum, word", [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted"),
                                          (signal.SIGHUP, "hung up")])
def test_stop_signals_clean_up(hf_checkpoints, tmp_path, signum, word):
    """SIGTERM (what `kill`, systemd and batch schedulers send) cleans up exactly like Ctrl-C."""
    flags, dst = tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    proc = start("pause", flags, "paused", "convert", hf_checkpoints["llama"], dst, "--to", "interop", "-q")
    wait_for(flags / "paused", proc)
    assert len(leftovers(dst)) == 1  # the temporary sibling, mid-write
    proc.send_signal(signum)
    code = proc.wait(timeout=120)
    _, err = proc.communicate()
    assert_refused((code, err), dst, word, code=128 + signum)


def test_kill9_leftover_is_removed_by_the_next_run(hf_checkpoints, tmp_path):
    """SIGKILL cannot be caught: the temporary sibling stays, named with its owner's PID; the next
    run into the same destination sees that process is gone, removes it, and says so."""
    flags, dst = tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    proc = start("pause", flags, "paused", "convert", hf_checkpoints["llama"], dst, "--to", "interop", "-q")
    wait_for(flags / "paused", proc)
    proc.kill()
    proc.wait(timeout=60)
    proc.communicate()
    [stale] = leftovers(dst)
    assert f"-{proc.pid}-" in stale and any((tmp_path / stale).iterdir())
    code, err, out = cli("convert", hf_checkpoints["llama"], dst, "--to", "interop", "-q")
    assert code == 0, err
    assert f"note: removed {tmp_path / stale}" in out and "killed" in out
    assert leftovers(dst) == []
    assert (dst / "interop.json").is_file()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_siblings_only_of_dead_owners_on_this_host(tmp_path):
    dst = tmp_path / "out"
    host = socket.gethostname()
    names = {
        "dead": f".out.tmp-{host}-{_dead_pid()}-abcd1234",
        "alive": f".out.tmp-{host}-{os.getppid()}-abcd1234",
        "mine": f".out.tmp-{host}-{os.getpid()}-abcd1234",
        "other host": f".out.tmp-{host}x-{_dead_pid()}-abcd1234",
        "no pid": ".out.tmp-k2j3h4g5",
        "other destination": f".out2.tmp-{host}-{_dead_pid()}-abcd1234",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_bytes(b"x")
    assert remove_stale_siblings(dst) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("theirs", ["empty dir", "full dir", "file"])
def test_publish_never_replaces_what_appeared_meanwhile(tmp_path, monkeypatch, native, theirs):
    """rename(2) would silently replace an EMPTY directory that appeared meanwhile; we never do."""
    if not native:
        monkeypatch.setattr(atomic, "_renameat2", None)
    dst = tmp_path / "out"
    with pytest.raises(InteropError, match="appeared while this run was writing"):
        with atomic_directory(dst) as tmp:
            (tmp / "ours").write_text("ours")
            if theirs == "file":
                dst.write_text("theirs")
            else:
                dst.mkdir()
                if theirs == "full dir":
                    (dst / "theirs").write_text("theirs")
    assert leftovers(dst) == []
    if theirs == "file":
        assert dst.read_text() == "theirs"
    else:
        assert [p.name for p in dst.iterdir()] == ([] if theirs == "empty dir" else ["theirs"])


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_force_swaps_and_removes_the_old(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(atomic, "_renameat2", None)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old").write_text("old")
    with atomic_directory(dst, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in dst.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_replaces_a_symlink_not_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("keep")
    dst = tmp_path / "out"
    dst.symlink_to(target)
    with atomic_directory(dst, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert not dst.is_symlink() and [p.name for p in dst.iterdir()] == ["new"]
    assert (target / "keep").read_text() == "keep"
    assert leftovers(dst) == []


# ---------------------------------------------------------------- --force never deletes the input

@pytest.fixture
def interop_src(hf_checkpoints, tmp_path):
    src = tmp_path / "outer" / "ckpt"
    code, err, _ = cli("convert", hf_checkpoints["llama"], src, "--to", "interop", "--tp", "2", "-q")
    assert code == 0, err
    return src


@pytest.mark.parametrize("case", ["is the source", "contains the source", "inside the source", "symlink to the source"])
def test_force_refuses_to_delete_the_input(interop_src, tmp_path, case):
    outer = interop_src.parent
    if case == "is the source":
        dst, fragment = interop_src, "is the input"
    elif case == "contains the source":
        dst, fragment = outer, "contains the input"
    elif case == "inside the source":
        dst, fragment = interop_src / "sub", "is inside the input"
        dst.mkdir()
    else:
        dst, fragment = tmp_path / "link", "is the input"
        dst.symlink_to(interop_src)
    before = snapshot(outer)
    code, err, _ = cli("convert", interop_src, dst, "--to", "interop", "--force", "-q")
    assert_refused((code, err), None, str(dst), fragment, "--force would delete")
    assert snapshot(outer) == before
    assert leftovers(dst) == []


def test_force_refuses_to_delete_the_model_config(hf_checkpoints, tmp_path):
    """The model config is input too: a destination holding it is not deleted."""
    ms = tmp_path / "ms"
    assert cli("convert", hf_checkpoints["llama"], ms, "--to", "mindspore", "-q")[0] == 0
    bare = tmp_path / "bare.ckpt"
    shutil.copy(next(ms.rglob("*.ckpt")), bare)
    dst = tmp_path / "configs"
    dst.mkdir()
    shutil.copy(hf_checkpoints["llama"] / "config.json", dst / "config.json")
    code, err, _ = cli("convert", bare, dst, "--from", "mindspore", "--to", "hf", "--force", "-q",
                       "--model-config", dst / "config.json")
    assert_refused((code, err), None, "contains the input", "config.json")
    assert (dst / "config.json").is_file()


# ---------------------------------------------------------------- permissions

@pytest.mark.parametrize("writer, umask", [(w, 0o022) for w in sorted(WRITERS)] + [("interop", 0o077),
                                                                                    ("interop", 0o002)])
def test_output_honours_the_umask(hf_checkpoints, tmp_path, writer, umask):
    """Like `cp` and `torch.save`: directories 0777 & ~umask, files 0666 & ~umask (not mkdtemp's 0700)."""
    old = os.umask(umask)
    try:
        code, err, _ = cli("convert", hf_checkpoints["llama"], tmp_path / "out", *WRITERS[writer], *sharded(writer, "--pp"), "-q")
    finally:
        os.umask(old)
    assert code == 0, err
    out = tmp_path / "out"
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    want_dir, want_file = 0o777 & ~umask, 0o666 & ~umask
    wrong = {p: oct(m) for p, m in modes.items()
             if m != (want_dir if (tmp_path / p).is_dir() else want_file)}
    assert wrong == {}, wrong


# ---------------------------------------------------------------- disk full

class FullDisk:
    """A disk with `budget` bytes left: the write that would pass it raises ENOSPC."""

    def __init__(self, budget: int):
        self.left, self.hit = budget, False

    def spend(self, nbytes: int) -> None:
        if nbytes > self.left:
            self.hit = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= nbytes


class FullFile:
    """A file object whose write() spends from a FullDisk first."""

    def __init__(self, file, disk: FullDisk):
        self._file, self._disk = file, disk

    def write(self, data):
        self._disk.spend(memoryview(data).nbytes)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


class FullOs:
    """The `os` module as a writer module sees it, with `os.write` spending from a FullDisk first."""

    def __init__(self, disk: FullDisk):
        self._disk = disk

    def write(self, fd, data):
        self._disk.spend(memoryview(data).nbytes)
        return os.write(fd, data)

    def __getattr__(self, name):
        return getattr(os, name)


def inject_enospc(monkeypatch, disk: FullDisk) -> None:
    """Make the lowest write call of every writer spend from `disk`: files opened for writing by the
    safetensors, MindSpore .ckpt, torch_dist spool and torch file writers, kernel copies between
    safetensors files, `os.write` in our zip writer (Megatron .pt) and torch's own zip writer
    (DCP's common.pt)."""
    from interop.io import ms_ckpt, safetensors, torch_file, zipfile_writer
    from interop.converters.megatron import torch_dist

    monkeypatch.setattr(zipfile_writer, "os", FullOs(disk))

    def full_open(*args, **kwargs):
        file = builtins.open(*args, **kwargs)
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
        return FullFile(file, disk) if any(c in mode for c in "wax+") else file

    for module in (safetensors, ms_ckpt, torch_dist, torch_file):
        monkeypatch.setattr(module, "open", full_open, raising=False)
    copy_range = safetensors._copy_range

    def full_copy_range(src, dst, offset, nbytes):
        disk.spend(nbytes)
        return copy_range(src, dst, offset, nbytes)

    monkeypatch.setattr(safetensors, "_copy_range", full_copy_range)
    real_writer = torch._C.PyTorchFileWriter

    class FullZipWriter:
        def __init__(self, *args):
            self._zip = real_writer(*args)

        def write_record(self, name, data, nbytes):
            disk.spend(nbytes)
            return self._zip.write_record(name, data, nbytes)

        def __getattr__(self, name):
            return getattr(self._zip, name)

    monkeypatch.setattr(torch._C, "PyTorchFileWriter", FullZipWriter)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_enospc_in_every_writer(hf_checkpoints, tmp_path, monkeypatch, writer):
    """ENOSPC midway through the output: one `error:` line naming the trouble, exit 1 (the machine's
    trouble, not the input's), no destination, no temporary directory."""
    disk = FullDisk(300_000)  # the output is ~0.9 MB
    inject_enospc(monkeypatch, disk)
    dst = tmp_path / "out"
    code, err, _ = cli("convert", hf_checkpoints["llama"], dst, *WRITERS[writer], *sharded(writer, "--tp"), "-q")
    assert disk.hit, "the injected full disk was never reached"
    assert_refused((code, err), dst, "No space left on device", code=1)
    assert list(tmp_path.iterdir()) == []


def _mount_namespace() -> list[str] | None:
    """The `unshare` prefix that gives a private mount namespace where tmpfs can be mounted, or None."""
    if not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k none /mnt 2>/dev/null || "
                                "mount -t tmpfs -o size=64k none /tmp"], capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


NAMESPACE = _mount_namespace()


@pytest.mark.skipif(NAMESPACE is None, reason="cannot mount a tmpfs here (no root, no user namespaces)")
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_real_full_disk(hf_checkpoints, tmp_path, writer):
    """A real 400 KB tmpfs (the output is ~0.9 MB), in a private mount namespace: one line, exit 1,
    and the filesystem is empty again afterwards."""
    mnt, report = tmp_path / "mnt", tmp_path / "report"
    mnt.mkdir()
    report.mkdir()
    script = (f'mount -t tmpfs -o size=400k none "{mnt}" || exit 99\n'
              f'"{sys.executable}" -m interop convert "{hf_checkpoints["llama"]}" "{mnt}/out" '
              f'{" ".join(WRITERS[writer])} -q\n'
              f'echo $? > "{report}/rc"\n'
              f'ls -A "{mnt}" > "{report}/ls"\n'
              f'df -k "{mnt}" | tail -1 | awk \'{{print $3}}\' > "{report}/used"\n')
    proc = subprocess.run([*NAMESPACE, "sh", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    code = int((report / "rc").read_text())
    assert_one_line_error(code, proc.stderr, 1, "No space left on device")
    assert (report / "ls").read_text() == "", "left on the full disk: " + (report / "ls").read_text()
    assert int((report / "used").read_text()) == 0



def test_sigterm_stops_a_training_run_and_its_ranks(tmp_path):
    """`interop train` launching its own ranks: SIGTERM stops the ranks too, then the launcher exits
    143 with one line (it must not wait forever for ranks that keep training)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("arch: llama\nnum_layers: 2\nhidden: 32\nffn_hidden: 64\nheads: 4\nkv_groups: 2\nhead_dim: 8\n"
                    "vocab: 120\npadded_vocab: 128\nmax_positions: 64\nnorm: rmsnorm\nnorm_eps: 1.0e-5\n"
                    "activation: swiglu\nposition: rope\n")
    proc = subprocess.Popen([sys.executable, "-m", "interop", "train", "--init-spec", str(spec), "--save",
                             str(tmp_path / "run"), "--tp", "2", "--steps", "1000000", "--log-interval", "1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline(), "training never started"  # a step line: the ranks are running
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert_one_line_error(code, err, 128 + signal.SIGTERM, "terminated")
