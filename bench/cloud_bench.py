"""Cloud-edge bench: edge-only, cloud-only, sequential and pipelined cloud-edge speculation over an
emulated link (RTT 10 / 50 / 100 ms, 20 Mbit/s up, 200 Mbit/s down), server and client on different cores.

    python -m edgespec.bench.cloud_bench [--models smollm2|qwen] [--max-tokens 128] [--repeats 2] [--out bench/out]

Writes results.json and CLOUD_RESULTS.md into --out. Greedy decoding. The verifier runs as its own
process pinned to the last core (`taskset`), the link proxy beside it; this process (the device) is
pinned to core 0 and drafts with one thread. Each cloud-edge mode first tunes its gate online
(optuna, as the client does by default) on warm-up generations, then is measured with the gate found.

* edge-only: the draft model decoding alone on the device.
* cloud-only: the target decoding alone on the server core (measured there), plus one RTT for the
  request; what a plain streaming API would give at best.
* sequential: draft a block, send it, wait for the answer, repeat.
* pipelined (1 in flight): keep drafting ahead while the one verification is in flight; send the
  next block once its answer confirms it.
* pipelined (3 in flight): continuous upload (PipeSD-style): each block goes out as soon as its gate
  closes, drafted after the blocks in flight and the bonus guessed for each; up to three in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Explain how a hash table handles collisions, in three short paragraphs.",
    "Rewrite this loop as a list comprehension and explain the change: result = []\nfor v in values:\n"
    "    if v > 0:\n        result.append(v * 2)",
]
RTTS = (10, 50, 100)
UP_MBIT, DOWN_MBIT = 20.0, 200.0
KEY = "bench-key-0123456789"
# mode: (label, CloudOptions overrides)
MODES = {
    "sequential": ("sequential", dict(pipelined=False)),
    "pipelined-1": ("pipelined (1 in flight)", dict(pipelined=True, max_inflight=1)),
    "pipelined": ("pipelined (3 in flight)", dict(pipelined=True, max_inflight=3)),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, timeout: float = 120.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/v1/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no verifier at {url}")


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *cmd]


def resolve_models(which: str, out: Path) -> tuple[Path, Path]:
    from edgespec.models import store
    from edgespec.runtimes.llamacpp import quantize

    if which == "qwen":
        return store.resolve("qwen2.5-coder-1.5b"), store.resolve("qwen2.5-coder-0.5b")
    target = store.resolve("smollm2-135m")
    draft = out / "smollm2-q4_0.gguf"
    if not draft.exists():
        quantize(target, draft, "q4_0")
    return target, draft


def plain_tok_s(model: Path, prompt_ids_list, max_tokens: int, core: int) -> list[dict]:
    """Plain decoding of `model` pinned to `core`, one thread (in this process, affinity switched)."""
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        engine = Engine(LlamaCppRuntime(model, LlamaCppOptions(n_ctx=2048, n_threads=1)))
        runs = []
        for ids in prompt_ids_list:
            r = engine.generate_tokens(ids, GenerationConfig(max_tokens=max_tokens, temperature=0, mode="ar"))
            runs.append({"generated": r.stats.generated, "decode_s": r.stats.decode_s, "ttft_s": r.stats.ttft_s,
                         "tokens_per_s": r.stats.tokens_per_s})
        engine.close()
        return runs
    finally:
        os.sched_setaffinity(0, before)


def run_cloud(client, prompt_ids_list, max_tokens: int, repeats: int, warmup: int) -> list[dict]:
    from edgespec.engine import GenerationConfig

    cfg = GenerationConfig(max_tokens=max_tokens, temperature=0)
    for i in range(warmup):  # the gate tuner learns here
        client.generate_tokens(prompt_ids_list[i % len(prompt_ids_list)], cfg)
    runs = []
    for _ in range(repeats):
        for ids in prompt_ids_list:
            r = client.generate_tokens(ids, cfg)
            s = r.stats
            runs.append({
                "generated": s.generated, "decode_s": s.decode_s, "ttft_s": s.ttft_s, "tokens_per_s": s.tokens_per_s,
                "e2e_tokens_per_s": s.generated / (s.prefill_s + s.decode_s),
                "rounds": s.rounds, "mean_accepted_length": s.mean_accepted_length,
                "verifier_passes": s.verifier_passes, "passes_per_token": s.verifier_passes / s.generated,
                "bytes_per_token": (s.bytes_sent + s.bytes_received) / s.generated,
                "bytes_up_per_token": s.bytes_sent / s.generated, "offline_tokens": s.offline_tokens,
                "predrafted": s.predrafted, "promoted": s.promoted, "stale_blocks": s.stale_blocks,
                "rebuilds": s.rebuilds, "wait_s": s.wait_s, "rtt_ms": s.rtt_ms,
                "gate": s.gate,
            })
    return runs


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) if runs else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cloud-edge speculation bench")
    parser.add_argument("--models", default="smollm2", choices=["smollm2", "qwen"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4, help="generations that tune the gate before measuring")
    parser.add_argument("--rtts", default=",".join(map(str, RTTS)))
    parser.add_argument("--out", default="bench/out/cloud")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_cores = os.cpu_count() or 1
    device_core, server_core = 0, n_cores - 1
    if n_cores < 2:
        print("warning: one core only; server and client share it", file=sys.stderr)

    from edgespec.cloud.client import CloudEdgeClient, CloudOptions
    from edgespec.engine import Engine
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    target, draft = resolve_models(args.models, out)
    os.sched_setaffinity(0, {device_core})
    tokenizer = Engine(LlamaCppRuntime(draft, LlamaCppOptions(n_ctx=2048, n_threads=1)))
    prompt_ids = [tokenizer.prompt_tokens(p) for p in PROMPTS]
    tokenizer.close()

    results: dict = {"machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                                 "cores": n_cores, "python": platform.python_version(),
                                 "load_avg_at_start": os.getloadavg()},
                     "models": {"target": str(target), "draft": str(draft)}, "max_tokens": args.max_tokens,
                     "link": {"up_mbit": UP_MBIT, "down_mbit": DOWN_MBIT}, "rtts": {}}
    print("edge-only ...", file=sys.stderr, flush=True)
    results["edge_only"] = plain_tok_s(draft, prompt_ids, args.max_tokens, device_core)
    print("cloud-only (target on the server core) ...", file=sys.stderr, flush=True)
    results["target_plain_on_server_core"] = plain_tok_s(target, prompt_ids, args.max_tokens, server_core)

    port = free_port()
    server = subprocess.Popen(pinned(server_core, [sys.executable, "-m", "edgespec.cli", "serve", "--verifier", "--target",
                                                   str(target), "--port", str(port), "--api-key", KEY,
                                                   "--threads", "1", "--max-sessions", "4", "--session-ctx", "1024",
                                                   "--rate", "100000"]),
                              stdout=subprocess.DEVNULL, stderr=open(out / "verifier.log", "wb"))
    try:
        wait_health(f"http://127.0.0.1:{port}")
        for rtt in [int(r) for r in args.rtts.split(",")]:
            proxy_port = free_port()
            proxy = subprocess.Popen(pinned(server_core, [sys.executable, "-m", "edgespec.cloud.proxy", "--to",
                                                          f"127.0.0.1:{port}", "--port", str(proxy_port), "--rtt-ms",
                                                          str(rtt), "--up-mbit", str(UP_MBIT), "--down-mbit",
                                                          str(DOWN_MBIT)]), stdout=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{proxy_port}"
                wait_health(url)
                entry = {}
                for mode, (label, overrides) in MODES.items():
                    print(f"rtt {rtt} ms, {label} ...", file=sys.stderr, flush=True)
                    options = CloudOptions(url, api_key=KEY, tune=True, tune_trials=10, tune_window_tokens=32,
                                           deadline_s=30.0, **overrides)
                    with CloudEdgeClient.load(draft, options, n_ctx=2048, n_threads=1) as client:
                        entry[mode] = run_cloud(client, prompt_ids, args.max_tokens, args.repeats, args.warmup)
                results["rtts"][str(rtt)] = entry
            finally:
                proxy.kill()
                proxy.wait()
    finally:
        server.kill()
        server.wait()

    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "CLOUD_RESULTS.md").write_text(render(results, " ".join(["python -m edgespec.bench.cloud_bench",
                                                                     *(argv if argv is not None else sys.argv[1:])])))
    print((out / "CLOUD_RESULTS.md").read_text())
    return 0


def render(results: dict, command: str) -> str:
    m = results["machine"]
    edge = median(results["edge_only"], "tokens_per_s")
    cloud_plain = results["target_plain_on_server_core"]
    lines = [
        "# Cloud-edge speculation", "",
        f"Command: `{command}`", "",
        f"Machine: {m['platform']}, {m['cores']} cores ({m['cpu']}), Python {m['python']}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])} (shared machine: absolute numbers are noisy, ratios "
        "within one run are the solid part).",
        f"Target (server): `{Path(results['models']['target']).name}`; draft (device): "
        f"`{Path(results['models']['draft']).name}`. Greedy, {results['max_tokens']} tokens, medians over prompts x "
        "repeats. Server and device each pinned to one core (`taskset`), one thread each; link emulated by "
        f"`edgespec.cloud.proxy`: RTT as listed, {results['link']['up_mbit']:g} Mbit/s up, "
        f"{results['link']['down_mbit']:g} Mbit/s down.", "",
        "tok/s is generated / decode time (prefill excluded, as everywhere in edgespec); passes/token counts every "
        "target forward pass on the server, prompt prefill and session rebuilds included; bytes/token counts HTTP "
        "bodies and headers in both directions.", "",
        "| RTT | system | tok/s | × sequential | passes/token | 1/MAL + 0.05 | mean accepted length | bytes/token "
        "(up) | promoted / predrafted | stale blocks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rtt, entry in results["rtts"].items():
        seq = median(entry["sequential"], "tokens_per_s")
        cloud_only = statistics.median(r["generated"] / (r["decode_s"] + int(rtt) / 1000) for r in cloud_plain)
        lines.append(f"| {rtt} ms | edge-only (draft model alone) | {edge:.1f} | {edge / seq:.2f} | - | - | - | 0 | - "
                     "| - |")
        lines.append(f"| {rtt} ms | cloud-only (target alone on the server core + 1 RTT) | {cloud_only:.1f} | "
                     f"{cloud_only / seq:.2f} | 1.00 | - | 1 | - | - | - |")
        for mode, (label, _) in MODES.items():
            runs = entry[mode]
            tps = median(runs, "tokens_per_s")
            mal = median(runs, "mean_accepted_length")
            promoted = sum(r["promoted"] for r in runs)
            predrafted = sum(r["predrafted"] for r in runs)
            lines.append(f"| {rtt} ms | {label} cloud-edge | {tps:.1f} | {tps / seq:.2f} | "
                         f"{median(runs, 'passes_per_token'):.3f} | {1 / mal + 0.05:.3f} | {mal:.2f} | "
                         f"{median(runs, 'bytes_per_token'):.0f} ({median(runs, 'bytes_up_per_token'):.0f}) | "
                         f"{promoted} / {predrafted} | {sum(r['stale_blocks'] for r in runs)} |")
    lines += ["", "Gates found by the online tuner (last measured run):", ""]
    for rtt, entry in results["rtts"].items():
        for mode, (label, _) in MODES.items():
            g = entry[mode][-1]["gate"]
            lines.append(f"- RTT {rtt} ms, {label}: token threshold {g['token_threshold']:.2f}, product threshold "
                         f"{g['product_threshold']:.2f}, max block {g['max_block']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
