"""Load on `edgespec serve --parallel N` and on the cloud verifier, as clients make it: many at once,
streaming, reading slowly, vanishing mid-stream. Every request must be answered, or refused at once
(429/503, with a JSON reason); none lost. Reports p50/p95 latency per kind of client.

    python -m edgespec.bench.load_bench [--clients 64] [--parallel 4] [--sessions 32] [--max-tokens 16]
                                        [--out bench/LOAD_RESULTS.json]

Starts the servers itself on loopback (SmolLM2-135M from the model store: `serve --parallel N` and
`serve --verifier`). tests/test_load.py runs the same load, smaller, as a test. Machines are shared:
read the latencies of one run against each other, not as absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from edgespec.bench import serve_bench

BEHAVIOURS = ("whole", "stream", "slow", "vanish")  # client i behaves as BEHAVIOURS[i % 4]
REFUSED = (429, 503)   # busy: refused at once, with Retry-After and a JSON reason
REFUSED_WITHIN_S = 5.0  # "at once": a refusal never waits for a generation


@dataclass
class Outcome:
    """What one request got."""

    client: int
    behaviour: str
    status: int | None         # None: no answer at all (a transport error or a timeout) -- a lost request
    latency_s: float           # sent to the last byte read (for `vanish`, to the moment it hung up)
    first_byte_s: float | None = None
    reason: str | None = None  # the refusal's error message, or the transport error


# --- the OpenAI server --------------------------------------------------------------------------------

async def _one_request(client: httpx.AsyncClient, url: str, model: str, i: int, behaviour: str,
                       max_tokens: int, timeout_s: float) -> Outcome:
    body = {"model": model, "prompt": f"Client {i} counts: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0,
            "stream": behaviour != "whole"}
    t0 = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                data = json.loads(await r.aread())
                return Outcome(i, behaviour, r.status_code, time.perf_counter() - t0, reason=data["error"]["message"])
            async for chunk in r.aiter_raw():
                first = first if first is not None else time.perf_counter() - t0
                if behaviour == "vanish" and chunk.strip():  # gone after the first event
                    break
                if behaviour == "slow":
                    await asyncio.sleep(0.05)
            return Outcome(i, behaviour, r.status_code, time.perf_counter() - t0, first)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Outcome(i, behaviour, None, time.perf_counter() - t0, first, f"{type(exc).__name__}: {exc}")


async def serve_load(url: str, model: str, clients: int = 64, requests_per_client: int = 2, max_tokens: int = 16,
                     timeout_s: float = 120.0) -> list[Outcome]:
    """`clients` clients at once, each sending `requests_per_client` requests one after another."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        async def one_client(i: int) -> list[Outcome]:
            behaviour = BEHAVIOURS[i % len(BEHAVIOURS)]
            return [await _one_request(client, url, model, i, behaviour, max_tokens, timeout_s)
                    for _ in range(requests_per_client)]
        done = await asyncio.gather(*(one_client(i) for i in range(clients)))
    return [o for outcomes in done for o in outcomes]


# --- the cloud verifier -----------------------------------------------------------------------------

async def verifier_load(url: str, key: str, sessions: int = 32, rounds: int = 4,
                        timeout_s: float = 60.0) -> list[Outcome]:
    """`sessions` edge sessions at once, each starting and verifying `rounds` empty drafts (greedy);
    a session the verifier evicted is started again, as the client does."""
    import msgpack

    from edgespec.cloud.protocol import CONTENT_TYPE, SessionRequest, VerifyRequest, pack
    from edgespec.sampling import SamplingParams

    headers = {"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {key}"}

    async def post(client, i: int, kind: str, path: str, message: dict) -> tuple[Outcome, dict | None]:
        t0 = time.perf_counter()
        try:
            r = await client.post(url + path, content=pack(message), headers=headers, timeout=timeout_s)
            data = msgpack.unpackb(r.content, raw=False)
        except (httpx.HTTPError, ValueError) as exc:
            return Outcome(i, kind, None, time.perf_counter() - t0, reason=f"{type(exc).__name__}: {exc}"), None
        reason = None if r.status_code == 200 else data.get("message")
        return Outcome(i, kind, r.status_code, time.perf_counter() - t0, reason=reason), data

    async def one_session(client, i: int) -> list[Outcome]:
        outcomes, state = [], None
        start = SessionRequest(np.arange(1, 9 + i % 5, dtype=np.int32), SamplingParams(temperature=0.0), i).to_wire()
        for _ in range(rounds + 2):  # bounded: a few restarts at most
            if state is None:
                outcome, state = await post(client, i, "start", "/v1/sessions", start)
                outcomes.append(outcome)
                state = state if outcome.status == 200 else None
                continue
            message = VerifyRequest(state["revision"], state["n_past"], np.zeros(0, np.int32)).to_wire()
            outcome, answer = await post(client, i, "verify", f"/v1/sessions/{state['session_id']}/verify", message)
            outcomes.append(outcome)
            if outcome.status == 200:
                state = {**state, **answer}
            else:
                state = None  # evicted (404) or refused: start again
        return outcomes

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=sessions), trust_env=False) as client:
        done = await asyncio.gather(*(one_session(client, i) for i in range(sessions)))
    return [o for outcomes in done for o in outcomes]


# --- reading the outcomes ---------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": round(float(np.percentile(values, 50)), 3),
            "p95_s": round(float(np.percentile(values, 95)), 3), "max_s": round(max(values), 3)}


def summary(outcomes: list[Outcome]) -> dict:
    """Counts by status, and latency percentiles of the answered requests and of the refusals, per kind."""
    out = {"requests": len(outcomes), "lost": sum(o.status is None for o in outcomes), "by_status": {}, "latency": {}}
    for o in outcomes:
        out["by_status"][str(o.status)] = out["by_status"].get(str(o.status), 0) + 1
    for kind in sorted({o.behaviour for o in outcomes}):
        mine = [o for o in outcomes if o.behaviour == kind]
        out["latency"][kind] = {"answered": percentiles([o.latency_s for o in mine if o.status == 200]),
                                "refused": percentiles([o.latency_s for o in mine if o.status in REFUSED])}
    return out


def problems(outcomes: list[Outcome], allowed: tuple[int, ...] = (200, *REFUSED)) -> list[str]:
    """What breaks "answered, or refused at once": lost requests, other statuses, slow refusals."""
    found = [f"client {o.client} ({o.behaviour}): no answer ({o.reason})" for o in outcomes if o.status is None]
    found += [f"client {o.client} ({o.behaviour}): {o.status} {o.reason}" for o in outcomes
              if o.status is not None and o.status not in allowed]
    found += [f"client {o.client} ({o.behaviour}): refused after {o.latency_s:.1f} s" for o in outcomes
              if o.status in REFUSED and o.latency_s > REFUSED_WITHIN_S]
    return found


# --- the servers, on loopback -----------------------------------------------------------------------

@contextmanager
def running(args: list[str], health: str, log: Path):
    """`edgespec serve ARGS` on a free loopback port until the block ends; yields its URL (serve_bench's lifecycle)."""
    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--host", "127.0.0.1", "--port", "{port}", *args]
    with serve_bench.running(cmd, log, health) as url:
        yield url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="per client, one after another")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--max-sessions", type=int, default=16, help="the verifier's; fewer than --sessions: evictions")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)

    from edgespec.models import store

    model = store.pull("smollm2-135m", progress=False)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results = {"setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "load_before": os.getloadavg()}
    with running(["--target", str(model), "--model-name", "smollm2", "--mode", "ar", "--parallel", str(args.parallel),
                  "--ctx", str(256 * args.parallel), "--max-queue", str(args.max_queue), "--threads", str(args.threads),
                  "--prefix-cache-mb", "0"], "/health", logs / "load_bench_serve.log") as url:
        t0 = time.perf_counter()
        outcomes = asyncio.run(serve_load(url, "smollm2", args.clients, args.requests, args.max_tokens))
        results["serve"] = {**summary(outcomes), "wall_s": round(time.perf_counter() - t0, 2),
                            "problems": problems(outcomes),
                            "server": httpx.get(url + "/health", timeout=10, trust_env=False).json()["requests"]}
    key = "load-bench-key"
    with running(["--verifier", "--target", str(model), "--api-key", key, "--max-sessions", str(args.max_sessions),
                  "--session-ctx", "256", "--threads", str(args.threads), "--rate", "10000"], "/v1/health",
                 logs / "load_bench_verifier.log") as url:
        t0 = time.perf_counter()
        outcomes = asyncio.run(verifier_load(url, key, args.sessions))
        results["verifier"] = {**summary(outcomes), "wall_s": round(time.perf_counter() - t0, 2),
                               "problems": problems(outcomes, (200, 404, *REFUSED))}
    results["load_after"] = os.getloadavg()
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if results["serve"]["problems"] or results["verifier"]["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
