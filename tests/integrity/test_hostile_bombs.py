"""Bounded: small inputs that stand for huge ones are refused in one line, in seconds and a few hundred MB.

Each case is a file of a few MB at most that a naive reader would expand into GBs or minutes: a DEFLATE
bomb in a torch.save zip (a Megatron rank file, `pytorch_model.bin`, a torch_dist `common.pt`, a DeepSpeed
engine file, a `.distcp` chunk whose directory declares the GiB or only the tensor's bytes), a `.ckpt`
with a million scalar Values appended, a safetensors header claiming 80 MB, a config asking for a million
experts, a YAML "billion laughs", a launch script whose variable doubles 40 times, a `--moe-layer-freq`
product of 3 billion layers.  Each run is a fresh interpreter whose own peak RSS (`wait4`) is asserted:
importing torch alone takes ~300 MiB, the bombs would take 3 GiB to 22 GiB.

Limits (docs/guarantees.md "Bounded"): compressed zip records expand at most 64x + 64 MiB (a `.distcp`
chunk's at most to its tensor's bytes + 1 MiB, and inflate to what they declare, CRC-32 checked); a `.ckpt` holds
at most 10,000 scalars and 1,000,000 Values; a safetensors header at most 16 MiB; at most 262,144 experts
over a model's MoE layers; YAML aliases expand to at most max(1,000,000, 2 x the text) values and
characters; a launch script's expansions at most 16 MiB; a `--moe-layer-freq` list at most 100,000 layers.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.bombs import append_scalars, deflate_bomb_pt, deflate_bomb_tensor, oversized_record_tensor
from helpers.hostile import assert_refused, cli_measured, run
from helpers.moe_models import hf_model

PEAK_MIB = 1024  # a refused bomb's whole process, torch included
SECONDS = 90  # the refusal itself is well under a second; a fresh interpreter on a shared CPU is not


def assert_bounded(result, dst, *words):
    code, stderr, seconds, peak = result
    assert_refused((code, stderr), dst, *words)
    assert seconds < SECONDS, f"took {seconds:.1f} s, over the {SECONDS} s bound"
    assert peak < PEAK_MIB, f"peak RSS {peak:.0f} MiB, over the {PEAK_MIB} MiB bound"


@pytest.fixture(scope="module")
def sources(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bomb-sources")
    hf = hf_checkpoints["llama"]
    for name, *args in (("torch", "--to", "megatron"), ("dist", "--to", "megatron", "--format", "torch_dist"),
                        ("ms", "--to", "mindspore")):
        code, out = run("convert", hf, root / name, *args)
        assert code == 0, out
    return {"torch": root / "torch", "dist": root / "dist", "ms": root / "ms", "hf": hf}


def _copy(src, tmp_path):
    shutil.copytree(src, tmp_path / "src")
    return tmp_path / "src"


def test_deflate_bomb_in_a_megatron_rank_file(sources, tmp_path):
    src = _copy(sources["torch"], tmp_path)
    rank = next(src.rglob("model_optim_rng.pt"))
    deflate_bomb_pt(rank, rank, gib=3)
    assert rank.stat().st_size < 32 << 20
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "model_optim_rng.pt", "expand", "64x", "DEFLATE bomb")


def test_deflate_bomb_in_pytorch_model_bin(sources, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(sources["hf"] / "config.json", src)
    from safetensors.torch import load_file
    torch.save(load_file(sources["hf"] / "model.safetensors"), tmp_path / "plain.bin")
    deflate_bomb_pt(tmp_path / "plain.bin", src / "pytorch_model.bin", gib=3)
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out",
                   "pytorch_model.bin", "64x", "DEFLATE bomb")


def test_deflate_bomb_in_torch_dist_common_pt(sources, tmp_path):
    src = _copy(sources["dist"], tmp_path)
    common = next(src.rglob("common.pt"))
    deflate_bomb_pt(common, common, gib=3)
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "common.pt", "64x", "DEFLATE bomb")


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("layout", ["deepspeed/global_step1", "deepspeed_zero/z1_fp32/checkpoint-2/global_step2"],
                         ids=["pipeline", "hf-engine"])
def test_deflate_bomb_in_a_deepspeed_engine_file(tmp_path, layout):
    top = layout.split("/")[0]
    shutil.copytree(FIXTURES / top, tmp_path / top)
    engine = tmp_path / layout / "mp_rank_00_model_states.pt"
    deflate_bomb_pt(engine, engine, gib=3)
    src = engine.parent.parent
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   "mp_rank_00_model_states.pt", "64x", "DEFLATE bomb")


def _bomb_a_distcp_chunk(folder, declared: str) -> str:
    """The embedding's first chunk in DCP folder `folder` replaced by a `deflate_bomb_tensor` appended to its
    `.distcp` file; returns its key."""
    import pickle
    from interop.io.dcp_metadata import MetadataIndex
    from interop.io.megatron_dist import _MetadataUnpickler
    meta = folder / ".metadata"
    with open(meta, "rb") as f:
        md = _MetadataUnpickler(f).load()
    key = next(k for k in md.state_dict_metadata if "embed" in k and k.endswith("weight"))
    entry = md.state_dict_metadata[key]
    chunk = entry.chunks[0]
    info = md.storage_data[MetadataIndex(key, chunk.offsets)]
    bomb = oversized_record_tensor(tuple(chunk.sizes), entry.properties.dtype) if declared == "oversized" else \
        deflate_bomb_tensor(tuple(chunk.sizes), entry.properties.dtype, gib=3, declared=declared)
    distcp = folder / info.relative_path
    info.offset, info.length = distcp.stat().st_size, len(bomb)
    with open(distcp, "ab") as f:
        f.write(bomb)
    meta.write_bytes(pickle.dumps(md))
    return key


@pytest.mark.parametrize("declared,words", [("huge", ("64x", "DEFLATE bomb")),
                                            ("oversized", ("compressed records declare", "DEFLATE bomb")),
                                            ("small", ("Bad CRC-32", "damaged"))])
@pytest.mark.parametrize("source", ["torch_dist", "fsdp_dcp"])
def test_deflate_bomb_in_a_distcp_chunk(sources, tmp_path, source, declared, words):
    """The slow path (a chunk whose record is compressed is loaded by torch, not copied by its byte range), in a
    Megatron torch_dist checkpoint and in accelerate's FSDP DCP (a real one: tests/fixtures/fsdp_dcp): a
    directory declaring 3 GiB is refused before torch allocates them; one declaring only the tensor's bytes over
    a 3 GiB stream is inflated to those and fails its CRC-32 (torch would take the zeros); a compressed record
    of 8 MiB of random values (no bomb by ratio) is held to the chunk's tensor bytes `.metadata` records."""
    if source == "torch_dist":
        src = _copy(sources["dist"], tmp_path)
        folder = src / "release"
    else:
        src = tmp_path / "src"
        shutil.copytree(FIXTURES / "fsdp_dcp", src)
        folder = src / "pytorch_model_fsdp_0"
    key = _bomb_a_distcp_chunk(folder, declared)
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   ".distcp", key, *words)


def test_ckpt_with_a_million_scalars_appended(sources, tmp_path):
    src = _copy(sources["ms"], tmp_path)
    ckpt = next(src.rglob("*.ckpt"))
    append_scalars(ckpt, 1_000_000)  # 28 MB; indexed whole: ~35 s and 2 GB
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   ckpt.name, "more than 10,000 scalars")


def test_safetensors_header_of_80_mb(sources, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(sources["hf"] / "config.json", src)
    with open(src / "model.safetensors", "wb") as f:  # sparse: the length field is what is refused
        f.write((80_000_000).to_bytes(8, "little") + b'{"')
        f.truncate(8 + 80_000_000 + 4096)
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out",
                   "model.safetensors", "80,000,000", "16,777,216")


def test_a_million_experts_in_a_config(tmp_path):
    src = tmp_path / "src"
    hf_model("mixtral").save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config["num_local_experts"] = 1_000_000  # tables of 6 million rows: minutes and ~5 GB before
    (src / "config.json").write_text(json.dumps(config))
    assert_bounded(cli_measured("convert", src, tmp_path / "out", "--to", "megatron"), tmp_path / "out",
                   "num_experts 1,000,000", "262,144")


LAUGHS = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("where", ["top", "value"])
def test_yaml_billion_laughs(tmp_path, where):
    doc = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + LAUGHS
    body = ("training_config:\n  seed: 42\nmodel_config:\n  num_layers: *i\n" if where == "value"
            else "training_config:\n  seed: 42\nmodel_config:\n  num_layers: 2\n")
    path = tmp_path / "pretrain.yaml"
    path.write_text(doc + body)
    assert_bounded(cli_measured("map-args", path, "--to", "megatron", "-o", tmp_path / "out.sh"),
                   tmp_path / "out.sh", "aliases", "1,000,000")


def test_yaml_billion_laughs_in_a_train_spec(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text('a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + LAUGHS +
                    "arch: llama\n")
    assert_bounded(cli_measured("train", "--init-spec", path, "--save", tmp_path / "run", "--steps", "1"),
                   tmp_path / "run", "aliases")


def test_launch_script_variable_doubling(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text('A=x\n' + 'A="$A$A"\n' * 40 + 'torchrun pretrain_gpt.py --num-layers 2 --data-path "$A"\n')
    assert_bounded(cli_measured("map-args", path, "--to", "mindspeed", "-o", tmp_path / "out.yaml"),
                   tmp_path / "out.yaml", "16 MiB", "$A")


def test_moe_layer_freq_product_is_not_built(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
                    "--seq-length 64 --max-position-embeddings 64 --num-experts 8 "
                    "--moe-layer-freq '([1]*99999)*30000'\n")
    code, stderr, seconds, peak = cli_measured("map-args", path, "--to", "mindspeed", "-o", tmp_path / "out.yaml")
    assert seconds < SECONDS and peak < PEAK_MIB, (seconds, peak)  # 59 s and 22 GB before
    assert code == 0 and "Traceback" not in stderr, stderr
    assert "unmapped: --moe-layer-freq='([1]*99999)*30000'" in stderr  # not read as a pattern: said so
