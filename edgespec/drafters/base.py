"""Drafters propose the tokens the target then verifies in one pass.

A drafter sees the committed context (prompt and emitted tokens; its last token is the one the
target has not evaluated yet) and returns up to k tokens, with the distributions it drew them from
when sampling, or None when it is deterministic (prompt lookup: one-hot).

This module holds what every drafter shares: the `Draft` it returns, the `Drafter` protocol, and the
`DrafterSpec` that declares one. Each drafter is one module of this package (lookup.py, draft_model.py,
suffix.py) with its class and its spec beside it, registered in the one table, edgespec.drafters.table.DRAFTERS:
the engine builds its drafters from that table, `--mode` offers them, and auto weighs them by their declared kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import numpy as np

from edgespec.runtimes.base import Runtime
from edgespec.sampling import Sampler

# Annotations below name edgespec.machine.profile.CostProfile and edgespec.drafters.suffix.SuffixHistory without importing
# them: both modules import this one.


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray               # int32, shape (m,), m <= k
    probs: np.ndarray | None = None  # (m, n_vocab) draft distributions, None = deterministic
    parents: np.ndarray | None = None  # a tree: parent node of each token (0 = the last committed
    #                                    token, i + 1 = tokens[i]); None = a chain
    confidence: np.ndarray | None = None  # (m,) the drafter's own chance that token i follows, given
    #                                       tokens[:i] did (suffix drafting); None = not given
    forced: int = 0  # the first `forced` tokens are a constraint's forced continuation (a chain
    #                  under any tree), not the drafter's
    certain: np.ndarray | None = None  # bool (forced,): forced token i is the only token the grammar
    #                                    admits there, so its row need not be computed (Engine.verify_rows)
    evidence: int = 0  # how much context backs the proposal (prompt lookup: the n-gram length it
    #                    matched); auto keeps its acceptance per level. 0 = not stated

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> "Draft":
        """The chain's first n tokens."""
        if n >= len(self) or self.parents is not None:
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], None,
                     None if self.confidence is None else self.confidence[:n], min(self.forced, n),
                     None if self.certain is None else self.certain[:n], self.evidence)


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32))


# The model-free drafters find earlier occurrences of the context's last token and extend each match
# leftward. Auto asks them every round, right after a target pass has streamed the weights through
# the caches, where each numpy call on a short array costs ~15x what it does back to back
# (bench/auto_idle.py --cold): a few occurrences (the median on the race's texts is one) are walked
# in Python, many by arrays.
FEW_OCCURRENCES = 64


def match_lengths(tokens: np.ndarray, ends: list[int], pattern: list[int]) -> list[int]:
    """For each position in `ends` (where tokens[end] == pattern[-1]), how many of `pattern`'s last
    tokens tokens[:end + 1] ends with."""
    tail = pattern[::-1]
    lengths = []
    for end in ends:
        before = tokens[max(end + 1 - len(tail), 0):end + 1].tolist()[::-1]
        n = 1
        while n < len(before) and before[n] == tail[n]:
            n += 1
        lengths.append(n)
    return lengths


def lead_with(forced: np.ndarray, draft: Draft) -> Draft:
    """`forced` tokens, then the draft (drafted from the context with them appended): one round's
    proposal. The forced tokens are one-hot proposals, certain where the grammar admits nothing
    else; verification judges them like any drafted token, so they need no trust."""
    f = len(forced)
    if not f:
        return draft
    tokens = np.concatenate([forced, draft.tokens]).astype(np.int32)
    probs = None
    if draft.probs is not None:
        probs = np.zeros((f, draft.probs.shape[1]), dtype=draft.probs.dtype)
        probs[np.arange(f), forced] = 1.0
        probs = np.concatenate([probs, draft.probs])
    parents = None
    if draft.parents is not None:  # the tree hangs off the last forced token (node f)
        parents = np.concatenate([np.arange(f), np.asarray(draft.parents) + f]).astype(np.int64)
    confidence = None if draft.confidence is None else np.concatenate([np.ones(f), draft.confidence])
    return Draft(tokens, probs, parents, confidence, forced=f + draft.forced)


class Drafter(Protocol):
    name: str

    def prepare(self, context: np.ndarray) -> None:
        """Prefill whatever the drafter needs for this context (counted in time to first token)."""

    def propose(self, context: np.ndarray, k: int, sampler: Sampler, gate=None, branch=None) -> Draft:
        """Up to k tokens continuing `context`. `gate(n, confidence, product) -> bool` may end a
        draft early, and `branch(n_nodes, p_alt, reach) -> bool` may add a runner-up token as a
        sibling leaf, making a tree; drafters that know their confidence honour them, others ignore them."""


class DrafterKind(Enum):
    """How auto asks a drafter and learns how far to trust it (edgespec.policy.AdaptivePolicy)."""

    COPIES = "copies"  # model-free: copies from text. Nothing to prefill; so cheap that auto asks it every
    #                    round, used or not, and scores the proposal against what the target commits
    MODEL = "model"    # a draft model: prefilled and kept in step with the committed text, at a cost per
    #                    drafted token (the profile's draft_s); asked only in rounds that use it


@dataclass(frozen=True)
class DraftSources:
    """What an engine has to build its drafters from."""

    draft: Runtime | None = None              # the draft model, if one is loaded
    target: Runtime | None = None             # the target (its own MTP head drafts, where it has one)
    history: "SuffixHistory | None" = None    # earlier generations' outputs (suffix drafting)


@dataclass(frozen=True)
class DrafterSpec:
    """One row of the drafter table: what the engine, auto and the CLI know about a drafter."""

    name: str                 # the drafter's `name`: its --mode, its key in stats and in auto's estimates
    kind: DrafterKind
    summary: str              # what --mode NAME does, for the CLI's help
    default_k: int            # tokens drafted per round under --mode NAME
    build: Callable[[DraftSources], "Drafter | None"]  # None: not available with these sources
    ask_s: Callable[["CostProfile"], float] | None = None  # COPIES: what auto pays to ask it once a round
    step_s: Callable[["CostProfile"], "float | None"] = lambda profile: profile.draft_s  # MODEL: one drafted token
    catchup_s: Callable[["CostProfile"], "float | None"] = lambda profile: profile.draft_catchup_s  # MODEL: two tokens
    trees: bool = False       # can widen a proposal into a token tree (honours `branch`)
    confident: bool = False   # states a confidence per token, which auto calibrates (ConfidenceCalibration)
    unavailable: str = ""     # the error for --mode NAME when `build` gives None

    def __post_init__(self):
        if self.kind is DrafterKind.COPIES and self.ask_s is None:
            raise ValueError(f"drafter {self.name!r} copies, so auto asks it every round: declare its ask_s")


def _top_probability(logits: np.ndarray) -> float:
    """Softmax probability of the argmax: the draft's confidence in a greedy token."""
    top = logits.max()
    return float(1.0 / np.exp(logits - top).sum())


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def _second_choice(dist: np.ndarray, first: int) -> int:
    top2 = np.argpartition(-dist, 1)[:2]
    return int(top2[0] if top2[0] != first else top2[1])


def with_siblings(chain: np.ndarray, siblings: list[tuple[int, int]]) -> Draft:
    """A chain plus sibling leaves: each sibling is an alternative to the chain token at its position."""
    tokens, parents = [], []
    node_of_position = []  # tree node of chain position i
    alternatives = dict(siblings)
    for i, token in enumerate(chain.tolist()):
        parent = node_of_position[-1] if node_of_position else 0
        tokens.append(token)
        parents.append(parent)
        node_of_position.append(len(tokens))
        if i in alternatives:  # listed after the chain token, so the chain stays the first child
            tokens.append(alternatives[i])
            parents.append(parent)
    return Draft(np.asarray(tokens, dtype=np.int32), None, np.asarray(parents, dtype=np.int64))
