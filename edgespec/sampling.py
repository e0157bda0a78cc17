"""Turning a logits row into the distribution a token is drawn from.

The same function processes target and draft rows, so rejection sampling compares like with like:
the speculative output then follows exactly the distribution plain sampling would use.
Order follows llama.cpp's default chain: logit bias, the grammar's mask (edgespec.structured),
penalties (repetition, presence, frequency), top-k, top-p, min-p, temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.errors import EdgespecError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings. temperature 0 means greedy (argmax), which is what speculation keeps exact."""

    temperature: float = 0.8
    top_k: int = 40          # 0 = whole vocabulary
    top_p: float = 0.95      # 1 = off
    min_p: float = 0.05      # 0 = off
    repeat_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64       # the window every penalty looks at (llama.cpp's penalty_last_n)
    presence_penalty: float = 0.0   # subtracted from the logit of a token seen in the window (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted once per time it was seen
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs added to the logits first

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"--top-k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1), got {self.min_p}"),
            (self.repeat_penalty > 0, f"--repeat-penalty must be > 0 (1 = off), got {self.repeat_penalty}"),
            (self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be >= 0"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise EdgespecError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether a row depends on the tokens before it (some penalty is on)."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)


def penalize(logits: np.ndarray, recent: np.ndarray, params: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties over the last repeat_last_n tokens: the repetition penalty shrinks the
    logit of each token seen, then presence and frequency subtract (presence + count x frequency).
    Returns a copy when anything changes."""
    if not params.penalised or len(recent) == 0:
        return logits
    out = logits.copy()
    seen, counts = np.unique(recent[-params.repeat_last_n:], return_counts=True)
    vals = out[seen]
    if params.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    out[seen] = vals - (params.presence_penalty + counts * params.frequency_penalty)
    return out


def token_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Dense probability vector (n_vocab,) after top-k, top-p, min-p and temperature. Needs temperature > 0."""
    n_vocab = logits.shape[0]
    if 0 < params.top_k < n_vocab:
        candidates = np.argpartition(-logits, params.top_k - 1)[: params.top_k]
    else:
        candidates = np.arange(n_vocab)
    candidates = candidates[np.argsort(-logits[candidates], kind="stable")]
    top = logits[candidates].astype(np.float64)

    if params.top_p < 1.0 or params.min_p > 0.0:
        p = np.exp(top - top[0])
        p /= p.sum()
        keep = len(p)
        if params.top_p < 1.0:  # smallest prefix whose mass reaches top_p
            keep = min(keep, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
        if params.min_p > 0.0:  # sorted, so the kept set is a prefix
            keep = min(keep, max(1, int(np.count_nonzero(p >= params.min_p * p[0]))))
        candidates, top = candidates[:keep], top[:keep]

    w = np.exp((top - top[0]) / params.temperature)
    probs = np.zeros(n_vocab, dtype=np.float64)
    probs[candidates] = w / w.sum()
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a (possibly unnormalised) non-negative vector."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


class Sampler:
    """Processes rows and draws tokens with one seeded generator, so a run can be reproduced.

    `grammar` (an edgespec.structured.Grammar) masks every row as the grammar stands after the
    tokens before that row, drafts included, like the penalties: the constrained distribution at
    each position, whichever pass or drafter asks.
    """

    def __init__(self, params: SamplingParams, seed: int, grammar=None):
        self.params = params
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.grammar = grammar
        self._bias: np.ndarray | None = None

    def rows(self, logits: np.ndarray, context: np.ndarray, continuation: np.ndarray) -> np.ndarray:
        """Process the logits rows of the last positions of context + continuation.

        With m rows, row j is the prediction after context + continuation[:len(continuation) - m + 1 + j]:
        a verify pass gives m = k + 1 rows for k drafted tokens; a draft step gives one row.
        Greedy returns (penalised) logits, since argmax is all it needs; sampling returns probabilities.
        """
        params = self.params
        penalised = params.penalised
        if params.greedy and not penalised and not params.logit_bias and self.grammar is None:
            return logits
        m = logits.shape[0]
        masks = self.grammar.row_masks(context, continuation, m) if self.grammar is not None else None
        history = np.concatenate([context[-params.repeat_last_n:] if penalised else context[:0], continuation])
        first = len(history) - m + 1
        out = np.empty(logits.shape, dtype=np.float32 if params.greedy else np.float64)
        for j in range(m):
            row = logits[j] if not params.logit_bias else logits[j] + self._bias_vector(logits.shape[1])
            if masks is not None:
                row = np.where(masks[j], row, -np.inf)
            row = penalize(row, history[: first + j], params) if penalised else row
            out[j] = row if params.greedy else token_distribution(row, params)
        return out

    def _bias_vector(self, n_vocab: int) -> np.ndarray:
        if self._bias is None:
            self._bias = np.zeros(n_vocab, dtype=np.float32)
            for token, bias in self.params.logit_bias:
                if token >= n_vocab:
                    raise EdgespecError(f"logit_bias names token {token}, past the vocabulary ({n_vocab} tokens)")
                self._bias[token] += bias
        return self._bias

    def pick(self, row: np.ndarray) -> int:
        """A token from one processed row: argmax when greedy, a draw otherwise."""
        return int(np.argmax(row)) if self.params.greedy else sample(row, self.rng)
