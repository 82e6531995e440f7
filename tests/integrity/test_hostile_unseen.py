"""Exact: nothing in a damaged or mislabelled Megatron checkpoint is dropped or passed through unseen.

- A tied embedding's last-stage copy is compared with the embedding: an untied head whose args say tied is one
  line naming `--model-config` (it was dropped, giving an HF model without `lm_head`, exit 0); at pp 1 the
  output layer the args cannot place names the same flag, and that flag reads it.
- Optimizer state held by some rank files and not others is a note (all 78 moments were lost silently).
- Bytes copied file to file (the fast path to HF) are CRC-checked like bytes read: a flipped byte in a
  rank file's record or a `.distcp` chunk is one line and no output (it was exit 0 with the flipped value).
- A tensor-parallel rank folder that is a copy of rank 0's (every split tensor byte-identical, by the
  records' CRC-32s) is refused; `--allow-identical-ranks` reads it, noted.
- `distrib_optim.pt`: a flipped byte in its flat buffers fails their CRC-32 (records read in parts are
  checked whole); a buffer cut short is one line (was a RuntimeError traceback).
"""
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from helpers.hostile import assert_refused, cli, run
from helpers.specs import LLAMA, write_spec

DISTOPT = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "0.12.3" / "distopt" / "torch"


@pytest.fixture(scope="module")
def sources(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("unseen")
    hf = hf_checkpoints["llama"]
    for name, *args in (("pp2", "--to", "megatron", "--tp", "2", "--pp", "2"), ("pp1", "--to", "megatron"),
                        ("dist", "--to", "megatron", "--format", "torch_dist", "--tp", "2")):
        code, out = run("convert", hf, root / name, *args)
        assert code == 0, out
    return {**{n: root / n for n in ("pp2", "pp1", "dist")}, "hf": hf}


def _copy(src, tmp_path, name="src"):
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def _say_tied(root):
    for f in root.rglob("model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)  # files this test wrote
        obj["args"].untie_embeddings_and_output_weights = False
        torch.save(obj, f)


def test_untied_head_in_a_checkpoint_whose_args_say_tied(sources, tmp_path):
    src = _copy(sources["pp2"], tmp_path)
    _say_tied(src)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "output_layer.weight", "differs from embedding.word_embeddings.weight", "--model-config")
    code, out = run("convert", src, tmp_path / "fixed", "--to", "hf", "--model-config",
                    sources["hf"] / "config.json")
    assert code == 0, out
    from safetensors.torch import load_file
    got, want = load_file(tmp_path / "fixed" / "model.safetensors"), load_file(sources["hf"] / "model.safetensors")
    assert torch.equal(got["lm_head.weight"], want["lm_head.weight"])


def test_output_layer_at_pp1_whose_args_say_tied_names_the_flag(sources, tmp_path):
    src = _copy(sources["pp1"], tmp_path)
    _say_tied(src)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "output_layer.weight", "tied", "--model-config with tie_word_embeddings false")


def test_a_tied_model_still_drops_its_checked_copy(hf_checkpoints, tmp_path):
    assert run("convert", hf_checkpoints["llama-tied"], tmp_path / "m", "--to", "megatron", "--pp", "2")[0] == 0
    code, out = run("convert", tmp_path / "m", tmp_path / "out", "--to", "hf")
    assert code == 0 and "tied embedding (checked equal to the input embedding)" in out, out


def test_optimizer_state_in_some_rank_files_only_is_a_note(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", LLAMA)
    code, out = run("train", "--init-spec", spec, "--save", tmp_path / "run", "--steps", "1")
    assert code == 0, out
    step = next((tmp_path / "run").glob("step_*"))
    assert run("convert", step, tmp_path / "m", "--to", "megatron", "--tp", "2", "--pp", "2")[0] == 0
    first = next((tmp_path / "m").rglob("mp_rank_00_000/model_optim_rng.pt"))
    obj = torch.load(first, weights_only=False)
    del obj["optimizer"]
    torch.save(obj, first)
    code, out = run("convert", tmp_path / "m", tmp_path / "out", "--to", "interop")
    assert code == 0, out
    assert "optimizer state not converted" in out and "mp_rank_00_000" in out and "other rank files do" in out
    assert not list((tmp_path / "out").glob("optim-*"))


def _flip_record(path, index):
    """Flip one bit in the middle of the data record of `path` that is `index`-th by size."""
    with zipfile.ZipFile(path) as z:
        info = sorted((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)[index]
    assert info.CRC and info.file_size > 4096  # past the records checked whole when the file is opened
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return info.filename


@pytest.mark.parametrize("index", [-2, -3, -5])  # fc1 and qkv records: copied file to file to HF
def test_flip_in_a_record_copied_file_to_file_fails_its_crc(sources, tmp_path, index):
    src = _copy(sources["pp2"], tmp_path)
    rank = next(src.rglob("mp_rank_00_000/model_optim_rng.pt"))
    record = _flip_record(rank, index)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out", record, "CRC-32")


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_flip_in_a_distcp_chunk_copied_file_to_file_fails_its_crc(sources, tmp_path, fraction):
    src = _copy(sources["dist"], tmp_path)
    chunk = sorted(src.rglob("*.distcp"))[1]
    at = int(chunk.stat().st_size * fraction)
    with open(chunk, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out", chunk.name, "CRC-32")


def test_flip_in_distrib_optim_fails_its_crc(tmp_path):
    src = _copy(DISTOPT, tmp_path)
    optim = next(src.rglob("distrib_optim.pt"))
    record = _flip_record(optim, -1)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out",
                   "distrib_optim.pt", record, "CRC-32")


def test_distrib_optim_buffer_cut_short_is_one_line(tmp_path):
    src = _copy(DISTOPT, tmp_path)
    optim = next(src.rglob("distrib_optim.pt"))
    obj = torch.load(optim, weights_only=False)  # a real megatron-core file: the test's own copy
    cut = []

    def walk(o):
        for k, v in (o.items() if isinstance(o, dict) else []):
            if isinstance(v, dict) and isinstance(v.get("exp_avg"), torch.Tensor):
                v["exp_avg"] = v["exp_avg"][:0].clone()
                cut.append(k)
            else:
                walk(v)
    walk(obj)
    assert cut
    torch.save(obj, optim)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out",
                   "distrib_optim.pt", "exp_avg buffer holds 0 elements", "cut short")


def test_a_copied_tensor_parallel_rank_folder_is_refused(sources, tmp_path):
    src = _copy(sources["pp2"], tmp_path)
    first = next(src.rglob("mp_rank_00_001/model_optim_rng.pt"))
    shutil.copy(first, first.parent.parent / "mp_rank_01_001" / "model_optim_rng.pt")  # tp 1 replaced by tp 0
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "mp_rank_01_001", "byte-identical to tensor-parallel rank 0's", "--allow-identical-ranks")
    code, out = run("convert", src, tmp_path / "given", "--to", "hf", "--allow-identical-ranks")
    assert code == 0 and "byte-identical to tensor-parallel rank 0's (read as given" in out, out
