"""Token trees: one target pass over several branches, exact greedy, lossless sampling."""

from __future__ import annotations

import numpy as np
from scipy import stats

from conftest import load_runtime
from edgespec.verify import accept_tree_greedy, accept_tree_sampling


def test_a_tree_pass_gives_each_branch_its_own_logits(smollm2_path):
    rt = load_runtime(smollm2_path, n_seq_max=4)
    prefix = rt.tokenize("The capital of France is", add_special=True, parse_special=False)
    rt.decode(prefix[:-1], 0)
    # root = last prompt token; chain a-b, sibling a' of a, sibling b' of b
    a, b, a2, b2 = 12366, 30, 3575, 28
    nodes = [prefix[-1], a, b, a2, b2]
    parents = [-1, 0, 1, 0, 1]
    tree = rt.decode_tree(nodes, parents)

    def alone(path):
        fresh = load_runtime(smollm2_path)
        fresh.decode(prefix[:-1], 0)
        row = fresh.decode([prefix[-1], *path], len(path) + 1)
        fresh.close()
        return row
    chain, via_a2, via_b2 = alone([a, b]), alone([a2]), alone([a, b2])
    np.testing.assert_allclose(tree[[0, 1, 2]], chain, atol=1e-3)
    np.testing.assert_allclose(tree[3], via_a2[1], atol=1e-3)
    np.testing.assert_allclose(tree[4], via_b2[2], atol=1e-3)

    # keep the path root -> a -> b': the main-chain part stays, the branch node is left for the
    # caller's next batch; continuing gives the logits of a fresh run of that prefix
    assert rt.keep_tree_path([0, 1, 4]) == 2
    assert list(rt.tokens) == prefix + [a]
    after = rt.decode([b2, 264], 1)[0]
    fresh = load_runtime(smollm2_path)
    expected = fresh.decode(prefix + [a, b2, 264], 1)[0]
    np.testing.assert_allclose(after, expected, atol=1e-3)
    rt.close(), fresh.close()


def test_greedy_walks_the_matching_branch():
    rows = np.zeros((5, 10), dtype=np.float32)
    nodes = np.array([9, 1, 2, 3, 4])
    parents = np.array([-1, 0, 1, 0, 1])    # 1 -> 2 chain; 3 sibling of 1; 4 sibling of 2
    rows[0, 3] = 1   # target wants 3 after the root: the sibling
    rows[3, 7] = 1   # then 7: no child, emitted as the correction
    assert accept_tree_greedy(nodes, parents, rows) == ([0, 3], 7)
    rows[0] = 0
    rows[0, 1] = 1
    rows[1, 4] = 1
    rows[4, 5] = 1   # leaf reached: bonus 5
    assert accept_tree_greedy(nodes, parents, rows) == ([0, 1, 4], 5)


def test_multi_candidate_sampling_keeps_the_distribution():
    p = np.array([0.1, 0.4, 0.2, 0.3])
    rows = np.tile(p, (3, 1))
    nodes = np.array([0, 1, 3])        # candidates 1 then 3 under the root
    parents = np.array([-1, 0, 0])
    rng = np.random.default_rng(0)
    n = 20000
    first = np.zeros(4)
    for _ in range(n):
        path, token = accept_tree_sampling(nodes, parents, rows, rng)
        first[nodes[path[1]] if len(path) > 1 else token] += 1
    assert stats.chisquare(first, p * n).pvalue > 0.001


def test_after_a_tree_later_decodes_equal_a_fresh_run(smollm2_path):
    """Branch cells interleaved with the kept path leave holes in the KV pool; tokens decoded later
    must still give exactly the logits of a run that never saw the tree (llama.cpp's flash attention
    changes results when a sequence's cells are out of position order, so decode_tree lays the main
    chain out first)."""
    rt, fresh = load_runtime(smollm2_path, n_seq_max=4), load_runtime(smollm2_path)
    prefix = rt.tokenize("Once upon a time", add_special=True, parse_special=False)
    rt.decode(prefix[:-1], 0)
    nodes, parents = [prefix[-1], 264, 279, 1234, 567], [-1, 0, 0, 1, 2]  # chain 0-1-3, branch 2-4
    rt.decode_tree(nodes, parents)
    assert rt.keep_tree_path([0, 1, 3]) == 3
    after = np.stack([rt.decode([t], 1)[0] for t in (11, 12, 13, 14)])
    fresh.decode(prefix[:-1], 0)
    fresh.decode([prefix[-1], 264, 1234], 0)
    expected = np.stack([fresh.decode([t], 1)[0] for t in (11, 12, 13, 14)])
    np.testing.assert_allclose(after, expected, atol=1e-4)
    rt.close(), fresh.close()


def test_a_session_whose_cells_interleave_with_others_gets_its_own_logits(smollm2_path):
    """The verifier's sessions share one pool: after another session frees cells below this one's,
    this session's next tokens land there, out of position order. Its logits must not change."""
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    opts = LlamaCppOptions(n_ctx=512, n_threads=2)
    pool, alone = LlamaCppMultiSeqRuntime(smollm2_path, opts, n_seq=2), LlamaCppMultiSeqRuntime(smollm2_path, opts, n_seq=2)
    prompt = pool.tokenize("The quick brown fox", add_special=True, parse_special=False)
    pool.decode_batch([(0, prompt, 0)])
    pool.decode_batch([(1, [1, 2, 3], 0)])
    pool.decode_batch([(0, [11, 12], 0)])
    pool.seq_clear(1)
    shared = np.stack([pool.decode_batch([(0, [t], 1)])[0][0] for t in (13, 14, 15)])
    alone.decode_batch([(0, prompt, 0)])
    alone.decode_batch([(0, [11, 12], 0)])
    expected = np.stack([alone.decode_batch([(0, [t], 1)])[0][0] for t in (13, 14, 15)])
    np.testing.assert_allclose(shared, expected, atol=1e-4)
    pool.close(), alone.close()
