"""Suffix drafting across requests: the drafter's walk, the bounded history and its file, auto's use
of its confidence, and losslessness through the real engine."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.policy import AdaptivePolicy, ConfidenceCalibration
from edgespec.drafters.suffix import SEPARATOR, SuffixDrafter, SuffixHistory
from lossless import compare_greedy
from test_policy import MS, make_state


def drafter_with(*outputs, limit=1000):
    history = SuffixHistory(limit)
    for output in outputs:
        history.add(output)
    return SuffixDrafter(history)


def test_the_most_frequent_continuation_is_proposed_with_its_share_as_confidence():
    drafter = drafter_with([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3, 4, 6])
    draft = drafter.propose(np.array([7, 1, 2, 3]), 4)
    assert draft.tokens.tolist()[:2] == [4, 6]  # 4 follows twice in three; then 5 or 6 once each: the latest
    # shares with a pseudo-count of 1 / (tokens matched): "1 2 3" matched, then "1 2 3 4"
    assert draft.confidence.tolist()[:2] == pytest.approx([2 / (3 + 1 / 3), 1 / (2 + 1 / 4)])


def test_the_longest_match_decides_and_outputs_do_not_run_into_each_other():
    drafter = drafter_with([9, 1, 2, 3, 7, 7], [5, 1, 2, 3, 8])
    draft = drafter.propose(np.array([5, 1, 2, 3]), 4)
    assert draft.tokens.tolist() == [8]  # the 4-token match; its output ends there
    assert draft.confidence.tolist() == [pytest.approx(1 / (1 + 1 / 4))]
    assert len(drafter.propose(np.array([42]), 4)) == 0  # nothing matches


def test_the_current_context_is_searched_too():
    drafter = drafter_with()
    draft = drafter.propose(np.array([3, 4, 5, 6, 0, 3, 4]), 3)
    assert draft.tokens.tolist() == [5, 6, 0]


def test_a_walk_that_runs_into_the_end_of_the_context_stops_there():
    drafter = drafter_with()
    context = np.array([7, 1, 2, 9, 1, 2, 9, 4, 4, 1, 2])  # "1 2 9" twice, then 1 or 4 (the latest), ...
    for branch in (None, lambda *_: False):                 # ... until the copy reaches the context's end
        assert drafter.propose(context, 8, branch=branch).tokens.tolist() == [9, 4, 4, 1, 2]


def test_the_walk_stops_where_the_path_becomes_unlikely():
    outputs = [[1, 2, t] for t in range(10, 30)]  # after "1 2": twenty different tokens, once each
    drafter = drafter_with(*outputs)
    assert len(drafter.propose(np.array([1, 2]), 4)) == 0  # best continuation has 1/20 < min_reach


def test_runner_up_continuations_become_sibling_leaves():
    drafter = drafter_with([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6])
    asked = []

    def branch(n_nodes, p_alt, reach):
        asked.append((n_nodes, round(p_alt, 3), reach))
        return True

    draft = drafter.propose(np.array([1, 2]), 2, branch=branch)
    assert draft.parents is not None
    assert draft.tokens.tolist() == [3, 5, 4] and draft.parents.tolist() == [0, 0, 1]
    assert asked[0] == (1, round(1 / (3 + 1 / 2), 3), 1.0)


def _suffix_by_definition(outputs, context, k, max_match=32, min_reach=0.1):
    """Suffix drafting as defined: the longest suffix of the context's last max_match tokens found in
    earlier outputs + context (ending before the context's last token); then, token by token, the
    commonest continuation of its occurrences still matching (the latest among equals), with its share
    of them and a pseudo-count of 1 / tokens matched as confidence, while the path's chance stays at
    least min_reach. Returns (tokens, confidences)."""
    from collections import Counter

    corpus = [t for output in outputs for t in [*output, SEPARATOR]] + list(context)
    pattern = list(context)[-max_match:]
    length, ends = 0, []
    for n in range(1, len(pattern) + 1):
        found = [e for e in range(n - 1, len(corpus) - 1) if corpus[e - n + 1:e + 1] == pattern[-n:]]
        if not found:
            break
        length, ends = n, found
    tokens, confidences, reach, following = [], [], 1.0, [e + 1 for e in ends]
    for i in range(k):
        following = [f for f in following if f < len(corpus)]
        nxt = [corpus[f] for f in following]
        counts = Counter(t for t in nxt if t != SEPARATOR)
        if not counts:
            break
        latest = {t: f for t, f in zip(nxt, following)}
        best = max(counts, key=lambda t: (counts[t], latest[t]))
        p = counts[best] / (len(nxt) + 1.0 / (length + i))
        if reach * p < min_reach:
            break
        tokens.append(best)
        confidences.append(p)
        reach *= p
        following = [f + 1 for f, t in zip(following, nxt) if t == best]
    return tokens, confidences


def test_the_walk_is_the_definition_on_many_small_histories():
    """Exactly the definition, on random small-alphabet histories and contexts: a few occurrences
    (counted in Python) and, with FEW_OCCURRENCES at 0, many (counted by numpy) alike."""
    import edgespec.drafters.suffix as suffix

    rng = np.random.default_rng(0)
    for few in (suffix.FEW_OCCURRENCES, 0):
        for _ in range(1500):
            alphabet = int(rng.integers(2, 7))
            outputs = [rng.integers(0, alphabet, size=int(rng.integers(2, 25))) for _ in range(int(rng.integers(0, 4)))]
            context = rng.integers(0, alphabet, size=int(rng.integers(1, 35)))
            k = int(rng.integers(1, 9))
            # a threshold no product of these rational shares lands on: the walk multiplies in another
            # order than the definition, and an exact tie (2/3 3/10 4/5 5/6 6/7 7/8 = 1/10) may go either way
            min_reach = 0.1 + 1e-9
            tokens, confidences = _suffix_by_definition(outputs, context, k, min_reach=min_reach)
            original = suffix.FEW_OCCURRENCES
            suffix.FEW_OCCURRENCES = few
            try:
                draft = SuffixDrafter(drafter_with(*outputs).history, min_reach=min_reach).propose(context, k)
            finally:
                suffix.FEW_OCCURRENCES = original
            assert draft.tokens.tolist() == tokens, (outputs, context, k)
            stated = [] if draft.confidence is None else draft.confidence.tolist()  # None: nothing drafted
            assert stated == pytest.approx(confidences, rel=1e-12)


def test_history_is_bounded_and_drops_the_oldest_output():
    history = SuffixHistory(limit=10)
    for start in (0, 100, 200):
        history.add(np.arange(start, start + 4))
    history.add(np.arange(300, 304))
    assert len(history) == 8 and history.n_outputs == 2
    assert history.tokens.tolist() == [200, 201, 202, 203, SEPARATOR, 300, 301, 302, 303, SEPARATOR]
    with pytest.raises(EdgespecError, match="at least 1 token"):
        SuffixHistory(limit=0)


def test_history_file_round_trip_and_refusals(tmp_path):
    history = SuffixHistory(limit=100, key="vocab-a")
    history.add([1, 2, 3])
    history.add([4, 5, 6, 7])
    path = history.save(tmp_path / "history.bin")
    again = SuffixHistory(limit=100, key="vocab-a")
    again.load(path)
    assert again.tokens.tolist() == history.tokens.tolist()

    with pytest.raises(EdgespecError, match="another vocabulary"):
        SuffixHistory(key="vocab-b").load(path)
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(path.read_bytes()[:-5])
    untouched = SuffixHistory(key="vocab-a")
    with pytest.raises(EdgespecError, match="corrupt"):
        untouched.load(corrupt)
    assert len(untouched) == 0
    (tmp_path / "junk.bin").write_bytes(b"not a history at all")
    with pytest.raises(EdgespecError, match="corrupt"):
        untouched.load(tmp_path / "junk.bin")
    assert not list(tmp_path.glob(".*partial"))


def test_auto_weighs_suffix_confidence_as_calibrated_by_the_target():
    calibration = ConfidenceCalibration()
    confident = np.array([0.99, 0.99, 0.99])
    unconfirmed = calibration.rates(confident)[0]
    assert unconfirmed < 0.5  # a drafter's word alone earns no more than a coin flip
    for _ in range(20):  # the target confirms it
        calibration.decay_step()
        calibration.record(confident, 3, False)
    confirmed = calibration.rates(confident)[0]
    assert confirmed > 0.9
    for _ in range(40):  # then keeps rejecting the first token
        calibration.decay_step()
        calibration.record(confident, 0, True)
    assert calibration.rates(confident)[0] < min(0.5, confirmed / 3)

    from edgespec.machine.profile import CostProfile

    drafter = drafter_with([1, 2, 3, 4, 5, 6, 7, 8])
    cheap = CostProfile({n: 10 * MS * (1 + 0.2 * (n - 1)) for n in (1, 2, 4, 8)}, None, None, 0.0)  # cheap, not free
    policy = AdaptivePolicy(cheap, None, None, k_max=6, suffix=drafter)
    assert policy.choose(make_state([9, 1, 2, 3])).k <= 1  # not yet confirmed: one token at most
    proposal = drafter.propose(np.array([9, 1, 2, 3]), 6)
    for _ in range(10):  # the target's tokens confirm proposals this confident (scored in the shadow)
        policy.calibration.decay_step()
        policy.calibration.record(proposal.confidence, len(proposal), False)
    choice = policy.choose(make_state([9, 1, 2, 3]))
    assert choice.drafter is drafter and choice.k == 5  # the whole remembered continuation
    for _ in range(30):
        policy.observe(choice, choice.k, 0, np.array([77]))  # and then the target never takes it
        choice = policy.choose(make_state([9, 1, 2, 3]))
    assert choice.drafter is None


def test_copies_that_disagree_cannot_both_pass():
    """Lookup (copying the context) and suffix (copying an earlier answer) each look right 9 times in
    10 or more; where they propose different tokens at most one can be the target's, so on a curve where a
    1-token draft needs more than a coin flip auto drafts neither; where they agree it drafts."""
    from edgespec.drafters import PromptLookupDrafter
    from edgespec.machine.profile import CostProfile
    from edgespec.policy import exclusive

    a, b = np.array([4, 5, 6]), np.array([4, 7, 8])
    capped = exclusive([(a, np.array([0.9, 0.8, 0.9])), (b, np.array([0.9, 0.6, 0.9]))])
    assert capped[0].tolist() == pytest.approx([0.9, 0.8 / 1.4, 0.9])  # judged apart at the 2nd token
    assert capped[1].tolist() == pytest.approx([0.9, 0.6 / 1.4, 0.9])
    unchanged = exclusive([(a, np.array([0.9, 0.3, 0.9])), (b, np.array([0.9, 0.6, 0.9]))])
    assert [r.tolist() for r in unchanged] == [[0.9, 0.3, 0.9], [0.9, 0.6, 0.9]]  # they already sum to <= 1

    steep = CostProfile({1: 10 * MS, 2: 16 * MS, 4: 28 * MS, 8: 52 * MS}, None, None, 0.0)
    context = [1, 2, 3, 4, 5, 6, 20, 21, 1, 2, 3]  # lookup copies "4 5 6" after "1 2 3"

    def policy_with(history):
        lookup, suffix = PromptLookupDrafter(), drafter_with(*history)
        policy = AdaptivePolicy(steep, lookup, None, k_max=3, suffix=suffix)
        policy.estimates["lookup"].assume(0.9)
        policy.calibration.trials[:] = 100.0
        policy.calibration.hits[:] = 95.0
        policy.calibration.changed()
        return policy, lookup, suffix

    policy, lookup, suffix = policy_with([[1, 2, 3, 7, 8, 9]] * 3)  # earlier answers went on "7 8 9"
    greedy = make_state(context).sampler
    assert lookup.propose(np.array(context), 3, greedy).tokens[0] != suffix.propose(np.array(context), 3).tokens[0]
    assert policy.choose(make_state(context)).drafter is None
    policy, lookup, suffix = policy_with([[1, 2, 3, 4, 5, 6]] * 3)  # the control: they agree
    assert policy.choose(make_state(context)).drafter is not None


# --- through the engine ---------------------------------------------------------------------------

STRUCTURED = [
    "Return a JSON object with the keys name, age and city for: Alice is 31 and lives in Paris.",
    "Return a JSON object with the keys name, age and city for: Bob is 45 and lives in Oslo.",
    "Return a JSON object with the keys name, age and city for: Chen is 28 and lives in Lima.",
]


def test_suffix_mode_is_greedy_lossless_and_drafts_from_earlier_requests(smollm2_path):
    reference = load_runtime(smollm2_path)
    with Engine(load_runtime(smollm2_path)) as engine:
        plain = []
        for prompt in STRUCTURED:  # plain outputs first, so the history holds their outputs too
            ids = engine.prompt_tokens(prompt)
            plain.append(engine.generate_tokens(ids, GenerationConfig(max_tokens=40, temperature=0, mode="ar")))
        engine.history.clear()  # forget them: start afresh
        accepted = []
        for prompt, expected in zip(STRUCTURED, plain):
            ids = engine.prompt_tokens(prompt)
            result = engine.generate_tokens(ids, GenerationConfig(max_tokens=40, temperature=0, mode="suffix"))
            cmp = compare_greedy(reference, ids, expected.tokens, result.tokens)
            assert cmp.near_tie, (prompt, cmp)
            accepted.append(result.stats.accepted)
        assert engine.history.n_outputs == 3
    reference.close()
    assert accepted[2] > accepted[0]  # later requests draft from the earlier ones' outputs


def test_cli_refuses_a_zero_history_limit_and_a_corrupt_history_file(tmp_path, smollm2_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "hi", "--target", str(smollm2_path),
                               "-n", "4", *args], capture_output=True, text=True, timeout=120)

    zero = run("--mode", "suffix", "--history-limit", "0")
    assert zero.returncode == 2 and "history limit" in zero.stderr and "Traceback" not in zero.stderr
    assert len(zero.stderr.strip().splitlines()) == 1
    bad = tmp_path / "history.bin"
    bad.write_bytes(b"garbage")
    corrupt = run("--mode", "suffix", "--history-file", str(bad))
    assert corrupt.returncode == 2 and "corrupt" in corrupt.stderr and "Traceback" not in corrupt.stderr
    assert bad.read_bytes() == b"garbage"  # left as it was

    path = tmp_path / "kept.bin"
    first = run("--mode", "suffix", "--history-file", str(path), "--json", "--temperature", "0")
    assert first.returncode == 0, first.stderr
    saved = SuffixHistory()
    saved.load(path)
    assert saved.n_outputs == 1 and saved.tokens[:-1].tolist() == json.loads(first.stdout)["tokens"]


def test_suffix_trees_where_a_wide_pass_is_cheap_stay_lossless(smollm2_path, smollm2_draft):
    """With a flat (GPU-like) cost profile and room for branches, auto widens suffix proposals into
    trees (the runner-up continuation of earlier outputs as a sibling); output stays the target's."""
    from test_policy import flat_profile

    reference = load_runtime(smollm2_path)
    with Engine(load_runtime(smollm2_path, n_seq_max=4), load_runtime(smollm2_draft)) as engine:
        engine._profile = flat_profile(draft=50 * MS)  # a costly draft: suffix is what pays
        plain = [engine.generate_tokens(engine.prompt_tokens(p), GenerationConfig(max_tokens=32, temperature=0,
                                                                                   mode="ar")) for p in STRUCTURED]
        tree_rounds = 0
        for prompt, expected in zip(STRUCTURED, plain):
            engine.history.clear()
            for other in plain:
                if other is not expected:
                    engine.history.add(other.tokens)
            ids = engine.prompt_tokens(prompt)
            result = engine.generate_tokens(ids, GenerationConfig(max_tokens=32, temperature=0, mode="auto"))
            cmp = compare_greedy(reference, ids, expected.tokens, result.tokens)
            assert cmp.near_tie, (prompt, cmp)
            tree_rounds += result.stats.tree_rounds
            assert not any(key.startswith("draft:") for key in result.stats.chosen), result.stats.chosen
    reference.close()
    assert tree_rounds > 0
