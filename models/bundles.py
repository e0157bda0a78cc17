"""Exported bundles (`edgespec export --out DIR`) as a model source: which file each runtime runs.

A bundle is a directory with a manifest (runtimes/formats.BUNDLE_MANIFEST, written by
edgespec.exporters.bundle) naming its files per format: the GGUF target and draft llama.cpp runs,
the ONNX files by quantization, the ONNX layer graphs, the Core ML packages and their tokenizer,
the MLX repo directories.
Reading the manifest is here; choosing the runtime is edgespec.loader's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgespec.errors import ModelFileError
from edgespec.models.sources import Source
from edgespec.runtimes.formats import BUNDLE_MANIFEST, ONNX_QUANTS


def is_bundle(name_or_path: str | os.PathLike | None) -> bool:
    if name_or_path is None:
        return False
    path = Path(name_or_path).expanduser()
    return path.is_dir() and (path / BUNDLE_MANIFEST).is_file()


def _manifest(bundle: Path) -> dict:
    try:
        return json.loads((bundle / BUNDLE_MANIFEST).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{bundle / BUNDLE_MANIFEST} is corrupt ({exc}); export the bundle again") from None


def gguf(bundle: str | os.PathLike, role: str, required: bool = True) -> Path | None:
    """The GGUF target or draft a bundle names for llama.cpp (None: no such role and not `required`)."""
    bundle = Path(bundle).expanduser()
    manifest = _manifest(bundle)
    try:
        rel = (manifest.get("runtimes", {}).get("llama.cpp") or {}).get(role)
    except AttributeError as exc:
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


def gguf_draft(name_or_path: str | os.PathLike | None) -> Path | None:
    """The draft GGUF a bundle directory names for llama.cpp, or None (not a bundle, or no draft)."""
    return gguf(name_or_path, "draft", required=False) if is_bundle(name_or_path) else None


def onnx(bundle: str | os.PathLike, role: str, quant: str) -> Path | None:
    """A bundle's ONNX target or draft file (by `quant`: auto = fp32, else int8, else int4; a draft is
    listed in one quant only); None for a missing draft."""
    bundle = Path(bundle).expanduser()
    manifest = _manifest(bundle)
    try:
        listed = {a["quant"]: a["file"] for a in (manifest.get("formats", {}).get("onnx") or {}).get(role, [])}
    except (AttributeError, KeyError, TypeError) as exc:
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


def onnx_draft(name_or_path: str | os.PathLike | None, quant: str = "auto") -> Path | None:
    """The ONNX draft file a bundle lists (the asked quant where listed, else its best), or None."""
    return onnx(name_or_path, "draft", quant) if is_bundle(name_or_path) else None


def onnx_layers(bundle: str | os.PathLike) -> Path:
    """The target's layer graphs (managed KV): a bundle's onnx/target-layers."""
    path = Path(bundle).expanduser() / "onnx" / "target-layers"
    if not path.is_dir():
        raise ModelFileError(f"bundle {bundle} has no layer graphs for its target; export it with "
                             "--format onnx --onnx-layers to offload KV")
    return path


def coreml(bundle_dir: str | os.PathLike) -> tuple[Path, Path | None, Path]:
    """(target package, draft package or None, tokenizer directory) of an exported bundle."""
    bundle = Path(bundle_dir).expanduser()
    if not (bundle / BUNDLE_MANIFEST).is_file():
        raise ModelFileError(f"{bundle} is not an edgespec bundle (no {BUNDLE_MANIFEST})")
    entry = (_manifest(bundle).get("formats") or {}).get("coreml") or {}
    if not entry.get("target"):
        raise ModelFileError(f"bundle {bundle} has no Core ML package; export it with --format coreml")
    target = bundle / entry["target"][0]["file"]
    draft = bundle / entry["draft"][0]["file"] if entry.get("draft") else None
    tokenizer = bundle / "tokenizer"
    for what, p in (("target", target), ("draft", draft), ("tokenizer", tokenizer / "tokenizer.json")):
        if p is not None and not p.exists():
            raise ModelFileError(f"bundle {bundle} lists {p.relative_to(bundle)} as its Core ML {what} but it is "
                                 "missing; the bundle is incomplete, export it again")
    return target, draft, tokenizer


def mlx(bundle: str | os.PathLike, role: str) -> Path | None:
    """The MLX repo directory a bundle names for `--runtime mlx` as its target or draft (None: no draft)."""
    bundle = Path(bundle).expanduser()
    try:
        rel = (_manifest(bundle).get("runtimes", {}).get("mlx") or {}).get(role)
    except AttributeError as exc:
        raise ModelFileError(f"{bundle / BUNDLE_MANIFEST} is corrupt ({exc}); export the bundle again") from None
    if rel is None:
        if role == "target":
            raise ModelFileError(f"bundle {bundle} has no MLX target; export it with --format mlx")
        return None
    path = bundle / rel
    if not (path / "config.json").is_file():
        raise ModelFileError(f"bundle {bundle} lists {rel} as its MLX {role} but it is missing; "
                             "the bundle is incomplete, export it again")
    return path


def mlx_draft(name_or_path: str | os.PathLike | None) -> Path | None:
    """The MLX draft directory a bundle names, or None (not a bundle, or no MLX draft)."""
    return mlx(name_or_path, "draft") if is_bundle(name_or_path) else None


class BundleSource(Source):
    """A bundle directory: its GGUF target (the other formats are the loader's to pick)."""

    label, stored = "bundle", False

    def claims(self, name: str) -> bool:
        return is_bundle(name)

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        return gguf(name, "target")


SOURCE = BundleSource()
