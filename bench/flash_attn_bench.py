"""Flash attention on or off on the CPU: the same engine, plain and auto, on short and long prompts.

    python -m edgespec.bench.flash_attn_bench [--models smollm2,qwen] [--per-class 3] [--repeats 3]
        [--max-tokens 96] [--out bench/FLASH_ATTN_RESULTS.md]

Why: llama.cpp turns flash attention on wherever it can, the CPU included, and its CPU kernel makes
every token held in the KV cache cost more than the plain attention path does, the more so the more
rows a pass has; but without it a batched pass's logits differ from single-token passes' (see
edgespec.runtimes.base.flash_attention). This measures both sides for a user: decode speed, greedy, of
the two settings loaded side by side, on the shipped chat prompts (short) and grounded edits (long: the
file to edit is in the prompt), plain and auto; and on how many prompts auto's text equals plain
decoding's under the same setting.

Method: per prompt, repeat and mode the two settings run back to back, their order alternated every
other run; per prompt the median tok/s over repeats; per class and mode the geometric mean of the
per-prompt ratios off / on with a 90 % bootstrap interval over prompts (bench/stats_ci.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edgespec.bench import stats_ci
from edgespec.bench.run import load_prompts

MODELS = {"smollm2": ("smollm2-135m", None, 1), "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 2)}
CLASSES = ("chat", "grounded")


def one_run(engine, prompt, mode: str, max_tokens: int) -> dict:
    from edgespec.drafters.suffix import SuffixHistory
    from edgespec.engine import GenerationConfig

    engine.target.truncate(0)
    if engine.draft_runtime is not None:
        engine.draft_runtime.truncate(0)
    engine.use_history(SuffixHistory())
    engine.acceptance = None
    r = engine.generate_tokens(engine.prompt_tokens(list(prompt.messages)),
                               GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=0, mode=mode))
    return {"tokens_per_s": r.stats.tokens_per_s, "tokens": [int(t) for t in r.tokens]}


def bench_model(name: str, prompts, repeats: int, max_tokens: int, modes: tuple[str, ...]) -> dict:
    from edgespec.engine import Engine

    target, draft, threads = MODELS[name]
    engines = {fa: Engine.load(target, draft, n_threads=threads, flash_attn=on)
               for fa, on in (("on", True), ("off", False))}
    for e in engines.values():
        e.cost_profile()  # measured (or read) outside the timed runs
    runs, n = [], 0
    for rep in range(repeats):
        for p in prompts:
            for mode in modes:
                for fa in ("on", "off") if n % 2 == 0 else ("off", "on"):
                    r = one_run(engines[fa], p, mode, max_tokens)
                    runs.append({"prompt": p.id, "class": p.category, "mode": mode, "fa": fa, "repeat": rep,
                                 "prompt_tokens": len(engines[fa].prompt_tokens(list(p.messages))), **r})
                    print(f"  {name} {p.id} {mode} fa={fa}: {r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
                n += 1
    for e in engines.values():
        e.close()
    return {"runs": runs}


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for mode in sorted({r["mode"] for r in runs}):
        for cls in CLASSES + ("overall",):
            sel = [r for r in runs if r["mode"] == mode and (cls == "overall" or r["class"] == cls)]
            if not sel:
                continue
            by = {}
            for r in sel:
                by.setdefault(r["prompt"], {}).setdefault(r["fa"], []).append(r["tokens_per_s"])
            ratios = [statistics.median(v["off"]) / statistics.median(v["on"]) for v in by.values()]
            iv = stats_ci.geomean_interval(ratios)
            same = sum(1 for p in by if _texts(sel, p, "on") == _texts(sel, p, "off"))
            # auto's text against plain decoding's under each setting (greedy: equal unless a batched
            # pass's logits flip a near-tie that single-token passes break the other way)
            plain = [r for r in runs if r["mode"] == "ar" and (cls == "overall" or r["class"] == cls)]
            as_plain = {fa: sum(1 for p in by if _texts(sel, p, fa) == _texts(plain, p, fa)) for fa in ("on", "off")}
            rows.append({"mode": mode, "class": cls, "prompts": len(by), "ratio": iv.value,
                         "lo": iv.low, "hi": iv.high,
                         "on_tok_s": statistics.median(statistics.median(v["on"]) for v in by.values()),
                         "off_tok_s": statistics.median(statistics.median(v["off"]) for v in by.values()),
                         "prompt_tokens": statistics.median(r["prompt_tokens"] for r in sel), "same_text": same,
                         "as_plain_on": as_plain["on"], "as_plain_off": as_plain["off"]})
    return rows


def _texts(runs, prompt, fa):
    return {tuple(r["tokens"]) for r in runs if r["prompt"] == prompt and r["fa"] == fa}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen")
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--modes", default="ar,auto")
    ap.add_argument("--out", type=Path, default=Path("bench/FLASH_ATTN_RESULTS.md"))
    args = ap.parse_args(argv)

    from edgespec.bench.run import describe_machine

    prompts = [p for p in load_prompts(args.per_class) if p.category in CLASSES]
    t0, load0 = time.time(), _load()
    results = {m: bench_model(m, prompts, args.repeats, args.max_tokens, tuple(args.modes.split(",")))
               for m in args.models.split(",")}
    cmd = "python -m edgespec.bench.flash_attn_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Flash attention on or off on the CPU", "", f"Command: `{cmd.strip()}`  ",
             f"Machine: {_machine(describe_machine())}; load average at start {load0}, at end {_load()}; "
             f"{time.time() - t0:.0f} s in all.", "", __doc__.split("\n\n", 2)[2].strip(), "",
             "Same text: prompts whose greedy text is the same with flash attention on and off. As plain: prompts "
             "where auto's text equals plain decoding's under the same setting, on / off.", "",
             "| model | mode | class | prompts | prompt tokens (median) | tok/s on | tok/s off | off / on (90 % interval) | same text | as plain (on / off) |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for m, res in results.items():
        res["summary"] = summarise(res["runs"])
        for r in res["summary"]:
            lines.append(f"| {m} | {r['mode']} | {r['class']} | {r['prompts']} | {r['prompt_tokens']:.0f} | "
                         f"{r['on_tok_s']:.1f} | {r['off_tok_s']:.1f} | {r['ratio']:.3f} ({r['lo']:.3f}-{r['hi']:.3f}) | "
                         f"{r['same_text']}/{r['prompts']} | "
                         + (f"{r['as_plain_on']}/{r['prompts']} / {r['as_plain_off']}/{r['prompts']} |" if r["mode"] != "ar" else "- |"))
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": cmd.strip(), "models": results}, indent=1))
    print("\n".join(lines))
    return 0


def _machine(d: dict) -> str:
    return f"{d['cpu']}, {d['logical_cores']} logical cores, {d['ram_gib']} GiB"


def _load() -> list[float]:
    import os
    return [round(x, 2) for x in os.getloadavg()]


if __name__ == "__main__":
    sys.exit(main())
