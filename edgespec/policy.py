"""Policies decide, each round, which drafter proposes and how many tokens (k = 0: plain decoding)."""

from __future__ import annotations

from typing import Protocol

from edgespec.drafters import Drafter
from edgespec.errors import EdgespecError

MODES = ("auto", "ar", "draft", "lookup")
DEFAULT_DRAFT_MAX = {"draft": 4, "lookup": 4}


class Policy(Protocol):
    @property
    def drafters(self) -> list[Drafter]:
        """Every drafter this policy may pick (the engine prepares them all at prefill)."""

    def choose(self, remaining: int) -> tuple[Drafter | None, int]:
        """The drafter and draft length for the next round; `remaining` tokens may still be emitted."""


class FixedPolicy:
    """The same drafter and draft length every round; no drafter means plain decoding."""

    def __init__(self, drafter: Drafter | None, k: int):
        self.drafter = drafter if k > 0 else None
        self.k = k if drafter is not None else 0

    @property
    def drafters(self) -> list[Drafter]:
        return [self.drafter] if self.drafter else []

    def choose(self, remaining: int) -> tuple[Drafter | None, int]:
        # The verify pass always emits one token of its own, so drafting past remaining - 1 is waste.
        k = min(self.k, remaining - 1)
        return (self.drafter, k) if k > 0 else (None, 0)


def resolve_mode(mode: str, has_draft_model: bool) -> str:
    """`auto` means the draft model when one is loaded, else plain decoding (until the adaptive policy)."""
    if mode not in MODES:
        raise EdgespecError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "auto":
        return "draft" if has_draft_model else "ar"
    if mode == "draft" and not has_draft_model:
        raise EdgespecError("--mode draft needs a draft model: pass --draft MODEL (or use --mode lookup)")
    return mode
