"""Benchmark of `edgespec serve` as clients see it: a real server process on loopback, HTTP clients.

    python -m edgespec.bench.serve_bench [--models smollm2|qwen|all] [--repeats 5] [--max-tokens 64]
                                         [--threads N] [--out bench/SERVE_RESULTS.md]

For each model setup (SmolLM2-135M with prompt lookup; Qwen2.5-Coder-1.5B with the 0.5B draft):

1. Time to first token with and without prefix reuse. A chat request with a long system prompt
   (about 600 tokens) and a short question. "cold": the system prompt starts with a tag unique to the
   request, so nothing of it is in any cache and all of it is prefilled. "warm": the same system
   prompt as an earlier request, a new question: its KV comes from the server's cache. Cold and warm
   requests alternate, so the warm one never follows its own prefix directly: it is restored from the
   prefix cache, not just kept by the runtime. TTFT is timed by the client: request sent to the first
   streamed chunk with text.
2. Throughput and latency at 1 and 4 concurrent clients: each client sends requests one after
   another (distinct questions, a short shared system prompt, `max_tokens` tokens, greedy); tokens/s
   is all completion tokens over the wall time of the whole run; latency is per request, send to the
   last byte. The server serves one request at a time (its runtimes hold one KV sequence), so at 4
   clients latency grows with the queue while throughput stays that of one stream.

Writes a markdown report (and a JSON file beside it). Machines are shared: the load average before
and after is recorded; read ratios measured in one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

SETUPS = {
    "smollm2": {"label": "SmolLM2-135M Q4_1, prompt lookup", "args": ["--target", "smollm2-135m", "--mode", "lookup"],
                "model": "smollm2-135m"},
    "qwen": {"label": "Qwen2.5-Coder-1.5B Q4_K_M + 0.5B draft", "model": "qwen2.5-coder-1.5b",
             "args": ["--target", "qwen2.5-coder-1.5b", "--draft", "qwen2.5-coder-0.5b", "--mode", "draft"]},
}

LONG_SYSTEM = (
    "You are the support assistant of a company that builds a command-line tool for data engineers. "
    "The tool reads CSV, Parquet and JSON files, validates them against a schema, converts between "
    "formats, and loads the result into a database. Users run it on laptops and on CI servers. "
    "When you answer, first restate the user's goal in one sentence, then give the exact command, "
    "then explain each flag briefly. Prefer portable shell syntax. Never invent flags: the tool has "
    "--input, --output, --schema, --format, --delimiter, --encoding, --chunk-size, --workers, "
    "--dry-run, --verbose and --log-file, nothing else. If a request needs something the tool cannot "
    "do, say so plainly and suggest a combination of standard Unix tools instead. "
) * 4
SHORT_SYSTEM = "You are a concise programming assistant."
QUESTIONS = [
    "How do I convert a CSV file to Parquet?",
    "How can I validate a JSON file against a schema without loading it?",
    "Which flag sets the number of parallel workers?",
    "How do I read a semicolon-separated file?",
    "Write a Python function that reverses a linked list.",
    "What does a dry run do?",
    "How do I log to a file instead of the terminal?",
    "Write a shell loop that converts every CSV in a folder.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(cmd: list[str], log: Path, health: str = "/health"):
    """A server process started from `cmd` ("{port}" becomes a free port), yielded once healthy, stopped after."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server never became healthy")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def server(setup: dict, threads: int | None, log: Path):
    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--port", "{port}", "--ctx", "4096", *setup["args"]]
    cmd += ["--threads", str(threads)] if threads else []
    with running(cmd, log) as url:
        yield url, " ".join(cmd[2:]).replace("{port}", url.rsplit(":", 1)[1])


def stream_chat(url: str, model: str, system: str, question: str, max_tokens: int) -> dict:
    """One streamed chat request, timed by the client."""
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    final = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if first is None and choice.get("delta", {}).get("content"):
                first = time.perf_counter()
            if choice.get("finish_reason"):
                final = chunk
    end = time.perf_counter()
    ext = final["edgespec"]
    return {"ttft_s": (first or end) - t0, "latency_s": end - t0, "completion_tokens": final["usage"]["completion_tokens"],
            "prompt_tokens": final["usage"]["prompt_tokens"], "cached_tokens": final["usage"]["prompt_tokens_details"]["cached_tokens"],
            "server_ttft_s": ext["ttft_s"], "queue_s": ext["queue_s"], "prefix_source": (ext.get("prefix_cache") or {}).get("source"),
            "acceptance_rate": ext["acceptance_rate"], "tokens_per_s": ext["tokens_per_s"]}


def bench_ttft(url: str, model: str, repeats: int) -> dict:
    stream_chat(url, model, LONG_SYSTEM, "Hello.", 4)  # warm-up: first-request costs out of the way
    cold, warm = [], []
    for i in range(repeats):
        cold.append(stream_chat(url, model, f"[ticket {uuid.uuid4().hex[:8]}] " + LONG_SYSTEM, QUESTIONS[i % 8], 8))
        warm.append(stream_chat(url, model, LONG_SYSTEM, QUESTIONS[(i + 3) % 8], 8))
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"cold": cold, "warm": warm,
            "summary": {"prompt_tokens": med(cold, "prompt_tokens"),
                        "cold_ttft_s": med(cold, "ttft_s"), "warm_ttft_s": med(warm, "ttft_s"),
                        "cold_cached_tokens": med(cold, "cached_tokens"), "warm_cached_tokens": med(warm, "cached_tokens"),
                        "warm_sources": sorted({r["prefix_source"] for r in warm}),
                        "speedup": med(cold, "ttft_s") / med(warm, "ttft_s")}}


def bench_concurrency(url: str, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for j in range(per_client):
            try:
                row = stream_chat(url, model, SHORT_SYSTEM, QUESTIONS[(c * per_client + j) % 8], max_tokens)
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
    tokens = sum(r["completion_tokens"] for r in rows)
    lat = sorted(r["latency_s"] for r in rows)
    return {"clients": clients, "requests": len(rows), "errors": errors, "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "latency_median_s": statistics.median(lat), "latency_max_s": lat[-1],
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
            "queue_median_s": statistics.median(r["queue_s"] for r in rows),
            "stream_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
            "acceptance_median": statistics.median(r["acceptance_rate"] for r in rows)}


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# `edgespec serve` benchmark",
        "",
        f"Command: `{results['command']}`",
        "",
        f"- CPU: {m.get('cpu')} ({m.get('physical_cores')} physical / {m.get('logical_cores')} logical cores), "
        f"{m.get('ram_gib')} GiB RAM, {m.get('os')}",
        f"- Python {m.get('python')}, llama-cpp-python {m.get('llama_cpp_python')}, server threads: "
        f"{results['threads'] or 'default (physical cores)'}",
        f"- load average before / after: {m.get('load_average_start')} / {results['load_average_end']} "
        "(a shared machine: other jobs ran alongside; compare the ratios within a run)",
        f"- {results['date']}; greedy; {results['repeats']} cold/warm pairs; {results['max_tokens']} tokens per "
        "request in the concurrency runs",
        "",
        "## Time to first token, with and without prefix reuse",
        "",
        "Client-timed, request sent to the first streamed text; medians. Cold: a system prompt no cache holds; "
        "warm: the same long system prompt as an earlier request (restored from the prefix cache).",
        "",
        "| setup | prompt tokens | cold TTFT (ms) | warm TTFT (ms) | cold / warm | cached tokens cold / warm | warm KV from |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["setups"].items():
        s = r["ttft"]["summary"]
        lines.append(f"| {r['label']} | {s['prompt_tokens']:.0f} | {s['cold_ttft_s'] * 1000:.0f} | "
                     f"{s['warm_ttft_s'] * 1000:.0f} | {s['speedup']:.1f}x | {s['cold_cached_tokens']:.0f} / "
                     f"{s['warm_cached_tokens']:.0f} | {', '.join(s['warm_sources'])} |")
    lines += [
        "",
        "## Throughput and latency at 1 and 4 concurrent clients",
        "",
        "Each client sends its requests one after another; tokens/s = all completion tokens / wall time. "
        "Requests are served one at a time in arrival order (no batching across requests), so the queue "
        "shows up in latency, not in throughput.",
        "",
        "| setup | clients | requests | tokens/s (all clients) | per-stream decode tok/s (median) | latency median / max (s) | TTFT median (s) | queued median (s) | acceptance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["setups"].items():
        for c in r["concurrency"]:
            lines.append(f"| {r['label']} | {c['clients']} | {c['requests']} | {c['tokens_per_s']:.1f} | "
                         f"{c['stream_tokens_per_s_median']:.1f} | {c['latency_median_s']:.2f} / {c['latency_max_s']:.2f} | "
                         f"{c['ttft_median_s']:.2f} | {c['queue_median_s']:.2f} | {c['acceptance_median']:.2f} |")
            if c["errors"]:
                lines.append(f"|  | errors: {len(c['errors'])} ({c['errors'][0][:80]}) |")
    lines += [
        "",
        "Reading: cold / warm is what the prefix cache saves on a long shared system prompt (the warm request's",
        "KV is restored from the cache, then only its question is prefilled). At 4 clients the aggregate",
        "tokens/s matches 1 client because requests are generated one at a time; the wait shows in the",
        "queued and TTFT columns. Absolute speeds depend on what else the machine runs (see the load average).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", choices=["smollm2", "qwen", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench/SERVE_RESULTS.md")
    args = parser.parse_args(argv)

    from edgespec.bench.run import describe_machine

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"machine": describe_machine(), "threads": args.threads, "repeats": args.repeats,
               "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
               "command": "python -m edgespec.bench.serve_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
               "setups": {}}
    names = ["smollm2", "qwen"] if args.models == "all" else [args.models]
    for name in names:
        setup = SETUPS[name]
        with server(setup, args.threads, Path(tempfile.gettempdir()) / f"edgespec_serve_bench_{name}.log") as (url, cmd):
            print(f"{name}: {cmd}", file=sys.stderr, flush=True)
            ttft = bench_ttft(url, setup["model"], args.repeats)
            print(f"  ttft {ttft['summary']}", file=sys.stderr, flush=True)
            runs = []
            for clients in (1, 4):
                per_client = args.per_client * (4 if clients == 1 else 1)  # the same number of requests
                runs.append(bench_concurrency(url, setup["model"], clients, per_client, args.max_tokens))
                print(f"  {clients} clients: {runs[-1]['tokens_per_s']:.1f} tok/s, "
                      f"latency median {runs[-1]['latency_median_s']:.2f}s", file=sys.stderr, flush=True)
            results["setups"][name] = {"label": setup["label"], "server": cmd, "ttft": ttft, "concurrency": runs}
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    results["load_average_end"] = [round(x, 2) for x in load] if load else None
    out.write_text(render(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
