"""Prompt lookup: draft by copying what followed an earlier occurrence of the context's tail."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.base import EMPTY_DRAFT, Draft, DrafterKind, DrafterSpec
from edgespec.sampling import Sampler

FEW_OCCURRENCES = 64  # candidates walked in Python, not arrays (PromptLookupDrafter.propose)


class PromptLookupDrafter:
    """Drafts by copying: find the latest earlier occurrence of the context's last n tokens and
    propose what followed it (Saxena 2023; llama.cpp's lookup). Costs a vectorised scan, no model.

    The longest match wins (n from `ngram_max` down to `ngram_min`), the latest among equals; the
    draft never runs past the end of the context. Auto asks it every round, so one scan for the last
    token and then a walk leftward from each candidate it found, not a scan per n.

    The match's length is the proposal's evidence (Draft.evidence): on the race's texts a copy after a
    1-token match had its first token accepted 19-34 % of the time, after a 4-token match 69-82 %
    (bench/policy_replay.py), so auto rates each match length apart.
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
        if len(ends) <= FEW_OCCURRENCES:
            longest, end = self._longest_few(context, ends.tolist())
        else:
            longest, end = self._longest_many(context, ends)
        if longest < self.ngram_min:
            return EMPTY_DRAFT
        return Draft(context[end + 1:end + 1 + k].astype(np.int32), evidence=longest)

    # Auto asks every round, right after a target pass has streamed the weights through the caches,
    # where each numpy call costs ~15x what it does back to back (bench/auto_idle.py --cold): a few
    # occurrences (the median is 1 on the race's texts) are walked in Python, many by arrays.

    def _longest_few(self, context: np.ndarray, ends: list[int]) -> tuple[int, int]:
        """(length, end) of the longest match among `ends`, the latest among equals."""
        tail = context[-self.ngram_max:].tolist()[::-1]  # tail[j]: the token j before the last
        longest, end = 0, -1
        for at in reversed(ends):
            before = context[max(at + 1 - len(tail), 0):at + 1].tolist()[::-1]
            n = 1
            while n < len(before) and before[n] == tail[n]:
                n += 1
            if n > longest:
                longest, end = n, at
                if n == len(tail):
                    break
        return longest, end

    def _longest_many(self, context: np.ndarray, ends: np.ndarray) -> tuple[int, int]:
        """As _longest_few, vectorised: one scan for the last token, then at most ngram_max - 1
        compares over the candidates."""
        matched = np.ones(len(ends), dtype=np.int64)
        for j in range(1, self.ngram_max):
            live = (matched == j) & (ends >= j)
            if not live.any():
                break
            matched[live] += context[ends[live] - j] == context[-1 - j]
        longest = int(matched.max())
        return longest, int(ends[np.flatnonzero(matched == longest)[-1]])

PROMPT_LOOKUP = DrafterSpec(
    "lookup", DrafterKind.COPIES, "prompt lookup", default_k=4,
    build=lambda sources: PromptLookupDrafter(), ask_s=lambda profile: profile.lookup_s)
