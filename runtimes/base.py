"""The runtime protocol: what the speculative engine needs from a model, and nothing more.

A runtime holds one model and the KV cache of one token sequence. It appends tokens to that
sequence and returns logits only for the rows asked for, rolls the sequence back to a prefix, and
reports its memory. llama.cpp, ONNX Runtime and Core ML implement it, so the engine never learns
which one it talks to.

What a runtime offers besides is declared, not probed: its `capabilities` name the optional
protocols below that it implements (token trees, several sequences, saved state, the model it runs,
the vocabulary a grammar masks),
and its `sizing` says how much one pass holds. Callers ask `TreeDecoding in runtime.capabilities`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
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


CTX_PAD = 256  # llama.cpp rounds a context's n_ctx (its KV pool's cells) up to a multiple of this


FLOAT_KV = ("f32", "f16", "bf16")  # KV cache types that are not quantized


def flash_attention(flash_attn: bool | None, type_v: str) -> bool | None:
    """The flash attention a llama.cpp context gets (None: llama.cpp decides, which means on).

    The caller's choice stands, and a quantized V cache needs it on. Otherwise llama.cpp's choice, on
    the CPU too, although its CPU kernel makes every held token cost more (bench/FLASH_ATTN_RESULTS*.md:
    off, SmolLM2-135M decodes 1.34x faster at 490 prompt tokens, the 1.5B target 1-2 % slower). Off,
    a batched pass's logits differ from single-token passes' (up to 0.78 on SmolLM2, identical with it
    on), so greedy speculation leaves plain decoding's text at gaps that are no near-ties (0.15 logits).
    Output equal to plain decoding's comes first; `--no-flash-attn` is the faster choice for a small
    model on long prompts.
    """
    if flash_attn is not None:
        return flash_attn
    return True if type_v not in FLOAT_KV else None


def padded_ctx(n_ctx: int) -> int:
    """The n_ctx llama.cpp allocates for a requested one (64 -> 256, 1000 -> 1024, 1025 -> 1280)."""
    return max(CTX_PAD, -(-n_ctx // CTX_PAD) * CTX_PAD)


@dataclass(frozen=True)
class Sizing:
    """How much one pass of a runtime holds: what draft lengths, tree widths and cost curves are cut to."""

    n_batch: int | None = None   # most tokens one pass evaluates (longer inputs are split); None = no such setting
    n_threads: int | None = None  # CPU threads it computes with; None = no such setting
    n_outputs_max: int = 0       # most logits rows one pass returns (0 = as many as it evaluates)
    n_seq_max: int = 1           # sequences one pass may hold: the branches of a token tree (1 = chains only)
    n_gpu_layers: int = 0        # layers computed on an offload device (GPU, Vulkan, Metal); -1 = all


@runtime_checkable
class Runtime(Protocol):
    """One model, one KV sequence. Not thread-safe: the engine serialises calls."""

    name: str
    n_ctx: int
    vocab: VocabInfo
    capabilities: frozenset[type]  # the optional protocols below that this runtime implements
    seq: int                       # the sequence id its KV sits under in its context (0 unless shared)

    @property
    def sizing(self) -> Sizing: ...

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


# --- the optional protocols: a runtime lists those it implements in `capabilities` ---------------

class TreeDecoding(Protocol):
    """A token tree verified in one pass, one sequence per branch (up to `sizing.n_seq_max` branches)."""

    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Append a tree in one pass (node 0 the root, parent -1; node i follows `parents[i]` < i);
        float32 logits of every node. Call `keep_tree_path` next."""

    def keep_tree_path(self, path: Sequence[int]) -> int:
        """Keep a root-first path of the last tree (or as much of it as the runtime keeps) and drop
        every other branch; return how many of its nodes were kept."""


class ModelIdentity(Protocol):
    """Which model file it runs, and everything its results (saved KV, measured costs) depend on."""

    path: Path

    def compatibility_key(self) -> dict: ...


class SavedState(ModelIdentity, Protocol):
    """The held KV as bytes, restored later for the same tokens (checked by `compatibility_key`)."""

    def save_state(self) -> bytes: ...

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None: ...


class SeveralSequences(Protocol):
    """`n_seq` independent KV sequences in one context, each call naming its sequence; `decode_batch`
    evaluates several of them in one pass (the cloud verifier's sessions, `serve --parallel`'s slots)."""

    n_seq: int
    batched: bool  # decode_batch evaluates the sequences in one pass (llama.cpp), not a pass each in turn (MLX)

    @property
    def cells_used(self) -> int:
        """KV cells held by all sequences together."""

    def decode_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """Append (seq, tokens, n_logits) for each sequence named; the logits of each."""

    def seq_n_past(self, seq: int) -> int: ...

    def seq_tokens(self, seq: int) -> np.ndarray: ...

    def seq_truncate(self, seq: int, n: int) -> None: ...

    def seq_clear(self, seq: int) -> None: ...

    def seq_save_state(self, seq: int) -> bytes: ...

    def seq_load_state(self, seq: int, blob: bytes, tokens: Sequence[int]) -> None: ...

    def sequence(self, seq: int, n_ctx: int) -> Runtime:
        """One sequence seen as a one-sequence `Runtime` with room for n_ctx tokens."""


class GrammarVocabulary(Protocol):
    """Constrained output (edgespec.structured): llguidance's tokenizer over the model's own vocabulary."""

    def grammar_tokenizer(self):
        """An `llguidance.LLTokenizer` (built on first use, then kept: about 1 s for 150k tokens)."""


class SelectedRows(Protocol):
    """A pass that computes only the logits rows asked for, not the last n of them: a row no one
    reads (a constraint's certain token, edgespec.engine) costs its KV but no output projection."""

    def decode_rows(self, tokens: Sequence[int], rows: Sequence[int]) -> np.ndarray:
        """Append `tokens`; return float32 logits of tokens[rows] (increasing indices into `tokens`),
        shape (len(rows), n_vocab)."""


class NextTokenHeads(Protocol):
    """The model's own multi-token-prediction (MTP / NextN) head, run as a drafter (edgespec.drafters.mtp).

    The head reads the target's hidden state at position p - 1 with token p and predicts token p + 1;
    its own KV holds one cell per position. The runtime keeps the hidden rows of what it evaluated."""

    n_next_token_heads: int  # NextN layers in the model (> 0)

    def hidden_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, n_embd) float32: the hidden states the head reads for positions start..stop-1
        (zeros where the target has none: a tree pass, a restored state, position -1)."""

    def next_token_head(self):
        """The head's own context: `tokens`, `truncate(n)`, `decode(tokens, hidden, n_logits) -> (logits, hidden)`."""


OPTIONAL_PROTOCOLS: tuple[type, ...] = (TreeDecoding, ModelIdentity, SavedState, SeveralSequences, GrammarVocabulary,
                                        SelectedRows, NextTokenHeads)


class NotOffered:
    """A member of a base class that a subclass does not offer: reading it raises TypeError with `why`.
    (A declaration check sees the member as absent.)"""

    def __init__(self, why: str):
        self.why = why

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise TypeError(self.why)


class TokenSequence:
    """What every one-sequence runtime keeps about its sequence: the ids whose KV is held, and the
    checks an append or a rollback makes before the runtime touches its KV."""

    n_ctx: int
    seq = 0  # alone in its context

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
