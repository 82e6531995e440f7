"""Loading `.pt` pickles (Megatron's `model_optim_rng.pt`, `common.pt`) and plain metadata pickles without
running code from them.

`torch.load(weights_only=True)` refuses every class it does not know.  Megatron
checkpoints hold a few harmless ones (the `args` Namespace, Megatron enums, signal
numbers, numpy rng state), so we allow those explicitly, stand in inert placeholders
for other *classes* (from packages that may not even be installed here), and refuse
a pickle that names a function or anything from a module that can reach the
system: such a pickle is not a checkpoint but a program.  Nothing is imported or
called on the pickle's say-so except the allow-list below.
"""
from __future__ import annotations

import argparse
import collections
import enum
import io
import pathlib
import pickle
import signal
import types
import zipfile
from pathlib import Path

import numpy
import numpy.core.multiarray
import torch

from ..errors import InteropError
from .small_files import read_small_bytes
from .zip_records import InflationBomb, check_expansion

# Real objects a checkpoint may name, by the dotted path the pickle uses.
ALLOWED = {
    "argparse.Namespace": argparse.Namespace,
    "types.SimpleNamespace": types.SimpleNamespace,
    "signal.Signals": signal.Signals,
    "_io.BytesIO": io.BytesIO,  # Transformer Engine's `_extra_state`
    "io.BytesIO": io.BytesIO,
    "pathlib.PosixPath": pathlib.PosixPath,
    "pathlib.PurePosixPath": pathlib.PurePosixPath,
    "numpy.core.multiarray._reconstruct": numpy.core.multiarray._reconstruct,
    "numpy._core.multiarray._reconstruct": numpy.core.multiarray._reconstruct,
    "numpy.core.multiarray.scalar": numpy.core.multiarray.scalar,
    "numpy._core.multiarray.scalar": numpy.core.multiarray.scalar,
    "numpy.ndarray": numpy.ndarray,
    "numpy.dtype": numpy.dtype,
}

# Classes whose names are lower case (so `_is_class_like` would take them for functions): stood in for.
LOWERCASE_CLASSES = {
    "deepspeed.utils.tensor_fragment.fragment_address",  # a dataclass (numel, start) in ZeRO optimizer files
}

# Modules whose names in a pickle mean "run something": never stand in for them, refuse.
DANGEROUS_MODULES = {
    "os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "shutil", "socket", "importlib",
    "runpy", "pickle", "_pickle", "marshal", "code", "codeop", "ctypes", "pty", "multiprocessing", "asyncio",
    "webbrowser", "platform", "functools", "operator", "types", "inspect", "pdb", "timeit", "tempfile",
    "io", "_io", "pathlib", "glob", "commands", "popen2", "torch", "numpy", "setuptools", "pip", "site",
}


class Placeholder:
    """Stands in for a class this environment does not have (or that we will not import).

    It records what the pickle gave it and does nothing else; `interop_name` says
    which class it replaced (e.g. `megatron.core.enums.ModelType`).
    """
    interop_name = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __new__(cls, *args, **kwargs):
        inst = super().__new__(cls)
        inst.args, inst.kwargs, inst.state = args, kwargs, None
        return inst

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        inner = ", ".join(repr(a) for a in self.args)
        return f"{self.interop_name}({inner})"


def placeholder_class(full_name: str) -> type:
    return type(full_name.rsplit(".", 1)[-1], (Placeholder,), {"interop_name": full_name})


def _numpy_dtype_class(full_name: str):
    """numpy >= 1.25 pickles some dtypes by their class (`numpy.dtypes.UInt32DType`)."""
    module, _, name = full_name.rpartition(".")
    if module == "numpy.dtypes" and name.endswith("DType"):
        return getattr(getattr(numpy, "dtypes", None), name, None)
    return None


def _numpy_dtype_classes() -> list[type]:
    dtypes = getattr(numpy, "dtypes", None)
    return [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")] if dtypes else []


def _is_class_like(full_name: str) -> bool:
    """Classes are CamelCase; a lower-case final name is a function, which a checkpoint never needs."""
    module, _, name = full_name.rpartition(".")
    if full_name in LOWERCASE_CLASSES:
        return True
    return bool(module) and name.lstrip("_")[:1].isupper() and module.split(".")[0] not in DANGEROUS_MODULES


def plan_globals(path, names: list[str]) -> tuple[list, list[str]]:
    """Safe-global entries for every name the pickle uses, and which of them became placeholders.

    Refuses (InteropError) a pickle naming a function or a system module."""
    # numpy rebuilds dtypes by BUILD on instances of these classes, which never appear by name
    entries, placeholders = [(cls, f"numpy.dtypes.{cls.__name__}") for cls in _numpy_dtype_classes()], []
    for full_name in sorted(names):
        obj = ALLOWED.get(full_name) or _numpy_dtype_class(full_name)
        if obj is not None:
            entries.append((obj, full_name))
        elif _is_class_like(full_name):
            entries.append((placeholder_class(full_name), full_name))
            placeholders.append(full_name)
        else:
            raise InteropError(f"{path}: refused to load: the pickle calls {full_name}, which could run code "
                               "(a checkpoint never needs it; the file may be malicious)")
    return entries, placeholders


def safe_torch_load(path, mmap: bool = True):
    """`torch.load` of `path` on CPU with `weights_only=True`, the allow-list above and placeholders.

    Tensors stay memory-mapped when the file is in torch's zip format (`mmap`)."""
    return load_pickle(path, mmap=mmap)[0]


def load_pickle(path, names: list[str] | None = None, map_location="cpu", mmap: bool = True):
    """(object, placeholder class names): the one safe `torch.load` every `.pt` reader goes through.

    `names`: the globals the pickle names, when the caller has them already (else read from the file);
    `map_location="meta"` leaves tensors unread (their bytes are read later, by offset)."""
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"{path}: no such file")
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        _check_expansion(path)
    if names is None:
        names = []
        if is_zip:
            try:
                names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            except Exception as exc:  # a damaged zip or pickle raises many types
                raise InteropError(f"{path}: not a readable torch checkpoint ({_first_line(exc)})") from None
    entries, placeholders = plan_globals(path, names)
    try:
        with torch.serialization.safe_globals(entries):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and is_zip), placeholders
    except InteropError:
        raise
    except Exception as exc:
        raise InteropError(f"{path}: cannot load safely ({_first_line(exc)})") from None


def _check_expansion(path: Path) -> None:
    """torch inflates a compressed record into a buffer of its declared size: bound that first."""
    try:
        with zipfile.ZipFile(path) as z:
            check_expansion(z)
    except InflationBomb as exc:
        raise InteropError(f"{path}: {exc}") from None
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise InteropError(f"{path}: not a readable zip file ({_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def to_plain(value, depth: int = 0):
    """A JSON-able copy of args-like values: Namespaces to dicts, placeholders and enums to strings."""
    if depth > 20:
        return repr(value)
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return {k: to_plain(v, depth + 1) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): to_plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (numpy.generic,)):
        return to_plain(value.item(), depth + 1)
    if isinstance(value, signal.Signals):
        return value.name
    if isinstance(value, enum.Enum):  # AttnBackend.auto, ...: by name
        return value.name
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"<tensor {list(value.shape)}>"
    return repr(value)


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, sets, numbers and strings, and torch.Size: any other global is refused."""

    ALLOWED_GLOBALS = {("torch", "Size"): torch.Size, ("collections", "OrderedDict"): collections.OrderedDict}

    def find_class(self, module, name):
        found = self.ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return found


def load_plain_pickle(path, what: str, limit: int = 64 << 20):
    """A plain `pickle.dump` file of metadata (ATorch's `flat_meta.*`, `ckpt_meta`), read without running code."""
    data = read_small_bytes(path, what, limit)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a damaged or hostile pickle raises many types
        raise InteropError(f"{path}: not a readable {what} ({_first_line(exc)})") from None
