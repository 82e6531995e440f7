"""Exact: a rank file that is a copy of another rank's is refused, in every sharded source.

Two ranks of a split tensor hold different shards; a checkpoint whose rank file was replaced by a copy of
another's (a damaged or hand-assembled folder) would be read as a model with one shard twice.  Each case here
copies a real rank file over another and expects one `error:` line naming both files and
`--allow-identical-ranks` (exit 2, nothing written); the flag reads it as given, noted.

- Megatron torch, expert parallel: an `mp_rank_TT_EEE` folder replaced by another EP rank's (its routed experts
  all byte-identical, by the zip records' CRC-32s; the dense tensors every EP rank holds are copies anyway).
- MindSpore (MindSpeed-Core-MS `rank_N/network.ckpt`, MindFormers `rank_N/checkpoint_N.ckpt`): tensor-parallel
  and expert-parallel rank files; by the `crc_num` trailer and size where the files carry one (nothing read),
  else by 4 KiB of each file's first split tensor and, where those agree, tensor by tensor.
- DeepSpeed pipeline: a `layer_XX-model_YY-model_states.pt` replaced by another tp rank's.
(The Megatron tensor-parallel case is in test_hostile_unseen.py.)
"""
import shutil
from pathlib import Path

import pytest

from helpers.hostile import assert_refused, cli, run

FLAG = "--allow-identical-ranks"
DEEPSPEED = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from helpers.moe_models import hf_model
    root = tmp_path_factory.mktemp("copied-ranks")
    hf_model("mixtral").save_pretrained(root / "hf")
    return root / "hf"


def _converted(src, dst, *args):
    code, out = run("convert", src, dst, *args, "-q")
    assert code == 0, out
    return dst


def _refused_then_allowed(src, tmp_path, copy, original, *words):
    """The copy is refused naming both files and the flag; with the flag it converts, noted."""
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   str(copy), str(original), "byte-identical", FLAG, *words)
    code, out = run("convert", src, tmp_path / "given", "--to", "hf", FLAG)
    assert code == 0 and "byte-identical to" in out and f"(read as given: {FLAG})" in out, out


def test_megatron_expert_parallel_folder_copied(mixtral, tmp_path):
    src = _converted(mixtral, tmp_path / "src", "--to", "megatron", "--tp", "2", "--ep", "2")
    ep0, ep1 = (next(src.rglob(f"mp_rank_01_00{e}")) / "model_optim_rng.pt" for e in (0, 1))
    shutil.copy(ep0, ep1)
    _refused_then_allowed(src, tmp_path, ep1, ep0, "every routed expert", "expert-parallel rank 0's")


def test_megatron_expert_parallel_folders_distinct_convert(mixtral, tmp_path):
    """The check cannot fire on a genuine checkpoint: its EP ranks hold the same dense tensors (copies)."""
    src = _converted(mixtral, tmp_path / "src", "--to", "megatron", "--tp", "2", "--ep", "2")
    code, out = run("convert", src, tmp_path / "back", "--to", "hf")
    assert code == 0 and "byte-identical" not in out, out


def _add_crc_trailers(root):
    """Every rank file rewritten as `mindspore.save_checkpoint(crc_check=True)` writes it (a crc_num trailer)."""
    from interop.io.ms_ckpt import load_ckpt, save_ckpt
    for f in root.rglob("*.ckpt"):
        save_ckpt(f, load_ckpt(f), crc=True)


@pytest.mark.parametrize("trailer", [False, True], ids=["no-trailer", "crc-trailer"])
@pytest.mark.parametrize("dialect", ["mindspeed", "mindformers"])
def test_mindspore_tensor_parallel_rank_file_copied(hf_checkpoints, tmp_path, dialect, trailer):
    src = _converted(hf_checkpoints["llama"], tmp_path / "src", "--to", "mindspore", "--dialect", dialect,
                     "--tp", "2", "--pp", "2")
    (src / "mindspore_model.json").unlink()  # as MindSpeed / MindFormers leave it: the files say the layout
    if trailer:
        _add_crc_trailers(src)
    files = sorted(src.rglob("rank_*/*.ckpt"), key=lambda f: int(f.parent.name[5:]))
    assert len(files) == 4
    shutil.copy(files[2], files[3])  # stage 1's tp rank 1 replaced by its tp rank 0
    what = "the whole file (crc_num trailer and size)" if trailer else "every split tensor"
    config = ["--model-config", hf_checkpoints["llama"] / "config.json"]
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf", *config), tmp_path / "out",
                   str(files[3]), str(files[2]), what, "tensor-parallel rank 0's", FLAG)
    code, out = run("convert", src, tmp_path / "given", "--to", "hf", *config, FLAG)
    assert code == 0 and f"(read as given: {FLAG})" in out, out


def test_mindspeed_expert_parallel_rank_file_copied(mixtral, tmp_path):
    src = _converted(mixtral, tmp_path / "src", "--to", "mindspore", "--ep", "2", "--dp", "2")
    (src / "mindspore_model.json").unlink()
    files = sorted(src.rglob("rank_*/*.ckpt"), key=lambda f: int(f.parent.name[5:]))
    shutil.copy(files[0], files[1])  # ep rank 1 (rank_1) replaced by ep rank 0's file
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf", "--model-config", mixtral / "config.json"),
                   tmp_path / "out", str(files[1]), str(files[0]), "every routed expert", "expert-parallel rank 0's",
                   FLAG)


def test_mindspore_genuine_ranks_read_few_bytes(hf_checkpoints, tmp_path, monkeypatch):
    """Without trailers a genuine checkpoint costs one 4 KiB read per rank file and no full comparison."""
    from interop.io import ms_ckpt
    src = _converted(hf_checkpoints["llama"], tmp_path / "src", "--to", "mindspore", "--tp", "2", "--pp", "2")
    compared = []
    monkeypatch.setattr(ms_ckpt.CkptFile, "same_bytes", lambda *a, **k: compared.append(a) or False)
    code, out = run("convert", src, tmp_path / "back", "--to", "hf")
    assert code == 0 and "byte-identical" not in out and compared == [], out


def test_deepspeed_layer_file_copied(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DEEPSPEED, src)
    rank0, rank1 = (src / "global_step1" / f"layer_03-model_0{t}-model_states.pt" for t in (0, 1))
    shutil.copy(rank0, rank1)
    _refused_then_allowed(src, tmp_path, rank1, rank0, "every split tensor", "tensor-parallel rank 0's")
