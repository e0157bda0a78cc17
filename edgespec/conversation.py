"""A multi-turn conversation over an engine, keeping its KV cache between turns.

Each turn renders the whole conversation with the model's chat template and hands the tokens to the
engine, whose `sync_to` keeps the KV of the longest prefix the target already holds: the previous
prompt and answer. So a turn prefills only what is new (the end of the last answer, the new message
and the template's markers around them); `stats.prefilled_tokens` and `stats.cached_tokens` say how
many. When the conversation no longer fits the context, the oldest turns are dropped (the system
message stays), and the KV of what still matches (the system prompt) is kept.

Saved conversations go through `edgespec.persist` like every saved state: the messages travel in
the file's metadata, the KV as llama.cpp's state blobs, and a file from another model, build or
context size is refused.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from edgespec.serve.aio import Piece, TokenStream
from edgespec.engine import Engine, GenerationConfig, GenerationResult
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.persist import load_state, save_state

CHAT_FORMAT = "edgespec-chat/1"


@dataclass
class ConversationTotals:
    turns: int = 0
    generated: int = 0
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    dropped_turns: int = 0


class Reply:
    """One answer in progress: iterate for its pieces; `.result` holds the whole result afterwards.

    `dropped` is how many of the oldest turns were dropped to make the conversation fit. A reply
    stopped through `cancel` keeps what was said so far in the conversation.
    """

    def __init__(self, conversation: "Conversation", prompt_ids: list[int], config: GenerationConfig,
                 cancel: threading.Event | None, dropped: int):
        self.conversation = conversation
        self.prompt_ids = prompt_ids
        self.config = config
        self.dropped = dropped
        self.stream = TokenStream(conversation.engine, prompt_ids, config, cancel=cancel)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Piece]:
        finished = False
        try:
            yield from self.stream
            finished = True
        finally:
            self.conversation._end_turn(self, self.stream.result if finished else None)
        self.result = self.stream.result

    def text(self) -> str:
        """Run the reply to its end; return its text."""
        for _ in self:
            pass
        return self.result.text


class Conversation:
    """Messages plus the engine's KV of them. Not thread-safe (the engine it holds is not)."""

    def __init__(self, engine: Engine, system: str | None = None):
        self.engine = engine
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.totals = ConversationTotals()
        self.last: GenerationResult | None = None
        self._pending: Reply | None = None
        self.reset()

    # -- turns ----------------------------------------------------------------------------------

    def reply(self, text: str, config: GenerationConfig = GenerationConfig(), *,
              cancel: threading.Event | None = None) -> Reply:
        """Add a user message; return the assistant's reply, ready to stream."""
        if not text.strip():
            raise EdgespecError("the message is empty")
        if config.raw:
            raise EdgespecError("a conversation needs the chat template; drop raw")
        if self._pending is not None:
            raise EdgespecError("the previous reply has not finished; iterate it to its end first")
        messages, prompt_ids, dropped = self.fit(self.messages + [{"role": "user", "content": text}],
                                                 config.max_tokens)
        self.messages = messages
        self.totals.dropped_turns += dropped
        self._pending = Reply(self, prompt_ids, config, cancel, dropped)
        return self._pending

    def fit(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[dict[str, str]], list[int], int]:
        """Drop the oldest turns (never the system message nor the last message) until the prompt
        plus `max_tokens` fits the context. Returns the messages kept, their tokens, turns dropped."""
        n_ctx = self.engine.target.n_ctx
        messages = list(messages)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = 0
        while True:
            ids = self.engine.prompt_tokens(messages)
            if len(ids) + max_tokens <= n_ctx:
                return messages, ids, dropped
            if len(messages) - first <= 1:
                raise ContextOverflowError(
                    f"the message ({len(ids)} tokens with the template{' and system prompt' if first else ''}) "
                    f"plus max tokens ({max_tokens}) does not fit in the context of {n_ctx} tokens; send a "
                    "shorter message, or use fewer --max-tokens or a larger --ctx")
            end = first + 1  # a turn: a user message and everything up to the next one
            while end < len(messages) - 1 and messages[end]["role"] != "user":
                end += 1
            del messages[first:end]
            dropped += 1

    def _end_turn(self, reply: Reply, result: GenerationResult | None) -> None:
        self._pending = None
        if result is None:  # failed or abandoned: forget the unanswered message
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": result.text})
        self.last = result
        t = self.totals
        t.turns += 1
        t.generated += result.stats.generated
        t.prefilled_tokens += result.stats.prefilled_tokens
        t.cached_tokens += result.stats.cached_tokens

    def reset(self) -> None:
        """Forget the turns, keep the system message (and the KV, whose system prefix stays useful)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def context_used(self) -> int:
        """Tokens of the conversation held in the target's KV."""
        return self.engine.target.n_past

    # -- saved conversations ----------------------------------------------------------------------

    def _runtimes(self) -> dict:
        runtimes = {"target": self.engine.target}
        if self.engine.draft_runtime is not None:
            runtimes["draft"] = self.engine.draft_runtime
        return runtimes

    def save(self, path: str | os.PathLike) -> Path:
        """Write the messages and the KV (target and draft) to one file, atomically."""
        with self.engine.exclusive():
            return save_state(path, self._runtimes(),
                              meta={"format": CHAT_FORMAT, "system": self.system, "messages": self.messages})

    def load(self, path: str | os.PathLike) -> None:
        """Restore a saved conversation; refused (and nothing changed) when the model, the runtime
        build, the context size or the KV types differ."""
        path = Path(path)
        with self.engine.exclusive():
            meta = load_state(path, self._runtimes())
        if meta.get("format") != CHAT_FORMAT or not isinstance(meta.get("messages"), list):
            raise EdgespecError(f"{path} holds saved state but not a conversation; save one with /save")
        self.system = meta.get("system")
        self.messages = [dict(m) for m in meta["messages"]]
        self.last = None
