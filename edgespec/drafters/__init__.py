"""Drafters: one module each (lookup, draft_model, suffix), what they share in base.py, and the one table
(table.py) the engine, `--mode` and auto read. Importing this package gives the names callers use."""

from edgespec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DrafterKind, DrafterSpec, DraftSources, lead_with, with_siblings
from edgespec.drafters.draft_model import DRAFT_MODEL, DraftModelDrafter
from edgespec.drafters.lookup import PROMPT_LOOKUP, PromptLookupDrafter

__all__ = ["EMPTY_DRAFT", "Draft", "Drafter", "DrafterKind", "DrafterSpec", "DraftSources", "lead_with", "with_siblings",
           "DRAFT_MODEL", "DraftModelDrafter", "PROMPT_LOOKUP", "PromptLookupDrafter"]
