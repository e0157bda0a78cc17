"""The memory guard's ladder, tested by resident memory falling after each step (real objects: a prefix
cache of llama.cpp KV blobs, a big suffix history, a loaded SmolLM2 draft), and a load test that samples
the resident set every 10 ms under a budget just above what the target alone needs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.machine.guard import (LADDER, DraftModelReleaser, KvPoolReleaser, MemoryBudgetError, MemoryGuard,
                                    PrefixCacheReleaser, SuffixHistoryReleaser, trim_heap)
from edgespec.machine.memory import current_rss

MiB = 1 << 20


def freed_by(releaser) -> tuple[int, int, int]:
    """(estimate, resident bytes freed by the step alone, freed once the heap is trimmed too)."""
    trim_heap()
    estimate = releaser.frees()
    before = current_rss()
    releaser.release()
    after = current_rss()
    trim_heap()
    return estimate, before - after, before - current_rss()


def filled_prefix_cache(runtime, n_entries: int = 6, n_tokens: int = 256):
    from edgespec.serve.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 30)
    rng = np.random.default_rng(0)
    for _ in range(n_entries):  # distinct sequences: none is a prefix of another
        runtime.truncate(0)
        runtime.decode(rng.integers(100, 20000, n_tokens).astype(np.int32), 0)
        assert cache.store({"target": runtime})
    runtime.truncate(0)
    return cache


def test_each_step_gives_memory_back(smollm2_path, smollm2_draft, capsys):
    from edgespec.drafters.suffix import SuffixHistory
    from edgespec.engine import Engine

    engine = Engine(load_runtime(smollm2_path, n_ctx=2048, n_threads=1),
                    load_runtime(smollm2_draft, n_ctx=2048, n_threads=1), history=SuffixHistory(limit=1 << 24))
    try:
        cache = filled_prefix_cache(engine.target)
        for _ in range(8):
            engine.history.add(np.arange(1 << 21, dtype=np.int32) % 5000)  # 16M tokens: 64 MiB of int32
        steps = [PrefixCacheReleaser(cache), SuffixHistoryReleaser(lambda: engine.history),
                 SuffixHistoryReleaser(lambda: engine.history), DraftModelReleaser(engine)]
        steps[2].shrunk = True  # the second one drops what the first one kept
        results = {}
        for name, step in zip(("prefix cache", "history shrink", "history drop", "draft model"), steps):
            results[name] = freed_by(step)
        with capsys.disabled():
            for name, (estimate, alone, trimmed) in results.items():
                print(f"\n  {name:15} estimate {estimate / MiB:7.1f} MiB, resident -{alone / MiB:7.1f} MiB, "
                      f"after malloc_trim -{trimmed / MiB:7.1f} MiB", end="")
        for name, (estimate, _, trimmed) in results.items():
            assert estimate > 4 * MiB, name
            assert trimmed >= 0.6 * estimate, (name, results)  # the memory the step names is really returned
        assert len(cache) == 0 and cache.max_bytes == 0 and len(engine.history) == 0
        assert engine.draft_runtime is None and "draft" not in engine.drafters
        result = engine.generate("Hi", max_tokens=4, temperature=0, mode="auto")  # model-free from now on
        assert result.stats.generated >= 1
    finally:
        engine.close()


def test_the_kv_pools_shrink_mid_generation_and_grow_back_with_the_output_unchanged(smollm2_path, smollm2_draft):
    """A 16k-token context's pools are most of what a small pair holds. Under pressure the guard's kv_pool
    step re-creates both contexts at the tokens they hold, mid-generation; the pools grow back as the
    answer needs, and the answer is the one the same engine gives unshrunk, token for token (llama.cpp
    attends over the used cells, whatever the pool's size). A saved state longer than a shrunk pool
    loads back into it. --parallel's shared pool is not offered."""
    from edgespec.engine import Engine, GenerationConfig

    n_ctx = 16384
    engine = Engine(load_runtime(smollm2_path, n_ctx=n_ctx, n_threads=1),
                    load_runtime(smollm2_draft, n_ctx=n_ctx, n_threads=1))
    try:
        ids = engine.target.tokenize("Write a long story about a lighthouse keeper.", add_special=True)
        never_end = tuple((t, -100.0) for t in engine.target.vocab.eog)  # an answer as long as asked
        config = GenerationConfig(max_tokens=600, temperature=0, mode="draft", logit_bias=never_end)
        reference = engine.generate_tokens(ids, config).tokens
        blob, held = engine.target.save_state(), engine.target.tokens
        engine.target.truncate(0)
        trim_heap()
        step = KvPoolReleaser(lambda: [engine.target, engine.draft_runtime])
        estimate = step.frees()
        assert estimate >= 0.8 * 2 * engine.target.pool_bytes()  # both pools, nearly all of them
        guard = MemoryGuard(int((current_rss() - estimate / 2) / 0.97), releasers=[step])
        engine.memory_guard = guard
        result = engine.generate_tokens(ids, config)
        (taken,) = guard.released
        print(f"\n  kv_pool: estimate {estimate / MiB:.1f} MiB, resident {taken['rss_before'] / MiB:.0f} -> "
              f"{taken['rss_after'] / MiB:.0f} MiB; pools after the answer {engine.target.pool_cells}, "
              f"{engine.draft_runtime.pool_cells} cells; {guard.events[0]}")
        assert taken["step"] == "kv_pool" and taken["rss_before"] - taken["rss_after"] >= 0.6 * estimate
        assert result.tokens == reference  # zero tolerance: the same engine, its pools shrunk and grown
        assert len(ids) + 600 <= engine.target.pool_cells < n_ctx  # grown back, doubling, as far as needed
        engine.memory_guard = None
        engine.target.truncate(0)
        engine.target.resize_pool(0)
        assert engine.target.pool_cells == 256
        engine.target.load_state(blob, held)  # longer than the pool: it grows first
        assert engine.target.pool_cells >= len(held) and np.array_equal(engine.target.tokens, held)
    finally:
        engine.close()
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    with LlamaCppMultiSeqRuntime(smollm2_path, LlamaCppOptions(n_ctx=4096, n_threads=1), n_seq=2) as shared:
        assert not shared.pool_resizable and KvPoolReleaser(lambda: [shared]).frees() == 0


GROW_WITHOUT_MEMORY = """
import resource, sys
import numpy as np
from edgespec.errors import EdgespecError
from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

rt = LlamaCppRuntime(sys.argv[1], LlamaCppOptions(n_ctx=32768, n_threads=1))
rt.decode(np.arange(100, 200, dtype=np.int32), 1)
rt.resize_pool(0)
before = rt.decode([300], 1)
rt.truncate(100)
# the address space as it is, plus 64 MiB: room to re-make a small pool, not a 32k one
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    rt.resize_pool(32768)
except EdgespecError as e:
    print(e)
print(rt.pool_cells, rt.n_past, bool(np.array_equal(rt.decode([300], 1), before)))
"""


def test_a_pool_that_cannot_grow_keeps_its_sequence_and_says_so(smollm2_path):
    """A real allocation failure (the address space capped in a child process): the runtime re-makes
    the pool it had, keeps the held tokens (the next row is the one before), and says why in one line."""
    proc = subprocess.run([sys.executable, "-c", GROW_WITHOUT_MEMORY, str(smollm2_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, state = proc.stdout.strip().splitlines()
    assert "no memory to grow the KV pool from 256 to 32768 cells; the sequence is kept" in error
    assert state == "256 100 True"


def test_the_guard_climbs_the_ladder_until_memory_falls_under_the_soft_line():
    """Real pressure, real memory: the budget is set so that only shedding both holders gets under it."""
    from edgespec.drafters.suffix import SuffixHistory
    from edgespec.machine.guard import CallbackReleaser

    history = SuffixHistory(limit=1 << 24)
    history.add(np.arange(1 << 23, dtype=np.int32))  # 32 MiB
    ballast = [bytearray(b"\1" * (48 * MiB))]
    guard = MemoryGuard(int((current_rss() - 8 * MiB) / 0.97), releasers=[
        CallbackReleaser("saved_state", lambda: len(ballast) * 48 * MiB, lambda: (ballast.clear(), "shed")[1]),
        SuffixHistoryReleaser(lambda: history)])
    before = current_rss()
    guard.check()
    assert current_rss() < guard.soft * guard.budget_bytes and before - current_rss() > 40 * MiB
    assert guard.admitting and [r["step"] for r in guard.released][0] == "saved_state"
    assert all(r["rss_after"] < r["rss_before"] for r in guard.released)


def test_with_nothing_left_the_guard_stops_admitting_then_refuses():
    guard = MemoryGuard(int(current_rss() / 0.98))
    guard.check()
    assert not guard.admitting and "memory" in guard.refusal() and not guard.still_admitting()
    guard.budget_bytes *= 4
    assert guard.still_admitting()  # sampled again on a new request: room again
    with pytest.raises(MemoryBudgetError, match="nothing left to free"):
        MemoryGuard(int(current_rss() / 0.999)).check()
    relaxed = MemoryGuard(current_rss() * 4)
    relaxed.admitting = False
    relaxed.check()
    assert relaxed.admitting  # room again: requests are taken


def test_the_ladder_is_one_table_in_order():
    assert [s.name for s in LADDER] == ["saved_state", "suffix_history", "kv_pool", "draft_model", "admission",
                                        "refuse"]
    guard = MemoryGuard(1 << 40)
    from edgespec.drafters.suffix import SuffixHistory
    from edgespec.serve.prefix_cache import PrefixCache

    guard.offer(SuffixHistoryReleaser(lambda: SuffixHistory()))
    guard.offer(PrefixCacheReleaser(PrefixCache(1)))
    assert [r.step for r in guard.releasers] == ["saved_state", "suffix_history"]


# --- under load: --parallel, the server's 429 ---------------------------------------------------------

class RssSampler:
    """The resident set every 10 ms (a thread reading /proc/self/statm)."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(current_rss())
            time.sleep(0.01)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_under_load_the_parallel_server_stays_under_a_budget_for_the_target_alone(smollm2_path, smollm2_draft):
    """4 slots, target + draft loaded, a prefix cache and a suffix history growing; the budget is just
    above what the target alone holds. The guard sheds the cache, the history and the draft, stops
    admitting when it must (429 naming memory), and the resident set never crosses the budget.

    Run in a fresh interpreter, as a server runs: a budget bounds the process's resident set, and the
    test process carries every earlier test's heap (in the full suite freed memory stayed resident
    there and every request was refused)."""
    code = ("import test_guard; test_guard.parallel_server_under_budget("
            f"{str(smollm2_path)!r}, {str(smollm2_draft)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def parallel_server_under_budget(smollm2_path: str, smollm2_draft: str) -> None:
    import httpx

    from edgespec.machine.guard import offer_engine_steps
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions
    from edgespec.serve.server import ServerConfig, create_app
    from edgespec.serve.slots import ParallelEngine

    options = LlamaCppOptions(n_ctx=2048, n_threads=1)
    target = LlamaCppMultiSeqRuntime(smollm2_path, options, n_seq=4)
    trim_heap()
    budget = current_rss() + 48 * MiB  # the process and the target, a little room; not the draft
    engine = ParallelEngine(target, LlamaCppMultiSeqRuntime(smollm2_draft, options, n_seq=4), slot_ctx=512)
    engine.memory_guard = MemoryGuard(budget)
    offer_engine_steps(engine.memory_guard, engine)
    app = create_app(engine, ServerConfig(model_id="m", mode="auto", prefix_cache_bytes=64 << 20, max_queue=64))
    service = app.state.service
    engine.memory_guard.check()  # a server under --budget is guarded from its first step
    statuses, bodies, refused = [], [], []

    async def one(client, i):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": f"Story {i}: once upon a time",
                                                       "max_tokens": 24, "temperature": 0}, timeout=120)
        statuses.append(r.status_code)
        bodies.append(r.json())

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            await asyncio.gather(*(one(client, i) for i in range(16)))
            guard = engine.memory_guard  # then pressure with nothing left to free: new requests get 429
            for _ in range(5):  # what is left to shed (a refilled prefix cache) goes first
                guard.budget_bytes = int(current_rss() / 0.98)
                guard.check()
                if not guard.admitting:
                    break
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
            refused.append((r.status_code, r.json(), r.headers))
            guard.budget_bytes = budget

    try:
        with RssSampler() as sampler:
            asyncio.run(asyncio.wait_for(run(), 55))
    finally:
        service.queue.close()
        engine.close()
    assert len(statuses) == 16 and set(statuses) <= {200, 429}, bodies
    assert statuses.count(200) >= 1
    for status, body in zip(statuses, bodies):
        if status == 429:
            assert body["error"]["code"] in ("memory_pressure", "queue_full") and body["error"]["message"]
    status, body, headers = refused[0]
    assert status == 429 and body["error"]["code"] == "memory_pressure" and "memory" in body["error"]["message"]
    assert headers.get("retry-after")
    assert engine.draft_runtime is None  # the draft did not fit beside the target: it went
    assert max(sampler.samples) < budget, (max(sampler.samples) / MiB, budget / MiB)
    assert len(sampler.samples) > 10


# --- the cloud verifier: per-session state -------------------------------------------------------------

def test_the_verifier_sheds_idle_sessions_then_refuses_new_ones(smollm2_path):
    from edgespec.cloud.protocol import ProtocolError, SessionRequest
    from edgespec.cloud.verifier import VerifierConfig, load_core
    from edgespec.sampling import SamplingParams

    config = VerifierConfig(api_keys=("k" * 8,), max_sessions=4, max_context=256, budget_bytes=current_rss() * 8,
                            idle_shed_s=0.5)
    core = load_core(str(smollm2_path), config, n_threads=1)
    guard = core.memory_guard

    def start(n: int):
        request = SessionRequest(np.arange(100, 100 + n, dtype=np.int32), SamplingParams(temperature=0), 1)
        return core.submit("start", "owner", request).result(timeout=60)

    try:
        ids = [start(40 + i).session_id for i in range(3)]
        assert len(core.sessions) == 3
        time.sleep(0.6)
        assert guard.estimates()["saved_state"] > 3 * 40 * 8
        trim_heap()
        guard.budget_bytes = int(current_rss() / 0.98)  # pressure: idle sessions go first
        deadline = time.monotonic() + 5
        while core.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(ids) & set(core.sessions) and core.stats()["shed"] == 3
        time.sleep(1.2)  # still pressed, nothing left to shed: no new sessions, with the usual error
        with pytest.raises(ProtocolError) as refused:
            start(20)
        assert refused.value.status == 503 and "memory" in refused.value.message
        guard.budget_bytes = current_rss() * 8  # room again
        time.sleep(1.2)
        assert start(20).session_id
    finally:
        core.stop()
        core.runtime.close()
