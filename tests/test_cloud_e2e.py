"""Cloud-edge speculation end to end, against a real verifier process on 127.0.0.1.

Greedy output through the network equals plain decoding of the target (up to near-ties), with
one block at a time or several in flight; sampled output follows the target's exact joint
distribution (chi-square, with a wrong client the same test must catch); blocks sent ahead whose
assumption failed cost the server no forward pass; the client falls back to its local model when
the server dies or stalls and resumes when it returns; eight concurrent clients each get what they
get alone; the CLI works and fails cleanly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cloud_helpers import API_KEY, VerifierProcess, free_port
from conftest import load_runtime
from edgespec.cloud.client import CloudEdgeClient, CloudOptions, Gate
from edgespec.cloud.protocol import compact_row
from edgespec.cloud.proxy import LinkProxy
from edgespec.engine import Engine, GenerationConfig
from lossless import compare_greedy
from test_lossless_greedy import PROMPTS
from test_lossless_sampling import chi_square_pvalue

TINY_PROMPT = [295, 104, 101, 108, 108, 111, 32, 104, 101, 108, 108, 111]  # BOS "hello hello"
GREEDY = dict(temperature=0.0, mode="ar")


def client_for(draft_path, url, **options):
    defaults = dict(api_key=API_KEY, tune=False)
    return CloudEdgeClient(load_runtime(draft_path, n_threads=1), CloudOptions(url, **{**defaults, **options}))


# --- greedy: SmolLM2 target on the server, its Q4_0 copy drafting on the device ---------------------

MAX_TOKENS = 40
# SmolLM2 Q4_1 on this llama.cpp build: the target's own one-token and batched evaluations of the same
# context differ by up to 0.15 logit at a near-tie on an AVX-512 machine (PROMPTS[1], position 7, without
# flash attention; 0.54 with it), above lossless.NEAR_TIE_GAP; on an AVX2-only machine the network's
# divergences came at gaps up to 0.29. A wrong token is several logits away.
CPU_NEAR_TIE_GAP = 0.5
# PROMPTS 1 and 2 have near-ties of 0.03 to 0.15 logit there, where the network's output may take
# either token: they stay in (the gap check decides each divergence).
CLEAN_PROMPTS = PROMPTS[:8]


@pytest.fixture(scope="module")
def smol_server(smollm2_path, tmp_path_factory):
    with VerifierProcess(smollm2_path, max_sessions=10, session_ctx=512,
                         log_dir=tmp_path_factory.mktemp("smol-logs")) as proc:
        yield proc


@pytest.fixture(scope="module")
def smol_target(smollm2_path):
    engine = Engine(load_runtime(smollm2_path, n_threads=1, flash_attn=False))  # computes as the verifier does
    yield engine
    engine.close()


def plain(engine, ids, n):
    return engine.generate_tokens(ids, GenerationConfig(max_tokens=n, **GREEDY)).tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipelined", "pipelined-1", "sequential"])
def test_greedy_through_the_network_is_the_targets_output(smol_server, smol_target, smollm2_draft, mode):
    """Several blocks in flight (over a 30 ms link, so that they are), one in flight, sequential."""
    prompts = {"pipelined": CLEAN_PROMPTS, "pipelined-1": CLEAN_PROMPTS[3:6], "sequential": CLEAN_PROMPTS[6:]}[mode]
    options = dict(pipelined=mode != "sequential", max_inflight=3 if mode == "pipelined" else 1,
                   tune=mode == "pipelined")
    with LinkProxy("127.0.0.1", smol_server.port, rtt_ms=30 if mode == "pipelined" else 0) as link, \
            client_for(smollm2_draft, f"http://127.0.0.1:{link.port}", **options) as client:
        identical, stale = 0, 0
        for prompt in prompts:
            ids = smol_target.prompt_tokens(prompt)
            expected = plain(smol_target, ids, MAX_TOKENS)
            result = client.generate_tokens(ids, GenerationConfig(max_tokens=MAX_TOKENS, **GREEDY))
            s = result.stats
            c = compare_greedy(smol_target.target, ids, expected, result.tokens)
            assert c.identical or abs(c.gap) <= CPU_NEAR_TIE_GAP, \
                f"{prompt!r}: diverged at {c.first_divergence} with logit gap {c.gap}"
            identical += c.identical
            if not c.identical:
                print(f"\n{prompt!r}: near-tie at {c.first_divergence}, gap {c.gap:.3f}")
            assert s.offline_tokens == 0 and s.rounds > 0 and s.generated == len(result.tokens)
            # the server spent one pass per verification plus one for the prompt (short prompts: one
            # chunk), and none on the blocks sent ahead that turned out stale
            assert s.verifier_passes == s.rounds + 1, s.to_dict()
            assert s.bytes_sent > 0 and s.bytes_received > 0
            stale += s.stale_blocks
        print(f"\n{mode}: {identical}/{len(prompts)} identical, {stale} stale blocks; last stats {s.to_dict()}")
        # Divergences are allowed only at near-ties (checked above, the losslessness test); block lengths
        # follow measured timings, so which near-tie flips varies from run to run, and how often depends
        # on the CPU's kernels: on an AVX-512 machine at most a quarter of these prompts diverged, on an
        # AVX2-only one (2 cores, AMD EPYC) 5/8, 0/3 and 2/2 stayed identical, every divergence at a gap
        # of 0.29 or less. So the count is only a floor, and only where there are enough prompts for one.
        if len(prompts) >= 8:
            assert identical >= 2, "almost nothing came through identical: more than near-ties flipped"
        if mode == "pipelined":
            assert stale > 0, "no block was sent ahead and found stale: the multi-block path was not exercised"
        else:
            assert stale == 0


# --- sampling: the exact joint distribution of the first tokens, tiny models -----------------------

N_TOKENS = 4
N_SAMPLES = 2000
ALPHA = 0.001
SAMPLING = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)


from test_lossless_sampling import exact_joint  # noqa: E402  (same SAMPLING settings)


@pytest.fixture(scope="module")
def tiny_models(tiny_pair, tmp_path_factory):
    from tiny_models import write_tiny_llama

    medium = write_tiny_llama(tmp_path_factory.mktemp("medium") / "draft-medium.gguf", seed=7, perturb_from=0,
                              perturb_scale=0.3)
    return {**tiny_pair, "medium_draft": medium}


@pytest.fixture(scope="module")
def tiny_server(tiny_models, tmp_path_factory):
    with VerifierProcess(tiny_models["target"], max_sessions=10, extra=("--rate", "100000"),
                         log_dir=tmp_path_factory.mktemp("tiny-logs")) as proc:
        yield proc


@pytest.fixture(scope="module")
def joint4(tiny_models):
    rt = load_runtime(tiny_models["target"], n_ctx=256)
    j = exact_joint(rt, TINY_PROMPT, N_TOKENS)
    rt.close()
    assert abs(sum(j.values()) - 1) < 1e-9 and len(j) == 4 ** N_TOKENS
    return j


class FlattenedClient(CloudEdgeClient):
    """A wrong client: drafts from its distribution q but sends sqrt(q) renormalised (a plausible
    bug, like sending probabilities before temperature). The verifier then judges drafts by the wrong q."""

    def _compact(self, row):
        ids, weights, q = compact_row(row, self.options.probs_k)
        flat = np.sqrt(q)
        wrong_ids, wrong_weights, _ = compact_row(flat / flat.sum(), self.options.probs_k)
        assert set(np.flatnonzero(q)) <= set(wrong_ids[wrong_weights > 0].tolist())  # every draft stays valid
        return wrong_ids, wrong_weights, q


def sample_cloud(client, n_samples=N_SAMPLES):
    out, promoted, stale = [], 0, 0
    for seed in range(n_samples):
        r = client.generate_tokens(TINY_PROMPT, GenerationConfig(max_tokens=N_TOKENS, seed=seed, **SAMPLING))
        s = r.stats
        assert len(r.tokens) == N_TOKENS and s.offline_tokens == 0
        assert s.verifier_passes == s.rounds + 1, s.to_dict()  # stale blocks cost no pass
        out.append(tuple(r.tokens))
        promoted += s.promoted
        stale += s.stale_blocks
    return out, promoted, stale


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind,max_inflight,probs_k,max_block", [
    ("good_draft", 3, 3, 1),     # one-token blocks, three in flight (promotions, stale blocks); top-4 rows cut to 3
    ("medium_draft", 0, 4, 2),   # sequential, whole top-4 rows, residual draws
])
def test_sampling_through_the_network_matches_the_target(tiny_models, tiny_server, joint4, draft_kind, max_inflight,
                                                         probs_k, max_block):
    gate = Gate(token_threshold=0.0, product_threshold=0.0, max_block=max_block)
    with client_for(tiny_models[draft_kind], tiny_server.url, pipelined=max_inflight > 0,
                    max_inflight=max(1, max_inflight), probs_k=probs_k, gate=gate) as c:
        samples, promoted, stale = sample_cloud(c)
    assert set(samples) <= set(joint4)
    p = chi_square_pvalue(samples, joint4)
    print(f"\n{draft_kind} in flight={max_inflight} k={probs_k}: chi-square p = {p:.4f}, promoted {promoted}, "
          f"stale blocks {stale}")
    assert p > ALPHA
    if max_inflight:
        assert promoted > 0, "the pipelined path (drafting ahead, then promoting) was not exercised"
        assert stale > 0, "no block sent ahead was found stale: the multi-block path was not exercised"


@pytest.mark.slow
def test_the_test_rejects_a_client_that_sends_other_probabilities(tiny_models, tiny_server, joint4):
    gate = Gate(token_threshold=0.0, product_threshold=0.0, max_block=2)
    client = FlattenedClient(load_runtime(tiny_models["medium_draft"], n_threads=1),
                             CloudOptions(tiny_server.url, api_key=API_KEY, tune=False, pipelined=False, probs_k=4,
                                          gate=gate))
    with client:
        samples, _, _ = sample_cloud(client)
    p = chi_square_pvalue(samples, joint4)
    print(f"\nwrong client: p = {p:.2e}")
    assert p < ALPHA


# --- the server dies or stalls mid-generation ---------------------------------------------------------

def check_verified_tail(target_path, tokens, spans, prompt):
    """Tokens after the last offline span are the target's greedy continuation of everything before."""
    start = spans[-1][1] if spans else 0
    engine = Engine(load_runtime(target_path, n_ctx=512, n_threads=1))
    try:
        context = list(prompt) + tokens[:start]
        expected = plain(engine, context, len(tokens) - start)
        c = compare_greedy(engine.target, context, expected, tokens[start:])
        assert c.near_tie, f"verified tail diverged at {c.first_divergence} (gap {c.gap})"
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["kill", "stall"])
def test_the_client_falls_back_and_resumes(tiny_models, tmp_path, failure):
    proc = VerifierProcess(tiny_models["target"], port=free_port(), max_sessions=4, log_dir=tmp_path).start()
    messages = []
    try:
        client = client_for(tiny_models["good_draft"], proc.url, reconnect_s=0.05, deadline_s=0.5,
                            gate=Gate(0.0, 0.0, 4))
        client.notify = messages.append
        with client:
            seen, phase, rounds_at_return = [], 0, None
            for state, new in client.rounds(TINY_PROMPT, GenerationConfig(max_tokens=220, **GREEDY)):
                seen += new.tolist()
                s = state.stats
                if phase == 0 and s.rounds >= 3:
                    proc.kill() if failure == "kill" else proc.pause()
                    phase = 1
                elif phase == 1 and s.offline_tokens >= 5:
                    proc.start() if failure == "kill" else proc.resume()
                    time.sleep(1.0)  # the generator is paused: let a probe that hung on the stall complete
                    rounds_at_return, phase = s.rounds, 2
            state = client.last_state
        s = state.stats
        tokens = state.committed[state.n_prompt:].tolist()
        assert seen == tokens, "tokens already shown were rewritten"
        assert phase == 2 and s.offline_tokens >= 5 and s.offline_spans
        assert s.rebuilds >= 1 and s.rounds > rounds_at_return, "verification did not resume"
        assert sum(b - a for a, b in s.offline_spans) == s.offline_tokens
        assert any("local model" in m for m in messages) and any("back" in m for m in messages)
        print(f"\n{failure}: offline spans {s.offline_spans}, rounds {s.rounds}, rebuilds {s.rebuilds}; {messages}")
        check_verified_tail(tiny_models["target"], tokens, s.offline_spans, TINY_PROMPT)
        # before the failure the output was verified too: it is a prefix of the target's own output
        first = s.offline_spans[0][0]
        check_verified_tail(tiny_models["target"], tokens[:first], [], TINY_PROMPT)
    finally:
        proc.kill()


# --- many clients at once -------------------------------------------------------------------------------

BATCHED_NEAR_TIE_GAP = 0.3


@pytest.mark.slow
def test_eight_concurrent_clients_get_what_they_get_alone(smol_server, smol_target, smollm2_draft):
    n_clients, n_tokens = 8, 16
    prompts = PROMPTS[8:8 + n_clients]
    ids = [smol_target.prompt_tokens(p) for p in prompts]
    # a generous deadline: on a loaded 2-core machine this is about correctness, not speed
    clients = [client_for(smollm2_draft, smol_server.url, gate=Gate(0.2, 0.1, 6), deadline_s=120.0)
               for _ in range(n_clients)]
    try:
        cfg = GenerationConfig(max_tokens=n_tokens, **GREEDY)
        alone = [c.generate_tokens(i, cfg).tokens for c, i in zip(clients, ids)]
        together: list = [None] * n_clients
        barrier = threading.Barrier(n_clients)

        def run(j):
            barrier.wait()
            together[j] = clients[j].generate_tokens(ids[j], cfg)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        identical, gaps = 0, []
        for j in range(n_clients):
            assert together[j] is not None and together[j].stats.offline_tokens == 0
            c = compare_greedy(smol_target.target, ids[j], alone[j], together[j].tokens)
            # Alone and together, the blocks differ (their lengths follow measured timings) and so do
            # the verify batches and KV cell layouts: a wider near-tie than one session's batch sizes.
            assert c.identical or abs(c.gap) <= BATCHED_NEAR_TIE_GAP, \
                f"client {j} diverged at {c.first_divergence} (gap {c.gap})"
            identical += c.identical
            gaps.append(c.gap)
        stats = clients[0].http.call("GET", "/v1/stats")[0]
        print(f"\n{identical}/{n_clients} identical, gaps at divergences {[g for g in gaps if g is not None]}; "
              f"server: {stats}")
        assert identical >= n_clients // 2
    finally:
        for c in clients:
            c.close()


# --- the command line -------------------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_generate_with_a_verifier(tiny_models, tiny_server):
    common = ["hello hello", "--raw", "--temperature", "0", "-n", "12", "--draft", str(tiny_models["good_draft"]),
              "--ctx", "256", "--threads", "1"]
    r = cli(*common, "--verifier", tiny_server.url, "--api-key", API_KEY, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("verifier_passes", "bytes_sent", "bytes_received", "offline_tokens", "tokens_per_s", "rounds"):
        assert key in out["stats"]
    assert out["stats"]["offline_tokens"] == 0 and out["stats"]["verifier_passes"] >= 1
    assert len(out["tokens"]) == 12 or out["finish_reason"] == "stop"

    wrong = cli(*common, "--verifier", tiny_server.url, "--api-key", "not-the-key-000")
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0 and "API key" in wrong.stderr
    assert "Traceback" not in wrong.stderr

    missing = cli(*common, "--verifier", tiny_server.url)
    assert missing.returncode == 2 and "API key" in missing.stderr

    down = cli(*common, "--verifier", f"http://127.0.0.1:{free_port()}", "--api-key", API_KEY, "--json")
    assert down.returncode == 0, down.stderr
    stats = json.loads(down.stdout)["stats"]
    assert stats["offline_tokens"] == stats["generated"] > 0 and stats["rounds"] == 0
    assert "unreachable" in down.stderr

    bad_url = cli(*common, "--verifier", "ftp://example", "--api-key", API_KEY)
    assert bad_url.returncode == 2 and "URL" in bad_url.stderr

    # a constraint travels to the verifier, which masks its rows by it (tests/test_structured.py checks exactness)
    regex = cli(*common[:4], "-n", "24", *common[6:], "--verifier", tiny_server.url, "--api-key", API_KEY, "--json",
                "--regex", "(hel+o )+[a-z]{1,6}\\.")
    assert regex.returncode == 0, regex.stderr
    out = json.loads(regex.stdout)
    assert out["stats"]["offline_tokens"] == 0 and re.fullmatch(r"(hel+o )+[a-z]{0,6}\.?", out["text"]), out["text"]
    unsatisfiable = cli(*common, "--verifier", tiny_server.url, "--api-key", API_KEY, "--regex", r"[^\s\S]")
    assert unsatisfiable.returncode == 2 and unsatisfiable.stderr.strip().count("\n") == 0
    assert "admits no output" in unsatisfiable.stderr
