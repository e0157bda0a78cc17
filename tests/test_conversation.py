"""Conversations keep their KV between turns, drop old turns to fit, save and restore; the engine
guards itself across threads, streams to asyncio and reports the target's log-probabilities."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from conftest import load_runtime as _load_runtime
from edgespec.serve.aio import AsyncEngine, QueueFullError, TokenStream
from edgespec.conversation import Conversation
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import ContextOverflowError, EdgespecError



def load_runtime(path, **options):
    # One thread: on a shared 2-core machine two llama.cpp threads spin at every barrier while the
    # other core is taken, which made decoding 8x slower here than one thread.
    return _load_runtime(path, **{"n_threads": 1, **options})


GREEDY = GenerationConfig(max_tokens=24, temperature=0, mode="ar")
QUESTIONS = ["Hi! Who are you?", "What is the capital of France?", "Name one famous building there."]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(load_runtime(smollm2_path)) as e:
        yield e


def test_each_turn_prefills_only_the_new_messages(engine, smollm2_path):
    conv = Conversation(engine, system="You are brief.")
    previous_kv = 0
    for i, question in enumerate(QUESTIONS):
        decoded = engine.target.n_decoded_tokens
        reply = conv.reply(question, GREEDY)
        reply.text()
        s = reply.result.stats
        # What the runtime actually evaluated: the prefill, then one token per round (plain decoding).
        prefilled = engine.target.n_decoded_tokens - decoded - s.rounds
        assert prefilled == s.prefilled_tokens == s.prompt_tokens - 1 - s.cached_tokens
        if i:
            new_tokens = len(engine.target.tokenize(question, add_special=False, parse_special=False))
            assert s.cached_tokens >= previous_kv - 2        # the previous prompt and answer (re-tokenised)
            assert prefilled <= new_tokens + 12              # the new message and the template's markers
            assert prefilled < s.prompt_tokens / 2
        previous_kv = engine.target.n_past
    assert conv.totals.turns == 3 and [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * 3

    # The same conversation prefilled from scratch answers the same: reuse changes nothing but the cost.
    with Engine(load_runtime(smollm2_path)) as fresh:
        result = fresh.generate(conv.messages[:-1], GREEDY)
    assert result.stats.cached_tokens == 0 and result.stats.prefilled_tokens == result.prompt_tokens - 1
    assert result.text == conv.messages[-1]["content"]


def test_outgrowing_the_context_drops_the_oldest_turns_but_keeps_the_system_prompt(smollm2_path):
    with Engine(load_runtime(smollm2_path, n_ctx=192)) as small:
        conv = Conversation(small, system="You are a helpful assistant who answers in one short sentence.")
        system_tokens = len(small.prompt_tokens([conv.messages[0]]))
        cfg = GenerationConfig(max_tokens=40, temperature=0, mode="ar")
        dropped = None
        for i in range(8):
            reply = conv.reply(f"Tell me one fact about the number {i + 1}.", cfg)
            reply.text()
            if reply.dropped:
                dropped = reply
                break
        assert dropped is not None, "the conversation never outgrew 192 tokens"
        assert conv.messages[0]["role"] == "system" and conv.messages[-2]["content"].endswith(f"{i + 1}.")
        assert "number 1." not in " ".join(m["content"] for m in conv.messages)  # the oldest turn is gone
        assert dropped.result.prompt_tokens + cfg.max_tokens <= small.target.n_ctx
        assert dropped.result.stats.cached_tokens >= system_tokens - 4  # the system prompt's KV was kept

        before = list(conv.messages)
        with pytest.raises(ContextOverflowError, match="does not fit"):
            conv.reply("word " * 300, cfg)
        assert conv.messages == before


def test_a_saved_conversation_restores_messages_and_kv(engine, smollm2_path, tmp_path):
    conv = Conversation(engine)
    for question in QUESTIONS[:2]:
        conv.reply(question, GREEDY).text()
    path = conv.save(tmp_path / "chat.state")
    continued = conv.reply(QUESTIONS[2], GREEDY)
    expected = continued.text()

    with Engine(load_runtime(smollm2_path)) as other:
        restored = Conversation(other)
        restored.load(path)
        assert restored.messages == conv.messages[:-2] and other.target.n_past > 0
        decoded = other.target.n_decoded_tokens
        reply = restored.reply(QUESTIONS[2], GREEDY)
        assert reply.text() == expected
        # Only the new message was prefilled: the rest came from the file.
        assert other.target.n_decoded_tokens - decoded - reply.result.stats.rounds == continued.result.stats.prefilled_tokens

    with Engine(load_runtime(smollm2_path, n_ctx=2048)) as bigger:
        wrong = Conversation(bigger)
        with pytest.raises(EdgespecError, match="n_ctx differs"):
            wrong.load(path)
        assert wrong.messages == [] and bigger.target.n_past == 0


def test_a_cancelled_answer_keeps_what_was_said_and_the_session_goes_on(engine):
    conv = Conversation(engine)
    cancel = threading.Event()
    reply = conv.reply("Write a long story about a dragon.", GenerationConfig(max_tokens=200, temperature=0, mode="ar"),
                       cancel=cancel)
    for piece in reply:
        if len(reply.stream.engine.target.tokens) > 40:
            cancel.set()
    assert reply.result.finish_reason == "cancelled" and len(reply.result.tokens) < 200
    assert conv.messages[-1] == {"role": "assistant", "content": reply.result.text}
    follow_up = conv.reply("Give it a title.", GREEDY)
    follow_up.text()
    assert follow_up.result.stats.cached_tokens >= len(reply.result.tokens)


def test_the_engine_guards_itself(engine):
    assert Engine.thread_safe is False
    ids = engine.prompt_tokens("Name three fruits.")
    solo = engine.generate_tokens(ids, GREEDY).tokens

    outer = iter(engine.stream("Name three fruits.", GREEDY))
    next(outer)
    with pytest.raises(EdgespecError, match="already generating in this thread"):
        engine.generate("Another prompt.", GREEDY)
    outer.close()

    results = [None, None]

    def worker(i):
        results[i] = engine.generate_tokens(ids, GREEDY).tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [solo, solo]  # serialised by the engine's lock, not interleaved


def test_logprobs_are_the_targets_log_softmax(engine, smollm2_path):
    result = engine.generate("Say yes.", GenerationConfig(max_tokens=6, temperature=0, mode="lookup", logprobs=3))
    assert len(result.logprobs) == len(result.tokens)
    for lp, token in zip(result.logprobs, result.tokens):
        assert lp.token == token and len(lp.top) == 3
        assert lp.top[0] == (token, pytest.approx(lp.logprob))  # greedy emits the most likely token
        assert 0 >= lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    ids = engine.prompt_tokens("Say yes.")
    with load_runtime(smollm2_path) as rt:
        row = rt.decode(ids, 1)[0].astype(np.float64)
    expected = row[result.tokens[0]] - (row.max() + np.log(np.exp(row - row.max()).sum()))
    assert result.logprobs[0].logprob == pytest.approx(expected, abs=1e-3)


def test_async_engine_serves_in_order_and_refuses_beyond_its_queue(engine):
    cfg = GenerationConfig(max_tokens=8, temperature=0, mode="ar")
    prompts = [engine.prompt_tokens(f"Count to {n}.") for n in (3, 4, 5)]
    expected = [TokenStream(engine, p, cfg) for p in prompts]
    for s in expected:
        list(s)

    async def main():
        aengine = AsyncEngine(engine, max_queue=1)
        try:
            order = []

            async def one(i, gen):
                async for _ in gen:
                    pass
                order.append(i)
                return gen.result.tokens

            first = aengine.submit(prompts[0], cfg)
            second = aengine.submit(prompts[1], cfg)
            with pytest.raises(QueueFullError, match="busy"):
                aengine.submit(prompts[2], cfg)
            tokens = await asyncio.gather(one(0, first), one(1, second))
            third = [p async for p in aengine.stream(prompts[2], cfg)]
            return order, tokens, "".join(p.text for p in third), aengine.counters
        finally:
            aengine.close()

    order, tokens, third_text, counters = asyncio.run(main())
    assert order == [0, 1] and tokens == [expected[0].result.tokens, expected[1].result.tokens]
    assert third_text == expected[2].result.text
    assert counters["rejected"] == 1 and counters["completed"] == 3
