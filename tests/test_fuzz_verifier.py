"""The cloud verifier fuzzed at the message level (hypothesis, a fixed seed, a bounded budget): valid
exchanges broken on purpose, truncated, oversized, wrong-typed, replayed and out of order. Every answer
comes at once (a block waiting for an earlier one: within the order timeout), none is a 5xx, every
refusal is a protocol error map (`error`, `message`), and the server keeps serving."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from cloud_helpers import API_KEY, OTHER_KEY, VerifierProcess
from edgespec.cloud.protocol import CONTENT_TYPE, Limits, ProtocolError, SessionRequest, VerifyRequest, pack, unpack
from edgespec.sampling import SamplingParams

N_VOCAB = 300          # the tiny target's vocabulary (tests/tiny_models.py)
MAX_BODY = 1 << 20     # the verifier's default message limit
FUZZ_SEED = 25
FUZZ_EXAMPLES = 40     # exchanges of up to 6 messages each (about 30 s here)
ANSWER_WITHIN_S = 8.0  # the order timeout (2 s) for a block sent ahead, and room for a slow machine
STATUSES: Counter = Counter()  # what the fuzzing got, reported at the end
BREAKS: Counter = Counter()    # how messages were broken


@pytest.fixture(scope="module")
def verifier(tiny_pair, tmp_path_factory):
    with VerifierProcess(tiny_pair["target"], log_dir=tmp_path_factory.mktemp("logs"), max_sessions=4,
                         extra=("--rate", "10000")) as proc:
        yield proc


def send(url: str, path: str, data: bytes, key: str = API_KEY, method: str = "POST") -> httpx.Response:
    started = time.monotonic()
    r = httpx.request(method, url + path, content=data if method == "POST" else None, timeout=ANSWER_WITHIN_S + 5,
                      headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {key}"}, trust_env=False)
    assert time.monotonic() - started < ANSWER_WITHIN_S, f"{path} took {time.monotonic() - started:.1f} s"
    assert r.status_code < 500, (r.status_code, r.content[:200])
    STATUSES[r.status_code] += 1
    if r.status_code != 200:
        reason = msgpack.unpackb(r.content, raw=False)
        assert isinstance(reason.get("error"), str) and isinstance(reason.get("message"), str) and reason["message"]
    return r


def start(url: str, tokens=(1, 2, 3, 4, 5), sampling=SamplingParams(temperature=0.0)) -> dict:
    r = send(url, "/v1/sessions", pack(SessionRequest(np.array(tokens, np.int32), sampling, 7).to_wire()))
    assert r.status_code == 200
    return msgpack.unpackb(r.content, raw=False)


# --- how a valid message is broken ---------------------------------------------------------------------

WRONG_TYPES = st.sampled_from([None, True, -1, 2**64 - 1, 1.5, float("nan"), "x", b"\x00\x01\x02", [], {}, [1, 2]])


BREAKS_ALL = ("truncated", "oversized", "wrong_type", "missing", "extra", "huge_field")


@st.composite
def broken(draw, message: dict, how: str | None = None) -> bytes:
    """`message` (a valid map) made invalid in one of the ways a network or a bad client breaks it."""
    how = how or draw(st.sampled_from(BREAKS_ALL))
    BREAKS[how] += 1
    if how == "truncated":
        data = pack(message)
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "oversized":  # past the body limit, whatever it holds
        return pack(message) + b"\x00" * (MAX_BODY + 1 - len(pack(message)) + draw(st.integers(0, 64)))
    key = draw(st.sampled_from(sorted(message)))
    if how == "wrong_type":
        return pack({**message, key: draw(WRONG_TYPES)})
    if how == "missing":
        return pack({k: v for k, v in message.items() if k != key})
    if how == "extra":
        return pack({**message, draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in message)): 1})
    # huge_field: a field far larger than the protocol allows, under the body limit
    return pack({**message, key: draw(st.sampled_from([b"\x01\x00\x00\x00" * 100_000, "y" * 5000, list(range(100))]))})


@pytest.mark.parametrize("how", BREAKS_ALL)
@pytest.mark.parametrize("what", ["start", "verify"])
@seed(FUZZ_SEED)
@settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_way_of_breaking_a_message_is_refused_with_a_reason(verifier, what, how, data):
    if what == "start":
        path, message = "/v1/sessions", SessionRequest(np.array([1, 2, 3], np.int32),
                                                       SamplingParams(temperature=0.0), 7).to_wire()
    else:
        s = start(verifier.url)
        path = f"/v1/sessions/{s['session_id']}/verify"
        message = VerifyRequest(s["revision"], s["n_past"], np.array([1, 2], np.int32)).to_wire()
    body = data.draw(broken(message, how))
    r = send(verifier.url, path, body)
    if r.status_code == 200:  # still a valid message (nil for an optional field, an optional field left out)
        assert how in ("wrong_type", "missing") and _valid(what, body), body[:100]
    else:
        assert r.status_code in (400, 404, 409, 413, 415, 422), r.status_code
    if how == "oversized":
        assert r.status_code == 413


def _valid(what: str, body: bytes) -> bool:
    limits = Limits(n_vocab=N_VOCAB, max_context=512)
    try:
        (SessionRequest if what == "start" else VerifyRequest).from_wire(unpack(body, limits), limits)
    except ProtocolError:
        return False
    return True


STEPS = st.lists(st.sampled_from(["valid", "broken", "replay", "ahead", "behind", "other_key", "closed", "junk"]),
                 min_size=1, max_size=6)


@seed(FUZZ_SEED)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(steps=STEPS, data=st.data())
def test_fuzzed_exchanges_get_no_5xx_no_hang_and_a_reason_on_refusal(verifier, steps, data):
    url = verifier.url
    s = start(url)
    sid, revision, n_past = s["session_id"], s["revision"], s["n_past"]
    path = f"/v1/sessions/{sid}/verify"
    sent: list[bytes] = []
    for step in steps:
        draft = data.draw(st.lists(st.integers(0, N_VOCAB - 1), max_size=4), label="draft")
        valid = VerifyRequest(revision, n_past, np.array(draft, np.int32)).to_wire()
        if step == "valid":
            body = pack(valid)
        elif step == "broken":
            if data.draw(st.booleans(), label="break a session start instead"):
                start_msg = SessionRequest(np.array([1, 2, 3], np.int32), SamplingParams(temperature=0.0), 7).to_wire()
                send(url, "/v1/sessions", data.draw(broken(start_msg), label="broken start"))
                continue
            body = data.draw(broken(valid), label="broken verify")
        elif step == "replay":  # an earlier message again, byte for byte (a retry after a lost answer)
            body = data.draw(st.sampled_from(sent), label="replayed") if sent else pack(valid)
        elif step == "ahead":  # a later block, with or without the 1.1 assumptions (waits, then 409 stale)
            ahead = VerifyRequest(revision + 1, n_past + len(draft) + 1, np.array(draft, np.int32))
            if data.draw(st.booleans(), label="assume"):
                ahead.assume_from, ahead.assume_last = revision, data.draw(st.integers(0, N_VOCAB - 1))
            body = pack(ahead.to_wire())
        elif step == "behind":  # a revision the session has passed
            body = pack(VerifyRequest(max(0, revision - 1), n_past, np.array(draft, np.int32)).to_wire())
        elif step == "other_key":  # the session is not this key's
            send(url, path, pack(valid), key=OTHER_KEY)
            continue
        elif step == "closed":  # close the session, then verify on it (a rebuild is the client's job)
            send(url, f"/v1/sessions/{sid}", b"", method="DELETE")
            body = pack(valid)
        else:  # junk: not msgpack, or msgpack that is not a map
            body = data.draw(st.binary(max_size=64) | st.just(msgpack.packb([1, 2, 3])), label="junk")
        r = send(url, path, body)
        sent.append(body)
        if r.status_code == 200:
            answer = msgpack.unpackb(r.content, raw=False)
            revision, n_past = answer["revision"], answer["n_past"]
        elif step == "closed":
            s = start(url)
            sid, revision, n_past = s["session_id"], s["revision"], s["n_past"]
            path = f"/v1/sessions/{sid}/verify"


def test_the_verifier_kept_serving(verifier):
    print(f"verifier fuzzing: {sum(STATUSES.values())} messages, by status {dict(sorted(STATUSES.items()))}, "
          f"broken {dict(BREAKS)}")
    assert set(BREAKS) == set(BREAKS_ALL)  # every way of breaking a message was tried
    assert verifier.alive()
    s = start(verifier.url)
    r = send(verifier.url, f"/v1/sessions/{s['session_id']}/verify",
             pack(VerifyRequest(s["revision"], s["n_past"], np.array([1], np.int32)).to_wire()))
    assert r.status_code == 200
    stats = msgpack.unpackb(httpx.get(verifier.url + "/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"},
                                      trust_env=False).content, raw=False)
    assert stats["sessions"] <= stats["max_sessions"]
