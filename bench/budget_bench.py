"""Throughput under a memory budget: the Qwen pair from "everything fits" down to "target alone".

    python -m edgespec.bench.budget_bench [--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b]
        [--points 6] [--max-tokens 128] [--repeats 3] [--out bench/BUDGET_RESULTS]
    python -m edgespec.bench.budget_bench --quick      # smoke: SmolLM2 as its own draft, 3 budgets, 8 tokens

The two ends come from the memory plan (edgespec.machine.planner): "everything fits" is the predicted
peak of the unconstrained plan (target + draft) plus its margin, "target alone" the same for the target
without a draft; --points budgets are spread between them. Each budget runs in a fresh process, two ways:

* guard: the unconstrained plan's settings are loaded, and the run-time guard (edgespec.machine.guard)
  holds the process to the budget by freeing memory (prefix cache, suffix history, draft model); its
  peak is counted from the guard's first check on (loading took the larger budget's memory first);
* plan: `apply_budget` at that budget (the plan itself may drop the draft or shrink the KV to fit).

Each reports tokens/s (greedy, --mode auto, the same prompts), the peak resident set (a thread sampling
/proc/self/statm every 10 ms, and VmHWM), what the guard gave up, what the plan dropped, and how the
process ended: never a crash or an OOM kill (a refused generation, MemoryBudgetError, is reported as
such). The whole ladder runs --repeats times, in reverse order every other time, so drift in the
machine falls on every budget alike. Throughput kept is each run's tokens/s over the same repeat's
"everything fits" guard run: the geometric mean over repeats with a 90 % bootstrap interval
(bench/stats_ci.py). Results go to OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
PROMPTS = [
    "Write a Python function that parses an ISO 8601 date string and returns a datetime, with tests.",
    "Implement a binary search tree in Python with insert, delete and in-order traversal.",
    "Refactor this loop into a list comprehension and explain why:\nresult = []\nfor x in items:\n"
    "    if x % 2 == 0:\n        result.append(x * x)\n",
]


# --- one budget, in its own process ----------------------------------------------------------------

class _Sampler:
    def __init__(self) -> None:
        from edgespec.machine.memory import current_rss

        self.read, self.peak, self._stop = current_rss, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_point(point: dict) -> dict:
    """Load, (guard,) generate the prompts, report. Runs inside the child process."""
    from edgespec.engine import GenerationConfig
    from edgespec.errors import EdgespecError
    from edgespec.machine.guard import MemoryBudgetError
    from edgespec.machine.memory import peak_rss
    from edgespec.machine.planner import apply_budget

    out = {"budget_bytes": point["budget"], "way": point["way"], "outcome": "ok"}
    with _Sampler() as sampler:
        load_budget = point["load_budget"] if point["way"] == "guard" else point["budget"]
        try:
            engine, the_plan = apply_budget(point["target"], point["draft"], budget=load_budget, ctx=point["ctx"],
                                            sampling=False, n_threads=point["threads"])
        except EdgespecError as exc:
            out.update(outcome="refused at load", reason=str(exc), peak_rss_bytes=sampler.peak)
            return out
        out["plan_notes"] = list(the_plan.notes)
        out["draft_loaded"] = engine.draft_runtime is not None
        guard = engine.memory_guard
        guard.budget_bytes = point["budget"]
        generated, decode_s = 0, 0.0
        config = GenerationConfig(max_tokens=point["max_tokens"], temperature=0, mode="auto")
        with engine:
            try:
                guard.check()  # a process under --budget is guarded from its first round
                out["load_peak_rss_bytes"] = sampler.peak  # guard way: loaded for the larger budget first
                sampler.peak = 0
                engine.cost_profile()
                for prompt in PROMPTS:
                    result = engine.generate(prompt, config)
                    generated += result.stats.generated
                    decode_s += result.stats.decode_s
            except MemoryBudgetError as exc:
                out.update(outcome="refused", reason=str(exc))
            out["draft_at_end"] = engine.draft_runtime is not None
        out.update(tokens=generated, decode_s=round(decode_s, 3),
                   tokens_per_s=round(generated / decode_s, 2) if decode_s else None,
                   peak_rss_bytes=max(sampler.peak, 0), vm_hwm_bytes=peak_rss(),
                   guard_dropped=[r["step"] for r in guard.released], guard_events=list(guard.events),
                   under_budget=sampler.peak < point["budget"])
    return out


def _child(point: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "edgespec.bench.budget_bench", "--point", json.dumps(point)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:  # a crash or an OOM kill (-9): the bench exists to show there is none
        return {"budget_bytes": point["budget"], "way": point["way"], "outcome": f"crashed (exit {proc.returncode})",
                "stderr": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the sweep ---------------------------------------------------------------------------------------

def budgets(target: str, draft: str, ctx: int, points: int) -> tuple[list[int], dict]:
    """From "everything fits" down to "target alone" (the plan's predicted peaks plus margins)."""
    from edgespec.machine.planner import plan_for_cli

    big = "1T"
    everything = plan_for_cli(target, draft, budget=big, ctx=ctx)
    alone = plan_for_cli(target, None, budget=big, ctx=ctx)
    hi = everything.predicted_peak_bytes + everything.margin_bytes
    lo = alone.predicted_peak_bytes + alone.margin_bytes
    step = (hi - lo) / max(1, points - 1)
    return [int(hi - i * step) for i in range(points)], {"everything_fits_bytes": hi, "target_alone_bytes": lo,
                                                         "draft_planned_bytes": hi - lo}


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (budget, way) over the repeats: median tokens/s, kept (each repeat's tokens/s over
    that repeat's "everything fits" guard run) as a geometric mean with its interval, the worst peak."""
    from edgespec.bench.stats_ci import geomean_interval

    top = max(r["budget_bytes"] for r in rows)
    base = {r["repeat"]: r["tokens_per_s"] for r in rows
            if r["way"] == "guard" and r["budget_bytes"] == top and r.get("tokens_per_s")}
    lines = []
    for key in dict.fromkeys((r["budget_bytes"], r["way"]) for r in rows):
        runs = [r for r in rows if (r["budget_bytes"], r["way"]) == key]
        speeds = [r["tokens_per_s"] for r in runs if r.get("tokens_per_s")]
        ratios = [r["tokens_per_s"] / base[r["repeat"]] for r in runs if r.get("tokens_per_s") and r["repeat"] in base]
        peaks = [r["peak_rss_bytes"] for r in runs if r.get("peak_rss_bytes")]
        lines.append({
            "budget_bytes": key[0], "way": key[1], "runs": len(runs),
            "tokens_per_s": float(sorted(speeds)[len(speeds) // 2]) if speeds else None,
            "kept": geomean_interval(ratios).to_dict() if ratios else None,
            "peak_rss_bytes": max(peaks) if peaks else None,
            "under_budget": all(r.get("under_budget") for r in runs),
            "draft_kept": all(r.get("draft_at_end") for r in runs),
            # in the ladder's order (each run's list is in the order the guard took the steps)
            "guard_dropped": list(dict.fromkeys(step for r in runs for step in r.get("guard_dropped", []))),
            "plan_notes": sorted({note for r in runs for note in r.get("plan_notes", [])}),
            "outcomes": sorted({r["outcome"] for r in runs})})
    return lines


def render(lines: list[dict], ends: dict, args) -> str:
    out = [f"# Throughput under a memory budget ({args.target} + {args.draft})", "",
           f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
           f"{platform.system()}, {args.threads} thread(s), ctx {args.ctx}, greedy --mode auto, "
           f"{len(PROMPTS)} prompts x {args.max_tokens} tokens per run, the ladder {args.repeats} times "
           f"(reversed every other time), each run a fresh process.", "",
           f"Everything fits: {ends['everything_fits_bytes'] / MiB:.0f} MiB; target alone: "
           f"{ends['target_alone_bytes'] / MiB:.0f} MiB (the plan's predicted peaks plus margins).", "",
           "Kept: tokens/s over the same repeat's 'everything fits' guard run, geometric mean over repeats "
           "(90 % bootstrap interval); peak: the largest over repeats.", "",
           "| budget MiB | way | runs | tokens/s (median) | kept (90 % interval) | peak RSS MiB | under budget "
           "| draft kept | guard dropped | plan | outcome |",
           "|---:|---|---:|---:|---|---:|---|---|---|---|---|"]
    for r in lines:
        kept = r["kept"]
        kept = f"{kept['value']:.3f} ({kept['low']:.3f}-{kept['high']:.3f})" if kept else "-"
        peak = f"{r['peak_rss_bytes'] / MiB:.0f}" if r["peak_rss_bytes"] else "-"
        out.append(f"| {r['budget_bytes'] / MiB:.0f} | {r['way']} | {r['runs']} | {r['tokens_per_s'] or '-'} | {kept} "
                   f"| {peak} | {r['under_budget']} | {r['draft_kept']} | {', '.join(r['guard_dropped']) or '-'} "
                   f"| {'; '.join(r['plan_notes']) or '-'} | {', '.join(r['outcomes'])} |")
    with_draft = [r for r in lines if r["draft_kept"] and r["kept"]]
    if with_draft:
        low = min(r["kept"]["low"] for r in with_draft)
        out += ["", f"Goal (issue 25): >= 0.95x while the draft still fits: lowest interval bound over the "
                    f"{len(with_draft)} budget and way settings that kept the draft {low:.3f}: {'met' if low >= 0.95 else '**not met**'}."]
    out += ["", f"Command: `python -m edgespec.bench.budget_bench {' '.join(sys.argv[1:])}`", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one budget in this process
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the whole ladder, reversed every other time")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ways", default="guard,plan", help="comma list of guard, plan")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per budget point")
    ap.add_argument("--out", default="bench/BUDGET_RESULTS", help="writes OUT.md and OUT.json")
    ap.add_argument("--quick", action="store_true", help="smoke: SmolLM2 as its own draft, 3 budgets, 8 tokens")
    args = ap.parse_args(argv)
    if args.point:
        print(json.dumps(run_point(json.loads(args.point))))
        return 0
    if args.quick:
        args.target = args.draft = "smollm2-135m"
        args.points, args.max_tokens, args.repeats, args.ctx = 3, 8, 2, 512
        args.threads = args.threads or 1
    ladder, ends = budgets(args.target, args.draft, args.ctx, args.points)
    points = [(budget, way) for budget in ladder for way in args.ways.split(",")]
    rows = []
    for repeat in range(args.repeats):
        for budget, way in points if repeat % 2 == 0 else points[::-1]:
            point = {"target": args.target, "draft": args.draft, "ctx": args.ctx, "budget": budget,
                     "load_budget": ladder[0], "way": way, "max_tokens": args.max_tokens, "threads": args.threads}
            row = {**_child(point, args.timeout), "repeat": repeat}
            rows.append(row)
            print(f"repeat {repeat} budget {budget / MiB:.0f} MiB {way}: {row.get('tokens_per_s')} tok/s, peak "
                  f"{(row.get('peak_rss_bytes') or 0) / MiB:.0f} MiB, guard dropped {row.get('guard_dropped')}, "
                  f"{row['outcome']}", file=sys.stderr, flush=True)
    lines = summarize(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"ends": ends, "args": vars(args), "summary": lines,
                                                    "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(render(lines, ends, args))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)
    return 1 if any(r["outcome"].startswith("crashed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
