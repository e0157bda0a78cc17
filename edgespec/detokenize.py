"""What a generation gives back: its new tokens as text that is safe to show, and its result.

Every way of running a generation (the engine's stream, `aio.TokenStream`, the parallel slots, the
cloud client) turns the tokens each round commits into text through one `Detokenizer`:

    output = Detokenizer(runtime, config.stop, state)
    piece  = output.feed(new)          # after each round: a Piece, or None while text is held back
    tail   = output.finish(why)        # at the end: what was held back, and tokens not shown yet
    result = output.result()           # text, tokens, finish reason, stats, log-probabilities

or, for a loop of rounds pulled by the caller, `output.pieces(rounds)`.
"""

from __future__ import annotations

import codecs
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from edgespec.stats import GenerationStats


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability (log-softmax of its raw logits) of an emitted token, and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str   # "stop" (end-of-generation token or stop string) | "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per emitted token when config.logprobs is set

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
               "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                               for lp in self.logprobs]
        return out


@dataclass
class Piece:
    """Text that is safe to show, and the tokens emitted since the previous piece."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


class TextAssembler:
    """Token bytes in, text pieces out: UTF-8 safe (a character split over tokens waits for its last
    byte) and holding back text that could still become a stop string."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self._overlap = max((len(s) for s in stops), default=1) - 1  # a stop may begin this far back
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, data: bytes, final: bool = False) -> str:
        """Add bytes; return the text that is now safe to show ('' if none)."""
        self.text += self._decoder.decode(data, final=final)
        hits = [i for i in (self.text.find(s, max(0, self._sent - self._overlap)) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped, final = self.text[: min(hits)], True, True
        ready = len(self.text) if final else len(self.text) - self._undecided()
        piece = self.text[self._sent:ready] if ready > self._sent else ""
        self._sent = max(self._sent, ready)
        return piece

    def _undecided(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        return max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)


class Detokenizer:
    """One generation's committed tokens in, `Piece`s out, and its `GenerationResult` at the end.

    `runtime` gives each token's bytes (`token_bytes`); `state` is the generation's
    `SpeculativeState`, whose log-probabilities (when asked for) ride along with the pieces.
    """

    def __init__(self, runtime, stops: tuple[str, ...], state):
        self.runtime = runtime
        self.state = state
        self.text = TextAssembler(stops)
        self.interrupted: str | None = None  # why the generation ended early: "cancelled", "timeout"
        self._pending: list[int] = []        # tokens emitted since the last piece
        self._n_logprobs = 0                 # log-probabilities already sent with a piece

    @property
    def stopped(self) -> bool:
        """A stop string ended the text: nothing after it is shown."""
        return self.text.stopped

    def feed(self, new: np.ndarray) -> Piece | None:
        """The tokens a round committed; the piece of text they make safe to show, or None."""
        tokens = new.tolist()
        self._pending += tokens
        text = self.text.feed(b"".join(self.runtime.token_bytes(t) for t in tokens))
        return self._piece(text) if text else None

    def finish(self, interrupted: str | None = None) -> Piece | None:
        """The generation ended (`interrupted` says why when it did not end by itself): the text held
        back and the tokens not shown yet, or None when there are neither."""
        self.interrupted = interrupted
        text = "" if self.stopped else self.text.feed(b"", final=True)
        return self._piece(text) if text or self._pending else None

    def _piece(self, text: str) -> Piece:
        logprobs = self.state.logprobs
        piece = Piece(text, self._pending, logprobs[self._n_logprobs:])
        self._pending, self._n_logprobs = [], len(logprobs)
        return piece

    def result(self) -> GenerationResult:
        state = self.state
        finish = "stop" if self.stopped else self.interrupted or state.finish_reason or "stop"
        return GenerationResult(text=self.text.text, tokens=state.committed[state.n_prompt:].tolist(),
                                prompt_tokens=state.n_prompt, finish_reason=finish, stats=state.stats,
                                logprobs=state.logprobs if state.top_logprobs is not None else None)

    def pieces(self, rounds: Iterator[np.ndarray],
               interrupted: Callable[[], str | None] = lambda: None) -> Iterator[Piece]:
        """Pieces of the tokens `rounds` yields, until it ends, a stop string, or `interrupted()`
        (asked between rounds) gives a reason. Closes `rounds`; `result()` is ready afterwards."""
        why = interrupted()
        try:
            while why is None:
                new = next(rounds, None)
                if new is None:
                    break
                piece = self.feed(new)
                if piece:
                    yield piece
                if self.stopped:
                    break
                why = interrupted()
        finally:
            rounds.close()
        tail = self.finish(why)
        if tail:
            yield tail

    def texts(self, rounds: Iterator[np.ndarray]) -> Iterator[str]:
        """`pieces` as text alone (what `Engine.stream` yields)."""
        with closing(self.pieces(rounds)) as pieces:
            for piece in pieces:
                if piece.text:
                    yield piece.text
