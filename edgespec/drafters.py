"""Drafters propose the tokens the target then verifies in one pass.

A drafter sees the committed context (prompt and emitted tokens; its last token is the one the
target has not evaluated yet) and returns up to k tokens, with the distributions it drew them from
when sampling, or None when it is deterministic (prompt lookup: one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgespec.runtimes.base import Runtime, common_prefix_length, sync_to
from edgespec.sampling import Sampler


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

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> "Draft":
        """The chain's first n tokens."""
        if n >= len(self) or self.parents is not None:
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], None,
                     None if self.confidence is None else self.confidence[:n], min(self.forced, n))


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32))


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


class DraftModelDrafter:
    """A small model with the target's vocabulary drafts k tokens autoregressively.

    Its KV holds the committed context except the last token, like the target's. After a
    verification the engine hands it the new context; `sync_to` keeps the accepted prefix, and the
    tokens it has not seen (the correction, or the last draft plus the bonus token when all passed)
    go into its next decode together. Memory: the draft's weights and KV plus k logits rows.
    """

    name = "draft"

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def prepare(self, context: np.ndarray) -> None:
        kept = sync_to(self.runtime, context[:-1])
        if kept < len(context) - 1:
            self.runtime.decode(context[kept:-1], 0)

    def unseen(self, context: np.ndarray) -> int:
        """Tokens of `context` the draft model would have to evaluate before drafting (its catch-up):
        the whole prompt when it was never prepared (auto prefills it only once it first pays)."""
        return len(context) - common_prefix_length(self.runtime.tokens, context)

    def propose(self, context: np.ndarray, k: int, sampler: Sampler, gate=None, branch=None) -> Draft:
        """Draft a chain of up to k tokens; `branch(n_nodes, p_alt, reach)` may add, at a position,
        the draft's second choice as a sibling leaf, turning the chain into a tree verified in one pass."""
        kept = sync_to(self.runtime, context)
        if kept == len(context):  # everything seen: re-evaluate the last token to get its row
            self.runtime.truncate(kept - 1)
            kept -= 1
        pending = context[kept:]
        tokens = np.zeros(k, dtype=np.int32)
        probs = None if sampler.params.greedy else np.empty((k, self.runtime.vocab.n_vocab))
        product = 1.0
        siblings: list[tuple[int, int]] = []  # (position, token)
        for i in range(k):
            logits = self.runtime.decode(pending, 1)
            row = sampler.rows(logits, context, tokens[:i])[0]
            tokens[i] = sampler.pick(row)
            if probs is not None:
                probs[i] = row
            pending = tokens[i:i + 1]
            if branch is not None:
                dist = row if probs is not None else _softmax(row)
                alt = _second_choice(dist, int(tokens[i]))
                if branch(i + 1 + len(siblings), float(dist[alt]), product):
                    siblings.append((i, alt))
            if gate is not None and i + 1 < k:
                confidence = float(row[tokens[i]]) if probs is not None else _top_probability(row)
                product *= confidence
                if not gate(i + 1, confidence, product):
                    tokens, probs = tokens[:i + 1], None if probs is None else probs[:i + 1]
                    break
            elif branch is not None:
                product *= float(dist[tokens[i]])
        if siblings:
            return with_siblings(tokens, siblings)
        return Draft(tokens, probs)


class PromptLookupDrafter:
    """Drafts by copying: find the latest earlier occurrence of the context's last n tokens and
    propose what followed it (Saxena 2023; llama.cpp's lookup). Costs a vectorised scan, no model.

    The longest match wins (n from `ngram_max` down to `ngram_min`), the latest among equals; the
    draft never runs past the end of the context. Auto asks it every round, so one scan for the last
    token and then at most ngram_max - 1 compares over the candidates it found, not a scan per n.
    """

    name = "lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def prepare(self, context: np.ndarray) -> None:
        pass

    def propose(self, context: np.ndarray, k: int, sampler: Sampler, gate=None, branch=None) -> Draft:
        # Ends of earlier occurrences of the last token (each with at least one token after it),
        # extended leftward while they keep matching the context's tail, up to ngram_max tokens.
        ends = np.flatnonzero(context[:-1] == context[-1])
        matched = np.ones(len(ends), dtype=np.int64)
        for j in range(1, self.ngram_max):
            live = (matched == j) & (ends >= j)
            if not live.any():
                break
            matched[live] += context[ends[live] - j] == context[-1 - j]
        longest = int(matched.max()) if ends.size else 0
        if longest < self.ngram_min:
            return EMPTY_DRAFT
        start = int(ends[np.flatnonzero(matched == longest)[-1]]) + 1
        return Draft(context[start:start + k].astype(np.int32))


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
