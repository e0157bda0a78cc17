"""The MLX runtime behind the project's front ends: `serve --runtime mlx` (one slot and `--parallel`)
through the openai client, chat with KV reuse and saved conversations, and cloud-edge speculation
with the device drafting on MLX against a llama.cpp verifier of the same weights.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

if sys.platform == "darwin" and platform.machine() != "arm64":
    pytest.skip("MLX has no build for Intel Macs", allow_module_level=True)
import mlx_lm  # noqa: E402,F401
import openai  # noqa: E402

from edgespec.conversation import Conversation  # noqa: E402
from edgespec.engine import Engine, GenerationConfig  # noqa: E402
from lossless import compare_greedy  # noqa: E402
from test_onnx_runtime import prompts  # noqa: E402
from test_server import free_port, running_server  # noqa: E402

KEY = "mlx-test-key"
GREEDY = GenerationConfig(max_tokens=16, temperature=0, mode="ar")
QUESTIONS = ["Hello there, who are you?", "The printing press changed what?", "Tell me more about cities."]


def mlx_engine(hf_tiny, draft=True, n_ctx=512):
    return Engine.load(hf_tiny["llama"], hf_tiny["llama_draft"] if draft else None, runtime="mlx", n_ctx=n_ctx)


def test_serve_runtime_mlx_answers_what_the_library_does(hf_tiny, tmp_path):
    log = tmp_path / "server.log"
    with running_server(log, "--target", hf_tiny["llama"], "--draft", hf_tiny["llama_draft"], "--runtime", "mlx",
                        "--mode", "draft", "--ctx", 512, "--api-key", KEY, "--model-name", "tiny") as url, \
            mlx_engine(hf_tiny) as library:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        for question in QUESTIONS + QUESTIONS[:1]:  # the repeat comes from the prefix cache (saved MLX KV)
            messages = [{"role": "user", "content": question}]
            got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
            want = library.generate(messages, GenerationConfig(max_tokens=16, temperature=0, mode="draft"))
            assert got.choices[0].message.content == want.text
        got = client.completions.create(model="tiny", prompt="The press", max_tokens=12, temperature=0)
        want = library.generate("The press", GenerationConfig(max_tokens=12, temperature=0, raw=True, mode="draft"))
        assert got.choices[0].text == want.text
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                max_tokens=16, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == library.generate([{"role": "user", "content": QUESTIONS[1]}],
                                            GenerationConfig(max_tokens=16, temperature=0, mode="draft")).text


def test_chat_on_mlx_prefills_only_new_messages_and_restores_a_saved_conversation(hf_tiny, tmp_path):
    with mlx_engine(hf_tiny, draft=False) as engine:
        conv = Conversation(engine, system="You are brief.")
        for i, question in enumerate(QUESTIONS[:2]):
            decoded = engine.target.n_decoded_tokens
            reply = conv.reply(question, GREEDY)
            reply.text()
            s = reply.result.stats
            prefilled = engine.target.n_decoded_tokens - decoded - s.rounds
            assert prefilled == s.prefilled_tokens == s.prompt_tokens - 1 - s.cached_tokens
            if i:
                assert s.cached_tokens > 0 and prefilled < s.prompt_tokens / 2
        path = conv.save(tmp_path / "chat.state")
        expected = conv.reply(QUESTIONS[2], GREEDY).text()
    with mlx_engine(hf_tiny, draft=False) as fresh:  # from scratch: the same answer (reuse changes only the cost)
        result = fresh.generate(conv.messages[:-1], GREEDY)
        assert result.stats.cached_tokens == 0 and result.text == expected
    with mlx_engine(hf_tiny, draft=False) as other:  # the saved MLX KV: only the new message is prefilled
        restored = Conversation(other)
        restored.load(path)
        assert other.target.n_past > 0
        decoded = other.target.n_decoded_tokens
        reply = restored.reply(QUESTIONS[2], GREEDY)
        assert reply.text() == expected
        assert other.target.n_decoded_tokens - decoded - reply.result.stats.rounds == reply.result.stats.prefilled_tokens
        assert reply.result.stats.cached_tokens > 0


def test_serve_parallel_on_mlx_answers_concurrent_requests_as_the_library_does_alone(hf_tiny, tmp_path):
    """`serve --parallel 2 --runtime mlx`: two slots on one copy of the weights, a cache each. Four
    requests at once: each answer is what the library gives that request alone (MLX's batched and
    one-token logits agree exactly on this CPU, test_mlx_runtime's spread), so a slot that read
    another's cache or a rollback that left a rejected draft would change the text."""
    import threading

    from test_parallel import wait_slots_idle

    questions = QUESTIONS + ["Why do rivers bend?"]
    with running_server(tmp_path / "server.log", "--target", hf_tiny["llama"], "--draft", hf_tiny["llama_draft"],
                        "--runtime", "mlx", "--mode", "draft", "--parallel", 2, "--ctx", 1024, "--api-key", KEY,
                        "--model-name", "tiny") as url, mlx_engine(hf_tiny) as library:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
        answers: dict[int, str] = {}

        def ask(i):
            got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": questions[i]}],
                                                 max_tokens=24, temperature=0)
            answers[i] = got.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        slots = wait_slots_idle(url)["slots"]
        assert slots["max_active"] == 2 and slots["batched_steps"] > 0, slots  # both slots ran at once
        for i, question in enumerate(questions):
            want = library.generate([{"role": "user", "content": question}],
                                    GenerationConfig(max_tokens=24, temperature=0, mode="draft")).text
            assert answers.get(i) == want, (question, answers.get(i), want)


def test_under_a_budget_idle_mlx_slots_give_their_kept_kv_back(tmp_path):
    """On MLX each slot's caches are its own memory: under pressure the guard's first step drops what
    idle slots keep (with the prefix cache), and the resident set falls by at least 0.6 of its estimate;
    the slots then answer as before."""
    import mlx.core as mx

    from edgespec.machine.guard import guard_loaded, trim_heap
    from edgespec.machine.memory import current_rss
    from edgespec.serve.slots import ParallelEngine, SlotScheduler
    from hf_models import write_tiny_checkpoint

    # 16 KiB of KV a position (8 layers, 4 KV heads of 64), so 768 kept positions a slot show in the resident set
    model = write_tiny_checkpoint(tmp_path / "wide", family="llama", tokenizer="gpt2", seed=6, n_layer=8, hidden=256,
                                  n_head=4, n_head_kv=4, ff=64, max_positions=4096)
    engine = ParallelEngine.load(str(model), None, parallel=2, n_ctx=4096, runtime="mlx")
    guard = guard_loaded(engine, current_rss() * 4)
    scheduler = SlotScheduler(engine)
    try:
        rng = np.random.default_rng(0)
        engine.target.decode_batch([(s, rng.integers(5, 300, 768), 1) for s in range(2)])  # what requests left
        estimate = guard.estimates()["saved_state"]
        assert estimate == 2 * 768 * 16 * 1024  # two slots' caches (grown in steps of 256 positions)
        mx.clear_cache()  # the passes' freed buffers go now, so what falls below is the caches alone
        trim_heap()
        guard.budget_bytes = int(current_rss() / 0.98)
        guard.check()  # nothing runs: the worker waits for a request
        step = guard.released[0]
        assert step["step"] == "saved_state" and [engine.target.seq_n_past(s) for s in range(2)] == [0, 0]
        assert step["rss_before"] - step["rss_after"] >= 0.6 * estimate, (step, estimate)
        ids = [int(t) for t in rng.integers(5, 300, 20)]
        cfg = GenerationConfig(max_tokens=6, temperature=0, mode="ar")
        with Engine.load(str(model), None, runtime="mlx", n_ctx=512) as alone:
            assert engine.front.generate_tokens(ids, cfg).tokens == alone.generate_tokens(ids, cfg).tokens
    finally:
        scheduler.close()
        engine.close()


def test_serve_parallel_runs_on_llama_cpp_and_mlx_only(hf_tiny, tmp_path):
    for runtime in ("onnx", "coreml"):
        proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "serve", "--target", str(hf_tiny["llama"]),
                               "--runtime", runtime, "--parallel", "2", "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "EDGESPEC_DEBUG": ""})
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "--parallel runs llama.cpp or MLX" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tiny_gguf(hf_tiny, tmp_path_factory):
    from edgespec.exporters.gguf_export import export_gguf

    return export_gguf(hf_tiny["llama"], tmp_path_factory.mktemp("mlx-cloud"), ["f32"], stem="llama").files["f32"]


def test_cloud_edge_drafting_on_mlx_against_a_llama_cpp_verifier(hf_tiny, tiny_gguf, tmp_path):
    from cloud_helpers import API_KEY, VerifierProcess
    from conftest import load_runtime
    from edgespec.cloud.client import CloudEdgeClient, CloudOptions
    from edgespec.runtimes.mlx import MlxOptions, MlxRuntime

    cfg = GenerationConfig(max_tokens=24, temperature=0, mode="ar")
    with VerifierProcess(tiny_gguf, max_sessions=4, session_ctx=512, log_dir=tmp_path) as server, \
            Engine(load_runtime(tiny_gguf, n_ctx=512, n_threads=1)) as plain, \
            load_runtime(tiny_gguf, n_ctx=512, n_threads=1) as reference:
        draft = MlxRuntime(hf_tiny["llama_draft"], MlxOptions(n_ctx=512))
        with CloudEdgeClient(draft, CloudOptions(server.url, api_key=API_KEY, tune=False)) as client:
            identical, drafted, accepted = 0, 0, 0
            for ids in prompts(hf_tiny["llama"], 6):
                result = client.generate_tokens(ids, cfg)
                drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
                cmp = compare_greedy(reference, ids, plain.generate_tokens(ids, cfg).tokens, result.tokens)
                identical += cmp.identical
                assert cmp.near_tie, cmp
    print(f"\ncloud-edge, MLX drafting for llama.cpp: identical {identical}/6, accepted {accepted}/{drafted}")
    assert drafted > 0 and accepted > 0

    # the CLI: generate --verifier --runtime mlx drafts on MLX
    with VerifierProcess(tiny_gguf, max_sessions=2, session_ctx=512) as server:
        proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "Hello", "--verifier", server.url,
                               "--api-key", API_KEY, "--runtime", "mlx", "--draft", str(hf_tiny["llama_draft"]),
                               "-n", "8", "--temperature", "0", "--ctx", "256"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "EDGESPEC_DEBUG": "", "EDGESPEC_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
