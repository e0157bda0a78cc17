"""Priced time and the oracle: what a run cost by the measured cost curve, and the least any policy
could have paid for the same tokens.

Priced time. A run's stats count its target passes by the rows each fed (`passes_by_rows`) and the
tokens each drafter drafted (`chosen`). Priced by the cost profile auto itself uses
(edgespec.machine.profile.CostProfile), a run costs

    sum over passes verify(rows, held) + draft-model tokens x draft_s + asks of model-free drafters x ask_s

seconds (held: the tokens a pass followed, `held_by_rows`), with no timing noise in it: two runs that
made the same passes cost the same. Auto asks every model-free drafter every round
(edgespec.policy.ShadowScorer); a fixed lookup or suffix mode asks its drafter once a round. The draft model's prefill and catch-up decodes, and tree passes
beyond their row count, are not priced (on either side of a comparison).

The oracle (greedy runs). After a run every drafter's acceptance is known at every position of the
text it produced: a model-free drafter's proposal at position j (auto's own shadow proposal where it
asked there; elsewhere the same drafter asked again over the same context and history, which gives
the same proposal: the bench checks they agree where both exist) keeps as many tokens as match the
text from j; the draft model's greedy proposals come from one teacher-forced pass of the draft over
the committed text, and an autoregressive draft from j would have kept as many tokens as those
predictions match the text from j (each drafted token, while right, is the text's token, so the next
proposal is the teacher-forced one). A dynamic program over positions then finds the cheapest way to
emit the same tokens: at position j, plain decoding (verify(1), advance 1), or drafter d with k
tokens (its draft cost + verify(k + 1), advance min(k, accepted) + 1), each pass priced after the
n_prompt + j tokens it follows.

    plain/auto - 1 over plain/oracle - 1 is auto's share of what any policy could have gained.

Under a constraint (edgespec.structured) every round leads with the tokens the grammar forces where it
stands (Engine.propose, at most FORCED_MAX), and the drafter drafts after them. So at position j with f
forced tokens, m of which the text confirms (a forced byte string may be spelt by other tokens), plain
decoding pays verify(1 + f) and advances m + 1 (f + 1 when all are kept), and drafter d with k tokens pays
verify(1 + f + k) and advances f + min(k, accepted at j + f) + 1. Plain decoding under the same
constraint is the path that always drafts nothing: the oracle's gain is over constrained plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from edgespec.drafters.base import DrafterKind
from edgespec.drafters.table import spec_for
from edgespec.machine.profile import CONTEXT_TOKENS

END = -1  # the end-of-generation position of a text that stopped on an end token (any of them matches)


@dataclass(frozen=True)
class Pricing:
    """The cost of each operation a round is made of, from one cost profile."""

    profile: object                 # edgespec.machine.profile.CostProfile
    model_free: tuple[str, ...]     # the model-free drafters the engine had (auto asks each every round)

    def verify(self, rows: int, held: int = CONTEXT_TOKENS) -> float:
        return self.profile.verify(rows, held)

    def ask(self, drafter: str) -> float:
        return spec_for(drafter).ask_s(self.profile)

    def draft(self, drafter: str, k: int) -> float:
        """What drafting k tokens with `drafter` costs besides the verify pass."""
        if spec_for(drafter).kind is DrafterKind.MODEL:
            return k * (self.profile.draft_s or 0.0)
        return self.ask(drafter)

    def passes_seconds(self, stats) -> float:
        """A finished run's target passes at their price, from its GenerationStats."""
        # verify() is linear in the tokens held, so n passes cost n at their mean depth
        return sum(n * self.verify(rows, stats.held_by_rows.get(rows, CONTEXT_TOKENS * n) / n)
                   for rows, n in stats.passes_by_rows.items())

    def run_seconds(self, stats) -> float:
        """A finished run's priced time, from its GenerationStats (see the module docstring)."""
        verify = self.passes_seconds(stats)
        model = 0.0
        for key, n in stats.chosen.items():
            drafter, k = key.rsplit(":", 1)
            if drafter != "none" and spec_for(drafter).kind is DrafterKind.MODEL:
                model += n * int(k) * (self.profile.draft_s or 0.0)
        if stats.mode == "auto":
            asks = stats.rounds * sum(self.ask(d) for d in self.model_free)
        elif stats.mode in self.model_free:
            asks = stats.rounds * self.ask(stats.mode)
        else:
            asks = 0.0
        return verify + model + asks


def with_end(tokens: Sequence[int], stopped: bool) -> np.ndarray:
    """The positions a run emitted: its tokens, and the end token's position when it stopped on one
    (that pass counts too; END stands for whichever end token it was)."""
    return np.asarray(list(tokens) + ([END] if stopped else []), dtype=np.int64)


def accepted_run(proposal: np.ndarray, text: np.ndarray, j: int, eog: frozenset[int]) -> int:
    """How many leading tokens of `proposal`, drafted at position j, the text confirms."""
    want = text[j:j + len(proposal)]
    got = np.asarray(proposal[:len(want)], dtype=np.int64)
    if eog:
        got = np.where(np.isin(got, list(eog)), END, got)
    same = got == want
    return len(same) if same.all() else int(np.argmin(same))


def runs_of_matches(predicted: np.ndarray, text: np.ndarray) -> np.ndarray:
    """For each position j: how many predictions from j on match the text before the first miss."""
    same = predicted[:len(text)] == text
    out = np.zeros(len(text) + 1, dtype=np.int64)
    for j in range(len(text) - 1, -1, -1):
        out[j] = out[j + 1] + 1 if same[j] else 0
    return out[:-1]


def teacher_forced(draft, prompt: Sequence[int], text: np.ndarray, eog: frozenset[int], chunk: int = 32,
                   grammar=None) -> np.ndarray:
    """The draft model's greedy prediction at each position of `text` given the prompt and the text
    before it: one pass over the committed text (in chunks of `chunk` logits rows). Leaves its KV empty."""
    return teacher_forced_confidence(draft, prompt, text, eog, chunk, grammar)[0]


def teacher_forced_confidence(draft, prompt: Sequence[int], text: np.ndarray, eog: frozenset[int] = frozenset(),
                              chunk: int = 32, grammar=None) -> tuple[np.ndarray, np.ndarray]:
    """teacher_forced's predictions, and the draft's probability of each (its confidence there).
    `grammar`: under a constraint, a Grammar at the prompt's end, walked along the text here: each row
    is masked as it stands there (the draft model drafts from masked rows, Engine.constrain)."""
    tokens = [int(t) for t in text if t != END]
    rows_max = draft.sizing.n_outputs_max
    chunk = min(chunk, rows_max) if rows_max else chunk
    draft.truncate(0)
    if len(prompt) > 1:
        draft.decode(np.asarray(prompt[:-1], dtype=np.int32), 0)
    feed = [int(prompt[-1])] + tokens  # row i predicts text[i]
    predicted, confidence = np.empty(len(feed), dtype=np.int64), np.empty(len(feed))
    for start in range(0, len(feed), chunk):
        piece = np.asarray(feed[start:start + chunk], dtype=np.int32)
        rows = draft.decode(piece, len(piece)).astype(np.float64)
        for i in range(len(piece)) if grammar is not None else ():  # row i predicts tokens[start + i]
            mask = grammar.allowed()[:rows.shape[1]]
            rows[i, :len(mask)][~mask] = -np.inf
            if start + i < len(tokens):
                grammar.consume([tokens[start + i]])
        predicted[start:start + len(piece)] = rows.argmax(axis=1)
        rows = np.exp(rows - rows.max(axis=1, keepdims=True))
        confidence[start:start + len(piece)] = 1.0 / rows.sum(axis=1)  # the top row's softmax
    draft.truncate(0)
    if eog:
        predicted = np.where(np.isin(predicted, list(eog)), END, predicted)
    return predicted[:len(text)], confidence[:len(text)]


@dataclass
class Hindsight:
    """Per drafter, the tokens its draft at each position of one run's text would have had accepted."""

    text: np.ndarray                    # with_end(...): the positions the run emitted
    accepted: dict[str, np.ndarray]     # drafter -> accepted tokens at each position (its k permitting)
    recorded: dict[str, int] = field(default_factory=dict)  # drafter -> positions whose proposal was auto's own
    n_prompt: int = CONTEXT_TOKENS      # the tokens before the text: position j's pass follows n_prompt + j
    agree: dict[str, int] = field(default_factory=dict)     # of those, where asking again gave the same proposal
    forced: np.ndarray | None = None       # under a constraint: the forced tokens leading a round at each position
    forced_kept: np.ndarray | None = None  # how many of those the text confirms (None: all)


def hindsight(prompt: Sequence[int], text: np.ndarray, eog: frozenset[int], k_max: int, *,
              shadow_log: Sequence[tuple[int, str, np.ndarray]] = (), model_free: Mapping = (),
              draft_model=None, sampler=None) -> Hindsight:
    """Acceptance at every position: the model-free drafters from auto's shadow proposals (`shadow_log`,
    as AdaptivePolicy.shadow_log records it, positions counted in the whole context), asked again over the
    same context where auto did not ask (`model_free`: name -> drafter over the history as it stood
    before the run); the draft model (a runtime) by teacher forcing."""
    n_prompt = len(prompt)
    context = np.concatenate([np.asarray(prompt, dtype=np.int32),
                              np.asarray([t for t in text if t != END], dtype=np.int32)])
    logged: dict[tuple[str, int], np.ndarray] = {}
    for position, name, tokens in shadow_log:
        logged.setdefault((name, position - n_prompt), tokens)
    out = Hindsight(text, {}, n_prompt=n_prompt)
    for name, drafter in dict(model_free).items():
        acc = np.zeros(len(text), dtype=np.int64)
        out.recorded[name] = out.agree[name] = 0
        for j in range(len(text)):
            own = logged.get((name, j))
            if own is not None:
                again = drafter.propose(context[:n_prompt + j], k_max, sampler).tokens
                out.recorded[name] += 1
                out.agree[name] += bool(np.array_equal(np.asarray(again), np.asarray(own)))
                proposal = own
            else:
                proposal = drafter.propose(context[:n_prompt + j], k_max, sampler).tokens
            acc[j] = accepted_run(proposal[:k_max], text, j, eog)
        out.accepted[name] = acc
    if draft_model is not None:
        out.accepted["draft"] = runs_of_matches(teacher_forced(draft_model, prompt, text, eog), text)
    return out


def forced_runs(grammar, text: np.ndarray, max_tokens: int, forced_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Under a constraint, at each position j of `text` (a Grammar at the prompt's end, which this walks
    to the text's end): the forced tokens a round there leads with (Engine.propose: at most
    min(forced_max, max_tokens - j - 1)), and how many of them the text confirms."""
    n = len(text)
    forced, kept = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for j in range(n):
        run = grammar.forced(min(forced_max, max_tokens - j - 1))
        forced[j] = len(run)
        kept[j] = accepted_run(run, text, j, frozenset())
        if text[j] != END:
            grammar.consume([int(text[j])])
    return forced, kept


@dataclass
class Oracle:
    seconds: float                   # the least priced time to emit the text
    plain_seconds: float             # plain decoding's: one verify(1) per position
    choices: dict[str, int]          # rounds per "drafter:k" on the cheapest path ("none:0": plain)

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds


def oracle(h: Hindsight, pricing: Pricing, k_max: int, drafters: Sequence[str] | None = None) -> Oracle:
    """The cheapest path over the positions of h.text (see the module docstring), using `drafters`
    (default: every one in h)."""
    names = list(h.accepted if drafters is None else drafters)
    n = len(h.text)
    forced = np.zeros(n, dtype=np.int64) if h.forced is None else np.asarray(h.forced, dtype=np.int64)
    kept = forced if h.forced_kept is None else np.asarray(h.forced_kept, dtype=np.int64)
    draft = {d: [0.0] + [pricing.draft(d, k) for k in range(1, k_max + 1)] for d in names}
    best, plain = np.zeros(n + 1), np.zeros(n + 1)  # from position j on: the cheapest, and plain decoding's
    move: list[tuple[str, int, int]] = [("none", 0, 1)] * n
    for j in range(n - 1, -1, -1):
        f, m = int(forced[j]), int(kept[j])
        verify = [0.0] + [pricing.verify(r, h.n_prompt + j) for r in range(1, f + k_max + 2)]
        step = min(min(m, f) + 1, n - j)
        plain[j] = verify[f + 1] + plain[j + step]
        best[j], move[j] = verify[f + 1] + best[j + step], ("none", 0, step)
        if m < f or j + f >= n:  # a forced token the text spells otherwise ends the round there
            continue
        for d in names:
            a = int(h.accepted[d][j + f])
            for k in range(1, k_max + 1):
                step = min(f + min(k, a) + 1, n - j)
                c = verify[f + k + 1] + draft[d][k] + best[j + step]
                if c < best[j]:
                    best[j], move[j] = c, (d, k, step)
    choices: dict[str, int] = {}
    j = 0
    while j < n:
        d, k, step = move[j]
        choices[f"{d}:{k}"] = choices.get(f"{d}:{k}", 0) + 1
        j += step
    return Oracle(float(best[0]), float(plain[0]), choices)
