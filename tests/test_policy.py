"""The adaptive policy's choices on synthetic cost curves, and auto mode through the real engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.drafters import PromptLookupDrafter
from edgespec.engine import Engine, GenerationConfig
from edgespec.policy import AdaptivePolicy
from edgespec.machine.profile import CONTEXT_TOKENS, DEEP_CONTEXT_TOKENS, CostProfile
from edgespec.sampling import Sampler, SamplingParams
from lossless import compare_greedy

MS = 1e-3


def linear_profile(per_token=10 * MS, draft=6 * MS):
    """CPU-like: verifying k+1 tokens costs about k+1 single steps; the draft costs 0.6 of a step."""
    return CostProfile({n: per_token * n for n in (1, 2, 3, 4, 6, 8, 10)}, draft, 2 * draft, 0.05 * MS)


def flat_profile(step=10 * MS, draft=1 * MS):
    """GPU-like: a verify pass costs the same for 1 to 10 tokens; the draft is cheap."""
    return CostProfile({n: step for n in (1, 2, 3, 4, 6, 8, 10)}, draft, 1.2 * draft, 0.05 * MS)


class _Named:
    def __init__(self, name):
        self.name = name

    def unseen(self, context):  # a draft model that has seen everything (no catch-up to pay)
        return 0


def make_state(context, remaining=100, n_prompt=0):
    """A state past its first round (the first round is always plain decoding)."""
    return SimpleNamespace(committed=np.asarray(context, dtype=np.int32), remaining=remaining, n=len(context),
                           n_prompt=n_prompt, sampler=Sampler(SamplingParams(temperature=0), 0), forced=0)


def with_acceptance(policy, name, rate, rounds=30):
    for _ in range(rounds):  # feed observations at the given per-token acceptance
        k = policy.k_max
        n = int(np.sum(np.cumprod(np.random.default_rng(len(policy.estimates[name].hits)).random(k) < rate)))
        policy.estimates[name].update(k, n)
    policy.estimates[name].assume(rate)  # exact rate, for a clean test
    return policy


def test_linear_verify_and_a_costly_draft_choose_plain_decoding():
    policy = with_acceptance(AdaptivePolicy(linear_profile(), None, _Named("draft")), "draft", 0.9)
    choice = policy.choose(make_state([1, 2, 3]))
    assert choice.k == 0 and choice.drafter is None
    assert choice.predicted_speed == pytest.approx(policy.plain_speed())


def test_flat_verify_and_high_acceptance_choose_a_long_draft():
    draft = _Named("draft")
    policy = with_acceptance(AdaptivePolicy(flat_profile(), None, draft, k_max=8), "draft", 0.9)
    choice = policy.choose(make_state([1, 2, 3]))
    assert choice.drafter is draft and choice.k >= 6
    assert choice.predicted_speed > 3 * policy.plain_speed()


def test_the_draft_models_bound_never_skips_a_chain_that_would_win():
    """choose skips pricing a draft model where model_could_beat says no chain can beat the best so
    far: on random curves (measured-like, not always increasing), rates, forced tokens, rows of other
    requests, catch-up and prefill, the bound is never below what model_speeds prices, and it does
    skip where the draft cannot pay (an idle text's rounds)."""
    rng = np.random.default_rng(3)
    skipped = 0
    for _ in range(400):
        step = float(rng.uniform(5, 15)) * MS
        curve = {n: step * float(rng.uniform(0.8, 1.2)) * (1 + float(rng.uniform(0.1, 1.0)) * (n - 1)) for n in (1, 2, 3, 4, 6, 8, 10)}
        profile = CostProfile(curve, float(rng.uniform(0.5, 12)) * MS, float(rng.uniform(1, 20)) * MS, 0.05 * MS)
        policy = AdaptivePolicy(profile, None, _Named("draft"), k_max=8)
        policy.estimates["draft"].assume(rng.uniform(0.0, 1.0, size=8))
        policy.rows_besides = int(rng.choice([0, 0, 3]))
        policy._forced = int(rng.choice([0, 0, 2]))
        k_cap = int(rng.integers(1, 9))
        speeds = policy.model_speeds("draft", k_cap, unseen=int(rng.integers(0, 40)), remaining=int(rng.integers(1, 200)),
                                     generated=int(rng.integers(0, 40)))
        for beat in (policy.plain_speed(), float(max(speeds[1:])) * 0.999, float(max(speeds[1:])) * 1.5):
            if max(speeds[1:]) > beat:
                assert policy.model_could_beat("draft", k_cap, beat)
            skipped += not policy.model_could_beat("draft", k_cap, beat)
    assert skipped > 100


def test_lookup_is_bounded_by_the_match():
    lookup = PromptLookupDrafter()
    policy = with_acceptance(AdaptivePolicy(flat_profile(), lookup, None, k_max=8), "lookup", 0.95)
    context = [5, 6, 7, 8, 9, 10, 11, 99, 5, 6, 7]          # "5 6 7" seen before, followed by 8 9 10 11 99
    choice = policy.choose(make_state(context))
    assert choice.drafter is lookup and list(choice.draft.tokens) == [8, 9, 10, 11, 99, 5, 6, 7][: choice.k]
    assert choice.k == 8  # the match runs to the end of the context, capped at k_max
    assert policy.choose(make_state([1, 2, 3, 4])).k == 0  # nothing to copy: plain decoding


def _lookup_by_definition(context, k, ngram_max, ngram_min):
    """Prompt lookup as defined: for n = ngram_max down to ngram_min, the latest earlier window equal
    to the last n tokens (one with a token after it); propose what followed it."""
    for n in range(min(ngram_max, len(context) - 1), ngram_min - 1, -1):
        for start in range(len(context) - 1 - n, -1, -1):
            if list(context[start:start + n]) == list(context[-n:]):
                return list(context[start + n:start + n + k])
    return []


def test_lookup_takes_the_longest_match_then_the_latest():
    lookup, sampler = PromptLookupDrafter(), Sampler(SamplingParams(temperature=0), 0)
    # "1 2 3" (3 tokens) beats the later "7 3" (only "3" matches); among equal matches the latest wins.
    assert list(lookup.propose(np.array([1, 2, 3, 9, 7, 3, 8, 1, 2, 3]), 3, sampler).tokens) == [9, 7, 3]
    assert list(lookup.propose(np.array([5, 3, 6, 5, 3, 7, 5, 3]), 2, sampler).tokens) == [7, 5]
    assert len(PromptLookupDrafter(4, 2).propose(np.array([1, 3, 2, 3]), 4, sampler)) == 0  # 1 < ngram_min
    rng = np.random.default_rng(0)  # and exactly the definition, on many small-alphabet contexts, with
    for i in range(3000):           # few earlier occurrences of the last token and with many (walked apart)
        context = rng.integers(0, rng.integers(2, 6), size=rng.integers(1, 40) if i % 10 else rng.integers(150, 400))
        for ngram_max, ngram_min in ((4, 1), (3, 2), (1, 1)):
            got = PromptLookupDrafter(ngram_max, ngram_min).propose(context, 6, sampler).tokens
            assert list(got) == _lookup_by_definition(context, 6, ngram_max, ngram_min), (context, ngram_max)


def test_lookup_asked_round_after_round_answers_as_if_asked_afresh():
    """One drafter asked as generations grow (one or a few tokens a round), now of one, now of another
    (two requests, one longer than the other, or sharing a head and then going on differently) answers
    every time exactly what the definition gives: a drafter that kept state between asks (session 22
    measured an incremental n-gram index, dropped for its 0.5 KiB a context token) must keep this."""
    sampler = Sampler(SamplingParams(temperature=0), 0)
    rng = np.random.default_rng(1)
    lookup = PromptLookupDrafter()
    asked = 0
    for _ in range(40):
        a = rng.integers(0, rng.integers(2, 8), size=rng.integers(1, 30))
        b = np.concatenate([a[:rng.integers(0, len(a) + 1)], rng.integers(0, 6, size=rng.integers(1, 30))])
        contexts = [a, b]
        while min(map(len, contexts)) < 80:
            i = int(rng.integers(0, 2))  # which request asks next
            for _ in range(int(rng.integers(1, 4))):
                context = contexts[i]
                assert list(lookup.propose(context, 5, sampler).tokens) == _lookup_by_definition(context, 5, 4, 1)
                asked += 1
                contexts[i] = np.concatenate([context, rng.integers(0, 6, size=rng.integers(1, 4))])
    assert asked > 1000


def test_estimates_recompute_what_they_derive_when_they_change():
    """Auto reads each estimate's rates every round, computed once per change: every way an estimate
    changes shows in what it returns next, and the kept arrays cannot be written by a caller."""
    from edgespec.policy import AcceptanceEstimate, ConfidenceCalibration

    est = AcceptanceEstimate(4)
    rates, emitted = est.rates, est.expected_emitted()
    assert est.rates is rates  # kept while nothing changed
    with pytest.raises(ValueError):
        rates[0] = 1.0
    est.update(3, 1)  # the first passed, the second failed
    assert est.rates[0] > rates[0] and est.rates[1] < rates[1] and est.expected_emitted()[1] > emitted[1]
    est.decay_step()
    assert not np.array_equal(est.rates, rates) and np.allclose(est.rates, est.hits / est.trials)
    est.assume(0.25)
    assert np.array_equal(est.rates, np.full(4, 0.25)) and est.all_pass()[2] == 0.25 ** 2
    calibration, confident = ConfidenceCalibration(), np.array([0.99])
    before = calibration.rates(confident)[0]
    calibration.record(np.full(20, 0.99), 20, False)
    confirmed = calibration.rates(confident)[0]
    assert confirmed > before
    calibration.decay_step()  # the same share on less evidence: a wider standard error, a lower bound lower
    assert calibration.rates(confident)[0] < confirmed


def test_a_break_even_speculation_is_not_taken():
    """Lookup k = 1 at a verify(2) / verify(1) of 1.32 (this CPU): 36 % acceptance predicts 1.03x,
    inside the margin, so plain decoding; 60 % predicts 1.21x, so lookup."""
    from edgespec.policy import SPECULATION_MARGIN

    profile = CostProfile({1: 10 * MS, 2: 13.2 * MS, 3: 16.4 * MS, 4: 19.6 * MS}, None, None, 0.0)
    lookup = PromptLookupDrafter()
    context = [5, 6, 7, 8, 1, 2, 5, 6, 7]  # "5 6 7" seen before: a match to propose
    for rate, taken in ((0.36, False), (0.60, True)):
        policy = AdaptivePolicy(profile, lookup, None, k_max=1)
        policy.estimates["lookup"].assume(rate)
        predicted = (1 + rate) / 1.32
        assert (predicted > 1 + SPECULATION_MARGIN) == taken
        choice = policy.choose(make_state(context))
        assert (choice.drafter is lookup) == taken, (rate, choice)


def test_never_predicts_below_plain_decoding():
    rng = np.random.default_rng(0)
    for trial in range(200):
        sizes = (1, 2, 3, 4, 6, 8)
        base = rng.uniform(1, 30) * MS
        growth = rng.uniform(0, 1.2)
        profile = CostProfile({n: base * (1 + growth * (n - 1)) for n in sizes}, rng.uniform(0.1, 1) * base,
                              rng.uniform(0.2, 2) * base, rng.uniform(0, 0.2) * base)
        policy = AdaptivePolicy(profile, PromptLookupDrafter(), _Named("draft"), k_max=5)
        for name in ("lookup", "draft"):
            policy.estimates[name].assume(rng.uniform(0, 1, 5))
        context = rng.integers(0, 4, size=40)  # small alphabet: lookup finds matches
        choice = policy.choose(make_state(context))
        assert choice.predicted_speed >= policy.plain_speed()
        if choice.k:
            assert choice.predicted_speed > policy.plain_speed()


def test_gate_thresholds_follow_the_costs():
    policy = AdaptivePolicy(flat_profile(draft=1 * MS), None, _Named("draft"), k_max=8)
    gate = policy._gate(target_speed=300.0)  # tokens/s the round aims at
    assert gate(1, 0.9, 0.9)            # confident and cheap: keep drafting
    assert not gate(1, 0.2, 0.2)        # a token whose confidence cannot pay for its draft cost
    assert not gate(4, 0.9, 0.001)      # the chain as a whole is unlikely to survive
    costly = AdaptivePolicy(linear_profile(), None, _Named("draft"))._gate(target_speed=50.0)
    assert not costly(1, 0.6, 0.6)      # verify grows with k here: only near-certain tokens pay


def test_shadow_scoring_teaches_lookup_without_using_it():
    lookup = PromptLookupDrafter()
    policy = AdaptivePolicy(linear_profile(), lookup, None)  # linear costs: lookup is never drafted
    before = policy.estimates["lookup"].rates[0]
    context = [4, 5, 6, 7, 8, 9] * 2
    for _ in range(10):
        choice = policy.choose(make_state(context))
        assert choice.drafter is None
        policy.observe(choice, 0, 0, np.array(context[6:8]))  # plain decoding emitted what lookup proposed
        context += context[6:8]
    assert policy.estimates["lookup"].rates[0] > before


def test_lookup_states_the_length_of_its_match_as_evidence():
    lookup = PromptLookupDrafter()
    sampler = Sampler(SamplingParams(temperature=0), 0)
    assert lookup.propose(np.array([1, 2, 3, 4, 9, 2, 3, 4]), 4, sampler).evidence == 3    # "2 3 4" seen before
    assert lookup.propose(np.array([7, 5, 8, 9, 1, 5]), 4, sampler).evidence == 1          # only "5"
    assert lookup.propose(np.array([1, 2, 3, 4, 9, 2, 3, 4]), 4, sampler).head(2).evidence == 3


def test_auto_rates_each_level_of_lookup_evidence_apart():
    """Copies after a 4-token match always pass, after a 1-token match never: pooled, lookup looks
    half right at every match; rated by level, auto drafts after the long match and not after the short one."""
    profile = CostProfile({1: 10 * MS, 2: 15 * MS, 3: 18 * MS, 4: 20 * MS}, None, None, 0.0)
    lookup = PromptLookupDrafter()
    policy = AdaptivePolicy(profile, lookup, None, k_max=3)
    long_match = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4]   # proposes 5 6 7, evidence 4
    short_match = [20, 21, 22, 30, 31, 32, 20]           # proposes 21 22 30, evidence 1
    for _ in range(12):  # plain rounds; the shadow proposals are judged against what was emitted
        for context, truth in ((long_match, [5, 6, 7, 8]), (short_match, [40, 41])):
            choice = policy.choose(make_state(context))
            policy.observe(choice, 0, 0, np.array(truth[:1]))  # judged by the shadow proposal alone
    pooled = policy.estimates["lookup"].rates[:3]
    assert 0.2 < pooled[0] < 0.8, pooled  # half of all proposals passed: pooled, a coin flip
    assert policy.choose(make_state(long_match)).drafter is lookup
    assert policy.choose(make_state(short_match)).drafter is None
    policy.by_evidence.clear()  # a negative control: without levels every match is rated by the pool
    assert policy.choose(make_state(long_match)).drafter is policy.choose(make_state(short_match)).drafter


def test_shadow_proposals_are_judged_over_later_rounds():
    from edgespec.drafters import Draft
    from edgespec.policy import ShadowScorer

    scorer = ShadowScorer()
    scorer.add("lookup", Draft(np.array([1, 2, 3, 4, 5], dtype=np.int32)), start=10)
    [(name, _, first, passed, failed)] = scorer.observe(10, np.array([1, 2]))  # right so far: still open
    assert (name, first, passed, failed) == ("lookup", 0, 2, False)
    [(_, _, first, passed, failed)] = scorer.observe(12, np.array([3, 9, 9]))  # wrong at its 4th token
    assert (first, passed, failed) == (2, 1, True)
    assert scorer.observe(15, np.array([4, 5])) == []                          # judged: gone
    scorer.add("lookup", Draft(np.array([7, 8], dtype=np.int32)), start=15)
    assert [j[2:] for j in scorer.observe(15, np.array([7, 8, 1]))] == [(0, 2, False)]  # all of it right
    assert scorer.observe(18, np.array([7])) == []


def _copy_with_edits(n_tokens=400, edit_every=8, seed=0):
    """A document, and a copy of it where every `edit_every`-th token is changed: lookup is right
    for edit_every - 2 tokens in a row (the one after an edit has no match to copy from)."""
    rng = np.random.default_rng(seed)
    document = rng.permutation(np.arange(1000, 1000 + n_tokens)).astype(np.int32)
    copy = document.copy()
    copy[::edit_every] = np.arange(5000, 5000 + len(copy[::edit_every]))  # fresh tokens: edits
    return document, copy


def test_auto_learns_long_lookup_drafts_it_has_not_drafted_yet():
    """Lookup right for 6 tokens in a row, on this CPU's cost curve (SmolLM2's): auto must find k >= 4
    within a few rounds, which needs acceptance seen at positions it has not drafted."""
    profile = CostProfile({1: 6.3 * MS, 2: 12.8 * MS, 4: 18 * MS, 8: 28 * MS, 12: 38 * MS}, None, None, 0.02 * MS)
    lookup = PromptLookupDrafter()
    policy = AdaptivePolicy(profile, lookup, None, k_max=8)
    document, truth = _copy_with_edits(edit_every=8)
    context = list(document)
    n_prompt, chosen = len(context), []
    while len(context) - n_prompt < 120:
        state = make_state(context, remaining=1000, n_prompt=n_prompt)
        choice = policy.choose(state)
        at = len(context) - n_prompt
        drafted = choice.draft.tokens if choice.draft is not None else np.zeros(0, dtype=np.int32)
        want = truth[at:at + len(drafted) + 1]
        n_ok = int(np.argmin(np.append(drafted == want[:len(drafted)], False)))
        emitted = np.append(drafted[:n_ok], want[n_ok])  # a greedy target that writes `truth`
        policy.observe(choice, len(drafted), n_ok, emitted)
        context += emitted.tolist()
        chosen.append(choice.k)
    assert max(chosen[:12]) >= 4, chosen
    assert np.median([k for k in chosen[len(chosen) // 2:] if k]) >= 4, chosen


def test_the_first_round_is_plain_so_ttft_matches_plain_decoding():
    policy = AdaptivePolicy(flat_profile(), PromptLookupDrafter(), None, k_max=8)
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    assert policy.choose(make_state(context, n_prompt=len(context))).k == 0     # first round
    policy.estimates["lookup"].assume(0.95)
    assert policy.choose(make_state(context + [8], n_prompt=len(context))).k > 0  # later rounds speculate


def test_the_draft_models_catch_up_is_weighed():
    """A draft model that has not seen a long prompt pays its prefill first: with few tokens left it
    does not pay, with many it does (flat, GPU-like costs)."""

    class Unseen(_Named):
        def unseen(self, context):
            return 2000

    policy = AdaptivePolicy(flat_profile(step=10 * MS, draft=2 * MS), None, Unseen("draft"), k_max=8)
    with_acceptance(policy, "draft", 0.9)
    assert policy.choose(make_state([1, 2, 3], remaining=4)).drafter is None
    assert policy.choose(make_state([1, 2, 3], remaining=2000)).drafter is not None


def test_tokens_the_draft_model_missed_while_others_drafted_are_paid_by_the_round_that_uses_it():
    """300 generated tokens the draft model has not seen (auto used lookup meanwhile) must be caught up
    before it drafts, every time auto comes back to it: that round pays them. The same 300 tokens as
    a never-seen prompt are a one-off investment, spread over the 2000 tokens left."""

    class Behind(_Named):
        def unseen(self, context):
            return 300

    policy = AdaptivePolicy(flat_profile(step=10 * MS, draft=2 * MS), None, Behind("draft"), k_max=8)
    with_acceptance(policy, "draft", 0.9)
    context = list(range(401))  # one token generated: the first round is plain whatever the costs
    assert policy.choose(make_state(context, remaining=2000, n_prompt=400)).drafter is not None  # the prompt
    assert policy.choose(make_state(context, remaining=2000, n_prompt=100)).drafter is None      # a backlog


# --- auto through the engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_like_engine(smollm2_path, smollm2_draft):
    """Auto mode with a flat (GPU-like) profile injected, so it really speculates with both drafters."""
    engine = Engine(load_runtime(smollm2_path), load_runtime(smollm2_draft))
    engine._profile = flat_profile()
    yield engine
    engine.close()


def test_auto_with_a_gpu_like_profile_speculates_losslessly(gpu_like_engine, smollm2_path):
    from test_lossless_greedy import PROMPTS

    reference = load_runtime(smollm2_path)
    chosen: dict[str, int] = {}
    identical = 0
    for prompt in PROMPTS[:10]:
        ids = gpu_like_engine.prompt_tokens(prompt)
        plain = gpu_like_engine.generate_tokens(ids, GenerationConfig(max_tokens=32, temperature=0, mode="ar"))
        gpu_like_engine.history.clear()  # or suffix drafting copies the plain run's answer: this tests the draft model
        auto = gpu_like_engine.generate_tokens(ids, GenerationConfig(max_tokens=32, temperature=0, mode="auto"))
        cmp = compare_greedy(reference, ids, plain.tokens, auto.tokens)
        assert cmp.near_tie, (prompt, cmp)
        identical += cmp.identical
        for key, n in auto.stats.chosen.items():
            chosen[key.split(":")[0]] = chosen.get(key.split(":")[0], 0) + n
    assert chosen.get("draft", 0) > 0, chosen          # the draft model was used
    assert identical >= 9
    reference.close()


def test_auto_measures_a_cost_curve_from_plain_to_k_16(smollm2_path):
    """What it checks: auto on this CPU measures its pass costs at 1 .. 17 rows. (It was named "never predicts
    a loss", which it cannot check; test_never_predicts_below_plain_decoding checks the prediction.)"""
    with Engine(load_runtime(smollm2_path)) as engine:
        result = engine.generate("Write a limerick.", max_tokens=16, temperature=0, mode="auto")
        profile = engine.cost_profile()
        n_prompt = len(engine.prompt_tokens("Write a limerick."))
    assert result.stats.mode == "auto" and set(profile.verify_s) >= {1, 2, 4, 8, 17}  # the curve spans k = 0 .. 16
    assert all(v > 0 for v in profile.verify_s.values())
    # and again over a long prompt's KV, where the same passes cost more (SmolLM2's 17 rows: ~2x over 512)
    assert profile.deep_tokens == DEEP_CONTEXT_TOKENS and set(profile.verify_deep_s) >= {1, 2, 4, 8, 17}
    assert profile.verify_deep_s[17] > profile.verify_s[17]
    # each pass's depth is in the stats: the tokens committed before it (the prompt's, then one more a pass)
    assert sum(result.stats.held_by_rows.values()) >= n_prompt * result.stats.rounds


def test_a_context_too_small_for_the_deep_curve_leaves_the_profile_depth_free(smollm2_path):
    from edgespec.machine.profile import measure_target_costs

    target = load_runtime(smollm2_path, n_ctx=512)
    profile = measure_target_costs(target, repeats=1, budget_s=0.3)
    target.close()
    assert profile.deep_tokens == 0 and profile.verify_deep_s == {}
    assert profile.verify(17, 2000) == profile.verify(17)


def test_a_pass_is_priced_at_the_tokens_it_follows():
    """Two measured depths price any depth linearly (attention grows with what the KV holds: a 17-row
    SmolLM2 pass measured 140 / 289 / 469 / 827 ms over 64 / 512 / 1024 / 2048 tokens); more held never
    costs less, and the deep curve survives the profile's cache format."""
    profile = CostProfile({1: 10 * MS, 2: 14 * MS, 17: 75 * MS}, verify_deep_s={1: 15 * MS, 17: 150 * MS},
                          deep_tokens=512)
    assert profile.verify(17) == profile.verify(17, CONTEXT_TOKENS) == 75 * MS
    assert profile.verify(17, 512) == pytest.approx(150 * MS)
    assert profile.verify(17, (CONTEXT_TOKENS + 512) // 2) == pytest.approx(112.5 * MS)
    assert profile.verify(1, 960) == pytest.approx(20 * MS)  # extrapolated past the deep curve
    assert profile.verify(9, 512) == pytest.approx(82.5 * MS)  # each curve interpolated over rows first
    assert CostProfile.from_dict(profile.to_dict()) == profile
    cheaper_deep = CostProfile({1: 10 * MS}, verify_deep_s={1: 9 * MS}, deep_tokens=512)
    assert cheaper_deep.verify(1, 2000) == 10 * MS  # noise in the deep timing never prices depth below zero


def test_auto_stops_drafting_where_the_prompt_makes_passes_dear():
    """The same acceptance pays over a short prompt and not over a long one: over 64 held tokens each
    extra row costs 0.45 of a step, over 512 it costs 0.9 (SmolLM2 with flash attention measures about
    this). A 1-token lookup draft accepted 60 % of the time: 1.6 tokens for 1.45 steps, then 1.9."""
    shallow = {n: 10 * MS * (1 + 0.45 * (n - 1)) for n in (1, 2, 4, 8, 17)}
    deep = {n: 10 * MS * (1 + 0.9 * (n - 1)) for n in (1, 2, 4, 8, 17)}
    profile = CostProfile(shallow, lookup_s=0.001 * MS, verify_deep_s=deep, deep_tokens=512)
    pattern = [5, 6, 7, 8, 9, 5, 6, 7]  # a repeat: lookup proposes
    decisions = {}
    for held in (CONTEXT_TOKENS, 600):
        policy = AdaptivePolicy(profile, PromptLookupDrafter(), None, k_max=4)
        policy.estimates["lookup"].assume(0.6)
        context = list(range(1000, 1000 + held - len(pattern))) + pattern
        decisions[held] = policy.choose(make_state(context))
    assert decisions[CONTEXT_TOKENS].drafter is not None and decisions[CONTEXT_TOKENS].k == 1
    assert decisions[600].drafter is None  # plain decoding: the pass's extra row costs what it brings


def test_timings_a_generation_learnt_carry_over_as_its_depth_is_repriced():
    """What the generation's own passes said about the profile (here: every pass 1.5x its price) is kept
    as a ratio when the depth reached re-prices the curve, not dropped nor taken as seconds."""
    from edgespec.policy import DEPTH_STEP, NO_DRAFT

    profile = CostProfile({1: 10 * MS, 2: 14 * MS, 17: 75 * MS}, verify_deep_s={1: 15 * MS, 2: 24 * MS, 17: 150 * MS},
                          deep_tokens=512, key={"measured": "here"})
    policy = AdaptivePolicy(profile, PromptLookupDrafter(), None, k_max=4)
    for _ in range(3):
        policy.observe(NO_DRAFT, 0, 0, np.array([1]), pass_s=1.5 * profile.verify(1))
    assert policy._verify[0] == pytest.approx(15 * MS)
    policy.choose(make_state(list(range(CONTEXT_TOKENS + DEPTH_STEP - 1))))  # moved too little: not re-priced
    assert policy._verify[0] == pytest.approx(15 * MS)
    policy.choose(make_state(list(range(512))))
    assert policy._verify[0] == pytest.approx(1.5 * 15 * MS)
    assert policy._verify[1] == pytest.approx(1.5 * 24 * MS)  # unseen sizes follow the seen ones' ratio


def test_a_burst_of_load_while_profiling_stays_out_of_the_cached_curve(smollm2_path):
    """A burst of other load (here a 0.2 s stall on 1-row passes, as a busy machine gives) must not
    reach the profile, which is cached for good: with one timed run per size it priced plain decoding
    at the burst's cost. Coarse sizes take every repeat (the fastest stands); a curve where a larger
    pass is cheaper is timed again. Both paths are exercised: bursts on two of three timed runs, and
    on the only one (repeats=1, where only the re-timing of a bent curve can mend it)."""
    import time

    from edgespec.machine.profile import measure_target_costs

    target = load_runtime(smollm2_path, n_ctx=512)
    decode = target.decode
    for repeats, stalled in ((3, 2), (1, 1)):
        calls = {"one_row": 0}

        def bursty(tokens, *args, **kwargs):
            if len(tokens) == 1:  # the first 1-row pass warms up untimed; the next `stalled` stall
                calls["one_row"] += 1
                if 1 < calls["one_row"] <= 1 + stalled:
                    time.sleep(0.2)
            return decode(tokens, *args, **kwargs)

        target.decode = bursty
        profile = measure_target_costs(target, repeats=repeats, budget_s=0.5)
        assert calls["one_row"] > 1 + stalled  # the stalled passes were timed, then clean ones
        assert profile.verify_s[1] < 0.1 and profile.verify_s[1] <= profile.verify_s[2], profile.verify_s
    target.close()


def test_rows_other_requests_add_to_the_pass_are_weighed():
    """Parallel slots: a pass that is flat up to 8 rows and then costs a step per row. Alone, a long
    draft rides the flat part; behind 8 rows of other requests every row of this one costs a full step,
    so the same acceptance no longer pays and the policy decodes plainly."""
    sizes = (1, 2, 3, 4, 6, 8, 10, 12, 16)
    profile = CostProfile({n: 10 * MS + max(0, n - 8) * 5 * MS for n in sizes}, 1 * MS, 1.2 * MS, 0.05 * MS)
    draft = _Named("draft")
    policy = with_acceptance(AdaptivePolicy(profile, None, draft, k_max=6), "draft", 0.7)
    alone = policy.choose(make_state([1, 2, 3]))
    assert alone.drafter is draft and alone.k >= 3
    policy.rows_besides = 8
    assert policy.plain_speed() == pytest.approx(1 / (5 * MS))  # one more row past the flat part
    behind = policy.choose(make_state([1, 2, 3]))
    assert behind.k == 0 and behind.drafter is None


def test_auto_corrects_a_profile_that_a_busy_machine_bent():
    """A profile measured under load (a 2-row pass 'cheaper' than one row) is mended by the passes
    the generation times itself: once the real cost of k = 1 is seen, auto stops paying for it."""
    from edgespec.policy import NO_DRAFT

    bent = CostProfile({1: 40 * MS, 2: 30 * MS, 4: 100 * MS, 8: 80 * MS, 17: 300 * MS}, None, None, 0.0,
                       key={"measured": "on a busy machine"})  # measured profiles (with a key) are corrected
    policy = AdaptivePolicy(bent, PromptLookupDrafter(), None, k_max=8)
    assert np.all(np.diff(policy._verify) >= 0)  # never cheaper for more rows
    policy.estimates["lookup"].assume(0.6)

    def true_cost(rows):  # this CPU: each extra row costs 0.8 of a step
        return 10 * MS * (1 + 0.8 * (rows - 1))

    for _ in range(2):  # the first rounds are plain (the first token; no match to copy yet)
        policy.observe(NO_DRAFT, 0, 0, np.array([1]), pass_s=true_cost(1))
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    chosen = []
    for _ in range(8):
        choice = policy.choose(make_state(context))
        policy.observe(choice, choice.k, 0, np.array([99]), pass_s=true_cost(choice.k + 1))
        policy.estimates["lookup"].assume(0.6)  # acceptance stays 0.6
        chosen.append(choice.k)
    assert chosen[0] > 0 and chosen[-3:] == [0, 0, 0], chosen  # tried on the bent curve, then corrected


# --- what one generation's auto leaves the next -----------------------------------------------

def test_a_policy_starts_from_a_record_as_a_copy():
    """A policy that saw lookup pass after 4-token matches and fail after 1-token ones leaves a record;
    one started from it skips the 1-token match at once and expects more of the 4-token one, where a
    fresh policy, on a curve where the priors make any copy worth a try (2 rows cost 1.3 steps),
    drafts both on the priors. The record is a copy: the first policy learning more changes nothing in the second."""
    from edgespec.policy import AcceptanceRecord

    profile = CostProfile({1: 10 * MS, 2: 13 * MS, 3: 16 * MS, 4: 19 * MS}, None, None, 0.0)
    lookup = PromptLookupDrafter()
    long_match, short_match = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4], [20, 21, 22, 30, 31, 32, 20]
    learner = AdaptivePolicy(profile, lookup, None, k_max=3)
    for _ in range(12):
        for context, truth in ((long_match, 5), (short_match, 40)):
            learner.observe(learner.choose(make_state(context)), 0, 0, np.array([truth]))
    record = learner.record([7, 7, 7])
    assert isinstance(record, AcceptanceRecord) and {("lookup", 1), ("lookup", 4)} <= record.by_evidence.keys()

    fresh, started = AdaptivePolicy(profile, lookup, None, k_max=3), AdaptivePolicy(profile, lookup, None, k_max=3)
    started.start_from(record)
    assert fresh.choose(make_state(short_match)).drafter is lookup    # the priors: worth a try
    assert started.choose(make_state(short_match)).drafter is None   # the record: it fails here
    sure, unsure = started.choose(make_state(long_match)), fresh.choose(make_state(long_match))
    assert sure.drafter is lookup and sure.predicted_speed > unsure.predicted_speed  # a 4-token match passes
    before = started.by_evidence["lookup", 1].trials.copy()
    learner.observe(learner.choose(make_state(short_match)), 0, 0, np.array([41]))  # the learner goes on alone
    assert np.array_equal(started.by_evidence["lookup", 1].trials, before)

    longer = AdaptivePolicy(linear_profile(), lookup, None, k_max=6)  # another k_max: the positions both have
    assert longer.k_max == 6
    longer.start_from(record)
    assert np.array_equal(longer.estimates["lookup"].trials[:3], record.estimates["lookup"].trials[:3])
    assert np.array_equal(longer.estimates["lookup"].trials[3:], fresh.estimates["lookup"].trials[:1].repeat(3))
    without = AdaptivePolicy(profile, None, None, k_max=3)  # a drafter it has not: left out
    without.start_from(record)
    assert "lookup" not in without.estimates and not without.by_evidence


def test_a_record_is_kin_to_prompts_that_share_more_than_the_template_gives_them():
    from edgespec.policy import AcceptanceRecord

    record = AcceptanceRecord.of(AdaptivePolicy(linear_profile()), list(range(40)))
    kin = AcceptanceRecord.KIN_TOKENS
    assert record.kin(list(range(30)) + [99], template_shares=20)               # 10 shared past the template's
    assert record.kin(list(range(20 + kin)), template_shares=20)
    assert not record.kin(list(range(20 + kin - 1)) + [99], template_shares=20)  # one short
    assert not record.kin(list(range(20 + kin - 1)), template_shares=20)          # a prompt too short to tell
    assert not record.kin([5] + list(range(1, 40)), template_shares=20)           # differs inside it


def test_the_engine_carries_autos_record_to_its_next_kin_generation(smollm2_path):
    """Through the engine: an auto generation leaves its record (a plain one leaves it as it was); the
    next auto generation starts from it if its prompt is kin (the same instructions, another
    question), from the priors if not."""
    with Engine(load_runtime(smollm2_path, n_ctx=1024, n_threads=1)) as engine:
        engine._profile = linear_profile()
        instructions = "Reply with the list of numbers the user gives, each once, in order, comma separated. "

        def ask(question):
            return engine.prompt_tokens([{"role": "system", "content": instructions},
                                         {"role": "user", "content": question}])

        first, kin, other = ask("1 2 3 4, 1 2 3 4, 1 2"), ask("5 6 7"), engine.prompt_tokens("Name a colour.")
        assert engine.acceptance is None
        engine.generate_tokens(first, GenerationConfig(max_tokens=16, temperature=0, mode="auto"))
        record = engine.acceptance
        assert record is not None and record.estimates.keys() == {"lookup", "suffix"}
        assert np.array_equal(record.prompt, first)
        engine.generate_tokens(other, GenerationConfig(max_tokens=4, temperature=0, mode="ar"))
        assert engine.acceptance is record
        assert record.kin(kin, engine.template_shares(kin)) and not record.kin(other, engine.template_shares(other))
        # the template's own share: its default system prompt where a request has none, its header where one has
        assert engine.template_shares(other) > engine.template_shares(kin) > 0
        _, started = engine.policy_for(GenerationConfig(mode="auto"), kin)
        _, fresh = engine.policy_for(GenerationConfig(mode="auto"), other)
        assert np.array_equal(started.calibration.trials, record.calibration.trials)
        assert np.array_equal(started.estimates["lookup"].hits, record.estimates["lookup"].hits)
        assert not np.array_equal(fresh.calibration.trials, record.calibration.trials)
