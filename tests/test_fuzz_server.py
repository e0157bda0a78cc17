"""`edgespec serve` fuzzed from its own OpenAPI schema (schemathesis), and the limits that keep one request
from taking the process: a real server on loopback with SmolLM2, a fixed seed, a bounded budget."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
import schemathesis

from test_server import MODEL, post, running_server

MAX_TOKENS = 4        # every accepted request generates at most this much, so the fuzzing stays fast
FUZZ_SEED = 25
FUZZ_EXAMPLES = 150   # across every route, valid and invalid requests together (about 40 s here)


@pytest.fixture(scope="module")
def fuzz_server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-fuzz") / "server.log"
    with running_server(log, "--target", smollm2_path, "--model-name", MODEL, "--mode", "ar", "--ctx", 512,
                        "--max-tokens-limit", MAX_TOKENS, "--max-request-kb", 64, "--timeout", 30,
                        "--prefix-cache-mb", 0) as url:
        yield url


def test_the_schema_describes_the_real_request_bodies(fuzz_server):
    from edgespec.serve.server import BODIES

    r = httpx.get(f"{fuzz_server}/openapi.json", timeout=10)
    assert r.status_code == 200
    schema = r.json()
    components = schema["components"]["schemas"]
    for path, model in BODIES.items():
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        described = components[body["$ref"].rsplit("/", 1)[1]]
        assert set(described["properties"]) == set(model.model_fields)  # every field the server reads
        assert set(described["required"]) == {n for n, f in model.model_fields.items() if f.is_required()}
        props = described["properties"]
        assert props["max_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS  # this server's limits
        assert props["stop"]["anyOf"][1]["maxItems"] == 4
        for code in ("400", "413", "429"):
            assert schema["paths"][path]["post"]["responses"][code]["content"]["application/json"]
    # A body built from the schema alone is one the server accepts.
    ok = post(fuzz_server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": MAX_TOKENS, "stop": ["\n\n"]}, key=None)
    assert ok.status_code == 200, ok.text


def _is_json_refusal(response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error.get("message"), str) and bool(error["message"]) and isinstance(error.get("type"), str)


def test_fuzzed_from_its_schema_no_5xx_and_a_json_reason_on_every_refusal(fuzz_server):
    from schemathesis import GenerationMode
    from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

    schema = schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    seen: dict[int, int] = {}

    @seed(FUZZ_SEED)
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=cases)
    def one(case):
        started = time.monotonic()
        response = case.call(base_url=fuzz_server, timeout=30)
        assert time.monotonic() - started < 30, "a request hung"
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance])
        if response.status_code >= 400:
            assert _is_json_refusal(response), (response.status_code, response.text[:300])
        elif "text/event-stream" in response.headers.get("content-type", ""):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]

    one()
    print(f"fuzzed: {sum(seen.values())} requests, by status {dict(sorted(seen.items()))}")
    assert seen.get(200) and sum(n for code, n in seen.items() if 400 <= code < 500), seen
    assert httpx.get(f"{fuzz_server}/health", timeout=10).json()["requests"]["failed"] == 0


# --- limits that protect the process ----------------------------------------------------------------

LIMITS = dict(max_tokens_limit=8, max_prompt_chars=2000, max_messages=16, max_stop=4, max_stop_chars=32,
              max_tools=4, max_schema_bytes=2000)


@pytest.fixture(scope="module")
def limited(smollm2_path):
    """The app in this process with small limits (ServerConfig), and a key."""
    from fastapi.testclient import TestClient

    from conftest import load_runtime
    from edgespec.engine import Engine
    from edgespec.serve.server import ServerConfig, create_app

    with Engine(load_runtime(smollm2_path, n_ctx=1024, n_threads=1)) as engine:
        app = create_app(engine, ServerConfig(model_id=MODEL, mode="ar", api_keys=("k-1", "a-much-longer-key-2"),
                                              prefix_cache_bytes=0, **LIMITS))
        with TestClient(app, headers={"authorization": "Bearer k-1"}) as client:
            yield client


def _tool(name: str, properties: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": "a tool",
                                             "parameters": {"type": "object", "properties": properties or {}}}}


def _chat(**over) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **over}


@pytest.mark.parametrize("path, body, field, code", [
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 2001, "max_tokens": 2}, "prompt", "prompt_too_long"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x" * 2001], "max_tokens": 2}, "prompt", "prompt_too_long"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 2001, "max_tokens": 2}, "prompt", "prompt_too_long"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "y" * 1001}] * 2), "messages",
     "prompt_too_long"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "y" * 2001}]}]),
     "messages", "prompt_too_long"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a"}] * 17), "messages", "too_many_messages"),
    ("/v1/chat/completions", _chat(max_tokens=9), "max_tokens", "max_tokens_too_large"),
    ("/v1/chat/completions", _chat(max_tokens=None, max_completion_tokens=10**9), "max_completion_tokens",
     "max_tokens_too_large"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2**40}, "max_tokens", "max_tokens_too_large"),
    ("/v1/chat/completions", _chat(stop=["a", "b", "c", "d", "e"]), "stop", "too_many_stops"),
    ("/v1/chat/completions", _chat(stop="z" * 33), "stop", "stop_too_long"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["ok", "q" * 1000]}, "stop", "stop_too_long"),
    ("/v1/chat/completions", _chat(tools=[_tool(f"f{i}") for i in range(5)]), "tools", "too_many_tools"),
    ("/v1/chat/completions", _chat(tools=[_tool("f", {f"p{i}": {"type": "string"} for i in range(100)})]), "tools",
     "schema_too_large"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}}}), "response_format",
     "schema_too_large"),
])
def test_a_request_past_a_limit_gets_a_json_reason_naming_the_field(limited, path, body, field, code):
    r = limited.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == code and error["message"], error


def test_requests_at_the_limits_are_served(limited):
    r = limited.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": "hi"}] * 16,
                                                        max_tokens=8, stop=["q" * 32] * 4, temperature=0))
    assert r.status_code == 200, r.text
    r = limited.post("/v1/completions", json={"model": MODEL, "prompt": "the " * 500, "max_tokens": 8})
    assert r.status_code == 200, r.text
    schema = limited.get("/openapi.json").json()["components"]["schemas"]
    assert schema["ChatRequest"]["properties"]["messages"]["maxItems"] == 16
    assert schema["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]["maxLength"] == 2000
    assert schema["ChatRequest"]["properties"]["stop"]["anyOf"][0]["maxLength"] == 32


def test_the_api_key_is_compared_in_constant_time_and_required_off_loopback(limited):
    import inspect

    from edgespec.errors import EdgespecError
    from edgespec.serve import server

    for header in ("Bearer k-1", "Bearer a-much-longer-key-2", "bearer  k-1 "):
        assert limited.get("/v1/models", headers={"authorization": header}).status_code == 200
    for header in ("", "Bearer", "Bearer k-2", "Bearer k-1x", "Basic k-1", "Bearer " + "k" * 10_000):
        r = limited.get("/v1/models", headers={"authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (header, r.text)
    # Equal-length digests compared with hmac.compare_digest, every key: the time says nothing of any key.
    source = inspect.getsource(server.authorized)
    assert "hmac.compare_digest" in source and "sha256" in source
    assert limited.get("/health", headers={"authorization": ""}).status_code == 200  # the probe needs no key
    for host in ("0.0.0.0", "192.168.1.2", "::"):
        with pytest.raises(EdgespecError, match="--api-key"):
            server.check_bind(host, 8000, ())
