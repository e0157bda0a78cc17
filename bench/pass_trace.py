"""Where auto's decode time goes against plain's: its target passes, and its own work between them.

    python -m edgespec.bench.pass_trace [--models smollm2] [--threads 1] [--classes chat] [--repeats 3]
                                        [--max-tokens 96] [--out FILE]

The race's prompts of the given classes, each run by plain decoding (`ar`) and auto back to back, the
order alternated per repeat, as the race runs them (empty KV; the suffix history holds the earlier
prompts' plain outputs; auto starts from its priors). Every target llama_decode is timed. Per mode:
the seconds in target passes, the seconds between the first decode pass and the last (the span), and
what lies between passes (the span less the passes: sampling, acceptance, bookkeeping and, for auto,
choosing and learning), per round. A race says how much slower or faster auto is; this says whether
the passes or the work between them made it so (session 22, bench/auto-idle-s22: on SmolLM2's chat
prompts auto's passes took 0.5 % less time than plain's and its work between them 1.01 ms a round
against plain's 0.56). Beside the timed passes, their price by the cost profile auto used
(bench/oracle.Pricing.passes_seconds): whether the profile prices a multi-row pass as it runs in the loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def timed_target_passes(engine) -> Iterator[list[tuple[float, float, int]]]:
    """While inside, every llama_decode on the engine's target context is timed: (start, seconds,
    tokens) appended to the list it yields (the caller clears it between runs)."""
    import edgespec.runtimes.llamacpp as lc

    decode, passes = lc.ll.llama_decode, []

    def timed(ctx, batch):
        t = time.perf_counter()
        rc = decode(ctx, batch)
        if ctx == engine.target._ctx:
            passes.append((t, time.perf_counter() - t, batch.n_tokens))
        return rc

    lc.ll.llama_decode = timed
    try:
        yield passes
    finally:
        lc.ll.llama_decode = decode


def alternated(engine, items, repeats: int, pair: tuple[str, str]):
    """(item, its prompt's ids, repeat, system, whether this is the item's last run): each item
    `repeats` times, both systems of `pair` each time, the order alternated per repeat."""
    for item in items:
        ids = engine.prompt_tokens(item.messages)
        for repeat in range(repeats):
            order = pair if repeat % 2 == 0 else pair[::-1]
            for system in order:
                yield item, ids, repeat, system, repeat == repeats - 1 and system == order[-1]


def decode_timing(passes: list[tuple[float, float, int]]) -> dict:
    """One run's passes (timed_target_passes) after its prompt's prefill: how many, the seconds in
    them, the span from the first one's start to the last one's end, and what lies between them."""
    rounds = passes[1:]  # the first is the prompt's prefill
    span = rounds[-1][0] + rounds[-1][1] - rounds[0][0]
    in_passes = sum(s for _, s, _ in rounds)
    single = [s for _, s, n in rounds if n == 1]
    return {"rounds": len(rounds), "pass_s": in_passes, "span_s": span, "between_s": span - in_passes,
            "single_pass_s": sum(single) / len(single) if single else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.pass_trace", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2", choices=("qwen", "smollm2"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--classes", default="chat", help="comma-separated race classes [chat]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON")
    args = p.parse_args(argv)

    from edgespec.bench.race import AutoOracle, edgespec_run, shipped_items
    from edgespec.bench.run import publish, setups
    from edgespec.engine import Engine
    from edgespec.models import store

    [setup] = setups(args.models)
    engine = Engine.load(store.resolve(setup.target), setup.draft_path(), n_ctx=4096, n_threads=args.threads, trees=False)
    engine.cost_profile(refresh=True)
    prices = AutoOracle(engine)
    classes = set(args.classes.split(","))
    items = [i for i in shipped_items(None) if i.category in classes]
    runs, outputs = [], []
    try:
        with timed_target_passes(engine) as passes:
            for item, ids, repeat, mode, last in alternated(engine, items, args.repeats, ("ar", "auto")):
                passes.clear()
                time.sleep(0.5)
                out = edgespec_run(engine, mode, mode, None, ids, outputs, args.max_tokens, prices)
                runs.append({"item": item.id, "mode": mode, "repeat": repeat, "tok_s": out["tok_s"],
                             **decode_timing(passes), "priced_pass_s": out["priced_pass_s"], "chosen": out["chosen"]})
                if mode == "ar" and repeat == 0:
                    plain_tokens = out["tokens"]
                if last:  # later prompts' suffix history holds this one's plain output
                    outputs.append(plain_tokens)
    finally:
        engine.close()

    summary = {}
    for mode in ("ar", "auto"):
        mine = [r for r in runs if r["mode"] == mode]
        rounds = sum(r["rounds"] for r in mine)
        summary[mode] = {"rounds": rounds, "pass_s": sum(r["pass_s"] for r in mine),
                         "priced_pass_s": sum(r["priced_pass_s"] for r in mine),
                         "span_s": sum(r["span_s"] for r in mine),
                         "between_ms_per_round": 1e3 * sum(r["between_s"] for r in mine) / rounds}
    a, b = summary["auto"], summary["ar"]
    for mode in ("ar", "auto"):  # the passes as timed against the cost profile's price for them
        summary[mode]["passes_over_priced"] = summary[mode]["pass_s"] / summary[mode]["priced_pass_s"]
    summary["auto_over_plain"] = {"span": a["span_s"] / b["span_s"], "passes": a["pass_s"] / b["pass_s"],
                                  "priced_passes": a["priced_pass_s"] / b["priced_pass_s"],
                                  "between_ms_per_round_extra": a["between_ms_per_round"] - b["between_ms_per_round"]}
    publish("pass_trace", argv, summary, args.out, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
