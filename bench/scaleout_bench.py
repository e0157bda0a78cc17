"""Scale-out bench: the verifier tier alone, one process vs Ray Serve with 1 and 2 replicas (one thread each).

    python -m edgespec.bench.scaleout_bench [--clients 1,2,4,8] [--rounds 24] [--k 4] [--repeats 2] [--out bench/out]

Writes results.json and SCALEOUT_RESULTS.md into --out. The clients are synthetic sessions that
do not draft (so their CPU does not compete with the replicas on a small machine): each starts a
session on a shipped prompt and sends `--rounds` verify requests of k tokens taken from the
target's own greedy continuation (re-aligned after a rejection), one request at a time, as fast
as the answers come (past the continuation's end of text the drafts are filler: a verification
costs the same pass whatever it holds). Per system and number of concurrent sessions: aggregate committed tokens/s
and verifications/s over the window where all sessions run, and p50 / p95 of the verify round trip.

Systems, all on 127.0.0.1 with SmolLM2-135M Q4_1 as the target, greedy:
* process: `edgespec serve --verifier --threads 1` (one process, one model)
* ray-1: `serve --verifier --ray --replicas 1 --threads 1` (the same replica behind the Serve proxy and
  the ingress: the cost of the two extra hops)
* ray-2: `--replicas 2` (one thread each; sessions spread by the router)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from edgespec.bench.cloud_bench import PROMPTS, free_port, wait_health

API_KEY = "bench-key-0123456789"
SYSTEMS = ("process", "ray-1", "ray-2")


def continuations(target: Path, n_sessions: int, n_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) per session, computed once here."""
    from edgespec.engine import Engine, GenerationConfig

    prompts = [PROMPTS[i % len(PROMPTS)] + (f" (variant {i})" if i >= len(PROMPTS) else "") for i in range(n_sessions)]
    with Engine.load(str(target), n_ctx=1024, n_threads=1) as engine:
        out = []
        for p in prompts:
            ids = engine.prompt_tokens(p)
            out.append((ids, engine.generate_tokens(ids, GenerationConfig(max_tokens=n_tokens, temperature=0.0,
                                                                          mode="ar")).tokens))
        return out


class SyntheticSession:
    """One session driven over HTTP with drafts from the target's continuation."""

    def __init__(self, url: str, prompt: list[int], continuation: list[int], k: int):
        from edgespec.cloud.protocol import CONTENT_TYPE

        self.http = httpx.Client(base_url=url, trust_env=False, timeout=120.0,
                                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": CONTENT_TYPE})
        self.prompt, self.continuation, self.k = prompt, continuation, k
        self.latencies: list[float] = []
        self.committed = 0
        self.replica = None

    def call(self, path: str, message) -> dict:
        import msgpack

        from edgespec.cloud.protocol import pack

        r = self.http.post(path, content=pack(message.to_wire()))
        self.replica = r.headers.get("x-edgespec-replica", self.replica)
        answer = msgpack.unpackb(r.content, raw=False)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {answer}")
        return answer

    def run(self, rounds: int, start_barrier: threading.Barrier, t_first: list, t_last: list) -> None:
        from edgespec.cloud.protocol import SessionRequest, VerifyRequest
        from edgespec.sampling import SamplingParams

        history = list(self.prompt)
        answer = self.call("/v1/sessions", SessionRequest(np.asarray(history, dtype=np.int32),
                                                          SamplingParams(temperature=0.0), 0))
        sid, revision = answer["session_id"], answer["revision"]
        start_barrier.wait()
        t_first.append(time.perf_counter())
        for _ in range(rounds):
            done = len(history) - len(self.prompt)
            aligned = history[len(self.prompt):] == self.continuation[:done]
            draft = self.continuation[done:done + self.k] if aligned else []
            draft = draft or [history[-1]] * self.k  # off the known path: any draft costs the same pass
            t = time.perf_counter()
            answer = self.call(f"/v1/sessions/{sid}/verify",
                               VerifyRequest(revision, len(history), np.asarray(draft, dtype=np.int32)))
            self.latencies.append(time.perf_counter() - t)
            n = answer["n_accepted"]
            history += draft[:n] + [answer["token"]]
            revision = answer["revision"]
            self.committed += n + 1
        t_last.append(time.perf_counter())
        self.http.delete(f"/v1/sessions/{sid}")
        self.http.close()


def measure(url: str, sessions_data, n_clients: int, rounds: int, k: int) -> dict:
    sessions = [SyntheticSession(url, *sessions_data[j], k) for j in range(n_clients)]
    barrier = threading.Barrier(n_clients)
    t_first: list[float] = []
    t_last: list[float] = []
    threads = [threading.Thread(target=s.run, args=(rounds, barrier, t_first, t_last)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    elapsed = max(t_last) - min(t_first)
    lat = sorted(x for s in sessions for x in s.latencies)
    drafted = n_clients * rounds * k
    return {"clients": n_clients, "tokens_per_s": sum(s.committed for s in sessions) / elapsed,
            "acceptance": (sum(s.committed for s in sessions) - len([x for s in sessions for x in s.latencies])) / drafted,
            "verifies_per_s": len(lat) / elapsed, "p50_ms": 1000 * lat[len(lat) // 2],
            "p95_ms": 1000 * lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "replicas_used": len({s.replica for s in sessions if s.replica})}


def run_process(target: Path, sessions_data, clients, rounds, k, max_sessions) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--verifier", "--target", str(target), "--port", str(port),
           "--api-key", API_KEY, "--threads", "1", "--max-sessions", str(max_sessions), "--session-ctx", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(f"http://127.0.0.1:{port}")
        return [measure(f"http://127.0.0.1:{port}", sessions_data, n, rounds, k) for n in clients]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_ray(target: Path, sessions_data, clients, rounds, k, replicas: int, max_sessions: int) -> list[dict]:
    from edgespec.serve import scaleout
    from edgespec.cloud.verifier import VerifierConfig

    options = scaleout.RayOptions(replicas=replicas, cpus_per_replica=1.0)
    config = VerifierConfig(api_keys=(API_KEY,), max_sessions=max_sessions, max_context=512)
    deployment = scaleout.deploy(scaleout.VERIFIER_APP, scaleout.verifier_app(str(target), config, {"n_threads": 1},
                                                                              options),
                                 options, host="127.0.0.1", port=free_port())
    try:
        measure(deployment.url, sessions_data, 1, 4, k)  # warm-up: the first requests set up the routes
        return [measure(deployment.url, sessions_data, n, rounds, k) for n in clients]
    finally:
        deployment.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=2, help="runs of every system, in alternating order; medians")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    from edgespec.machine.hardware import detect_cpu
    from edgespec.models import store

    clients = [int(c) for c in args.clients.split(",")]
    target = store.pull("smollm2-135m", progress=False)
    sessions_data = continuations(target, max(clients), args.rounds * (args.k + 1) + 8)
    cpu = detect_cpu()
    results = {"machine": {"platform": platform.platform(), "cpu": cpu.name, "logical_cores": cpu.logical_cores,
                           "load_avg_at_start": list(os.getloadavg())},
               "settings": {"rounds": args.rounds, "k": args.k, "target": target.name}, "systems": {}}
    runs: dict[str, list[list[dict]]] = {}
    names = args.systems.split(",")
    for repeat in range(args.repeats):  # forward, then backward: drift of a shared machine's load evens out
        for system in names if repeat % 2 == 0 else names[::-1]:
            print(f"{system} (run {repeat + 1}) ...", file=sys.stderr, flush=True)
            if system == "process":
                rows = run_process(target, sessions_data, clients, args.rounds, args.k, max(clients))
            else:
                rows = run_ray(target, sessions_data, clients, args.rounds, args.k, int(system.split("-")[1]),
                               max(clients))
            runs.setdefault(system, []).append(rows)
            for row in rows:
                print(f"  {row}", file=sys.stderr, flush=True)
    for system in names:
        results["systems"][system] = [{key: (statistics.median(run[i][key] for run in runs[system])
                                             if key != "clients" else row["clients"]) for key in row}
                                      for i, row in enumerate(runs[system][0])]
    results["runs"] = runs
    results["machine"]["load_avg_at_end"] = list(os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    command = "python -m edgespec.bench.scaleout_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "SCALEOUT_RESULTS.md").write_text(render(results, command.strip()))
    print(render(results, command.strip()))
    return 0


def render(results: dict, command: str) -> str:
    m, systems = results["machine"], results["systems"]
    lines = [f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['platform']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])}, at end "
             f"{', '.join(f'{x:.1f}' for x in m.get('load_avg_at_end', []))} (shared machine: absolute numbers are "
             f"noisy). Medians of {len(next(iter(results.get('runs', {}).values()), [None]))} runs per cell.",
             f"Command: `{command}`", "",
             "| system | sessions | tokens/s | verifies/s | p50 ms | p95 ms | acceptance | replicas used | "
             "verifies/s x process |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["clients"]: r["verifies_per_s"] for r in systems.get("process", [])}
    for name, rows in systems.items():
        for r in rows:
            ratio = f"{r['verifies_per_s'] / base[r['clients']]:.2f}" if r["clients"] in base else "-"
            lines.append(f"| {name} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['verifies_per_s']:.1f} | "
                         f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['acceptance']:.2f} | {r['replicas_used']:g} | "
                         f"{ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
