"""Atomic output directories: build in a hidden sibling, then rename into place.

A failed or interrupted conversion leaves nothing at the destination.  The final rename
never replaces what the run does not own: without `force` it publishes only if the
destination is still absent, in one step (Linux `renameat2(RENAME_NOREPLACE)`), so of two
runs into the same new destination exactly one wins; with `force` the new directory and
the old one swap places in one step (`RENAME_EXCHANGE`) and the old one is then removed.

The sibling is named `.DST.tmp-HOST-PID-XXXXXXXX`.  A process killed with SIGKILL cannot
clean up after itself, so a later run into the same destination removes the siblings whose
owner (same host, that PID) is gone, and says so.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import tempfile
from pathlib import Path

from .errors import InteropError

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _load_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def renameat2(src, dst, flags: int) -> bool:
    """rename(2) with `flags`; False where the system or the filesystem cannot do it, OSError when it refuses."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # e.g. an old kernel, or NFS / some FUSE mounts
        return False
    raise OSError(err, os.strerror(err), os.fspath(dst))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_destination(dst, force: bool, inputs=()) -> Path:
    """Refuse a destination that exists (without `force`), is not a directory, lies inside an input folder,
    or whose removal by `--force` would delete any of `inputs` (the source, a model config)."""
    dst = Path(dst)
    real_dst = Path(os.path.realpath(dst))
    if (dst.exists() or dst.is_symlink()) and not force:
        raise InteropError(f"{dst} already exists (use --force to replace it)")
    if dst.exists() and not dst.is_dir():
        raise InteropError(f"{dst} exists and is not a directory")
    if force and (dst.exists() or dst.is_symlink()):
        for given in inputs:
            if given is None:
                continue
            real = Path(os.path.realpath(given))
            if _inside(real, real_dst):
                what = "is" if real == real_dst else "contains"
                raise InteropError(f"{dst} {what} the input {given}: --force would delete it; choose another destination")
            if _inside(real_dst, real):
                raise InteropError(f"{dst} is inside the input {given}: --force would delete part of it; "
                                   "choose another destination")
    # (after --force's own refusals, which say more)
    for given in inputs:  # a new destination inside a source folder would be written into the source
        if given is not None and Path(given).is_dir() and _inside(real_dst, Path(os.path.realpath(given))) \
                and real_dst != Path(os.path.realpath(given)):
            raise InteropError(f"{dst} is inside the input {given}: the output would be written into the source; "
                               "choose another destination")
    return dst


def current_umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, so a rename publishes complete data."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_prefix(dst: Path) -> str:
    return f".{dst.name}.tmp-"


def _owner_prefix(dst: Path) -> str:
    return f"{_temp_prefix(dst)}{socket.gethostname()}-{os.getpid()}-"


def _owner_pid(dst: Path, sibling: str) -> int | None:
    """The PID in a temporary sibling's name when this host made it; None when it is not ours to judge."""
    rest = sibling[len(_temp_prefix(dst)):]
    parts = rest.rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not (parts[1].isascii() and parts[1].isdigit()):
        return None
    return int(parts[1])


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_siblings(dst) -> list[str]:
    """Remove `.DST.tmp-HOST-PID-*` siblings whose owner process is gone; returns their names."""
    dst = Path(dst)
    removed = []
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return removed
    for name in sorted(names):
        if not name.startswith(_temp_prefix(dst)):
            continue
        pid = _owner_pid(dst, name)
        if pid is None or _alive(pid):
            continue
        path = dst.parent / name
        if path.is_symlink() or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(name)
    return removed


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Move the finished `tmp` to `dst`: only into an absent destination, or, with `force`, swapping."""
    if force and (dst.exists() or dst.is_symlink()):
        _replace(tmp, dst)
        return
    taken = InteropError(f"{dst} appeared while this run was writing (another run?); it was not replaced")
    try:
        if renameat2(tmp, dst, RENAME_NOREPLACE):
            return
        os.mkdir(dst)  # no renameat2 here: claim the name first (fails if anyone has it) ...
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise taken from None
        raise
    try:
        os.rename(tmp, dst)  # ... then replace our own empty directory (fails if someone filled it)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # our claim, if it is still empty
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise taken from None
        raise


def _replace(tmp: Path, dst: Path) -> None:
    """--force: `tmp` becomes `dst` and the old destination is removed; never a moment without `dst`
    where the system can swap in one step."""
    if renameat2(tmp, dst, RENAME_EXCHANGE):
        old = tmp  # the old destination now lives under the temporary name
    else:
        old = Path(tempfile.mkdtemp(prefix=_owner_prefix(dst), dir=dst.parent))
        os.replace(dst, old)  # dst -> an (empty) directory of ours: allowed by rename(2)
        os.replace(tmp, dst)
    if old.is_symlink():
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; the ones created, deepest first (a failed run removes them:
    `out/a/b/model` refused or interrupted leaves no `out/a/b`)."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


@contextlib.contextmanager
def atomic_directory(dst, force: bool = False, inputs=(), notes: list[str] | None = None):
    """Yield a temporary directory beside `dst`; on success it becomes `dst`, on error it vanishes.

    `inputs` are paths `--force` must not delete; `notes`, when given, gets a line for each stale
    temporary sibling removed (else the line goes nowhere)."""
    dst = check_destination(dst, force, inputs)
    made = _make_parents(dst.parent)
    for name in remove_stale_siblings(dst):
        if notes is not None:
            notes.append(f"removed {dst.parent / name}, left behind by an earlier run that was killed")
    tmp = Path(tempfile.mkdtemp(prefix=_owner_prefix(dst), dir=dst.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())  # like mkdir(1), cp and torch.save, not mkdtemp's 0700
        _publish(tmp, dst, force)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # the parents this run created, deepest first, while they are still empty
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(dst)  # "error: DST: No space left on device", not a bare strerror
        raise
