"""What the adaptive policy predicts on hardware we do not have: a PREDICTION, not a measurement.

Acceptance is measured here, on this machine, for real (draft model and prompt lookup at k = 8 on
the shipped prompts, greedy; per-position rates from the engine's stats). Costs come from a
recorded GPU-like profile in which a verify pass costs the same for 1 to 16 tokens, as it does on
a discrete GPU for small models. The policy's own model (E(k)/T(k)) then says which drafter and
k it would pick and what speed-up over plain decoding that implies.

    python -m edgespec.bench.policy_predict [--models smollm2|qwen|all] [--max-tokens 64]
    python -m edgespec.bench.policy_predict --models qwen --profile bench/gpu/out/profile-qwen2.5-1.5b.json

`--profile` takes the costs from a profile measured elsewhere (`edgespec profile --json`, as
bench/gpu/run.py writes it on a GPU) instead of the assumed GPU-like one: still a prediction for
that machine, from its measured costs and the acceptance measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from edgespec.drafters import PromptLookupDrafter
from edgespec.engine import Engine, GenerationConfig
from edgespec.policy import AdaptivePolicy
from edgespec.machine.profile import CostProfile

# A GPU-like profile, per target step: verify is flat up to 16 tokens; the draft model costs this
# fraction of a target step (a 0.5B draft for a 1.5B target on a GPU is bound by launch overheads).
GPU_LIKE = {"verify_steps": {n: 1.0 for n in (1, 2, 3, 4, 6, 8, 10, 12, 16)}, "draft_fraction": 0.35,
            "lookup_fraction": 0.01}


def gpu_like_profile(step_s: float = 0.01) -> CostProfile:
    return CostProfile({n: v * step_s for n, v in GPU_LIKE["verify_steps"].items()},
                       GPU_LIKE["draft_fraction"] * step_s, 2 * GPU_LIKE["draft_fraction"] * step_s,
                       GPU_LIKE["lookup_fraction"] * step_s)


class _Named:
    def __init__(self, name: str):
        self.name = name


def measured_acceptance(engine: Engine, prompts: list, max_tokens: int, mode: str) -> np.ndarray:
    """Per-position acceptance at k = 8 over the prompts, conditional as the policy models it: the rate
    at position i among rounds whose first i - 1 draft tokens passed (the stats count position i in
    every round that drafted it; accepted / drafted would be the chance the whole prefix passed)."""
    drafted = np.zeros(8)
    accepted = np.zeros(8)
    for messages in prompts:
        ids = engine.prompt_tokens(messages)
        stats = engine.generate_tokens(ids, GenerationConfig(max_tokens=max_tokens, temperature=0, mode=mode,
                                                             draft_max=8)).stats
        n = len(stats.drafted_at)
        drafted[:n] += stats.drafted_at
        accepted[:n] += stats.accepted_at
    return conditional_rates(drafted, accepted)


def conditional_rates(drafted: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """P(position i passes | 1..i-1 passed): rounds that accepted position i over rounds that reached
    it (accepted i - 1) and drafted it (lookup drafts stop where the match ends)."""
    reached = np.minimum(np.concatenate([[np.inf], accepted[:-1]]), drafted)
    return np.where(reached > 0, accepted / np.maximum(reached, 1), 0.0)


def load_profile(path: str) -> CostProfile:
    """A profile from `edgespec profile --json` (its extra `curve` key, if any, is not needed here)."""
    d = json.loads(Path(path).read_text())
    fields = {k: d[k] for k in ("verify_s", "draft_s", "draft_catchup_s", "lookup_s", "key", "measured_in_s") if k in d}
    return CostProfile.from_dict(fields)


def predict(rates: dict[str, np.ndarray], profile: CostProfile | None = None) -> dict:
    """The policy's choice and predicted speed-up for each drafter on `profile` (default: GPU-like)."""
    profile = profile or gpu_like_profile()
    out = {}
    for name, r in rates.items():
        policy = AdaptivePolicy(profile, None, _Named("draft"), k_max=8) if name == "draft" else \
            AdaptivePolicy(profile, PromptLookupDrafter(), None, k_max=8)
        est = policy.estimates[name]
        k_max = policy.k_max  # a measured profile may time fewer pass sizes than 9
        est.assume(r[:k_max])
        speeds = policy.model_speeds(name, k_max) if name == "draft" else policy.copy_speeds(name, k_max)
        k = int(np.argmax(speeds))
        out[name] = {"per_position_acceptance": [round(float(x), 3) for x in r], "chosen_k": k,
                     "predicted_speedup_vs_plain": round(float(speeds[k] / speeds[0]), 2),
                     "expected_tokens_per_pass": round(float(est.expected_emitted()[k]), 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", choices=["smollm2", "qwen", "all"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--out", default="bench/out/policy_predict.json")
    parser.add_argument("--profile", default=None, help="costs from `edgespec profile --json` of another machine")
    args = parser.parse_args(argv)

    from edgespec.bench.run import load_prompts, smollm2_draft

    prompts = [p.messages for p in load_prompts(args.prompts)]
    pairs = []
    if args.models in ("smollm2", "all"):
        pairs.append(("smollm2-135m", "smollm2-135m", str(smollm2_draft())))
    if args.models in ("qwen", "all"):
        pairs.append(("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    measured = load_profile(args.profile) if args.profile else None
    report = {"note": "PREDICTION on a recorded GPU-like profile (verify cost flat in k); acceptance measured "
                      "on this machine", "profile": GPU_LIKE, "models": {}}
    if measured is not None:
        report.update(note=f"PREDICTION with costs measured on {measured.key.get('device', '?')} ({args.profile}); "
                           "acceptance measured on this machine", profile=measured.to_dict())
    for label, target, draft in pairs:
        with Engine.load(target, draft, n_ctx=4096) as engine:
            rates = {mode: measured_acceptance(engine, prompts, args.max_tokens, mode) for mode in ("draft", "lookup")}
        report["models"][label] = predict(rates, measured)
        print(label, json.dumps(report["models"][label]), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
