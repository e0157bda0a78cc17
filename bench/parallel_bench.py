"""Benchmark of parallel slots: `edgespec serve --parallel 1` vs `--parallel 4` vs llama-server `--parallel 4`.

    python -m edgespec.bench.parallel_bench [--clients 1,2,4,8] [--per-client 3] [--max-tokens 64]
                                            [--threads 1] [--repeats 2] [--modes ar,auto]
                                            [--out bench/PARALLEL_RESULTS.md]

Every server runs SmolLM2-135M Q4_1 with the same KV pool (--ctx 4096; with 4 slots each gets 1024,
llama-server's rule) and the same threads, on loopback, one after another in the same run. At each
level of C concurrent clients, every client sends `per_client` chat requests one after another
(distinct questions, a short system prompt, greedy, `max_tokens` tokens); aggregate tokens/s is all
completion tokens over the wall time of the level; latency is per request, send to the last byte
(non-streaming), reported as p50 and p95. All servers are up at once and take turns at each level,
for `repeats` rounds; the tables show medians over the rounds. llama-server is built from the llama.cpp that the
llama-cpp-python sdist vendors (`edgespec.bench.llama_tools`), so both race the same kernels.

Writes a markdown report and a JSON file beside it. The machine is shared: the load average before
and after is recorded; read ratios measured in one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from edgespec.bench.serve_bench import QUESTIONS, running

MODEL = "smollm2-135m"
SYSTEM = "You are a helpful assistant. Answer in detail."
CTX = 4096


def systems(modes: list[str], threads: int, model_path: Path) -> dict[str, list[str]]:
    out = {}
    for mode in modes:
        for parallel in (1, 4):
            out[f"edgespec --parallel {parallel} --mode {mode}"] = [
                sys.executable, "-m", "edgespec.cli", "serve", "--port", "{port}", "--target", str(model_path),
                "--model-name", MODEL, "--mode", mode, "--ctx", str(CTX), "--threads", str(threads),
                "--parallel", str(parallel), "--max-queue", "64"]
    out["llama-server --parallel 4"] = ["{llama-server}", "-m", str(model_path), "--port", "{port}", "--host", "127.0.0.1",
                                        "-c", str(CTX), "-np", "4", "-t", str(threads), "-tb", str(threads),
                                        "--alias", MODEL, "--no-webui"]
    return out


def ask(url: str, question: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return {"latency_s": time.perf_counter() - t0, "completion_tokens": r.json()["usage"]["completion_tokens"]}


def level(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for j in range(per_client):
            try:
                row = ask(url, QUESTIONS[(c * per_client + j) % len(QUESTIONS)], max_tokens)
            except Exception as exc:  # noqa: BLE001 - reported
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                rows.append(row)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(r["latency_s"] for r in rows)
    p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))] if lat else None
    tokens = sum(r["completion_tokens"] for r in rows)
    return {"clients": clients, "requests": len(rows), "errors": errors, "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": p95}


def median_row(rows: list[dict]) -> dict:
    """The median of each measure over the repeats of one level."""
    out = {"clients": rows[0]["clients"], "repeats": len(rows), "errors": [e for r in rows for e in r["errors"]]}
    for key in ("tokens_per_s", "latency_p50_s", "latency_p95_s", "tokens", "wall_s"):
        out[key] = statistics.median(r[key] for r in rows)
    return out


def render(results: dict) -> str:
    meta = results["meta"]
    names = list(results["systems"])
    levels = meta["clients"]
    lines = ["# Parallel slots: edgespec `serve --parallel` vs llama-server", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']}; load average before {meta['load_before']}, after {meta['load_after']} "
             "(the machine is shared with other jobs: read the ratios, measured in one run).", "",
             f"SmolLM2-135M Q4_1, greedy, chat requests of {meta['max_tokens']} tokens at most, {meta['per_client']} "
             f"per client, KV pool {CTX} tokens, {meta['threads']} thread(s) per server; medians of {meta['repeats']} "
             "repeats, the systems taking turns at each level.", "",
             "## Aggregate tokens/s (completion tokens over the wall time of each level)", "",
             "| system | " + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in levels) + " |",
             "|---|" + "---:|" * len(levels)]
    for name in names:
        cells = [f"{r['tokens_per_s']:.1f}" for r in results["systems"][name]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Per-request latency p50 / p95 (s)", "",
              "| system | " + " | ".join(f"{c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
    for name in names:
        cells = [f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f}" for r in results["systems"][name]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratios at each level", ""]
    for mode in meta["modes"]:
        one = results["systems"].get(f"edgespec --parallel 1 --mode {mode}")
        four = results["systems"].get(f"edgespec --parallel 4 --mode {mode}")
        peer = results["systems"].get("llama-server --parallel 4")
        if not (one and four):
            continue
        ratio = lambda a, b: " | ".join(f"{x['tokens_per_s'] / y['tokens_per_s']:.2f}" for x, y in zip(a, b))  # noqa: E731
        lines.append(f"- `--mode {mode}`: --parallel 4 / --parallel 1: | {ratio(four, one)} |")
        if peer:
            lines.append(f"- `--mode {mode}`: --parallel 4 / llama-server --parallel 4: | {ratio(four, peer)} |")
    errors = {n: sum(len(r["errors"]) for r in rows) for n, rows in results["systems"].items()}
    lines += ["", f"Errors: {errors}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="ar,auto")
    ap.add_argument("--systems", default="", help="only systems whose name contains one of these (comma-separated)")
    ap.add_argument("--out", default="bench/PARALLEL_RESULTS.md")
    args = ap.parse_args(argv)
    from edgespec.models import store

    model_path = store.pull(MODEL, progress=False)
    clients = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    chosen = systems(modes, args.threads, model_path)
    if args.systems:
        keep = args.systems.split(",")
        chosen = {n: c for n, c in chosen.items() if any(k in n for k in keep)}
    if any("{llama-server}" in cmd for cmd in chosen.values()):
        from edgespec.bench.llama_tools import ensure_tools

        server = str(ensure_tools() / "llama-server")
        chosen = {n: [server if c == "{llama-server}" else c for c in cmd] for n, cmd in chosen.items()}
    out = Path(args.out)
    load_before = os.getloadavg()
    runs: dict[str, list[list[dict]]] = {name: [[] for _ in clients] for name in chosen}
    with ExitStack() as stack:
        # Every server is up at once (idle ones cost no CPU) and the systems take turns at each level,
        # repeat after repeat, so the shared machine's load drifts over all of them alike.
        urls = {name: stack.enter_context(running(cmd, out.with_name(f"{out.stem}.{i}.server.log")))
                for i, (name, cmd) in enumerate(chosen.items())}
        for url in urls.values():
            ask(url, "Hello.", 8)  # warm-up (and auto's cost profile)
        for r in range(args.repeats):
            for i, c in enumerate(clients):
                for name, url in urls.items():
                    row = level(url, c, args.per_client, args.max_tokens)
                    runs[name][i].append(row)
                    print(f"repeat {r + 1}, {c} clients, {name}: {row['tokens_per_s']:.1f} tok/s, "
                          f"p50 {row['latency_p50_s']:.2f} s", file=sys.stderr, flush=True)
    results = {"systems": {name: [median_row(rows) for rows in per_level] for name, per_level in runs.items()},
               "runs": runs}
    results["meta"] = {"command": "python -m edgespec.bench.parallel_bench " + " ".join(argv or sys.argv[1:]),
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                       "load_before": [round(x, 2) for x in load_before],
                       "load_after": [round(x, 2) for x in os.getloadavg()], "clients": clients,
                       "per_client": args.per_client, "max_tokens": args.max_tokens, "threads": args.threads,
                       "modes": modes, "repeats": args.repeats}
    out.write_text(render(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
