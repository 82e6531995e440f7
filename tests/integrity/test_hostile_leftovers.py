"""Atomic and nothing lost: a run that fails leaves nothing it made.

- A destination under missing parents: the parents the run created go with its temporary directory
  (`out/a/b/model` refused mid-way left `out/a/b`).
- `train --data` with out-of-vocabulary ids: one line, and the `--save` folder the run created is removed
  (it was left, empty).
- `convert --workers 2` with one worker SIGKILLed mid-way (as the OOM killer would): one `error:` line naming
  the worker and the signal, exit 2, no destination and no temporary sibling.
"""
import dataclasses
import shutil
import struct
import zipfile

import numpy as np
import pytest

import interop.workers as parallel
from helpers.hostile import assert_one_error, assert_refused, cli, leftovers, run
from helpers.killed_worker import KilledInOneWorker
from helpers.specs import LLAMA, write_spec


def _flip_a_copied_record(rank_file):
    with zipfile.ZipFile(rank_file) as z:
        info = sorted((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)[-2]
    with open(rank_file, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_missing_parents_made_by_a_failed_run_are_removed(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "megatron", "--tp", "2", "--pp", "2")[0] == 0
    _flip_a_copied_record(next(src.rglob("mp_rank_00_000/model_optim_rng.pt")))  # found while writing
    (tmp_path / "out").mkdir()
    dst = tmp_path / "out" / "a" / "b" / "model"
    assert_refused(cli("convert", src, dst, "--to", "hf"), dst, "CRC-32")
    assert list((tmp_path / "out").iterdir()) == []  # no out/a/b left behind; out/ was there before


def test_out_of_vocabulary_data_leaves_no_run_folder(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", LLAMA)
    np.save(tmp_path / "tokens.npy", np.full(4096, LLAMA["vocab"] + 7, dtype=np.int32))
    code, stderr, _ = cli("train", "--init-spec", spec, "--save", tmp_path / "run", "--steps", "2",
                          "--data", tmp_path / "tokens.npy")
    assert_refused((code, stderr), tmp_path / "run", "outside the vocabulary", f"[0, {LLAMA['vocab']})")


def test_an_existing_save_folder_is_kept_when_the_run_fails(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", LLAMA)
    np.save(tmp_path / "tokens.npy", np.full(4096, LLAMA["vocab"] + 7, dtype=np.int32))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mine.txt").write_text("the user's")
    code, _, _ = cli("train", "--init-spec", spec, "--save", tmp_path / "run", "--steps", "2",
                     "--data", tmp_path / "tokens.npy")
    assert code == 2 and (tmp_path / "run" / "mine.txt").read_text() == "the user's"


def test_a_worker_killed_midway_leaves_nothing_and_one_line(hf_checkpoints, tmp_path, monkeypatch):
    src = tmp_path / "store"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "interop", "--tp", "2", "--pp", "2")[0] == 0
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)  # a tiny model splits
    real, started = parallel.run, []

    def killing(tasks, *args, **kwargs):  # the workers open the source with a reader that dies mid-way
        started.append(len(tasks))
        tasks = [dataclasses.replace(t, reader_cls=KilledInOneWorker,
                                     reader_options=dict(t.reader_options, kill_flag=str(tmp_path / "killed")))
                 for t in tasks]
        return real(tasks, *args, **kwargs)

    monkeypatch.setattr(parallel, "run", killing)
    dst = tmp_path / "out"
    assert_one_error(*run("convert", src, dst, "--to", "megatron", "--tp", "2", "--pp", "2", "--workers", "2"),
                     "was killed by signal 9")
    assert started == [2] and (tmp_path / "killed").exists()
    assert not dst.exists() and leftovers(dst) == []
