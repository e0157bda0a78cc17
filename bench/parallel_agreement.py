"""How often a concurrent greedy request under `--parallel N` equals its solo answer, and why not.

    python -m edgespec.bench.parallel_agreement [--model smollm2-135m] [--requests 8] [--parallel 4]
                                                [--tokens 32] [--mode ar] [--threads 1] [--json OUT]

Each request runs alone (one engine, one sequence), then all run at once through `N` slots sharing
every pass (`SlotScheduler`, what `serve --parallel N` drives), with every verify pass recorded
(edgespec.audit). For every request: whether each pass's tokens are the acceptance rule's on its
recorded rows (zero tolerance), whether it equals its solo answer and, where it does not, why: the
row that emitted the first divergent token is compared with a fresh evaluation of its committed
prefix, and the bound is the spread this run measures between evaluating such prefixes at other batch
shapes (the divergence rows and each request's last row; edgespec.audit.Fresh). A row within it was
computed from the right cells, and the two answers part at a near-tie that batched arithmetic flipped
(the gap between the two tokens is printed); a row beyond it would be a slot reading the wrong cells.
The same prompts then go to llama-server (built from the llama.cpp llama-cpp-python vendors,
bench/llama_tools.py) with `--parallel N`: each alone, then all at once, and the count of equal answers
is published beside edgespec's (`--no-llama-server` skips it). llama-server records no rows, so its
count comes without the why. No speed is measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np


def agreement(model_path, prompts: list[list[int]], *, parallel: int = 4, tokens: int = 32, mode: str = "ar",
              threads: int = 1) -> dict:
    """Solo versus concurrent greedy answers of `prompts` (token ids), explained pass by pass."""
    from edgespec.audit import ExactnessError, Fresh, Recorder, check_decisions
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions, LlamaCppRuntime
    from edgespec.serve.slots import ParallelEngine, SlotScheduler

    config = GenerationConfig(max_tokens=tokens, temperature=0.0, mode=mode)
    single = LlamaCppOptions(n_ctx=2048, n_threads=threads, flash_attn=False)  # computes as the shared pool does
    with Engine(LlamaCppRuntime(model_path, single)) as solo_engine:
        solo = [solo_engine.generate_tokens(p, config).tokens for p in prompts]

    recorder = Recorder()
    pool = LlamaCppMultiSeqRuntime(model_path, LlamaCppOptions(n_ctx=parallel * 1024, n_threads=threads),
                                   n_seq=parallel)
    with ParallelEngine(pool, slot_ctx=1024) as engine:
        for e in engine.engines:
            e.recorder = recorder
        scheduler = SlotScheduler(engine, max_queue=len(prompts))

        async def run_all():
            return await asyncio.gather(*[scheduler.generate(p, config) for p in prompts])

        try:
            results = asyncio.run(run_all())
        finally:
            scheduler.close()
        counters = dict(scheduler.counters)
    by_prompt = {tuple(ps[0].committed.tolist()): ps for ps in recorder.by_key().values()}

    one = LlamaCppRuntime(model_path, single)
    companion = LlamaCppMultiSeqRuntime(model_path, LlamaCppOptions(n_ctx=2048, n_threads=threads), n_seq=2)
    fresh = Fresh(one, companion)
    rows, checked = [], []  # checked: (request, pass, row) whose fresh spread sets the run's bound
    try:
        for i, (prompt, alone, result) in enumerate(zip(prompts, solo, results)):
            passes = by_prompt[tuple(prompt)]
            row = {"request": i, "identical": result.tokens == alone, "passes": len(passes), "seq": passes[0].seq}
            try:
                check_decisions(passes, prompt, result.tokens)
                row["rule_exact"] = True
            except ExactnessError as exc:
                row["rule_exact"], row["rule_error"] = False, str(exc)
            checked.append((i, passes[-1], len(passes[-1].logits) - 1))  # every request's last row
            if not row["identical"]:
                j = next((t for t, (a, b) in enumerate(zip(alone, result.tokens)) if a != b),
                         min(len(alone), len(result.tokens)))
                at = 0  # the pass that emitted token j, and its row for it
                while at < len(passes) and len(passes[at].committed) + len(passes[at].emitted()) <= len(prompt) + j:
                    at += 1
                p = passes[at]
                r = len(prompt) + j - len(p.committed)
                checked.append((i, p, r))
                ref, _ = fresh.shapes(p.contexts()[r])
                a, b = alone[j], result.tokens[j] if j < len(result.tokens) else None
                gap = float(ref[a] - ref[b]) if b is not None else None
                row.update(first_divergence=j, solo_minus_parallel_logit=gap)
            rows.append(row)
        measured = []
        for i, p, r in checked:
            reference, others = fresh.shapes(p.contexts()[r])
            measured.append((i, float(np.abs(p.logits[r] - reference).max()),
                             max(float(np.abs(o - reference).max()) for o in others)))
        bound = max(s for _, _, s in measured)  # the run's measured batch-shape spread
        for i, deviation, spread in measured[::-1]:  # a divergent request's divergence row comes last
            row = rows[i]
            if not row["identical"] and "why" not in row:
                row.update(row_deviation=deviation, row_spread=spread, bound=bound,
                           why="batched numerics at a near-tie" if deviation <= bound else "wrong cells")
    finally:
        one.close()
        companion.close()
    identical = sum(r["identical"] for r in rows)
    return {"model": str(model_path), "parallel": parallel, "solo": solo, "requests": len(prompts), "tokens": tokens, "mode": mode,
            "identical": identical, "rule_exact": all(r["rule_exact"] for r in rows),
            "batched_steps": counters["batched_steps"], "steps": counters["steps"], "rows": rows}


def llama_server_agreement(model_path, prompts: list[list[int]], *, parallel: int = 4, tokens: int = 32,
                           threads: int = 1, log=None) -> dict:
    """Solo versus concurrent greedy answers of `prompts` through llama-server `--parallel N`: the same
    server answers each prompt alone, then all at once (flash attention off, as edgespec's pool runs)."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx

    from edgespec.bench.llama_tools import ensure_tools
    from edgespec.bench.serve_bench import running

    server = str(ensure_tools(("llama-server",)) / "llama-server")
    cmd = [server, "-m", str(model_path), "--port", "{port}", "--host", "127.0.0.1", "-c", str(parallel * 1024),
           "-np", str(parallel), "-t", str(threads), "-tb", str(threads), "-fa", "off", "--no-webui"]
    log = Path(log or "bench/out/parallel_agreement_llama_server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with running(cmd, log) as url:
        def complete(prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False,
                    "return_tokens": True, "ignore_eos": False}
            r = httpx.post(f"{url}/completion", json=body, timeout=600)
            r.raise_for_status()
            return list(r.json()["tokens"])

        solo = [complete(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
    identical = sum(a == b for a, b in zip(solo, together))
    return {"command": " ".join(cmd), "parallel": parallel, "requests": len(prompts), "tokens": tokens,
            "identical": identical, "solo": solo, "concurrent": together}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--mode", default="ar")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--no-llama-server", action="store_true", help="edgespec only")
    args = p.parse_args(argv)

    from edgespec.bench.run import load_prompts
    from edgespec.engine import Engine
    from edgespec.models import store
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    path = store.resolve(args.model)
    with Engine(LlamaCppRuntime(path, LlamaCppOptions(n_ctx=512, n_threads=1))) as e:
        prompts = [e.prompt_tokens(list(x.messages)) for x in load_prompts()[:args.requests]]
    out = agreement(path, prompts, parallel=args.parallel, tokens=args.tokens, mode=args.mode, threads=args.threads)
    if not args.no_llama_server:
        peer = llama_server_agreement(path, prompts, parallel=args.parallel, tokens=args.tokens, threads=args.threads)
        peer["solo_equals_edgespec_solo"] = sum(a == b for a, b in zip(peer["solo"], out["solo"]))
        out["llama_server"] = peer
    print(summary(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["rule_exact"] and all(r.get("why") != "wrong cells" for r in out["rows"]) else 1


def summary(out: dict) -> str:
    lines = [f"--parallel {out['parallel']}, {out['requests']} concurrent greedy requests of {out['tokens']} tokens "
             f"({out['mode']}), {out['batched_steps']} of {out['steps']} passes shared: {out['identical']} of "
             f"{out['requests']} equal their solo answer; every pass's tokens are the rule's on its rows: "
             f"{out['rule_exact']}"]
    for r in out["rows"]:
        if not r["identical"]:
            gap = r["solo_minus_parallel_logit"]
            lines.append(f"  request {r['request']} (slot {r['seq']}): parts at token {r['first_divergence']}; "
                         f"its row is {r['row_deviation']:.3g} from a fresh evaluation of its prefix (batch-shape "
                         f"spread measured in this run {r['bound']:.3g}); solo token leads by "
                         f"{'n/a' if gap is None else f'{gap:.3g}'} logit: {r['why']}")
    if peer := out.get("llama_server"):
        lines.append(f"llama-server --parallel {peer['parallel']} on the same prompts: {peer['identical']} of "
                     f"{peer['requests']} concurrent answers equal its solo answer; its solo answers equal "
                     f"edgespec's for {peer['solo_equals_edgespec_solo']} of {peer['requests']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
