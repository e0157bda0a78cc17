"""A target pass's cost by rows and by tokens already held, with flash attention on and off.

    python -m edgespec.bench.depth_curve [--models smollm2-135m:1,qwen2.5-coder-0.5b:2,qwen2.5-coder-1.5b:2]
        [--held 64,512,1024,2048] [--rows 1,2,4,8,12,17] [--repeats 7] [--out bench/DEPTH_CURVE_RESULTS.md]

Why: auto's cost profile times passes over 64 and 512 held tokens (edgespec.machine.profile's
CONTEXT_TOKENS, DEEP_CONTEXT_TOKENS) and prices other depths linearly between them; this shows how far a pass of n rows, counted in single steps, moves
with what the KV cache holds, and how llama.cpp's CPU flash attention changes that. Each point is the
median of `repeats` timed decodes of n random tokens after `held` random tokens (the first dropped as a
warm-up), the cache cut back after each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def measure(name: str, threads: int, flash: bool, held: list[int], rows: list[int], repeats: int) -> dict:
    from edgespec.loader import LoadOptions, resolve
    from edgespec.runtimes.llamacpp import LlamaCppRuntime

    rt = LlamaCppRuntime(resolve(name), LoadOptions(n_ctx=max(held) + max(rows) + 64, n_threads=threads,
                                                    flash_attn=flash).llamacpp())
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for depth in held:
        rt.truncate(0)
        rt.decode(rng.integers(100, 30000, size=depth).astype(np.int32), 0)
        ms = {}
        for n in rows:
            batch = rng.integers(100, 30000, size=n).astype(np.int32)
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                rt.decode(batch, n)
                times.append(time.perf_counter() - t)
                rt.truncate(depth)
            ms[str(n)] = round(1e3 * statistics.median(times[1:]), 3)
        out[str(depth)] = ms
        print(f"  {name} flash={'on' if flash else 'off'} held {depth}: " +
              ", ".join(f"{n}: {v:.1f} ms" for n, v in ms.items()), file=sys.stderr, flush=True)
    rt.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m:1,qwen2.5-coder-0.5b:2,qwen2.5-coder-1.5b:2",
                    help="comma list of model:threads")
    ap.add_argument("--held", default="64,512,1024,2048")
    ap.add_argument("--rows", default="1,2,4,8,12,17")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("bench/DEPTH_CURVE_RESULTS.md"))
    args = ap.parse_args(argv)
    held = [int(x) for x in args.held.split(",")]
    rows = [int(x) for x in args.rows.split(",")]

    from edgespec.bench.run import describe_machine

    t0, d = time.time(), describe_machine()
    results = {}
    for spec in args.models.split(","):
        name, threads = spec.rsplit(":", 1)
        results[name] = {"threads": int(threads), **{
            fa: measure(name, int(threads), fa == "on", held, rows, args.repeats) for fa in ("on", "off")}}
    cmd = "python -m edgespec.bench.depth_curve " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# A pass's cost by rows and by tokens held", "", f"Command: `{cmd.strip()}`  ",
             f"Machine: {d['cpu']}, {d['logical_cores']} logical cores, {d['ram_gib']} GiB; {time.time() - t0:.0f} s in all.",
             "", __doc__.split("\n\n", 2)[2].strip(), "",
             "Milliseconds per pass (in brackets: single steps at that depth, the pass over 1 row being 1).", "",
             "| model, threads | flash attention | held | " + " | ".join(f"{n} rows" for n in rows) + " |",
             "|---|---|---:|" + "---:|" * len(rows)]
    for name, res in results.items():
        for fa in ("on", "off"):
            for depth, ms in res[fa].items():
                step = ms[str(rows[0])]
                lines.append(f"| {name}, {res['threads']} | {fa} | {depth} | " +
                             " | ".join(f"{ms[str(n)]:.1f} ({ms[str(n)] / step:.2f})" for n in rows) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": cmd.strip(), "models": results}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
