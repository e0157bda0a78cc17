"""Streaming an engine to apps: round by round, cancellable, and from asyncio.

`TokenStream` runs one generation in the calling thread and yields `Piece`s: text that is safe to
show, with the tokens (and their log-probabilities, when asked for) that made it. It stops between
rounds when its `cancel` event is set or its deadline passes, so a caller can stop it from another
thread or a signal handler without breaking the engine's KV invariant.

`AsyncEngine` owns an engine through one worker thread and a bounded queue: requests are served in
the order they arrive, a full queue refuses new ones at once (`QueueFullError`), and each request
is an async iterator of pieces. The HTTP server is built on it; an app embeds it the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Iterator, Sequence

from edgespec.detokenize import Detokenizer, GenerationResult, Piece
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError


class QueueFullError(EdgespecError):
    """Every place in the request queue is taken: try again later."""


class RequestTimeoutError(EdgespecError):
    """A request ran past its time limit (waiting in the queue included)."""


class TokenStream:
    """One generation, round by round. `.result` holds the whole result once iteration ends.

    finish_reason is "stop" or "length" as in `GenerationStream`, "cancelled" when `cancel` was set,
    "timeout" when `deadline` (a `time.monotonic()` value) passed.
    """

    def __init__(self, engine: Engine, prompt_ids: Sequence[int], config: GenerationConfig, *,
                 cancel: threading.Event | None = None, deadline: float | None = None):
        self.engine = engine
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.cancel = cancel or threading.Event()
        self.deadline = deadline
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Piece]:
        with self.engine.exclusive():
            yield from self.run()

    def _interrupted(self) -> str | None:
        if self.cancel.is_set():
            return "cancelled"
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "timeout"
        return None

    def run(self) -> Iterator[Piece]:
        """The generation itself; the caller holds `engine.exclusive()`."""
        engine, config = self.engine, self.config
        state, policy = engine.begin(self.prompt_ids, config)
        output = Detokenizer(engine.target, config.stop, state)
        yield from output.pieces(engine.rounds(state, policy), self._interrupted)
        self.result = output.result()


_END = object()


class AsyncGeneration:
    """One queued request: `async for piece in generation`, then `.result`. Leaving an
    `async with` block (or calling `cancel`) stops it between rounds."""

    def __init__(self, request_id: int, prompt_ids: list[int], config: GenerationConfig,
                 deadline: float | None, loop: asyncio.AbstractEventLoop):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.config = config
        self.deadline = deadline
        self.cancel_event = threading.Event()
        self.result: GenerationResult | None = None
        self.info: dict = {}            # filled by the worker: queue_s, prefix cache use
        self.enqueued = time.monotonic()
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._done = False

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def done(self) -> bool:
        return self._done

    # -- worker side (any thread) ---------------------------------------------------------------

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel_event.set()

    def _put_end(self) -> None:
        """The generation is over (its `result` is set, or it never ran)."""
        self._put(_END)

    # -- caller side (the event loop) -----------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Piece]:
        while not self._done:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic()) + 5.0
            try:
                item = await asyncio.wait_for(self._items.get(), timeout)
            except asyncio.TimeoutError:  # the worker is busy elsewhere past our deadline
                self.cancel()
                self._done = True
                raise RequestTimeoutError("the request ran past its time limit while waiting for the engine")
            if item is _END:
                self._done = True
                if self.result is not None and self.result.finish_reason == "timeout":
                    raise RequestTimeoutError("the request ran past its time limit")
                return
            if isinstance(item, BaseException):
                self._done = True
                raise item
            yield item

    async def text(self) -> GenerationResult:
        """Wait for the whole generation; return its result."""
        async for _ in self:
            pass
        return self.result

    async def __aenter__(self) -> "AsyncGeneration":
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._done:
            self.cancel()


class Submitter:
    """`stream` and `generate` over a `submit(prompt_ids, config, timeout=) -> AsyncGeneration`,
    shared by the one-at-a-time AsyncEngine and the parallel slots' scheduler."""

    def _start_worker(self, name: str) -> None:
        """The job queue, the in-flight count and the worker thread (running `self._work`) both kinds keep."""
        self._jobs: queue.Queue = queue.Queue()
        self._inflight = 0  # submitted and not finished: the running ones plus those waiting
        self._count_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def stream(self, prompt_ids: Sequence[int], config: GenerationConfig, *,
                     timeout: float | None = None) -> AsyncIterator[Piece]:
        """Pieces of one generation; breaking out of the loop cancels it."""
        gen = self.submit(prompt_ids, config, timeout=timeout)
        async with gen:
            async for piece in gen:
                yield piece

    async def generate(self, prompt_ids: Sequence[int], config: GenerationConfig, *,
                       timeout: float | None = None) -> GenerationResult:
        gen = self.submit(prompt_ids, config, timeout=timeout)
        async with gen:
            return await gen.text()


class AsyncEngine(Submitter):
    """An engine behind a worker thread and a bounded FIFO queue, for asyncio callers.

    Thread-safe and loop-safe: `submit` may be called from any coroutine; generations run one at a
    time, in arrival order (the runtimes hold one KV sequence, so there is no batching across
    requests). `max_queue` counts requests waiting behind the running one.
    `prefix_cache` (a `PrefixCache`) restores the KV of earlier requests that share a prefix; with
    `reuse_prefix=False` every request is prefilled from scratch (for measuring what reuse gives).
    """

    thread_safe = True

    def __init__(self, engine: Engine, *, max_queue: int = 8, prefix_cache=None, reuse_prefix: bool = True):
        if max_queue < 0:
            raise EdgespecError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.reuse_prefix = reuse_prefix
        self.counters = {"completed": 0, "cancelled": 0, "timed_out": 0, "failed": 0, "rejected": 0}
        self.running: AsyncGeneration | None = None
        self._start_worker("edgespec-engine")

    @property
    def waiting(self) -> int:
        return max(0, self._inflight - (self.running is not None))

    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig, *,
               timeout: float | None = None) -> AsyncGeneration:
        """Queue a generation; raises `QueueFullError` at once when the queue is full."""
        if self._closed:
            raise EdgespecError("the engine is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        gen = AsyncGeneration(next(self._ids), list(prompt_ids), config, deadline, asyncio.get_running_loop())
        with self._count_lock:
            if self._inflight > self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFullError(f"the server is busy: {self._inflight - 1} requests are waiting behind the "
                                     f"running one (limit {self.max_queue}); try again shortly")
            self._inflight += 1
        self._jobs.put(gen)
        return gen

    def close(self) -> None:
        """Cancel what is running, drop what waits, stop the worker."""
        self._closed = True
        if self.running is not None:
            self.running.cancel()
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # -- the worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            gen = self._jobs.get()
            if gen is None:
                return
            self.running = gen
            try:
                self._run(gen)
            finally:
                with self._count_lock:
                    self._inflight -= 1
                    self.running = None

    def _run(self, gen: AsyncGeneration) -> None:
        gen.info["queue_s"] = round(time.monotonic() - gen.enqueued, 6)
        if self._closed or gen.cancel_event.is_set():
            self.counters["cancelled"] += 1
            gen._put(_END)
            return
        stream = TokenStream(self.engine, gen.prompt_ids, gen.config, cancel=gen.cancel_event,
                             deadline=gen.deadline)
        try:
            with self.engine.exclusive():
                if stream._interrupted() == "timeout":
                    raise RequestTimeoutError("the request waited in the queue past its time limit")
                self._prepare(gen)
                for piece in stream.run():
                    gen._put(piece)
                if self.prefix_cache is not None and stream.result.finish_reason != "cancelled":
                    self.prefix_cache.store(self._runtimes())
            gen.result = stream.result
            reason = stream.result.finish_reason
            self.counters[{"cancelled": "cancelled", "timeout": "timed_out"}.get(reason, "completed")] += 1
            gen._put(_END)
        except RequestTimeoutError as exc:
            self.counters["timed_out"] += 1
            gen._put(exc)
        except BaseException as exc:  # reported to the caller; the worker keeps serving
            self.counters["failed"] += 1
            gen._put(exc)

    def _runtimes(self) -> dict:
        runtimes = {"target": self.engine.target}
        if self.engine.draft_runtime is not None:
            runtimes["draft"] = self.engine.draft_runtime
        return runtimes

    def _prepare(self, gen: AsyncGeneration) -> None:
        """Bring the best KV we hold for this prompt into the runtimes (the caller holds the engine)."""
        if not self.reuse_prefix:
            for rt in self._runtimes().values():
                rt.truncate(0)
            return
        if self.prefix_cache is not None:
            gen.info["prefix_cache"] = self.prefix_cache.restore(self._runtimes(), gen.prompt_ids)
