"""sha256 checks of model files kept in other tools' stores (the HF cache, Ollama's blobs).

Those stores name a blob by its sha256 but do not check the bytes when they write them. edgespec hashes
a file once before its first use and remembers the result (size, mtime and inode of the file, keyed by
its digest) under the edgespec cache, so a 5 GB model costs its hash once, not on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from edgespec import atomic
from edgespec.models.cache import models_dir

_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike, advance=None) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks; `advance(n)` is called per chunk (a progress bar)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if advance:
                advance(len(chunk))
    return digest.hexdigest()


def _marker(sha256: str) -> Path:
    return models_dir() / ".verified" / f"{sha256}.json"


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def is_verified(path: str | os.PathLike, sha256: str) -> bool:
    """True when this exact file (same size, mtime, inode) was hashed to `sha256` before."""
    real = Path(path).resolve()
    try:
        return json.loads(_marker(sha256).read_text()) == _stamp(real)
    except (OSError, ValueError):
        return False


def check(path: str | os.PathLike, sha256: str, advance=None) -> bool:
    """Whether the file's sha256 is `sha256` (hashing it unless it was verified before); remembers a match."""
    real = Path(path).resolve()
    sha256 = sha256.lower()
    if is_verified(real, sha256):
        return True
    if sha256_file(real, advance) != sha256:
        return False
    marker = _marker(sha256)
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(marker, json.dumps(_stamp(real)))
    return True
