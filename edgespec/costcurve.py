"""The whole cost curve of a target: one verify pass of every size 1..N, and token trees of several widths.

`edgespec.profile` samples the pass sizes auto needs, quickly, once per machine. This measures the
curve point by point (for `edgespec profile --curve N` and the GPU benchmark), so a reader can see
where a pass of k + 1 tokens stops costing the same as one (a GPU's flat region) and what a tree's
extra branches add over a chain of as many nodes. Nothing here feeds the policy directly.

A tree of n nodes and width w is what auto builds: a main chain of n - w + 1 nodes (root included)
with w - 1 sibling leaves hung off its first positions, one llama.cpp sequence per branch.
"""

from __future__ import annotations

import time

import numpy as np

from edgespec.profile import CONTEXT_TOKENS, _best_time
from edgespec.runtimes.base import Runtime, TreeDecoding

TREE_NODES = (4, 8, 16)


def tree_parents(n_nodes: int, width: int) -> np.ndarray:
    """Parents of a tree of n_nodes with `width` branches (see the module docstring)."""
    if width < 1 or 2 * width > n_nodes + 1:  # each sibling needs a chain node beside it
        raise ValueError(f"a tree of {n_nodes} nodes cannot have {width} branches")
    chain = n_nodes - (width - 1)
    parents = [-1] + list(range(chain - 1))           # the main chain: node i follows node i - 1
    parents += [i for i in range(width - 1)]          # siblings of chain nodes 1 .. width - 1
    return np.asarray(parents, dtype=np.int64)


def measure_curve(target: Runtime, *, max_batch: int = 17, tree_widths: tuple[int, ...] = (1, 2, 3, 4),
                  repeats: int = 3, budget_s: float = 60.0) -> dict:
    """Seconds per verify pass for n = 1..max_batch and per tree pass for each width and TREE_NODES size.

    Widths above the runtime's sequences (`sizing.n_seq_max`), or on a runtime without `TreeDecoding`,
    are reported as skipped, as are points left when `budget_s` runs out (then with one repeat, then
    none). Leaves the target's KV empty.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    n_vocab = target.vocab.n_vocab
    context = rng.integers(0, n_vocab, size=CONTEXT_TOKENS).astype(np.int32)
    target.truncate(0)
    target.decode(context, 0)
    rows_max = target.sizing.n_outputs_max or max_batch
    skipped: list[str] = []

    def reps() -> int:
        spent = time.perf_counter() - t0
        return 0 if spent > budget_s else repeats if spent < budget_s / 2 else 1

    def timed(step) -> float | None:
        n = reps()
        if n == 0:
            return None
        step()  # warm this size's kernels and buffers
        return _best_time(step, n)

    verify_s: dict[int, float] = {}
    for n in range(1, min(max_batch, rows_max) + 1):
        batch = rng.integers(0, n_vocab, size=n).astype(np.int32)

        def chain(batch=batch, n=n):
            target.decode(batch, n)
            target.truncate(CONTEXT_TOKENS)
        s = timed(chain)
        if s is None:
            skipped.append(f"verify {n}: time budget")
            continue
        verify_s[n] = s

    tree_s: dict[int, dict[int, float]] = {}
    branches = target.sizing.n_seq_max
    for width in tree_widths:
        if width > branches or TreeDecoding not in target.capabilities:
            skipped.append(f"tree width {width}: the runtime holds {branches} sequence(s)")
            continue
        for n in TREE_NODES:
            if n > min(max_batch, rows_max) or 2 * width > n + 1:
                continue
            nodes = rng.integers(0, n_vocab, size=n).astype(np.int32)
            parents = tree_parents(n, width)

            def tree(nodes=nodes, parents=parents):
                target.decode_tree(nodes, parents)
                target.keep_tree_path([0])
                target.truncate(CONTEXT_TOKENS)
            s = timed(tree)
            if s is None:
                skipped.append(f"tree {width}x{n}: time budget")
                continue
            tree_s.setdefault(width, {})[n] = s
    target.truncate(0)
    step = verify_s.get(1)
    return {
        "verify_s": {str(n): round(s, 7) for n, s in verify_s.items()},
        "verify_steps": {str(n): round(s / step, 3) for n, s in verify_s.items()} if step else {},
        "tree_s": {str(w): {str(n): round(s, 7) for n, s in sizes.items()} for w, sizes in tree_s.items()},
        "tree_vs_chain": {str(w): {str(n): round(s / verify_s[n], 3) for n, s in sizes.items() if n in verify_s}
                          for w, sizes in tree_s.items()},
        "context_tokens": CONTEXT_TOKENS, "repeats": repeats, "skipped": skipped,
        "measured_in_s": round(time.perf_counter() - t0, 3),
    }
