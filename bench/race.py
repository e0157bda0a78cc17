"""The race, `edgespec bench`: every edgespec setting against plain decoding and llama.cpp's own C++
tools, prompt by prompt, with confidence intervals, a noise-free priced speedup and the oracle.

    edgespec bench [--models smollm2,qwen] [--repeats 5] [--max-tokens 96] [--threads 1]
                   [--classes chat,code] [--per-category N] [--ks 1,2,4,8] [--no-cpp] [--out bench/out]
    python -m edgespec.bench.race ...   (the same; also --from-runs, --systems, --limit)

Workloads, all greedy:
- the shipped prompts (bench/prompts.json): chat, code, grounded (answers that copy the input);
- multi-turn conversations whose turns repeat and edit earlier answers (bench/workloads.json:
  code review rounds, document edits, JSON edits); the assistant turns are the target's own greedy
  answers from this run (edgespec plain's first repeat);
- repeated structured requests (JSON extraction, tool calls), each a new request with nothing of
  the others in its context, so only drafting across requests can help.

Suffix drafting's history is, for every run of every system, exactly the outputs of the requests
before it in its workload (earlier shipped prompts, earlier turns of the conversation, earlier
structured requests), as a server that answered them in that order would hold; never the run's own.

Systems: edgespec `ar` (plain), `lookup` and `draft` at each k of --ks, `suffix`, `auto`; llama.cpp's
`llama-completion` (plain), `llama-speculative-simple` with the draft model and `llama-lookup`, at
--spec-draft-n-max in --cpp-ks, built from the llama.cpp that llama-cpp-python vendors (bench/llama_tools.py).

How it is measured, so that a 3 % difference shows:
- interleaved: every system runs a prompt before the next prompt starts, --repeats times (5), the
  order of the systems reversed every other repeat (forward, reverse, forward, ...), so a slow drift
  of the machine weighs on every system alike;
- speed is decode tokens/s as each system times itself (edgespec's stats: generated / decode_s; the C++
  tools' own timers); per prompt the median over repeats, and its ratio to edgespec plain's median;
- per class and overall the geometric mean of those ratios, with a 90 % bootstrap interval that
  resamples prompts within their class (bench/stats_ci.py, seeded). A claim such as "auto >= plain on
  code" is printed as holding only where the interval's lower bound is >= 1, "auto loses on chat"
  only where its upper bound is < 1, and "cannot tell" otherwise;
- priced: every edgespec run's target passes (stats.passes_by_rows) and drafting, priced by the cost
  profile auto itself uses (bench/oracle.py): a speedup with no timing noise in it, beside the
  wall-clock one;
- the oracle (bench/oracle.py): after each auto run, every drafter's acceptance at every position of
  its text (lookup and suffix from auto's shadow proposals, the draft model by one teacher-forced
  pass), and the cheapest any policy could have emitted that text at, by the same prices. Auto's gain
  as a share of the oracle's, per class: (plain/auto - 1) / (plain/oracle - 1) of the priced speedups'
  geometric means. Goal: >= 0.9 in every class.
Writes results.json (with every run), results.md, intervals.png and race_per_prompt.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from edgespec.bench.run import describe_machine, load_prompts, setups
from edgespec.bench.stats_ci import LEVEL, Interval, geomean, geomean_interval, verdict
from edgespec.machine.profile import describe_curves

CLASSES = ("chat", "code", "grounded", "multi-turn", "structured")
PLAIN = "edgespec ar"
AUTO = "edgespec auto"
CPP_PLAIN = "llama.cpp completion"
DEFAULT_REPEATS = 5
ORACLE_GOAL = 0.9       # auto's share of the oracle's gain, per class
AUTO_FLOOR = 0.97       # auto's interval lower bound against plain, per class


@dataclass
class Item:
    id: str
    category: str
    group: str                          # history is shared within a group, in order
    messages: list[dict]
    turn_of: str | None = None          # conversation id when the item is a later turn


@dataclass
class Run:
    system: str
    item: str
    category: str
    threads: int
    repeat: int
    tok_s: float | None
    ttft_s: float | None = None
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: list[int] = field(default_factory=list)
    chosen: dict = field(default_factory=dict)
    model: str = ""
    order: int = 0                      # its place among the systems in this repeat of this prompt
    priced_s: float | None = None       # the run's passes and drafting at the profile's prices (bench/oracle.py)
    priced_pass_s: float | None = None  # of which its target passes
    priced_tok_s: float | None = None   # generated / priced_s; edgespec runs only
    passes_by_rows: dict = field(default_factory=dict)
    finish_reason: str | None = None
    oracle: dict | None = None          # auto's runs: its priced speedup and the oracle's on its text


# --- workloads ---------------------------------------------------------------------------------

def load_workloads() -> dict:
    return json.loads(resources.files("edgespec.bench").joinpath("workloads.json").read_text(encoding="utf-8"))


def shipped_items(per_category: int | None) -> list[Item]:
    return [Item(p.id, p.category, "shipped", list(p.messages)) for p in load_prompts(per_category)]


def structured_items() -> list[Item]:
    return [Item(s["id"], s["category"], "structured", s["messages"]) for s in load_workloads()["structured"]]


# --- systems -------------------------------------------------------------------------------------

@contextmanager
def shadow_logging(engine, log: list):
    """Auto's policies made while inside keep every model-free proposal they ask for in `log`
    (AdaptivePolicy.shadow_log); other policies, and the engine outside, are untouched."""
    policy_for = engine.policy_for

    def logged(config, prompt=()):
        mode, policy = policy_for(config, prompt)
        if hasattr(policy, "shadow_log"):
            policy.shadow_log = log
        return mode, policy

    engine.policy_for = logged  # an instance attribute over the method, removed below
    try:
        yield log
    finally:
        del engine.policy_for


class AutoOracle:
    """The oracle of one setup's auto runs: its prices and the drafters it re-asks (bench/oracle.py)."""

    def __init__(self, engine):
        from edgespec.bench.oracle import Pricing
        from edgespec.drafters import DrafterKind
        from edgespec.drafters.table import spec_for
        from edgespec.policy import AdaptivePolicy

        self.engine = engine
        profile = engine.cost_profile()
        self.model_free = tuple(n for n in engine.drafters if spec_for(n).kind is DrafterKind.COPIES)
        self.pricing = Pricing(profile, self.model_free)
        self.k_max = AdaptivePolicy(profile).k_max  # the longest draft auto may choose
        self._teacher: dict[tuple, object] = {}     # the draft model's predictions, per (prompt, text)

    def priced(self, stats) -> dict:
        seconds = self.pricing.run_seconds(stats)
        return {"priced_s": seconds, "priced_tok_s": stats.generated / seconds if seconds > 0 and stats.generated else None,
                "priced_pass_s": self.pricing.passes_seconds(stats)}

    def judge(self, ids: list[int], history: list[list[int]], result, shadow_log: list, grammar=None,
              max_tokens: int = 0) -> dict:
        """Auto's priced speedup on its own text, and the oracle's (all drafters, each alone, and one never
        wrong). `grammar`: under a constraint, a function that makes the run's Grammar at the prompt's end;
        then every round of a path leads with the tokens it forces (`max_tokens`: the run's, which caps
        them as the engine does) and the draft model predicts from masked rows."""
        import numpy as np

        from edgespec.bench import oracle
        from edgespec.drafters import DraftSources
        from edgespec.drafters.suffix import SuffixHistory
        from edgespec.drafters.table import build_drafters
        from edgespec.engine import FORCED_MAX
        from edgespec.sampling import Sampler, SamplingParams

        engine = self.engine
        eog = engine.target.vocab.eog
        text = oracle.with_end(result.tokens, result.finish_reason == "stop")
        before = SuffixHistory(key=engine.history.key)  # the history as it stood when the run began
        for output in history:
            before.add(output)
        drafters = build_drafters(DraftSources(history=before))
        h = oracle.hindsight(ids, text, eog, self.k_max, shadow_log=shadow_log,
                             model_free={n: drafters[n] for n in self.model_free},
                             sampler=Sampler(SamplingParams(temperature=0.0), 0))
        if grammar is not None:
            h.forced, h.forced_kept = oracle.forced_runs(grammar(), text, max_tokens, FORCED_MAX)
        if engine.draft_runtime is not None:
            key = (tuple(ids), tuple(text.tolist()), grammar is not None)
            if key not in self._teacher:
                self._teacher[key] = oracle.runs_of_matches(oracle.teacher_forced(
                    engine.draft_runtime, ids, text, eog, grammar=grammar() if grammar is not None else None), text)
            h.accepted["draft"] = self._teacher[key]
        best = oracle.oracle(h, self.pricing, self.k_max)
        auto_s = self.pricing.run_seconds(result.stats)
        out = {"auto_x": best.plain_seconds / auto_s, "oracle_x": best.speedup,
               "auto_priced_s": auto_s, "oracle_s": best.seconds,
               "plain_priced_s": best.plain_seconds, "oracle_choices": best.choices,
               "oracle_x_alone": {d: oracle.oracle(h, self.pricing, self.k_max, [d]).speedup for d in h.accepted},
               "shadow_positions": h.recorded, "shadow_agree": h.agree}
        if self.model_free:  # the cost curve's own ceiling on this text: a drafter that proposes the text itself,
            # priced as the cheapest ask, so that it matches any move of the oracle's for no more
            cheapest = min(self.model_free, key=self.pricing.ask)
            never_wrong = replace(h, accepted={cheapest: np.full(len(text), len(text), dtype=np.int64)})
            out["never_wrong_x"] = oracle.oracle(never_wrong, self.pricing, self.k_max).speedup
        return out


def edgespec_run(engine, name: str, mode: str, k: int | None, ids: list[int], history: list[list[int]],
                 max_tokens: int, hindsight: AutoOracle | None = None, acceptance=None) -> dict:
    """One timed run. `acceptance`: the record auto starts from (Engine.acceptance; None: the priors)."""
    from edgespec.engine import GenerationConfig

    engine.acceptance = acceptance
    engine.target.truncate(0)  # no system reuses a previous run's prompt KV
    if engine.draft_runtime is not None:
        engine.draft_runtime.truncate(0)
    engine.history.clear()
    for output in history:
        engine.history.add(output)
    config = GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=0, mode=mode, draft_max=k)
    with shadow_logging(engine, []) as shadow_log:
        result = engine.generate_tokens(ids, config)
    s = result.stats
    out = {"tok_s": s.tokens_per_s or None, "ttft_s": s.ttft_s, "generated": s.generated, "drafted": s.drafted,
           "accepted": s.accepted, "tokens": result.tokens, "chosen": dict(s.chosen),
           "passes_by_rows": {str(n): c for n, c in sorted(s.passes_by_rows.items())},
           "finish_reason": result.finish_reason}
    if hindsight is not None:
        out.update(hindsight.priced(s))
        if mode == "auto":  # after the timed run: nothing of the oracle is in its time
            out["oracle"] = hindsight.judge(ids, history, result, shadow_log)
    return out


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")


def cpp_run(tool: Path, args: list[str], prompt_text: str, *, threads: int, ctx: int, max_tokens: int) -> dict:
    """One run of a llama.cpp tool on a prompt file; its own timers give the decode speed."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(prompt_text)
    try:
        cmd = [str(tool), *args, "-f", f.name, "-n", str(max_tokens), "--temp", "0", "-t", str(threads),
               "-tb", str(threads), "-c", str(ctx), "--seed", "0"]
        if tool.name == "llama-completion":
            cmd += ["-no-cnv", "--no-display-prompt", "--no-warmup"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    finally:
        os.unlink(f.name)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{tool.name} failed ({proc.returncode}): {log[-400:]}")
    m = _DECODED.search(log)
    if m:
        n, secs = int(m.group(1)), float(m.group(2))
    else:
        m = _EVAL.search(log)
        if not m:
            raise RuntimeError(f"{tool.name}: no timing line in its output: {log[-400:]}")
        secs, n = float(m.group(1)) / 1000, int(m.group(2))
    drafted, accepted = _DRAFTED.search(log), _ACCEPT.search(log)
    return {"tok_s": n / secs if secs > 0 else None, "generated": n,
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0}


def repeat_order(systems: list, repeat: int) -> list:
    """The systems in the order one repeat runs them: forward on even repeats, reversed on odd ones."""
    return list(systems) if repeat % 2 == 0 else list(reversed(systems))


# --- the run ---------------------------------------------------------------------------------------

def run_model(setup, args, threads: int, log, record=None) -> tuple[list[Run], dict]:
    """Every item of the workloads, raced; returns the runs and the cost profile that priced them."""
    from edgespec.engine import Engine
    from edgespec.models import store

    target = store.resolve(setup.target)
    draft = setup.draft_path()
    engine = Engine.load(target, draft, n_ctx=args.ctx, n_threads=threads, trees=False)
    engine.cost_profile(refresh=True)  # measured in this run's conditions, before any timed run
    hindsight = AutoOracle(engine)
    systems: list[tuple] = ([("edgespec", PLAIN, "ar", None)]
                            + [("edgespec", f"edgespec lookup k={k}", "lookup", k) for k in args.ks]
                            + [("edgespec", f"edgespec draft k={k}", "draft", k) for k in args.ks]
                            + [("edgespec", "edgespec suffix", "suffix", None), ("edgespec", AUTO, "auto", None)])
    cpp_systems = [] if args.no_cpp else (
        [(CPP_PLAIN, "llama-completion", ["-m", str(target)])]
        + [(f"llama.cpp speculative n={k}", "llama-speculative-simple",
            ["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
             "--spec-draft-n-min", "0"]) for k in args.cpp_ks]
        + [(f"llama.cpp lookup n={k}", "llama-lookup", ["-m", str(target), "--spec-draft-n-max", str(k)])
           for k in args.cpp_ks])
    if args.systems:  # a re-measure of a few systems; plain (every ratio's base) and auto always run
        systems = [s for s in systems if s[1] in (PLAIN, AUTO) or s[1] in args.systems]
        cpp_systems = [s for s in cpp_systems if s[0] in args.systems]
    if cpp_systems:
        from edgespec.bench.llama_tools import ensure_tools

        tools = ensure_tools(tuple(dict.fromkeys(tool for _, tool, _ in cpp_systems)))
        systems += [("cpp", name, tools / tool, tool_args) for name, tool, tool_args in cpp_systems]

    wanted = set(args.classes or CLASSES)
    conversations = [c for c in load_workloads()["conversations"][:args.limit] if c["category"] in wanted]
    per_category = min(args.per_category or args.limit, args.limit) if args.limit else args.per_category
    groups: list[list[Item]] = [[i for i in group if i.category in wanted]
                                for group in (shipped_items(per_category), structured_items()[:args.limit])]
    runs: list[Run] = _Recorded(record)
    references: dict[str, list[int]] = {}

    # Auto starts each prompt from what its first run of the prompt before learned (Engine.acceptance),
    # as a server's next request would; never from its own earlier repeats, which knew this very text.
    acceptance = {"before": None, "after": None}

    def race(item: Item, history: list[list[int]]) -> None:
        ids = engine.prompt_tokens(item.messages)
        text = engine.prompt_text(item.messages)
        for repeat in range(args.repeats):
            for order, (family, name, mode_or_tool, k_or_args) in enumerate(repeat_order(systems, repeat)):
                where = dict(system=name, item=item.id, category=item.category, threads=threads, repeat=repeat,
                             model=setup.name, order=order)
                if family == "edgespec":
                    out = edgespec_run(engine, name, mode_or_tool, k_or_args, ids, history, args.max_tokens, hindsight,
                                       acceptance["before"])
                    if name == PLAIN and item.id not in references:
                        references[item.id] = out["tokens"]
                    if name == AUTO and repeat == 0:
                        acceptance["after"] = engine.acceptance
                else:
                    try:
                        out = cpp_run(mode_or_tool, k_or_args, text, threads=threads, ctx=args.ctx,
                                      max_tokens=args.max_tokens)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"  {name} on {item.id}: {e}", file=log)
                        continue
                runs.append(Run(**where, **out))
        mine = [r for r in runs if r.item == item.id and r.threads == threads and r.model == setup.name]
        plain = statistics.median([r.tok_s for r in mine if r.system == PLAIN and r.tok_s])
        auto = statistics.median([r.tok_s for r in mine if r.system == AUTO and r.tok_s])
        print(f"  {setup.name} t={threads} {item.id}: plain {plain:.1f} tok/s, auto {auto / plain:.2f}x", file=log,
              flush=True)
        acceptance["before"] = acceptance["after"]

    for group in groups:
        for i, item in enumerate(group):
            race(item, [references[g.id] for g in group[:i]])
    for conv in conversations:
        messages: list[dict] = []
        done: list[str] = []
        for t, turn in enumerate(conv["turns"][:args.limit]):
            messages = messages + [{"role": "user", "content": turn}]
            item = Item(f"{conv['id']}-t{t + 1}", conv["category"], conv["id"], messages,
                        turn_of=conv["id"] if t else None)
            race(item, [references[d] for d in done])
            answer = b"".join(engine.target.token_bytes(x) for x in references[item.id]).decode("utf-8", "replace")
            messages = messages + [{"role": "assistant", "content": answer}]
            done.append(item.id)
    profile = engine.cost_profile().to_dict()
    engine.close()
    return runs, profile


class _Recorded(list):
    """A list of runs that also appends each run to a JSON-lines file as it comes, so a run that is
    stopped early can still be summarised (--from-runs)."""

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path

    def append(self, run: Run) -> None:
        super().append(run)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(run.__dict__) + "\n")


# --- summary -----------------------------------------------------------------------------------

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if a and b else None


def _interval(ratios_by_class: dict[str, list[float | None]]) -> Interval | None:
    clean = {c: [r for r in rs if r] for c, rs in ratios_by_class.items()}
    return geomean_interval(clean) if any(clean.values()) else None


def _geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return geomean(xs) if xs else None


def claim(cls: str, interval: Interval | None, priced: Interval | None = None, system: str = "auto") -> dict:
    """The one claim an interval allows about `system` against plain on `cls` (with the priced speedup beside)."""
    v = verdict(interval) if interval else "cannot tell"
    where = "overall" if cls == "overall" else f"on {cls}"
    text = {"holds": f"{system} >= plain {where}", "loses": f"{system} loses {where}",
            "cannot tell": f"{system} vs plain {where}: cannot tell"}[v]
    return {"class": cls, "verdict": v, "claim": text, "interval": interval.to_dict() if interval else None,
            "priced": priced.to_dict() if priced else None}


def oracle_share(auto_x: float | None, oracle_x: float | None) -> dict:
    """Auto's priced gain over plain as a share of the oracle's, and whether it meets ORACLE_GOAL."""
    if auto_x is None or oracle_x is None:
        return {"auto_x": auto_x, "oracle_x": oracle_x, "fraction": None, "met": None}
    gain, limit = auto_x - 1.0, oracle_x - 1.0
    fraction = gain / limit if limit > 0 else None
    return {"auto_x": auto_x, "oracle_x": oracle_x, "fraction": fraction,
            "met": gain >= ORACLE_GOAL * limit if limit > 0 else None}


def summarize(runs: list[Run]) -> dict:
    """Per (model, threads): per prompt, each system's median tok/s and its ratio to plain (wall-clock
    and priced) and the oracle's figures; per class and overall, geometric means with 90 % intervals,
    the claims they allow, the best fixed setting, and auto's share of the oracle's gain."""
    out = {}
    for key in sorted({(r.model, r.threads) for r in runs}):
        mine = [r for r in runs if (r.model, r.threads) == key]
        systems = sorted({r.system for r in mine}, key=lambda s: (not s.startswith("edgespec"), s))
        items = list(dict.fromkeys(r.item for r in mine))
        category = {r.item: r.category for r in mine}

        def med(s, i, attr):
            return _median([getattr(r, attr) for r in mine if r.system == s and r.item == i])

        speed = {(s, i): med(s, i, "tok_s") for s in systems for i in items}
        priced = {(s, i): med(s, i, "priced_tok_s") for s in systems for i in items}
        ttft = {(s, i): med(s, i, "ttft_s") for s in (PLAIN, AUTO) for i in items}
        ratio = {(s, i): _ratio(speed[s, i], speed[PLAIN, i]) for s in systems for i in items}
        priced_ratio = {(s, i): _ratio(priced[s, i], priced[PLAIN, i]) for s in systems for i in items}
        oracles = {i: [r.oracle for r in mine if r.system == AUTO and r.item == i and r.oracle] for i in items}
        auto_x = {i: _median([o["auto_x"] for o in oracles[i]]) for i in items}
        oracle_x = {i: _median([o["oracle_x"] for o in oracles[i]]) for i in items}
        fixed = [s for s in systems if s.startswith("edgespec ") and s not in (PLAIN, AUTO)]
        cpp = [s for s in systems if s.startswith("llama.cpp") and s != CPP_PLAIN]
        present = [c for c in CLASSES if any(category[i] == c for i in items)]
        by_class = {c: [i for i in items if category[i] == c] for c in present}

        def group(ids_by_class: dict[str, list[str]]) -> dict:
            ids = [i for ids in ids_by_class.values() for i in ids]
            x = {s: _interval({c: [ratio[s, i] for i in ids] for c, ids in ids_by_class.items()}) for s in systems}
            px = {s: _interval({c: [priced_ratio[s, i] for i in ids] for c, ids in ids_by_class.items()})
                  for s in systems}
            value = {s: x[s].value if x[s] else None for s in systems}
            best_fixed = max(fixed, key=lambda s: value[s] or 0) if fixed else None
            best_cpp = max(cpp, key=lambda s: value[s] or 0) if cpp else None
            return {
                "prompts": len(ids), "plain_tok_s": _median([speed[PLAIN, i] for i in ids]),
                "x_plain": {s: x[s].to_dict() if x[s] else None for s in systems},
                "priced_x_plain": {s: px[s].to_dict() if px[s] else None for s in systems},
                "best_fixed": best_fixed, "auto_vs_best_fixed": _ratio(value[AUTO], value.get(best_fixed)),
                "best_cpp": best_cpp, "auto_vs_best_cpp": _ratio(value[AUTO], value.get(best_cpp)),
                "plain_vs_cpp_plain": _geomean([_ratio(speed[PLAIN, i], speed.get((CPP_PLAIN, i))) for i in ids]),
                "auto_ttft_x_plain": _median([_ratio(ttft[AUTO, i], ttft[PLAIN, i]) for i in ids]),
                "auto_min_x_plain": min((ratio[AUTO, i] for i in ids if ratio[AUTO, i]), default=None),
                "oracle": oracle_share(_geomean([auto_x[i] for i in ids]), _geomean([oracle_x[i] for i in ids])),
            }

        classes = {c: group({c: ids}) for c, ids in by_class.items()}
        overall = group(by_class)
        def auto_claim(cls: str, ids_by_class: dict[str, list[str]]) -> dict:
            return claim(cls, _interval({c: [ratio[AUTO, i] for i in ids] for c, ids in ids_by_class.items()}),
                         _interval({c: [priced_ratio[AUTO, i] for i in ids] for c, ids in ids_by_class.items()}))

        claims = [auto_claim(c, {c: ids}) for c, ids in by_class.items()] + [auto_claim("overall", by_class)]
        identical = [i for i in items if _tokens(mine, AUTO, i) == _tokens(mine, PLAIN, i)]
        out[f"{key[0]} t={key[1]}"] = {
            "classes": classes, "overall": overall, "claims": claims, "systems": systems,
            "per_prompt": {i: {"category": category[i], "plain_tok_s": speed[PLAIN, i],
                               "x_plain": {s: ratio[s, i] for s in systems},
                               "priced_x_plain": {s: priced_ratio[s, i] for s in systems},
                               "oracle": {"auto_x": auto_x[i], "oracle_x": oracle_x[i],
                                          "choices": _merged([o["oracle_choices"] for o in oracles[i]]),
                                          "alone": {d: _median([o["oracle_x_alone"][d] for o in oracles[i]])
                                                    for d in (oracles[i][0]["oracle_x_alone"] if oracles[i] else {})}},
                               "auto_chose": _merged([r.chosen for r in mine if r.system == AUTO and r.item == i])}
                           for i in items},
            "auto_identical_to_plain": f"{len(identical)}/{len(items)}",
        }
    return out


def _tokens(runs, system, item):
    return next((r.tokens for r in runs if r.system == system and r.item == item and r.repeat == 0), None)


def _merged(counts: list[dict]) -> dict:
    total: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            total[k] = total.get(k, 0) + n
    return total


GOALS = (  # (claim, class or None for every prompt, value key, threshold, met when value >= threshold)
    ("auto >= 0.97x plain on every prompt", None, "auto_min_x_plain", 0.97, True),
    (f"auto's {LEVEL:.0%} interval lower bound >= {AUTO_FLOOR}x plain, per class", "*", "auto_low", AUTO_FLOOR, True),
    (f"auto >= {ORACLE_GOAL} of the oracle's gain (priced), per class", "*", "oracle_fraction", ORACLE_GOAL, True),
    ("auto >= 0.97x the best fixed setting, per class", "*", "auto_vs_best_fixed", 0.97, True),
    ("grounded prompts >= 1.6x plain", "grounded", "auto", 1.6, True),
    ("multi-turn edit conversations >= 3x plain", "multi-turn", "auto", 3.0, True),
    ("repeated structured requests >= 1.5x plain", "structured", "auto", 1.5, True),
    ("edgespec plain >= 0.95x llama.cpp plain", "*", "plain_vs_cpp_plain", 0.95, True),
    ("auto >= every llama.cpp tool's best setting, per class", "*", "auto_vs_best_cpp", 1.0, True),
    ("auto's TTFT within 5 % of plain's, per class (median)", "*", "auto_ttft_x_plain", 1.05, False),
)


def _goal_value(data: dict, key: str):
    auto = data["x_plain"].get(AUTO)
    if key == "auto":
        return auto and auto["value"]
    if key == "auto_low":
        return auto and auto["low"]
    if key == "oracle_fraction":
        return data["oracle"]["fraction"]
    return data.get(key)


def goals(summary: dict) -> list[dict]:
    rows = []
    for setup, s in summary.items():
        for text, cls, key, threshold, at_least in GOALS:
            targets = s["classes"].items() if cls in (None, "*") else [(cls, s["classes"].get(cls))]
            for c, data in targets:
                value = _goal_value(data, key) if data else None
                if value is None:
                    continue
                rows.append({"setup": setup, "claim": text, "class": c, "value": round(value, 3),
                             "threshold": threshold, "met": value >= threshold if at_least else value <= threshold})
    return rows


def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(d: dict | None) -> str:
    return "-" if not d else f"{d['value']:.3f} ({d['low']:.3f}-{d['high']:.3f})"


def claim_lines(summary: dict) -> list[str]:
    lines = []
    for setup, s in summary.items():
        for c in s["claims"]:
            ci = c["interval"]
            detail = f" ({_ci(ci)}, {LEVEL:.0%} interval, {ci['n']} prompts)" if ci else ""
            priced = f"; priced {c['priced']['value']:.3f}" if c.get("priced") else ""
            lines.append(f"{setup}: {c['claim']}{detail}{priced}")
    return lines


def render(doc: dict) -> str:
    m = doc["machine"]
    lines = ["# Race: edgespec against plain decoding, every fixed setting and llama.cpp's own tools", "",
             f"Command: `{doc['command']}`  ", f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, "
             f"{m['ram_gib']} GiB; load average at start {m['load_average_start']}, at end "
             f"{doc['load_average_end']}; {doc['seconds']:.0f} s in all.", "", doc["timing"], "",
             "## Claims", "", *[f"- {line}" for line in claim_lines(doc["summary"])], ""]
    for setup, s in doc["summary"].items():
        groups = {**s["classes"], "overall": s["overall"]}
        lines += [f"## {setup}", "",
                  f"Geometric mean over prompts of x plain ({LEVEL:.0%} interval); priced: the same runs' passes "
                  "at the cost profile's prices (no timing noise); oracle: the cheapest any policy could have "
                  "emitted auto's text at, by the same prices.", "",
                  "| class | prompts | plain tok/s | auto x plain | auto priced | oracle priced | auto's share of "
                  "the oracle's gain | best fixed | auto / best fixed | best llama.cpp tool | auto / it | "
                  "plain / llama.cpp plain |",
                  "|---|---:|---:|---|---|---:|---:|---|---:|---|---:|---:|"]
        for c, d in groups.items():
            o = d["oracle"]
            best = d["best_fixed"]
            lines.append(
                f"| {c} | {d['prompts']} | {_f(d['plain_tok_s'])} | {_ci(d['x_plain'].get(AUTO))} | "
                f"{_ci(d['priced_x_plain'].get(AUTO))} | {_f(o['oracle_x'], 3)} | "
                f"{_f(o['fraction'], 2)}{'' if o['met'] is None else (' met' if o['met'] else ' **not met**')} | "
                f"{best or '-'} {_f((d['x_plain'].get(best) or {}).get('value'), 2)} | {_f(d['auto_vs_best_fixed'], 2)} | "
                f"{d['best_cpp'] or '-'} | {_f(d['auto_vs_best_cpp'], 2)} | {_f(d['plain_vs_cpp_plain'], 2)} |")
        lines += ["", f"Greedy auto output identical to plain on {s['auto_identical_to_plain']} prompts "
                  "(divergences are batch-vs-single-token near-ties; see bench/batch_numerics.py).", "",
                  f"Every system, x plain per class: wall-clock geometric mean ({LEVEL:.0%} interval) / priced:", "",
                  "| system | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for name in s["systems"]:
            cells = []
            for d in groups.values():
                wall, price = d["x_plain"].get(name), d["priced_x_plain"].get(name)
                cells.append(_ci(wall) + (f" / {price['value']:.3f}" if price else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "Per prompt (medians over repeats; oracle: its priced speedup, each drafter alone, its "
                  "rounds per drafter:k; auto chose: rounds per drafter:k):", "",
                  "| prompt | class | plain tok/s | auto | auto priced | oracle priced | oracle alone | "
                  "best fixed | auto chose | oracle chose |", "|---|---|---:|---:|---:|---:|---|---|---|---|"]
        for i, p in s["per_prompt"].items():
            fixed = {k: v for k, v in p["x_plain"].items() if k.startswith("edgespec ") and k not in (PLAIN, AUTO)}
            best = max(fixed, key=lambda k: fixed[k] or 0, default=None)
            o = p["oracle"]
            alone = ", ".join(f"{d} {_f(x, 2)}" for d, x in o["alone"].items())
            lines.append(f"| {i} | {p['category']} | {_f(p['plain_tok_s'])} | {_f(p['x_plain'][AUTO], 2)} | "
                         f"{_f(p['priced_x_plain'][AUTO], 3)} | {_f(o['oracle_x'], 3)} | {alone} | "
                         f"{best or '-'} {_f(fixed.get(best), 2)} | {_top(p['auto_chose'])} | {_top(o['choices'])} |")
        lines.append("")
    lines += ["## Goals (issues 17 and 23)", "", "| setup | claim | class | value | goal | met |",
              "|---|---|---|---:|---:|---|"]
    for g in doc["goals"]:
        lines.append(f"| {g['setup']} | {g['claim']} | {g['class']} | {g['value']:.3f} | {g['threshold']} | "
                     f"{'yes' if g['met'] else '**no**'} |")
    lines += ["", "Cost profile (seconds per target pass of n rows, per draft-model token, per model-free ask):", ""]
    for setup, profile in doc.get("profiles", {}).items():
        lines.append(f"- {setup}: {describe_curves(profile)}; draft {_f((profile.get('draft_s') or 0) * 1000, 2)} ms; lookup "
                     f"{_f(profile.get('lookup_s', 0) * 1e6, 0)} us; suffix {_f(profile.get('suffix_s', 0) * 1e6, 0)} us")
    return "\n".join(lines) + "\n"


def _top(counts: dict, n: int = 3) -> str:
    return ", ".join(f"{k} {c}" for k, c in sorted(counts.items(), key=lambda kv: -kv[1])[:n])


def plot(doc: dict, out: Path) -> None:
    """intervals.png: per class, auto's (and the best fixed setting's) geometric mean x plain with its
    interval, the priced speedup and the oracle's; race_per_prompt.png: auto per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups_ = list(doc["summary"].items())
    fig, axes = plt.subplots(len(setups_), 1, figsize=(10, 4 * len(setups_)), squeeze=False)
    for ax, (setup, s) in zip(axes[:, 0], setups_):
        groups = {**s["classes"], "overall": s["overall"]}
        xs = list(range(len(groups)))
        for offset, (label, pick, color) in enumerate((
                ("edgespec auto", lambda d: d["x_plain"].get(AUTO), "tab:blue"),
                ("best fixed setting", lambda d: d["x_plain"].get(d["best_fixed"]), "tab:orange"))):
            pts = [pick(d) for d in groups.values()]
            xo = [x + (offset - 0.5) * 0.25 for x in xs]
            ok = [(x, p) for x, p in zip(xo, pts) if p]
            if ok:
                ax.errorbar([x for x, _ in ok], [p["value"] for _, p in ok],
                            yerr=[[p["value"] - p["low"] for _, p in ok], [p["high"] - p["value"] for _, p in ok]],
                            fmt="o", color=color, capsize=4, label=f"{label} ({LEVEL:.0%} interval)")
        priced = [(x, (d["priced_x_plain"].get(AUTO) or {}).get("value")) for x, d in zip(xs, groups.values())]
        ax.scatter([x - 0.125 for x, v in priced if v], [v for _, v in priced if v], marker="_", s=300,
                   color="tab:green", label="auto, priced (noise-free)")
        oracle = [(x, d["oracle"]["oracle_x"]) for x, d in zip(xs, groups.values())]
        ax.scatter([x for x, v in oracle if v], [v for _, v in oracle if v], marker="*", s=120, color="tab:red",
                   label="oracle, priced")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(xs, list(groups))
        ax.set_ylabel("decode tok/s x edgespec plain (geometric mean)")
        ax.set_title(setup)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "intervals.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(setups_), 1, figsize=(14, 4.2 * len(setups_)), squeeze=False)
    for ax, (setup, s) in zip(axes[:, 0], setups_):
        items = list(s["per_prompt"])
        xs = range(len(items))
        auto = [s["per_prompt"][i]["x_plain"][AUTO] or 0 for i in items]
        best_fixed = [max([(v or 0) for k, v in s["per_prompt"][i]["x_plain"].items()
                           if k.startswith("edgespec ") and k not in (PLAIN, AUTO)] or [0]) for i in items]
        best_cpp = [max([(v or 0) for k, v in s["per_prompt"][i]["x_plain"].items()
                         if k.startswith("llama.cpp") and k != CPP_PLAIN] or [0]) for i in items]
        ax.bar(xs, auto, color="tab:blue", label="edgespec auto")
        ax.scatter(xs, best_fixed, color="tab:orange", marker="_", s=300, label="best fixed edgespec setting")
        ax.scatter(xs, best_cpp, color="tab:red", marker="x", label="best llama.cpp tool")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(xs), items, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("decode tok/s x edgespec plain")
        ax.set_title(setup)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "race_per_prompt.png", dpi=110)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.race", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,qwen", help="comma list of smollm2, qwen")
    p.add_argument("--threads", default="1", help="comma list of thread counts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="runs of every system on every prompt, the order reversed every other repeat")
    p.add_argument("--classes", default="", help=f"comma list of classes to run ({', '.join(CLASSES)}); default all")
    p.add_argument("--per-category", type=int, default=None, help="shipped prompts per category [all]")
    p.add_argument("--ks", default="1,2,4,8", help="fixed draft lengths for edgespec lookup and draft")
    p.add_argument("--cpp-ks", default="2,4,8", help="--spec-draft-n-max values for llama.cpp's speculative tools")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--no-cpp", action="store_true", help="skip llama.cpp's C++ tools")
    p.add_argument("--systems", default="", help="comma list of system names to run (e.g. 'edgespec lookup k=2'); "
                   "default all; edgespec plain and auto always run")
    p.add_argument("--limit", type=int, default=None, help="a quick check: at most this many shipped prompts per "
                   "category, structured requests, conversations and turns")
    p.add_argument("--out", type=Path, default=Path("bench/out/race"))
    p.add_argument("--from-runs", type=Path, nargs="+", default=None,
                   help="summarise runs.jsonl files of earlier (possibly stopped) runs instead of running")
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.cpp_ks = [int(k) for k in args.cpp_ks.split(",") if k]
    args.systems = {name.strip() for name in args.systems.split(",") if name.strip()}
    args.classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = set(args.classes) - set(CLASSES)
    if unknown:
        p.error(f"unknown classes {sorted(unknown)}; use {', '.join(CLASSES)}")
    if args.repeats < 1 or args.max_tokens < 2:
        p.error("need --repeats >= 1 and --max-tokens >= 2")
    return args


TIMING = ("Decode tok/s = generated tokens / decode time, prefill excluded, as each system times itself "
          "(edgespec: stats.tokens_per_s; llama-speculative-simple and llama-lookup: 'decoded N tokens in T s'; "
          "llama-completion: llama_perf 'eval time'). Greedy, one process per C++ run (its load and prefill are "
          "outside its timer). KV reset before every edgespec run; the suffix history holds only earlier "
          "requests' outputs, and auto's acceptance record (used where a prompt is kin to the one before) "
          "only what its first run of the prompt before learned. Every system runs a prompt before the next prompt starts, the systems' order "
          "reversed every other repeat. Per prompt the median over repeats and its ratio to edgespec plain's; "
          f"per class the geometric mean of those ratios with a {LEVEL:.0%} bootstrap interval (prompts "
          "resampled within their class, seeded; bench/stats_ci.py). Priced: each edgespec run's passes and "
          "drafting at the prices of the cost profile auto used (bench/oracle.py), with no timing noise.")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.time()
    machine = describe_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    profiles: dict[str, dict] = {}
    if args.from_runs:
        for path in args.from_runs:
            runs += [Run(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    else:
        record = args.out / "runs.jsonl"
        record.unlink(missing_ok=True)
        for name in args.models.split(","):
            [setup] = setups(name)
            for threads in [int(t) for t in args.threads.split(",")]:
                print(f"{setup.name}, {threads} thread(s)", file=sys.stderr, flush=True)
                got, profiles[f"{setup.name} t={threads}"] = run_model(setup, args, threads, sys.stderr, record)
                runs += got
    summary = summarize(runs)
    doc = {"command": "python -m edgespec.bench.race " + " ".join(argv), "machine": machine, "timing": TIMING,
           "seconds": time.time() - t0, "load_average_end": [round(x, 2) for x in os.getloadavg()],
           "summary": summary, "profiles": profiles}
    doc["goals"] = goals(summary)
    (args.out / "results.json").write_text(json.dumps({**doc, "runs": [r.__dict__ for r in runs]}, indent=1))
    (args.out / "results.md").write_text(render(doc))
    plot(doc, args.out)
    print("\n".join(claim_lines(summary)))
    print(f"wrote {args.out / 'results.json'}, results.md, intervals.png, race_per_prompt.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
