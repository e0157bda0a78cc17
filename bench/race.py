"""The race: every edgespec setting against llama.cpp's own C++ tools, prompt by prompt, in one run.

    python -m edgespec.bench.race [--models smollm2,qwen] [--threads 1[,2]] [--max-tokens 96]
                                  [--repeats 1] [--per-category 2] [--ks 1,2,4,8] [--no-cpp]
                                  [--out bench/out/race]

Workloads, all greedy:
- the shipped prompts (bench/prompts.json): chat, code, grounded (answers that copy the input);
- multi-turn conversations whose turns repeat and edit earlier answers (bench/workloads.json:
  code review rounds, document edits, JSON edits); the assistant turns are the target's own greedy
  answers from this run (edgespec plain's, which runs first on every prompt);
- repeated structured requests (JSON extraction, tool calls), each a new request with nothing of
  the others in its context, so only drafting across requests can help.

Suffix drafting's history is, for every run of every system, exactly the outputs of the requests
before it in its workload (earlier shipped prompts, earlier turns of the conversation, earlier
structured requests), as a server that answered them in that order would hold; never the run's own.

Systems, interleaved per prompt (every system runs a prompt before the next prompt starts):
edgespec `ar`, `lookup` and `draft` at each k of --ks, `suffix`, `auto`; llama.cpp's
`llama-completion` (plain), `llama-speculative-simple` with the draft model and `llama-lookup`, at
--spec-draft-n-max in --cpp-ks, built from the llama.cpp that llama-cpp-python vendors (bench/llama_tools.py).

Speed is decode tokens/s: generated tokens / decode time, prefill excluded, as each system times
itself: edgespec's stats (generated / decode_s) and the C++ tools' own timers ('decoded N tokens in
T s' of the speculative tools, llama_perf's 'eval time' of llama-completion). Medians over repeats;
ratios are taken per prompt against the same run's plain decoding, then medians per class.
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
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from edgespec.bench.run import describe_machine, load_prompts, setups, smollm2_draft

CLASSES = ("chat", "code", "grounded", "multi-turn", "structured")
PLAIN = "edgespec ar"
CPP_PLAIN = "llama.cpp completion"


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


# --- workloads ---------------------------------------------------------------------------------

def load_workloads() -> dict:
    return json.loads(resources.files("edgespec.bench").joinpath("workloads.json").read_text(encoding="utf-8"))


def shipped_items(per_category: int | None) -> list[Item]:
    return [Item(p.id, p.category, "shipped", list(p.messages)) for p in load_prompts(per_category)]


def structured_items() -> list[Item]:
    return [Item(s["id"], s["category"], "structured", s["messages"]) for s in load_workloads()["structured"]]


# --- systems -------------------------------------------------------------------------------------

def edgespec_run(engine, name: str, mode: str, k: int | None, ids: list[int], history: list[list[int]],
                 max_tokens: int) -> dict:
    from edgespec.engine import GenerationConfig

    engine.target.truncate(0)  # no system reuses a previous run's prompt KV
    if engine.draft_runtime is not None:
        engine.draft_runtime.truncate(0)
    engine.history.clear()
    for output in history:
        engine.history.add(output)
    result = engine.generate_tokens(ids, GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=0, mode=mode,
                                                          draft_max=k))
    s = result.stats
    return {"tok_s": s.tokens_per_s or None, "ttft_s": s.ttft_s, "generated": s.generated, "drafted": s.drafted,
            "accepted": s.accepted, "tokens": result.tokens, "chosen": dict(s.chosen)}


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


# --- the run ---------------------------------------------------------------------------------------

def run_model(setup, args, threads: int, log, record=None) -> list[Run]:
    from edgespec.engine import Engine
    from edgespec.models import store

    target = store.resolve(setup.target)
    draft = smollm2_draft() if setup.draft == "smollm2-q4_0" else store.resolve(setup.draft)
    engine = Engine.load(target, draft, n_ctx=args.ctx, n_threads=threads, trees=False)
    engine.cost_profile(refresh=True)  # measured in this run's conditions, before any timed run
    edgespec_systems = ([(PLAIN, "ar", None)] + [(f"edgespec lookup k={k}", "lookup", k) for k in args.ks]
                        + [(f"edgespec draft k={k}", "draft", k) for k in args.ks]
                        + [("edgespec suffix", "suffix", None), ("edgespec auto", "auto", None)])
    cpp_systems = [] if args.no_cpp else (
        [(CPP_PLAIN, "llama-completion", ["-m", str(target)])]
        + [(f"llama.cpp speculative n={k}", "llama-speculative-simple",
            ["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
             "--spec-draft-n-min", "0"]) for k in args.cpp_ks]
        + [(f"llama.cpp lookup n={k}", "llama-lookup", ["-m", str(target), "--spec-draft-n-max", str(k)])
           for k in args.cpp_ks])
    if args.systems:  # a re-measure of a few systems; plain (every ratio's base) and auto always run
        edgespec_systems = [s for s in edgespec_systems if s[0] in (PLAIN, "edgespec auto") or s[0] in args.systems]
        cpp_systems = [s for s in cpp_systems if s[0] in args.systems]
    if cpp_systems:
        from edgespec.bench.llama_tools import ensure_tools

        tools = ensure_tools(tuple(dict.fromkeys(tool for _, tool, _ in cpp_systems)))
        cpp_systems = [(name, tools / tool, tool_args) for name, tool, tool_args in cpp_systems]

    conversations = load_workloads()["conversations"][:args.limit]
    per_category = min(args.per_category, args.limit) if args.limit else args.per_category
    groups: list[list[Item]] = [shipped_items(per_category), structured_items()[:args.limit]]
    runs: list[Run] = _Recorded(record)
    references: dict[str, list[int]] = {}

    def race(item: Item, history: list[list[int]]) -> None:
        ids = engine.prompt_tokens(item.messages)
        text = engine.prompt_text(item.messages)
        for repeat in range(args.repeats):
            for name, mode, k in edgespec_systems:
                out = edgespec_run(engine, name, mode, k, ids, history, args.max_tokens)
                runs.append(Run(name, item.id, item.category, threads, repeat, **out, model=setup.name))
                if name == PLAIN and repeat == 0:
                    references[item.id] = out["tokens"]
            for name, tool, tool_args in cpp_systems:
                try:
                    out = cpp_run(tool, tool_args, text, threads=threads, ctx=args.ctx, max_tokens=args.max_tokens)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"  {name} on {item.id}: {e}", file=log)
                    continue
                runs.append(Run(name, item.id, item.category, threads, repeat, **out, model=setup.name))
        mine = [r for r in runs if r.item == item.id and r.threads == threads]
        plain = statistics.median([r.tok_s for r in mine if r.system == PLAIN and r.tok_s])
        auto = statistics.median([r.tok_s for r in mine if r.system == "edgespec auto" and r.tok_s])
        print(f"  {setup.name} t={threads} {item.id}: plain {plain:.1f} tok/s, auto {auto / plain:.2f}x", file=log,
              flush=True)

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
    engine.close()
    return runs


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


def summarize(runs: list[Run]) -> dict:
    """Per (model, threads): per prompt, each system's median tok/s and its ratio to plain; per class,
    medians of those ratios, the best fixed setting, and the goals of issue 17."""
    out = {}
    for key in sorted({(r.model, r.threads) for r in runs}):
        mine = [r for r in runs if (r.model, r.threads) == key]
        systems = sorted({r.system for r in mine}, key=lambda s: (not s.startswith("edgespec"), s))
        items = list(dict.fromkeys(r.item for r in mine))
        category = {r.item: r.category for r in mine}
        speed = {(s, i): _median([r.tok_s for r in mine if r.system == s and r.item == i]) for s in systems for i in items}
        ttft = {(s, i): _median([r.ttft_s for r in mine if r.system == s and r.item == i])
                for s in (PLAIN, "edgespec auto") for i in items}
        ratio = {(s, i): (speed[s, i] / speed[PLAIN, i]) if speed[s, i] and speed[PLAIN, i] else None
                 for s in systems for i in items}
        cpp_plain = {i: speed.get((CPP_PLAIN, i)) for i in items}
        fixed = [s for s in systems if s.startswith("edgespec ") and s not in (PLAIN, "edgespec auto")]
        cpp = [s for s in systems if s.startswith("llama.cpp") and s != CPP_PLAIN]
        classes = {}
        for c in CLASSES:
            ids = [i for i in items if category[i] == c]
            if not ids:
                continue
            per = {s: _median([ratio[s, i] for i in ids]) for s in systems}
            best_fixed = max(fixed, key=lambda s: per[s] or 0) if fixed else None
            best_cpp = max(cpp, key=lambda s: per[s] or 0) if cpp else None
            classes[c] = {
                "prompts": len(ids), "plain_tok_s": _median([speed[PLAIN, i] for i in ids]),
                "x_plain": {s: per[s] for s in systems},
                "best_fixed": best_fixed, "auto_vs_best_fixed": _ratio(per["edgespec auto"], per.get(best_fixed)),
                "best_cpp": best_cpp, "auto_vs_best_cpp": _ratio(per["edgespec auto"], per.get(best_cpp)),
                "plain_vs_cpp_plain": _median([_ratio(speed[PLAIN, i], cpp_plain[i]) for i in ids]),
                "auto_ttft_x_plain": _median([_ratio(ttft["edgespec auto", i], ttft[PLAIN, i]) for i in ids]),
                "auto_min_x_plain": min((ratio["edgespec auto", i] for i in ids if ratio["edgespec auto", i]),
                                        default=None),
            }
        identical = [i for i in items if _tokens(mine, "edgespec auto", i) == _tokens(mine, PLAIN, i)]
        out[f"{key[0]} t={key[1]}"] = {
            "classes": classes, "systems": systems,
            "per_prompt": {i: {"category": category[i], "plain_tok_s": speed[PLAIN, i],
                               "x_plain": {s: ratio[s, i] for s in systems},
                               "auto_chose": _chosen(mine, i)} for i in items},
            "auto_identical_to_plain": f"{len(identical)}/{len(items)}",
        }
    return out


def _ratio(a, b):
    return a / b if a and b else None


def _tokens(runs, system, item):
    return next((r.tokens for r in runs if r.system == system and r.item == item and r.repeat == 0), None)


def _chosen(runs, item) -> dict:
    counts: dict[str, int] = {}
    for r in runs:
        if r.system == "edgespec auto" and r.item == item:
            for k, n in r.chosen.items():
                counts[k] = counts.get(k, 0) + n
    return counts


GOALS = (  # (claim, class or None for every prompt, value key, threshold, met when value >= threshold)
    ("auto >= 0.97x plain on every prompt", None, "auto_min_x_plain", 0.97, True),
    ("auto >= 0.97x the best fixed setting, per class", "*", "auto_vs_best_fixed", 0.97, True),
    ("grounded prompts >= 1.6x plain", "grounded", "auto", 1.6, True),
    ("multi-turn edit conversations >= 3x plain", "multi-turn", "auto", 3.0, True),
    ("repeated structured requests >= 1.5x plain", "structured", "auto", 1.5, True),
    ("edgespec plain >= 0.95x llama.cpp plain", "*", "plain_vs_cpp_plain", 0.95, True),
    ("auto >= every llama.cpp tool's best setting, per class", "*", "auto_vs_best_cpp", 1.0, True),
    ("auto's TTFT within 5 % of plain's, per class (median)", "*", "auto_ttft_x_plain", 1.05, False),
)


def goals(summary: dict) -> list[dict]:
    rows = []
    for setup, s in summary.items():
        for claim, cls, key, threshold, at_least in GOALS:
            targets = s["classes"].items() if cls in (None, "*") else [(cls, s["classes"].get(cls))]
            for c, data in targets:
                if not data:
                    continue
                value = data["x_plain"]["edgespec auto"] if key == "auto" else data.get(key)
                if value is None:
                    continue
                rows.append({"setup": setup, "claim": claim, "class": c, "value": round(value, 3),
                             "threshold": threshold, "met": value >= threshold if at_least else value <= threshold})
    return rows


def render(doc: dict) -> str:
    lines = ["# Race: edgespec against fixed settings and llama.cpp's own tools", "",
             f"Command: `{doc['command']}`  ", f"Machine: {doc['machine']['cpu']}, {doc['machine']['logical_cores']} "
             f"logical cores, {doc['machine']['ram_gib']} GiB; load average at start "
             f"{doc['machine']['load_average_start']}, at end {doc['load_average_end']}; "
             f"{doc['seconds']:.0f} s in all.", "", doc["timing"], ""]
    for setup, s in doc["summary"].items():
        lines += [f"## {setup}", "", "| class | prompts | plain tok/s | auto x plain (lowest prompt) | best fixed | "
                  "auto / best fixed | suffix x plain | best llama.cpp tool x plain | auto / it | plain / llama.cpp plain |",
                  "|---|---:|---:|---:|---|---:|---:|---|---:|---:|"]
        for c, d in s["classes"].items():
            x = d["x_plain"]
            lines.append(f"| {c} | {d['prompts']} | {_f(d['plain_tok_s'])} | {_f(x['edgespec auto'], 2)} "
                         f"({_f(d['auto_min_x_plain'], 2)}) | {d['best_fixed'] or '-'} {_f(x.get(d['best_fixed']), 2)} | "
                         f"{_f(d['auto_vs_best_fixed'], 2)} | {_f(x.get('edgespec suffix'), 2)} | "
                         f"{d['best_cpp'] or '-'} {_f(x.get(d['best_cpp']), 2) if d['best_cpp'] else ''} | "
                         f"{_f(d['auto_vs_best_cpp'], 2)} | {_f(d['plain_vs_cpp_plain'], 2)} |")
        lines += ["", f"Greedy auto output identical to plain on {s['auto_identical_to_plain']} prompts "
                  "(divergences are batch-vs-single-token near-ties; see bench/batch_numerics.py).", "",
                  "Every system, median x plain per class:", "",
                  "| system | " + " | ".join(s["classes"]) + " |", "|---|" + "---:|" * len(s["classes"])]
        for name in s["systems"]:
            lines.append(f"| {name} | " + " | ".join(_f(d["x_plain"].get(name), 2) for d in s["classes"].values()) + " |")
        lines += ["", "Per prompt (auto x plain; what auto chose, rounds per drafter:k):", "",
                  "| prompt | class | plain tok/s | auto | best fixed | auto chose |", "|---|---|---:|---:|---|---|"]
        for i, p in s["per_prompt"].items():
            fixed = {k: v for k, v in p["x_plain"].items() if k.startswith("edgespec ") and k not in (PLAIN, "edgespec auto")}
            best = max(fixed, key=lambda k: fixed[k] or 0, default=None)
            chose = ", ".join(f"{k} {n}" for k, n in sorted(p["auto_chose"].items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"| {i} | {p['category']} | {_f(p['plain_tok_s'])} | {_f(p['x_plain']['edgespec auto'], 2)} | "
                         f"{best or '-'} {_f(fixed.get(best), 2)} | {chose} |")
        lines.append("")
    lines += ["## Goals (issue 17)", "", "| setup | claim | class | value | goal | met |", "|---|---|---|---:|---:|---|"]
    for g in doc["goals"]:
        lines.append(f"| {g['setup']} | {g['claim']} | {g['class']} | {g['value']:.2f} | {g['threshold']} | "
                     f"{'yes' if g['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups_ = list(doc["summary"].items())
    fig, axes = plt.subplots(len(setups_), 1, figsize=(14, 4.2 * len(setups_)), squeeze=False)
    for ax, (setup, s) in zip(axes[:, 0], setups_):
        items = list(s["per_prompt"])
        xs = range(len(items))
        auto = [s["per_prompt"][i]["x_plain"]["edgespec auto"] or 0 for i in items]
        best_fixed = [max([(v or 0) for k, v in s["per_prompt"][i]["x_plain"].items()
                           if k.startswith("edgespec ") and k not in (PLAIN, "edgespec auto")] or [0]) for i in items]
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
    fig.savefig(path, dpi=110)


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.race", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,qwen", help="comma list of smollm2, qwen")
    p.add_argument("--threads", default="1", help="comma list of thread counts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--per-category", type=int, default=2, help="shipped prompts per category")
    p.add_argument("--ks", default="1,2,4,8", help="fixed draft lengths for edgespec lookup and draft")
    p.add_argument("--cpp-ks", default="2,4,8", help="--spec-draft-n-max values for llama.cpp's speculative tools")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--no-cpp", action="store_true", help="skip llama.cpp's C++ tools")
    p.add_argument("--systems", default="", help="comma list of system names to run (e.g. 'edgespec auto'); "
                   "default all; edgespec plain and auto always run")
    p.add_argument("--limit", type=int, default=None, help="a quick check: at most this many shipped prompts per category, structured requests, "
                   "conversations and turns")
    p.add_argument("--out", type=Path, default=Path("bench/out/race"))
    p.add_argument("--from-runs", type=Path, nargs="+", default=None,
                   help="summarise runs.jsonl files of earlier (possibly stopped) runs instead of running")
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.cpp_ks = [int(k) for k in args.cpp_ks.split(",") if k]
    args.systems = {name.strip() for name in args.systems.split(",") if name.strip()}
    return args


TIMING = ("Decode tok/s = generated tokens / decode time, prefill excluded, as each system times itself "
          "(edgespec: stats.tokens_per_s; llama-speculative-simple and llama-lookup: 'decoded N tokens in T s'; "
          "llama-completion: llama_perf 'eval time'). Greedy, one process per C++ run (its load and prefill are "
          "outside its timer). KV reset before every edgespec run; the suffix history holds only earlier "
          "requests' outputs. Ratios per prompt against edgespec plain in the same run, medians per class.")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    machine = describe_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
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
                runs += run_model(setup, args, threads, sys.stderr, record)
    summary = summarize(runs)
    doc = {"command": "python -m edgespec.bench.race " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine, "timing": TIMING, "seconds": time.time() - t0,
           "load_average_end": [round(x, 2) for x in os.getloadavg()], "summary": summary}
    doc["goals"] = goals(summary)
    (args.out / "race.json").write_text(json.dumps({**doc, "runs": [r.__dict__ for r in runs]}, indent=1))
    (args.out / "RACE_RESULTS.md").write_text(render(doc))
    plot(doc, args.out / "race_per_prompt.png")
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
