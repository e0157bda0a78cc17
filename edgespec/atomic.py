"""Files written whole or not at all: the one way edgespec replaces a file it keeps (a saved chat, the
suffix history, a model in the store, an export's manifest, cached measurements).

The bytes go to a temporary name next to the final one, are flushed to the disk (fsync), and only then
take the final name (`os.replace`, atomic on POSIX and Windows), and the directory entry is flushed too.
A process killed at any point leaves the previous file intact, or no file, never a partial one under the
final name. A full disk removes the temporary file and says so in one line, the previous file kept.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from edgespec.errors import EdgespecError

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(EdgespecError):
    """No space left on the disk while writing a file; the previous file is untouched."""


def temp_name(path: Path) -> Path:
    """A fresh hidden name beside `path` (one filesystem, so the final rename is atomic)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces `path` when the block ends without an error, else vanishes."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full(path, exc) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_write(path) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Give a finished file (written elsewhere) its final name: flushed first, so a crash right after the
    rename cannot leave the name pointing at bytes still in the page cache."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths (directories too) in one atomic step: Linux's renameat2(RENAME_EXCHANGE).
    False, with nothing changed, where the system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (the rename) where the platform can (not Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in _FULL


def disk_full(path: Path, exc: OSError) -> DiskFullError:
    return DiskFullError(f"no space left on the disk to write {path} ({exc.strerror or exc}); "
                         f"{'its previous content was kept' if path.exists() else 'nothing was written'}; "
                         "free some space and try again")
