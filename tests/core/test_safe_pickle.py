"""`safe_torch_load`: Megatron's harmless classes load, unknown classes become placeholders, code never runs."""
from __future__ import annotations

import argparse
import enum
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from interop.errors import InteropError
from interop.io.safe_pickle import Placeholder, safe_torch_load
from interop.io.torch_file import LazyTorchFile


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvilPopen:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.Popen, (["touch", str(self.marker)],))


class _EvilEval:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


@pytest.mark.parametrize("payload", [_Evil, _EvilPopen, _EvilEval])
def test_malicious_reduce_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "model": {"w": torch.ones(2)}, "x": payload(marker)}, path)
    for load in (safe_torch_load, LazyTorchFile):
        with pytest.raises(InteropError, match="refused to load.*could run code"):
            load(path)
    assert not marker.exists()


def test_malicious_checkpoint_through_the_cli(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    (ckpt / "release" / "mp_rank_00").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("release")
    torch.save({"args": argparse.Namespace(num_layers=2), "model": {}, "evil": _Evil(marker)},
               ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt")
    run = subprocess.run([sys.executable, "-m", "interop", "convert", str(ckpt), str(tmp_path / "out"),
                          "--from", "megatron", "--to", "hf", "-q"], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "refused to load" in run.stderr and "posix.system" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()


def _fake_module_class(module: str):
    """An enum from a package this environment does not have (like megatron's ModelType)."""
    mod = types.ModuleType(module)
    cls = enum.Enum("ModelType", {"encoder_or_decoder": 1, "encoder_and_decoder": 2}, module=module)
    mod.ModelType = cls
    return mod, cls


def test_megatron_style_args_load_with_placeholders(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    mod, cls = _fake_module_class("notinstalled_megatron.core.enums")
    parents = ["notinstalled_megatron", "notinstalled_megatron.core"]
    sys.modules.update({name: types.ModuleType(name) for name in parents})
    sys.modules[mod.__name__] = mod
    try:
        args = argparse.Namespace(num_layers=2, model_type=cls.encoder_or_decoder, exit_signal=signal.SIGTERM,
                                  params_dtype=torch.bfloat16, nested=types.SimpleNamespace(a=1))
        np.random.seed(3)
        rng = {"random_rng_state": None, "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
        torch.save({"args": args, "rng_state": [rng], "model": {"w": torch.arange(4.0)}, "np_scalar": np.float64(2.5)},
                   path)
    finally:
        for name in parents + [mod.__name__]:
            sys.modules.pop(name, None)
    lazy = LazyTorchFile(path)
    assert lazy.placeholders == ["notinstalled_megatron.core.enums.ModelType"]
    assert lazy.obj["args"].model_type.interop_name == "notinstalled_megatron.core.enums.ModelType"
    assert torch.equal(lazy.read(lazy.obj["model"]["w"]), torch.arange(4.0))
    loaded = safe_torch_load(path)
    a = loaded["args"]
    assert isinstance(a, argparse.Namespace) and a.num_layers == 2 and a.exit_signal is signal.SIGTERM
    assert isinstance(a.model_type, Placeholder) and a.model_type.interop_name == "notinstalled_megatron.core.enums.ModelType"
    assert a.model_type.args == (1,)
    assert a.params_dtype is torch.bfloat16 and a.nested.a == 1
    np.random.seed(3)
    want = np.random.get_state()
    got = loaded["rng_state"][0]["np_rng_state"]
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0)) and loaded["np_scalar"] == 2.5


def test_lazy_file_reads_views_and_plain_files(tmp_path):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    torch.save({"view": base[:, 1:3], "whole": base, "half": base.to(torch.bfloat16)[2:]}, tmp_path / "a.pt")
    f = LazyTorchFile(tmp_path / "a.pt")
    assert f.obj["whole"].device.type == "meta"
    assert torch.equal(f.read(f.obj["view"]), base[:, 1:3])
    assert torch.equal(f.read(f.obj["whole"]), base)
    assert torch.equal(f.read(f.obj["half"]), base.to(torch.bfloat16)[2:])
    raw = torch.arange(8, dtype=torch.uint8)
    torch.save({"param": torch.nn.Parameter(base.clone()), "bytes": raw.untyped_storage(), "shape": base.shape,
                "same": [base, base[1:]]}, tmp_path / "b.pt")
    g = LazyTorchFile(tmp_path / "b.pt")
    assert torch.equal(g.read(g.obj["param"]), base) and g.obj["shape"] == torch.Size([4, 6])
    assert "Storage" in type(g.obj["bytes"]).__name__  # a bare storage loads too
    a, b = g.obj["same"]
    assert a.untyped_storage()._checkpoint_offset == b.untyped_storage()._checkpoint_offset  # one storage, two views
    assert torch.equal(g.read(b), base[1:])


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(InteropError, match="x.pt"):
        safe_torch_load(tmp_path / "x.pt")
