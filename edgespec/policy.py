"""Policies decide, each round, which drafter proposes and how many tokens (k = 0: plain decoding).

The adaptive policy maximises expected emitted tokens per second from a measured cost profile
and online acceptance estimates. For a chain of k drafted tokens with per-position acceptance
rates a_1..a_k (each conditional on the previous ones passing), one round emits on average

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k        tokens
    T(k) = draft_cost(k) + verify(k + 1)                 seconds

and plain decoding is E(0) / T(0) = 1 / verify(1). The policy picks the (drafter, k) with the best
E/T, so it never picks a setting it predicts to be slower than plain decoding.

With parallel slots (edgespec.slots) other requests put R rows into the same pass; what this
request's k + 1 rows cost is then the marginal verify(R + k + 1) - verify(R) (`rows_besides` = R).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from edgespec.drafters import Draft, Drafter
from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from edgespec.engine import SpeculativeState
    from edgespec.profile import CostProfile

MODES = ("auto", "ar", "draft", "lookup")
DEFAULT_DRAFT_MAX = {"draft": 4, "lookup": 4, "auto": 8}
# A speculative choice must be predicted this much faster than plain decoding. The acceptance
# estimates follow the last few rounds, so the option that looks best is biased upward (the winner's
# curse): break-even choices, prompt lookup on chat text above all, measured 2-4 % slower than plain.
SPECULATION_MARGIN = 0.05

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
    @property
    def drafters(self) -> list[Drafter]:
        """Every drafter this policy may pick (the engine prepares them all at prefill)."""

    def choose(self, state: "SpeculativeState") -> Choice: ...

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: np.ndarray) -> None: ...


class FixedPolicy:
    """The same drafter and draft length every round; no drafter means plain decoding."""

    def __init__(self, drafter: Drafter | None, k: int):
        self.drafter = drafter if k > 0 else None
        self.k = k if drafter is not None else 0

    @property
    def drafters(self) -> list[Drafter]:
        return [self.drafter] if self.drafter else []

    def choose(self, state: "SpeculativeState") -> Choice:
        # The verify pass always emits one token of its own, so drafting past remaining - 1 is waste.
        k = min(self.k, state.remaining - 1)
        return Choice(self.drafter, k) if k > 0 else NO_DRAFT

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: np.ndarray) -> None:
        pass


class AcceptanceEstimate:
    """Per-position acceptance rates of one drafter, exponentially decayed so they follow the text.

    Position i is counted only in rounds that reached it (every earlier draft token accepted).
    A weak prior keeps a drafter that was never tried from looking perfect or hopeless.
    """

    def __init__(self, k_max: int, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9):
        self.hits = np.full(k_max, prior * weight)
        self.trials = np.full(k_max, weight)
        self.decay = decay

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        self.hits *= self.decay
        self.trials *= self.decay
        reached = min(n_accepted + 1, n_drafted)
        self.trials[:reached] += 1
        self.hits[:n_accepted] += 1

    @property
    def rates(self) -> np.ndarray:
        return self.hits / self.trials

    def expected_emitted(self) -> np.ndarray:
        """E(k) for k = 0 .. k_max."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.rates))])


class AdaptivePolicy:
    """Speculate only when it pays, by the measured costs and the acceptance seen so far."""

    def __init__(self, profile: "CostProfile", lookup: Drafter | None, draft_model: Drafter | None,
                 k_max: int = DEFAULT_DRAFT_MAX["auto"], max_branches: int = 1):
        self.profile = profile
        self.lookup = lookup
        self.draft_model = draft_model
        self.k_max = max(1, min(k_max, profile.max_batch - 1))
        self.max_branches = max_branches  # sequences the target can verify at once (1 = chains only)
        self.estimates = {d.name: AcceptanceEstimate(self.k_max) for d in self.drafters}
        self._shadow: Draft | None = None  # lookup's proposal this round, scored even when unused
        self.rows_besides = 0  # rows other requests add to the same target pass (parallel slots)

    @property
    def drafters(self) -> list[Drafter]:
        return [d for d in (self.lookup, self.draft_model) if d is not None]

    def _pass(self, n: int) -> float:
        """What n rows of this request add to the target pass: verify(R + n) - verify(R)."""
        r = self.rows_besides
        return self.profile.verify(r + n) - self.profile.verify(r) if r else self.profile.verify(n)

    def plain_speed(self) -> float:
        return 1.0 / self._pass(1)

    def _verify_costs(self, k: int) -> np.ndarray:
        """The pass's cost of n = 1 .. k + 1 rows of this request."""
        return np.array([self._pass(n) for n in range(1, k + 2)])

    def lookup_speeds(self, available: int) -> np.ndarray:
        """Predicted tokens/s of a lookup chain of k = 0 .. available tokens."""
        e = self.estimates["lookup"].expected_emitted()[: available + 1]
        cost = self._verify_costs(available) + self.profile.lookup_s * (np.arange(available + 1) > 0)
        return e / cost

    def draft_speeds(self, k_cap: int) -> np.ndarray:
        """Predicted tokens/s of a draft-model chain of k = 0 .. k_cap tokens."""
        est = self.estimates["draft"]
        e = est.expected_emitted()[: k_cap + 1]
        all_pass = np.concatenate([[0.0], np.cumprod(est.rates)])[: k_cap + 1]
        ks = np.arange(k_cap + 1)
        extra = (self.profile.draft_catchup_s or 0.0) - (self.profile.draft_s or 0.0)
        cost = self._verify_costs(k_cap) + ks * (self.profile.draft_s or 0.0) + all_pass * max(extra, 0.0)
        return e / cost

    def choose(self, state: "SpeculativeState") -> Choice:
        k_cap = min(self.k_max, state.remaining - 1)
        plain = Choice(None, 0, predicted_speed=self.plain_speed())
        self._shadow = None
        if k_cap <= 0:
            return plain
        best = Choice(None, 0, predicted_speed=plain.predicted_speed * (1 + SPECULATION_MARGIN))
        if self.lookup is not None:
            proposal = self.lookup.propose(state.committed, k_cap, state.sampler)
            self._shadow = proposal
            if len(proposal):
                speeds = self.lookup_speeds(len(proposal))
                k = int(np.argmax(speeds))
                if k > 0 and speeds[k] > best.predicted_speed:
                    best = Choice(self.lookup, k, Draft(proposal.tokens[:k]), predicted_speed=float(speeds[k]))
        if self.draft_model is not None:
            speeds = self.draft_speeds(k_cap)
            k = int(np.argmax(speeds))
            if k > 0 and speeds[k] > best.predicted_speed:
                branch = self._branch(float(speeds[k])) if self.max_branches > 1 else None
                best = Choice(self.draft_model, k, gate=self._gate(float(speeds[k])), branch=branch,
                              predicted_speed=float(speeds[k]))
        return best if best.drafter is not None else plain

    def _gate(self, target_speed: float) -> Gate:
        """PipeSD's dual threshold, with thresholds from the cost model instead of constants.

        Drafting one more token costs draft_s plus the growth of the verify pass; it pays only if
        the tokens it is expected to add, per second spent, beat the speed this round aims at.
        A token whose own confidence cannot cover its draft cost (tau_token), or a chain whose
        joint confidence cannot cover the next step (tau_chain), ends the draft.
        """
        draft_s = self.profile.draft_s or 0.0
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

    def observe(self, choice: Choice, n_drafted: int, n_accepted: int, emitted: np.ndarray) -> None:
        if choice.drafter is not None:
            self.estimates[choice.drafter.name].update(n_drafted, n_accepted)
        if self._shadow is not None and len(self._shadow) and choice.drafter is not self.lookup:
            # What lookup would have scored: under greedy its tokens pass iff they equal the target's;
            # under sampling a one-hot draft token x passes with probability p(x), the chance the
            # emitted token is x. Only positions the round emitted can be judged.
            judged = min(len(self._shadow), len(emitted))
            match = self._shadow.tokens[:judged] == emitted[:judged]
            n_match = judged if match.all() else int(np.argmin(match))
            self.estimates["lookup"].update(judged, n_match)


def resolve_mode(mode: str, has_draft_model: bool) -> str:
    if mode not in MODES:
        raise EdgespecError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "draft" and not has_draft_model:
        raise EdgespecError("--mode draft needs a draft model: pass --draft MODEL (or use --mode lookup)")
    return mode
