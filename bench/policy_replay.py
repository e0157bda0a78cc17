"""Policy replay: auto's choices re-run on fixed greedy texts, priced by a cost profile, beside the oracle.

A race measures auto in wall-clock time, where a 3 % change of policy hides in the machine's noise
and every try costs minutes. Under greedy decoding the text is fixed (plain decoding's), and so is
what any drafter's proposal at any position would have had accepted (bench/oracle.py: lookup and
suffix asked over the same context and history, the draft model by one teacher-forced pass). So the
policy itself, AdaptivePolicy unchanged, can be run round by round on that text: each round it
chooses (drafter, k), the replay answers with the tokens the target would have accepted, and the
round is priced by the cost profile (verify(k + 1), draft tokens, the asks of the model-free
drafters), as bench/oracle.py prices a real run. No model runs during the replay, so every prompt
replays in milliseconds and the same profile prices auto, plain and the oracle.

What it does not model: the draft model's confidence gate is fed the teacher-forced confidence of
the text's own token at each position (the draft's real confidence once its chain left the text
differs, but those tokens are rejected whatever it says); the draft model's prefill and catch-up
are not priced (as in bench/oracle.py); a real run's text can differ from plain's at batch-vs-single
near-ties. tests/test_bench.py checks the replay against the engine: on the text a real auto run
emitted, the replayed policy makes the same rounds at the same priced cost.

Each prompt is replayed seven times: auto as the engine runs every request after its first, starting
from the acceptance record the prompt before left it where the two prompts are kin (Engine.acceptance,
AcceptanceRecord.kin; `--order mixed` makes the prompt before one of another class); auto from the
priors, as a fresh process's first request (fresh); four ablations, each auto with one rule taken
out: the record carried whatever the prompts' kinship (WholeRecordPolicy), every lookup proposal
rated by lookup's pooled acceptance, as before auto rated each match length apart (PooledPolicy),
each proposal rated apart from the others, as before two that disagree were made exclusive
(ApartPolicy), and every pass priced at the profile's shallow depth, as before the profile timed two
(ShallowPolicy); and a reference, auto told the rates it would learn from the whole text before it
starts (InformedPolicy). A calibration table then sets, per drafter and draft length, the tokens
the policy predicted a round would emit (its predicted speed times the round's priced time) beside
those it did.

    python -m edgespec.bench.policy_replay --models qwen --threads 2 [--profile bench/race-head-qwen/results.json]
                                           [--per-category N] [--order classes|mixed] [--out bench/replay-qwen]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import numpy as np

from edgespec.bench import oracle
from edgespec.bench.race import CLASSES, ORACLE_GOAL, oracle_share, shipped_items, structured_items
from edgespec.bench.run import describe_machine, setups
from edgespec.bench.stats_ci import LEVEL, geomean, geomean_interval
from edgespec.drafters import DrafterKind, DraftSources
from edgespec.drafters.suffix import SuffixHistory
from edgespec.drafters.table import build_drafters, spec_for
from edgespec.machine.profile import describe_curves
from edgespec.policy import NO_DRAFT, AcceptanceRecord, AdaptivePolicy, ShadowScorer
from edgespec.sampling import Sampler, SamplingParams
from edgespec.state import SpeculativeState
from edgespec.stats import GenerationStats


class ReplayedDraftModel:
    """Stands in for the draft model: the policy asks it only how much of the context it has not seen."""

    name = "draft"

    def __init__(self):
        self.seen = 0  # tokens of the context in its KV: none until auto first drafts with it

    def unseen(self, context: np.ndarray) -> int:
        return len(context) - self.seen


class PooledPolicy(AdaptivePolicy):
    """The ablation: auto as it was before evidence levels, every model-free proposal rated by its
    drafter's pooled estimate (prompt lookup after a 1-token match like one after a 4-token match)."""

    def rates_of(self, name, proposal):
        return super().rates_of(name, proposal) if proposal.confidence is not None else self.estimates[name].rates


class ApartPolicy(AdaptivePolicy):
    """The ablation: auto as it was before session 12, each proposal rated apart from the others (two
    that disagree can both look sure)."""

    def rate_proposals(self, proposals, k_cap):
        return [self.rates_of(d.name, p)[:min(len(p), k_cap)] for d, p in proposals]


class InformedPolicy(AdaptivePolicy):
    """Not an ablation but a reference: auto's own rule, told in advance what its estimates would
    converge to on this very text. Before the replay it watches the whole text once (every position's
    shadow proposals judged, nothing forgotten) and reads the draft model's per-position acceptance
    from the teacher-forced runs; during the replay it learns nothing more. The gap from auto to it is
    what better estimates of the same quantities could gain; the gap from it to the oracle is what
    only knowing each draft's outcome (not its odds) gains."""

    def learn_text(self, prompt: np.ndarray, text: np.ndarray, h: oracle.Hindsight) -> None:
        for r in (*self.estimates.values(), self.calibration):
            r.decay = 1.0
        n_prompt, n = len(prompt), len(text)
        context = np.concatenate([prompt, text]).astype(np.int32)
        state = SpeculativeState(context, n_prompt, n_prompt, n, Sampler(SamplingParams(temperature=0.0), 0),
                                 GenerationStats("auto"))
        for j in range(n):
            state.n = n_prompt + j
            self.choose(state)  # asks every model-free drafter there, as auto's rounds do
            super().observe(NO_DRAFT, 0, 0, text[j:j + 1])
            for level in self.by_evidence.values():
                level.decay = 1.0
        for d in self._models:  # P(position i passes | all before it passed), from the teacher-forced runs
            runs = h.accepted[d.name]
            reached = np.array([(runs >= i).sum() for i in range(self.k_max)], dtype=float)
            passed = np.array([(runs >= i + 1).sum() for i in range(self.k_max)], dtype=float)
            self.estimates[d.name].trials[:] = reached + 1.0
            self.estimates[d.name].assume((passed + 0.5) / (reached + 1.0))
        self.shadows = ShadowScorer()

    def observe(self, choice, n_drafted, n_accepted, emitted, *, pass_s=None) -> None:
        self.shadows.observe(self._round_start, np.asarray(emitted))  # drained, not learned from


class WholeRecordPolicy(AdaptivePolicy):
    """The ablation: auto starting from the acceptance record of the prompt before whatever its kind
    (the engine carries it only between kin prompts: AcceptanceRecord)."""


class ShallowPolicy(AdaptivePolicy):
    """The ablation: auto as it was before session 21, every pass priced at the profile's 64 held
    tokens (its online costs still learn from the passes' depth-priced times, as they learnt from the
    real passes' times)."""

    def _reach(self, held):
        pass


POLICIES = {"auto": AdaptivePolicy, "fresh": AdaptivePolicy, "whole": WholeRecordPolicy, "pooled": PooledPolicy,
            "apart": ApartPolicy, "shallow": ShallowPolicy, "informed": InformedPolicy}
FROM_PRIORS = ("fresh", "informed")  # the others start each prompt from their own record of the one before
VARIANTS = {"fresh": "auto starting every prompt from the priors, as a fresh process's first request does",
            "whole": "ablation: auto starting from the record of the prompt before, kin or not",
            "pooled": "ablation: lookup rated by its pooled record (no match-length levels)",
            "apart": "ablation: each proposal rated apart from the others (no exclusivity)",
            "shallow": "ablation: every pass priced at the profile's 64 held tokens (no depth)",
            "informed": "reference: auto told in advance the rates it would learn from the whole text "
                        "(what better estimates could gain; the rest of the oracle's gain needs each outcome)"}


@dataclass
class Replayed:
    seconds: dict[str, float]                        # priced time of each policy's rounds on the text
    plain_seconds: float                             # one verify(1) per token, at its depth
    oracle_seconds: float
    choices: dict[str, dict[str, int]] = field(default_factory=dict)  # policy -> "drafter:k" -> rounds
    # policy -> (drafter, k, tokens predicted, tokens emitted) of each model-free drafting round
    predicted: dict[str, list[tuple[str, int, float, int]]] = field(default_factory=dict)
    work_s: dict[str, float] = field(default_factory=dict)  # policy -> CPU time of its rounds (no model runs)

    def x(self, policy: str = "auto") -> float:
        return self.plain_seconds / self.seconds[policy]

    @property
    def oracle_x(self) -> float:
        return self.plain_seconds / self.oracle_seconds


def replay(policy: AdaptivePolicy, prompt: np.ndarray, text: np.ndarray, h: oracle.Hindsight,
           draft_confidence: np.ndarray | None, pricing: oracle.Pricing) -> tuple[float, dict[str, int], list]:
    """Auto's rounds on `text` (END-free), answered from the hindsight `h`; its priced seconds, choices
    and, per model-free drafting round, (drafter, k, tokens predicted, tokens emitted)."""
    n_prompt, n = len(prompt), len(text)
    context = np.zeros(n_prompt + n, dtype=np.int32)
    context[:n_prompt] = prompt
    state = SpeculativeState(context, n_prompt, n_prompt, n, Sampler(SamplingParams(temperature=0.0), 0),
                             GenerationStats("auto"))
    asks = sum(pricing.ask(d) for d in pricing.model_free)
    model = {d.name: d for d in policy.drafters if spec_for(d.name).kind is DrafterKind.MODEL}
    seconds, choices, predicted = 0.0, {}, []
    while state.n - n_prompt < n:
        j = state.n - n_prompt
        choice = policy.choose(state)
        name = choice.drafter.name if choice.drafter is not None else "none"
        k = choice.k if choice.drafter is not None else 0
        if name in model:
            if choice.gate is not None:  # the draft stops where its confidence gate says
                product = 1.0
                for i in range(k - 1):
                    confidence = float(draft_confidence[min(j + i, n - 1)])
                    product *= confidence
                    if not choice.gate(i + 1, confidence, product):
                        k = i + 1
                        break
            accepted = min(k, int(h.accepted[name][j]))
        elif k:
            draft = choice.draft if choice.draft is not None else choice.drafter.propose(state.committed, k, state.sampler)
            k = len(draft)
            accepted = oracle.accepted_run(draft.tokens, text, j, frozenset())
        else:
            accepted = 0
        pass_s = pricing.verify(k + 1, state.n)
        seconds += pass_s + asks + (pricing.draft(name, k) if name in model else 0.0)
        key = f"{name if k else 'none'}:{k}"
        choices[key] = choices.get(key, 0) + 1
        emitted = text[j:j + accepted + 1]
        if k and name not in model:  # the policy priced this round at what the replay charges for it
            predicted.append((name, k, choice.predicted_speed * (pass_s + pricing.ask(name)), len(emitted)))
        policy.observe(choice, k, accepted, emitted, pass_s=pass_s)
        context[state.n:state.n + len(emitted)] = emitted
        state.n += len(emitted)
        if name in model:
            model[name].seen = state.n - 1
    return seconds, choices, predicted


def plain_texts(engine, items, max_tokens: int, cache: Path) -> dict[str, list[int]]:
    """Plain greedy text of every item (the target runs here, once; kept in `cache`)."""
    from edgespec.engine import GenerationConfig

    texts = json.loads(cache.read_text()) if cache.exists() else {}
    for item in items:
        if item.id not in texts:
            engine.target.truncate(0)
            result = engine.generate_tokens(engine.prompt_tokens(item.messages),
                                            GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=0, mode="ar"))
            texts[item.id] = [int(t) for t in result.tokens]
            print(f"  plain text of {item.id}: {len(result.tokens)} tokens", file=sys.stderr, flush=True)
            cache.write_text(json.dumps(texts))
    return texts


def run(engine, profile, items, texts: dict[str, list[int]], k_max: int) -> dict[str, Replayed]:
    """Every item replayed in its group's order, each with the suffix history of the items before it."""
    model_free = tuple(n for n in engine.drafters if spec_for(n).kind is DrafterKind.COPIES)
    pricing = oracle.Pricing(profile, model_free)
    greedy = Sampler(SamplingParams(temperature=0.0), 0)
    out: dict[str, Replayed] = {}
    history: dict[str, list[list[int]]] = {}
    carried: dict[str, AcceptanceRecord] = {}  # policy -> the record the prompt before left it
    for item in items:
        prompt = np.asarray(engine.prompt_tokens(item.messages), dtype=np.int32)
        text = np.asarray(texts[item.id], dtype=np.int64)
        before = SuffixHistory(key=engine.history.key)
        for earlier in history.setdefault(item.group, []):
            before.add(np.asarray(earlier, dtype=np.int32))
        drafters = build_drafters(DraftSources(history=before))
        h = oracle.hindsight(prompt, text, frozenset(), k_max, model_free={n: drafters[n] for n in model_free},
                             sampler=greedy)
        confidence = None
        if engine.draft_runtime is not None:
            predicted, confidence = oracle.teacher_forced_confidence(engine.draft_runtime, prompt, text)
            h.accepted["draft"] = oracle.runs_of_matches(predicted, text)
        candidates = [drafters[n] for n in model_free] + ([ReplayedDraftModel()] if "draft" in h.accepted else [])
        # the engine's order: its drafters as the table builds them
        candidates.sort(key=lambda d: list(engine.drafters).index(d.name))
        best = oracle.oracle(h, pricing, k_max)
        out[item.id] = Replayed({}, best.plain_seconds, best.seconds)
        for name, cls in POLICIES.items():
            for d in candidates:
                if isinstance(d, ReplayedDraftModel):
                    d.seen = 0
            policy = cls(profile, *candidates, k_max=k_max)
            if isinstance(policy, InformedPolicy):
                policy.learn_text(prompt, text, h)
            record = carried.get(name)
            kin = record is not None and record.kin(prompt, engine.template_shares(prompt))
            if record is not None and name not in FROM_PRIORS and (name == "whole" or kin):
                policy.start_from(record)
            r, t = out[item.id], time.perf_counter()
            r.seconds[name], r.choices[name], r.predicted[name] = replay(policy, prompt, text, h, confidence, pricing)
            r.work_s[name] = time.perf_counter() - t
            carried[name] = policy.record(prompt)
        history[item.group].append(texts[item.id])
    return out


def summarize(items, replayed: dict[str, Replayed]) -> dict:
    by_class: dict[str, dict] = {}
    for cls in [c for c in CLASSES if any(i.category == c for i in items)] + ["overall"]:
        mine = [replayed[i.id] for i in items if cls in ("overall", i.category)]
        auto_x, oracle_x = geomean([r.x() for r in mine]), geomean([r.oracle_x for r in mine])
        by_class[cls] = {"prompts": len(mine), **oracle_share(auto_x, oracle_x),
                         "worst_auto_x": min(r.x() for r in mine)}
        for name in VARIANTS:
            by_class[cls][f"{name}_share"] = oracle_share(geomean([r.x(name) for r in mine]), oracle_x)["fraction"]
            by_class[cls] |= {f"{name}_x": geomean([r.x(name) for r in mine]),
                              f"worst_{name}_x": min(r.x(name) for r in mine),
                              f"auto_over_{name}": geomean_interval([r.x() / r.x(name) for r in mine]).__dict__}
    return by_class


K_BUCKETS = ((1, 3), (4, 8), (9, 1 << 30))


def work_per_round(replayed: dict[str, Replayed]) -> dict[str, dict]:
    """Per policy, its own CPU time a round in this replay: choosing (the model-free drafters' asks
    included) and learning, what a real round adds to its target pass (a single timing, not a race)."""
    out = {}
    for name in POLICIES:
        rounds = sum(sum(r.choices[name].values()) for r in replayed.values())
        out[name] = {"rounds": rounds, "us_per_round": 1e6 * sum(r.work_s[name] for r in replayed.values()) / rounds}
    return out


def calibration(replayed: dict[str, Replayed], policy: str) -> list[dict]:
    """Per model-free drafter and draft length, the tokens `policy` predicted its rounds would emit and
    those they did (means over every prompt's drafting rounds)."""
    rows = [p for r in replayed.values() for p in r.predicted.get(policy, [])]
    out = []
    for drafter in sorted({p[0] for p in rows}):
        for low, high in K_BUCKETS:
            mine = [p for p in rows if p[0] == drafter and low <= p[1] <= high]
            if mine:
                out.append({"drafter": drafter, "k": f"{low}-{high}" if high < 1 << 30 else f"{low}+",
                            "rounds": len(mine), "predicted": float(np.mean([p[2] for p in mine])),
                            "emitted": float(np.mean([p[3] for p in mine]))})
    return out


def render(doc: dict) -> str:
    lines = ["# Policy replay: auto's choices on plain's greedy text, priced (no timing noise)", "",
             f"Command: `{doc['command']}`  ", f"Machine (whose cost profile prices it): {doc['machine']['cpu']}; "
             f"profile: {describe_curves(doc['profile'])}"
             + (f"; draft {1e3 * doc['profile']['draft_s']:.1f} ms/token" if doc['profile'].get('draft_s') else ""), "",
             "Auto x plain and the oracle x plain are geometric means over prompts of priced speedups; share: "
             f"auto's gain as a fraction of the oracle's (goal {ORACLE_GOAL}). This is a model of a run, not a "
             "timing: bench/race.py measures the same policy in wall-clock time.", "",
             "Auto starts each prompt from the record of the one before where the two are kin (Engine.acceptance), "
             "else from the priors. Beside it: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items())
             + f". Auto / variant: geometric mean over prompts with a {LEVEL:.0%} bootstrap interval (prompts resampled).", "",
             "| class | prompts | auto x plain | worst prompt | " + " | ".join(f"{a} x plain | auto / {a}" for a in VARIANTS)
             + " | oracle x plain | auto's share of the oracle's gain | fresh's share | informed's share |",
             "|---|---:|---:|---:|" + "---:|---|" * len(VARIANTS) + "---:|---:|---:|---:|"]
    for cls, s in doc["summary"].items():
        share = " | ".join("-" if f is None else f"{f:.2f}"
                           for f in (s["fraction"], s["fresh_share"], s["informed_share"]))
        ablated = " | ".join(f"{s[a + '_x']:.3f} | {s['auto_over_' + a]['value']:.3f} ({s['auto_over_' + a]['low']:.3f}-"
                             f"{s['auto_over_' + a]['high']:.3f})" for a in VARIANTS)
        lines.append(f"| {cls} | {s['prompts']} | {s['auto_x']:.3f} | {s['worst_auto_x']:.3f} | {ablated} "
                     f"| {s['oracle_x']:.3f} | {share} |")
    lines += ["", "Calibration: per model-free drafter and draft length k, the tokens a round was predicted to emit "
              "(its predicted speed times its priced time) and the tokens it emitted, means over every prompt's "
              "drafting rounds.", "",
              "| policy | drafter | k | rounds | predicted | emitted |", "|---|---|---|---:|---:|---:|"]
    for policy, rows in doc["calibration"].items():
        lines += [f"| {policy} | {r['drafter']} | {r['k']} | {r['rounds']} | {r['predicted']:.2f} | {r['emitted']:.2f} |"
                  for r in rows]
    if "work_per_round" in doc:
        lines += ["", "Each policy's own work a round, timed in this replay (choosing, with the model-free drafters' "
                  "asks, and learning; no model runs; one timing, so a few per cent of noise): " + ", ".join(
                      f"{name} {w['us_per_round']:.0f} us over {w['rounds']} rounds" for name, w in doc["work_per_round"].items())
                  + ". A real round adds this to its target pass."]
    lines += ["", "| prompt | class | auto x plain | " + " | ".join(f"{a} x plain" for a in VARIANTS)
              + " | oracle x plain | auto chose (rounds per drafter:k) |",
              "|---|---|---:|" + "---:|" * len(VARIANTS) + "---:|---|"]
    for item_id, r in doc["prompts"].items():
        top = ", ".join(f"{k} {v}" for k, v in sorted(r["choices"].items(), key=lambda kv: -kv[1])[:4])
        ablated = " | ".join(f"{r[a + '_x']:.3f}" for a in VARIANTS)
        lines.append(f"| {item_id} | {r['category']} | {r['auto_x']:.3f} | {ablated} | {r['oracle_x']:.3f} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.policy_replay", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen", choices=("qwen", "smollm2"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--per-category", type=int, default=None, help="shipped prompts per category [all]")
    p.add_argument("--profile", type=Path, default=None,
                   help="a race's results.json whose cost profile prices the replay [measure one now]")
    p.add_argument("--order", choices=("classes", "mixed"), default="classes",
                   help="prompts class by class (the race's order) or one of each class in turn; matters to "
                        "auto, which starts a prompt from the record of the one before if they are kin")
    p.add_argument("--out", type=Path, default=Path("bench/out/replay"))
    args = p.parse_args(argv)

    from edgespec.engine import Engine
    from edgespec.machine.profile import CostProfile
    from edgespec.models import store

    t0 = time.time()
    [setup] = setups(args.models)
    engine = Engine.load(store.resolve(setup.target), setup.draft_path(), n_ctx=4096, n_threads=args.threads, trees=False)
    if args.profile:
        [profile_dict] = [v for k, v in json.loads(args.profile.read_text())["profiles"].items()
                          if k == f"{setup.name} t={args.threads}"]
        profile = CostProfile.from_dict(profile_dict)
    else:
        profile = engine.cost_profile(refresh=True)
    args.out.mkdir(parents=True, exist_ok=True)
    items = shipped_items(args.per_category) + structured_items()
    if args.order == "mixed":  # one prompt of each class in turn (each group's own order kept)
        by_class: dict[str, list] = {}
        for item in items:
            by_class.setdefault(item.category, []).append(item)
        items = [item for row in zip_longest(*by_class.values()) for item in row if item is not None]
    texts = plain_texts(engine, items, args.max_tokens, args.out / f"texts-{setup.name}.json")
    k_max = AdaptivePolicy(profile).k_max
    replayed = run(engine, profile, items, texts, k_max)
    engine.close()
    doc = {"command": "python -m edgespec.bench.policy_replay " + " ".join(argv), "machine": describe_machine(),
           "seconds": round(time.time() - t0, 1), "profile": profile.to_dict(),
           "summary": summarize(items, replayed),
           "calibration": {"auto": calibration(replayed, "auto")},
           "work_per_round": work_per_round(replayed),
           "prompts": {i.id: {"category": i.category, "auto_x": replayed[i.id].x(),
                              **{f"{a}_x": replayed[i.id].x(a) for a in VARIANTS},
                              "oracle_x": replayed[i.id].oracle_x, "choices": replayed[i.id].choices["auto"]}
                       for i in items}}
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "results.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
