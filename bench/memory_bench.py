"""Memory: predicted against measured peaks, and throughput kept against memory saved across budgets.

    python -m edgespec.bench.memory_bench [--out bench/MEMORY_RESULTS.md] [--quick] [--repeats 3]

1. Prediction grid: SmolLM2-135M and the Qwen2.5-Coder 1.5B / 0.5B pair across contexts, KV cache
   types, weights mapped or read, draft on and off. Each point runs in a fresh process
   (`python -m edgespec.machine.memprobe measure`): load, prefill a prompt one ubatch long (so the whole
   compute buffer is used), generate, report VmHWM, the peak resident set (anonymous and file-backed
   pages alike). The prediction is `edgespec.machine.memory.predict` with this build's calibration, which
   comes from SmolLM2 at other settings (see memprobe.REFERENCE_RUN and DRY_RUNS).
2. Budgets (SpecMemo's view): for the Qwen pair at a 4096-token context, `edgespec.machine.planner.plan` at
   falling budgets; each chosen setup runs greedy generation in a fresh process (median of
   --repeats timed generations) and reports tokens/s and its measured peak. Memory saved and
   throughput kept are relative to the plan for an unconstrained budget.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from edgespec.machine.memory import MiB, Hardware, ModelSettings, Setup, calibrate, model_facts, predict
from edgespec.machine.memprobe import run_measure_subprocess

# (target, draft, n_ctx, kv, use_mmap, n_batch, k)
GRID = [
    ("smollm2-135m", None, 1024, "f16", True, 512, 0),
    ("smollm2-135m", None, 4096, "f16", True, 512, 0),
    ("smollm2-135m", None, 2048, "q8_0", True, 512, 0),
    ("smollm2-135m", None, 8192, "q4_0", True, 256, 0),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 1024, "f16", True, 512, 4),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 4096, "f16", False, 512, 4),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 2048, "q8_0", True, 256, 3),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 4096, "q4_0", False, 128, 2),
    ("qwen2.5-coder-1.5b", None, 1024, "f16", True, 512, 0),
    ("qwen2.5-coder-1.5b", None, 4096, "q8_0", True, 512, 0),
    ("qwen2.5-coder-1.5b", None, 2048, "q4_0", False, 256, 0),
    ("qwen2.5-coder-0.5b", None, 2048, "f16", False, 512, 0),
]
QUICK_GRID = [GRID[0], GRID[2], GRID[4], GRID[10]]
BUDGETS_MIB = [None, 2600, 2000, 1900, 1840, 1700, 1350, 1300, 1280, 1240]
QUICK_BUDGETS_MIB = [None, 2000, 1700, 1350]


def _paths(names):
    from edgespec.models import store

    return {n: store.resolve(n) for n in names if n}


def run_grid(grid, cal, repeats: int = 1) -> list[dict]:
    paths = _paths({g[0] for g in grid} | {g[1] for g in grid})
    rows = []
    for target, draft, n_ctx, kv, mmap, n_batch, k in grid:
        t = model_facts(paths[target])
        d = model_facts(paths[draft]) if draft else None
        ts = ModelSettings(n_ctx=n_ctx, type_k=kv, type_v=kv, n_batch=n_batch, n_outputs_max=k + 1, use_mmap=mmap)
        setup = Setup(t, ts, d, replace(ts, n_outputs_max=1) if d else None, max_draft=k, sampling=False)
        pred = predict(setup, cal)
        t0 = time.time()
        got = run_measure_subprocess({"target": str(paths[target]), "draft": str(paths[draft]) if draft else None,
                                      "setup": setup.to_dict(), "prompt_tokens": n_batch + 8, "max_tokens": 16,
                                      "mode": "draft" if draft else "ar", "repeats": repeats})
        row = {"target": target, "draft": draft, "n_ctx": n_ctx, "kv": kv, "weights": "mmap" if mmap else "read",
               "n_batch": n_batch, "k": k, "predicted": pred.peak_bytes, "measured": got["peak"],
               "error": pred.peak_bytes - got["peak"], "rel_error": (pred.peak_bytes - got["peak"]) / got["peak"],
               "breakdown": pred.host, "buffers": got["buffers"], "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(f"{target} {draft or '-'} ctx {n_ctx} {kv} {row['weights']} ub {n_batch} k {k}: predicted "
              f"{pred.peak_bytes / MiB:.1f} MiB, measured {got['peak'] / MiB:.1f} MiB ({100 * row['rel_error']:+.2f} %)",
              file=sys.stderr, flush=True)
    return rows


def run_budgets(budgets_mib, cal, repeats: int, max_tokens: int, threads: int = 1) -> list[dict]:
    """Plan each budget; measure each plan's peak in its own fresh process; then time every plan in one
    process, interleaved (see memprobe.cmd_throughput), so machine noise falls on all plans alike."""
    import statistics

    from edgespec.machine.planner import plan, setup_for

    paths = _paths(["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    target, draft = paths["qwen2.5-coder-1.5b"], paths["qwen2.5-coder-0.5b"]
    t, d = model_facts(target), model_facts(draft)
    rows, timed = [], []
    for mib in budgets_mib:
        budget = (64 << 30) if mib is None else mib * MiB
        p = plan(target, draft, budget=budget, ctx=4096, sampling=False, hardware=Hardware(), calibration=cal)
        row = {"budget_mib": mib, "fits": p.fits, "notes": p.notes}
        if p.fits:
            s = p.settings
            entry = {"target": str(target), "draft": str(draft) if s.draft else None,
                     "setup": setup_for(s, t, d, Hardware(), sampling=False).to_dict(),
                     "mode": "draft" if s.draft else "ar"}
            got = run_measure_subprocess({**entry, "prompt_tokens": 600, "max_tokens": 16})
            row.update(settings=s.to_dict(), predicted=p.predicted_peak_bytes, measured=got["peak"])
            timed.append((row, entry))
            print(f"budget {mib} MiB: {s}: predicted {p.predicted_peak_bytes / MiB:.0f} MiB, measured "
                  f"{got['peak'] / MiB:.0f} MiB", file=sys.stderr, flush=True)
        else:
            row["smallest_budget_mib"] = round(p.smallest_budget_bytes / MiB, 1)
            print(f"budget {mib} MiB: nothing fits (smallest {row['smallest_budget_mib']} MiB)", file=sys.stderr)
        rows.append(row)
    if timed:
        got = run_measure_subprocess({"setups": [e for _, e in timed], "repeats": repeats, "max_tokens": max_tokens,
                                      "prompt_tokens": 200, "n_threads": threads}, timeout=7200, command="throughput")
        for (row, _), speeds, acc in zip(timed, got["speeds"], got["acceptance"]):
            row.update(tokens_per_s=statistics.median(speeds), speeds=speeds, acceptance=statistics.median(acc))
    return rows


KV_PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("f16", "q4_0"), ("q4_0", "q8_0"), ("q4_0", "q4_0")]


def run_kv_quality(n_tokens: int = 24) -> list[dict]:
    """Greedy output of each model under each KV cache pair, against its f16 output (fresh process)."""
    import subprocess

    code = f"""
import json
from edgespec.engine import Engine, GenerationConfig
from edgespec.machine.memprobe import prompt_ids
from edgespec.models import store
from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime
rows = []
for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
    ref = None
    for k, v in {KV_PAIRS!r}:
        rt = LlamaCppRuntime(store.resolve(name), LlamaCppOptions(n_ctx=1024, type_k=k, type_v=v, n_threads=1,
                                                                  flash_attn=True))
        with Engine(rt) as engine:
            ids = prompt_ids(rt, 200)
            out = engine.generate_tokens(ids, GenerationConfig(max_tokens={n_tokens}, temperature=0, mode="ar")).tokens
        ref = ref or out
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        rows.append({{"model": name, "type_k": k, "type_v": v, "equal_prefix": same, "tokens": len(ref)}})
print(json.dumps(rows))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    from edgespec.machine.hardware import detect

    r = detect(onnxruntime=False)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    return (f"{r.cpu.name} ({r.cpu.usable_cores} usable cores, {r.cpu.simd_level}), "
            f"{(r.memory.usable_bytes or 0) / 2**30:.1f} GiB RAM, no GPU; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}; {r.llama_cpp.build or 'llama.cpp ?'}; load average at start "
            f"{load[0]:.1f} (shared machine)")


def _settings_label(s: dict) -> str:
    kv = f"KV {s['type_k']}" if s["type_k"] == s["type_v"] else f"KV K {s['type_k']} / V {s['type_v']}"
    return (f"{kv}, {'mmap' if s['use_mmap'] else 'read'}, ubatch {s['n_batch']}, "
            + (f"draft k={s['max_draft']}" if s["draft"] else "no draft"))


def render(grid_rows, budget_rows, cal, command: str, started: str, host: str, kv_rows=()) -> str:
    out = ["# Memory: predicted vs measured peaks, and throughput across budgets", "",
           f"Command: `{command}`  ", f"Run: {started}  ", f"Machine: {host}", "",
           "Peak = VmHWM of a fresh process per row: resident anonymous pages and file-backed (mmap'd) weight "
           "pages alike. Prediction: `edgespec.machine.memory.predict`, calibrated once for this build on SmolLM2-135M "
           f"at other settings (compute-buffer scales ffn {cal.ffn_scale}, output {cal.output_scale}, attention "
           f"{cal.attn_scale}; fixed process {cal.base_bytes / MiB:.1f} + {cal.process_extra_bytes / MiB:.1f} MiB, "
           f"per model {cal.per_model_bytes / MiB:.1f} MiB, vocabulary {cal.vocab_bytes_per_entry} B per entry).", "",
           "## Predicted vs measured peak", "",
           "| target | draft | ctx | KV | weights | ubatch | k | predicted MiB | measured MiB | error |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in grid_rows:
        out.append(f"| {r['target']} | {r['draft'] or '-'} | {r['n_ctx']} | {r['kv']} | {r['weights']} | {r['n_batch']} "
                   f"| {r['k']} | {r['predicted'] / MiB:.1f} | {r['measured'] / MiB:.1f} | {100 * r['rel_error']:+.2f} % |")
    if grid_rows:
        errs = [abs(r["rel_error"]) for r in grid_rows]
        worst = max(grid_rows, key=lambda r: abs(r["error"]))
        out += ["", f"Mean |error| {100 * sum(errs) / len(errs):.2f} %, largest {100 * max(errs):.2f} % "
                    f"({worst['error'] / MiB:+.1f} MiB). Rows within 5 %: {sum(e <= 0.05 for e in errs)} of {len(errs)}."]
    if budget_rows:
        base = next((r for r in budget_rows if r.get("fits") and r["budget_mib"] is None), None)
        out += ["", "## Throughput kept against memory saved (Qwen2.5-Coder 1.5B + 0.5B draft, context 4096, greedy)",
                "", "Each budget is planned by `edgespec.machine.planner.plan`; the chosen setup's peak is measured in a "
                "fresh process (600-token prompt, so full compute buffers). Tokens/s: decode only, greedy, a "
                "200-token code prompt (a repeated snippet: the draft is almost always right), one thread, median over the repeats, every setup timed in one process in "
                "turn per repeat (interleaved, so a busy machine slows them alike). Saved and kept are relative to the "
                "unconstrained plan.", "",
                "| budget | chosen settings | predicted MiB | measured MiB | tok/s | draft acceptance | memory saved "
                "| throughput kept |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in budget_rows:
            label = "unconstrained" if r["budget_mib"] is None else f"{r['budget_mib']} MiB"
            if not r.get("fits"):
                out.append(f"| {label} | nothing fits (smallest: {r['smallest_budget_mib']} MiB) | | | | | | |")
                continue
            what = _settings_label(r["settings"])
            saved = kept = ""
            if base:
                saved = f"{100 * (1 - r['measured'] / base['measured']):.1f} %"
                kept = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            acceptance = f"{r['acceptance']:.2f}" if r["settings"]["draft"] else "-"
            out.append(f"| {label} | {what} | {r['predicted'] / MiB:.0f} | {r['measured'] / MiB:.0f} | "
                       f"{r['tokens_per_s']:.2f} | {acceptance} | {saved} | {kept} |")
        fitted = [r for r in budget_rows if r.get("fits")]
        if base and fitted:
            free = [r for r in fitted if r["tokens_per_s"] >= 0.97 * base["tokens_per_s"]]
            most = max(free, key=lambda r: 1 - r["measured"] / base["measured"]) if free else None
            no_draft = [r for r in fitted if not r["settings"]["draft"]]
            lines = []
            if most is not None:
                lines.append(f"Within 3 % of the unconstrained throughput the plan saves up to "
                             f"{100 * (1 - most['measured'] / base['measured']):.0f} % of the memory (the "
                             f"{most['budget_mib'] or 'unconstrained'} MiB row: {_settings_label(most['settings'])}); "
                             "most of it comes from reading the weights instead of mapping them, which stops the "
                             "repacked tensors from being held twice.")
            if no_draft:
                kept = [r["tokens_per_s"] / base["tokens_per_s"] for r in no_draft]
                lines.append(f"Dropping the draft saves {100 * (1 - no_draft[0]['measured'] / base['measured']):.0f} % "
                             f"and keeps {min(kept):.2f}x to {max(kept):.2f}x of the throughput here: on this CPU the "
                             "0.5B draft buys little speed (see FACTS.md), so its memory is the first large thing "
                             "worth giving up; on hardware where verification is nearly free the same step costs more.")
            out += [""] + [" ".join(lines)]
    if kv_rows:
        out += ["", "## KV cache types and output quality", "",
                "Greedy tokens (24, after a 200-token code prompt, flash attention on) equal to the f16 cache's "
                "before the first difference. This is why the planner's KV ladder is f16, q8_0, then K q8_0 / "
                "V q4_0, and a q4_0 K cache only on request.", "",
                "| model | " + " | ".join(f"K {k} / V {v}" for k, v in KV_PAIRS) + " |",
                "|---|" + "---:|" * len(KV_PAIRS)]
        for model in dict.fromkeys(r["model"] for r in kv_rows):
            cells = {(r["type_k"], r["type_v"]): r for r in kv_rows if r["model"] == model}
            out.append(f"| {model} | " + " | ".join(
                f"{cells[p]['equal_prefix']}/{cells[p]['tokens']}" if p in cells else "" for p in KV_PAIRS) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/MEMORY_RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="4 grid points, 4 budgets, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="threads for the timed runs (1: robust on a shared machine)")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-budgets", action="store_true")
    ap.add_argument("--skip-kv-quality", action="store_true")
    ap.add_argument("--grid-from", help="reuse the grid rows of an earlier run's JSON instead of measuring them")
    ap.add_argument("--render-only", help="rewrite the markdown from an earlier run's JSON, measuring nothing")
    args = ap.parse_args(argv)
    if args.render_only:
        from edgespec.machine.memory import Calibration

        data = json.loads(Path(args.render_only).read_text())
        Path(args.out).write_text(render(data["grid"], data["budgets"], Calibration.from_dict(data["calibration"]),
                                         data.get("command", "?"), data["started"], data["machine"],
                                         data.get("kv_quality", ())))
        return 0
    started = _dt.datetime.now().isoformat(timespec="seconds")
    host = machine()
    cal = calibrate()
    repeats = 1 if args.quick else args.repeats
    if args.grid_from:
        grid_rows = json.loads(Path(args.grid_from).read_text())["grid"]
    else:
        grid_rows = [] if args.skip_grid else run_grid(QUICK_GRID if args.quick else GRID, cal)
    kv_rows = [] if (args.skip_kv_quality or args.quick) else run_kv_quality()
    budget_rows = [] if args.skip_budgets else run_budgets(QUICK_BUDGETS_MIB if args.quick else BUDGETS_MIB, cal,
                                                           repeats, args.max_tokens, args.threads)
    command = "python -m edgespec.bench.memory_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(grid_rows, budget_rows, cal, command.strip(), started, host, kv_rows))
    out.with_suffix(".json").write_text(json.dumps({"grid": grid_rows, "budgets": budget_rows, "kv_quality": kv_rows,
                                                    "command": command.strip(),
                                                    "calibration": cal.to_dict(), "machine": host,
                                                    "started": started}, indent=1, default=str))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
