"""What a model source is: a place whose names resolve to model files (the table is `store.SOURCES`).

A source claims the names it understands (by a prefix such as `hf:`, or by looking at the path),
resolves one to the file llama.cpp loads, lists what it holds on this machine, and, when it is a
store (`stored`), pulls and removes models for `edgespec models pull|rm`. Adding a source is one
module with one of these, and one line in `store.SOURCES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import EdgespecError


@dataclass(frozen=True)
class Pulled:
    """What `edgespec models pull NAME` says: "{name}: {note}: {path}"."""

    name: str
    path: Path
    note: str  # "already cached", "pulled, sha256 verified", "already on this machine"


class Source:
    label = ""    # what `edgespec models list` calls it ("catalog", "hf", ...)
    prefix = ""   # the name prefix it claims ("hf:"); empty: it claims by looking at the name
    stored = True  # a store's names: `models pull` and `models rm` apply (not to a plain path or a bundle)

    def claims(self, name: str) -> bool:
        return bool(self.prefix) and name.startswith(self.prefix)

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        """The model file the name means (fetched first if missing and `pull_if_missing`)."""
        raise NotImplementedError

    def installed(self) -> list[dict]:
        """What it holds on this machine: [{"name", "path", "bytes", ...}]."""
        return []

    def pull(self, name: str) -> Pulled:
        raise NotImplementedError

    def remove(self, name: str) -> int:
        """Delete the model; the bytes freed (0: it was not there)."""
        raise NotImplementedError


class InPlaceSource(Source):
    """Another tool's store, read where it is: nothing to pull, and removing is that tool's job."""

    remove_hint = ""  # how to remove a model there

    def pull(self, name: str) -> Pulled:
        return Pulled(name, self.resolve(name), "already on this machine")

    def remove(self, name: str) -> int:
        raise EdgespecError(f"{name} belongs to {self.label}'s store; remove it there ({self.remove_hint})")
