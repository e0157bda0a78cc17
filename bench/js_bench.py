"""The TypeScript kit (kits/js) against the Python engine on ONNX Runtime: same bundle, same prompts, same run.

    python -m edgespec.bench.js_bench [--prompts 4] [--max-tokens 64] [--repeats 2] [--threads 1]
                                      [--no-web] [--out bench/JS_RESULTS.md]

The bundle is SmolLM2-135M-Instruct exported by `edgespec export --format onnx --quant onnx:fp32,onnx:int4
--self-draft quant` (fp32 target, its int4 copy as the draft), built once under
~/.cache/edgespec/bench/js. Systems, each greedy with plain decoding, prompt lookup (k=2) and the draft
model (k=4) over the first --prompts prompts of bench/prompts.json (chat-templated by the Python
engine, so every system gets the same ids):

* python: edgespec.engine.Engine on runtimes/onnxrt.py (onnxruntime, IO binding);
* node: the kit on onnxruntime-node (CPU), kits/js/bench/node-bench.mjs;
* web: the kit's web entry point in headless Chromium (Debian's package), onnxruntime-web WebAssembly,
  one thread, pages served from loopback (kits/js/test/web/parity.html).

Python and Node alternate by repeat (python, node, python, node, ...), so a change in the machine's load
hits both; the browser runs all repeats after them. Each block starts with one untimed warm-up generation. tok/s is the engines' own decode tok/s
(generated / decode time, prefill excluded: the same definition in Python and JS); the tables give
medians over prompts x repeats, and ratios against the Python engine in the same mode. The greedy
tokens of every system are compared too (they must agree; the tests prove it).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "kits" / "js"
CHROMIUM = "/usr/bin/chromium"
MODES = (("ar", 0), ("lookup", 2), ("draft", 4))


# --- loopback pages in headless Chromium (also used by tests/test_js_kit.py) ------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}

    def log_message(self, *args):
        pass


def serve(root: Path) -> http.server.ThreadingHTTPServer:
    """A static file server for `root` on 127.0.0.1 (a free port), in a daemon thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_in_chromium(bundles: dict[str, Path], fixture: dict, workdir: Path, timeout: int = 600,
                    kit: Path = KIT, page: str = "test/web/parity.html") -> dict:
    """Serve the kit (as /kit/), the bundles (as /NAME/) and the fixture from loopback; run a page of the
    kit (the test page, or the example page) in headless Chromium; return what it produced."""
    if not Path(CHROMIUM).is_file():
        raise RuntimeError("Chromium is missing at /usr/bin/chromium: `bash scripts/install.sh --test` installs "
                           "Debian's chromium package")
    root = Path(tempfile.mkdtemp(prefix="www-", dir=workdir))
    (root / "kit").symlink_to(kit)
    for name, path in bundles.items():
        (root / name).symlink_to(Path(path).resolve())
    (root / "fixture.json").write_text(json.dumps(fixture))
    out = root.parent / f"{root.name}-results.json"
    server = serve(root)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/kit/{page}"
        proc = subprocess.run(["node", "test/web/run-chromium.mjs", url, str(out), CHROMIUM, str(timeout - 20)],
                              cwd=kit, capture_output=True, text=True, timeout=timeout)
    finally:
        server.shutdown()
        server.server_close()
    if proc.returncode != 0:
        raise RuntimeError(f"the browser run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


# --- the benchmark --------------------------------------------------------------------------------

def smollm2_bundle(progress=print) -> Path:
    from edgespec.bench.run import bench_cache_dir
    from edgespec.exporters.from_gguf import smollm2_checkpoint_from_gguf
    from edgespec.models import store

    root = bench_cache_dir() / "js"
    ckpt, bundle = root / "smollm2-hf", root / "smollm2-bundle"
    if not (bundle / "edgespec.json").is_file():
        if not (ckpt / "config.json").is_file():
            progress("building the Hugging Face checkpoint from the catalog GGUF")
            smollm2_checkpoint_from_gguf(store.resolve("smollm2-135m"), ckpt)
        progress("exporting the bundle (ONNX fp32 target, int4 self-draft)")
        subprocess.run([sys.executable, "-m", "edgespec.cli", "export", str(ckpt), "--format", "onnx", "--quant",
                        "onnx:fp32,onnx:int4", "--self-draft", "quant", "--no-measure", "--out", str(bundle)],
                       check=True)
    return bundle


def bench_prompts(engine, n: int) -> list[tuple[str, list[int]]]:
    data = json.loads((ROOT / "bench" / "prompts.json").read_text())
    items = [p for cat in data["categories"].values() for p in cat]
    # Interleave the categories (chat, code, grounded edits) so a short run sees each kind.
    cats = list(data["categories"].values())
    items = [c[i] for i in range(max(len(c) for c in cats)) for c in cats if i < len(c)]
    return [(p["id"], engine.prompt_tokens(p["messages"])) for p in items[:n]]


def runs_for(prompts, max_tokens: int, repeat: int) -> list[dict]:
    """One repeat's generations, after an untimed warm-up."""
    runs = [{"name": f"warmup r{repeat}", "prompt": prompts[0][1], "mode": "ar", "draft_max": 0, "max_tokens": 8}]
    for mode, k in MODES:
        for pid, ids in prompts:
            runs.append({"name": f"{mode} {pid} r{repeat}", "mode": mode, "draft_max": k, "prompt": ids,
                         "max_tokens": max_tokens})
    return runs


def python_runs(engine, runs) -> dict[str, dict]:
    from edgespec.engine import GenerationConfig

    out = {}
    for run in runs:
        cfg = GenerationConfig(max_tokens=run["max_tokens"], temperature=0, mode=run["mode"], draft_max=run["draft_max"])
        r = engine.generate_tokens(run["prompt"], cfg)
        out[run["name"]] = {"tokens": r.tokens, "stats": r.stats.to_dict()}
    return out


def node_runs(bundle: Path, runs, threads: int, n_ctx: int, workdir: Path) -> dict[str, dict]:
    job = workdir / "node-job.json"
    job.write_text(json.dumps({"bundle": str(bundle), "threads": threads, "n_ctx": n_ctx, "quant": "fp32",
                               "draft_quant": "int4", "runs": runs}))
    proc = subprocess.run(["node", "bench/node-bench.mjs", str(job)], cwd=KIT, capture_output=True, text=True,
                          check=True)
    return {r["name"]: r for r in json.loads(proc.stdout)["runs"]}


def web_runs(bundle: Path, runs, n_ctx: int, workdir: Path) -> dict[str, dict]:
    fixture = {"bundles": {"smollm2": {"url": "../../../smollm2/", "n_ctx": n_ctx, "quant": "fp32",
                                       "draft_quant": "int4"}},
               "greedy": [{**r, "bundle": "smollm2"} for r in runs], "chat": []}
    results = run_in_chromium({"smollm2": bundle}, fixture, workdir, timeout=1800)
    errors = {k: v["error"] for k, v in results["cases"].items() if "error" in v}
    if errors:
        raise RuntimeError(f"the browser failed some runs: {errors}")
    return results["cases"]


def summarize(systems: dict[str, dict], runs) -> dict:
    table = {}
    for system, results in systems.items():
        for mode, _ in MODES:
            timed = [r for r in runs if r["mode"] == mode and not r["name"].startswith("warmup")]
            speeds = [results[r["name"]]["stats"]["tokens_per_s"] for r in timed]
            acc = [results[r["name"]]["stats"] for r in timed]
            drafted, accepted = sum(s["drafted"] for s in acc), sum(s["accepted"] for s in acc)
            table[(system, mode)] = {"median_tok_s": statistics.median(speeds), "n": len(speeds),
                                     "acceptance": accepted / drafted if drafted else None}
    agree = {}
    for system in systems:
        if system != "python":
            agree[system] = sum(systems[system][r["name"]]["tokens"] == systems["python"][r["name"]]["tokens"]
                                for r in runs) / len(runs)
    return {"table": table, "agreement": agree}


def machine() -> str:
    from edgespec.machine.hardware import detect_cpu

    cpu = detect_cpu()
    name, cores = cpu.name or platform.processor(), cpu.physical_cores or os.cpu_count()
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip() \
        if Path(CHROMIUM).is_file() else "none"
    import onnxruntime

    return (f"{name}, {cores} cores, Linux {platform.release()}; Python {platform.python_version()}, onnxruntime "
            f"{onnxruntime.__version__}; Node {node}, onnxruntime-node 1.30.0; {chromium}, onnxruntime-web 1.30.0 (wasm)")


def write_markdown(path: Path, summary: dict, args, desc: str, seconds: float) -> None:
    t = summary["table"]
    systems = sorted({s for s, _ in t}, key=["python", "node", "web"].index)
    lines = ["# The TypeScript kit against the Python engine (SmolLM2-135M, ONNX)", "",
             f"Command: `python -m edgespec.bench.js_bench --prompts {args.prompts} --max-tokens {args.max_tokens} "
             f"--repeats {args.repeats} --threads {args.threads}{' --no-web' if args.no_web else ''}` "
             f"({seconds / 60:.1f} minutes).", "",
             f"Machine: {desc}. Shared with other jobs while it ran: absolute numbers are rough, the ratios "
             "measured in one run are what to read.", "",
             "Bundle: SmolLM2-135M-Instruct from `edgespec export --format onnx --quant onnx:fp32,onnx:int4 "
             "--self-draft quant` (fp32 target, int4 draft). Greedy, the first "
             f"{args.prompts} prompts of bench/prompts.json (categories interleaved), {args.max_tokens} tokens, "
             f"{args.repeats} repeats, {args.threads} thread(s) for ONNX Runtime (the browser: 1 WebAssembly thread). "
             "tok/s = generated / decode time (prefill excluded), median over prompts x repeats.", "",
             "| mode | " + " | ".join(f"{s} tok/s" for s in systems) + " | " +
             " | ".join(f"{s} / python" for s in systems if s != "python") + " | acceptance (python / node) |",
             "|---|" + "---:|" * (2 * len(systems) - 1) + "---|"]
    for mode, k in MODES:
        row = [f"{mode}" + (f" k={k}" if k else "")]
        row += [f"{t[(s, mode)]['median_tok_s']:.1f}" for s in systems]
        row += [f"{t[(s, mode)]['median_tok_s'] / t[('python', mode)]['median_tok_s']:.2f}" for s in systems if s != "python"]
        accs = [t[(s, mode)]["acceptance"] for s in ("python", "node") if (s, mode) in t]
        row.append(" / ".join("-" if a is None else f"{a:.2f}" for a in accs))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Greedy tokens identical to the Python engine's: " +
              ", ".join(f"{s} {v:.0%} of the runs" for s, v in summary["agreement"].items()) + ".", ""]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--no-web", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "JS_RESULTS.md")
    args = ap.parse_args(argv)
    from edgespec.engine import Engine
    from edgespec.runtimes.onnxrt import OnnxOptions, OnnxRuntime

    t0 = time.time()
    bundle = smollm2_bundle()
    subprocess.run(["npm", "run", "--silent", "build"], cwd=KIT, check=True)
    manifest = json.loads((bundle / "edgespec.json").read_text())["formats"]["onnx"]
    files = {(role, a["quant"]): bundle / a["file"] for role in ("target", "draft") for a in manifest[role]}
    options = OnnxOptions(n_ctx=args.n_ctx, n_threads=args.threads)
    systems: dict[str, dict] = {"python": {}, "node": {}}
    runs: list[dict] = []
    with Engine(OnnxRuntime(files[("target", "fp32")], options), OnnxRuntime(files[("draft", "int4")], options)) as engine, \
            tempfile.TemporaryDirectory() as tmp:
        prompts = bench_prompts(engine, args.prompts)
        for r in range(args.repeats):
            block = runs_for(prompts, args.max_tokens, r)
            runs += block
            print(f"repeat {r}: python, then node ({len(block)} generations each)", file=sys.stderr)
            systems["python"].update(python_runs(engine, block))
            systems["node"].update(node_runs(bundle, block, args.threads, args.n_ctx, Path(tmp)))
        if not args.no_web:
            print("web (headless Chromium)", file=sys.stderr)
            systems["web"] = web_runs(bundle, runs, args.n_ctx, Path(tmp))
    summary = summarize(systems, runs)
    seconds = time.time() - t0
    write_markdown(args.out, summary, args, machine(), seconds)
    args.out.with_suffix(".json").write_text(json.dumps({
        "table": [{"system": s, "mode": m, **v} for (s, m), v in summary["table"].items()],
        "agreement": summary["agreement"], "seconds": seconds}, indent=1))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
