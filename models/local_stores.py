"""Models that Ollama and LM Studio already keep on this machine, run in place (never copied).

Ollama (`ollama:NAME[:TAG]`): its store ($OLLAMA_MODELS, else ~/.ollama/models) holds
`manifests/HOST/NAMESPACE/NAME/TAG`, a JSON manifest whose layers list blobs by digest, and
`blobs/sha256-HEX`. The layer of media type `application/vnd.ollama.image.model` is the GGUF. A bare
NAME is `registry.ollama.ai/library/NAME`, `USER/NAME` is `registry.ollama.ai/USER/NAME`, and
`hf.co/OWNER/REPO` is what `ollama pull hf.co/...` stores. The blob's sha256 (its name) is checked once.

LM Studio (`lmstudio:PUBLISHER/REPO[:QUANT | /FILE]`): its models folder (~/.lmstudio/models, older
~/.cache/lm-studio/models; EDGESPEC_LMSTUDIO_MODELS overrides both) holds PUBLISHER/REPO/FILE.gguf,
the layout of the hub repo it was downloaded from.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from edgespec.errors import ModelFileError
from edgespec.models import digests
from edgespec.models.gguf_names import models_in, pick, with_shards
from edgespec.models.sources import InPlaceSource

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


# --- Ollama ----------------------------------------------------------------------------------------

def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def _ollama_manifest(name: str) -> tuple[Path, str]:
    """(manifest path, canonical name) for NAME[:TAG], USER/NAME[:TAG] or HOST/NS/NAME[:TAG]."""
    model, _, tag = name.partition(":")
    parts = [p for p in model.split("/") if p]
    if not parts or len(parts) > 3 or any(p in (".", "..") for p in parts) or "/" in tag:
        raise ModelFileError(f"{OLLAMA}{name} is not an Ollama model name; write ollama:NAME[:TAG] "
                             "(e.g. ollama:qwen2.5-coder:1.5b)")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    tag = tag or "latest"
    return ollama_dir().joinpath("manifests", *parts, tag), name if ":" in name else f"{name}:latest"


def _ollama_blob(manifest: Path, name: str) -> tuple[Path, str, int | None]:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        layer = next(lay for lay in layers if lay.get("mediaType") == OLLAMA_MODEL_LAYER)
        m = _DIGEST.fullmatch(layer["digest"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ModelFileError(f"the Ollama manifest of {name} ({manifest}) is corrupt or has no model layer; "
                             f"run `ollama pull {name}` again") from None
    if not m:
        raise ModelFileError(f"the Ollama manifest of {name} names no sha256 blob; run `ollama pull {name}` again")
    return ollama_dir() / "blobs" / f"sha256-{m.group(1)}", m.group(1), layer.get("size")


def resolve_ollama(name: str) -> Path:
    """The GGUF blob of an Ollama model, checked against its digest (once) and its listed size."""
    manifest, canonical = _ollama_manifest(name)
    if not manifest.is_file():
        have = ", ".join(m["name"] for m in ollama_models()) or "none"
        raise ModelFileError(f"Ollama has no model {canonical} in {ollama_dir()} (it has: {have}); "
                             f"run `ollama pull {canonical}` or set OLLAMA_MODELS to its store")
    blob, sha, size = _ollama_blob(manifest, canonical)
    if not blob.is_file():
        raise ModelFileError(f"the Ollama blob of {canonical} is missing ({blob}); run `ollama pull {canonical}`")
    if size is not None and blob.stat().st_size != size:
        raise ModelFileError(f"the Ollama blob of {canonical} has {blob.stat().st_size} bytes, its manifest says "
                             f"{size}; run `ollama pull {canonical}` again")
    if not digests.check(blob, sha):
        raise ModelFileError(f"the Ollama blob of {canonical} does not match its sha256 {sha[:12]}...; "
                             f"run `ollama rm {canonical} && ollama pull {canonical}`")
    return blob


def ollama_models() -> list[dict]:
    """Every model Ollama's manifests list: [{"name": ollama:..., "path", "bytes"}]."""
    root = ollama_dir() / "manifests"
    found = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
        host, *middle, model, tag = manifest.relative_to(root).parts
        if host == OLLAMA_REGISTRY and middle == ["library"]:
            name = f"{model}:{tag}"
        else:
            name = "/".join(([host] if host != OLLAMA_REGISTRY else []) + middle + [model]) + f":{tag}"
        try:
            blob, _, size = _ollama_blob(manifest, name)
        except ModelFileError:
            continue
        if blob.is_file():
            found.append({"name": OLLAMA + name, "path": blob, "bytes": blob.stat().st_size})
    return found


# --- LM Studio -------------------------------------------------------------------------------------

def lmstudio_dirs() -> list[Path]:
    override = os.environ.get("EDGESPEC_LMSTUDIO_MODELS")
    if override:
        return [Path(override).expanduser()]
    home = Path.home()
    return [d for d in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models") if d.is_dir()]


_LMS = re.compile(r"(?P<repo>[^/:]+/[^/:]+)(?::(?P<quant>[\w.-]+)|/(?P<file>.+))?")


def resolve_lmstudio(name: str) -> Path:
    """The GGUF an LM Studio name points at, in place."""
    m = _LMS.fullmatch(name)
    if not m or ".." in name.split("/"):
        raise ModelFileError(f"{LMSTUDIO}{name} is not an LM Studio model name; write "
                             "lmstudio:PUBLISHER/REPO[:QUANT] or lmstudio:PUBLISHER/REPO/FILE.gguf")
    for root in lmstudio_dirs():
        folder = root / m["repo"]
        if not folder.is_dir():
            continue
        names = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf") if p.is_file()]
        where = f"{LMSTUDIO}{m['repo']}"
        model = with_shards(names, m["file"], where) if m["file"] else pick(names, m["quant"], where)
        return folder / model.first
    searched = ", ".join(str(d) for d in lmstudio_dirs()) or "~/.lmstudio/models (absent)"
    raise ModelFileError(f"LM Studio has no {m['repo']} in {searched}; download it in LM Studio "
                         "(or set EDGESPEC_LMSTUDIO_MODELS to its models folder)")


def lmstudio_models() -> list[dict]:
    """Every GGUF model in LM Studio's folders: [{"name": lmstudio:..., "path", "bytes"}]."""
    found = []
    for root in lmstudio_dirs():
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            names = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf") if p.is_file()]
            models = models_in(names)
            quants = [x.quant for x in models]
            repo = folder.relative_to(root).as_posix()
            for model in models:
                tail = f":{model.quant}" if model.quant and quants.count(model.quant) == 1 else f"/{model.first}"
                found.append({"name": f"{LMSTUDIO}{repo}{tail}", "path": folder / model.first,
                              "bytes": sum((folder / f).stat().st_size for f in model.files)})
    return found


# --- the two sources -------------------------------------------------------------------------------

class OllamaSource(InPlaceSource):
    label, prefix, remove_hint = "ollama", OLLAMA, "`ollama rm NAME`"

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        return resolve_ollama(name[len(OLLAMA):])

    def installed(self) -> list[dict]:
        return ollama_models()


class LMStudioSource(InPlaceSource):
    label, prefix, remove_hint = "lmstudio", LMSTUDIO, "in LM Studio"

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        return resolve_lmstudio(name[len(LMSTUDIO):])

    def installed(self) -> list[dict]:
        return lmstudio_models()


OLLAMA_SOURCE = OllamaSource()
LMSTUDIO_SOURCE = LMStudioSource()
