"""The edge client: drafts on the device, verifies on a server, and never waits on the network idly.

One loop, one thread of drafting, requests on a small thread pool. The drafter grows a chain of
draft tokens past the committed ones; the chain is cut into blocks, each ending at a token whose
confidence is below R2, where the product of the block's confidences falls to R1, or at a length cap.

    continuous upload (PipeSD-style): up to `max_inflight` blocks are in flight at once. Block i+1
        is drafted after block i plus the bonus token b_i the draft itself predicts after block i,
        and goes out as soon as its gate closes, naming the state it assumes (revision and n_past
        after block i fully accepted, b_i as `assume_last`, and as `assume_from` the revision of the
        chain's first block, the last one sent with nothing ahead of it). Each block's length cap is the
        gate's, or less: the length that maximises tokens/s given the measured acceptance rate,
        draft step time and answer time (RTT + bytes / bandwidth + server time)
    an answer (oldest block first, looked at after every draft step): commit accepted +
        correction/bonus (Engine.accept_step). When everything was accepted and the bonus equals
        b_i, the blocks behind were drafted on exactly this outcome and stay in flight; otherwise
        they are stale (the server answers them 409 stale without a forward pass, and the client
        ignores those answers) and drafting resumes from the correction
    no answer by the deadline, or no server: decode with the local model (plain decoding), emit
        those tokens as they are (unverified context, counted in `offline_tokens`), probe the server
        and rebuild the session from the token history when it is back

With `max_inflight=1` the device still drafts ahead while its one block is in flight, and sends the
next block once the answer has confirmed it. Sequential mode (the baseline) sends complete blocks
only and drafts nothing while waiting.

Sampling stays lossless because the device draws each draft token from exactly the compact
distribution it sends (top-k, uint16 weights: `protocol.compact_row`), and the server's acceptance
draws are independent of the device's. That holds for blocks drafted after an assumed bonus too:
such a block is verified only when the bonus is what was committed, so it is a draft of the
committed context drawn from the q it carries. Block boundaries depend only on the draft's own
confidences, which leaves rejection sampling exact. Greedy needs no probabilities at all.

Thresholds (R1, R2, length cap) are tuned online by Bayesian optimisation (optuna's TPE) on the
measured throughput; RTT, uplink bandwidth and server time are measured on every request and set
the deadline and the block length cap.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import random
import ssl
import threading
import time
from collections import deque
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from edgespec.cloud.protocol import (CONTENT_TYPE, CompactProbs, ProtocolError, SessionRequest,
                                     SessionResponse, VerifyRequest, VerifyResponse, compact_row, pack,
                                     vocab_fingerprint)
from edgespec.drafters import EMPTY_DRAFT, Draft
from edgespec.detokenize import Detokenizer, GenerationResult
from edgespec.engine import Engine, GenerationConfig, SpeculativeState, Verification
from edgespec.errors import EdgespecError
from edgespec.policy import FixedPolicy
from edgespec.runtimes.base import Runtime, sync_to
from edgespec.sampling import Sampler, sample
from edgespec.stats import GenerationStats

log = logging.getLogger("edgespec.cloud")

OFFLINE = "offline"   # drafter name of tokens the local model made alone
CLOUD = "cloud"


@dataclass(frozen=True)
class Gate:
    """When to send a block: a token's confidence below `token_threshold` (R2), the product of the
    block's confidences at or below `product_threshold` (R1), or `max_block` tokens."""

    token_threshold: float = 0.3
    product_threshold: float = 0.15
    max_block: int = 12


@dataclass(frozen=True)
class CloudOptions:
    url: str
    api_key: str | None = None
    pipelined: bool = True           # False: send, wait, then draft again (the sequential baseline)
    max_inflight: int = 3            # blocks in flight at once when pipelined (1: one block, drafting ahead)
    gate: Gate = Gate()
    probs_k: int = 16                # probability entries sent per drafted token when sampling
    tune: bool = True                # tune the gate online (optuna)
    tune_trials: int = 16
    tune_window_tokens: int = 48     # tokens measured per trial
    deadline_s: float | None = None  # None: max(deadline_floor_s, 4 x the expected answer time)
    deadline_floor_s: float = 2.0
    start_timeout_s: float = 30.0    # session start includes the server's prefill of the prompt
    reconnect_s: float = 0.5         # first probe interval when offline (doubles up to 8 s)
    ca_file: str | None = None       # TLS: trust this CA bundle (a self-signed verifier); None = system CAs
    seed_tuner: int = 0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise EdgespecError(f"--verifier must be an http:// or https:// URL, got {self.url!r}")
        if not 1 <= self.probs_k <= 1024:
            raise EdgespecError("probs_k must be between 1 and 1024")
        if not 1 <= self.max_inflight <= 16:
            raise EdgespecError(f"--in-flight (max_inflight) must be between 1 and 16, got {self.max_inflight}")


@dataclass
class CloudStats(GenerationStats):
    """GenerationStats plus the network's side. `rounds` counts verifications by the server only."""

    verifier_passes: int = 0     # target forward passes on the server, prefill and rebuilds included
    bytes_sent: int = 0          # HTTP bodies and headers, both directions
    bytes_received: int = 0
    offline_tokens: int = 0
    offline_spans: list = field(default_factory=list)  # [start, end) in the generated tokens
    requests: int = 0
    rebuilds: int = 0
    predrafted: int = 0          # tokens drafted ahead while a verification was in flight
    promoted: int = 0            # of those, kept by the answer they were drafted behind (counted once)
    stale_blocks: int = 0        # blocks sent ahead whose assumed state did not happen (answered stale)
    wait_s: float = 0.0          # time the drafter had nothing to do but wait for an answer
    rtt_ms: float = 0.0
    uplink_mbit_s: float = 0.0
    gate: dict = field(default_factory=dict)

    def record_round(self, drafter: str, n_drafted: int, n_accepted: int, **forced) -> None:
        if drafter != OFFLINE:  # local plain decoding is not a verification
            super().record_round(drafter, n_drafted, n_accepted, **forced)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(verifier_passes=self.verifier_passes, bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
                 offline_tokens=self.offline_tokens, offline_spans=[list(s) for s in self.offline_spans],
                 requests=self.requests, rebuilds=self.rebuilds, predrafted=self.predrafted, promoted=self.promoted,
                 stale_blocks=self.stale_blocks,
                 wait_s=round(self.wait_s, 6), rtt_ms=round(self.rtt_ms, 3),
                 uplink_mbit_s=round(self.uplink_mbit_s, 3), gate=self.gate,
                 verifier_passes_per_token=round(self.verifier_passes / self.generated, 4) if self.generated else 0.0)
        return d

    def summary(self) -> str:
        line = super().summary() + f", {self.verifier_passes} verifier passes, {self.bytes_sent + self.bytes_received} B"
        if self.offline_tokens:
            line += f", {self.offline_tokens} tokens made offline (unverified)"
        return line


# --- measuring the link ------------------------------------------------------------------------

class NetworkMonitor:
    """Round-trip time, uplink bandwidth and server time, from every request's timing.

    network time = total - server time = rtt + bytes / bandwidth, fitted by least squares over a
    window of requests (the slope is only trusted when request sizes vary enough to show it).
    """

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.server_s = 0.0
        self.draft_step_s = 0.0
        self.drafted = self.accepted = 0.0
        self._rtt, self._s_per_byte = 0.05, 0.0

    def observe(self, nbytes: int, total_s: float, server_s: float, server_time: bool = True) -> None:
        """`server_time` False: server_s includes waiting for an earlier block (a block sent ahead),
        which says nothing about the server's speed; the network part still does."""
        if server_time:
            self.server_s = server_s if not self.samples else 0.8 * self.server_s + 0.2 * server_s
        self.samples.append((float(nbytes), max(0.0, total_s - server_s)))
        x = np.array([s[0] for s in self.samples])
        y = np.array([s[1] for s in self.samples])
        if len(x) >= 4 and x.max() - x.min() > 256:
            slope, intercept = np.polyfit(x, y, 1)
            self._s_per_byte = max(0.0, float(slope))
            self._rtt = max(0.0, float(np.median(y - self._s_per_byte * x)))
        else:
            self._rtt = float(np.median(y))

    def observe_round(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted:
            self.drafted = 0.95 * self.drafted + n_drafted
            self.accepted = 0.95 * self.accepted + n_accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.8

    def best_block(self, cap: int, inflight: int = 0) -> int:
        """Block length m that maximises tokens per second when every token is accepted with the
        measured rate a: a block yields (1 - a^(m+1)) / (1 - a) tokens after m draft steps (d each)
        and one answer (L).

        Drafting ahead (`inflight` blocks at most): the block behind one stays valid with
        p = a^(m+1) (all accepted, bonus drafted right), so each restart is followed by on average
        S = p / (1 - p) valid blocks, one every max((m+1) d, L / inflight). Sequential: S = 0."""
        if not self.samples or self.draft_step_s == 0:
            return cap
        a, d = min(self.acceptance, 0.99), self.draft_step_s
        answer = self.expected_answer_s(200 + 100 * cap)
        m = np.arange(1, cap + 1)
        tokens = (1 - a ** (m + 1)) / (1 - a)
        p = a ** (m + 1) if inflight else np.zeros(len(m))
        runs = p / (1 - p)
        interval = np.maximum((m + 1) * d, answer / max(1, inflight))
        rate = (1 + runs) * tokens / (m * d + answer + runs * interval)
        return int(m[np.argmax(rate)])

    def observe_draft_step(self, seconds: float) -> None:
        self.draft_step_s = seconds if self.draft_step_s == 0 else 0.9 * self.draft_step_s + 0.1 * seconds

    @property
    def rtt_s(self) -> float:
        return self._rtt

    @property
    def uplink_bytes_per_s(self) -> float:
        return 1.0 / self._s_per_byte if self._s_per_byte > 0 else math.inf

    def expected_answer_s(self, nbytes: int) -> float:
        return self._rtt + nbytes * self._s_per_byte + self.server_s


class GateTuner:
    """Online Bayesian optimisation of the gate: one optuna trial per window of tokens, scored by
    tokens per second, then the best gate found. The study lives as long as the client."""

    SPACE = {"token_threshold": (0.0, 0.9), "product_threshold": (0.0, 0.6), "max_block": (2, 24)}

    def __init__(self, initial: Gate, n_trials: int, window_tokens: int, seed: int = 0):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        d = optuna.distributions
        self.distributions = {"token_threshold": d.FloatDistribution(*self.SPACE["token_threshold"]),
                              "product_threshold": d.FloatDistribution(*self.SPACE["product_threshold"]),
                              "max_block": d.IntDistribution(*self.SPACE["max_block"])}
        self.study = optuna.create_study(direction="maximize",
                                         sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
        self.study.enqueue_trial(asdict(initial))
        self.n_trials, self.window_tokens = n_trials, window_tokens
        self.gate = initial
        self._trial = None
        self._tokens, self._seconds = 0, 0.0
        self._next()

    def _next(self) -> None:
        done = [t for t in self.study.trials if t.state == self._optuna.trial.TrialState.COMPLETE]
        if len(done) >= self.n_trials:
            self.gate, self._trial = Gate(**self.study.best_params), None
            return
        self._trial = self.study.ask(self.distributions)
        self.gate = Gate(**self._trial.params)

    def observe(self, tokens: int, seconds: float) -> None:
        if self._trial is None:
            return
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens >= self.window_tokens and self._seconds > 0:
            self.study.tell(self._trial, self._tokens / self._seconds)
            self._tokens, self._seconds = 0, 0.0
            self._next()


# --- HTTP ----------------------------------------------------------------------------------------

class VerifierError(Exception):
    """The verifier answered with an error status."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class _Http:
    """msgpack over HTTP with byte counting. Thread-safe (httpx.Client is)."""

    def __init__(self, url: str, api_key: str | None, ca_file: str | None, max_connections: int = 8):
        import httpx

        self.httpx = httpx
        headers = {"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, verify=verify,
                                   timeout=httpx.Timeout(60.0, connect=3.0), trust_env=False,
                                   limits=httpx.Limits(max_connections=max_connections,
                                                       max_keepalive_connections=max_connections))
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.requests = 0

    def call(self, method: str, path: str, message: dict | None = None, timeout: float | None = None) -> tuple[dict, int]:
        """Returns (answer, bytes sent in this request's body). Raises VerifierError or httpx errors."""
        import msgpack

        body = pack(message) if message is not None else b""
        request = self.client.build_request(method, path, content=body or None,
                                            timeout=timeout if timeout is not None else self.httpx.USE_CLIENT_DEFAULT)
        head = len(method) + len(path) + 12 + sum(len(k) + len(v) + 4 for k, v in request.headers.raw)
        response = self.client.send(request)
        data = response.content
        with self._lock:
            self.sent += head + len(body)
            self.received += 17 + sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + len(data)
            self.requests += 1
        try:
            answer = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 20, max_str_len=8192)
        except Exception:
            answer = None
        if not isinstance(answer, dict):
            raise VerifierError(response.status_code, "malformed", f"the verifier's answer is not a msgpack map "
                                                                   f"(HTTP {response.status_code})")
        if response.status_code != 200:
            raise VerifierError(response.status_code, str(answer.get("error", "?")), str(answer.get("message", "")))
        return answer, len(body)

    def counters(self) -> tuple[int, int, int]:
        with self._lock:
            return self.sent, self.received, self.requests

    def close(self) -> None:
        self.client.close()


# --- the blocks being drafted -------------------------------------------------------------------

class _Chain:
    """Drafted tokens beyond the committed ones, with their confidences and compact distributions.

    With blocks in flight (`_Pipeline`) the chain is block_0, b_0, block_1, b_1, ...: each block in
    flight followed by the bonus token the drafter assumes the verifier will give after it; what
    follows the last of them is being drafted for the next block.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.conf: list[float] = []
        self.ids: list = []
        self.weights: list = []
        self.ahead: list[bool] = []  # drafted while a block was in flight, and not yet kept by an answer

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, conf: float, ids, weights, ahead: bool) -> None:
        self.tokens.append(token)
        self.conf.append(conf)
        self.ids.append(ids)
        self.weights.append(weights)
        self.ahead.append(ahead)

    def drop(self, n: int) -> None:
        del self.tokens[:n], self.conf[:n], self.ids[:n], self.weights[:n], self.ahead[:n]

    def promote(self) -> int:
        """An answer kept the rest of the chain: count the tokens drafted ahead that it kept first."""
        n = sum(self.ahead)
        self.ahead = [False] * len(self)
        return n

    def block_end(self, gate: Gate, room: int, eog: frozenset[int], start: int = 0) -> int | None:
        """Length of the block that starts at `start`: through the first token whose confidence is
        below the token threshold, or where the product falls to the product threshold, or an
        end-of-generation token, or `room` tokens. None: no boundary among the tokens drafted yet."""
        product = 1.0
        for i in range(start, min(len(self), start + room)):
            product *= self.conf[i]
            if self.conf[i] < gate.token_threshold or product <= gate.product_threshold or self.tokens[i] in eog:
                return i + 1 - start
        return room if len(self) - start >= room else None

    def request(self, start: int, n: int, greedy: bool) -> tuple[np.ndarray, CompactProbs | None]:
        tokens = np.asarray(self.tokens[start:start + n], dtype=np.int32)
        if greedy or n == 0:
            return tokens, None
        return tokens, CompactProbs(np.stack(self.ids[start:start + n]).astype(np.int32),
                                    np.stack(self.weights[start:start + n]).astype(np.uint16))


@dataclass
class _Server:
    session_id: str
    revision: int
    n_past: int
    limits: SessionResponse


@dataclass
class _Block:
    """One verify request on its way."""

    future: concurrent.futures.Future
    tokens: np.ndarray
    sent_at: float
    deadline: float
    assumed: bool        # sent behind an unanswered block (its request carries assume_from/assume_last)


class _Pipeline:
    """The blocks in flight, oldest first. Answers are taken in this order: a block's answer is
    only meaningful once the one ahead of it has been committed."""

    def __init__(self) -> None:
        self.blocks: deque[_Block] = deque()
        self.root = 0  # revision of the chain's first block, sent with nothing ahead: the chain's name

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def head(self) -> _Block | None:
        return self.blocks[0] if self.blocks else None

    @property
    def span(self) -> int:
        """Chain tokens the blocks in flight cover, each with its assumed bonus: where the next block starts."""
        return sum(len(b.tokens) + 1 for b in self.blocks)

    def push(self, block: _Block) -> None:
        self.blocks.append(block)

    def pop(self) -> _Block:
        return self.blocks.popleft()

    def drop(self) -> int:
        """Forget every block in flight (their answers, when they come, are ignored); how many there were."""
        n = len(self.blocks)
        self.blocks.clear()
        return n


# --- the client --------------------------------------------------------------------------------

class CloudEdgeClient:
    """A local draft model and a remote verifier. One generation at a time."""

    def __init__(self, draft: Runtime, options: CloudOptions, notify: Callable[[str], None] | None = None):
        self.engine = Engine(draft)  # the draft model is the local target when offline
        self.draft = draft
        self.options = options
        self.notify = notify or (lambda message: log.warning(message))
        # Room for every block in flight, as many just dropped as stale and still being answered, a probe
        # and a close; idle connections are kept alive so that a block never waits for a handshake.
        workers = 2 * options.max_inflight + 2
        self.http = _Http(options.url, options.api_key, options.ca_file, max_connections=workers)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgespec-net")
        self._max_inflight = options.max_inflight  # 1 once a verifier turns out to speak protocol 1.0
        self.monitor = NetworkMonitor()
        self.tuner = (GateTuner(options.gate, options.tune_trials, options.tune_window_tokens, options.seed_tuner)
                      if options.tune else None)
        self._vocab_hash: str | None = None
        self._sessions_passes: dict[str, int] = {}
        self.last_state: SpeculativeState | None = None

    @classmethod
    def load(cls, draft: str | Path, options: CloudOptions, *, n_ctx: int = 4096, n_threads: int | None = None,
             n_gpu_layers: int | None = 0, verbose: bool = False, notify: Callable[[str], None] | None = None,
             runtime: str = "llamacpp"):
        from edgespec.loader import LoadOptions, load_pair, load_runtime

        # n_gpu_layers None: all layers where a GPU build has a GPU
        load = LoadOptions(runtime=runtime, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                           verbose=verbose)
        # the draft on MLX: one sequence of its own, as llama.cpp's
        runtime = load_pair(draft, None, load)[0] if runtime == "mlx" else load_runtime(draft, load)
        try:
            return cls(runtime, options, notify)
        except BaseException:
            runtime.close()
            raise

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.http.close()
        self.draft.close()

    def __enter__(self) -> "CloudEdgeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def gate(self) -> Gate:
        return self.tuner.gate if self.tuner else self.options.gate

    # -- public API -----------------------------------------------------------------------------

    def stream(self, prompt, config: GenerationConfig = GenerationConfig(), **overrides) -> "CloudGenerationStream":
        config = replace(config, **overrides) if overrides else config
        return CloudGenerationStream(self, self.engine.prompt_tokens(prompt, raw=config.raw), config)

    def generate(self, prompt, config: GenerationConfig = GenerationConfig(), **overrides) -> GenerationResult:
        stream = self.stream(prompt, config, **overrides)
        for _ in stream:
            pass
        return stream.result

    def generate_tokens(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> GenerationResult:
        stream = CloudGenerationStream(self, list(prompt_ids), config)
        for _ in stream:
            pass
        return stream.result

    # -- sessions ---------------------------------------------------------------------------------

    def _start_request(self, state: SpeculativeState, resume: str | None, config: GenerationConfig) -> SessionRequest:
        """The session as the server must hold it: the history, the sampling chain and the constraint
        (the verifier masks its rows by it as the engine does; the draft's rows here are masked too)."""
        seed_seq = np.random.SeedSequence([state.stats.seed, 1])  # independent of the drafting stream
        server_seed = int(seed_seq.generate_state(2, np.uint64)[0] >> np.uint64(1))
        return SessionRequest(state.committed.copy(), state.sampler.params, server_seed, resume,
                              config.constraint, state.n_prompt)

    def _call_start(self, request: SessionRequest, timeout: float) -> tuple[SessionResponse, float]:
        t = time.perf_counter()
        answer, _ = self.http.call("POST", "/v1/sessions", request.to_wire(), timeout=timeout)
        try:
            response = SessionResponse.from_wire(answer)
        except ProtocolError as exc:
            raise VerifierError(502, "malformed", exc.message) from None
        return response, time.perf_counter() - t

    def _check_session(self, state: SpeculativeState, r: SessionResponse) -> _Server:
        if self._vocab_hash is None:
            self._vocab_hash = vocab_fingerprint(self.draft)
        if r.n_vocab != self.draft.vocab.n_vocab or r.vocab_hash != self._vocab_hash:
            raise EdgespecError("the verifier's target model has another vocabulary than the draft model; use a "
                                "draft from the target's family (same tokenizer)")
        need = state.n_prompt + state.max_tokens
        if need > r.max_context:
            raise EdgespecError(f"prompt ({state.n_prompt} tokens) plus --max-tokens ({state.max_tokens}) exceeds the "
                                f"verifier's session context of {r.max_context} tokens; use fewer --max-tokens")
        self._sessions_passes[r.session_id] = r.passes
        return _Server(r.session_id, r.revision, r.n_past, r)

    def _passes(self) -> int:
        return sum(self._sessions_passes.values())

    # -- the loop ---------------------------------------------------------------------------------

    def rounds(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Iterator[tuple[SpeculativeState, np.ndarray]]:
        """Yields (state, tokens added) until a stop; the state's stats are CloudStats."""
        generation = CloudGeneration(self, prompt_ids, config)
        with closing(generation.rounds()) as rounds:
            for new in rounds:
                yield generation.state, new

    def _close_quietly(self, session_id: str) -> None:
        try:
            self.http.call("DELETE", f"/v1/sessions/{session_id}", None, 5.0)
        except Exception:
            pass

    def _compact(self, row: np.ndarray):
        """The distribution sent and the one drafted from: they must be the same (see module doc)."""
        return compact_row(row, self.options.probs_k)


class CloudGeneration:
    """One generation against the verifier: `rounds` yields the tokens each turn commits.

    It carries what a generation needs between turns: the state, the session on the server (None
    while offline), the chain drafted past the committed tokens and the blocks in flight. Each turn
    does one thing, in this order of priority:

        receive     the oldest block's answer is back: reconcile it with the request, commit
        go_offline  the answer is late: carry on with the local model
        offline     no server: probe for it now and then, decode one token locally (unverified)
        send        the next block's gate has closed and a slot is free: send it
        wait        drafting more cannot help: wait for the oldest answer
        draft       one more token at the end of the chain
    """

    def __init__(self, client: CloudEdgeClient, prompt_ids: Sequence[int], config: GenerationConfig):
        self.client, self.options = client, client.options
        self.prompt_ids, self.config = list(prompt_ids), config
        self.state: SpeculativeState | None = None
        self.server: _Server | None = None
        self.last_sid: str | None = None       # the session to resume after an outage
        self.chain, self.pipe = _Chain(), _Pipeline()
        self.probe_future: concurrent.futures.Future | None = None
        self.probe_every = self.options.reconnect_s
        self.next_probe = self.last_commit = self.t_decode = 0.0
        self._counters0 = (0, 0, 0)            # the HTTP client's byte and request counters at the start

    @property
    def stats(self) -> CloudStats:
        return self.state.stats

    # -- start and end ----------------------------------------------------------------------------

    def open(self) -> SpeculativeState:
        """Prefill the draft model here while the server prefills the session there."""
        client, config, prompt_ids = self.client, self.config, self.prompt_ids
        t0 = time.perf_counter()
        seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**63)
        self._counters0 = client.http.counters()
        client._sessions_passes = {}
        # Ask the server to prefill while the draft model prefills here.
        placeholder = SpeculativeState(np.asarray(prompt_ids, dtype=np.int32), len(prompt_ids), len(prompt_ids),
                                       config.max_tokens, Sampler(config.sampling, seed),
                                       CloudStats(mode=CLOUD, prompt_tokens=len(prompt_ids), seed=seed))
        if not prompt_ids or len(prompt_ids) + config.max_tokens > client.draft.n_ctx:
            client.engine.start(prompt_ids, config, FixedPolicy(None, 0), CLOUD)  # raises the engine's clear error
        start_future = client.pool.submit(client._call_start, client._start_request(placeholder, None, config),
                                          self.options.start_timeout_s)
        # the verifier sends no logits: a cloud generation has no log-probabilities
        state = client.engine.start(prompt_ids, replace(config, seed=seed, logprobs=None), FixedPolicy(None, 0), CLOUD)
        base = state.stats
        state.stats = CloudStats(mode=CLOUD, prompt_tokens=base.prompt_tokens, seed=seed, prefill_s=base.prefill_s)
        self.state = client.last_state = state
        self._join(start_future, len(placeholder.committed) * 4 + 200)
        state.stats.prefill_s = time.perf_counter() - t0
        self.next_probe = time.perf_counter() + self.options.reconnect_s
        self.last_commit = self.t_decode = time.perf_counter()
        return state

    def _join(self, start_future: concurrent.futures.Future, nbytes: int) -> None:
        """Take the session the server started, or go on offline (with a notice) when there is none."""
        client = self.client
        try:
            response, elapsed = start_future.result(timeout=self.options.start_timeout_s + 1)
            try:
                self.server = client._check_session(self.state, response)
            except EdgespecError:
                client.pool.submit(client._close_quietly, response.session_id)
                raise
            self.last_sid = self.server.session_id
            client.monitor.observe(nbytes, elapsed, response.server_s)
        except EdgespecError:
            raise
        except VerifierError as exc:
            if exc.status in (401, 403):
                raise EdgespecError(f"the verifier refused the API key ({exc.message}); pass the right --api-key")
            if exc.status < 500 and exc.status != 429:
                raise EdgespecError(f"the verifier refused the session: {exc.message}")
            client.notify(f"verifier unavailable ({exc.status} {exc.code}); generating with the local model, "
                          "unverified")
        except Exception as exc:
            client.notify(f"verifier unreachable ({type(exc).__name__}); generating with the local model, unverified")

    def close(self) -> None:
        """The network's side of the stats; the session is closed on the server in the background."""
        client, stats = self.client, self.stats
        stats.decode_s = time.perf_counter() - self.t_decode
        stats.verify_s = stats.wait_s
        (sent, recv, req), (sent0, recv0, req0) = client.http.counters(), self._counters0
        stats.bytes_sent, stats.bytes_received, stats.requests = sent - sent0, recv - recv0, req - req0
        stats.verifier_passes = client._passes()
        stats.rtt_ms = client.monitor.rtt_s * 1000
        bw = client.monitor.uplink_bytes_per_s
        stats.uplink_mbit_s = 0.0 if math.isinf(bw) else bw * 8 / 1e6
        stats.gate = asdict(client.gate)
        if self.server is not None:
            client.pool.submit(client._close_quietly, self.server.session_id)

    # -- the loop ---------------------------------------------------------------------------------

    def rounds(self) -> Iterator[np.ndarray]:
        """Yields the tokens each turn commits until a stop (opening the session first unless `open` did)."""
        if self.state is None:
            self.open()
        try:
            while self.state.finish_reason is None:
                new = self.turn()
                if new is not None and len(new):
                    yield new
        finally:
            self.close()

    def turn(self) -> np.ndarray | None:
        """One step of the loop (see the class doc); the tokens it committed, if any."""
        now = time.perf_counter()
        head = self.pipe.head
        if head is not None and head.future.done():
            return self.receive()
        if head is not None and now > head.deadline:
            self.go_offline(f"slower than the {head.deadline - head.sent_at:.1f} s deadline")
            return None
        if self.server is None:
            return self.offline()
        if not self.send_or_wait():
            self.draft()
        return None

    # -- answers ----------------------------------------------------------------------------------

    def receive(self) -> np.ndarray | None:
        """The oldest block's answer: commit what it accepted (None when it was an error dealt with here)."""
        head = self.pipe.pop()
        t_answer = time.perf_counter()
        try:
            answer, nbytes = head.future.result()
            response = VerifyResponse.from_wire(answer, self.client.draft.vocab.n_vocab)
        except VerifierError as exc:
            self._refused(exc, head)
            return None
        except ProtocolError as exc:
            raise EdgespecError(f"the verifier sent a malformed answer: {exc.message}") from None
        except Exception as exc:
            self.go_offline(f"unreachable ({type(exc).__name__})")
            return None
        self.reconcile(head, response, nbytes, t_answer)
        return self.commit(head, response)

    def _refused(self, exc: VerifierError, head: _Block) -> None:
        """An error answer: go on where the protocol allows it (one block in flight, a rebuilt session,
        offline), else stop with the reason."""
        if exc.status in (401, 403):
            raise EdgespecError(f"the verifier refused the API key ({exc.message})") from None
        if exc.status == 400 and head.assumed:
            # a 1.0 verifier does not know assume_from/assume_last: one block in flight
            # from now on; the chain is still right and its first block goes out again
            self.client._max_inflight = 1
            self.pipe.drop()
            self.client.notify("the verifier speaks protocol 1.0; keeping one block in flight")
        elif exc.status in (404, 409):
            if not self.rebuild(self.server.session_id if exc.status == 409 else None):
                self.go_offline("lost the session and could not rebuild it")
        elif exc.status >= 500 or exc.status == 429:
            self.go_offline(f"answered {exc.status} {exc.code}")
        else:
            raise EdgespecError(f"the verifier refused a request: {exc.message}") from None

    def reconcile(self, head: _Block, response: VerifyResponse, nbytes: int, t_answer: float) -> None:
        """Measure the link by the answer, check that it fits the request, follow the session's state."""
        monitor, server = self.client.monitor, self.server
        n_sent, n = len(head.tokens), response.n_accepted
        monitor.observe(nbytes, t_answer - head.sent_at, response.server_s, not head.assumed)
        monitor.observe_round(n_sent, min(n, n_sent))
        if n > n_sent or response.n_past != server.n_past + n + 1 or response.revision != server.revision + 1:
            raise EdgespecError("the verifier's answer does not fit the request (protocol violation)")
        server.revision, server.n_past = response.revision, response.n_past
        self.client._sessions_passes[server.session_id] = response.passes

    def commit(self, head: _Block, response: VerifyResponse) -> np.ndarray:
        """Commit the accepted tokens and the correction or bonus; the blocks behind stay in flight
        only when they were drafted on exactly this outcome."""
        n_sent, n, chain = len(head.tokens), response.n_accepted, self.chain
        new = self.client.engine.accept_step(self.state, Verification(Draft(head.tokens), n, response.token), CLOUD)
        if n == n_sent and len(chain) > n_sent and chain.tokens[n_sent] == response.token:
            chain.drop(n_sent + 1)
            self.stats.promoted += chain.promote()
        else:
            self.stats.stale_blocks += self.pipe.drop()  # drafted on a future that did not happen
            self.chain = _Chain()
        tuner = self.client.tuner
        if tuner is not None:
            t = time.perf_counter()
            tuner.observe(len(new), t - self.last_commit)
            self.last_commit = t
        return new

    # -- without the server -----------------------------------------------------------------------

    def go_offline(self, reason: str) -> None:
        if self.server is not None:
            self.client.notify(f"verifier {reason}; continuing with the local model, output unverified until it "
                               "is back")
        self.server, self.chain = None, _Chain()
        self.pipe.drop()
        self.probe_every = self.options.reconnect_s
        self.next_probe = time.perf_counter() + self.probe_every

    def rebuild(self, resume: str | None) -> bool:
        """Start the session again from the whole history (same session id when it still exists)."""
        client, timeout = self.client, self.options.start_timeout_s
        self.pipe.drop()
        request = client._start_request(self.state, resume, self.config)
        try:
            response, elapsed = client.pool.submit(client._call_start, request, timeout).result(timeout=timeout + 1)
        except VerifierError as exc:
            if exc.status in (401, 403):
                raise EdgespecError(f"the verifier refused the API key ({exc.message}); pass the right --api-key")
            return False
        except Exception:
            return False
        self.server = client._check_session(self.state, response)
        self.last_sid = self.server.session_id
        self.stats.rebuilds += 1
        self.chain = _Chain()
        return True

    def offline(self) -> np.ndarray | None:
        """No server: now and then a probe (back to verifying once it answers), else one local token."""
        if self.probe_future is not None and self.probe_future.done() and self._probed():
            return None
        if self.probe_future is None and time.perf_counter() >= self.next_probe:
            self.probe_future = self.client.pool.submit(self.client.http.call, "GET", "/v1/health", None, 2.0)
        return self.offline_token()

    def _probed(self) -> bool:
        """The probe has answered: True when the session is rebuilt, else the next probe waits longer."""
        ok = self.probe_future.exception() is None
        self.probe_future = None
        if ok and self.rebuild(self.last_sid):
            self.client.notify("verifier is back; verifying again")
            return True
        self.probe_every = min(8.0, self.probe_every * 2)
        self.next_probe = time.perf_counter() + self.probe_every
        return False

    def offline_token(self) -> np.ndarray:
        """Plain decoding with the local model: the engine's zero-draft round on the draft runtime."""
        state, rt, committed = self.state, self.client.draft, self.state.committed
        kept = sync_to(rt, committed[:-1])
        if kept < len(committed) - 1:
            rt.decode(committed[kept:-1], 0)
        t = time.perf_counter()
        logits = rt.decode(committed[-1:], 1)
        row = state.sampler.rows(logits, committed, committed[:0])
        token = state.sampler.pick(row[0])
        state.stats.draft_s += time.perf_counter() - t
        start = state.n - state.n_prompt
        new = self.client.engine.accept_step(state, Verification(EMPTY_DRAFT, 0, token), OFFLINE)
        stats = self.stats
        if len(new):
            stats.offline_tokens += len(new)
            if stats.offline_spans and stats.offline_spans[-1][1] == start:
                stats.offline_spans[-1][1] = start + len(new)
            else:
                stats.offline_spans.append([start, start + len(new)])
        return new

    # -- drafting and sending ---------------------------------------------------------------------

    def send_or_wait(self) -> bool:
        """The next block starts after the blocks in flight and their assumed bonuses: send it once
        its gate closes and a slot is free, or wait for an answer where drafting more cannot help.
        False: neither; draft."""
        client, opts, state, chain, pipe = self.client, self.options, self.state, self.chain, self.pipe
        gate, limit = client.gate, client._max_inflight if opts.pipelined else 1
        eog = client.draft.vocab.eog
        base = pipe.span
        room = self._room(gate, state.remaining - base - 1, state.n + base)
        end = None
        if base == 0 or (room > 0 and len(chain) >= base):
            cap = client.monitor.best_block(max(1, room), limit if opts.pipelined else 0)
            end = chain.block_end(gate, min(room, cap), eog, base)
            if end is not None and len(pipe) < limit:
                self.send(base, end)
                return True
        # wait where drafting more cannot help: sequential mode, the next block complete and every
        # slot taken, no room for another block, or an end of generation drafted
        at_eog = len(chain) > 0 and chain.tokens[-1] in eog
        if pipe.head is not None and (not opts.pipelined or end is not None or room <= 0 or at_eog):
            self.wait(pipe.head)
            return True
        return False

    def _room(self, gate: Gate, room: int, n_base: int) -> int:
        """Most tokens a block may hold: the gate's cap, the generation budget, the server's limits."""
        limits = self.server.limits
        return max(0, min(gate.max_block, room, limits.max_draft, limits.max_context - n_base - 1))

    def send(self, start: int, n: int) -> None:
        """Send the chain's block [start, start + n) behind the blocks in flight."""
        client, server, pipe, n_committed = self.client, self.server, self.pipe, self.state.n
        tokens, probs = self.chain.request(start, n, self.state.sampler.params.greedy)
        depth = len(pipe)
        if depth == 0:
            if server.n_past != n_committed:
                raise EdgespecError("internal: client and verifier disagree on the committed length")
            request = VerifyRequest(server.revision, server.n_past, tokens, probs)
            pipe.root = server.revision
        else:  # the state after the blocks ahead, all accepted with the bonus drafted after each
            request = VerifyRequest(server.revision + depth, n_committed + start, tokens, probs,
                                    assume_from=pipe.root, assume_last=self.chain.tokens[start - 1])
        nbytes = 200 + len(tokens) * 4 + (0 if probs is None else probs.nbytes)
        expected = client.monitor.expected_answer_s(nbytes)
        deadline_s = self.options.deadline_s or max(self.options.deadline_floor_s, 4 * expected)
        t = time.perf_counter()
        future = client.pool.submit(client.http.call, "POST", f"/v1/sessions/{server.session_id}/verify",
                                    request.to_wire(), deadline_s + 5)
        pipe.push(_Block(future, tokens, t, t + deadline_s, assumed=depth > 0))

    def wait(self, head: _Block) -> None:
        t = time.perf_counter()
        concurrent.futures.wait([head.future], timeout=max(0.0, head.deadline - t))
        self.stats.wait_s += time.perf_counter() - t

    def draft(self) -> None:
        """One more draft token at the end of the chain (ahead of the blocks in flight, if any)."""
        context = self.state.committed
        if len(self.chain):
            context = np.concatenate([context, np.asarray(self.chain.tokens, dtype=np.int32)])
        t = time.perf_counter()
        token, conf, ids, weights = self.draft_one(context)
        dt = time.perf_counter() - t
        self.stats.draft_s += dt
        self.client.monitor.observe_draft_step(dt)
        ahead = self.pipe.head is not None  # drafted on the assumption that the blocks in flight are accepted
        self.stats.predrafted += ahead
        self.chain.add(token, conf, ids, weights, ahead)

    def draft_one(self, context: np.ndarray):
        """One draft token after `context`: (token, confidence, compact ids, weights)."""
        rt, sampler = self.client.draft, self.state.sampler
        kept = sync_to(rt, context)
        if kept == len(context):
            rt.truncate(kept - 1)
            kept -= 1
        logits = rt.decode(context[kept:], 1)
        row = sampler.rows(logits, context, context[:0])[0]
        if sampler.params.greedy:
            token = int(np.argmax(row))
            z = np.exp(logits[0].astype(np.float64) - float(logits[0].max()))
            return token, float(z[token] / z.sum()), None, None
        ids, weights, q = self.client._compact(row)
        token = sample(q, sampler.rng)
        return token, float(q[token]), ids, weights


class CloudGenerationStream:
    """Text pieces of one cloud-edge generation; `.result` holds the whole result afterwards."""

    def __init__(self, client: CloudEdgeClient, prompt_ids: list[int], config: GenerationConfig):
        self.client = client
        self.prompt_ids = prompt_ids
        self.config = config
        self.result: GenerationResult | None = None
        self.state: SpeculativeState | None = None

    def __iter__(self) -> Iterator[str]:
        with self.client.engine.exclusive():  # one generation at a time on the draft runtime
            yield from self._pieces()

    def _pieces(self) -> Iterator[str]:
        generation = CloudGeneration(self.client, self.prompt_ids, self.config)
        self.state = generation.open()
        output = Detokenizer(self.client.draft, self.config.stop, self.state)
        yield from output.texts(generation.rounds())
        self.result = output.result()
