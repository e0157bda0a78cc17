"""Writers that the crash tests kill: `python crash_writers.py KIND DIR [FIRST]` writes version FIRST,
FIRST+1, ... of one file (or bundle) with edgespec's own code, forever, printing each version once it is
in place. `check(KIND, DIR)` says which complete version is there now (None: nothing), and fails on
anything partial. Each version's size depends on its number, so a truncated file cannot pass."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

KINDS = ("chat", "suffix", "pull", "export")
SCALE = 1.0  # of every size below (the full-disk test writes a small version, then a big one)


def _blob(v: int, size: int) -> bytes:
    return np.full(int(size * SCALE) + 4096 * (v % 7), v % 251, dtype=np.uint8).tobytes()


class StandInRuntime:
    """Just what `persist` asks of a runtime that saves its KV (`SavedState`): a KV blob of a few MB."""

    name = "stand-in"

    def __init__(self, v: int = 0):
        from edgespec.runtimes.base import SavedState

        self.capabilities = frozenset({SavedState})
        self.v = v
        self.tokens = np.arange(v % 50 + 1, dtype=np.int32)
        self.loaded: tuple[bytes, list] | None = None

    def compatibility_key(self) -> dict:
        return {"model": "stand-in"}

    def save_state(self) -> bytes:
        return _blob(self.v, 4 << 20)

    def load_state(self, blob: bytes, tokens) -> None:
        self.loaded = (blob, list(tokens))


def _payload(v: int) -> bytes:  # a "model" for the store: its version number, then 8 MB and a bit
    return v.to_bytes(4, "little") + _blob(v, 8 << 20)


def _entry(v: int):
    import dataclasses

    from edgespec.models import catalog

    data = _payload(v)
    return dataclasses.replace(catalog.get("smollm2-135m"), name=f"crash-{v}", file_name="crash-model.gguf",
                               size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def write(kind: str, root: Path, v: int) -> None:
    if kind == "chat":  # a saved chat: Conversation.save writes through persist.save_state
        from edgespec.persist import save_state

        save_state(root / "chat.state", {"target": StandInRuntime(v)}, meta={"messages": [{"v": v}]})
    elif kind == "suffix":
        from edgespec.drafters.suffix import SuffixHistory

        history = SuffixHistory(limit=1 << 22, key="k")
        for i in range(64):
            history.add(np.full(int(8192 * SCALE) + v % 5, v * 100 + i, dtype=np.int32))
        history.save(root / "history.bin")
    elif kind == "pull":  # the store's own pull; the download is a local copy written chunk by chunk
        import os

        from edgespec.models import store

        os.environ["EDGESPEC_HOME"] = str(root)
        entry = _entry(v)  # one file name, and a size that differs from the last version's: pulled again

        def assemble(entry, work, out_path, progress):
            data, digest = _payload(v), hashlib.sha256()
            with open(out_path, "wb") as out:
                for at in range(0, len(data), 1 << 20):
                    out.write(data[at:at + (1 << 20)])
                    digest.update(data[at:at + (1 << 20)])
                out.flush()
                os.fsync(out.fileno())
            return digest.hexdigest()

        store._assemble = assemble
        store.pull(entry, progress=False)
    elif kind == "export":  # a bundle's last steps: files in a work dir, the manifest, the move into place
        import tempfile

        from edgespec.exporters import bundle

        out = root / "bundle"
        work = Path(tempfile.mkdtemp(prefix=".bundle.partial-", dir=root))
        (work / "gguf").mkdir()
        (work / "gguf" / "target.gguf").write_bytes(_blob(v, 2 << 20))
        (work / "gguf" / "draft.gguf").write_bytes(_blob(v + 1, 1 << 20))
        manifest = {"version": v, "files": bundle._file_table(work)}
        (work / bundle.MANIFEST).write_text(json.dumps(manifest))
        bundle._fsync_tree(work)
        bundle._move_into_place(work, out)
    else:
        raise ValueError(kind)


def check(kind: str, root: Path) -> int | None:
    """The complete version under the final name, or None when there is none; an AssertionError on a partial."""
    if kind == "chat":
        from edgespec.persist import load_state

        path = root / "chat.state"
        if not path.exists():
            return None
        runtime = StandInRuntime()
        meta = load_state(path, {"target": runtime})
        v = meta["messages"][0]["v"]
        assert runtime.loaded == (_blob(v, 4 << 20), list(range(v % 50 + 1))), f"chat version {v} is not whole"
        return v
    if kind == "suffix":
        from edgespec.drafters.suffix import SuffixHistory

        path = root / "history.bin"
        if not path.exists():
            return None
        history = SuffixHistory(limit=1 << 22, key="k")
        history.load(path)
        outputs = history.outputs()
        assert len(outputs) == 64, len(outputs)
        v = int(outputs[0][0]) // 100
        for i, o in enumerate(outputs):
            assert np.array_equal(o, np.full(int(8192 * SCALE) + v % 5, v * 100 + i, dtype=np.int32)), (v, i)
        return v
    if kind == "pull":
        path = root / "models" / "crash-model.gguf"
        if not path.exists():
            return None
        data = path.read_bytes()
        v = int.from_bytes(data[:4], "little")
        assert data == _payload(v), f"the model under its final name is partial ({len(data)} bytes)"
        return v
    if kind == "export":
        from edgespec.exporters.bundle import read_manifest, verify_bundle

        out = root / "bundle"
        if not out.exists():
            return None
        problems = verify_bundle(out)
        assert not problems, problems
        return read_manifest(out)["version"]
    raise ValueError(kind)


if __name__ == "__main__":
    kind, root, first = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    SCALE = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    if len(sys.argv) > 5:  # once: the full-disk test
        try:
            write(kind, root, first)
        except Exception as exc:  # noqa: BLE001 - what the user would see, on one line
            print(type(exc).__name__, str(exc), sep="\n", end="")
            sys.exit(3)
        sys.exit(0)
    v = first
    while True:  # until killed
        write(kind, root, v)
        print(v, flush=True)
        v += 1
