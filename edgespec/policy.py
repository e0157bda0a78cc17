"""Policies decide, each round, which drafter proposes and how many tokens (k = 0: plain decoding).

The adaptive policy maximises expected emitted tokens per second from a measured cost profile
and online acceptance estimates. For a chain of k drafted tokens with per-position acceptance
rates a_1..a_k (each conditional on the previous ones passing), one round emits on average

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k        tokens
    T(k) = draft_cost(k) + verify(k + 1)                 seconds

and plain decoding is E(0) / T(0) = 1 / verify(1). The policy picks the (drafter, k) with the best
E/T, so it never picks a setting it predicts to be slower than plain decoding.

With parallel slots (edgespec.serve.slots) other requests put R rows into the same pass; what this
request's k + 1 rows cost is then the marginal verify(R + k + 1) - verify(R) (`rows_besides` = R).
Tokens a constraint forces (state.forced = f) lead the pass whatever is chosen and the target
accepts them (the grammar admits them alone, or its tokenizer spells them as the model does), so a
round with them emits f + E(k) tokens for verify(f + k + 1): every choice, plain included, gets them.

Where the rates come from: the model-free drafters (DrafterKind.COPIES: prompt lookup, suffix) cost
nearly nothing to ask, so every round asks each of them for its longest proposal, used or not, and
scores it against the tokens later rounds commit (ShadowScorer). Their estimates therefore cover
every position up to the longest k, whatever was drafted; a proposal that states its evidence (prompt
lookup: the length of the match it copies after) is rated by that level's record, shrunk toward the
drafter's pooled one (EvidenceEstimate). A draft model (DrafterKind.MODEL) is
scored on what it drafted. A drafter that states a confidence per token (suffix) is rated by that
confidence as calibrated against what the target accepted (ConfidenceCalibration). Where two
proposals differ, at most one can pass: their rates at the first token they differ on are made to
sum to at most 1 (`exclusive`).

The policy names no drafter: it weighs the drafters it is given by the kind, ask cost and traits
their rows in edgespec.drafters.table declare.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Collection, Protocol, Sequence

import numpy as np

from edgespec.drafters.table import BY_NAME, DRAFTERS, spec_for
from edgespec.drafters import Draft, Drafter, DrafterKind
from edgespec.errors import EdgespecError
from edgespec.machine.profile import CONTEXT_TOKENS

if TYPE_CHECKING:
    from edgespec.state import SpeculativeState
    from edgespec.machine.profile import CostProfile

MODES = ("auto", "ar") + tuple(spec.name for spec in DRAFTERS)  # ar: plain decoding; the rest name a drafter
DEFAULT_DRAFT_MAX = {**{spec.name: spec.default_k for spec in DRAFTERS}, "auto": 16}
# A speculative choice must be predicted this much faster than plain decoding. The acceptance
# estimates follow the last few rounds, so the option that looks best is biased upward (the winner's
# curse): break-even choices, prompt lookup on chat text above all, measured 2-4 % slower than plain.
SPECULATION_MARGIN = 0.05
# Passes are re-priced at the KV depth reached once it moves this many tokens: on SmolLM2 a 17-row
# pass costs ~0.35 ms more per 1000 held tokens, so 32 moves a price by under 1 %.
DEPTH_STEP = 32

# gate(n_drafted, confidence of the last token, product of confidences) -> keep drafting?
Gate = Callable[[int, float, float], bool]
# branch(tree nodes so far, probability of the draft's second choice, chance to reach here) -> add it?
Branch = Callable[[int, float, float], bool]


@dataclass(frozen=True)
class Choice:
    drafter: Drafter | None
    k: int
    draft: Draft | None = None   # a proposal already in hand (prompt lookup costs nothing to ask)
    gate: Gate | None = None     # confidence gating: stop drafting early
    branch: Branch | None = None  # token trees: add the draft's second choice as a sibling
    predicted_speed: float = 0.0  # tokens/s the policy expects from this choice


NO_DRAFT = Choice(None, 0)


class Policy(Protocol):
    rows_besides: int  # rows other requests add to the same target pass (parallel slots); a policy may weigh them

    @property
    def drafters(self) -> list[Drafter]:
        """Every drafter this policy may pick."""

    @property
    def prefilled(self) -> list[Drafter]:
        """The drafters the engine prepares at prefill; the others catch up when first used."""

    def choose(self, state: "SpeculativeState") -> Choice: ...

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: Sequence[int], *,
                pass_s: float | None = None) -> None:
        """What the round emitted; `pass_s`: how long its target pass over n_drafted + 1 rows took."""


class FixedPolicy:
    """The same drafter and draft length every round; no drafter means plain decoding."""

    def __init__(self, drafter: Drafter | None, k: int):
        self.drafter = drafter if k > 0 else None
        self.k = k if drafter is not None else 0
        self.rows_besides = 0  # a fixed draft length does not weigh them

    @property
    def drafters(self) -> list[Drafter]:
        return [self.drafter] if self.drafter else []

    prefilled = drafters

    def choose(self, state: "SpeculativeState") -> Choice:
        # The verify pass always emits one token of its own, so drafting past remaining - 1 is waste.
        k = min(self.k, state.remaining - 1)
        return Choice(self.drafter, k) if k > 0 else NO_DRAFT

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: Sequence[int], *,
                pass_s: float | None = None) -> None:
        pass


class DecayedRates:
    """hits / trials per bin, exponentially decayed so the rates follow the text; a weak prior
    keeps a bin that has seen nothing from looking perfect or hopeless."""

    def __init__(self, prior: np.ndarray, weight: float, decay: float):
        # hits and trials are rows of one array, so a decay is one numpy call (see the note on
        # AdaptivePolicy.chain_speeds: this runs every round, right after a target pass)
        self.counts = np.stack([prior * weight, np.full(len(prior), float(weight))])
        self.hits, self.trials = self.counts
        self.decay = decay
        # What auto reads every round is computed from hits and trials once per change (`derived`):
        # they change only in rounds that judge this drafter. Auto's per-round work is what it loses
        # to plain decoding where a step is short (SmolLM2 on the EPYC: 3 % of a 5.9 ms step); this and
        # OnlineCosts' lists cut the policy's rounds by about 7 % (16 us on the Xeon), the asks of
        # lookup and suffix being most of the rest.
        self._derived: dict = {}

    def changed(self) -> None:
        """Say that hits or trials were changed (the methods below say it themselves)."""
        self._derived.clear()

    def derived(self, name: str, compute) -> np.ndarray:
        """compute(), kept (read-only) until hits or trials change."""
        value = self._derived.get(name)
        if value is None:
            value = self._derived[name] = compute()
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        return value

    def decay_step(self) -> None:
        self.counts *= self.decay
        self.changed()


class AcceptanceEstimate(DecayedRates):
    """Per-position acceptance rates of one drafter. Position i is counted only in rounds that
    reached it (every earlier draft token accepted)."""

    def __init__(self, k_max: int, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9):
        super().__init__(np.full(k_max, prior), weight, decay)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """One round that drafted n_drafted tokens, of which the target accepted n_accepted."""
        if n_drafted:
            self.decay_step()
            self.record(0, n_accepted, n_accepted < n_drafted)

    def record(self, first: int, n_passed: int, failed: bool) -> None:
        """Positions first .. first + n_passed - 1 passed and, if `failed`, the one after did not
        (every position before `first` passed, judged in earlier rounds)."""
        stop = min(first + n_passed + int(failed), len(self.trials))
        hits, trials = self.hits, self.trials
        for i in range(first, stop):  # a position or two a round: a loop beats two slices after a pass
            trials[i] += 1.0
            if i < first + n_passed:
                hits[i] += 1.0
        self.changed()

    def assume(self, rates) -> None:
        """Set the rates outright at the weight of evidence already held (tests, what-if predictions)."""
        self.hits[:] = np.asarray(rates) * self.trials
        self.changed()

    @property
    def rates(self) -> np.ndarray:
        return self.derived("rates", lambda: self.hits / self.trials)

    def expected_emitted(self) -> np.ndarray:
        """E(k) for k = 0 .. k_max."""
        return self.derived("emitted", lambda: 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.rates))]))

    def all_pass(self) -> np.ndarray:
        """The chance that all k drafted tokens pass, for k = 0 .. k_max (0 for k = 0: nothing drafted)."""
        return self.derived("all_pass", lambda: np.concatenate([[0.0], np.cumprod(self.rates)]))


class EvidenceEstimate(AcceptanceEstimate):
    """Per-position acceptance of one drafter's proposals at one level of evidence (Draft.evidence),
    shrunk toward the drafter's pooled estimate: a level seen a few times follows the pool, one seen
    often follows its own record. On the race's chat and code text prompt lookup after a 1-token
    match failed 3 times in 4 while the pool said a copy was worth drafting; these are the drafts
    that made auto slower than plain there."""

    PRIOR_WEIGHT = 2.0  # trials of the pooled rate a level starts from (the pool's own prior weight)

    def __init__(self, k_max: int, decay: float = 0.9):
        super().__init__(k_max, prior=0.0, weight=0.0, decay=decay)

    def shrunk(self, pooled: np.ndarray) -> np.ndarray:
        """`pooled`: the pool's rates (its `rates`, itself kept until the pool changes)."""
        w = self.PRIOR_WEIGHT
        if self._derived.get("pooled") is not pooled:
            self._derived.clear()
            self._derived["pooled"] = pooled
        return self.derived("shrunk", lambda: (self.hits[:len(pooled)] + w * pooled) / (self.trials[:len(pooled)] + w))


class ConfidenceCalibration(DecayedRates):
    """Acceptance as a function of a drafter's own confidence, per confidence bin, starting from
    half the bin's confidence: a drafter is believed once the target has confirmed it, not on its word.

    Where a pass of many rows costs many steps (a CPU: 17 rows of Qwen2.5-Coder-1.5B cost 11 single
    steps at two threads) a long draft taken on a drafter's word loses far more when wrong than it
    gains when right: in the Qwen race a 16-token suffix draft on a chat prompt, taken on the
    drafter's word (the old prior), kept at most 2 of its tokens. Confirmation is free, since every
    round's proposals are scored whether drafted or not (ShadowScorer): a real copy earns trust
    within a few tokens.
    """

    EDGES = np.array([0.2, 0.4, 0.6, 0.8, 0.95])
    _EDGES = EDGES.tolist()

    def __init__(self, weight: float = 2.0, decay: float = 0.95):
        bin_confidence = np.array([0.1, 0.3, 0.5, 0.7, 0.875, 0.975])
        super().__init__(0.5 * bin_confidence, weight, decay)

    def rates(self, confidence: np.ndarray) -> np.ndarray:
        """The rate of each token's bin, one standard error below its estimate: a long chain priced at
        the product of per-token rates needs many confirmations behind them, not a handful (the Qwen
        race's code prompts: a bin confirmed ~4 times priced an 11-token draft at 1.12x plain; it kept 3)."""
        return self.derived("lower", self._lower)[np.searchsorted(self.EDGES, confidence, side="right")]

    def _lower(self) -> np.ndarray:
        lower = []  # six bins, recomputed most rounds: Python floats (see DecayedRates)
        for hits, trials in zip(self.hits.tolist(), self.trials.tolist()):
            p = hits / trials
            lower.append(max(p - math.sqrt(p * (1 - p) / (trials + 1)), 0.0))  # <= p <= 1 already
        return np.array(lower)

    def record(self, confidence: np.ndarray, n_passed: int, failed: bool) -> None:
        """Tokens with these confidences: the first n_passed passed and, if `failed`, the next did not."""
        hits, trials = self.hits, self.trials
        for i, c in enumerate(confidence[:n_passed + int(failed)].tolist()):  # a token or two a round
            b = bisect_right(self._EDGES, c)
            trials[b] += 1.0
            if i < n_passed:
                hits[b] += 1.0
        self.changed()


class ShadowScorer:
    """Scores whole proposals against the tokens committed after them, position by position, over as
    many rounds as it takes.

    A proposal made when `start` tokens were committed predicts the tokens at start, start + 1, ...;
    each round judges the positions its committed tokens cover, until one differs (under greedy that
    is exactly what verification would have done; under sampling a one-hot token x passes with
    probability p(x), the chance the committed token is x) or the proposal is used up.
    """

    OPEN_PER_DRAFTER = 4  # proposals followed at once: neighbours mostly copy the same source, so a
    #                       few give nearly all the information at a few array compares per round

    def __init__(self):
        self._pending: list[list] = []  # [drafter name, draft, position of its first token, judged so far]

    def add(self, name: str, draft: Draft, start: int) -> None:
        if len(draft) and sum(entry[0] == name for entry in self._pending) < self.OPEN_PER_DRAFTER:
            self._pending.append([name, draft, start, 0])

    def observe(self, start: int, committed: Sequence[int]) -> list[tuple[str, Draft, int, int, bool]]:
        """`committed` are the tokens now at positions start, start + 1, ...; returns, per proposal
        they judge, (drafter name, draft, index of its first newly judged token, how many of them
        matched, whether the next one failed)."""
        judged, still = [], []
        # a few tokens against a few proposals: lists beat array calls
        committed = committed.tolist() if isinstance(committed, np.ndarray) else list(committed)
        for entry in self._pending:
            name, draft, first, done = entry
            if start - first != done:  # not in step (a gap in what was observed): cannot be judged
                continue
            predicted = draft.tokens[done:done + len(committed)].tolist()
            if not predicted:
                continue
            n_same = next((i for i, (a, b) in enumerate(zip(predicted, committed)) if a != b), len(predicted))
            failed = n_same < len(predicted)
            judged.append((name, draft, done, n_same, failed))
            entry[3] = done + len(predicted)
            if not failed and entry[3] < len(draft):
                still.append(entry)
        self._pending = still
        return judged


@dataclass(frozen=True)
class Rates:
    """A copy of one DecayedRates' counts."""

    hits: np.ndarray
    trials: np.ndarray

    @classmethod
    def of(cls, rates: DecayedRates) -> "Rates":
        return cls(rates.hits.copy(), rates.trials.copy())

    def copy_into(self, rates: DecayedRates) -> None:
        """Into `rates`, the bins both have."""
        n = min(len(self.trials), len(rates.trials))
        rates.hits[:n], rates.trials[:n] = self.hits[:n], self.trials[:n]
        rates.changed()


@dataclass(frozen=True)
class AcceptanceRecord:
    """Auto's acceptance estimates at the end of a generation (AdaptivePolicy.record), which the
    engine's next generation starts from (Engine.acceptance) if it answers the same kind of prompt.

    A generation that starts from the priors spends its first rounds finding out what the last one
    knew, and a short answer (a tool call, an extraction) ends before it has: apps send the same
    instructions, schema or tools again and again, with a new document or question. Between prompts
    of different kinds the record misleads: trust in lookup learned on a grounded edit costs failed
    passes on an extraction after it. So it is carried only between kin (`kin`): prompts that share
    at least KIN_TOKENS tokens past what any two prompts share through the chat template (its header,
    and the default system prompt it adds to a request without one: Engine.template_shares).

    In the policy replay (bench/policy_replay.py: 28 prompts, each starting from the record of the
    one before; both pairs, two orders, two machines' prices) structured requests ran 2.6-4.3 %
    faster priced, overall 0.9-1.5 %, the other classes unchanged (no prompt of theirs is kin to the
    one before); single prompts 0.89x-1.26x. Carried between any two prompts, the worst prompt fell
    from 0.975 to 0.87-0.94x plain (0.77x at the EPYC's prices).
    Memory: a few arrays of k_max floats per drafter and evidence level, and the prompt's head."""

    KIN_TOKENS = 8
    HEAD = 1024  # prompt tokens kept: enough for any instructions two requests share

    estimates: dict[str, Rates]
    by_evidence: dict[tuple[str, int], Rates]
    calibration: Rates
    prompt: np.ndarray  # the head of the prompt the generation answered

    @classmethod
    def of(cls, policy: "AdaptivePolicy", prompt: Sequence[int] = ()) -> "AcceptanceRecord":
        return cls({name: Rates.of(e) for name, e in policy.estimates.items()},
                   {key: Rates.of(e) for key, e in policy.by_evidence.items()}, Rates.of(policy.calibration),
                   np.asarray(prompt[:cls.HEAD], dtype=np.int64))

    def kin(self, prompt: Sequence[int], template_shares: int) -> bool:
        """Whether `prompt` starts with at least KIN_TOKENS more of this record's prompt than the
        `template_shares` tokens any two prompts share through the chat template alone."""
        n = template_shares + self.KIN_TOKENS
        if len(prompt) < n or len(self.prompt) < n:
            return False
        return bool(np.array_equal(self.prompt[:n], np.asarray(prompt[:n])))


class OnlineCosts:
    """verify(n) as this generation's own passes measure it, over the profile's curve as a prior.

    A profile is measured once, in seconds, and a busy machine bends it (measured here: a 2-row pass
    "cheaper" than a 1-row one). Every round times its pass, so the sizes auto uses are soon known
    as they are now; sizes not seen yet follow the profile, scaled by how the seen ones compare to
    it. A pass never costs less for more rows, so the curve is kept non-decreasing. What is learnt is
    each size's ratio to the prior, so a prior that moves (the profile's price at the KV depth the
    generation has reached) carries what the timings said.
    """

    ALPHA = 0.2        # weight of the newest timing of a size
    MIN_SAMPLES = 2    # timings of a size before they replace the profile's figure

    def __init__(self, prior: np.ndarray):
        # Python floats, not arrays: <= 17 of them, updated and read every round between two target
        # passes, where each numpy call costs more than the arithmetic (and main-thread CPU slows the
        # next multi-threaded pass, bench/auto_idle.py)
        self.reprice(prior)
        self.ratio = [1.0] * len(prior)
        self.count = [0] * len(prior)

    def reprice(self, prior: np.ndarray) -> None:
        """The profile's curve at a new depth."""
        self.prior = np.maximum.accumulate(prior).tolist()

    def observe(self, n_rows: int, seconds: float) -> None:
        i = n_rows - 1
        ratio = seconds / self.prior[i]
        self.ratio[i] = ratio if self.count[i] == 0 else self.ratio[i] + self.ALPHA * (ratio - self.ratio[i])
        self.count[i] += 1

    def curve(self) -> list[float]:
        seen = [c >= self.MIN_SAMPLES for c in self.count]
        ratios = sorted(r for r, s in zip(self.ratio, seen) if s)
        n = len(ratios)  # their median, as statistics.median, without its cost every round
        scale = (ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2) if n else 1.0
        return list(accumulate((p * (r if s else scale) for r, p, s in zip(self.ratio, self.prior, seen)), max))


class AdaptivePolicy:
    """Speculate only when it pays, by the measured costs and the acceptance seen so far."""

    def __init__(self, profile: "CostProfile", *drafters: Drafter | None, k_max: int = DEFAULT_DRAFT_MAX["auto"],
                 max_branches: int = 1, suffix: Drafter | None = None):
        """`drafters`: those auto may pick (None: not available), weighed in this order within a kind.
        `suffix` is one more, for callers written when the policy took each drafter by name."""
        self.profile = profile
        self._drafters = [d for d in (*drafters, suffix) if d is not None]
        self.specs = {d.name: spec_for(d.name) for d in self._drafters}
        self._copies, self._models = (self._of_kind(kind) for kind in (DrafterKind.COPIES, DrafterKind.MODEL))
        self.k_max = max(1, min(k_max, profile.max_batch - 1))
        self.max_branches = max_branches  # sequences the target can verify at once (1 = chains only)
        self.estimates = {d.name: AcceptanceEstimate(self.k_max) for d in self.drafters}
        self.by_evidence: dict[tuple[str, int], EvidenceEstimate] = {}  # (drafter, Draft.evidence) -> its own rates
        # verify(n) for n = 1 .. k_max + 1, read every round: the profile's at the KV depth reached
        # (re-priced every DEPTH_STEP tokens), corrected by the passes this generation times
        # (OnlineCosts), computed once per change rather than per round.
        self.held = CONTEXT_TOKENS
        self.costs = OnlineCosts(self._profile_curve())
        self._verify = self.costs.curve()
        # confidence -> acceptance, shared by the drafters that state a confidence (spec.confident: suffix)
        self.calibration = ConfidenceCalibration()
        self.shadows = ShadowScorer()
        # (position, drafter name, tokens) of every model-free proposal asked, when a caller sets a list
        # (the bench's oracle, edgespec.bench.oracle); None, the default, keeps nothing
        self.shadow_log: list[tuple[int, str, np.ndarray]] | None = None
        self._round_start = 0
        self.rows_besides = 0  # rows other requests add to the same target pass (parallel slots)
        self._forced = 0       # this round's grammar-forced rows, in the pass whatever is chosen
        self._max_batch = profile.max_batch
        self._batch_s: dict[int, tuple[float, float]] = {}  # b -> verify(b), b * verify(1): draft_prefill_s's

    @property
    def drafters(self) -> list[Drafter]:
        return list(self._drafters)

    def record(self, prompt: Sequence[int] = ()) -> "AcceptanceRecord":
        """What this generation learned of its drafters' acceptance, for the next one to start from
        where it answers the same kind of prompt (`prompt`: the one this generation answered)."""
        return AcceptanceRecord.of(self, prompt)

    def start_from(self, record: "AcceptanceRecord") -> None:
        """Start from an earlier generation's acceptance record instead of the priors (a drafter this
        policy has not, or positions past its k_max, are left out)."""
        for name, rates in record.estimates.items():
            if name in self.estimates:
                rates.copy_into(self.estimates[name])
        for key, rates in record.by_evidence.items():
            if key[0] in self.estimates:
                rates.copy_into(self.by_evidence.setdefault(key, EvidenceEstimate(self.k_max)))
        record.calibration.copy_into(self.calibration)

    def _of_kind(self, kind: DrafterKind) -> list[Drafter]:
        return [d for d in self._drafters if self.specs[d.name].kind is kind]

    @property
    def prefilled(self) -> list[Drafter]:
        """None: the model-free drafters need no prefill, and the draft model is prefilled only once
        it first pays, so a generation that ends up with lookup or nothing starts as fast as plain."""
        return []

    def _profile_curve(self) -> np.ndarray:
        return np.array([self.profile.verify(n, self.held) for n in range(1, self.k_max + 2)])

    def _reach(self, held: int) -> None:
        """Price passes over the `held` tokens this round's pass follows, where the profile says depth
        matters (a pass's attention grows with them) and they moved DEPTH_STEP tokens since last priced."""
        if self.profile.deep_tokens and abs(held - self.held) >= DEPTH_STEP:
            self.held = held
            self.costs.reprice(self._profile_curve())
            self._verify = self.costs.curve()

    def _pass(self, n: int) -> float:
        """What n rows of this request (after its forced ones) add to the target pass:
        verify(R + f + n) - verify(R)."""
        r = self.rows_besides
        n += self._forced
        verify = self.profile.verify
        return verify(r + n, self.held) - verify(r, self.held) if r else verify(n, self.held)

    def plain_speed(self) -> float:
        return (1.0 + self._forced) / self._verify_costs(0)[0]

    def _verify_costs(self, k: int) -> list[float]:
        """The pass's cost of n = 1 .. k + 1 rows of this request: verify(n) alone (computed once), the
        marginal verify(R + n) - verify(R) beside R rows of other requests."""
        costs = self._verify[:k + 1] if not self.rows_besides and not self._forced else \
            [self._pass(n) for n in range(1, k + 2)]
        # a recurrent model pays its rollback on every drafting round (priced as if a draft is rejected)
        rollback = self.profile.rollback_s
        return [c + rollback * (i > 0) for i, c in enumerate(costs)] if rollback else costs

    # The speeds below are Python floats, not arrays: they are computed every round between two target
    # passes, whose weights have just streamed through the caches. There a chain's speeds took 87 us in
    # numpy and 35 us in a Python loop (6 and 2 us back to back; bench/auto_idle.py --cold, SmolLM2 on
    # the Xeon), and auto's own work between passes, ~0.4 ms a round, was 2 % of a SmolLM2 step on
    # chat, where it drafts almost nothing.

    def chain_speeds(self, rates: Sequence[float], ask_s: float) -> list[float]:
        """Predicted tokens/s of a model-free chain of k = 0 .. len(rates) tokens."""
        costs = self._verify_costs(len(rates))
        base = 1.0 + self._forced
        speeds, reach, expected = [base / costs[0]], 1.0, 0.0
        for rate, cost in zip(_floats(rates), costs[1:]):
            reach *= rate
            expected += reach
            speeds.append((base + expected) / (cost + ask_s))
        return speeds

    def copy_speeds(self, name: str, available: int) -> list[float]:
        """Predicted tokens/s of a chain of k = 0 .. available tokens from model-free drafter `name`,
        by its acceptance estimate (not its stated confidence)."""
        return self.chain_speeds(self.estimates[name].rates[:available], self.specs[name].ask_s(self.profile))

    def model_speeds(self, name: str, k_cap: int, unseen: int = 0, remaining: int = 1 << 30,
                     generated: int = 0) -> list[float]:
        """Predicted tokens/s of a chain of k = 0 .. k_cap tokens from draft model `name`. `unseen`
        tokens the draft must catch up on first cost a prefill: the prompt's (its first use) is spread
        over the rounds left to pay it back, as it is paid once; the tokens generated since its last use
        (of `generated` so far) are paid in full by this round, as they come back each time auto returns
        to the draft model after other drafters (spread, they were priced ~100x low: Qwen2.5-Coder-0.5B
        caught up 13 tokens in 145 ms where the round was charged ~1 ms)."""
        est = self.estimates[name]
        forced = self._forced
        e = [x + forced for x in est.derived("emitted_list", lambda: est.expected_emitted().tolist())[: k_cap + 1]]
        spec = self.specs[name]
        step_s = spec.step_s(self.profile) or 0.0
        extra = max((spec.catchup_s(self.profile) or 0.0) - step_s, 0.0)
        all_pass = est.derived("all_pass_list", lambda: est.all_pass().tolist())
        cost = [v + i * step_s + a * extra for i, (v, a) in enumerate(zip(self._verify_costs(k_cap), all_pass))]
        backlog = min(unseen, generated)
        prompt = unseen - backlog
        if prompt > 1:
            spread = self.draft_prefill_s(prompt, step_s)
            cost[1:] = [c + spread * x / max(remaining, 1) for c, x in zip(cost[1:], e[1:])]
        if backlog > 2:  # two are the usual catch-up after a round, priced above (step_s, extra)
            catchup = self.draft_prefill_s(backlog - 2, step_s)
            cost[1:] = [c + catchup for c in cost[1:]]
        return [x / c for x, c in zip(e, cost)]

    def model_could_beat(self, name: str, k_cap: int, speed: float) -> bool:
        """Whether a chain from draft model `name` could beat `speed` this round, by a bound that
        model_speeds never exceeds: each chain's expected tokens over the least it could cost (the
        cheapest pass of the curve, k drafted tokens at the draft's step, no catch-up or prefill).
        On text the draft cannot follow most rounds end here, before the full pricing and before
        asking the draft how far behind it is (auto's own work between passes, see chain_speeds)."""
        est = self.estimates[name]
        e = est.derived("emitted_list", lambda: est.expected_emitted().tolist())
        step_s = self.specs[name].step_s(self.profile) or 0.0
        floor, forced = min(self._verify_costs(k_cap)), self._forced
        if floor <= 0.0:  # a hand-made curve with a free pass: no bound, price it
            return True
        return any((e[k] + forced) / (floor + k * step_s) > speed for k in range(1, k_cap + 1))

    def draft_prefill_s(self, n: int, step_s: float | None = None) -> float:
        """The draft model's prefill of n tokens, from its step cost (`step_s`, the draft model's by
        default) and the target's batching efficiency at that batch size (a batch of B costs verify(B)
        where B single steps cost B * verify(1))."""
        step_s = (self.profile.draft_s or 0.0) if step_s is None else step_s
        b = min(max(n, 1), self._max_batch)
        batch = self._batch_s.get(b)
        if batch is None:  # asked every round for a backlog that grows, at most max_batch sizes
            batch = self._batch_s[b] = (self.profile.verify(b), b * self.profile.verify(1))
        return n * step_s * batch[0] / batch[1]

    def choose(self, state: "SpeculativeState") -> Choice:
        self._reach(state.n)
        k_cap = min(self.k_max, state.remaining - 1)
        self._forced = state.forced
        plain = Choice(None, 0, predicted_speed=self.plain_speed())
        self._round_start = state.n
        proposals = []
        for drafter in self._copies:  # asked every round, used or not: see ShadowScorer
            proposal = drafter.propose(state.committed, self.k_max, state.sampler)
            proposals.append((drafter, proposal))
            self.shadows.add(drafter.name, proposal, state.n)
            if self.shadow_log is not None:
                self.shadow_log.append((state.n, drafter.name, proposal.tokens))
        if k_cap <= 0 or state.n == state.n_prompt:  # the first token as soon as plain decoding has it
            return plain
        best = Choice(None, 0, predicted_speed=plain.predicted_speed * (1 + SPECULATION_MARGIN))
        proposals = [(drafter, proposal) for drafter, proposal in proposals if len(proposal)]
        for (drafter, proposal), rates in zip(proposals, self.rate_proposals(proposals, k_cap)):
            speeds = self.chain_speeds(rates, self.specs[drafter.name].ask_s(self.profile))
            k = _argmax(speeds)
            if k > 0 and speeds[k] > best.predicted_speed:
                best = self._model_free_choice(drafter, proposal, k, float(speeds[k]))
        for drafter in self._models:
            if not self.model_could_beat(drafter.name, k_cap, best.predicted_speed):
                continue
            speeds = self.model_speeds(drafter.name, k_cap, drafter.unseen(state.committed), state.remaining,
                                       state.n - state.n_prompt)
            k = _argmax(speeds)
            if k > 0 and speeds[k] > best.predicted_speed:
                trees = self.max_branches > 1 and self.specs[drafter.name].trees
                best = Choice(drafter, k, gate=self._gate(float(speeds[k]), self.specs[drafter.name].step_s(self.profile)),
                              branch=self._branch(float(speeds[k])) if trees else None,
                              predicted_speed=float(speeds[k]))
        return best if best.drafter is not None else plain

    def rate_proposals(self, proposals: list[tuple[Drafter, Draft]], k_cap: int) -> list[np.ndarray]:
        """Per-position acceptance of each model-free proposal of this round, up to k_cap tokens, made
        consistent with each other (`exclusive`)."""
        return exclusive([(proposal.tokens, self.rates_of(drafter.name, proposal)[:min(len(proposal), k_cap)])
                          for drafter, proposal in proposals])

    def rates_of(self, name: str, proposal: Draft) -> np.ndarray:
        """Per-position acceptance of model-free drafter `name`'s `proposal`: where it states a
        confidence per token, that confidence as calibrated; where it states a level of evidence, that
        level's record; else the drafter's pooled record."""
        if proposal.confidence is not None:
            return self.calibration.rates(proposal.confidence)
        pooled = self.estimates[name].rates
        level = self.by_evidence.get((name, proposal.evidence)) if proposal.evidence else None
        return pooled if level is None else level.shrunk(pooled)

    def _model_free_choice(self, drafter: Drafter, proposal: Draft, k: int, speed: float) -> Choice:
        """The proposal's first k tokens; a drafter that knows its runner-up continuations may
        widen them into a tree where the profile says the wider pass pays (the engine asks again)."""
        if self.max_branches > 1 and self.specs[drafter.name].trees and proposal.confidence is not None:
            return Choice(drafter, k, branch=self._branch(speed), predicted_speed=speed)
        return Choice(drafter, k, proposal.head(k), predicted_speed=speed)

    def _gate(self, target_speed: float, step_s: float | None = None) -> Gate:
        """PipeSD's dual threshold, with thresholds from the cost model instead of constants.

        Drafting one more token costs draft_s plus the growth of the verify pass; it pays only if
        the tokens it is expected to add, per second spent, beat the speed this round aims at.
        A token whose own confidence cannot cover its draft cost (tau_token), or a chain whose
        joint confidence cannot cover the next step (tau_chain), ends the draft.
        """
        draft_s = (self.profile.draft_s or 0.0) if step_s is None else step_s
        tau_token = target_speed * draft_s

        def keep_drafting(n: int, confidence: float, product: float) -> bool:
            step = draft_s + self._pass(n + 2) - self._pass(n + 1)
            return confidence >= tau_token and product >= target_speed * step

        return keep_drafting

    def _branch(self, target_speed: float) -> Branch:
        """Trees where verification is cheap: a sibling leaf at a position pays when the chance it
        is the one accepted (reach x the draft's second-choice probability) per second of the larger
        verify pass beats the speed this round aims at. On a flat (GPU-like) cost curve that is
        almost always; where each verified token costs a step (this CPU), practically never."""
        added = [0]

        def add_sibling(n_nodes: int, p_alt: float, reach: float) -> bool:
            if added[0] + 1 >= self.max_branches or n_nodes + 2 > self.profile.max_batch:
                return False
            step = self._pass(n_nodes + 2) - self._pass(n_nodes + 1)
            if reach * p_alt >= target_speed * step:
                added[0] += 1
                return True
            return False

        return add_sibling

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: Sequence[int], *,
                pass_s: float | None = None) -> None:
        # A measured profile (it has a key) is corrected by this generation's timings; one given by
        # hand (a prediction, a GPU-like curve) is taken as given.
        if pass_s and self.profile.key and not self.rows_besides and n_drafted < len(self._verify):
            self.costs.observe(n_drafted + 1, pass_s)
            self._verify = self.costs.curve()
        if choice.drafter is not None and self.specs[choice.drafter.name].kind is DrafterKind.MODEL:
            self.estimates[choice.drafter.name].update(n_drafted, n_accepted)
        # Model-free drafters learn from their shadow proposals alone (the drafted tokens are a
        # prefix of them), so a round's draft is not counted twice; their estimates decay per round.
        judged = self.shadows.observe(self._round_start, emitted)
        levels = {(name, draft.evidence) for name, draft, *_ in judged if draft.evidence}
        for key in levels - self.by_evidence.keys():
            self.by_evidence[key] = EvidenceEstimate(self.k_max)
        for name in {name for name, *_ in judged}:
            (self.calibration if self.specs[name].confident else self.estimates[name]).decay_step()
        for key in levels:
            self.by_evidence[key].decay_step()
        for name, draft, first, n_passed, failed in judged:
            if draft.confidence is not None:
                self.calibration.record(draft.confidence[first:], n_passed, failed)
            else:
                self.estimates[name].record(first, n_passed, failed)
                if draft.evidence:
                    self.by_evidence[name, draft.evidence].record(first, n_passed, failed)


def _argmax(xs: list[float]) -> int:
    """The first index of the largest, as np.argmax."""
    return max(range(len(xs)), key=xs.__getitem__)


def _floats(xs) -> list[float]:
    return xs.tolist() if isinstance(xs, np.ndarray) else list(xs)


def exclusive(chains: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Per-position acceptance rates of proposals made over the same context, made consistent: where
    two chains first differ, both are judged after the same accepted prefix and propose different
    tokens, of which at most one can be the target's, so their rates there are scaled to sum to at most
    1. (In the policy replay of a grounded rename, prompt lookup copying the prompt and suffix copying
    an earlier answer disagreed where the edit renamed something, and each alone looked sure.) Pairwise:
    auto has two model-free drafters. `chains`: (tokens, rates) pairs."""
    rates = [r for _, r in chains]  # copied only where scaled: this runs every round
    for a in range(len(chains)):
        for b in range(a + 1, len(chains)):
            m = min(len(rates[a]), len(rates[b]))
            differ = np.flatnonzero(chains[a][0][:m] != chains[b][0][:m])
            if len(differ):
                i = int(differ[0])
                total = rates[a][i] + rates[b][i]
                if total > 1.0:
                    for j in (a, b):
                        rates[j] = rates[j].astype(float)  # a copy: the caller's arrays stay as they were
                        rates[j][i] /= total
    return rates


def resolve_mode(mode: str, available: Collection[str]) -> str:
    """`mode` checked against MODES and, where it names a drafter, against the drafters `available`."""
    if mode not in MODES:
        raise EdgespecError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode in BY_NAME and mode not in available:
        raise EdgespecError(BY_NAME[mode].unavailable or f"--mode {mode} is not available with these models")
    return mode
