"""The drafters edgespec knows, one row each: the engine builds its drafters from this table, `--mode`
offers each by name, and auto weighs each by the kind its row declares (edgespec.policy).

Adding a drafter: a module in this package with its class and its `DrafterSpec` (see base.py), a test,
and a row here. A model-free drafter (DrafterKind.COPIES) needs nothing else; a second draft model
would also need its own step cost in the profile (auto prices DrafterKind.MODEL by the profile's
draft_s).
"""

from __future__ import annotations

from edgespec.drafters.base import Drafter, DrafterSpec, DraftSources
from edgespec.drafters.draft_model import DRAFT_MODEL
from edgespec.drafters.lookup import PROMPT_LOOKUP
from edgespec.drafters.mtp import MTP
from edgespec.errors import EdgespecError
from edgespec.drafters.suffix import SUFFIX

# The order is --mode's order in help and errors, and the order auto weighs drafters of one kind in
# (the first of equally fast proposals wins).
DRAFTERS: tuple[DrafterSpec, ...] = (DRAFT_MODEL, MTP, PROMPT_LOOKUP, SUFFIX)
BY_NAME: dict[str, DrafterSpec] = {spec.name: spec for spec in DRAFTERS}


def spec_for(name: str) -> DrafterSpec:
    """The row of the drafter called `name`."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise EdgespecError(f"drafter {name!r} is not in the drafter table (edgespec.drafters.table.DRAFTERS)") from None


def build_drafters(sources: DraftSources) -> dict[str, Drafter]:
    """Every drafter these sources allow, by name, in table order."""
    built = {spec.name: spec.build(sources) for spec in BY_NAME.values()}
    return {name: drafter for name, drafter in built.items() if drafter is not None}
