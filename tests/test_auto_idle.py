"""Auto costs nothing where it drafts nothing (issue 23, item 6).

A round of `--mode auto` that drafts nothing must hand llama.cpp exactly what plain decoding hands it:
the same passes (tokens, logits rows), nothing on the draft model's context, the same graph reuse, no
thread of its own. Measured while chasing a 5-15 % slower verify_s on chat prompts: all of these were
equal, and the pass itself costs the same CPU at one thread (auto/plain 0.997); what differs is the
main thread's work between passes, which at two threads reaches the next pass through libgomp's
worker (bench/auto_idle.py measures both). These counts keep the pass side from drifting: a batch
sized for k = 16, logits for every row, a draft catch-up or a tree pass inside the verify timer.
Counts only, never timings.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from edgespec.drafters.suffix import SuffixHistory
from edgespec.engine import Engine, GenerationConfig
from edgespec.machine.profile import BATCH_SIZES, CostProfile

PROMPT = "Why do people enjoy music so much?"


def cpu_like_profile() -> CostProfile:
    """A CPU's curve (each extra row costs most of a step): speculation pays only on real copies."""
    return CostProfile(verify_s={n: 0.01 * (1 + 0.7 * (n - 1)) for n in BATCH_SIZES}, draft_s=0.004,
                       draft_catchup_s=0.005, lookup_s=1e-5, suffix_s=1e-4)


@pytest.fixture(scope="module")
def engine(smollm2_path, smollm2_draft):
    from conftest import load_runtime

    eng = Engine(load_runtime(smollm2_path, n_seq_max=4), load_runtime(smollm2_draft))
    eng._profile = cpu_like_profile()
    yield eng
    eng.close()


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


def run_traced(engine: Engine, mode: str, monkeypatch) -> dict:
    """One greedy generation from an empty KV and an empty suffix history; every llama_decode recorded."""
    import edgespec.runtimes.llamacpp as lc

    ll = lc.ll
    calls, threads = [], set()
    decode = ll.llama_decode

    def traced(ctx, batch):
        n = batch.n_tokens
        rows = int(np.count_nonzero(np.ctypeslib.as_array(batch.logits, shape=(n,))))
        rc = decode(ctx, batch)
        threads.update(_threads())
        calls.append(("target" if ctx == engine.target._ctx else "draft", n, rows))
        return rc

    monkeypatch.setattr(ll, "llama_decode", traced)
    engine.target.truncate(0)
    engine.draft_runtime.truncate(0)
    engine.use_history(SuffixHistory())
    reused = ll.llama_perf_context(engine.target._ctx).n_reused
    result = engine.generate(PROMPT, GenerationConfig(max_tokens=12, temperature=0, mode=mode))
    monkeypatch.setattr(ll, "llama_decode", decode)
    return {"result": result, "calls": calls, "threads": threads,
            "reused": ll.llama_perf_context(engine.target._ctx).n_reused - reused}


def test_an_auto_round_that_drafts_nothing_hands_llama_cpp_what_plain_does(engine, monkeypatch):
    plain = run_traced(engine, "ar", monkeypatch)
    auto = run_traced(engine, "auto", monkeypatch)
    assert auto["result"].stats.drafted == 0, "the prompt must be one auto cannot draft"
    assert auto["result"].tokens == plain["result"].tokens
    assert auto["result"].stats.rounds == plain["result"].stats.rounds
    # the same passes: one prefill, then one token and one logits row per round
    assert auto["calls"] == plain["calls"]
    assert all(n == 1 and rows == 1 for _, n, rows in plain["calls"][1:])
    assert not [c for c in auto["calls"] if c[0] == "draft"]  # no draft prefill or catch-up
    assert auto["reused"] == plain["reused"]  # llama.cpp reused its graph as often
    assert auto["threads"] <= plain["threads"] | _threads()  # no thread of auto's own
