"""The Python API as an app uses it: load, generate, stream, chat messages, stops, prefix reuse."""

from __future__ import annotations

import pytest

from conftest import load_runtime
from edgespec.detokenize import TextAssembler
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import ContextOverflowError, EdgespecError

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2_path, smollm2_draft):
    e = Engine(load_runtime(smollm2_path), load_runtime(smollm2_draft))
    yield e
    e.close()


def test_load_by_catalog_name(smollm2_path):
    with Engine.load("smollm2-135m", n_ctx=512, n_threads=2) as e:
        assert e.target.path == smollm2_path and e.draft_runtime is None  # SmolLM2 has no catalog draft
        result = e.generate("Hi!", max_tokens=4, **GREEDY)
    assert 0 < len(result.tokens) <= 4


def test_the_default_model_comes_with_its_catalog_draft(monkeypatch):
    """No model named: the catalog's default target and its draft (a real pair); a named target or draft is
    taken as named. Checked on the names the loader opens, without loading 1.6 GB."""
    from edgespec import loader
    from edgespec.models import catalog, store

    opened = []
    monkeypatch.setattr(store, "resolve", lambda name, pull_if_missing=True: str(name))
    monkeypatch.setattr(loader, "open_llamacpp_pair", lambda t, _to, d, _do, n_seq=None: opened.append((t, d)))
    default = catalog.get(catalog.DEFAULT_MODEL)
    assert default.draft is not None
    loader.load_pair()
    loader.load_slots(None, None, loader.LoadOptions(), n_seq=2)
    loader.load_pair(None, "smollm2-135m")
    loader.load_pair("smollm2-135m")
    assert opened == [(default.name, default.draft)] * 2 + [(default.name, "smollm2-135m"), ("smollm2-135m", None)]
    assert loader.choose_draft(None, None, mode="ar") == default.draft  # the default is a pair in every mode
    assert loader.model_id(None) == default.name


def test_stream_pieces_make_up_the_text(engine):
    stream = engine.stream("Write a short poem about tea.", GenerationConfig(max_tokens=32, mode="lookup", **GREEDY))
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text and len(pieces) > 1


def test_characters_split_across_tokens_are_never_cut(engine):
    text = "café 咖啡 ☕ καφές — naïve 🍵"
    ids = engine.target.tokenize(text, add_special=False, parse_special=False)
    pieces_bytes = [engine.target.token_bytes(t) for t in ids]
    assert any(_is_partial_utf8(b) for b in pieces_bytes), "this text must split a character over tokens"
    assembler = TextAssembler()
    shown = [assembler.feed(b) for b in pieces_bytes] + [assembler.feed(b"", final=True)]
    assert "".join(shown) == text and not any("\ufffd" in piece for piece in shown)


def test_stop_strings_are_held_back_until_decided():
    assembler = TextAssembler(stops=("STOP",))
    assert assembler.feed(b"hello ST") == "hello "   # "ST" may start the stop string
    assert assembler.feed(b"ART") == "START"
    assert assembler.feed(b" and STO") == " and "
    assert assembler.feed(b"P, more") == "" and assembler.stopped
    assert assembler.text == "hello START and "


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_chat_messages_use_the_models_template(engine):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What colour is the sky?"}]
    ids = engine.prompt_tokens(messages)
    im_start = engine.target.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and ids.count(im_start[0]) == 3  # system, user, and the assistant's turn
    text = b"".join(engine.target.token_bytes(t) for t in ids).decode()  # special tokens print as nothing
    assert text.startswith("system\nYou answer in one word.") and text.endswith("assistant\n")
    assert engine.generate(messages, max_tokens=8, **GREEDY).text.strip()


def test_end_of_generation_token_stops_and_is_not_emitted(engine):
    result = engine.generate("Reply with just the word yes.", max_tokens=64, **GREEDY)
    assert result.finish_reason == "stop"
    assert not set(result.tokens) & engine.target.vocab.eog and len(result.tokens) < 64


def test_max_tokens_is_exact_even_when_a_round_emits_several(engine):
    for mode in ("draft", "lookup", "ar"):
        result = engine.generate("Count from 1 to 50, separated by commas.", max_tokens=7, mode=mode, draft_max=5,
                                 **GREEDY)
        assert len(result.tokens) == 7 and result.finish_reason == "length"
        assert result.stats.generated == 7


def test_stop_strings_cut_the_text(engine):
    result = engine.generate("Count from 1 to 20, separated by commas.", max_tokens=60, stop=("7",), **GREEDY)
    assert result.finish_reason == "stop" and "7" not in result.text and "6" in result.text


def test_a_shared_prompt_prefix_is_not_prefilled_twice(engine):
    cfg = GenerationConfig(max_tokens=4, mode="ar", **GREEDY)
    ids = engine.prompt_tokens("Tell me about the moon in detail, please.")
    engine.generate_tokens(ids, cfg)
    before = engine.target.n_decode_calls
    engine.generate_tokens(ids, cfg)
    assert engine.target.n_decode_calls - before == 4  # the 4 decode steps, no prefill


def test_seeded_sampling_is_reproducible(engine):
    cfg = GenerationConfig(max_tokens=16, temperature=1.0, seed=123, mode="draft")
    a, b = engine.generate("Tell a story.", cfg), engine.generate("Tell a story.", cfg)
    assert a.tokens == b.tokens and a.stats.seed == 123


def test_budget_longer_than_the_context_fails_before_running(smollm2_path):
    with Engine(load_runtime(smollm2_path, n_ctx=256)) as e:
        calls = e.target.n_decode_calls
        with pytest.raises(ContextOverflowError, match="exceeds the context"):
            e.generate("hello", max_tokens=300)
        assert e.target.n_decode_calls == calls


def test_stats_split_time_and_follow_the_definitions(engine):
    s = engine.generate("Write a Python class for a stack.", max_tokens=32, mode="draft", draft_max=3,
                        **GREEDY).stats
    assert s.draft_s > 0 and s.verify_s > 0 and s.draft_s + s.verify_s <= s.decode_s
    assert s.prefill_s <= s.ttft_s
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert sum(s.chosen.values()) == s.rounds
    d = s.to_dict()
    assert len(d["per_position_acceptance"]) == 3
    assert d["per_position_acceptance"] == sorted(d["per_position_acceptance"], reverse=True)


def test_bad_requests(engine):
    with pytest.raises(EdgespecError, match="empty"):
        engine.generate("  ")
    with pytest.raises(EdgespecError, match="max-tokens"):
        GenerationConfig(max_tokens=0)
    with pytest.raises(EdgespecError, match="role"):
        engine.generate([{"content": "no role"}])
