"""The cloud-edge protocol: strict decoding, compact probabilities, and a live verifier that answers
every malformed, oversized, unauthenticated or out-of-vocabulary message with a 4xx and keeps serving,
and serves the blocks of one session in revision order however they arrive (protocol 1.1)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_helpers import API_KEY, OTHER_KEY, VerifierProcess
from edgespec.cloud.protocol import (CONTENT_TYPE, CompactProbs, Limits, ProtocolError, SessionRequest,
                                     VerifyRequest, compact_row, decode_probs, pack, unpack)
from edgespec.sampling import SamplingParams

N_VOCAB = 300
LIMITS = Limits(n_vocab=N_VOCAB, max_context=512, max_draft=16, max_probs_k=8)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)


# --- offline: schemas and compact probabilities ---------------------------------------------------

def test_compact_row_is_the_distribution_it_claims():
    rng = np.random.default_rng(0)
    row = rng.random(N_VOCAB) ** 4
    row[rng.random(N_VOCAB) < 0.5] = 0
    row /= row.sum()
    ids, w, q = compact_row(row, 8)
    assert len(ids) == 8 and np.count_nonzero(w) <= 8
    dense = CompactProbs(ids[None], w[None]).dense(N_VOCAB)[0]
    assert np.array_equal(dense, q), "the receiver must rebuild exactly the q the sender samples from"
    assert abs(q.sum() - 1) < 1e-12
    top8 = np.argsort(-row)[:8]
    assert set(np.flatnonzero(q)) <= set(top8.tolist())


def test_compact_row_pads_short_rows_without_corrupting_token_zero():
    row = np.zeros(N_VOCAB)
    row[0], row[5] = 0.7, 0.3
    ids, w, q = compact_row(row, 6)
    assert np.count_nonzero(w) == 2
    dense = CompactProbs(ids[None], w[None]).dense(N_VOCAB)[0]
    assert dense[0] == pytest.approx(0.7, abs=1e-4) and dense[5] == pytest.approx(0.3, abs=1e-4)
    assert np.array_equal(dense, q)


def test_messages_round_trip():
    start = SessionRequest(np.array([1, 2, 3], dtype=np.int32), SAMPLED, 42, None)
    back = SessionRequest.from_wire(unpack(pack(start.to_wire()), LIMITS), LIMITS)
    assert back.tokens.tolist() == [1, 2, 3] and back.sampling == SAMPLED and back.seed == 42
    ids, w, _ = compact_row(np.array([0.5, 0.3, 0.2] + [0] * (N_VOCAB - 3)), 4)
    verify = VerifyRequest(3, 10, np.array([0], dtype=np.int32), CompactProbs(ids[None], w[None]))
    back = VerifyRequest.from_wire(unpack(pack(verify.to_wire()), LIMITS), LIMITS)
    assert back.draft.tolist() == [0] and np.array_equal(back.probs.weights, w[None])
    assert back.assume_last is None and not {"assume_from", "assume_last"} & set(verify.to_wire())  # still 1.0
    ahead = VerifyRequest(4, 12, np.array([5, 6], dtype=np.int32), None, assume_from=2, assume_last=9)
    back = VerifyRequest.from_wire(unpack(pack(ahead.to_wire()), LIMITS), LIMITS)
    assert (back.revision, back.n_past, back.assume_from, back.assume_last) == (4, 12, 2, 9)
    assert back.draft.tolist() == [5, 6]


def _verify_wire(**over) -> dict:
    msg = VerifyRequest(0, 5, np.array([7, 8], dtype=np.int32)).to_wire()
    msg.update(over)
    return msg


def _ahead_wire(**over) -> dict:
    msg = VerifyRequest(3, 9, np.array([7, 8], dtype=np.int32), None, assume_from=1, assume_last=4).to_wire()
    msg.update(over)
    return {k: v for k, v in msg.items() if v is not ...}


@pytest.mark.parametrize("message,status", [
    (_verify_wire(v=2), 400),                                              # another protocol version
    (_verify_wire(v=True), 400),                                           # a bool is not a version
    (_verify_wire(extra=1), 400),                                          # unknown field
    ({k: v for k, v in _verify_wire().items() if k != "draft"}, 400),      # missing field
    (_verify_wire(draft=np.array([N_VOCAB], "<i4").tobytes()), 422),       # token outside the vocabulary
    (_verify_wire(draft=np.array([-1], "<i4").tobytes()), 422),            # negative token
    (_verify_wire(draft=b"\x01\x02\x03"), 400),                            # not whole int32s
    (_verify_wire(draft=[1, 2]), 400),                                     # a list, not bytes
    (_verify_wire(draft=np.zeros(17, "<i4").tobytes()), 413),              # longer than max_draft
    (_verify_wire(revision=-1), 422),
    (_verify_wire(revision=1.5), 422),
    (_verify_wire(n_past=10**9), 422),
    (_ahead_wire(assume_last=N_VOCAB), 422),                               # assumed token outside the vocabulary
    (_ahead_wire(assume_last=-1), 422),
    (_ahead_wire(assume_last="7"), 422),                                   # not an integer
    (_ahead_wire(assume_last=True), 422),
    (_ahead_wire(assume_last=7.0), 422),
    (_ahead_wire(assume_last=None), 422),
    (_ahead_wire(assume_last=[7]), 422),
    (_ahead_wire(assume_from=3), 422),                                     # a chain starts before its blocks
    (_ahead_wire(assume_from=-1), 422),
    (_ahead_wire(assume_from=None), 422),
    (_ahead_wire(revision=0, assume_from=0), 422),
    (_ahead_wire(assume_from=...), 400),                                   # one without the other
    (_ahead_wire(assume_last=...), 400),
])
def test_verify_request_validation(message, status):
    with pytest.raises(ProtocolError) as err:
        VerifyRequest.from_wire(unpack(pack(message), LIMITS), LIMITS)
    assert err.value.status == status


def test_probs_validation():
    draft = np.array([3], dtype=np.int32)
    good = {"k": 2, "ids": np.array([3, 4], "<i4").tobytes(), "w": np.array([10, 5], "<u2").tobytes()}
    assert decode_probs(good, draft, LIMITS).ids.tolist() == [[3, 4]]
    bad = [
        {**good, "w": np.array([0, 5], "<u2").tobytes()},                  # the draft token has weight 0
        {**good, "ids": np.array([3, 3], "<i4").tobytes()},                # a token twice
        {**good, "ids": np.array([3, N_VOCAB], "<i4").tobytes()},          # outside the vocabulary
        {**good, "k": 3},                                                  # sizes do not match k
        {**good, "k": 99},                                                 # k above the limit
        {"k": 2, "ids": good["ids"]},                                      # missing weights
    ]
    for probs in bad:
        with pytest.raises(ProtocolError):
            decode_probs(probs, draft, LIMITS)


def test_unpack_refuses_what_is_not_a_small_msgpack_map():
    for data in [b"", b"\xc1", pack([1, 2]), pack(5), msgpack.packb(msgpack.ExtType(1, b"x")),
                 pack({"v": 1, "x": msgpack.ExtType(3, b"abc")}), b"\x81" + b"\xa1a" * 3]:
        with pytest.raises(ProtocolError) as err:
            unpack(data, LIMITS)
        assert 400 <= err.value.status < 500
    with pytest.raises(ProtocolError) as err:
        unpack(b"\x00" * (LIMITS.max_body_bytes + 1), LIMITS)
    assert err.value.status == 413


def test_sampling_params_are_checked():
    msg = SessionRequest(np.array([1], dtype=np.int32), SAMPLED, 1).to_wire()
    for field, value in [("top_p", 0.0), ("top_p", float("nan")), ("temperature", -1), ("top_k", "4"), ("min_p", 2)]:
        bad = {**msg, "sampling": {**msg["sampling"], field: value}}
        with pytest.raises(ProtocolError) as err:
            SessionRequest.from_wire(bad, LIMITS)
        assert err.value.status in (400, 422)


# --- a live verifier ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with VerifierProcess(tiny_pair["target"], log_dir=tmp_path_factory.mktemp("logs"), max_sessions=4) as proc:
        yield proc


def post(url: str, path: str, body, key: str | None = API_KEY, ctype: str = CONTENT_TYPE) -> httpx.Response:
    headers = {"Content-Type": ctype}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else pack(body)
    return httpx.post(url + path, content=data, headers=headers, timeout=10, trust_env=False)


def answer(response: httpx.Response) -> dict:
    return msgpack.unpackb(response.content, raw=False)


def start_session(url: str, tokens=(295, 104, 101), key: str = API_KEY, sampling=GREEDY) -> dict:
    r = post(url, "/v1/sessions", SessionRequest(np.array(tokens, dtype=np.int32), sampling, 7).to_wire(), key)
    assert r.status_code == 200, answer(r)
    return answer(r)


def test_session_and_verify(server):
    s = start_session(server.url)
    assert s["n_vocab"] == N_VOCAB and s["n_past"] == 3 and len(s["session_id"]) >= 32
    sid = s["session_id"]
    r = post(server.url, f"/v1/sessions/{sid}/verify", VerifyRequest(s["revision"], 3, np.array([108, 108], np.int32)).to_wire())
    assert r.status_code == 200
    a = answer(r)
    assert 0 <= a["n_accepted"] <= 2 and a["n_past"] == 3 + a["n_accepted"] + 1 and a["revision"] == s["revision"] + 1
    # the same request again is stale now
    again = post(server.url, f"/v1/sessions/{sid}/verify", VerifyRequest(s["revision"], 3, np.array([108], np.int32)).to_wire())
    assert again.status_code == 409 and answer(again)["error"] == "out_of_sync"


def test_authentication(server):
    body = SessionRequest(np.array([1, 2], dtype=np.int32), GREEDY, 1).to_wire()
    assert post(server.url, "/v1/sessions", body, key=None).status_code == 401
    assert post(server.url, "/v1/sessions", body, key="wrong-key-123456").status_code == 401
    r = httpx.post(server.url + "/v1/sessions", content=pack(body), trust_env=False,
                   headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Basic {API_KEY}"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/v1/stats", trust_env=False).status_code == 401


def test_a_session_belongs_to_the_key_that_made_it(server):
    sid = start_session(server.url, key=API_KEY)["session_id"]
    msg = VerifyRequest(0, 3, np.array([5], np.int32)).to_wire()
    r = post(server.url, f"/v1/sessions/{sid}/verify", msg, key=OTHER_KEY)
    assert r.status_code == 404  # indistinguishable from a session that does not exist
    r = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {OTHER_KEY}"}, trust_env=False)
    assert r.status_code == 404
    r = post(server.url, "/v1/sessions/" + "A" * 32 + "/verify", msg)
    assert r.status_code == 404


def test_bad_tokens_and_sizes(server):
    bad_start = SessionRequest(np.array([1, N_VOCAB + 5], dtype=np.int32), GREEDY, 1).to_wire()
    r = post(server.url, "/v1/sessions", bad_start)
    assert r.status_code == 422 and answer(r)["error"] == "bad_token"
    sid = start_session(server.url)["session_id"]
    r = post(server.url, f"/v1/sessions/{sid}/verify", _verify_wire(n_past=3, draft=np.array([10**6], "<i4").tobytes()))
    assert r.status_code == 422
    too_long = SessionRequest(np.ones(600, dtype=np.int32), GREEDY, 1).to_wire()  # session context is 512
    assert post(server.url, "/v1/sessions", too_long).status_code == 413
    assert post(server.url, "/v1/sessions", b"\x00" * (2 << 20)).status_code == 413
    assert post(server.url, "/v1/sessions", bad_start, ctype="application/json").status_code == 415


def test_sessions_are_bounded_with_lru_eviction(server):
    first = start_session(server.url)["session_id"]
    for _ in range(4):  # the server holds 4
        start_session(server.url)
    r = post(server.url, f"/v1/sessions/{first}/verify", VerifyRequest(0, 3, np.array([5], np.int32)).to_wire())
    assert r.status_code == 404
    stats = answer(httpx.get(server.url + "/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"}, trust_env=False))
    assert stats["sessions"] <= 4 and stats["evicted"] >= 1


# --- several blocks of one session in flight (protocol 1.1) -----------------------------------------

def verify_wire(revision: int, n_past: int, draft, assume: tuple[int, int] | None = None) -> dict:
    """`assume`: (assume_from, assume_last) for a block sent ahead."""
    from_, last = assume or (None, None)
    return VerifyRequest(revision, n_past, np.array(draft, np.int32), None, from_, last).to_wire()


def server_stats(url: str) -> dict:
    return answer(httpx.get(url + "/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"}, trust_env=False))


def greedy_tokens(url: str, n: int) -> list[int]:
    """The target's next n greedy tokens after start_session's prompt, one empty draft at a time."""
    s = start_session(url)
    revision, n_past, out = s["revision"], s["n_past"], []
    for _ in range(n):
        a = answer(post(url, f"/v1/sessions/{s['session_id']}/verify", verify_wire(revision, n_past, [])))
        revision, n_past = a["revision"], a["n_past"]
        out.append(a["token"])
    return out


class Later(threading.Thread):
    """A POST on its own connection, in the background: `.response` once the server has answered."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.request, self.response = (url, path, body), None
        self.start()

    def run(self) -> None:
        self.response = post(*self.request)


def test_a_block_sent_ahead_is_served_after_the_block_it_follows(server):
    g = greedy_tokens(server.url, 4)
    s = start_session(server.url)
    revision, n, path = s["revision"], s["n_past"], f"/v1/sessions/{s['session_id']}/verify"
    before = server_stats(server.url)
    # block i+1 arrives first: it assumes block i = [g0] all accepted with the bonus g1
    second = Later(server.url, path, verify_wire(revision + 1, n + 2, [g[2]], assume=(revision, g[1])))
    time.sleep(0.5)
    assert second.response is None, "a block sent ahead must wait for the block it follows"
    first = post(server.url, path, verify_wire(revision, n, [g[0]]))
    second.join(10)
    a, b = answer(first), answer(second.response)
    assert first.status_code == 200 and (a["n_accepted"], a["token"], a["revision"], a["n_past"]) == \
        (1, g[1], revision + 1, n + 2), a
    assert second.response.status_code == 200, b
    assert (b["n_accepted"], b["token"], b["revision"], b["n_past"]) == (1, g[3], revision + 2, n + 4)
    after = server_stats(server.url)
    assert after["waited"] == before["waited"] + 1 and after["passes"] == before["passes"] + 2


def test_a_block_whose_assumption_failed_is_answered_stale_without_a_pass(server):
    g = greedy_tokens(server.url, 2)
    wrong = (g[1] + 1) % N_VOCAB
    s = start_session(server.url)
    revision, n, path = s["revision"], s["n_past"], f"/v1/sessions/{s['session_id']}/verify"
    before = server_stats(server.url)
    # chain `revision`: block i = [g0], then a block assuming the bonus `wrong` after it, sent first
    ahead = Later(server.url, path, verify_wire(revision + 1, n + 2, [5], assume=(revision, wrong)))
    time.sleep(0.5)
    first = post(server.url, path, verify_wire(revision, n, [g[0]]))
    a = answer(first)
    assert first.status_code == 200 and (a["n_accepted"], a["token"]) == (1, g[1])
    ahead.join(10)
    assert ahead.response.status_code == 409 and answer(ahead.response)["error"] == "stale"
    further = Later(server.url, path, verify_wire(revision + 2, n + 4, [5], assume=(revision, 7)))  # waits
    late = post(server.url, path, verify_wire(revision + 1, n + 2, [5], assume=(revision, wrong)))
    assert late.status_code == 409 and answer(late)["error"] == "stale"  # arriving after: at once
    # the client's next chain starts from block i's answer and reuses the dead chain's revisions
    root = post(server.url, path, verify_wire(a["revision"], a["n_past"], []))
    b = answer(root)
    assert root.status_code == 200 and b["revision"] == revision + 2
    further.join(10)
    assert further.response.status_code == 409 and answer(further.response)["error"] == "stale"
    # the state's revision, length and last token as the dead chain could have assumed them: still stale
    ghost = post(server.url, path, verify_wire(b["revision"], b["n_past"], [5], assume=(revision, b["token"])))
    assert ghost.status_code == 409 and answer(ghost)["error"] == "stale"
    after = server_stats(server.url)
    assert after["passes"] == before["passes"] + 2, "a stale block cost a forward pass"
    assert after["stale"] == before["stale"] + 4
    # a block of the live chain, assuming exactly the state there is, is served at once
    nxt = post(server.url, path, verify_wire(b["revision"], b["n_past"], [5], assume=(a["revision"], b["token"])))
    assert nxt.status_code == 200, answer(nxt)


def test_a_rebuild_ends_every_chain_of_the_session(server):
    s = start_session(server.url)
    path = f"/v1/sessions/{s['session_id']}/verify"
    t0 = time.monotonic()
    waiting = Later(server.url, path, verify_wire(1, 5, [5], assume=(0, 7)))  # behind a block that never comes
    time.sleep(0.3)
    rebuilt = post(server.url, "/v1/sessions", SessionRequest(np.array([295, 104, 101], dtype=np.int32), GREEDY, 7,
                                                              resume=s["session_id"]).to_wire())
    assert rebuilt.status_code == 200 and answer(rebuilt)["revision"] == 1
    waiting.join(5)
    assert waiting.response.status_code == 409 and answer(waiting.response)["error"] == "stale"
    assert time.monotonic() - t0 < 1.5, "answered by the rebuild, not by the order timeout"
    # the rebuilt state (revision 1, the 3 tokens, last 101) was made by no chain of blocks
    r = post(server.url, path, verify_wire(1, 3, [5], assume=(0, 101)))
    assert r.status_code == 409 and answer(r)["error"] == "stale"


def test_blocks_waiting_for_an_earlier_one_are_bounded_and_time_out(server):
    s = start_session(server.url)
    revision, n, path = s["revision"], s["n_past"], f"/v1/sessions/{s['session_id']}/verify"
    t0 = time.monotonic()
    # nine blocks ahead of a block that never comes: eight may wait (the server's bound), for 2 s
    waiters = [Later(server.url, path, verify_wire(revision + 1 + j, n + 2 * (j + 1), [5], assume=(revision, 5)))
               for j in range(9)]
    for w in waiters:
        w.join(15)
    codes = sorted(w.response.status_code for w in waiters)
    assert codes == [409] * 8 + [429], codes
    assert all(answer(w.response)["error"] == "stale" for w in waiters if w.response.status_code == 409)
    assert time.monotonic() - t0 >= 1.9
    assert post(server.url, path, verify_wire(revision, n, [])).status_code == 200  # the session is fine


# Arbitrary msgpack-able values, and maps that look like protocol messages with wrong contents.
values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64)
                      | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=64),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)
token_bytes = st.lists(st.integers(-5, N_VOCAB + 5), max_size=8).map(lambda t: np.array(t, "<i4").tobytes())
look_alike = st.fixed_dictionaries({"v": st.sampled_from([1, 1, 1, 0, 2, "1"]), "revision": st.integers(-2, 3),
                                    "n_past": st.integers(-2, 6), "draft": token_bytes | st.binary(max_size=9)},
                                   optional={"probs": values | st.fixed_dictionaries(
                                       {"k": st.integers(0, 3), "ids": token_bytes, "w": st.binary(max_size=12)}),
                                       "assume_from": st.integers(-2, 4) | values,
                                       "assume_last": st.integers(-3, N_VOCAB + 3) | values, "junk": values})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                         look_alike.map(lambda v: msgpack.packb(v, use_bin_type=True))),
       path=st.sampled_from(["/v1/sessions", "/v1/sessions/SID/verify", "/v1/sessions/nope/verify"]))
def test_fuzz_the_server_answers_4xx_and_stays_up(server, fuzz_session, payload, path):
    # (a valid request naming a later revision waits up to the server's order timeout, 2 s, then 409)
    r = post(server.url, path.replace("SID", fuzz_session), payload)
    if r.status_code == 200:  # a random message can be valid (a stale-free verify, a tiny session)
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.content[:200])
    assert "error" in answer(r)


@pytest.fixture(scope="module")
def fuzz_session(server):
    return start_session(server.url, tokens=(1, 2, 3, 4, 5))["session_id"]


def test_the_server_survived_the_fuzzing(server):
    assert server.alive()
    start_session(server.url)


def test_rate_limit(tiny_pair, tmp_path_factory):
    with VerifierProcess(tiny_pair["target"], extra=("--rate", "5"), max_sessions=2,
                         log_dir=tmp_path_factory.mktemp("logs")) as proc:
        codes = [httpx.get(proc.url + "/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"},
                           trust_env=False).status_code for _ in range(30)]
        assert 429 in codes and codes[0] == 200
        other = httpx.get(proc.url + "/v1/stats", headers={"Authorization": f"Bearer {OTHER_KEY}"}, trust_env=False)
        assert other.status_code == 200  # limits are per client


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(tiny_pair, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with VerifierProcess(tiny_pair["target"], certfile=str(cert), keyfile=str(key), max_sessions=2,
                         log_dir=tmp_path) as proc:
        assert proc.url.startswith("https://")
        body = pack(SessionRequest(np.array([1, 2], dtype=np.int32), GREEDY, 1).to_wire())
        headers = {"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {API_KEY}"}
        r = httpx.post(proc.url + "/v1/sessions", content=body, headers=headers, trust_env=False,
                       verify=ssl.create_default_context(cafile=str(cert)))
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # an untrusted certificate is refused by default
            httpx.post(proc.url + "/v1/sessions", content=body, headers=headers, trust_env=False)
        with pytest.raises(httpx.HTTPError):  # and plain HTTP does not reach it
            httpx.post(proc.url.replace("https", "http") + "/v1/sessions", content=body, headers=headers,
                       trust_env=False)


# --- the runtime underneath: several sequences in one context -----------------------------------------

def test_multi_sequence_runtime_matches_one_sequence_at_a_time(tiny_pair):
    from conftest import load_runtime
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    multi = LlamaCppMultiSeqRuntime(tiny_pair["target"], LlamaCppOptions(n_ctx=512, n_threads=1), n_seq=3)
    single = load_runtime(tiny_pair["target"], n_ctx=256, n_threads=1, flash_attn=False)  # as the verifier runs
    try:
        a, b = [295, 104, 101, 108, 108, 111], [295, 116, 104, 101]
        out = multi.decode_batch([(0, a, 2), (2, b, 1)])
        assert multi.passes_by_seq == {0: 1, 2: 1} and multi.cells_used == len(a) + len(b)
        ref_a = single.decode(a, 2)
        single.truncate(0)
        ref_b = single.decode(b, 1)
        single.truncate(0)
        assert np.allclose(out[0], ref_a, atol=1e-4) and np.allclose(out[1], ref_b, atol=1e-4)
        # roll one sequence back and extend it: the other is untouched
        multi.seq_truncate(0, 3)
        again = multi.decode_batch([(0, [32, 104], 2)])[0]
        assert np.allclose(again, single.decode(a[:3] + [32, 104], 2), atol=1e-4)
        assert multi.seq_tokens(2).tolist() == b and multi.seq_n_past(0) == 5
        with pytest.raises(ValueError):
            multi.decode_batch([(0, [1], 1), (0, [2], 1)])  # a sequence twice in one batch
        with pytest.raises(TypeError):
            multi.decode([1], 1)  # the one-sequence API does not apply
    finally:
        multi.close()
        single.close()
