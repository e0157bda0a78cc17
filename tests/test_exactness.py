"""Exactness with zero tolerance, on every path, with an audit trail of the verify passes.

Each test records every verify pass (edgespec.audit.Recorder) and checks two things:

1. every emitted token is what the acceptance rule gives on the recorded rows, with NO tolerance
   (greedy: the argmax; sampling: rejection sampling re-run with the recorded uniforms), and each
   pass's fed tokens sit at their positions in the committed text;
2. each recorded row belongs to its committed context: it equals a fresh one-sequence evaluation of
   that prefix within the spread the same test measures between evaluating the prefixes at other
   batch shapes (edgespec.audit.Fresh); never a constant.

Negative controls show each check fails when it should: an acceptance rule that takes near-argmax
drafts; a rejected draft's KV left in place (rollback skipped); rows read one position off; a slot
reading another slot's KV cells. The paths: the single engine (lookup, draft, suffix, auto, trees;
greedy and the default sampling chain with a repetition penalty), `--parallel` slots with concurrent
requests, the cloud verifier (a real HTTP server on loopback) and ONNX Runtime.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from conftest import load_runtime, pooled_fresh
from edgespec.audit import ExactnessError, Fresh, Recorder, check_decisions, check_rows
from edgespec.engine import Engine, GenerationConfig
from edgespec.machine.profile import CostProfile

PROMPT = [295, 104, 101, 108, 108, 111, 32, 104, 101, 108, 108, 111]  # BOS "hello hello": lookup finds matches
PROMPTS = [PROMPT, [295, 116, 104, 101, 32, 99, 97, 116], [295, 97, 98, 99, 97, 98, 99, 32, 97],
           [295, 111, 110, 99, 101, 32, 117, 112, 111, 110], [295, 49, 50, 51, 32, 49, 50, 51],
           [295, 100, 101, 102, 32, 102, 40, 120, 41, 58]]
GREEDY = dict(temperature=0.0)
CHAIN = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)  # the default chain, penalised
FLAT_VERIFY = CostProfile({n: 0.01 for n in (1, 2, 3, 4, 6, 8)}, 0.001, 0.0012, 0.00005)  # auto drafts (and branches)


def rt(path, **options):
    return load_runtime(path, **{"n_ctx": 512, "n_threads": 1, **options})


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def fresh(tiny):
    runtime = rt(tiny["target"])
    yield Fresh(runtime)
    runtime.close()


def audited_engine(tiny, draft="good_draft", mode="draft", target=None):
    engine = Engine(target or rt(tiny["target"], n_seq_max=4 if mode == "trees" else 1), rt(tiny[draft]))
    if mode in ("auto", "trees"):
        engine._profile = FLAT_VERIFY
    engine.recorder = Recorder()
    return engine


def generate(engine, prompt, sampling, mode, seed=0, max_tokens=32, verifier=None):
    config = GenerationConfig(max_tokens=max_tokens, mode="auto" if mode == "trees" else mode, draft_max=4, seed=seed,
                              **sampling)
    engine.recorder.passes.clear()
    result = engine.generate_tokens(prompt, config, verifier=verifier)
    return result, list(engine.recorder.passes)


# --- the single engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [GREEDY, CHAIN], ids=["greedy", "chain"])
@pytest.mark.parametrize("mode", ["draft", "lookup", "suffix", "auto", "trees"])
def test_every_emitted_token_is_the_rules_on_its_recorded_rows(tiny, fresh, mode, sampling):
    with audited_engine(tiny, "good_draft", mode) as engine:
        if mode == "suffix":  # suffix drafts from earlier outputs: give it one
            generate(engine, PROMPT, sampling, "ar", seed=1)
        drafted = trees = 0
        for seed, prompt in enumerate(PROMPTS[:3]):
            result, passes = generate(engine, prompt, sampling, mode, seed=seed)
            assert check_decisions(passes, prompt, result.tokens) == result.stats.rounds
            report = check_rows(passes, fresh)
            drafted += result.stats.drafted
            trees += result.stats.tree_rounds
            print(f"\n{mode} {'greedy' if not sampling['temperature'] else 'chain'} seed {seed}: "
                  f"{len(passes)} passes exact; {report}")
    assert drafted > 0
    assert (trees > 0) == (mode == "trees")


def test_recording_changes_nothing(tiny):
    """Same seed, recorder on and off: the same tokens (the proxy passes the sampler's own draws through)."""
    with audited_engine(tiny, "good_draft") as engine:
        on, _ = generate(engine, PROMPT, CHAIN, "draft", seed=5)
        engine.recorder = None
        off = engine.generate_tokens(PROMPT, GenerationConfig(max_tokens=32, mode="draft", draft_max=4, seed=5,
                                                              **CHAIN))
    assert on.tokens == off.tokens


def test_passes_spilled_to_a_directory_read_back_and_check_as_recorded(tiny, tmp_path):
    """Recorder(spill=DIR), how a server in another process is audited (Ray replicas, serve --verifier
    --audit-dir): the passes read back are the ones recorded, and the same checks pass or fail on them."""
    with audited_engine(tiny, "good_draft") as engine:
        kept, passes = generate(engine, PROMPT, CHAIN, "draft", seed=5)
        engine.recorder = Recorder(spill=tmp_path)
        spilled = engine.generate_tokens(PROMPT, GenerationConfig(max_tokens=32, mode="draft", draft_max=4, seed=5,
                                                                  **CHAIN))
    assert engine.recorder.passes == []  # nothing held in memory
    read = Recorder.read(tmp_path)
    assert spilled.tokens == kept.tokens and len(read) == len(passes)
    assert len({p.key for p in read}) == 1
    for a, b in zip(read, passes):
        assert a.decision == b.decision and a.uniforms == b.uniforms and np.array_equal(a.logits, b.logits)
    assert check_decisions(read, PROMPT, spilled.tokens) == len(read)
    with pytest.raises(ExactnessError):
        check_decisions(read, PROMPT, spilled.tokens[:-1] + [spilled.tokens[-1] + 1])


# --- negative controls: each check must fail on a known bug -----------------------------------------

def near_argmax(gap):
    """A wrong greedy rule: takes a draft token whose logit is within `gap` of the best."""
    def rule(draft, draft_probs, rows, rng=None):
        for i, token in enumerate(draft):
            if rows[i, token] < rows[i].max() - gap:
                return i, int(np.argmax(rows[i]))
        return len(draft), int(np.argmax(rows[len(draft)]))
    return rule


class Faulty:
    """A runtime with one fault; everything else is the real runtime's."""

    def __init__(self, runtime):
        self._rt = runtime

    def __getattr__(self, name):
        return getattr(self._rt, name)


class SkipsRollback(Faulty):
    """Keeps a rejected draft's KV cells: its bookkeeping rolls back, the cells stay (as when a
    sequence-removal call is skipped or names the wrong sequence), so later tokens attend to them."""

    def __init__(self, runtime):
        super().__init__(runtime)
        self._held: list[int] = []

    @property
    def n_past(self):
        return len(self._held)

    @property
    def tokens(self):
        return np.asarray(self._held, dtype=np.int32)

    def decode(self, tokens, n_logits):
        out = self._rt.decode(tokens, n_logits)
        self._held += [int(t) for t in tokens]
        return out

    def truncate(self, n):
        if n == 0:
            self._rt.truncate(0)
        del self._held[n:]


class RowsOffByOne(Faulty):
    """Returns each logits row one position early (row i is the prediction after one token fewer;
    the first row of a pass that asks for all its tokens' rows stays)."""

    def decode(self, tokens, n_logits):
        if n_logits < len(tokens):
            return self._rt.decode(tokens, n_logits + 1)[:-1]
        out = self._rt.decode(tokens, n_logits)
        return np.concatenate([out[:1], out[:-1]])


def test_negative_control_a_near_argmax_rule_fails_the_decision_check(tiny, fresh):
    """Drafts within half a logit of the argmax taken: output that an old near-tie tolerance (0.1) would pass."""
    caught = []
    with audited_engine(tiny, "good_draft", "draft") as engine:
        for prompt in PROMPTS:
            result, passes = generate(engine, prompt, GREEDY, "draft", verifier=near_argmax(0.5))
            check_rows(passes, fresh)  # the rows themselves are right: only the decision check can see this bug
            try:
                check_decisions(passes, prompt, result.tokens)
            except ExactnessError as exc:
                caught.append(str(exc))
    assert caught, "the wrong rule took no near-argmax draft: the control proves nothing"
    assert all("the rule on the recorded rows gives" in c for c in caught)
    print(f"\nnear-argmax rule: {len(caught)} of {len(PROMPTS)} generations caught, e.g. {caught[0]}")


def test_negative_control_a_kept_rejected_cell_fails_the_row_check(tiny, fresh):
    with audited_engine(tiny, "bad_draft", "draft", target=SkipsRollback(rt(tiny["target"]))) as engine:
        result, passes = generate(engine, PROMPT, GREEDY, "draft", max_tokens=12)
    assert result.stats.drafted > result.stats.accepted  # drafts were rejected, their cells kept
    check_decisions(passes, PROMPT, result.tokens)  # the bookkeeping is consistent: only the rows can tell
    with pytest.raises(ExactnessError, match="beyond the measured batch-shape spread") as caught:
        check_rows(passes, fresh)
    print(f"\nkept rejected cell: {caught.value}")


def test_negative_control_rows_off_by_one_fail_the_row_check(tiny, fresh):
    with audited_engine(tiny, "good_draft", "draft", target=RowsOffByOne(rt(tiny["target"]))) as engine:
        result, passes = generate(engine, PROMPT, GREEDY, "draft", max_tokens=16)
    check_decisions(passes, PROMPT, result.tokens)  # a faithful rule on wrong rows: this check cannot see it
    with pytest.raises(ExactnessError, match="beyond the measured batch-shape spread") as caught:
        check_rows(passes, fresh)
    print(f"\nrows off by one: {caught.value}")


# --- parallel slots: concurrent requests, one batched pass per step ---------------------------------

def run_slots(tiny, sampling, mode, prompts=PROMPTS, fault=None, max_tokens=24, streams=True):
    """Every prompt submitted at once to 4 slots; returns {prompt: (result, passes)} and the counters.
    `streams=False`: the slots share one unified KV pool instead of a stream each."""
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions
    from edgespec.serve.slots import ParallelEngine, SlotScheduler

    options = LlamaCppOptions(n_ctx=2048, n_threads=1)
    recorder = Recorder()
    with ParallelEngine(LlamaCppMultiSeqRuntime(tiny["target"], options, n_seq=4, streams=streams),
                        LlamaCppMultiSeqRuntime(tiny["good_draft"], options, n_seq=4, streams=streams),
                        slot_ctx=512) as engine:
        for e in engine.engines:
            e.recorder = recorder  # every slot's passes run in the scheduler's one worker thread
        if fault is not None:
            fault(engine.target)
        scheduler = SlotScheduler(engine, max_queue=len(prompts))
        config = dict(max_tokens=max_tokens, mode=mode, draft_max=4, **sampling)

        async def run_all():
            return await asyncio.gather(*[scheduler.generate(p, GenerationConfig(seed=i, **config))
                                          for i, p in enumerate(prompts)])

        try:
            results = asyncio.run(run_all())
        finally:
            scheduler.close()
        counters = dict(scheduler.counters)
    by_prompt = {tuple(passes[0].committed.tolist()): passes for passes in recorder.by_key().values()}
    return {tuple(p): (r, by_prompt[tuple(p)]) for p, r in zip(prompts, results)}, counters


@pytest.fixture(scope="module")
def fresh_pool(tiny):
    """Fresh evaluations computed as the shared pool computes (no flash attention)."""
    fresh, close = pooled_fresh(tiny["target"])
    yield fresh
    close()


@pytest.mark.parametrize("sampling", [GREEDY, pytest.param(CHAIN, marks=pytest.mark.slow)], ids=["greedy", "chain"])
@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_parallel_slots_emit_the_rules_tokens_on_their_own_rows(tiny, fresh_pool, mode, sampling):
    runs, counters = run_slots(tiny, sampling, mode)
    assert counters["batched_steps"] > 0 and counters["max_active"] == 4, counters
    for prompt, (result, passes) in runs.items():
        check_decisions(passes, prompt, result.tokens)
        assert len({p.seq for p in passes}) == 1  # one request, one slot
    report = check_rows([p for _, passes in runs.values() for p in passes], fresh_pool)
    print(f"\nslots {mode}: {len(runs)} concurrent requests, every pass exact; {report}")


def reads_another_slots_cells(target):
    """A fault in the shared pool: the first time two slots verify in one pass, the shorter one's cells
    are tagged with the longer one's sequence too (llama_memory_seq_cp), so the longer slot attends to them."""
    from edgespec.runtimes.llamacpp import ll

    real, done = target.decode_batch, []

    def decode_batch(work):
        verifying = sorted((target.seq_n_past(s), s) for s, _, n in work if n)
        if not done and len(verifying) >= 2:
            (_, src), (_, dst) = verifying[0], verifying[-1]
            ll.llama_memory_seq_cp(target._mem, src, dst, 0, -1)
            done.append((src, dst))
        return real(work)

    target.decode_batch = decode_batch
    return done


def test_negative_control_a_slot_reading_another_slots_cells_fails_the_row_check(tiny, fresh_pool):
    """On a unified pool (streams=False), where one slot's cells can be tagged with another's sequence;
    with a stream per slot llama.cpp keeps a sequence's attention inside its own stream."""
    faulted = []
    runs, _ = run_slots(tiny, GREEDY, "draft", prompts=PROMPTS[:4], streams=False,
                        fault=lambda target: faulted.append(reads_another_slots_cells(target)))
    (src, dst), = faulted[0]
    passes = []
    for prompt, (result, own) in runs.items():
        check_decisions(own, prompt, result.tokens)  # each slot's bookkeeping is consistent
        passes += own
    with pytest.raises(ExactnessError, match="beyond the measured batch-shape spread") as caught:
        check_rows(passes, fresh_pool)
    report = check_rows(passes, fresh_pool, raise_on_failure=False)
    assert {passes[i].seq for i, *_ in report.beyond} == {dst}  # the slot that read foreign cells, and only it
    print(f"\nslot {dst} reading slot {src}'s cells: {caught.value}")


@pytest.mark.slow
def test_concurrent_greedy_requests_under_parallel_4_part_from_solo_only_at_batched_near_ties(smollm2_path):
    """8 requests through 4 slots against their solo answers (bench/parallel_agreement.py publishes the
    same): every pass exact, and each answer that differs parts where its row was computed from its own
    cells (within the measured batch-shape spread), not from another slot's."""
    from edgespec.bench.parallel_agreement import agreement, summary
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Name a famous physicist.", "What is 12 times 12?", "Explain what a hash table is in one sentence.",
             "Write a bash command that lists all files ending in .py.", "Sort: pear, apple, fig, banana."]
    with Engine(LlamaCppRuntime(smollm2_path, LlamaCppOptions(n_ctx=512, n_threads=1))) as engine:
        prompts = [engine.prompt_tokens(t) for t in texts]
    out = agreement(smollm2_path, prompts, parallel=4, tokens=24)
    print("\n" + summary(out))
    assert out["rule_exact"] and out["batched_steps"] > 0
    assert all(r.get("why") != "wrong cells" for r in out["rows"]), summary(out)


# --- the cloud verifier: a real HTTP server on loopback, its core recording ----------------------------

@pytest.fixture(scope="module")
def audited_verifier(tiny):
    """`serve --verifier` in this process (uvicorn on 127.0.0.1 in a thread), so its recorder can be read."""
    import uvicorn

    from cloud_helpers import API_KEY, free_port
    from edgespec.cloud.verifier import VerifierConfig, create_app, load_core

    core = load_core(str(tiny["target"]), VerifierConfig(api_keys=(API_KEY,), max_sessions=4, max_context=512,
                                                         rate_per_s=1e5, rate_burst=1e5), n_threads=1)
    core.recorder = Recorder()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(core), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield core, f"http://127.0.0.1:{port}", API_KEY
    server.should_exit = True
    thread.join(timeout=10)
    core.stop()
    core.runtime.close()


@pytest.mark.parametrize("sampling", [GREEDY, CHAIN], ids=["greedy", "chain"])
@pytest.mark.parametrize("pipelined", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["sequential", "pipelined"])
def test_the_cloud_verifier_emits_the_rules_tokens_on_its_own_rows(tiny, fresh_pool, audited_verifier, sampling,
                                                                  pipelined):
    from edgespec.cloud.client import CloudEdgeClient, CloudOptions, Gate

    core, url, key = audited_verifier
    gate = Gate(token_threshold=0.0, product_threshold=0.0, max_block=4)
    passes = []
    with CloudEdgeClient(rt(tiny["good_draft"]), CloudOptions(url, api_key=key, tune=False, pipelined=pipelined,
                                                              gate=gate)) as client:
        for seed, prompt in enumerate(PROMPTS[:3]):
            core.recorder.passes.clear()
            result = client.generate_tokens(prompt, GenerationConfig(max_tokens=24, seed=seed, **sampling))
            assert result.stats.offline_tokens == 0
            own = list(core.recorder.passes)
            assert len({p.key for p in own}) == 1  # one session
            check_decisions(own, prompt, result.tokens)
            passes += own
    report = check_rows(passes, fresh_pool)
    print(f"\ncloud {'pipelined' if pipelined else 'sequential'}: every verified token exact; {report}")


def test_concurrent_cloud_sessions_stay_exact_on_their_own_rows(tiny, fresh_pool, audited_verifier):
    """Four clients at once: the verifier batches their sessions' passes into shared llama_decode calls."""
    from edgespec.cloud.client import CloudEdgeClient, CloudOptions, Gate

    core, url, key = audited_verifier
    core.recorder.passes.clear()
    shared_before = core.counters["multi_session_calls"]
    results = {}

    def run(i):
        options = CloudOptions(url, api_key=key, tune=False, pipelined=False,
                               gate=Gate(token_threshold=0.0, product_threshold=0.0, max_block=4))
        with CloudEdgeClient(rt(tiny["good_draft"]), options) as client:
            results[i] = client.generate_tokens(PROMPTS[i], GenerationConfig(max_tokens=24, seed=i, **GREEDY))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_prompt = {tuple(ps[0].committed.tolist()): ps for ps in core.recorder.by_key().values()}
    for i, result in results.items():
        assert result.stats.offline_tokens == 0
        check_decisions(by_prompt[tuple(PROMPTS[i])], PROMPTS[i], result.tokens)
    # Each session has its own KV stream (LlamaCppMultiSeqRuntime), so which sessions share a pass
    # (timing decides) changes only the pass's row count, and the fresh shapes vary that (pads, a
    # second sequence beside it); with one unified pool it also moved cells and this bound did not hold.
    shared = core.counters["multi_session_calls"] - shared_before
    report = check_rows(list(core.recorder.passes), fresh_pool)
    print(f"\ncloud, 4 concurrent sessions ({shared} shared calls): every verified token exact; {report}")


# --- ONNX Runtime ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_pair(hf_tiny, tmp_path_factory):
    """The tiny llama checkpoint and its perturbed draft as fp32 ONNX bundles (as tests/test_onnx_runtime.py does)."""
    pytest.importorskip("onnxruntime")
    from edgespec.exporters.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("onnx-exact")
    return {name: export_onnx(hf_tiny[name], root / name, ["fp32"]).directory for name in ("llama", "llama_draft")}


def onnx_rt(path):
    from edgespec.runtimes.onnxrt import OnnxOptions, OnnxRuntime

    return OnnxRuntime(path, OnnxOptions(n_ctx=512, n_threads=1))


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, CHAIN], ids=["greedy", "chain"])
@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_onnx_runtime_emits_the_rules_tokens_on_its_own_rows(onnx_pair, mode, sampling):
    reference = onnx_rt(onnx_pair["llama"])
    passes, drafted = [], 0
    with Engine(onnx_rt(onnx_pair["llama"]), onnx_rt(onnx_pair["llama_draft"])) as engine:
        engine.recorder = Recorder()
        prompt = engine.target.tokenize("the cat sat on the mat. the cat sat on", add_special=True,
                                        parse_special=False)
        for seed in range(2):
            engine.recorder.passes.clear()
            result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=24, mode=mode, draft_max=4, seed=seed,
                                                                     **sampling))
            check_decisions(engine.recorder.passes, prompt, result.tokens)
            passes += engine.recorder.passes
            drafted += result.stats.drafted
    report = check_rows(passes, Fresh(reference))
    reference.close()
    assert drafted > 0
    print(f"\nonnx {mode}: every pass exact; {report}")
