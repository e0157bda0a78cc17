"""The verifier: a server that hosts the target model and verifies drafts for many edge sessions.

Each session is one llama.cpp sequence in one shared context (`LlamaCppMultiSeqRuntime`, unified
KV pool sized sessions x context), so concurrent sessions cost KV cells, not model copies, and one
`llama_decode` verifies the drafts of every session that has work queued. One worker thread owns
the model and every session; HTTP handlers (FastAPI on uvicorn) only parse, authenticate, rate-limit
and hand jobs to it. A session is rebuilt from the client's token history whenever this replica does
not know it (restart, eviction, another replica behind a load balancer), so no state is sticky.

Randomness is replica-independent: the acceptance draws of the round at committed length n use
`numpy.random.default_rng([seed, n])`, with the seed the client gave at session start.

A client may keep several blocks of one session in flight (protocol 1.1, `assume_from` and
`assume_last`); they can arrive out of order over separate connections. The worker serves a
session's requests strictly in revision order: one that names a later revision waits (bounded in
number and time) until the session gets there, and one whose assumed state did not happen is
answered 409 `stale` as soon as that is known, without a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec.cloud.protocol import (CONTENT_TYPE, PROTOCOL_MINOR, Limits, ProtocolError, SessionRequest,
                                     SessionResponse, VerifyRequest, VerifyResponse, error_message, pack, unpack,
                                     vocab_fingerprint)
from edgespec.errors import EdgespecError
from edgespec.sampling import Sampler
from edgespec.structured import ConstraintError, Grammar
from edgespec.verify import accept_greedy, accept_sampling

log = logging.getLogger("edgespec.cloud.verifier")


@dataclass(frozen=True)
class VerifierConfig:
    api_keys: tuple[str, ...]
    max_sessions: int = 16
    max_context: int = 2048          # tokens per session
    idle_timeout_s: float = 600.0
    max_draft: int = 64
    max_probs_k: int = 64
    max_body_bytes: int = 1 << 20
    rate_per_s: float = 1000.0       # requests per second per API key (token bucket)
    rate_burst: float = 2000.0
    max_queue: int = 256             # jobs waiting for the model before new ones get 503
    batch: bool = True               # verify concurrent sessions in one llama_decode
    max_waiting: int = 8             # requests per session waiting for an earlier one (1.1); more get 429
    order_timeout_s: float = 2.0     # how long such a request waits for the one it follows before 409 stale
    session_id_prefix: str = ""      # Ray Serve replicas put their id here, so a router can find a session's KV
    budget_bytes: int | None = None  # --budget: a MemoryGuard sheds idle sessions, then refuses new ones
    idle_shed_s: float = 5.0         # under memory pressure, sessions idle this long are shed first
    audit_dir: str | None = None     # record every verify pass there (edgespec.audit; off by default)

    def __post_init__(self) -> None:
        if not self.api_keys or any(len(k) < 8 for k in self.api_keys):
            raise EdgespecError("the verifier needs --api-key with at least 8 characters (clients send it as a "
                                "bearer token)")
        if not 1 <= self.max_sessions <= 256:
            raise EdgespecError("--max-sessions must be between 1 and 256")
        if self.max_context < 16:
            raise EdgespecError("--session-ctx must be at least 16 tokens")
        if len(self.session_id_prefix) > 24:  # session ids are at most 64 characters on the wire
            raise EdgespecError("session_id_prefix must be at most 24 characters")


def key_id(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass
class Session:
    id: str
    owner: str                   # key_id of the API key that created it
    seq: int
    tokens: list[int]            # committed; the runtime holds the KV of tokens[:-1]
    sampler: Sampler
    seed: int
    revision: int = 0
    # The chain of blocks (its first revision) whose verification made the current state; None after a
    # start or rebuild. Revisions alone do not tell two chains apart: after a stale chain the client's
    # next one reuses its revisions.
    chain: int | None = None
    passes: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    kind: str                    # "start" | "verify" | "close"
    owner: str
    request: object
    session_id: str | None
    future: concurrent.futures.Future
    t_arrived: float = field(default_factory=time.perf_counter)


class VerifierCore:
    """The model, the sessions and the worker thread that serves them. No HTTP in here."""

    def __init__(self, runtime, config: VerifierConfig):
        self.runtime = runtime
        self.config = config
        self.limits = Limits(n_vocab=runtime.vocab.n_vocab, max_body_bytes=config.max_body_bytes,
                             max_context=config.max_context, max_draft=config.max_draft,
                             max_probs_k=config.max_probs_k)
        self.vocab_hash = vocab_fingerprint(runtime)
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.free_seqs = list(range(runtime.n_seq))
        self.counters = {"passes": 0, "multi_session_calls": 0, "sessions_started": 0,
                         "sessions_rebuilt": 0, "evicted": 0, "expired": 0, "verified": 0, "waited": 0, "stale": 0}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        # Worker-thread state only: verify requests waiting for their session to reach the revision
        # they name, as (deadline, job) by session id; and those released for the next pass.
        self._waiting: dict[str, list[tuple[float, _Job]]] = {}
        self._ready: list[_Job] = []
        self.recorder = None  # an edgespec.audit.Recorder records every verify pass; off by default
        if config.audit_dir:
            from edgespec.audit import Recorder

            self.recorder = Recorder(spill=config.audit_dir)
        self.memory_guard = None
        if config.budget_bytes:
            from edgespec.machine.guard import CallbackReleaser, MemoryGuard

            self.memory_guard = MemoryGuard(config.budget_bytes, releasers=[
                CallbackReleaser("saved_state", self._idle_bytes, self._shed_idle)])
        self._thread = threading.Thread(target=self._run, name="edgespec-verifier", daemon=True)
        self._thread.start()

    # -- called from other threads ------------------------------------------------------------------

    def submit(self, kind: str, owner: str, request, session_id: str | None = None) -> concurrent.futures.Future:
        if self._queue.qsize() >= self.config.max_queue:
            raise ProtocolError(503, "overloaded", "the verifier is overloaded; retry later")
        job = _Job(kind, owner, request, session_id, concurrent.futures.Future())
        self._queue.put(job)
        return job.future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- the worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        last_sweep = time.monotonic()
        while True:
            jobs, self._ready = self._ready, []  # released by the last pass: they go first
            if not jobs:
                try:
                    job = self._queue.get(timeout=0.05 if self._waiting else 1.0)
                except queue.Empty:
                    job = False
                if job is None:
                    return
                if job is not False:
                    jobs.append(job)
            self._expire_waiting()
            self._guard_memory()
            if time.monotonic() - last_sweep > 1.0:
                self._expire_idle()
                last_sweep = time.monotonic()
            if not jobs:
                continue
            while self.config.batch and len(jobs) < self.runtime.n_seq:  # whatever else is waiting joins the pass
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            try:
                self._serve(jobs)
            except Exception as exc:  # never let the worker die: fail these jobs, keep serving
                log.exception("verifier worker error")
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(ProtocolError(500, "internal", f"{type(exc).__name__}"))

    def _serve(self, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if not job.future.done()]  # a waiting job failed by an earlier error
        work, pending, busy = [], [], set()
        for job in jobs:
            try:
                if job.kind == "close":
                    self._close(job)
                    continue
                prepared = self._prepare(job, busy)
                if prepared is None:  # waits for an earlier request of its session
                    continue
                session, item = prepared
                busy.add(session.id)
                pending.append((job, session, item))
                if item is not None:
                    work.append(item)
            except ProtocolError as exc:
                job.future.set_exception(exc)
        outs = {}
        if work:
            try:
                results = self.runtime.decode_batch(work)
            except Exception as exc:
                for job, session, _ in pending:
                    if job.kind == "start":  # a half-built session would be out of step: drop it
                        self._drop(session)
                    job.future.set_exception(ProtocolError(503, "decode_failed", str(exc)))
                return
            calls, self.runtime.n_decode_calls = self.runtime.n_decode_calls, 0
            self.counters["passes"] += calls
            if len(work) > 1:
                self.counters["multi_session_calls"] += calls
            outs = {item[0]: rows for item, rows in zip(work, results)}
        for job, session, item in pending:
            try:
                session.passes += self.runtime.passes_by_seq.get(session.seq, 0) if item is not None else 0
                if job.kind == "start":
                    job.future.set_result(self._start_done(job, session))
                else:
                    job.future.set_result(self._verify_done(job, session, outs[session.seq]))
                    self._release(session)
            except ProtocolError as exc:
                job.future.set_exception(exc)

    def _owned(self, session_id: str | None, owner: str) -> Session | None:
        session = self.sessions.get(session_id) if session_id else None
        if session is None or not hmac.compare_digest(session.owner, owner):
            return None  # someone else's session is as unknown as a missing one
        return session

    def _prepare(self, job: _Job, busy: set[str]):
        """Validate a job against the session state; return (session, decode work item or None), or
        None when the job waits for an earlier request of its session."""
        if job.kind == "start":
            req: SessionRequest = job.request
            session = self._owned(req.resume, job.owner)
            if session is not None and session.id in busy:
                raise ProtocolError(409, "busy", "this session has a request in progress")
            history = req.tokens.tolist()
            grammar = self._grammar(req)
            if session is None:
                session = self._new_session(job.owner, req, busy, grammar)
                kept = 0
            else:  # rebuild in place: keep the KV of the prefix both histories share
                held = self.runtime.seq_tokens(session.seq)
                target = np.asarray(history[:-1], dtype=np.int32)
                n = min(len(held), len(target))
                diff = np.flatnonzero(held[:n] != target[:n])
                kept = int(diff[0]) if diff.size else n
                self.runtime.seq_truncate(session.seq, kept)
                session.sampler = Sampler(req.sampling, req.seed, grammar)
                session.seed = req.seed
                session.revision += 1
                session.chain = None
                self.counters["sessions_rebuilt"] += 1
                # requests drafted on the replaced history: their assumption no longer means anything
                self._flush(session, ProtocolError(409, "stale", "the session was rebuilt"))
            session.tokens = history
            self.sessions.move_to_end(session.id)
            session.last_used = time.monotonic()
            todo = history[kept:-1]
            return session, ((session.seq, todo, 0) if todo else None)

        req: VerifyRequest = job.request
        session = self._owned(job.session_id, job.owner)
        if session is None:
            raise ProtocolError(404, "unknown_session", "no such session here (expired, evicted, another replica "
                                                        "or a restart): start it again from your token history")
        if req.assume_last is not None:
            dead = self._chain_dead(req, session)
            if req.revision > session.revision and not dead:  # the requests ahead of it are not answered yet
                waiting = self._waiting.setdefault(session.id, [])
                if len(waiting) >= self.config.max_waiting:
                    raise ProtocolError(429, "rate_limited", "too many requests of this session wait for earlier "
                                                             "ones")
                waiting.append((time.perf_counter() + self.config.order_timeout_s, job))
                self.counters["waited"] += 1
                return None
            # the state must be the one the blocks ahead of it, all accepted, produced: made by its own
            # chain, with the length and the last token it assumes
            if (dead or req.revision != session.revision or session.chain != req.assume_from
                    or req.n_past != len(session.tokens) or session.tokens[-1] != req.assume_last):
                self.counters["stale"] += 1
                raise ProtocolError(409, "stale", "the state this request assumes did not happen")
        if session.id in busy:
            raise ProtocolError(409, "busy", "this session has a request in progress")
        if req.revision != session.revision or req.n_past != len(session.tokens):
            raise ProtocolError(409, "out_of_sync", f"the session is at revision {session.revision} with "
                                                    f"{len(session.tokens)} tokens; rebuild it from your history")
        if len(session.tokens) + len(req.draft) + 1 > self.config.max_context:
            raise ProtocolError(422, "context_full", f"the session would exceed {self.config.max_context} tokens")
        self.sessions.move_to_end(session.id)
        session.last_used = time.monotonic()
        fed = [session.tokens[-1]] + req.draft.tolist()
        return session, (session.seq, fed, len(fed))

    # -- memory (under --budget) --------------------------------------------------------------------

    def _guard_memory(self) -> None:
        """Between passes: the guard sheds idle sessions under pressure; past that it stops new sessions."""
        if self.memory_guard is not None:
            try:
                self.memory_guard.check()
            except EdgespecError:  # nothing left to shed: new sessions are refused (not admitting)
                pass

    def _idle(self) -> list[Session]:
        now = time.monotonic()
        return [s for s in self.sessions.values()
                if now - s.last_used > self.config.idle_shed_s and s.id not in self._waiting]

    def _idle_bytes(self) -> int:
        """What shedding idle sessions frees: their histories (Python ints, about 36 bytes a token). Their
        KV cells go back to the pool, which llama.cpp allocated at load: they make room for new sessions,
        not resident memory."""
        return sum(36 * len(s.tokens) + 200 for s in self._idle())

    def _shed_idle(self) -> str:
        idle = self._idle()
        for session in idle:
            self._drop(session)
        self.counters["shed"] = self.counters.get("shed", 0) + len(idle)
        return f"shed {len(idle)} idle sessions"

    def _grammar(self, req: SessionRequest) -> Grammar | None:
        """The session's grammar (None unconstrained), built as the engine builds it and walked over the
        output so far; 422 `bad_constraint` when no output can match it or the history does not."""
        if req.constraint is None:
            return None
        rt = self.runtime
        try:
            grammar = Grammar(rt.grammar_tokenizer(), req.constraint, n_vocab=rt.vocab.n_vocab, eog=rt.vocab.eog,
                              position=req.constraint_start)
        except ConstraintError as exc:
            raise ProtocolError(422, "bad_constraint", str(exc)) from None
        output = req.tokens[req.constraint_start:]
        if grammar.consume(output) < len(output):
            raise ProtocolError(422, "bad_constraint", f"the tokens after constraint.start do not follow the "
                                                       f"{req.constraint.describe()}")
        return grammar

    def _new_session(self, owner: str, req: SessionRequest, busy: set[str], grammar: Grammar | None) -> Session:
        if self.memory_guard is not None and not self.memory_guard.admitting:
            raise ProtocolError(503, "overloaded", "the verifier is near its memory budget and takes no new "
                                                   "sessions now; retry later")
        if not self.free_seqs:
            victim = next((s for s in self.sessions.values() if s.id not in busy), None)  # least recently used
            if victim is None:
                raise ProtocolError(503, "overloaded", "every session is busy; retry later")
            self._drop(victim)
            self.counters["evicted"] += 1
        seq = self.free_seqs.pop()
        self.runtime.seq_clear(seq)
        session = Session(self.config.session_id_prefix + secrets.token_urlsafe(24), owner, seq, [],
                          Sampler(req.sampling, req.seed, grammar), req.seed)
        self.sessions[session.id] = session
        self.counters["sessions_started"] += 1
        return session

    def _drop(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.runtime.seq_clear(session.seq)
            self.free_seqs.append(session.seq)
            self._flush(session, ProtocolError(404, "unknown_session", "the session was closed, evicted or expired"))

    @staticmethod
    def _chain_dead(req: VerifyRequest, session: Session) -> bool:
        """Every state from its chain's first revision on must come from that chain: once another made
        one, the request can never be served."""
        return req.assume_from < session.revision and session.chain != req.assume_from

    def _release(self, session: Session) -> None:
        """After a verification: requests that waited for this revision, or whose chain it ended, go to
        the next pass, where they are served or answered stale."""
        waiting = self._waiting.get(session.id)
        if not waiting:
            return
        keep = []
        for t, job in waiting:
            if job.request.revision <= session.revision or self._chain_dead(job.request, session):
                self._ready.append(job)
            else:
                keep.append((t, job))
        if keep:
            self._waiting[session.id] = keep
        else:
            del self._waiting[session.id]

    def _flush(self, session: Session, error: ProtocolError) -> None:
        for _, job in self._waiting.pop(session.id, []):
            if not job.future.done():
                self.counters["stale"] += error.code == "stale"
                job.future.set_exception(error)

    def _expire_waiting(self) -> None:
        now = time.perf_counter()
        for sid, waiting in list(self._waiting.items()):
            keep = [(t, job) for t, job in waiting if t > now]
            for t, job in waiting:
                if t <= now and not job.future.done():
                    self.counters["stale"] += 1
                    message = f"the request this one follows did not come within {self.config.order_timeout_s:g} s"
                    job.future.set_exception(ProtocolError(409, "stale", message))
            if keep:
                self._waiting[sid] = keep
            else:
                del self._waiting[sid]

    def _close(self, job: _Job) -> None:
        session = self._owned(job.session_id, job.owner)
        if session is None:
            job.future.set_exception(ProtocolError(404, "unknown_session", "no such session"))
            return
        self._drop(session)
        job.future.set_result({"v": 1, "closed": True})

    def _expire_idle(self) -> None:
        now = time.monotonic()
        for session in [s for s in self.sessions.values() if now - s.last_used > self.config.idle_timeout_s]:
            self._drop(session)
            self.counters["expired"] += 1

    def _start_done(self, job: _Job, session: Session) -> SessionResponse:
        return SessionResponse(session.id, session.revision, len(session.tokens), session.passes,
                               self.limits.n_vocab, self.vocab_hash, self.config.max_draft, self.config.max_probs_k,
                               self.config.max_context, time.perf_counter() - job.t_arrived)

    def _verify_done(self, job: _Job, session: Session, logits: np.ndarray) -> VerifyResponse:
        req: VerifyRequest = job.request
        n_past = len(session.tokens)
        committed = np.asarray(session.tokens, dtype=np.int32)
        rows = session.sampler.rows(logits, committed, req.draft)
        if session.sampler.params.greedy:
            rule, q, rng = accept_greedy, None, None
        else:
            q = None if req.probs is None else req.probs.dense(self.limits.n_vocab)
            rule, rng = accept_sampling, np.random.default_rng([session.seed, n_past])
        if self.recorder is not None:
            rule = self.recorder.rule(rule, key=session.id, committed=committed, logits=logits, seq=session.seq,
                                      held=self.runtime.seq_tokens(session.seq), greedy=rng is None)
        n, token = rule(req.draft, q, rows, rng)
        self.runtime.seq_truncate(session.seq, n_past + n)  # KV: old last token plus the accepted drafts
        new = req.draft[:n].tolist() + [int(token)]
        session.tokens += new
        if session.sampler.grammar is not None:  # it holds committed tokens only, as the engine's
            session.sampler.grammar.consume(new)
        session.revision += 1
        session.chain = req.revision if req.assume_from is None else req.assume_from
        self.counters["verified"] += 1
        return VerifyResponse(session.revision, len(session.tokens), n, int(token), session.passes,
                              time.perf_counter() - job.t_arrived)

    def stats(self) -> dict:
        return {**self.counters, "sessions": len(self.sessions), "max_sessions": self.runtime.n_seq,
                "kv_cells_used": self.runtime.cells_used, "kv_cells": self.runtime.n_ctx}


# --- HTTP ------------------------------------------------------------------------------------------

class _RateLimiter:
    """Token buckets by client key; the event loop is the only caller, so no lock."""

    def __init__(self, rate: float, burst: float, max_clients: int = 10000):
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, client: str) -> bool:
        now = time.monotonic()
        level, t = self.buckets.pop(client, (self.burst, now))
        level = min(self.burst, level + (now - t) * self.rate)
        ok = level >= 1.0
        self.buckets[client] = (level - 1.0 if ok else level, now)
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        return ok


def create_app(core: VerifierCore):
    """The FastAPI application: /v1/health, /v1/stats, /v1/sessions, /v1/sessions/{id}/verify, DELETE."""
    app = FastAPI(title="edgespec verifier", docs_url=None, redoc_url=None, openapi_url=None)
    keys = {key_id(k): k for k in core.config.api_keys}
    limiter = _RateLimiter(core.config.rate_per_s, core.config.rate_burst)
    strangers = _RateLimiter(20.0, 40.0)  # requests that fail authentication, by address

    def reply(message: dict, status: int = 200) -> Response:
        return Response(pack(message), status_code=status, media_type=CONTENT_TYPE)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError):
        extra = {"retry_after_s": 1.0} if exc.status == 429 else {}
        return reply(error_message(exc.code, exc.message, **extra), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return reply(error_message("http", str(exc.detail)), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return reply(error_message("malformed", "bad request"), 400)

    def authenticate(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        owner = None
        if scheme.lower() == "bearer" and token:
            candidate = key_id(token)
            known = keys.get(candidate)
            if known is not None and hmac.compare_digest(known.encode(), token.encode()):
                owner = candidate
        if owner is None:
            address = request.client.host if request.client else "?"
            if not strangers.allow(address):
                raise ProtocolError(429, "rate_limited", "too many unauthenticated requests")
            raise ProtocolError(401, "unauthorized", "missing or wrong API key (send Authorization: Bearer KEY)")
        if not limiter.allow(owner):
            raise ProtocolError(429, "rate_limited", "rate limit exceeded for this API key; slow down")
        return owner

    async def body(request: Request) -> dict:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in (CONTENT_TYPE, "application/x-msgpack"):
            raise ProtocolError(415, "content_type", f"send {CONTENT_TYPE}")
        limit = core.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise ProtocolError(413, "too_large", f"messages are limited to {limit} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise ProtocolError(413, "too_large", f"messages are limited to {limit} bytes")
        return unpack(bytes(data), core.limits)

    async def run(kind: str, owner: str, message, session_id: str | None = None):
        return await asyncio.wrap_future(core.submit(kind, owner, message, session_id))

    @app.get("/v1/health")
    async def health():
        return reply({"v": 1, "minor": PROTOCOL_MINOR, "status": "ok"})

    @app.get("/v1/stats")
    async def stats(request: Request):
        authenticate(request)
        return reply({"v": 1, **core.stats()})

    @app.post("/v1/sessions")
    async def start(request: Request):
        owner = authenticate(request)
        message = SessionRequest.from_wire(await body(request), core.limits)
        return reply((await run("start", owner, message)).to_wire())

    @app.post("/v1/sessions/{session_id}/verify")
    async def verify(session_id: str, request: Request):
        owner = authenticate(request)
        if len(session_id) > 64:
            raise ProtocolError(404, "unknown_session", "no such session")
        message = VerifyRequest.from_wire(await body(request), core.limits)
        return reply((await run("verify", owner, message, session_id)).to_wire())

    @app.delete("/v1/sessions/{session_id}")
    async def close(session_id: str, request: Request):
        owner = authenticate(request)
        if len(session_id) > 64:
            raise ProtocolError(404, "unknown_session", "no such session")
        return reply(await run("close", owner, None, session_id))

    return app


def load_core(target: str, config: VerifierConfig, *, n_threads: int | None = None, n_gpu_layers: int | None = None,
              flash_attn: bool | None = None, type_k: str = "f16", type_v: str = "f16",
              verbose: bool = False) -> VerifierCore:
    from edgespec.loader import LoadOptions, load_runtime

    # n_gpu_layers None: all layers where a GPU build has a GPU
    options = LoadOptions(n_ctx=config.max_sessions * config.max_context, n_threads=n_threads,
                          n_gpu_layers=n_gpu_layers, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
                          verbose=verbose)
    runtime = load_runtime(target, options, n_seq=config.max_sessions)
    return VerifierCore(runtime, config)


def serve(target: str, config: VerifierConfig, *, host: str = "127.0.0.1", port: int = 8765,
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None, **load_options) -> None:
    """Load the target and serve until interrupted (uvicorn, one process: the model is in-process)."""
    import sys

    import uvicorn

    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise EdgespecError("TLS needs both --ssl-certfile and --ssl-keyfile")
    core = load_core(target, config, **load_options)
    scheme = "https" if ssl_certfile else "http"
    print(f"edgespec serve --verifier: {target} ({core.runtime.n_seq} sessions x {config.max_context} tokens) on "
          f"{scheme}://{host}:{port}", file=sys.stderr, flush=True)
    if not ssl_certfile and host not in ("127.0.0.1", "localhost", "::1"):
        print("warning: serving without TLS on a non-loopback address; API keys travel in clear text "
              "(pass --ssl-certfile/--ssl-keyfile)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(core), host=host, port=port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                    log_level="warning", access_log=False, timeout_keep_alive=30,
                    h11_max_incomplete_event_size=16 * 1024)
    finally:
        core.stop()
        core.runtime.close()
