"""The runtime protocol: what the speculative engine needs from a model, and nothing more.

A runtime holds one model and the KV cache of one token sequence. It appends tokens to that
sequence and returns logits only for the rows asked for, rolls the sequence back to a prefix, and
reports its memory. llama.cpp implements it today; ONNX Runtime, Core ML and a remote verifier
implement the same protocol later, so the engine never learns which one it talks to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from edgespec.errors import ContextOverflowError


@dataclass(frozen=True)
class VocabInfo:
    """What the engine and the vocabulary check need to know about a tokenizer."""

    n_vocab: int
    vocab_type: str  # "spm" | "bpe" | "wpm" | "ugm" | "rwkv" | "none"
    bos: int | None
    eos: int | None
    add_bos: bool
    eog: frozenset[int]  # every end-of-generation token (eos, eot, im_end, ...)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a runtime holds, by kind. `total` is what it adds to the process."""

    weights: int
    kv_cache: int
    logits: int
    other: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.logits + sum(self.other.values())

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "logits": self.logits,
                **self.other, "total": self.total}


@runtime_checkable
class Runtime(Protocol):
    """One model, one KV sequence. Not thread-safe: the engine serialises calls."""

    name: str
    n_ctx: int
    vocab: VocabInfo

    @property
    def n_past(self) -> int:
        """Number of tokens whose KV is held."""

    @property
    def tokens(self) -> np.ndarray:
        """The token ids whose KV is held, in order (int32, a copy)."""

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append `tokens`; return float32 logits of the last `n_logits` of them, shape (n_logits, n_vocab)."""

    def truncate(self, n: int) -> None:
        """Drop the KV of every position >= n."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes this token contributes to the output text (may be part of a UTF-8 character)."""

    def token_text(self, token: int) -> str:
        """The vocabulary's own text of a token (as stored, for comparing vocabularies)."""

    def chat_template(self) -> str | None: ...

    def memory(self) -> MemoryReport: ...

    def close(self) -> None: ...


class TokenSequence:
    """What every one-sequence runtime keeps about its sequence: the ids whose KV is held, and the
    checks an append or a rollback makes before the runtime touches its KV."""

    n_ctx: int

    def _start_sequence(self, n_ctx: int) -> None:
        self._tokens = np.zeros(n_ctx, dtype=np.int32)  # ids whose KV is held
        self._n_past = 0

    @property
    def n_past(self) -> int:
        return self._n_past

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self._n_past].copy()

    def _check_append(self, tokens: Sequence[int], n_logits: int, dtype=np.int32) -> np.ndarray:
        """The tokens as an array, once they fit: at least one, n_logits of them at most, room left."""
        ids = np.asarray(tokens, dtype=dtype).reshape(-1)
        n = len(ids)
        if n == 0 or not 0 <= n_logits <= n:
            raise ValueError(f"decode needs at least one token and 0 <= n_logits <= {n}")
        if self._n_past + n > self.n_ctx:
            raise ContextOverflowError(f"the context of {self.n_ctx} tokens is full ({self._n_past} held, "
                                       f"{n} more asked); use a larger --ctx or a shorter prompt")
        return ids

    def _check_truncate(self, n: int) -> bool:
        """Whether truncating to n drops anything (a ValueError if n is not a held length)."""
        if not 0 <= n <= self._n_past:
            raise ValueError(f"cannot truncate to {n}: {self._n_past} positions held")
        return n < self._n_past


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def sync_to(runtime: Runtime, tokens: np.ndarray) -> int:
    """Keep the runtime's KV for the longest prefix it shares with `tokens`; return that length.

    The caller then decodes `tokens[kept:]`. This is how prompt KV is reused between generations
    and how a drafter's KV is brought back in step with what the target accepted.
    """
    kept = common_prefix_length(runtime.tokens, tokens)
    if kept < runtime.n_past:
        runtime.truncate(kept)
    return kept
