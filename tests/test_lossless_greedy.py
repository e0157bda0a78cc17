"""Greedy speculation emits what the target alone emits, up to floating-point near-ties.

Every divergence from plain decoding must start where the target's logits for the two tokens are
within NEAR_TIE_GAP; the identical fraction is printed (run with -s) and must stay high.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig
from lossless import NEAR_TIE_GAP, compare_greedy

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France?",
    "Rename the variable x to count in: x = 0\nfor i in range(10):\n    x += i\nprint(x)",
    "Translate to French: The cat sleeps on the mat.",
    "List three primary colors.",
    "Fix the bug: def add(a, b): return a - b",
    "Explain what a hash table is in one sentence.",
    "Convert this JSON to YAML: {\"name\": \"edgespec\", \"version\": 1, \"tags\": [\"fast\", \"small\"]}",
    "Write a haiku about the sea.",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog does not react.",
    "What is 12 times 12?",
    "Refactor into a list comprehension: result = []\nfor v in values:\n    if v > 0:\n        result.append(v * 2)",
    "Give me a title for a blog post about speculative decoding.",
    "Write a SQL query that counts the rows of table users.",
    "Repeat exactly: alpha beta gamma delta epsilon alpha beta gamma delta epsilon",
    "Name a famous physicist.",
    "Complete the sentence: The best way to learn programming is",
    "Write a bash command that lists all files ending in .py.",
    "Add type hints: def greet(name, times):\n    return ' '.join([name] * times)",
    "Describe the colour blue to someone who cannot see.",
    "Sort these words alphabetically: pear, apple, fig, banana.",
    "Write a JavaScript function that reverses a string.",
]

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def smol_engine(smollm2_path, smollm2_draft):
    engine = Engine(load_runtime(smollm2_path), load_runtime(smollm2_draft))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def plain_outputs(smol_engine):
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    out = {}
    for prompt in PROMPTS:
        ids = smol_engine.prompt_tokens(prompt)
        out[prompt] = (ids, smol_engine.generate_tokens(ids, cfg).tokens)
    return out


def _check_all(engine, plain_outputs, cfg, reference_runtime, on_result=None):
    identical, diverged = 0, []
    for prompt, (ids, plain) in plain_outputs.items():
        result = engine.generate_tokens(ids, cfg)
        if on_result is not None:
            on_result(result)
        cmp = compare_greedy(reference_runtime, ids, plain, result.tokens)
        identical += cmp.identical
        if not cmp.identical:
            diverged.append((prompt[:30], cmp.first_divergence, cmp.gap))
        assert cmp.near_tie, f"{prompt!r}: diverges at token {cmp.first_divergence} with logit gap {cmp.gap:.3f} " \
                             f"> {NEAR_TIE_GAP}: not a near-tie, a real error"
    fraction = identical / len(plain_outputs)
    print(f"\n{cfg.mode} k={cfg.draft_max}: identical {identical}/{len(plain_outputs)}; near-tie divergences: {diverged}")
    return fraction


@pytest.fixture(scope="module")
def reference(smollm2_path):
    rt = load_runtime(smollm2_path)
    yield rt
    rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode,k", [("draft", 1), ("draft", 3), ("draft", 6), ("lookup", 2), ("lookup", 5),
                                    ("auto", None)])
def test_smollm2_greedy_speculation_is_lossless(smol_engine, plain_outputs, reference, mode, k):
    assert len(PROMPTS) >= 20
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode=mode, draft_max=k)
    assert _check_all(smol_engine, plain_outputs, cfg, reference) >= 0.8


@pytest.mark.slow
def test_smollm2_greedy_token_trees_are_lossless(smollm2_path, smollm2_draft, plain_outputs, reference):
    """Auto mode on a GPU-like profile (flat verify cost) verifies token trees; greedy output stays
    the target's own, up to near-ties."""
    from edgespec.machine.profile import CostProfile

    some = dict(list(plain_outputs.items())[:8])  # tree passes are slow on this CPU: 8 prompts
    tree_rounds = []
    with Engine(load_runtime(smollm2_path, n_seq_max=4), load_runtime(smollm2_draft)) as engine:
        engine._profile = CostProfile({n: 0.01 for n in (1, 2, 4, 8, 16)}, 0.001, 0.0012, 0.00005)
        cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="auto")
        assert _check_all(engine, some, cfg, reference, lambda r: tree_rounds.append(r.stats.tree_rounds)) >= 0.8
    # Trees on at least half the prompts; on the others free model-free chains (lookup, suffix) paid more.
    assert sum(1 for n in tree_rounds if n) >= 4, tree_rounds


def test_speculation_actually_drafts_and_rejects(smol_engine, plain_outputs):
    """Losslessness would be trivial if nothing were drafted or everything accepted."""
    ids, _ = plain_outputs[PROMPTS[0]]
    stats = smol_engine.generate_tokens(ids, GenerationConfig(max_tokens=MAX_TOKENS, temperature=0,
                                                              mode="draft", draft_max=4)).stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    assert stats.rounds < stats.generated            # some passes emitted several tokens
    assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted / stats.rounds)


@pytest.mark.parametrize("draft_kind", ["good_draft", "bad_draft"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_tiny_models_greedy_lossless(tiny_pair, draft_kind, k):
    target = load_runtime(tiny_pair["target"], n_ctx=512)
    engine = Engine(target, load_runtime(tiny_pair[draft_kind], n_ctx=512))
    reference = load_runtime(tiny_pair["target"], n_ctx=512)
    rng = np.random.default_rng(k)
    identical = 0
    for trial in range(20):
        ids = [295] + rng.integers(32, 127, size=12).tolist()  # BOS and printable bytes
        plain = engine.generate_tokens(ids, GenerationConfig(max_tokens=60, temperature=0, mode="ar")).tokens
        for mode in ("draft", "lookup"):
            spec = engine.generate_tokens(ids, GenerationConfig(max_tokens=60, temperature=0, mode=mode,
                                                                draft_max=k))
            cmp = compare_greedy(reference, ids, plain, spec.tokens)
            assert cmp.near_tie, f"trial {trial} {mode}: divergence at {cmp.first_divergence}, gap {cmp.gap}"
            identical += cmp.identical
    print(f"\ntiny {draft_kind} k={k}: identical {identical}/40")
    assert identical >= 36
    engine.close(), reference.close()
