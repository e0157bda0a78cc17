"""`edgespec serve` against real clients: a real server process on loopback, SmolLM2, the official
`openai` Python client and raw HTTP for what a client library would refuse to send."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig

KEY = "test-key-123"
MODEL = "smollm2-135m"
SYSTEM = "You are a helpful assistant."
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # a raw prompt SmolLM2 keeps continuing, so generations run long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(log: Path, *args):
    port = free_port()
    env = {**os.environ, "EDGESPEC_DEBUG": ""}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "serve", "--port", str(port), "--threads", "1",
                                 *map(str, args)], stdout=err, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server never became healthy: {log.read_text()}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(log, "--target", smollm2_path, "--model-name", MODEL, "--mode", "lookup", "--ctx", 2048,
                        "--api-key", KEY, "--max-request-kb", 64, "--max-tokens-limit", 2000) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def library(smollm2_path):
    """The same model in this process: what the server must answer."""
    with Engine(load_runtime(smollm2_path, n_ctx=2048, n_threads=1)) as e:
        yield e


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def post(url: str, path: str, body, *, key: str | None = KEY, raw: bytes | None = None, timeout: float = 60):
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def wait_idle(url: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if not h["queue"]["running"] and not h["queue"]["waiting"]:
            return h
        assert time.monotonic() < deadline, f"the server is still generating: {h}"
        time.sleep(0.1)


# --- the OpenAI client gets correct completions -------------------------------------------------

def test_health_and_models(server, client):
    h = health(server)
    assert h["status"] == "ok" and h["model"] == MODEL and h["mode"] == "lookup"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_is_what_the_engine_generates(client, library):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    expected = library.generate("The capital of France is", GenerationConfig(max_tokens=12, temperature=0, raw=True,
                                                                           mode="lookup"))
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert resp.usage.completion_tokens == len(expected.tokens)
    assert resp.usage.prompt_tokens == expected.prompt_tokens
    stats = resp.model_extra["edgespec"]
    assert stats["mode"] == "lookup" and stats["generated"] == len(expected.tokens)
    assert {"drafted", "accepted", "acceptance_rate", "mean_accepted_length", "rounds", "ttft_s",
            "tokens_per_s", "cached_tokens"} <= set(stats)


def test_chat_streaming_and_not_agree_with_the_engine(client, library):
    messages = chat(SYSTEM, "What is the capital of France?")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = library.generate(messages, GenerationConfig(max_tokens=24, temperature=0, mode="lookup"))
    assert whole.choices[0].message.content == streamed == expected.text
    assert "Paris" in streamed and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["edgespec"]["generated"] == len(expected.tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.tokens)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_request_fields_people_rely_on(client):
    def ask(**kw):
        return client.chat.completions.create(model=MODEL, messages=chat(SYSTEM, "Tell me a story about a cat."),
                                              **kw)

    short = ask(max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    stopped = ask(max_tokens=60, temperature=0, stop=[".", "!"])
    text = stopped.choices[0].message.content
    assert text and "." not in text and "!" not in text and stopped.choices[0].finish_reason == "stop"
    a, b = (ask(max_tokens=16, temperature=0.9, top_p=0.9, seed=11) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content and a.model_extra["edgespec"]["seed"] == 11


def test_logprobs_of_the_emitted_tokens(client):
    resp = client.chat.completions.create(model=MODEL, messages=chat(SYSTEM, "Say hello."), max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)

    streamed = list(client.chat.completions.create(model=MODEL, messages=chat(SYSTEM, "Say hello."), max_tokens=8,
                                                   temperature=0, logprobs=True, top_logprobs=1, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in content]

    comp = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=6, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


# --- malformed requests get 4xx JSON errors, and the server keeps serving ------------------------

@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2500}], "max_tokens": 10}, 400, "max_tokens"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
])
def test_malformed_requests_get_json_errors(server, body, status, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"].split(".")[0] == param


def test_bad_bodies_keys_and_paths(server, client):
    assert post(server, "/v1/completions", None, raw=b"{not json").status_code == 400
    assert post(server, "/v1/completions", None, raw=b"").status_code == 400
    huge = post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    for key in (None, "wrong-key"):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                 key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    missing = httpx.get(f"{server}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    # ... and it still serves.
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).usage.completion_tokens
    assert health(server)["requests"]["failed"] == 0


def test_a_client_that_disconnects_cancels_its_generation(server):
    before = wait_idle(server)["requests"]["cancelled"]
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # it started
    # 2000 tokens would take a minute; the cancelled one stops at the next round.
    assert wait_idle(server)["requests"]["cancelled"] == before + 1

    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        post(server, "/v1/completions", {**body, "stream": False}, timeout=1.5)
    assert wait_idle(server)["requests"]["cancelled"] == before + 2


def test_shared_prefixes_reuse_their_kv(client, library, server):
    long_system = ("You are a meticulous assistant for a bicycle repair shop. Answer customers' questions about "
                   "brakes, gears, tyres, chains and wheels. Be concise, friendly and precise; suggest a visit to "
                   "the shop when a repair needs tools. ") * 4
    n_system = len(library.prompt_tokens([{"role": "system", "content": long_system}], raw=False))

    def ask(system, question):
        r = client.chat.completions.create(model=MODEL, messages=chat(system, question), max_tokens=8, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens, r.model_extra["edgespec"]

    ask(long_system, "How do I fix a flat tyre?")
    cached, stats = ask(long_system, "How often should I oil the chain?")
    assert cached >= n_system - 5 and stats["prefix_cache"]["source"] == "live"  # what the runtime still held
    assert stats["prefilled_tokens"] == stats["prompt_tokens"] - 1 - cached
    ask("You are a pirate.", "Say ahoy.")  # another prefix takes the runtime's KV
    cached, stats = ask(long_system, "What tyre pressure for a road bike?")
    assert stats["prefix_cache"]["source"] == "cache" and cached >= n_system - 5  # restored from the cache
    cache = health(server)["prefix_cache"]
    assert cache["hits"] >= 1 and 0 < cache["bytes"] <= cache["max_bytes"] and cache["entries"] >= 2


# --- a small queue and a short time limit ---------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-small") / "server.log"
    with running_server(log, "--target", smollm2_path, "--mode", "ar", "--ctx", 4096, "--max-queue", 1,
                        "--timeout", 8, "--prefix-cache-mb", 0) as url:
        yield url


@pytest.mark.slow
def test_beyond_the_queue_clients_get_429_and_nothing_hangs(small_server):
    results = []

    def one(i):
        try:
            r = post(small_server, "/v1/completions", {"model": MODEL, "prompt": f"{COUNTING} #{i}", "max_tokens": 24,
                                                      "temperature": 0}, key=None, timeout=60)
            results.append((r.status_code, r.json(), r.headers))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append((None, repr(exc), None))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    statuses = sorted(s for s, _, _ in results)
    assert None not in statuses and set(statuses) <= {200, 429}, results
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1  # one running + one waiting get through
    refused = next(body for s, body, _ in results if s == 429)
    assert refused["error"]["type"] == "rate_limit_error" and "busy" in refused["error"]["message"]
    assert all(h.get("retry-after") for s, _, h in results if s == 429)
    h = wait_idle(small_server)
    assert h["requests"]["rejected"] == statuses.count(429) and h["requests"]["completed"] == statuses.count(200)
    ok = post(small_server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}, key=None)
    assert ok.status_code == 200


@pytest.mark.slow
def test_a_request_past_its_time_limit_gets_504(small_server):
    r = post(small_server, "/v1/completions", {"model": MODEL, "prompt": COUNTING, "max_tokens": 3000,
                                               "temperature": 0}, key=None, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    h = wait_idle(small_server)
    assert h["requests"]["timed_out"] >= 1
    assert post(small_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                key=None).status_code == 200


def test_an_exposed_server_needs_a_key():
    proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "serve", "--host", "0.0.0.0", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "EDGESPEC_DEBUG": "", "EDGESPEC_API_KEY": ""})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--api-key" in lines[0]
