"""The draft model: a small model with the target's vocabulary drafts k tokens autoregressively."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.base import EMPTY_DRAFT, Draft, DrafterKind, DrafterSpec, _second_choice, _softmax, _top_probability, with_siblings
from edgespec.runtimes.base import Runtime, common_prefix_length, sync_to
from edgespec.sampling import Sampler


class DraftModelDrafter:
    """A small model with the target's vocabulary drafts k tokens autoregressively.

    Its KV holds the committed context except the last token, like the target's. After a
    verification the engine hands it the new context; `sync_to` keeps the accepted prefix, and the
    tokens it has not seen (the correction, or the last draft plus the bonus token when all passed)
    go into its next decode together. Memory: the draft's weights and KV plus k logits rows.
    """

    name = "draft"
    released = False  # set when a memory guard unloads the model: running generations draft nothing from it

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def prepare(self, context: np.ndarray) -> None:
        if self.released:
            return
        kept = sync_to(self.runtime, context[:-1])
        if kept < len(context) - 1:
            self.runtime.decode(context[kept:-1], 0)

    def unseen(self, context: np.ndarray) -> int:
        """Tokens of `context` the draft model would have to evaluate before drafting (its catch-up):
        the whole prompt when it was never prepared (auto prefills it only once it first pays)."""
        if self.released:
            return 0
        return len(context) - common_prefix_length(self.runtime.tokens, context)

    def propose(self, context: np.ndarray, k: int, sampler: Sampler, gate=None, branch=None) -> Draft:
        """Draft a chain of up to k tokens; `branch(n_nodes, p_alt, reach)` may add, at a position,
        the draft's second choice as a sibling leaf, turning the chain into a tree verified in one pass."""
        if self.released:
            return EMPTY_DRAFT
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


DRAFT_MODEL = DrafterSpec(
    "draft", DrafterKind.MODEL, "draft model", default_k=4, trees=True,
    build=lambda sources: DraftModelDrafter(sources.draft) if sources.draft is not None else None,
    unavailable="--mode draft needs a draft model: pass --draft MODEL (or use --mode lookup)")
