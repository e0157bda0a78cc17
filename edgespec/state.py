"""The state one generation carries between rounds of the speculative loop (edgespec.engine).

Its own module so the policy and the memory guard, which read it every round, need not import the
engine that drives them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from edgespec.detokenize import TokenLogprob
from edgespec.sampling import Sampler
from edgespec.stats import GenerationStats
from edgespec.structured import Grammar


@dataclass
class SpeculativeState:
    """Everything one generation carries between rounds, in one place."""

    context: np.ndarray          # prompt then emitted tokens; capacity n_prompt + max_tokens
    n: int                       # tokens committed (context[:n])
    n_prompt: int
    max_tokens: int
    sampler: Sampler
    stats: GenerationStats
    finish_reason: str | None = None
    t_start: float = field(default_factory=time.perf_counter)
    top_logprobs: int | None = None                        # config.logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    forced: int = 0  # a look-ahead view (see `ahead`): the last `forced` committed tokens are the
    #                  grammar's, fed with this round's draft and not verified yet

    @property
    def committed(self) -> np.ndarray:
        return self.context[: self.n]

    @property
    def grammar(self) -> Grammar | None:
        return self.sampler.grammar

    def ahead(self, forced: np.ndarray) -> "SpeculativeState":
        """The state as drafters and the policy see it this round: the grammar's forced tokens
        appended, as if committed (they are written past `n`, which nothing reads yet)."""
        if not len(forced):
            return self
        self.context[self.n:self.n + len(forced)] = forced
        return replace(self, n=self.n + len(forced), forced=len(forced))

    @property
    def remaining(self) -> int:
        return self.max_tokens - (self.n - self.n_prompt)
