"""`serve --parallel N`: several requests in one llama.cpp context, advanced in one batched target
pass per step. Real server processes on loopback with SmolLM2, and the slot scheduler in-process on
the tiny models for the statistical test."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import load_runtime
from test_lossless_sampling import N_SAMPLES, N_TOKENS, PROMPT, SAMPLING, chi_square_pvalue, exact_joint
from test_server import COUNTING, KEY, MODEL, health, post, running_server
from edgespec.engine import Engine, GenerationConfig
from edgespec.serve.slots import ParallelEngine, SlotScheduler, SlotsError, slot_context

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n\n# a function that", "Water boils at",
           "My favourite season is autumn because", "1, 2, 3, 4, 5, 6, 7, 8,"]


@pytest.fixture(scope="module")
def parallel_server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-parallel") / "server.log"
    with running_server(log, "--target", smollm2_path, "--model-name", MODEL, "--mode", "lookup", "--parallel", 4,
                        "--ctx", 4096, "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def plain(smollm2_path):
    """The same model alone in this process (one sequence, no flash attention: as the slots run it)."""
    with Engine(load_runtime(smollm2_path, n_ctx=1024, n_threads=1, flash_attn=False)) as e:
        yield e


# llama.cpp's CPU kernels give a batch other logits than one token (up to ~1.4 on SmolLM2:
# `python -m edgespec.bench.batch_numerics`), so a token a batched pass chose may sit a little below
# the argmax of a solo re-evaluation; a token taken from another sequence's context sits far below.
OWN_CONTEXT_GAP = 1.5


def argmax_gaps(runtime, prompt_ids: list[int], tokens: list[int]):
    """For each emitted token: how far below the target's best its logit is, given the request's own
    prompt and earlier tokens (one solo pass over the whole text). 0 = the argmax itself."""
    import numpy as np

    runtime.truncate(0)
    rows = runtime.decode(list(prompt_ids) + tokens[:-1], len(tokens))
    runtime.truncate(0)
    return rows.max(axis=1) - rows[np.arange(len(tokens)), tokens]


def wait_slots_idle(url: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if h["slots"]["active"] == 0 and not h["queue"]["waiting"]:
            return h
        assert time.monotonic() < deadline, f"the slots are still busy: {h}"
        time.sleep(0.1)


def test_eight_concurrent_requests_each_equal_their_solo_greedy_output(parallel_server, plain):
    prompt_ids = [plain.prompt_tokens(p, raw=True) for p in PROMPTS]
    before = wait_slots_idle(parallel_server)["slots"]
    results: dict[int, dict] = {}

    def ask(i):
        r = post(parallel_server, "/v1/completions", {"model": MODEL, "prompt": prompt_ids[i], "max_tokens": 40,
                                                      "temperature": 0}, timeout=300)
        results[i] = r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text}

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == len(PROMPTS) and all("choices" in r for r in results.values()), results
    after = wait_slots_idle(parallel_server)["slots"]
    assert after["max_active"] == 4, after  # 8 requests on 4 slots: all four ran at once
    assert after["batched_steps"] - before["batched_steps"] > 20, after  # passes that served several requests

    identical, worst, crossed = 0, 0.0, float("inf")
    for i, ids in enumerate(prompt_ids):
        got = results[i]["edgespec"]["tokens"]
        solo = plain.generate_tokens(ids, GenerationConfig(max_tokens=40, temperature=0, mode="ar")).tokens
        identical += solo == got
        gaps = argmax_gaps(plain.target, ids, got)
        worst = max(worst, float(gaps.max()))
        assert gaps.max() <= OWN_CONTEXT_GAP, (
            f"request {i} ({PROMPTS[i]!r}) emitted token {int(gaps.argmax())} {gaps.max():.3f} below the target's "
            "best given its own context: another sequence leaked in, or verification is wrong")
        text = b"".join(plain.target.token_bytes(t) for t in got).decode("utf-8", errors="replace")
        assert results[i]["choices"][0]["text"] == text
        # the check can fail: the same tokens read after another request's prompt are far from greedy
        other = prompt_ids[(i + 1) % len(PROMPTS)]
        crossed = min(crossed, float(argmax_gaps(plain.target, other, got).max()))
    print(f"\n{identical} of {len(PROMPTS)} identical to solo plain decoding (the rest differ after a near-tie); "
          f"worst gap {worst:.3f}; smallest gap of swapped outputs {crossed:.3f}")
    assert crossed > OWN_CONTEXT_GAP


def test_a_request_cancelled_mid_stream_frees_its_slot(parallel_server):
    wait_slots_idle(parallel_server)
    cancelled_before = health(parallel_server)["requests"]["cancelled"]
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 900, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120, headers=headers) as http:
        streams = [http.stream("POST", f"{parallel_server}/v1/completions", json=body) for _ in range(4)]
        opened = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in opened]  # kept: a dropped iterator closes its connection
            for it in lines:  # every slot is generating
                assert next(line for line in it if line.startswith("data: "))
            assert health(parallel_server)["slots"]["active"] == 4
            streams[0].__exit__(None, None, None)  # the client goes away mid-stream
            deadline = time.monotonic() + 20
            while health(parallel_server)["slots"]["active"] != 3:
                assert time.monotonic() < deadline, "the cancelled request kept its slot"
                time.sleep(0.05)
            # the freed slot serves a new request while the three others still generate
            r = post(parallel_server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            h = health(parallel_server)
            assert h["slots"]["active"] == 3 and h["queue"]["waiting"] == 0, h
            assert h["requests"]["cancelled"] == cancelled_before + 1
        finally:
            for s in streams[1:]:
                s.__exit__(None, None, None)
    assert wait_slots_idle(parallel_server)["requests"]["cancelled"] == cancelled_before + 4


@pytest.mark.slow
def test_beyond_the_slots_and_the_queue_clients_get_429(smollm2_path, tmp_path):
    with running_server(tmp_path / "server.log", "--target", smollm2_path, "--mode", "ar", "--parallel", 2,
                        "--ctx", 1024, "--max-queue", 1, "--prefix-cache-mb", 0) as url:
        results = []

        def one(i):
            r = post(url, "/v1/completions", {"model": MODEL, "prompt": f"{COUNTING} #{i}", "max_tokens": 48,
                                              "temperature": 0}, key=None, timeout=120)
            results.append((r.status_code, r.json(), r.headers))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        statuses = sorted(s for s, _, _ in results)
        assert len(statuses) == 7 and set(statuses) <= {200, 429}, results
        assert statuses.count(200) >= 3 and statuses.count(429) >= 1  # two slots + one waiting get through
        refused = next(body for s, body, _ in results if s == 429)
        assert refused["error"]["code"] == "queue_full" and "slots" in refused["error"]["message"]
        assert all(h.get("retry-after") for s, _, h in results if s == 429)
        h = wait_slots_idle(url)
        assert h["requests"]["rejected"] == statuses.count(429) and h["requests"]["completed"] == statuses.count(200)
        assert post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, key=None).status_code == 200


@pytest.mark.parametrize("args, says", [(["--parallel", "64", "--ctx", "2048"], "tokens of context per slot"),
                                        (["--parallel", "0"], "--parallel must be between"),
                                        (["--parallel", "2", "--ctx", "0"], "explicit --ctx")])
def test_more_slots_than_the_context_allows_is_one_clear_line(args, says):
    proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_slot_context_is_the_pools_share():
    assert slot_context(4096, 4) == 1024
    with pytest.raises(SlotsError, match="at least 8192"):
        slot_context(4096, 64)


# --- sampling under load: the target's distribution, per request ---------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_sampled_outputs_under_load_pass_the_chi_square_check(tiny_pair, tmp_path_factory, mode):
    """N_SAMPLES requests (each its own seed) submitted at once to 4 slots: they share every pass with
    each other, and the first three tokens must still follow the target's exact joint distribution."""
    from tiny_models import write_tiny_llama
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    rt = load_runtime(tiny_pair["target"], n_ctx=256)
    joint = exact_joint(rt, PROMPT)
    rt.close()
    medium = write_tiny_llama(tmp_path_factory.mktemp("medium") / "draft-medium.gguf", seed=7, perturb_from=0,
                              perturb_scale=0.3)
    options = LlamaCppOptions(n_ctx=1024, n_threads=1)
    with ParallelEngine(LlamaCppMultiSeqRuntime(tiny_pair["target"], options, n_seq=4),
                        LlamaCppMultiSeqRuntime(medium, options, n_seq=4), slot_ctx=256) as engine:
        scheduler = SlotScheduler(engine, max_queue=N_SAMPLES)
        cfg = dict(max_tokens=N_TOKENS, mode=mode, draft_max=2, **SAMPLING)

        async def run_all():
            return await asyncio.gather(*[scheduler.generate(PROMPT, GenerationConfig(seed=seed, **cfg))
                                          for seed in range(N_SAMPLES)])

        try:
            results = asyncio.run(run_all())
        finally:
            scheduler.close()
        counters = dict(scheduler.counters)
    samples = [tuple(r.tokens) for r in results]
    assert all(len(s) == N_TOKENS for s in samples)
    assert counters["max_active"] == 4 and counters["batched_steps"] > N_SAMPLES // 2, counters
    assert sum(r.stats.drafted for r in results) > N_SAMPLES // 2  # speculation ran, per request
    assert set(samples) <= set(joint), "sampled an outcome the target gives probability 0"
    p = chi_square_pvalue(samples, joint)
    print(f"\nparallel {mode}: chi-square p = {p:.4f} over {N_SAMPLES} samples, {counters}")
    assert p > 0.001


def test_a_budget_plans_and_loads_the_slots(smollm2_path):
    """serve --parallel N --budget B: the plan's pool and rows are what gets loaded, and it serves."""
    from edgespec.machine.memory import current_rss
    from edgespec.machine.planner import apply_budget_parallel

    # The plan counts what this process already holds: a long pytest run holds much, so the budget is
    # that plus 1 GiB (a fixed "1G" passes alone and fails after other tests loaded their models).
    budget = current_rss() + (1 << 30)
    engine, the_plan = apply_budget_parallel(smollm2_path, None, parallel=2, budget=budget, ctx=1024, n_threads=1)
    with engine:
        assert engine.n_slots == 2 and engine.slot_ctx == 512 and the_plan.fits
        assert engine.target.n_ctx == 1024
        assert engine.target.options.n_outputs_max == the_plan.settings.target_settings().n_outputs_max == 10
        scheduler = SlotScheduler(engine)
        try:
            result = asyncio.run(scheduler.generate(engine.front.prompt_tokens("Hi", raw=True),
                                                    GenerationConfig(max_tokens=4, temperature=0, mode="lookup")))
        finally:
            scheduler.close()
        assert len(result.tokens) == 4


# --- in-process: continuous batching, chunked prefill, prefix reuse per slot -----------------------

@pytest.fixture(scope="module")
def smol_slots(smollm2_path):
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    with ParallelEngine(LlamaCppMultiSeqRuntime(smollm2_path, LlamaCppOptions(n_ctx=2048, n_threads=1), n_seq=2),
                        slot_ctx=1024) as engine:
        yield engine


def test_a_joining_prompt_is_prefilled_in_chunks_beside_a_running_request(smol_slots, plain):
    scheduler = SlotScheduler(smol_slots, prefill_chunk=32)
    long_prompt = plain.prompt_tokens("Summarise: " + "the quick brown fox jumps over the lazy dog; " * 30, raw=True)
    counting = plain.prompt_tokens(COUNTING, raw=True)

    async def run():
        first = scheduler.submit(counting, GenerationConfig(max_tokens=60, temperature=0, mode="ar"))
        async for _ in first:  # the first request is generating when the second joins
            break
        second = await scheduler.generate(long_prompt, GenerationConfig(max_tokens=4, temperature=0, mode="ar"))
        return await first.text(), second

    try:
        a, b = asyncio.run(run())
    finally:
        scheduler.close()
    c = scheduler.counters
    chunks = -(-(len(long_prompt) - 1) // 32)
    assert len(long_prompt) > 300 and c["prefill_chunks"] >= chunks
    assert c["mixed_steps"] >= chunks - 1, c  # the running request kept decoding through the prefill
    assert a.finish_reason == "length" and len(b.tokens) == 4
    assert argmax_gaps(plain.target, counting, a.tokens).max() <= OWN_CONTEXT_GAP
    assert argmax_gaps(plain.target, long_prompt, b.tokens).max() <= OWN_CONTEXT_GAP


def test_each_slot_keeps_its_prefix_for_the_next_request(smol_slots, plain):
    scheduler = SlotScheduler(smol_slots)
    one = "You are a patient tutor of chemistry for high-school students. Explain with everyday examples. " * 3
    two = "You are a terse assistant for shell scripting questions; answer with one command and no prose. " * 3

    def chat(system, user):
        return plain.prompt_tokens([{"role": "system", "content": system}, {"role": "user", "content": user}])

    async def run():
        cfg = GenerationConfig(max_tokens=4, temperature=0, mode="ar")
        await asyncio.gather(scheduler.generate(chat(one, "What is an acid?"), cfg),
                             scheduler.generate(chat(two, "List files."), cfg))
        # each slot now holds one system prompt; each follow-up goes to the slot holding its own
        return await asyncio.gather(scheduler.generate(chat(two, "Count lines."), cfg),
                                    scheduler.generate(chat(one, "What is a base?"), cfg))

    try:
        again_two, again_one = asyncio.run(run())
    finally:
        scheduler.close()
    n_one = len(plain.prompt_tokens([{"role": "system", "content": one}]))
    n_two = len(plain.prompt_tokens([{"role": "system", "content": two}]))
    assert again_one.stats.cached_tokens >= n_one - 5 and again_two.stats.cached_tokens >= n_two - 5


def test_every_slot_starts_from_what_auto_learned_in_any_of_them(smol_slots, plain):
    """Auto's acceptance record (Engine.acceptance) is the engine's, not one slot's: a request that
    ends in one slot leaves its record to every slot's next request."""
    for e in smol_slots.engines:
        e.acceptance = None
    scheduler = SlotScheduler(smol_slots)
    try:
        asyncio.run(scheduler.generate(plain.prompt_tokens(COUNTING, raw=True),
                                       GenerationConfig(max_tokens=12, temperature=0, mode="auto")))
    finally:
        scheduler.close()
    records = [e.acceptance for e in smol_slots.engines]
    assert records[0] is not None and all(r is records[0] for r in records)
