"""Suffix drafting across requests (SuffixDecoding, Oliaro et al. 2024; vLLM's `suffix` method).

The drafter matches the longest suffix of the context against everything the model has produced:
this request's prompt and text so far, and the outputs of earlier requests kept in a bounded
`SuffixHistory`. Among the occurrences of that suffix it follows the most frequent continuation,
token by token, as a walk down a suffix tree would, and gives each token a confidence: the share of
the occurrences still matching that go on with it, with a pseudo-count of 1 / tokens matched for
"something else" (one occurrence after a long match is strong evidence, after a short one weak).
Auto weighs that confidence, calibrated against
what the target accepts, like any drafter's (policy.ConfidenceCalibration). The runner-up
continuation at a position can become a sibling leaf of a token tree where the cost profile says
a wider pass pays.

The walk is the suffix tree's, computed on the fly: the occurrences are found by one vectorised
scan, so there is no index to build, update or bound. Memory: the history's int32 tokens (4 bytes
each, `limit` at most) plus one separator per stored output, and a transient copy of history plus
context per proposal.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import struct
from collections import Counter, deque
from pathlib import Path

import numpy as np

from edgespec.atomic import atomic_write
from edgespec.drafters.base import EMPTY_DRAFT, FEW_OCCURRENCES, Draft, DrafterKind, DrafterSpec, match_lengths, with_siblings
from edgespec.errors import EdgespecError
from edgespec.sampling import Sampler

DEFAULT_HISTORY_TOKENS = 1 << 16   # 256 KiB of int32 tokens
MAX_MATCH = 32                     # longest suffix matched: longer ones add cost, not accuracy
SEPARATOR = -1                     # between stored outputs: no match or continuation crosses it
FORMAT = "edgespec-suffix-history/1"
_MAGIC = b"EDGESPEC-SUFFIX\n"


class SuffixHistory:
    """The outputs of earlier requests, oldest dropped first once `limit` tokens are held.

    `key` names the vocabulary the token ids belong to (vocabulary_key); a saved history is only
    loaded for the same key.
    """

    def __init__(self, limit: int = DEFAULT_HISTORY_TOKENS, key: str = ""):
        if limit < 1:
            raise EdgespecError(f"the suffix history limit must be at least 1 token, got {limit}; "
                                f"use --mode lookup to draft without a history")
        self.limit = limit
        self.key = key
        self._lengths: deque[int] = deque()  # of each stored output, oldest first
        self._corpus = np.zeros(0, dtype=np.int32)

    @property
    def tokens(self) -> np.ndarray:
        """Every stored output, each followed by SEPARATOR (int32)."""
        return self._corpus

    @property
    def n_outputs(self) -> int:
        return len(self._lengths)

    def __len__(self) -> int:
        return len(self._corpus) - len(self._lengths)

    def outputs(self) -> list[np.ndarray]:
        ends = np.cumsum(np.asarray(self._lengths, dtype=np.int64) + 1)
        return [self._corpus[end - n - 1:end - 1] for n, end in zip(self._lengths, ends)]

    def clear(self) -> None:
        self._lengths.clear()
        self._corpus = np.zeros(0, dtype=np.int32)

    def shrink(self, limit: int) -> None:
        """Keep at most `limit` tokens from now on, the newest outputs; the old array is let go, so its
        memory goes back (a memory guard's step)."""
        self.limit = max(1, int(limit))
        lengths, held, drop = self._lengths, len(self), 0
        while lengths and held > self.limit:
            n = lengths.popleft()
            held, drop = held - n, drop + n + 1
        self._corpus = self._corpus[drop:].copy() if drop else self._corpus  # a copy: a view would keep the old

    def add(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)[-self.limit:]
        if len(tokens) < 2:  # nothing to learn a continuation from
            return
        held, drop = len(self), 0
        while held + len(tokens) > self.limit:  # the oldest outputs make room
            n = self._lengths.popleft()
            held, drop = held - n, drop + n + 1
        self._lengths.append(len(tokens))
        self._corpus = np.concatenate([self._corpus[drop:], tokens, [SEPARATOR]]).astype(np.int32)

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: the file is complete or absent."""
        path = Path(path)
        header = json.dumps({"format": FORMAT, "key": self.key, "limit": self.limit,
                             "lengths": list(self._lengths)}).encode()
        with atomic_write(path) as f:
            f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
            for output in self.outputs():
                f.write(output.astype("<i4").tobytes())
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Add the outputs saved at `path` (refused, with nothing changed, if corrupt or for another vocabulary)."""
        path = Path(path)
        what = f"the suffix history {path}"
        try:
            raw = path.read_bytes()
            if not raw.startswith(_MAGIC):
                raise ValueError("not an edgespec suffix history")
            (n,) = struct.unpack_from("<Q", raw, len(_MAGIC))
            start = len(_MAGIC) + 8
            header = json.loads(raw[start:start + n])
            lengths = [int(x) for x in header["lengths"]]
            body = np.frombuffer(raw, dtype="<i4", offset=start + n)
            if header.get("format") != FORMAT or len(body) != sum(lengths) or min(lengths, default=2) < 2:
                raise ValueError("its header does not match its contents")
        except OSError as e:
            raise EdgespecError(f"cannot read {what}: {e.strerror or e}") from e
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise EdgespecError(f"{what} is corrupt ({e}); delete it or pass another --history-file") from e
        if self.key and header.get("key") != self.key:
            raise EdgespecError(f"{what} was saved for another vocabulary; use it with the model that made it "
                                f"or pass another --history-file")
        for output in np.split(body.astype(np.int32), np.cumsum(lengths)[:-1]) if lengths else []:
            self.add(output)


def vocabulary_key(runtime) -> str:
    """A short identity of a runtime's vocabulary: token ids mean the same text under the same key."""
    vocab = runtime.vocab
    h = hashlib.sha256(f"{vocab.vocab_type}:{vocab.n_vocab}".encode())
    for token in range(0, vocab.n_vocab, max(1, vocab.n_vocab // 512)):  # a strided sample suffices
        h.update(runtime.token_bytes(token) + b"\0")
    return h.hexdigest()[:16]


class SuffixDrafter:
    """Proposes the most frequent continuation of the longest suffix match in history + context.

    `propose` returns a chain with a confidence per token (conditional on the tokens before it);
    with `branch`, the runner-up continuation at a position may be added as a sibling leaf.
    `remember(tokens)` stores a finished request's output for later requests.
    """

    name = "suffix"

    def __init__(self, history: SuffixHistory, max_match: int = MAX_MATCH, min_reach: float = 0.1):
        self.history = history
        self.max_match = max_match
        self.min_reach = min_reach  # stop where the path's chance (the product of confidences) falls below

    def prepare(self, context: np.ndarray) -> None:
        pass

    def remember(self, tokens: np.ndarray) -> None:
        self.history.add(tokens)

    def propose(self, context: np.ndarray, k: int, sampler: Sampler | None = None, gate=None,
                branch=None) -> Draft:
        if k < 1 or len(context) < 1:
            return EMPTY_DRAFT
        corpus = np.concatenate([self.history.tokens, np.asarray(context, dtype=np.int32)])
        ends, matched = self._longest_match(corpus, np.asarray(context[-self.max_match:], dtype=np.int32))
        if not len(ends):
            return EMPTY_DRAFT
        tokens, confidence, siblings = [], [], []
        reach = 1.0
        # Where each occurrence's continuation stands, ascending: an array while there are many (a short
        # match in a long history), a Python list once there are few, counted in a dict: auto asks every
        # round, with the caches a target pass leaves, where each of the dozen numpy calls np.unique and
        # a lexsort make costs ~15x what it does back to back (bench/auto_idle.py --cold).
        following = [at + 1 for at in ends] if isinstance(ends, list) else ends + 1
        for i in range(k):
            if len(following) and following[-1] >= len(corpus):  # ran into the context's end (only the last can)
                following = following[:-1]
            if not len(following):
                break
            if len(following) == 1 and branch is None:  # one occurrence left: the rest is a plain copy
                return self._copy_rest(corpus, int(following[0]), k - i, matched + i, tokens, confidence, reach, gate)
            if len(following) <= FEW_OCCURRENCES and not isinstance(following, list):
                following = following.tolist()
            nxt = corpus[following]  # each occurrence's next token, a list where `following` is one
            if isinstance(following, list):
                nxt = nxt.tolist()
            ranked = self._ranked(nxt, following)
            if not ranked:
                break
            (best, n_best), second = ranked[0], ranked[1] if len(ranked) > 1 else None
            # The share of occurrences that go on this way, with a pseudo-count for "something else"
            # that shrinks as the matched context grows: one occurrence after a 1-token match is
            # weak evidence, one after 16 matching tokens is strong.
            total = len(nxt) + 1.0 / (matched + i)
            p = n_best / total
            if reach * p < self.min_reach:
                break
            if branch is not None and second is not None:
                if branch(len(tokens) + 1 + len(siblings), second[1] / total, reach):
                    siblings.append((i, second[0]))
            tokens.append(best)
            confidence.append(p)
            reach *= p
            if gate is not None and i + 1 < k and not gate(i + 1, p, reach):
                break
            if isinstance(following, list):
                following = [at + 1 for at, token in zip(following, nxt) if token == best]
            else:
                following = following[nxt == best] + 1
        chain = np.asarray(tokens, dtype=np.int32)
        if siblings:
            return with_siblings(chain, siblings)
        return Draft(chain, confidence=np.asarray(confidence))

    def _copy_rest(self, corpus: np.ndarray, at: int, n: int, matched: int, tokens: list, confidence: list,
                   reach: float, gate) -> Draft:
        """The walk with one occurrence left: copy what follows it up to its output's end, each token
        with confidence 1 / (1 + 1 / tokens matched), while the path stays likely (in Python: a copy
        is at most k tokens, and this runs every round)."""
        run = corpus[at:at + n].tolist()
        if SEPARATOR in run:
            run = run[:run.index(SEPARATOR)]
        for j, token in enumerate(run):
            p = 1.0 / (1.0 + 1.0 / (matched + j))
            if reach * p < self.min_reach:
                break
            reach *= p
            tokens.append(token)
            confidence.append(p)
            if gate is not None and j + 1 < n and not gate(len(tokens), p, reach):
                break
        return Draft(np.asarray(tokens, dtype=np.int32), confidence=np.asarray(confidence, dtype=np.float64))

    @staticmethod
    def _ranked(nxt, following) -> list[tuple[int, int]]:
        """The two commonest tokens of `nxt` but SEPARATOR, with their counts, the commonest first and
        the latest (where it follows at the largest position of `following`, ascending) among equals.
        Lists (few) are counted in dicts, arrays (many) by numpy."""
        if isinstance(nxt, list):
            counts = Counter(nxt)
            counts.pop(SEPARATOR, None)
            latest = dict(zip(nxt, following))
            top = heapq.nlargest(2, counts, key=lambda t: (counts[t], latest[t]))
            return [(t, counts[t]) for t in top]
        live = nxt != SEPARATOR
        values, counts = np.unique(nxt[live], return_counts=True)
        latest = np.full(len(values), -1, dtype=np.int64)
        np.maximum.at(latest, np.searchsorted(values, nxt[live]), following[live])
        order = np.lexsort((-latest, -counts))[:2]
        return list(zip(values[order].tolist(), counts[order].tolist()))

    @staticmethod
    def _longest_match(corpus: np.ndarray, pattern: np.ndarray) -> tuple[np.ndarray | list[int], int]:
        """End positions of the longest suffix of `pattern` found in corpus[:-1] (so each has a
        continuation), and its length. A few occurrences of the last token (a list comes back) are
        each walked leftward in Python; many (an array) are extended together one token at a time
        (each at once, once a single candidate is left)."""
        ends, matched = np.flatnonzero(corpus[:-1] == pattern[-1]), 1
        if len(ends) <= FEW_OCCURRENCES:
            ends = ends.tolist()
            lengths = match_lengths(corpus, ends, pattern.tolist())
            longest = max(lengths, default=0)
            return [end for end, n in zip(ends, lengths) if n == longest], longest
        while ends.size > 1 and matched < len(pattern):
            before = ends - matched
            ok = before >= 0
            ok[ok] = corpus[before[ok]] == pattern[-1 - matched]
            if not ok.any():
                break
            ends, matched = ends[ok], matched + 1
        if ends.size == 1 and matched < len(pattern):
            end = int(ends[0])
            span = min(len(pattern), end + 1)
            left = corpus[end + 1 - span:end + 1][::-1] == pattern[::-1][:span]
            matched = span if left.all() else int(np.argmin(left))
        return ends, matched


SUFFIX = DrafterSpec(
    "suffix", DrafterKind.COPIES, "copy from the prompt, the text so far and earlier outputs", default_k=8,
    build=lambda sources: SuffixDrafter(sources.history) if sources.history is not None else None,
    ask_s=lambda profile: profile.suffix_s, trees=True, confident=True)
