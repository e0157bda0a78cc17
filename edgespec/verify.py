"""Verification: which drafted tokens the target accepts, and the token it emits after them.

Both rules keep the target's output: greedy emits exactly the target's argmax sequence, and
rejection sampling (Leviathan et al. 2023; Chen et al. 2023) emits tokens distributed exactly as
the target's own sampling would. Each takes the k drafted tokens and the target's k+1 processed rows
(row i predicts the token after draft[:i]) and returns (n_accepted, next_token).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgespec.sampling import sample


class Verifier(Protocol):
    def __call__(self, draft: np.ndarray, draft_probs: np.ndarray | None, target_rows: np.ndarray,
                 rng: np.random.Generator) -> tuple[int, int]: ...


def accept_greedy(draft: np.ndarray, draft_probs: np.ndarray | None, target_rows: np.ndarray,
                  rng: np.random.Generator | None = None) -> tuple[int, int]:
    """Accept while the draft equals the target's argmax; then emit the target's own token."""
    target_tokens = np.argmax(target_rows, axis=1).tolist()  # compared in Python: a few tokens, every round
    n = next((i for i, (d, t) in enumerate(zip(np.asarray(draft).tolist(), target_tokens)) if d != t), len(draft))
    return n, target_tokens[n]


def accept_sampling(draft: np.ndarray, draft_probs: np.ndarray | None, target_rows: np.ndarray,
                    rng: np.random.Generator) -> tuple[int, int]:
    """Rejection sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)).

    On the first rejection, draw from the residual max(0, p_i - q_i) normalised; when every draft
    token passes, draw the bonus token from p_k. `draft_probs` None means a deterministic drafter
    (prompt lookup): q_i is one-hot at x_i, so acceptance is p_i(x_i) and the residual is p_i without x_i.
    """
    k = len(draft)
    idx = np.arange(k)
    p = target_rows[idx, draft]
    q = np.ones(k) if draft_probs is None else draft_probs[idx, draft]
    u = rng.random(k)
    rejected = np.flatnonzero(u * q >= p)  # u < p/q, written without dividing by q
    if not rejected.size:
        return k, sample(target_rows[k], rng)
    i = int(rejected[0])
    residual = target_rows[i].copy()
    if draft_probs is None:
        residual[draft[i]] = 0.0
    else:
        residual = np.maximum(residual - draft_probs[i], 0.0)
    if residual.sum() <= 0:  # p <= q everywhere can only happen through rounding: fall back to p
        residual = target_rows[i]
    return i, sample(residual, rng)


# --- token trees -------------------------------------------------------------------------------
# A tree is node 0 (the last committed token) plus drafted nodes; parents[i] is node i's parent and
# rows[i] the target's processed row after the path to node i. Both rules walk down from the root
# and return (path of accepted nodes, root first, next_token).

def _children(parents: np.ndarray) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        kids[int(parents[i])].append(i)
    return kids


def accept_tree_greedy(nodes: np.ndarray, parents: np.ndarray, rows: np.ndarray,
                       rng: np.random.Generator | None = None) -> tuple[list[int], int]:
    """Follow the child that equals the target's argmax, as long as there is one."""
    kids, path = _children(parents), [0]
    while True:
        token = int(np.argmax(rows[path[-1]]))
        match = [c for c in kids[path[-1]] if nodes[c] == token]
        if not match:
            return path, token
        path.append(match[0])


def accept_tree_sampling(nodes: np.ndarray, parents: np.ndarray, rows: np.ndarray,
                         rng: np.random.Generator) -> tuple[list[int], int]:
    """Multi-candidate verification with the candidates taken as given (one-hot drafts).

    At a node, try its children in order: accept candidate x with probability p(x) under the
    target's row renormalised over the tokens not yet tried; on the last refusal, draw from what
    is left. Whatever the candidates are, the emitted token is distributed exactly as p (it is p
    drawn as a sequence of yes/no questions), so sampling stays lossless.
    """
    kids, path = _children(parents), [0]
    while True:
        p = rows[path[-1]].copy()
        for c in kids[path[-1]]:
            mass = p.sum()
            if mass > 0 and rng.random() * mass < p[nodes[c]]:
                path.append(c)
                break
            p[nodes[c]] = 0.0
        else:
            return path, sample(p if p.sum() > 0 else rows[path[-1]], rng)
