"""Saved state — a chat, a session's KV — through one mechanism and one compatibility key.

A file holds a JSON header (format, each runtime's compatibility key and token ids, the caller's
own metadata) and each runtime's KV blob. Loading checks every key first and refuses a mismatch
with a message that names what differs. Files are written atomically: complete or absent.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

from edgespec.atomic import atomic_write
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import Runtime, SavedState

FORMAT = "edgespec-state/1"
_MAGIC = b"EDGESPEC-STATE\n"


def save_state(path: str | os.PathLike, runtimes: Mapping[str, Runtime], meta: dict | None = None) -> Path:
    """Write each runtime's KV and tokens (runtimes: name -> runtime that implements `SavedState`)."""
    _check_saves(runtimes)
    path = Path(path)
    blobs = {name: rt.save_state() for name, rt in runtimes.items()}
    header = {"format": FORMAT, "meta": meta or {},
              "runtimes": {name: {"key": rt.compatibility_key(), "tokens": rt.tokens.tolist(),
                                  "bytes": len(blobs[name])} for name, rt in runtimes.items()}}
    raw = json.dumps(header).encode()
    with atomic_write(path) as f:
        f.write(_MAGIC + struct.pack("<Q", len(raw)) + raw)
        for name in runtimes:
            f.write(blobs[name])
    return path


def load_state(path: str | os.PathLike, runtimes: Mapping[str, Runtime]) -> dict:
    """Restore KV into the runtimes after checking compatibility; return the caller's metadata."""
    _check_saves(runtimes)
    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"no saved state at {path}")
    with path.open("rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise EdgespecError(f"{path} is not an edgespec state file")
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        if header.get("format") != FORMAT:
            raise EdgespecError(f"{path} has state format {header.get('format')!r}; this edgespec reads {FORMAT}")
        saved = header["runtimes"]
        if set(saved) != set(runtimes):
            raise EdgespecError(f"{path} holds state for {sorted(saved)}, this session has {sorted(runtimes)}")
        for name, rt in runtimes.items():
            mismatch = _differences(saved[name]["key"], rt.compatibility_key())
            if mismatch:
                raise EdgespecError(f"cannot restore {path}: the {name} model's {mismatch}; "
                                    "load it with the same model, build, context size and KV types")
        for name in saved:  # header order is the blob order
            blob = f.read(saved[name]["bytes"])
            runtimes[name].load_state(blob, saved[name]["tokens"])
    return header["meta"]


def _check_saves(runtimes: Mapping[str, Runtime]) -> None:
    for name, rt in runtimes.items():
        if SavedState not in rt.capabilities:
            raise EdgespecError(f"the {name} model's runtime ({rt.name}) cannot save or restore its KV state")


def _differences(saved: dict, current: dict) -> str:
    diffs = [f"{k} differs (saved {saved.get(k)!r}, now {current.get(k)!r})"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    return "; ".join(diffs)
