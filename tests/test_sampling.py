"""Logits processing against its definitions, computed the slow obvious way."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.sampling import Sampler, SamplingParams, penalize, token_distribution


def reference(logits, top_k, top_p, min_p, temperature):
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        order = order[:top_k]
    p = np.exp([logits[i] - logits[order[0]] for i in order])
    p /= p.sum()
    keep = len(order)
    if top_p < 1:
        acc = 0.0
        for n, x in enumerate(p, 1):
            acc += x
            if acc >= top_p:
                keep = min(keep, n)
                break
    if min_p > 0:
        keep = min(keep, max(1, sum(1 for x in p if x >= min_p * p[0])))
    kept = order[:keep]
    w = np.exp([(logits[i] - logits[kept[0]]) / temperature for i in kept])
    out = np.zeros(len(logits))
    out[kept] = w / w.sum()
    return out


@pytest.mark.parametrize("top_k,top_p,min_p,temperature", [
    (0, 1.0, 0.0, 1.0), (5, 1.0, 0.0, 0.7), (0, 0.9, 0.0, 1.3), (10, 0.8, 0.05, 0.5), (0, 1.0, 0.1, 1.0),
])
def test_distribution_matches_definition(top_k, top_p, min_p, temperature):
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(200) * 3).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = token_distribution(logits, params)
    np.testing.assert_allclose(got, reference(logits, top_k, top_p, min_p, temperature), atol=1e-6)
    assert got.sum() == pytest.approx(1.0)


def test_repetition_penalty_follows_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = penalize(logits, np.array([0, 1, 1]), SamplingParams(repeat_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])
    assert logits[0] == 2.0  # input untouched


def test_rows_use_each_rows_own_history():
    params = SamplingParams(temperature=0, repeat_penalty=4.0, repeat_last_n=8)
    logits = np.tile(np.array([3.0, 2.9, 0.0, 0.0], dtype=np.float32), (3, 1))
    rows = Sampler(params, 0).rows(logits, context=np.array([2, 3]), continuation=np.array([0, 1]))
    # row 0 follows the context only; row 1 has also seen token 0; row 2 tokens 0 and 1
    assert [int(r.argmax()) for r in rows] == [0, 1, 0]


def test_invalid_values_are_user_errors():
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(min_p=1.5), dict(repeat_penalty=0)):
        with pytest.raises(EdgespecError):
            SamplingParams(**bad)


def test_seeded_sampling_reproduces():
    probs = np.full(50, 1 / 50)
    a = Sampler(SamplingParams(), 7)
    b = Sampler(SamplingParams(), 7)
    assert [a.pick(probs) for _ in range(20)] == [b.pick(probs) for _ in range(20)]
