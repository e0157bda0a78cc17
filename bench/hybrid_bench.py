"""Hybrid recurrent models at the widths of real ones: what rolling back a rejected draft costs against a
decode step, what the recurrent state weighs, and what auto chooses; the Qwen pair beside them.

No hybrid model can be downloaded here, so the models are random-weight ones built at the widths of the
small released models (bench/hybrid_models.py, size "realistic": LFM2-350M's, Granite-4.0-H-350M's, and
Qwen3-Next's layout at LFM2-350M's width), converted by llama.cpp's own converter to Q8_0. Their passes
cost what real ones of that shape cost; their text is noise, so acceptance (and any speed-up from it)
says nothing about real models: SmolLM2-135M drafts for them (same vocabulary), and auto's choices show
only that it prices the rollback and keeps to plain decoding where drafts fail.

Measured per model, on a context of CONTEXT tokens:
- verify(n): the cost profile's target pass of n rows (edgespec.machine.profile), and rollback_s, the
  profile's price of a rollback beyond the pass (what auto adds to every drafting round);
- checkpoint save and restore of one sequence's recurrent state (llama_state_seq_*_ext, PARTIAL_ONLY);
- a rollback of a 5-row pass to keep 2 of its tokens, both ways the runtime has: llama.cpp's per-token
  snapshots (a cut, where the architecture keeps them) and checkpoint restore + replay of the kept tokens;
- the state's bytes, measured (llama_state_seq_get_size_ext) and as the memory planner predicts them;
- what auto would choose from this profile for a copying drafter at a per-token acceptance of 0.5, 0.7
  and 0.9 (best k, predicted x plain), with the rollback priced and without (what the price changes);
- auto against plain, greedy, interleaved with the order alternated: tokens/s, ratio, auto's choices.

    python -m edgespec.bench.hybrid_bench [--archs lfm2,qwen3next,granitehybrid] [--threads 2] [--repeats 3]
                                          [--max-tokens 64] [--out bench/HYBRID_RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CONTEXT = 256      # tokens of context the state-cost measurements run at
PASS_ROWS = 5      # a verify pass of k = 4 ...
KEPT = 2           # ... of which the rollback keeps 2 tokens (as edgespec.machine.profile prices it)
PROMPTS = ("chat-hashmap", "grounded-rename")
ACCEPTANCE = (0.5, 0.7, 0.9)  # per-token acceptance of the choices table


def _median_time(fn, repeats: int, setup=None) -> float:
    """Median seconds of fn() over `repeats` runs, `setup()` (untimed) before each."""
    times = []
    for _ in range(repeats + 1):  # the first run warms buffers and is dropped
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def state_costs(rt, repeats: int) -> dict:
    """Checkpoint, restore and both rollbacks of a recurrent runtime `rt` (llama.cpp), at CONTEXT tokens."""
    from edgespec.runtimes.llamacpp import RecurrentCheckpoints
    import llama_cpp as ll

    rng = np.random.default_rng(0)
    context = rng.integers(100, 30000, size=CONTEXT).astype(np.int32)
    rt.truncate(0)
    rt.decode(context, 0)
    out: dict = {"state_bytes": int(ll.llama_state_seq_get_size_ext(rt._ctx, 0, RecurrentCheckpoints.FLAGS)),
                 "snapshot_window": rt.snapshot_window}
    ck = rt._checkpoints
    out["checkpoint_s"] = _median_time(lambda: ck.save(0, CONTEXT), repeats, setup=lambda: ck.forget(0))
    ck.save(0, CONTEXT)
    out["restore_s"] = _median_time(lambda: ck.restore(0, CONTEXT), repeats)
    batch = rng.integers(100, 30000, size=PASS_ROWS).astype(np.int32)

    def a_pass():
        rt.truncate(CONTEXT)
        rt.decode(batch, PASS_ROWS)

    out["pass_s"] = _median_time(lambda: rt.decode(batch, PASS_ROWS), repeats, setup=lambda: rt.truncate(CONTEXT))
    window = rt.snapshot_window
    if window:
        out["cut_by_snapshots_s"] = _median_time(lambda: rt.truncate(CONTEXT + KEPT), repeats, setup=a_pass)
    rt.snapshot_window = 0  # the checkpoint path: restore, then replay the kept tokens
    try:
        out["restore_and_replay_s"] = _median_time(lambda: rt.truncate(CONTEXT + KEPT), repeats, setup=a_pass)
    finally:
        rt.snapshot_window = window
    rt.truncate(0)
    return out


def kv_cut_cost(rt, repeats: int) -> dict:
    """An attention-only model's rollback: llama.cpp removes the cells (the Qwen pair's case)."""
    rng = np.random.default_rng(0)
    rt.truncate(0)
    rt.decode(rng.integers(100, 30000, size=CONTEXT).astype(np.int32), 0)
    batch = rng.integers(100, 30000, size=PASS_ROWS).astype(np.int32)

    def a_pass():
        rt.truncate(CONTEXT)
        rt.decode(batch, PASS_ROWS)

    out = {"pass_s": _median_time(lambda: rt.decode(batch, PASS_ROWS), repeats, setup=lambda: rt.truncate(CONTEXT)),
           "kv_cut_s": _median_time(lambda: rt.truncate(CONTEXT + KEPT), repeats, setup=a_pass)}
    rt.truncate(0)
    return out


def race(engine, prompts, repeats: int, max_tokens: int) -> dict:
    """Auto against plain on `prompts`, interleaved, the order alternated every repeat; medians."""
    from edgespec.engine import GenerationConfig

    speeds: dict[str, dict[str, list[float]]] = {p.id: {"ar": [], "auto": []} for p in prompts}
    chosen: dict[str, int] = {}
    drafted = accepted = 0
    for r in range(repeats):
        for p in prompts:
            ids = engine.prompt_tokens(list(p.messages))
            for mode in (("ar", "auto") if r % 2 == 0 else ("auto", "ar")):
                engine.target.truncate(0)
                if engine.draft_runtime is not None:
                    engine.draft_runtime.truncate(0)
                engine.history.clear()
                result = engine.generate_tokens(ids, GenerationConfig(max_tokens=max_tokens, temperature=0.0,
                                                                     seed=0, mode=mode))
                speeds[p.id][mode].append(result.stats.tokens_per_s)
                if mode == "auto":
                    for key, n in result.stats.chosen.items():
                        chosen[key] = chosen.get(key, 0) + n
                    drafted += result.stats.drafted
                    accepted += result.stats.accepted
    per_prompt = {pid: {"plain_tok_s": statistics.median(v["ar"]), "auto_tok_s": statistics.median(v["auto"]),
                        "auto_x": statistics.median(v["auto"]) / statistics.median(v["ar"])} for pid, v in speeds.items()}
    return {"per_prompt": per_prompt, "chosen": chosen, "drafted": drafted, "accepted": accepted}


def choices(profile) -> dict:
    """Auto's best k and predicted speed-up for a copying drafter (free to ask) at each ACCEPTANCE, from
    this profile with its rollback priced, and with the rollback taken as free."""
    from dataclasses import replace

    from edgespec.policy import AdaptivePolicy

    out = {}
    for label, prof in (("priced", profile), ("free_rollback", replace(profile, rollback_s=0.0))):
        policy = AdaptivePolicy(prof)
        for a in ACCEPTANCE:
            speeds = policy.chain_speeds(np.full(policy.k_max, a), 0.0)
            k = int(np.argmax(speeds))
            out[f"{label}@{a}"] = {"k": k, "x_plain": float(speeds[k] / speeds[0])}
    return out


def bench_model(name: str, target: Path, draft: Path, args, prompts) -> dict:
    from edgespec.engine import Engine
    from edgespec.machine.memory import model_facts, recurrent_bytes

    engine = Engine.load(target, draft, n_ctx=2048, n_threads=args.threads, trees=False)
    profile = engine.cost_profile(refresh=True)
    rt = engine.target
    facts = model_facts(target)
    row = {"model": name, "path": target.name, "size_mib": target.stat().st_size / 2**20, "arch": facts.arch,
           "recurrent": bool(getattr(rt, "recurrent", False)),
           "verify_s": {str(n): profile.verify(n) for n in (1, 2, 5, 9, 17)}, "draft_s": profile.draft_s,
           "rollback_s": profile.rollback_s, "choices": choices(profile)}
    row.update(state_costs(rt, args.repeats * 5) if row["recurrent"] else kv_cut_cost(rt, args.repeats * 5))
    if row["recurrent"]:
        row["planner_state_bytes"] = facts.recurrent_state_bytes
        row["planner_recurrent_bytes"] = recurrent_bytes(facts)
    row["race"] = race(engine, prompts, args.repeats, args.max_tokens)
    engine.close()
    return row


def render(doc: dict) -> str:
    ms = lambda s: "-" if s is None else f"{1e3 * s:.2f}"  # noqa: E731
    lines = ["# Hybrid recurrent models: rollback cost, state memory and auto's choices", "",
             f"Command: `{doc['command']}`  ", f"Machine: {doc['machine']['cpu']}, {doc['threads']} thread(s); "
             f"{doc['seconds']:.0f} s in all.", "",
             "Random-weight models at the widths of real ones (bench/hybrid_models.py, Q8_0): the costs are "
             "real, the text is noise, so acceptance says nothing about a real model (SmolLM2-135M drafts; a "
             "trained MTP head's acceptance cannot be measured here either: the GPU bench, bench/gpu/run.py, "
             "runs a real model where a device is lent). Times are medians; ms.", "",
             "| model | arch | GGUF MiB | verify(1) | verify(5) | verify(17) | checkpoint save | restore | "
             "rollback by snapshots | rollback by restore + replay | KV cut | profile's rollback_s | state KiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["models"]:
        v = r["verify_s"]
        lines.append(f"| {r['model']} | {r['arch']} | {r['size_mib']:.0f} | {ms(v['1'])} | {ms(v['5'])} | {ms(v['17'])} "
                     f"| {ms(r.get('checkpoint_s'))} | {ms(r.get('restore_s'))} | {ms(r.get('cut_by_snapshots_s'))} "
                     f"| {ms(r.get('restore_and_replay_s'))} | {ms(r.get('kv_cut_s'))} | {ms(r['rollback_s'])} "
                     f"| {r.get('state_bytes', 0) / 1024:.0f} |")
    lines += ["", "Memory of the recurrent state, one sequence: its size as llama.cpp serialises it and as the "
              "memory planner reads it from the GGUF, and what the planner reserves for it "
              "(edgespec.machine.memory.recurrent_bytes: the state, llama.cpp's per-token snapshots where the "
              "architecture keeps them, and the runtime's rollback checkpoints).", "",
              "| model | state KiB measured | planner's state KiB | snapshots | planner reserves MiB |",
              "|---|---:|---:|---:|---:|"]
    for r in doc["models"]:
        if r["recurrent"]:
            lines.append(f"| {r['model']} | {r['state_bytes'] / 1024:.0f} | {r['planner_state_bytes'] / 1024:.0f} "
                         f"| {r['snapshot_window']} | {r['planner_recurrent_bytes'] / 2**20:.1f} |")
    lines += ["", "What auto would choose from each profile for a copying drafter (free to ask) at a per-token "
              "acceptance a: best k and predicted x plain, with the rollback priced / taken as free:", "",
              "| model | " + " | ".join(f"a = {a}" for a in ACCEPTANCE) + " |", "|---|" + "---|" * len(ACCEPTANCE)]
    for r in doc["models"]:
        c = r["choices"]
        cells = [f"k {c[f'priced@{a}']['k']}: {c[f'priced@{a}']['x_plain']:.2f}x / "
                 f"k {c[f'free_rollback@{a}']['k']}: {c[f'free_rollback@{a}']['x_plain']:.2f}x" for a in ACCEPTANCE]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Auto against plain decoding (greedy, interleaved, order alternated; medians over repeats):", "",
              "| model | prompt | plain tok/s | auto tok/s | auto x plain | auto's rounds on both prompts (drafter:k) | drafted / accepted |",
              "|---|---|---:|---:|---:|---|---|"]
    for r in doc["models"]:
        race = r["race"]
        top = ", ".join(f"{k} {n}" for k, n in sorted(race["chosen"].items(), key=lambda kv: -kv[1])[:4])
        for pid, p in race["per_prompt"].items():
            lines.append(f"| {r['model']} | {pid} | {p['plain_tok_s']:.1f} | {p['auto_tok_s']:.1f} | {p['auto_x']:.3f} "
                         f"| {top} | {race['drafted']} / {race['accepted']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.hybrid_bench", description=__doc__.split("\n")[0])
    p.add_argument("--archs", default="lfm2,qwen3next,granitehybrid")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--models-dir", type=Path, default=None, help="where the built models are kept [the bench cache]")
    p.add_argument("--no-qwen", action="store_true", help="skip the Qwen pair")
    p.add_argument("--size", default="realistic", choices=("realistic", "tiny"),
                   help="the models' widths: realistic (Q8_0, the bench) or tiny (f32, the tests' own)")
    p.add_argument("--out", type=Path, default=Path("bench/HYBRID_RESULTS.md"))
    args = p.parse_args(argv)

    from edgespec.bench.hybrid_models import ARCHITECTURES, hybrid_gguf
    from edgespec.bench.run import bench_cache_dir, describe_machine, load_prompts, smollm2_draft
    from edgespec.models import store

    archs = [a for a in args.archs.split(",") if a]
    unknown = set(archs) - set(ARCHITECTURES)
    if unknown:
        p.error(f"unknown architectures {sorted(unknown)}; use {', '.join(ARCHITECTURES)}")
    t0 = time.time()
    root = args.models_dir or bench_cache_dir() / "hybrid-realistic"
    root.mkdir(parents=True, exist_ok=True)
    smollm2 = store.resolve("smollm2-135m")
    prompts = load_prompts(ids=list(PROMPTS))
    rows = []
    for arch in archs:
        print(f"{arch}: building (random weights, {args.size} width) ...", file=sys.stderr, flush=True)
        path = hybrid_gguf(arch, root, smollm2, size=args.size, outtype="q8_0" if args.size == "realistic" else "f32")
        print(f"{arch}: measuring", file=sys.stderr, flush=True)
        rows.append(bench_model(arch, path, smollm2_draft(), args, prompts))
    if not args.no_qwen:
        print("qwen2.5-coder-1.5b: measuring", file=sys.stderr, flush=True)
        rows.append(bench_model("qwen2.5-coder-1.5b", Path(store.resolve("qwen2.5-coder-1.5b")),
                                Path(store.resolve("qwen2.5-coder-0.5b")), args, prompts))
    doc = {"command": "python -m edgespec.bench.hybrid_bench " + " ".join(argv), "machine": describe_machine(),
           "threads": args.threads, "seconds": time.time() - t0, "models": rows}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    args.out.write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
