"""A change of code against an earlier commit's, interleaved in one process: what a race cannot resolve.

    python -m edgespec.bench.code_ab --base REV --modules edgespec.policy,edgespec.drafters.lookup
                                     [--mode auto] [--models smollm2] [--threads 1] [--classes chat]
                                     [--repeats 3] [--max-tokens 96] [--limit N] [--out FILE]

A change that saves 0.05 ms a round is 0.4 % of a SmolLM2 step: two races, minutes apart, differ by
more. Here both versions run in the same process on the same loaded model, prompt by prompt, the
order alternated per repeat: "new" with the working tree's code, "old" with the classes and functions
of the named modules as they were at `--base` (their source at that commit executed as a module of its
own, then set in place on the live classes and modules before each old run and taken back after).
Every target llama_decode is timed, so beside the decode span there is what lies between passes
(sampling, acceptance, bookkeeping and, for auto, choosing and learning) and what the single-row
passes cost; ratios new / old per run, geometric means with 90 % bootstrap intervals.

Limits: a name another module imported by value (`from edgespec.verify import accept_greedy` in the
engine) keeps the working tree's object; modules whose classes changed shape between the commits must
be swapped together (name them all). Greedy text is compared run by run: under auto the choices follow
the pass timings (OnlineCosts), so the same text is expected, the same choices are not.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path


def module_at(rev: str, name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(the live module `name`, its source at commit `rev` executed as a module of its own)."""
    live = importlib.import_module(name)
    path = Path(live.__file__).resolve()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=path.parent).stdout.strip()
    source = subprocess.run(["git", "show", f"{rev}:{path.relative_to(root)}"], capture_output=True, text=True,
                            check=True, cwd=root).stdout
    old = types.ModuleType(f"{name}_at_{rev}")
    old.__file__ = str(path)
    sys.modules[old.__name__] = old  # dataclasses look their module up
    exec(compile(source, str(path), "exec"), old.__dict__)
    return live, old


def swaps(live: types.ModuleType, old: types.ModuleType) -> list[tuple[object, str, object, object]]:
    """(owner, attribute, live value or None, old value): the old module's version of every class
    attribute and module function the live module defines."""
    out = []
    for name, value in vars(live).items():
        if name not in vars(old) or getattr(value, "__module__", None) != live.__name__:
            continue
        if isinstance(value, type):
            for attr, was in vars(vars(old)[name]).items():
                if callable(was) or isinstance(was, (staticmethod, classmethod, property)):
                    out.append((value, attr, vars(value).get(attr), was))
        elif callable(value):
            out.append((live, name, value, vars(old)[name]))
    return out


def use(patches, version: str) -> None:
    for owner, attr, live, was in patches:
        value = was if version == "old" else live
        if value is None:
            if attr in vars(owner):
                delattr(owner, attr)
        else:
            setattr(owner, attr, value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.code_ab", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the commit whose code runs as 'old'")
    p.add_argument("--modules", required=True, help="comma-separated modules to swap, e.g. edgespec.policy")
    p.add_argument("--mode", default="auto")
    p.add_argument("--models", default="smollm2", choices=("qwen", "smollm2"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--classes", default="chat", help="comma-separated race classes [chat]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per class")
    p.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON")
    args = p.parse_args(argv)

    from edgespec.bench.pass_trace import alternated, decode_timing, timed_target_passes
    from edgespec.bench.race import edgespec_run, shipped_items
    from edgespec.bench.run import publish, setups
    from edgespec.bench.stats_ci import geomean_interval
    from edgespec.engine import Engine
    from edgespec.models import store

    patches = [s for name in args.modules.split(",") for s in swaps(*module_at(args.base, name))]
    [setup] = setups(args.models)
    engine = Engine.load(store.resolve(setup.target), setup.draft_path(), n_ctx=4096, n_threads=args.threads, trees=False)
    engine.cost_profile()
    classes = args.classes.split(",")
    items = [i for c in classes for i in [i for i in shipped_items(None) if i.category == c][:args.limit]]
    runs, outputs = [], []
    try:
        with timed_target_passes(engine) as passes:
            for item, ids, repeat, version, last in alternated(engine, items, args.repeats, ("new", "old")):
                use(patches, version)
                passes.clear()
                time.sleep(0.3)
                out = edgespec_run(engine, version, args.mode, None, ids, outputs, args.max_tokens)
                use(patches, "new")  # (and below, should a run fail)
                runs.append({"item": item.id, "version": version, "repeat": repeat, "tok_s": out["tok_s"],
                             **decode_timing(passes), "chosen": out["chosen"], "tokens": out["tokens"]})
                if last:  # later prompts' suffix history holds this one's output under the new code
                    outputs.append(next(r["tokens"] for r in runs if r["item"] == item.id and r["version"] == "new"))
    finally:
        use(patches, "new")
        engine.close()

    new = [r for r in runs if r["version"] == "new"]
    old = [r for r in runs if r["version"] == "old"]  # paired with `new` run by run: same item and repeat
    summary = {}
    for version, mine in (("new", new), ("old", old)):
        rounds = sum(r["rounds"] for r in mine)
        summary[version] = {"rounds": rounds,
                            "between_ms_per_round": 1e3 * sum(r["between_s"] for r in mine) / rounds,
                            "pass_ms_per_round": 1e3 * sum(r["pass_s"] for r in mine) / rounds,
                            "drafting_rounds": sum(n for r in mine for key, n in r["chosen"].items()
                                                   if not key.endswith(":0"))}
    summary["new_over_old"] = {
        "tok_s": geomean_interval([a["tok_s"] / b["tok_s"] for a, b in zip(new, old)]).to_dict(),
        "span": geomean_interval([a["span_s"] / b["span_s"] for a, b in zip(new, old)]).to_dict(),
        "single_pass": geomean_interval([a["single_pass_s"] / b["single_pass_s"] for a, b in zip(new, old)
                                         if a["single_pass_s"] and b["single_pass_s"]]).to_dict(),
        "between_ms_per_round_median_difference": statistics.median(
            1e3 * (a["between_s"] / a["rounds"] - b["between_s"] / b["rounds"])
            for a, b in zip(new, old)),
        "same_text": all(a["tokens"] == b["tokens"] for a, b in zip(new, old))}
    publish("code_ab", argv, summary, args.out, runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
