"""`.metadata` is written with pickle's C pickler under DCP's class names (`interop.io.dcp_metadata.dump`): the
bytes are those DCP's own `pickle.dump` writes, in a process without DCP (the conversions') and in one with it."""
from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

from helpers.dcp_build import build_metadata

TESTS = Path(__file__).resolve().parents[1]

WRITE_WITHOUT_DCP = """
import sys
sys.path.insert(0, {tests!r})
from helpers.dcp_build import build_metadata
from interop.io import dcp_metadata as m
with open({out!r}, "wb") as f:
    m.dump(build_metadata(m, m._StorageInfo), f)
assert not [k for k in sys.modules if k.startswith("torch.distributed.checkpoint")], "DCP was imported"
assert m.Metadata.__module__ == "interop.io.dcp_metadata" and m._StorageInfo.__qualname__ == "_StorageInfo"
"""


def test_the_c_pickler_writes_dcps_bytes_without_dcp(tmp_path):
    out = tmp_path / "metadata.pkl"
    subprocess.run([sys.executable, "-c", WRITE_WITHOUT_DCP.format(tests=str(TESTS), out=str(out))], check=True,
                   timeout=300)
    from torch.distributed.checkpoint import metadata as real
    from torch.distributed.checkpoint.filesystem import _StorageInfo as RealInfo
    expected = build_metadata(real, RealInfo)
    assert out.read_bytes() == pickle.dumps(expected)
    loaded = pickle.loads(out.read_bytes())  # DCP's classes, from our bytes
    assert type(loaded) is real.Metadata and loaded == expected


def test_with_dcp_imported_the_same_bytes():
    from torch.distributed.checkpoint import metadata as real
    from torch.distributed.checkpoint.filesystem import _StorageInfo as RealInfo
    from interop.io import dcp_metadata as m
    buffer = io.BytesIO()
    m.dump(build_metadata(m, m._StorageInfo), buffer)
    assert buffer.getvalue() == pickle.dumps(build_metadata(real, RealInfo))
