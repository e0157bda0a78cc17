"""Generation statistics, defined as vLLM defines them so numbers compare across tools.

acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / rounds (tokens emitted
per target verification pass); per-position acceptance; time split into draft, verify and other.
Prefill of target and draft belongs to ttft_s, never to decode_s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.machine.memory import format_bytes


@dataclass
class GenerationStats:
    mode: str
    prompt_tokens: int = 0
    cached_tokens: int = 0       # prompt tokens whose KV was reused (prefix cache, earlier turns)
    prefilled_tokens: int = 0    # prompt tokens evaluated at prefill (the last one goes with the first round)
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0              # tokens a constraint forced into drafts (not in drafted: no drafter's guess)
    forced_accepted: int = 0     # of which the target took (all, but where it tokenizes a forced string
    #                              its own way)
    rounds: int = 0              # target verification passes
    tree_rounds: int = 0         # of which verified a token tree rather than a chain
    prefill_s: float = 0.0
    ttft_s: float = 0.0          # start to first emitted token, prefill included
    decode_s: float = 0.0        # end of prefill to the last token
    draft_s: float = 0.0
    verify_s: float = 0.0
    seed: int | None = None
    predicted_peak_bytes: int | None = None  # the memory plan's predicted peak (with --budget)
    peak_rss_bytes: int | None = None        # the process's real peak resident set (VmHWM), measured
    peak_gpu_bytes: int | None = None        # this process's GPU memory (NVML), where a GPU exists
    memory_events: list[str] = field(default_factory=list)  # what the memory guard gave up, and why
    drafted_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    chosen: dict[str, int] = field(default_factory=dict)  # "drafter:k" -> rounds
    passes_by_rows: dict[int, int] = field(default_factory=dict)  # rows a pass fed (forced + drafted + 1) ->
    #                                   passes: with a cost curve it prices the run free of timing noise
    held_by_rows: dict[int, int] = field(default_factory=dict)    # rows -> the tokens those passes followed,
    #                                   summed: a pass's price grows linearly with them (CostProfile.verify)

    def record_round(self, drafter: str, n_drafted: int, n_accepted: int, *, forced: int = 0,
                     forced_accepted: int = 0, held: int = 0) -> None:
        """One pass: a drafter's n_drafted tokens after `forced` ones, n_accepted of its own accepted,
        following `held` committed tokens."""
        self.forced += forced
        self.forced_accepted += forced_accepted
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        key = f"{drafter}:{n_drafted}"
        self.chosen[key] = self.chosen.get(key, 0) + 1
        rows = forced + n_drafted + 1
        self.passes_by_rows[rows] = self.passes_by_rows.get(rows, 0) + 1
        self.held_by_rows[rows] = self.held_by_rows.get(rows, 0) + held
        if not n_drafted:  # most rounds, where a speculative mode finds nothing worth drafting
            return
        if n_drafted > len(self.drafted_at):
            grow = n_drafted - len(self.drafted_at)
            self.drafted_at = np.concatenate([self.drafted_at, np.zeros(grow, dtype=np.int64)])
            self.accepted_at = np.concatenate([self.accepted_at, np.zeros(grow, dtype=np.int64)])
        self.drafted_at[:n_drafted] += 1
        self.accepted_at[:n_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + (self.accepted + self.forced_accepted) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    def to_dict(self) -> dict:
        per_position = (self.accepted_at / np.maximum(self.drafted_at, 1)).round(4).tolist()
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated": self.generated,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "forced": self.forced,
            "forced_accepted": self.forced_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "per_position_acceptance": per_position,
            "rounds": self.rounds,
            "tree_rounds": self.tree_rounds,
            "ttft_s": round(self.ttft_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "other_s": round(self.other_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "chosen": dict(self.chosen),
            "passes_by_rows": {str(n): c for n, c in sorted(self.passes_by_rows.items())},
            "held_by_rows": {str(n): c for n, c in sorted(self.held_by_rows.items())},
            "seed": self.seed,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "memory_events": list(self.memory_events),
        }

    def summary(self) -> str:
        """The one-line stats a person reads after a generation."""
        line = (f"{self.generated} tokens in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"ttft {self.ttft_s * 1000:.0f} ms, prompt {self.prompt_tokens} tokens, mode {self.mode}")
        if self.drafted:
            line += (f", accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.0%}), "
                     f"{self.mean_accepted_length:.2f} tokens/pass")
        if self.forced:
            line += f", forced {self.forced_accepted}/{self.forced} by the constraint"
            if not self.drafted:
                line += f", {self.mean_accepted_length:.2f} tokens/pass"
        if self.predicted_peak_bytes and self.peak_rss_bytes:  # under --budget
            line += (f", peak {format_bytes(self.peak_rss_bytes)} "
                     f"(plan {format_bytes(self.predicted_peak_bytes)})")
        return line
