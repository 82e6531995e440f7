"""interop.io.megatron_dist: torch_dist checkpoints with plain torch.

Most tests need only torch; the last ones read what real megatron-core wrote and show that
megatron-core's own `dist_checkpointing.load` accepts what this module writes.
"""
import argparse
import json
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from interop.errors import InteropError
from interop.io.megatron_dist import (BACKEND_CONFIG, DistCheckpoint, DistWriter, LazyTensor, checkpoint_dir, is_stacked,
                                      write_dist_checkpoint)

QKV = "decoder.layers.self_attention.linear_qkv.weight"
EMB = "embedding.word_embeddings.weight"
NORM = "decoder.final_layernorm.weight"


def tensors(layers=3):
    g = torch.Generator().manual_seed(0)
    return {EMB: torch.randn(16, 8, generator=g),
            QKV: torch.randn(layers, 12, 8, generator=g),
            "decoder.layers.mlp.linear_fc1.weight": torch.randn(layers, 10, 8, generator=g).to(torch.bfloat16),
            NORM: torch.randn(8, generator=g)}


@pytest.fixture
def written(tmp_path):
    want = tensors()
    common = {"args": argparse.Namespace(num_layers=3, hidden_size=8), "iteration": 7, "checkpoint_version": 3.0}
    objects = {f"decoder.layers.mlp.linear_fc1._extra_state/shard_{i}_3": None for i in range(3)}
    write_dist_checkpoint(tmp_path / "ckpt", want.items(), common=common, objects=objects)
    return tmp_path / "ckpt", want, objects


def test_round_trip(written):
    path, want, objects = written
    ckpt = DistCheckpoint(path)
    assert ckpt.config == BACKEND_CONFIG
    assert json.loads((path / "metadata.json").read_text()) == BACKEND_CONFIG
    assert ckpt.common["iteration"] == 7 and vars(ckpt.common["args"]) == {"num_layers": 3, "hidden_size": 8}
    assert ckpt.keys() == list(want) and ckpt.objects() == list(objects)
    for key, t in want.items():
        assert ckpt.meta(key) == (t.dtype, tuple(t.shape))
        got = ckpt.read(key)
        assert got.dtype == t.dtype and torch.equal(got, t)
    for layer in range(3):
        assert torch.equal(ckpt.read(QKV, layer), want[QKV][layer])


def test_stacked_keys_are_stored_one_chunk_per_layer(written):
    """As megatron-core stores them: a layer can be read without reading the others."""
    path, want, _ = written
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert [(list(c.offsets), list(c.sizes)) for c in md[QKV].chunks] == [([i, 0, 0], [1, 12, 8]) for i in range(3)]
    assert [(list(c.offsets), list(c.sizes)) for c in md[EMB].chunks] == [([0, 0], [16, 8])]


def test_a_layer_read_touches_only_its_chunk(written):
    """Damage layer 2's stored bytes: layers 0 and 1 still read, layer 2 fails with a clear error."""
    path, want, _ = written
    meta = FileSystemReader(str(path)).read_metadata()
    info = next(v for k, v in meta.storage_data.items() if k.fqn == QKV and k.offset[0] == 2)
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\0" * info.length)
    ckpt = DistCheckpoint(path)
    assert torch.equal(ckpt.read(QKV, 0), want[QKV][0]) and torch.equal(ckpt.read(QKV, 1), want[QKV][1])
    with pytest.raises(InteropError, match="cannot read"):
        ckpt.read(QKV, 2)


def test_lazy_tensors_are_loaded_a_layer_at_a_time(tmp_path):
    want, calls = tensors(), []

    def load(key):
        def fn(layer):
            calls.append((key, layer))
            return want[key] if layer is None else want[key][layer]
        return fn

    items = [(k, LazyTensor(t.dtype, tuple(t.shape), load(k))) for k, t in want.items()]
    write_dist_checkpoint(tmp_path / "ckpt", items)
    assert sorted(calls, key=str) == sorted([(EMB, None), (NORM, None)] + [(k, i) for k in want if is_stacked(k)
                                                                           for i in range(3)], key=str)
    ckpt = DistCheckpoint(tmp_path / "ckpt")
    assert ckpt.common == {} and all(torch.equal(ckpt.read(k), t) for k, t in want.items())


def test_lazy_tensor_of_the_wrong_shape_is_refused(tmp_path):
    bad = LazyTensor(torch.float32, (4, 8), lambda layer: torch.zeros(4, 9))
    with pytest.raises(ValueError, match="planned"):
        write_dist_checkpoint(tmp_path / "ckpt", [(EMB, bad)])


def test_is_stacked():
    assert is_stacked(QKV) and is_stacked("optimizer.state.exp_avg." + QKV)
    assert not is_stacked("decoder.layers.0.self_attention.linear_qkv.weight") and not is_stacked(EMB)


def test_checkpoint_dir_follows_the_tracker(written, tmp_path):
    path, _, _ = written
    save = tmp_path / "save"
    save.mkdir()
    os.rename(path, save / "iter_0000007")
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert checkpoint_dir(save) == save / "iter_0000007"
    assert checkpoint_dir(save, iteration=7) == save / "iter_0000007"
    assert checkpoint_dir(save / "iter_0000007") == save / "iter_0000007"
    with pytest.raises(InteropError, match="iter_0000003"):
        checkpoint_dir(save, iteration=3)
    (save / "latest_checkpointed_iteration.txt").write_text("seven")
    with pytest.raises(InteropError, match="expected an iteration number"):
        checkpoint_dir(save)
    with pytest.raises(InteropError, match="neither a torch_dist checkpoint"):
        checkpoint_dir(tmp_path / "nothing")


def test_other_backends_are_refused(written):
    path, _, _ = written
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(InteropError, match="zarr"):
        DistCheckpoint(path)
    (path / "metadata.json").write_text("{not json")
    with pytest.raises(InteropError, match="not valid JSON"):
        DistCheckpoint(path)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_hostile_metadata_pickle_is_refused_and_never_run(written, tmp_path, monkeypatch):
    path, _, _ = written
    monkeypatch.chdir(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(InteropError, match="not a readable DCP metadata file"):
        DistCheckpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_missing_data_file_is_a_clear_error(written):
    path, _, _ = written
    for f in path.glob("*.distcp"):
        f.unlink()
    with pytest.raises(InteropError, match=f"cannot read {EMB}"):
        DistCheckpoint(path).read(EMB)


def test_unknown_key_and_layer(written):
    path, _, _ = written
    ckpt = DistCheckpoint(path)
    with pytest.raises(InteropError, match="no tensor named"):
        ckpt.read("nope")
    with pytest.raises(InteropError, match="no layer 3"):
        ckpt.read(QKV, 3)


def test_destination_must_be_empty(written):
    path, want, _ = written
    with pytest.raises(InteropError, match="not empty"):
        write_dist_checkpoint(path, want.items())


# --- against real megatron-core ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    import helpers.megatron_ref as megatron_ref
    return megatron_ref.reference_once(tmp_path_factory)


def test_what_mcore_writes_reads_as_the_legacy_ranks_merged(ref):
    """Real mcore layout (tp 2): stacked layers, norms under TE names, fc1 globally [gate; up]."""
    import helpers.megatron_ref as R

    root, _ = ref
    ckpt = DistCheckpoint(R.dist_dir(root, "llama", 2) / "iter_0000001")
    ranks = [torch.load(R.legacy_dir(root, "llama", 2) / "iter_0000001" / f"mp_rank_0{t}" / "model_optim_rng.pt",
                        weights_only=False)["model"] for t in range(2)]
    assert ckpt.common["iteration"] == 1 and ckpt.common["args"].ckpt_format == "torch_dist"
    assert "rng_state/shard_0.0_1.2" in ckpt.objects()
    for i in range(R.DIMS["llama"]["num_layers"]):
        p = f"decoder.layers.{i}."
        assert torch.equal(ckpt.read(QKV, i), torch.cat([r[p + "self_attention.linear_qkv.weight"] for r in ranks]))
        assert torch.equal(ckpt.read("decoder.layers.self_attention.linear_proj.weight", i),
                           torch.cat([r[p + "self_attention.linear_proj.weight"] for r in ranks], dim=1))
        halves = [r[p + "mlp.linear_fc1.weight"].chunk(2) for r in ranks]  # each rank: [gate_r; up_r]
        assert torch.equal(ckpt.read("decoder.layers.mlp.linear_fc1.weight", i),
                           torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]]))
        assert torch.equal(ckpt.read("decoder.layers.self_attention.linear_qkv.layer_norm_weight", i),
                           ranks[0][p + "input_layernorm.weight"])
        assert torch.equal(ckpt.read("decoder.layers.mlp.linear_fc1.layer_norm_weight", i),
                           ranks[0][p + "pre_mlp_layernorm.weight"])
    assert torch.equal(ckpt.read(EMB), torch.cat([r[EMB] for r in ranks]))


@pytest.mark.parametrize("name", ["gpt2-tp1", "gpt2-tp2", "llama-tp1", "llama-tp2"])
def test_mcore_loads_what_we_write(ref, name):
    """mcore's checkpoint copied through read()/write_dist_checkpoint loads back into a fresh mcore
    model (other seed) with megatron-core's own dist_checkpointing.load: identical weights and loss."""
    _, results = ref
    entry = results[name]
    assert entry["rewritten_equal"]
    assert entry["rewritten_loss"] == entry["loss"]


def test_torchs_own_dcp_load_reads_what_we_write_without_its_planner(written):
    """We write `.distcp`/`.metadata` ourselves (no DCP save planning): torch's own `dcp.load`,
    the reader megatron-core uses underneath, must read it back exactly, boxes across layers included."""
    import torch.distributed.checkpoint as dcp
    path, want, _ = written
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=FileSystemReader(str(path)), no_dist=True)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert torch.equal(DistCheckpoint(path).read_box(QKV, [1, 2, 0], [2, 5, 8]), want[QKV][1:3, 2:7])


def test_a_chunk_never_written_or_written_twice_is_refused(tmp_path):
    out = DistWriter(tmp_path / "a")
    out.declare(QKV, torch.float32, (2, 3, 4))
    out.write(QKV, 0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="written twice"):
        out.write(QKV, 0, torch.zeros(3, 4))
    with pytest.raises(InteropError, match="never written"):
        out.finish({})
    out.abort()
    assert not (tmp_path / "a" / ".metadata").exists()
