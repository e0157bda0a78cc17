"""Managed KV: decode speed and peak memory against the fraction of the KV kept resident.

    python -m edgespec.bench.kv_offload_bench [--model smollm2|tiny] [--context 2048] [--gen 64]
        [--repeats 3] [--fractions 1.0,0.5,0.25,0.1] [--threads 2] [--out bench/KV_OFFLOAD_RESULTS.md]

The model is exported as layer graphs (exporters/onnx_layers.py) and run by the layered runtime
(runtimes/onnx_layered.py). `smollm2` is SmolLM2-135M-Instruct made a Hugging Face fp32 checkpoint from
the catalog GGUF (edgespec.exporters.from_gguf, the smollm2_hf fixture's path; needs the export
extra); `tiny` is a random 8-layer model with a large KV for its size (tests/hf_models.py, so it
needs the repository's tests/ folder).

Each of `--repeats` rounds runs every fraction once, in turn, each in a fresh process (so the load
of a shared machine drifts over all fractions alike): load, prefill `context - gen` tokens of sample
text, then two timed greedy generations of `gen` tokens through edgespec.engine.Engine (mode ar;
the prompt's KV is reused, so only decoding is timed). The resident budget is the
fraction times the KV of a full context (1.0 = no budget: every layer in RAM); the layers beyond it
live in the file tier (a memory-mapped temporary file, pages released after each use). Reported:
median decode tok/s (generated / decode_s) over all generations, the ratio to 1.0, the peak RSS
over the loaded model (VmHWM reset after loading; median over rounds), the time the compute thread
waited for a KV fetch, and the file-tier bytes read per token. Greedy tokens are compared with 1.0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

FRACTIONS = (1.0, 0.5, 0.25, 0.1)
GENERATIONS_PER_PROCESS = 2
REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


# --- the model -------------------------------------------------------------------------------------

def prepare(model: str, work: Path) -> Path:
    """A layered export of the model under `work` (made once, reused)."""
    from edgespec.exporters.onnx_layers import export_onnx_layers
    from edgespec.exporters.progress import SILENT

    layers = work / f"{model}-layers"
    if (layers / "layers.json").is_file():
        return layers
    ckpt = work / f"{model}-hf"
    if not (ckpt / "config.json").is_file():
        if model == "smollm2":
            from edgespec.exporters.from_gguf import smollm2_checkpoint_from_gguf
            from edgespec.models import store

            smollm2_checkpoint_from_gguf(store.resolve("smollm2-135m"), ckpt)
        else:
            sys.path.insert(0, str(REPO / "tests"))  # hf_models: the test suite's tiny checkpoint builder
            import hf_models

            hf_models.write_tiny_checkpoint(ckpt, family="llama", tokenizer="gpt2", n_layer=8, hidden=256, n_head=2,
                                            n_head_kv=2, ff=64, max_positions=8192)
    t = time.perf_counter()
    art = export_onnx_layers(ckpt, layers, progress=SILENT)
    print(f"exported {model} as {len(art.manifest['groups'])} layer graphs in {time.perf_counter() - t:.0f} s; "
          f"check vs transformers: max |logit diff| {art.check['max_abs_logit_diff']:.2e}", file=sys.stderr)
    return layers


def prompt_ids(layers: Path, n: int) -> list[int]:
    """Sample text (the exporters' quality text, repeated) as n token ids."""
    from tokenizers import Tokenizer

    from edgespec.exporters.gguf_export import QUALITY_TEXT

    ids = Tokenizer.from_file(str(layers / "tokenizer.json")).encode(QUALITY_TEXT, add_special_tokens=False).ids
    return (ids * (n // len(ids) + 1))[:n]


# --- one fraction, in a fresh process ---------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(args) -> dict:
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.onnx_layered import LayeredOnnxRuntime

    budget = None if args.budget < 0 else args.budget
    rt = LayeredOnnxRuntime(args.layers, n_ctx=args.context, n_threads=args.threads, resident_budget_bytes=budget,
                            verify_files=False)
    rt.decode(list(range(5, 5 + rt.n_batch)), 1)  # ONNX Runtime's first-run allocations (~1 MiB per graph)
    rt.truncate(0)
    try:  # glibc: give back what loading freed, so later reuse of it shows as growth
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    loaded = _status("VmRSS")
    linux = Path("/proc/self/clear_refs").exists()
    if linux:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here on: what prefill and decoding add
    prompt = prompt_ids(Path(args.layers), args.context - args.gen)
    engine = Engine(rt)
    config = GenerationConfig(max_tokens=args.gen, temperature=0.0, mode="ar")
    t = time.perf_counter()
    rt.decode(prompt[:-1], 0)  # the engine keeps this prefix: the generations time decoding only
    prefill_s = time.perf_counter() - t
    runs, tokens = [], None
    for _ in range(GENERATIONS_PER_PROCESS):
        before = rt.kv_stats()
        result = engine.generate_tokens(prompt, config)
        after = rt.kv_stats()
        n = result.stats.generated
        runs.append({"tok_s": result.stats.tokens_per_s, "generated": n,
                     "fetch_wait_ms_per_token": 1000 * (after["fetch_wait_s"] - before["fetch_wait_s"]) / max(n, 1),
                     "fetch_ms_per_token": 1000 * (after["fetch_s"] - before["fetch_s"]) / max(n, 1),
                     "file_mib_per_token":
                         (after["bytes_fetched_file"] - before["bytes_fetched_file"]) / MiB / max(n, 1)})
        tokens = result.tokens
    out = {"budget": budget, "prefill_s": prefill_s, "runs": runs, "tokens": tokens, "kv_stats": rt.kv_stats(),
           "rss_loaded": loaded, "peak": _status("VmHWM") if linux else None, "weights": rt.weight_bytes()}
    rt.close()
    return out


def run_fraction(layers: Path, fraction: float, args) -> dict:
    geo = json.loads((layers / "layers.json").read_text())["geometry"]
    kv_full = 2 * geo["n_layer"] * geo["n_head_kv"] * geo["head_dim"] * 4 * args.context
    budget = -1 if fraction >= 1.0 else int(fraction * kv_full)
    minimum = 2 * kv_full // geo["n_layer"]  # two staging buffers of one layer (64-token blocks divide the context)
    if 0 <= budget < minimum:
        return {"fraction": fraction, "kv_full": kv_full, "skipped": f"below the minimum budget of two staging "
                f"layers ({minimum / MiB:.1f} MiB = {minimum / kv_full:.2f} of the KV)"}
    cmd = [sys.executable, "-m", "edgespec.bench.kv_offload_bench", "--child", "--layers", str(layers),
           "--budget", str(budget), "--context", str(args.context), "--gen", str(args.gen),
           "--threads", str(args.threads)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"fraction {fraction}: the child failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(fraction=fraction, kv_full=kv_full, seconds=round(time.perf_counter() - t, 1))
    return row


# --- report ----------------------------------------------------------------------------------------

def machine() -> dict:
    import onnxruntime

    from edgespec.bench.run import describe_machine

    info = describe_machine()
    info["onnxruntime"] = onnxruntime.__version__
    return info


def render(rows: list[dict], args, info: dict, model_line: str) -> str:
    base = statistics.median(r["tok_s"] for r in rows[0]["runs"])
    lines = [
        "# Managed KV: decode speed against the resident fraction",
        "",
        f"Generated by `bench/kv_offload_bench.py` on {info['date']}. Reproduce with:",
        "",
        "```sh",
        f"python -m edgespec.bench.kv_offload_bench --model {args.model} --context {args.context} --gen {args.gen} "
        f"--repeats {args.repeats} --fractions {','.join(str(f) for f in args.fractions)} --threads {args.threads}",
        "```",
        "",
        *([f"A reduced run (context {args.context}, {args.gen} tokens, {args.repeats} rounds); the full one is "
           "`python -m edgespec.bench.kv_offload_bench` (context 2048, 64 tokens, 3 rounds).", ""]
          if (args.context, args.gen, args.repeats) != (2048, 64, 3) else []),
        f"Model: {model_line}. Context {args.context} tokens ({args.context - args.gen} of prompt, then {args.gen} "
        f"generated greedily), ONNX Runtime CPU, {args.threads} intra-op threads per graph, KV float32 in blocks of "
        "64 positions; file tier = a temporary file read with preadv into the staging buffers and written with "
        "pwrite (its pages live in the kernel's page cache, not in the process).",
        "",
        f"Machine: {info['cpu']}, {info['logical_cores']} logical cores ({info['physical_cores']} physical), "
        f"{info['ram_gib']} GiB RAM, {info['os']}, Python {info['python']}, onnxruntime {info['onnxruntime']}; "
        f"load average at start {info['load_average_start']} (shared machine: absolute times are rough).",
        "",
        "| resident fraction | budget (MiB) | layers RAM / file | decode tok/s (median, min-max) | × 1.0 | "
        "RSS loaded (MiB) | peak RSS (MiB) | growth (MiB) | resident KV (MiB) | fetch wait (ms/token) | "
        "file read (MiB/token) | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['fraction']:.2f} | | | {r['skipped']} | | | | | | | | |")
            continue
        tok = [x["tok_s"] for x in r["runs"]]
        med = statistics.median(tok)
        st = r["kv_stats"]
        peak = r["peak"] / MiB if r["peak"] else float("nan")
        growth = peak - r["rss_loaded"] / MiB
        budget = "none" if r["budget"] is None else f"{r['budget'] / MiB:.1f}"
        lines.append(
            f"| {r['fraction']:.2f} | {budget} | {st['ram_layers']} / {st['file_layers']} | {med:.1f} ({min(tok):.1f}-"
            f"{max(tok):.1f}) | {med / base:.2f} | {r['rss_loaded'] / MiB:.0f} | {peak:.0f} | {growth:.1f} | "
            f"{st['resident_bytes'] / MiB:.1f} | "
            f"{statistics.median(x['fetch_wait_ms_per_token'] for x in r['runs']):.2f} | "
            f"{statistics.median(x['file_mib_per_token'] for x in r['runs']):.2f} | "
            f"{'yes' if r['tokens'] == rows[0]['tokens'] else 'NO'} |")
    lines += [
        "",
        f"Full KV of the context: {rows[0]['kv_full'] / MiB:.1f} MiB; weights (graph files) "
        f"{rows[0]['weights'] / MiB:.1f} MiB. RSS loaded: after loading the graphs, one warm-up decode and "
        "malloc_trim; peak RSS: VmHWM over the prefill and the generations (reset after loading); growth = "
        "peak - loaded: the resident KV (RAM-tier blocks and the two staging buffers) plus ONNX Runtime's "
        "activations and the allocator's slack. The offloaded KV stays in the page cache on a machine "
        "with free RAM, so these figures measure the copies, not disk reads. "
        "Fetch wait is the time the compute thread waited for the background "
        "fetch of the next layer's KV (the part not hidden behind the current layer's compute); file read "
        "is what the file tier copied into the staging buffers per generated token. "
        f"{args.repeats} rounds; in each, every fraction ran once in a fresh process with "
        f"{GENERATIONS_PER_PROCESS} timed generations; tok/s: median and range over all generations; memory: "
        "median over rounds.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=list(FRACTIONS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=REPO / "bench" / "out" / "kv_offload")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "KV_OFFLOAD_RESULTS.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    args.fractions = sorted(set(args.fractions) | {1.0}, reverse=True)  # 1.0 is the reference
    args.work.mkdir(parents=True, exist_ok=True)
    info = machine()
    layers = prepare(args.model, args.work)
    manifest = json.loads((layers / "layers.json").read_text())
    geo = manifest["geometry"]
    model_line = (f"{manifest['source']} ({args.model}), {geo['n_layer']} layers, {geo['n_head_kv']} KV heads x "
                  f"{geo['head_dim']}, fp32 layer graphs")
    rows = {}
    for r in range(args.repeats):
        for fraction in args.fractions:
            got = run_fraction(layers, fraction, args)
            if "skipped" in got:
                rows[fraction] = got
                if r == 0:
                    print(f"fraction {fraction:.2f}: {got['skipped']}", file=sys.stderr, flush=True)
                continue
            row = rows.setdefault(fraction, {**got, "runs": [], "peaks": [], "loaded": []})
            row["runs"] += got["runs"]
            row["peaks"].append(got["peak"] or 0)
            row["loaded"].append(got["rss_loaded"])
            med = statistics.median(x["tok_s"] for x in got["runs"])
            print(f"round {r + 1}, fraction {fraction:.2f}: {med:.1f} tok/s, RAM/file layers "
                  f"{got['kv_stats']['ram_layers']}/{got['kv_stats']['file_layers']} ({got['seconds']} s)",
                  file=sys.stderr, flush=True)
    rows = [rows[f] for f in args.fractions]
    for row in rows:
        if "peaks" in row:
            row["peak"], row["rss_loaded"] = statistics.median(row["peaks"]), statistics.median(row["loaded"])
    text = render(rows, args, info, model_line)
    args.out.write_text(text, encoding="utf-8")
    public = {k: str(getattr(args, k)) for k in ("model", "context", "gen", "repeats", "fractions", "threads")}
    report = {"machine": info, "args": public, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
