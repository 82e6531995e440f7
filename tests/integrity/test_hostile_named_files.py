"""Safe and usable: files a checkpoint names or links to.

- A tokenizer named by the checkpoint (Megatron's `tokenizer_model` in its args, kept in the training state
  by every reader and by the common format) is copied only when it lies inside the checkpoint or the user
  names it with `--tokenizer`; otherwise a note, never the file (`interop/named_tokenizer.py`).
- An HF `tokenizer.json` that is a symlink out of the checkpoint is not copied.
- A Hugging Face hub cache snapshot (`models--X/snapshots/REV/`, each file a symlink to `../../blobs/HASH`,
  as `huggingface_hub` lays it out) is read; a symlink out of that model's cache repository is still refused
  (`interop/io/paths.py` `bound`).
"""
import hashlib
import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli, leftovers, run
from helpers.megatron_built import hand_built, megatron_args

SECRET = b"API_TOKEN=do-not-copy-me\n"


@pytest.fixture()
def secret(tmp_path):
    path = tmp_path / "secret.model"
    path.write_bytes(SECRET)
    return path


def _megatron(root, named):
    model = build("llama")
    args = megatron_args(model, "llama", 1, 1)
    args["tokenizer_model"] = str(named)
    hand_built(root, model, "llama", tp=1, pp=1, args=args)
    return root


def _no_secret_in(out):
    for dirpath, _, names in os.walk(out):
        for name in names:
            assert SECRET not in open(os.path.join(dirpath, name), "rb").read(), name


@pytest.mark.parametrize("named", ["secret", "/proc/self/environ", "../secret.model", "missing.model"])
def test_megatron_named_tokenizer_outside_is_not_copied(tmp_path, secret, named):
    target = {"secret": str(secret)}.get(named, named)
    src = _megatron(tmp_path / "meg", target)
    code, output = run("convert", src, tmp_path / "hf", "--to", "hf")
    assert code == 0, output
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    assert "tokenizer not copied" in output and "--tokenizer" in output, output
    _no_secret_in(tmp_path / "hf")


def test_named_tokenizer_through_the_common_format_is_not_copied(tmp_path, secret):
    """Megatron -> interop keeps the name in the state; interop -> hf must not follow it either."""
    src = _megatron(tmp_path / "meg", secret)
    assert run("convert", src, tmp_path / "store", "--to", "interop")[0] == 0
    code, output = run("convert", tmp_path / "store", tmp_path / "hf", "--to", "hf")
    assert code == 0 and "tokenizer not copied" in output, output
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    _no_secret_in(tmp_path / "hf")


def test_named_tokenizer_given_by_the_user_is_copied(tmp_path, secret):
    """--tokenizer is the user's word: the same file named on the command line is taken."""
    named = tmp_path / "secret.json"  # (a .json: a sentencepiece .model would be parsed for its token ids)
    named.write_bytes(SECRET)
    src = _megatron(tmp_path / "meg", named)
    code, output = run("convert", src, tmp_path / "hf", "--to", "hf", "--tokenizer", named)
    assert code == 0, output
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == SECRET


def test_hf_tokenizer_symlink_out_of_the_checkpoint_is_not_copied(hf_checkpoints, tmp_path, secret):
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoints["llama"], src)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    (src / "tokenizer.json").symlink_to(secret)
    code, output = run("convert", src, tmp_path / "hf", "--to", "hf")
    assert code == 0, output
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert "not carried: tokenizer.json (a symlink out of the checkpoint" in output, output
    _no_secret_in(tmp_path / "hf")
    code, output = run("convert", src, tmp_path / "store", "--to", "interop")  # not kept in carried/ either
    assert code == 0 and not (tmp_path / "store" / "carried" / "tokenizer.json").exists(), output


def hub_cache(src, cache, rev="0123abcd"):
    """`src` laid out as huggingface_hub's cache does: models--org--tiny/{blobs/SHA, snapshots/REV/NAME ->
    ../../blobs/SHA, refs/main}."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snap / path.name).symlink_to(os.path.join("..", "..", "blobs", digest))
    return snap


def _sharded(hf_checkpoints, tmp_path):
    """The tiny llama saved in two shards with an index (the index names each shard)."""
    direct = tmp_path / "sharded"
    assert run("convert", hf_checkpoints["llama"], direct, "--to", "hf", "--max-shard-size", "100KB")[0] == 0
    assert (direct / "model.safetensors.index.json").is_file()
    return direct


def test_hub_cache_snapshot_is_read(hf_checkpoints, tmp_path):
    plain = _sharded(hf_checkpoints, tmp_path)
    snap = hub_cache(plain, tmp_path / "cache")
    code, output = run("convert", snap, tmp_path / "out", "--to", "hf")
    assert code == 0, output
    ref = tmp_path / "ref"
    assert run("convert", plain, ref, "--to", "hf")[0] == 0
    for name in sorted(p.name for p in ref.glob("*.safetensors")):
        a, b = load_file(ref / name), load_file(tmp_path / "out" / name)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((ref / "config.json").read_text())


def test_hub_cache_symlink_out_of_the_model_repository_is_refused(hf_checkpoints, tmp_path):
    """A snapshot's shard that links out of models--org--tiny (to another model's blobs) is an escape."""
    plain = _sharded(hf_checkpoints, tmp_path)
    snap = hub_cache(plain, tmp_path / "cache")
    shard = sorted(snap.glob("model-*.safetensors"))[0]
    other = tmp_path / "cache" / "models--other--x" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(shard, other / "stolen")
    shard.unlink()
    shard.symlink_to(os.path.join("..", "..", "..", "models--other--x", "blobs", "stolen"))
    result = cli("convert", snap, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "outside the checkpoint")
    assert leftovers(tmp_path / "out") == []
