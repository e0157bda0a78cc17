"""The model's own MTP head: a GGUF whose model carries NextN layers drafts through them.

A NextN block reads the target's hidden state at position p - 1 together with token p and predicts
token p + 1 (DeepSeek-V3 / GLM-4.5 / Qwen3.5 multi-token prediction). Run recursively on its own
hidden state it drafts a chain, at the cost of one decoder layer per token instead of a second model.
The head has its own KV (llama.cpp's MTP context): cell p holds token p read with the target's row
p - 1, kept in step with the committed text the way a draft model's is. Lossless like every drafter:
the target verifies what it proposes.
"""

from __future__ import annotations

import numpy as np

from edgespec.drafters.base import Draft, DrafterKind, DrafterSpec, _top_probability
from edgespec.runtimes.base import NextTokenHeads, Runtime, common_prefix_length
from edgespec.sampling import Sampler


class MtpDrafter:
    """Drafts k tokens with the target's NextN head (runtime capability `NextTokenHeads`).

    Before drafting, the head catches up on the committed positions it has not read (token p with
    the target's hidden row p - 1); the last committed token, which the target has not evaluated, is
    read with the row before it and starts the chain. Draft positions are dropped from the head's KV
    afterwards: they were read with the head's own rows, and the target's replace them next round.
    Memory: the NextN layer's KV and the target's hidden rows (n_ctx x n_embd float32).
    """

    name = "mtp"

    def __init__(self, target: Runtime):
        self.target = target
        self.head = target.next_token_head()

    def prepare(self, context: np.ndarray) -> None:
        self._catch_up(context, n_logits=0)

    def unseen(self, context: np.ndarray) -> int:
        """Committed positions the head has not read yet (its catch-up before drafting)."""
        return len(context) - common_prefix_length(self.head.tokens, context)

    def _catch_up(self, context: np.ndarray, n_logits: int):
        """Read context[kept:] into the head (the last `n_logits` rows' logits and hidden rows)."""
        kept = common_prefix_length(self.head.tokens, context)
        if kept == len(context) and n_logits:  # everything read: re-read the last token for its row
            kept -= 1
        self.head.truncate(kept)
        out = (np.empty((0, self.target.vocab.n_vocab), np.float32), None)
        for start in range(kept, len(context), self.target.sizing.n_batch):
            stop = min(len(context), start + self.target.sizing.n_batch)
            want = n_logits if stop == len(context) else 0
            if stop - start:
                out = self.head.decode(context[start:stop], self.target.hidden_rows(start - 1, stop - 1), want)
        return out

    def propose(self, context: np.ndarray, k: int, sampler: Sampler, gate=None, branch=None) -> Draft:
        """A chain of up to k tokens (`gate` may end it early; MTP drafts no trees, so `branch` is ignored)."""
        n = len(context)
        logits, hidden = self._catch_up(context, n_logits=1)
        tokens = np.zeros(k, dtype=np.int32)
        probs = None if sampler.params.greedy else np.empty((k, self.target.vocab.n_vocab))
        product = 1.0
        for i in range(k):
            row = sampler.rows(logits, context, tokens[:i])[0]
            tokens[i] = sampler.pick(row)
            if probs is not None:
                probs[i] = row
            if gate is not None and i + 1 < k:
                confidence = float(row[tokens[i]]) if probs is not None else _top_probability(row)
                product *= confidence
                if not gate(i + 1, confidence, product):
                    tokens, probs = tokens[:i + 1], None if probs is None else probs[:i + 1]
                    break
            if i + 1 < k:
                logits, hidden = self.head.decode(tokens[i:i + 1], hidden, 1)
        self.head.truncate(n)
        return Draft(tokens, probs)


def _build(sources) -> MtpDrafter | None:
    target = sources.target
    if target is None or NextTokenHeads not in getattr(target, "capabilities", ()):
        return None
    return MtpDrafter(target)


MTP = DrafterSpec(
    "mtp", DrafterKind.MODEL, "the model's own MTP (NextN) head", default_k=3, build=_build,
    step_s=lambda profile: profile.mtp_s, catchup_s=lambda profile: profile.mtp_s,  # drafts re-read, no catch-up pair
    unavailable="--mode mtp needs a model with MTP (NextN) layers (`edgespec models list` shows which have one)")
