"""A prefix cache: the KV of earlier requests, kept in memory so a request that shares a prefix
with one of them (a system prompt, an earlier turn of a chat) skips prefilling it.

The runtimes hold one KV sequence, which is itself the cheapest cache (the engine's `sync_to` keeps
whatever prefix the next prompt shares with it). This cache adds more entries: after each request
the whole sequence's KV is saved as a blob (`runtime.save_state()`, as llama.cpp serialises it); a
later prompt whose longest shared prefix is in a blob, not in the live sequence, gets that blob
restored first. Entries are bounded by a byte limit and evicted least recently used first; an
entry that is a prefix of a newer one is replaced by it.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from edgespec.runtimes.base import Runtime, common_prefix_length


@dataclass
class _Entry:
    tokens: dict[str, np.ndarray]   # per runtime: the token ids whose KV the blob holds
    blobs: dict[str, bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs.values()) + sum(t.nbytes for t in self.tokens.values())


class PrefixCache:
    """KV blobs of earlier sequences under a byte limit, least recently used evicted first.

    `runtimes` maps names to runtimes that implement `SavedState` (`save_state`, `load_state`);
    "target" decides which entry matches. Thread-safe; the caller must hold the runtimes.
    """

    def __init__(self, max_bytes: int, *, min_tokens: int = 16, min_gain: int = 4):
        self.max_bytes = max(0, int(max_bytes))
        self.min_tokens = min_tokens   # shorter sequences are not worth an entry
        self.min_gain = min_gain       # restore a blob only when it saves this many tokens over the live KV
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self.hits = self.live_hits = self.misses = self.evictions = self.stores = 0
        self.restored_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "live_hits": self.live_hits, "misses": self.misses,
                "evictions": self.evictions, "stores": self.stores, "restored_tokens": self.restored_tokens}

    def restore(self, runtimes: Mapping[str, Runtime], prompt_ids: Sequence[int]) -> dict:
        """Load the entry sharing the longest prefix with the prompt, when it beats the live KV.

        Returns what happened: `source` ("live", "cache" or "none") and `tokens`, the prefix length
        whose KV is now held (the engine keeps it and prefills the rest).
        """
        target = runtimes["target"]
        want = np.asarray(prompt_ids, dtype=np.int32)[:-1]  # the engine feeds the last token itself
        live = common_prefix_length(target.tokens, want)
        with self._lock:
            best_key, best = None, live + self.min_gain - 1
            for key, entry in self._entries.items():
                n = common_prefix_length(entry.tokens["target"], want)
                if n > best:
                    best_key, best = key, n
            if best_key is None:
                if live:
                    self.live_hits += 1
                else:
                    self.misses += 1
                return {"source": "live" if live else "none", "tokens": live}
            entry = self._entries[best_key]
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.restored_tokens += best
        for name, rt in runtimes.items():
            if name in entry.blobs:
                rt.load_state(entry.blobs[name], entry.tokens[name])
        return {"source": "cache", "tokens": best}

    def store(self, runtimes: Mapping[str, Runtime]) -> bool:
        """Save the runtimes' current KV as an entry; False when it is too short or too large to keep."""
        target_tokens = runtimes["target"].tokens
        if len(target_tokens) < self.min_tokens or self.max_bytes == 0:
            return False
        with self._lock:
            for key, entry in list(self._entries.items()):
                held = entry.tokens["target"]
                if len(held) <= len(target_tokens) and common_prefix_length(held, target_tokens) == len(held):
                    del self._entries[key]  # the new entry covers every prompt this one could serve
        entry = _Entry({name: rt.tokens for name, rt in runtimes.items()},
                       {name: rt.save_state() for name, rt in runtimes.items()})
        if entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
                self._entries.popitem(last=False)
                self.evictions += 1
            self._entries[next(self._keys)] = entry
            self.stores += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
