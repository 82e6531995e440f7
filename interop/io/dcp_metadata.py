"""DCP's `.metadata` classes without importing torch.distributed.checkpoint (1.5-2 s of import, measured).

A torch_dist checkpoint's `.metadata` is a pickle of `torch.distributed.checkpoint.metadata.Metadata`
and the classes it holds.  Reading one needs only their fields, and writing one only their names in the
pickle: these stand-ins have the same fields and pickle state as DCP's (torch 2.x:
`torch/distributed/checkpoint/metadata.py`, `filesystem.py`), and `dump` writes them under DCP's module
and class names, so that DCP's own `pickle.load` builds its real classes from our file (a test pickles
the same metadata both ways and compares the bytes).
"""
from __future__ import annotations

import dataclasses
import enum
import pickle
import sys
import threading
import types
import contextlib
from typing import Any

import torch

DCP = "torch.distributed.checkpoint"
CURRENT_DCP_VERSION = "1.0.0"  # filesystem.CURRENT_DCP_VERSION of torch 2.6-2.13


@dataclasses.dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 (DCP's name)
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_FORMATS = {torch.contiguous_format: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            torch.channels_last: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
            torch.preserve_format: _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT}


@dataclasses.dataclass
class TensorProperties:
    """Pickled as DCP pickles it: a tuple, the memory format as an enum."""
    dtype: torch.dtype = dataclasses.field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __getstate__(self):
        return self.dtype, self.layout, self.requires_grad, _FORMATS[self.memory_format], self.pin_memory

    def __setstate__(self, state):
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = {v: k for k, v in _FORMATS.items()}[_MEM_FORMAT_ENCODING(encoding)]


@dataclasses.dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list


@dataclasses.dataclass
class BytesStorageMetadata:
    pass


@dataclasses.dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclasses.dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = dataclasses.field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset=None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@dataclasses.dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclasses.dataclass
class _StoragePrefix:
    prefix: str


class Opaque:
    """Stands in for what old checkpoints keep in `planner_data` (DCP's save-plan classes, megatron-core's
    MCoreSavePlan): it keeps what the pickle gives it and does nothing."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state


# Our class -> DCP's (module, name), for writing; the reader maps the other way (megatron_dist).
# (The module names are one string object each: pickle memoizes a string by identity, as DCP's classes share
# their module's `__module__` string.)
_METADATA, _FILESYSTEM = sys.intern(f"{DCP}.metadata"), sys.intern(f"{DCP}.filesystem")
DCP_NAMES = {cls: (_METADATA, cls.__name__) for cls in (
    ChunkStorageMetadata, _MEM_FORMAT_ENCODING, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
    StorageMeta, Metadata, MetadataIndex)}
DCP_NAMES.update({_StorageInfo: (_FILESYSTEM, "_StorageInfo"), _StoragePrefix: (_FILESYSTEM, "_StoragePrefix")})


class _SlowPickler(pickle._Pickler):
    """pickle's Python pickler, naming the stand-ins as DCP's classes in `save_global` (~0.4 ms a chunk: 12 s
    for 31k chunks): only for a process that has imported DCP, where `_dcp_names` cannot lend DCP's names."""

    def save_global(self, obj, name=None):
        real = DCP_NAMES.get(obj) if isinstance(obj, type) else None
        if real is None:
            return super().save_global(obj, name)
        module, qualname = real
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_DUMPING = threading.Lock()


@contextlib.contextmanager
def _dcp_names():
    """For the dump only, the stand-ins carry DCP's module and class names, and module objects under DCP's
    module names in `sys.modules` hold them: the C pickler finds each class where it says it lives and writes
    DCP's names (the bytes DCP's own `pickle.dump` writes).  DCP is not imported (checked by the caller), so
    no one else looks these modules up meanwhile."""
    placed = {name: types.ModuleType(name) for name in (_METADATA, _FILESYSTEM)}
    saved = {cls: (cls.__module__, cls.__qualname__) for cls in DCP_NAMES}
    try:
        sys.modules.update(placed)
        for cls, (module, name) in DCP_NAMES.items():
            cls.__module__, cls.__qualname__ = module, name
            setattr(placed[module], name, cls)
        yield
    finally:
        for cls, (module, name) in saved.items():
            cls.__module__, cls.__qualname__ = module, name
        for name in placed:
            del sys.modules[name]


def dump(metadata: Metadata, file) -> None:
    """Write `metadata` as DCP's `.metadata` (the default protocol, as DCP's `pickle.dump`), with pickle's C
    pickler (31k chunks: 12 s -> ~0.1 s, `benchmarks/bench_dcp_metadata.py`)."""
    with _DUMPING:
        if _METADATA in sys.modules or _FILESYSTEM in sys.modules or DCP in sys.modules:
            _SlowPickler(file, pickle.DEFAULT_PROTOCOL).dump(metadata)
            return
        with _dcp_names():
            pickle.Pickler(file, pickle.DEFAULT_PROTOCOL).dump(metadata)
