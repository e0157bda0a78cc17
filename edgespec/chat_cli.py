"""`edgespec chat`: an interactive conversation in the terminal.

The answer streams to stdout as it is produced; a one-line stats summary and every notice go to
stderr. Ctrl-C stops the answer in progress (between two speculative rounds, so the KV stays
consistent) and the session goes on; Ctrl-D or /quit ends it.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from typing import Callable, TextIO

from edgespec.conversation import Conversation, Reply
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError

HELP = """commands:
  /reset        forget the conversation (keeps the system prompt)
  /stats        show the conversation's token and cache counts and the last answer's stats
  /save FILE    save the conversation with its KV cache
  /load FILE    restore a saved conversation (same model, build and context size)
  /help         show this help
  /quit         end the session (or Ctrl-D)
Ctrl-C stops the answer being written."""

PROMPT = ">>> "


class ChatSession:
    """The loop, with its input and outputs injectable (the terminal in use, a test's streams)."""

    def __init__(self, engine: Engine, config: GenerationConfig, *, system: str | None = None,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                 read_line: Callable[[str], str] = input):
        self.engine = engine
        self.config = config
        self.conversation = Conversation(engine, system=system)
        self.out, self.err = out, err
        self.read_line = read_line

    def note(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def banner(self) -> str:
        t = self.engine.target
        draft = self.engine.draft_runtime
        return (f"edgespec chat: {t.path.name}" + (f" + draft {draft.path.name}" if draft else "")
                + f", mode {self.config.mode}, context {t.n_ctx} tokens. /help for commands, Ctrl-D to quit.")

    def run(self) -> int:
        self.note(self.banner())
        while True:
            try:
                line = self.read_line(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                self.note("(Ctrl-D or /quit ends the session)")
                continue
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if self.command(line) == "quit":
                        return 0
                else:
                    self.answer(line)
            except EdgespecError as exc:
                self.note(f"error: {exc}")

    # -- a turn ---------------------------------------------------------------------------------

    def answer(self, text: str) -> None:
        cancel = threading.Event()
        reply = self.conversation.reply(text, self.config, cancel=cancel)
        if reply.dropped:
            self.note(f"[the conversation outgrew the context of {self.engine.target.n_ctx} tokens: dropped the "
                      f"{reply.dropped} oldest turn{'s' if reply.dropped > 1 else ''}, kept the system prompt]")
        self._stream(reply, cancel)

    def _stream(self, reply: Reply, cancel: threading.Event) -> None:
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set()) if in_main else None
        try:
            for piece in reply:
                self.out.write(piece.text)
                self.out.flush()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
        self.out.write("\n")
        self.out.flush()
        result = reply.result
        if result.finish_reason == "cancelled":
            self.note("[stopped]")
        s = result.stats
        self.note(f"[{s.summary()}; prefilled {s.prefilled_tokens}, reused {s.cached_tokens} cached]")

    # -- commands -------------------------------------------------------------------------------

    def command(self, line: str) -> str | None:
        try:
            parts = shlex.split(line)
        except ValueError as exc:
            raise EdgespecError(f"cannot parse the command: {exc}") from exc
        name, args = parts[0].lower(), parts[1:]
        if name in ("/quit", "/exit"):
            return "quit"
        if name == "/help":
            self.note(HELP)
        elif name == "/reset":
            self.conversation.reset()
            self.note("[conversation reset]")
        elif name == "/stats":
            self.note(self.stats_text())
        elif name in ("/save", "/load"):
            if len(args) != 1:
                raise EdgespecError(f"usage: {name} FILE")
            if name == "/save":
                path = self.conversation.save(args[0])
                self.note(f"[saved {self.conversation.turns} turns and {self.engine.target.n_past} tokens of KV "
                          f"to {path}]")
            else:
                self.conversation.load(args[0])
                self.note(f"[loaded {self.conversation.turns} turns and {self.engine.target.n_past} tokens of KV "
                          f"from {args[0]}]")
        else:
            raise EdgespecError(f"unknown command {name}; /help lists the commands")
        return None

    def stats_text(self) -> str:
        c, t = self.conversation, self.conversation.totals
        lines = [
            f"turns: {c.turns} in the conversation ({t.turns} answered this session, {t.dropped_turns} dropped)",
            f"context: {c.context_used()} / {self.engine.target.n_ctx} tokens held in the KV cache",
            f"prompt tokens: {t.prefilled_tokens} prefilled, {t.cached_tokens} reused from the cache; "
            f"{t.generated} generated",
        ]
        if c.last is not None:
            lines.append(f"last answer: {c.last.stats.summary()}")
        return "\n".join(lines)


def run_chat(engine: Engine, config: GenerationConfig, *, system: str | None = None) -> int:
    """The interactive session on this process's terminal."""
    import signal

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on every platform
        pass
    # A process started in the background by a script inherits SIGINT ignored, and Python keeps it so;
    # in a conversation Ctrl-C must stop an answer, so take it back.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    engine.policy_for(config)  # refuse a bad mode before the first message
    return ChatSession(engine, config, system=system).run()
