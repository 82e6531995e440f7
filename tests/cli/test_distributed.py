"""`torchrun ... -m interop convert`: the target files split over the ranks of a torch.distributed job (gloo,
127.0.0.1) write what one process writes; a failing or killed rank ends the job with one `error:` line naming it
and nothing left behind; two torchrun "nodes" on this machine share one destination."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from interop.convert import convert

from helpers.hostile import leftovers
from helpers.same_output import EXPERTS, _write_hf, assert_same_output

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
TIMEOUT = 300  # a heavily loaded machine: torch starts in each rank


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    _write_hf(root / "hf")
    _write_hf(root / "mixtral", experts=EXPERTS)
    convert(root / "hf", root / "ms-tp2pp2", dst_format="mindspore", tp=2, pp=2)
    _with_crc(root / "ms-tp2pp2")
    return root


def _with_crc(folder: Path) -> None:
    """Each rank file rewritten with the crc trailer MindSpore's `save_checkpoint(crc_check=True)` appends."""
    from interop.io.ms_ckpt import CkptFile, save_ckpt
    for ckpt in sorted(folder.glob("rank_*/*.ckpt")):
        with CkptFile(ckpt) as f:
            tensors = {tag: f.read(tag).clone() if not isinstance(f.read(tag), str) else f.read(tag)
                       for tag in f.keys()}
        save_ckpt(ckpt, tensors, crc=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, nproc: int, port: int, nnodes: int = 1, node_rank: int = 0, fault: str | None = None, cwd=None,
            split: bool = False):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "INTEROP_DIST_HEARTBEAT_TIMEOUT": "10"}
    target = ["-m", "interop"]
    if fault or split:
        env.update(INTEROP_TEST_FAULT=fault or "none:-1", INTEROP_TEST_SPLIT="1" if split else "")
        target = [str(HELPERS / "faulty_rank.py")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), *target,
           *map(str, args)]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc) -> tuple[str, str]:
    """Its output; past TIMEOUT the launcher and its ranks (its own process group) are killed."""
    try:
        return proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def torchrun(args, nproc: int = 2, **kw) -> tuple[int, str, str]:
    proc = _launch(args, nproc, _port(), **kw)
    out, err = _finish(proc)
    return proc.returncode, out, err


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


CASES = {  # target: (source, convert flags)
    "torch_dist": ("hf", ["--to", "megatron", "--format", "torch_dist"]),
    "megatron-torch-tp2pp2": ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
    "moe-torch_dist-ep2": ("mixtral", ["--to", "megatron", "--format", "torch_dist", "--ep", "2"]),
    "moe-mindspore-tp2pp2ep2": ("mixtral", ["--to", "mindspore", "--tp", "2", "--pp", "2", "--ep", "2"]),
    "interop-store-tp2pp2": ("hf", ["--to", "interop", "--tp", "2", "--pp", "2"]),
    "hf-sharded": ("mixtral", ["--to", "hf", "--max-shard-size", "100KB"]),
    "megatron-torch-one-file": ("hf", ["--to", "megatron"]),  # one unit: rank 1 has nothing to write
    "hf-one-file": ("mixtral", ["--to", "hf"]),
    "from-mindspore-to-torch_dist": ("ms-tp2pp2", ["--to", "megatron", "--format", "torch_dist"]),
}


def _options(flags: list[str]) -> dict:
    """The CLI flags as convert()'s keywords."""
    out, it = {}, iter(flags)
    for flag in it:
        key = flag[2:].replace("-", "_")
        value = next(it)
        out["dst_format" if key == "to" else key] = int(value) if value.isdigit() else value
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_write_the_same_bytes_as_one_process(sources, tmp_path, case):
    src, flags = CASES[case]
    convert(sources / src, tmp_path / "one", **_options(flags))
    code, out, err = torchrun(["convert", sources / src, tmp_path / "two", *flags, "-q"])
    assert code == 0, err
    assert out.count("converted ") == 1  # rank 0 reports the job, the others nothing
    assert_same_output(tmp_path / "one", tmp_path / "two")
    assert leftovers(tmp_path / "two") == []


def test_four_ranks_and_workers_compose(sources, tmp_path):
    """4 ranks over 5 torch_dist files (the last rank gets two and splits them over 2 workers): the same bytes."""
    flags = ["--to", "megatron", "--format", "torch_dist", "--ep", "2"]
    convert(sources / "mixtral", tmp_path / "one", **_options(flags))
    code, out, err = torchrun(["convert", sources / "mixtral", tmp_path / "four", *flags, "-q", "--workers", "2"],
                              nproc=4, split=True)
    assert code == 0, err
    assert out.count("workers: 2") == 1, out  # the ranks of one unit convert in their own process
    assert_same_output(tmp_path / "one", tmp_path / "four")


def test_two_nodes_share_one_destination(sources, tmp_path):
    """Two torchrun launches, node ranks 0 and 1, one rendezvous endpoint on 127.0.0.1: one process's output."""
    flags = ["--to", "megatron", "--tp", "2", "--pp", "2", "--ep", "2"]
    convert(sources / "mixtral", tmp_path / "one", **_options(flags))
    port = _port()
    args = ["convert", sources / "mixtral", tmp_path / "nodes", *flags, "-q"]
    nodes = [_launch(args, 1, port, nnodes=2, node_rank=n) for n in (0, 1)]
    outs = [_finish(p) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert_same_output(tmp_path / "one", tmp_path / "nodes")
    assert leftovers(tmp_path / "nodes") == []


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_failing_rank_ends_the_job_and_leaves_nothing(sources, tmp_path, fault):
    dst = tmp_path / "out"
    args = ["convert", sources / "hf", dst, "--to", "megatron", "--format", "torch_dist", "-q"]
    code, out, err = torchrun(args, fault=f"{fault}:1")
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "rank 1" in lines[0], err
    if fault == "raise":
        assert "injected fault" in lines[0]
    assert not dst.exists() and leftovers(dst) == []
    code, out, err = torchrun(args)  # a later run succeeds
    assert code == 0, err
    assert leftovers(dst) == []


def test_a_rank_that_does_not_see_the_source_is_named(sources, tmp_path):
    """Rank 1 runs from another directory: the relative SRC is not there for it."""
    dst = tmp_path / "out"
    code, out, err = torchrun(["convert", "hf", dst, "--to", "megatron", "--format", "torch_dist", "-q"],
                              fault="elsewhere:1", cwd=sources)
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "rank 1" in lines[0] and "does not see hf" in lines[0], err
    assert not dst.exists() and leftovers(dst) == []


def test_a_rank_killed_on_another_node_is_found_by_its_silence(sources, tmp_path):
    """Node 1's only rank is SIGKILLed; node 0's torchrun knows nothing of it: rank 0 finds the silent heartbeat
    (INTEROP_DIST_HEARTBEAT_TIMEOUT, 10 s here), prints the one error line, and the destination stays empty."""
    dst = tmp_path / "out"
    port = _port()
    args = ["convert", sources / "mixtral", dst, "--to", "megatron", "--tp", "2", "--pp", "2", "-q"]
    nodes = [_launch(args, 1, port, nnodes=2, node_rank=n, fault="kill:1") for n in (0, 1)]
    outs = [_finish(p) for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    lines = error_lines(outs[0][1] + outs[1][1])
    assert len(lines) == 1 and "rank 1" in lines[0] and "stopped answering" in lines[0], outs
    assert not dst.exists() and leftovers(dst) == []


def test_ctrl_c_on_the_launcher_cleans_up(sources, tmp_path):
    """SIGINT to torchrun while rank 1 is mid-way: torchrun stops its ranks, one error line, nothing left."""
    import time
    dst = tmp_path / "out"
    proc = _launch(["convert", sources / "hf", dst, "--to", "megatron", "--format", "torch_dist", "-q"], 2, _port(),
                   fault="hang:1")
    assert proc.stdout.readline().strip() == "hanging"  # rank 1 is inside its units, the temporary directory made
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert proc.returncode != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "rank " in lines[0], err
    assert not dst.exists() and leftovers(dst) == []


def _damage(ckpt: Path) -> None:
    """One byte of tensor data changed: the file still indexes, its crc trailer no longer matches."""
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))


def test_the_ranks_share_the_source_checks(sources, tmp_path):
    """Each rank checks the crc of its share of a MindSpore source's files (one read of the source in all, not
    one per rank): a damaged rank_3 file is rank 1's to find (files 0-3 over 2 ranks: 1 and 3 are rank 1's)."""
    import shutil
    from interop.converters.mindspore.reader import Reader
    src = tmp_path / "ms"
    shutil.copytree(sources / "ms-tp2pp2", src)
    damaged = sorted(src.glob("rank_3/*.ckpt"))[0]
    _damage(damaged)
    Reader(src, verify_share=(0, 2)).close()  # rank 0's share (rank_0, rank_2) is sound: it never reads rank_3
    with pytest.raises(Exception, match="crc check failed"):
        Reader(src, verify_share=(1, 2))
    dst = tmp_path / "out"
    code, out, err = torchrun(["convert", src, dst, "--to", "hf", "-q"])
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "rank 1" in lines[0] and "crc check failed" in lines[0], err
    assert not dst.exists() and leftovers(dst) == []


def test_convert_then_verify_under_torchrun(tmp_path):
    """`--verify` under torchrun: rank 0 verifies the job's output once, its frameworks (megatron-core's own gloo
    world) started clear of the torchrun job's store; the other ranks end after converting."""
    from helpers.hf_models import save
    save("llama", tmp_path / "hf")
    code, out, err = torchrun(["convert", tmp_path / "hf", tmp_path / "meg", "--to", "megatron", "--tp", "2",
                               "--verify", "-q"])
    assert code == 0, err[-3000:]
    assert out.startswith("converted ") and out.count("\nverify ") == 1, out
    assert ": OK" in out, out
