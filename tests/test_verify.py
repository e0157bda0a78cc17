"""The acceptance rules on hand-made distributions, where the exact answer is known."""

from __future__ import annotations

import numpy as np
from scipy import stats

from edgespec.verify import accept_greedy, accept_sampling


def test_greedy_accepts_the_matching_prefix_then_corrects():
    rows = np.eye(6, dtype=np.float32)[[1, 2, 3, 4]]          # target argmax: 1, 2, 3, 4
    assert accept_greedy(np.array([1, 2, 5]), None, rows) == (2, 3)   # reject at 5, emit 3
    assert accept_greedy(np.array([1, 2, 3]), None, rows) == (3, 4)   # all pass: bonus 4
    assert accept_greedy(np.array([], dtype=np.int32), None, rows[:1]) == (0, 1)  # plain decoding


def _first_token_histogram(q, p, n, deterministic=False):
    """Distribution of the first emitted token when a draft token is drawn from q (or fixed at 0)."""
    rng = np.random.default_rng(0)
    counts = np.zeros(len(p[0]))
    for _ in range(n):
        x = 0 if deterministic else int(rng.choice(len(q), p=q))
        draft_probs = None if deterministic else q[None, :]
        n_acc, token = accept_sampling(np.array([x]), draft_probs, p, rng)
        counts[x if n_acc else token] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution():
    p = np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([0.1, 0.2, 0.3, 0.4])  # a poor draft
    n = 20000
    for counts in (_first_token_histogram(q, p, n), _first_token_histogram(q, p, n, deterministic=True)):
        assert stats.chisquare(counts, p[0] * n).pvalue > 0.001
    # and the test has power: the draft's own distribution is clearly rejected
    assert stats.chisquare(_first_token_histogram(q, p, n), q * n).pvalue < 1e-6


def test_bonus_token_comes_from_the_last_row():
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = np.array([[0.0, 1.0, 0.0]])
    assert accept_sampling(np.array([1]), q, p, np.random.default_rng(0)) == (1, 2)
