"""MLX against llama.cpp on the same weights and prompts: plain and auto decoding, interleaved.

    python -m edgespec.bench.mlx_bench [--model smollm2|tiny] [--prompts 6] [--repeats 3] [--max-tokens 64]
                                       [--out bench/MLX_RESULTS.md]

The model is SmolLM2-135M-Instruct as a Hugging Face checkpoint made from the catalog GGUF
(edgespec.exporters.from_gguf), run by MLX from that checkpoint and by llama.cpp from its GGUF f32
export (our converter): the same f32 weights. `--model tiny` uses a tiny random-weight Llama instead
(a smoke run: seconds, no download). llama.cpp keeps its defaults (f16 KV cache). Every (runtime, mode) pair runs each prompt in turn, in an order
rotated every round, so drift in machine load falls on all of them alike. Decode tok/s is the
engine's own (prefill excluded); the table gives the median and a 95% bootstrap interval of the
median over prompts x repeats, then the paired ratios (MLX over llama.cpp per mode, auto over plain
per runtime: each pair ran in the same round on the same prompt, seconds apart) with their own
bootstrap intervals, which drift in machine load disturbs far less than the separate medians.

Which MLX backend ran is read from MLX (`mx.default_device()`) and printed in the title: on Linux
it is the CPU backend, which says nothing about MLX on Metal. On an Apple Silicon Mac the same
command compares MLX on Metal against llama.cpp with every layer offloaded (a Metal build);
`pip install -e '.[export,mlx]'` first (the SmolLM2 checkpoint is built with transformers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MODES = ("ar", "auto")
RUNTIMES = ("llamacpp", "mlx")


def artefacts(model: str, progress=print) -> tuple[Path, Path]:
    """(checkpoint directory, f32 GGUF of the same weights), built once under the bench cache."""
    from edgespec.bench.run import bench_cache_dir
    from edgespec.exporters.gguf_export import convert_to_gguf

    root = bench_cache_dir() / "mlx"
    ckpt, gguf = root / f"{model}-hf", root / f"{model}.f32.gguf"
    if not (ckpt / "config.json").is_file():
        progress(f"building the {model} Hugging Face checkpoint")
        if model == "tiny":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from hf_models import write_tiny_checkpoint

            write_tiny_checkpoint(ckpt, family="llama", tokenizer="gpt2")
        else:
            from edgespec.exporters.from_gguf import smollm2_checkpoint_from_gguf
            from edgespec.models import store

            smollm2_checkpoint_from_gguf(store.resolve("smollm2-135m"), ckpt)
    if not gguf.is_file():
        progress("converting to GGUF f32")
        convert_to_gguf(ckpt, gguf, outtype="f32")
    return ckpt, gguf


def bench_prompts(n: int) -> list[list[dict]]:
    """The first n prompts of bench/prompts.json, a few from each category."""
    from edgespec.bench.run import load_prompts

    return [list(p.messages) for p in load_prompts(per_category=-(-n // 3))][:n]


def bootstrap_median(values: list[float], rng: np.random.Generator, n: int = 2000) -> tuple[float, float]:
    data = np.asarray(values)
    medians = np.median(rng.choice(data, size=(n, len(data)), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def mlx_backend() -> str:
    import mlx.core as mx

    device = mx.default_device().type.name
    return "Metal (GPU)" if device == "gpu" else "CPU backend"


def run(args) -> dict:
    from edgespec.engine import Engine, GenerationConfig

    ckpt, gguf = artefacts(args.model, lambda m: print(m, file=sys.stderr))
    engines = {"llamacpp": Engine.load(str(gguf), n_ctx=args.ctx, n_threads=args.threads),
               "mlx": Engine.load(str(ckpt), runtime="mlx", n_ctx=args.ctx)}
    prompts = [engines["mlx"].prompt_tokens(p) for p in bench_prompts(args.prompts)]
    points = [(r, m) for r in RUNTIMES for m in MODES]
    speeds = {p: [] for p in points}  # in run order: entry j of every point is the same (round, prompt)
    tokens = {p: {} for p in points}
    deadline = time.monotonic() + args.max_seconds if args.max_seconds else None
    for e in engines.values():  # warm-up: load pages, build auto's cost profile once
        for mode in MODES:
            e.generate_tokens(prompts[0], GenerationConfig(max_tokens=8, temperature=0, mode=mode))
    for rnd in range(args.repeats):
        order = points[rnd % len(points):] + points[:rnd % len(points)]
        for i, ids in enumerate(prompts):
            for runtime, mode in order:
                engine = engines[runtime]
                engine.target.truncate(0)  # prefill every time, as every point does
                result = engine.generate_tokens(ids, GenerationConfig(max_tokens=args.max_tokens, temperature=0,
                                                                      mode=mode))
                speeds[(runtime, mode)].append(result.stats.tokens_per_s)
                tokens[(runtime, mode)][i] = [int(t) for t in result.tokens]
            if deadline and time.monotonic() > deadline:
                break
        if deadline and time.monotonic() > deadline:
            print(f"stopped after round {rnd + 1} (--max-seconds)", file=sys.stderr)
            break
    for e in engines.values():
        e.close()
    rng = np.random.default_rng(0)
    rows = []
    for runtime, mode in points:
        s = speeds[(runtime, mode)]
        lo, hi = bootstrap_median(s, rng)
        same = sum(tokens[(runtime, mode)][i] == tokens[(runtime, "ar")][i] for i in tokens[(runtime, mode)])
        rows.append({"runtime": runtime, "mode": mode, "tok_s": statistics.median(s), "ci95": [lo, hi], "n": len(s),
                     "same_tokens_as_plain": f"{same}/{len(tokens[(runtime, mode)])}"})
    # Paired ratios: each (round, prompt) ran every point within seconds of each other, so their ratio
    # cancels most of the machine's drift; the interval is a bootstrap of the median ratio over the pairs.
    n = min(len(v) for v in speeds.values())
    ratios = []
    for label, num, den in ([(f"mlx / llamacpp, {m}", ("mlx", m), ("llamacpp", m)) for m in MODES]
                            + [(f"auto / ar, {r}", (r, "auto"), (r, "ar")) for r in RUNTIMES]):
        values = [a / b for a, b in zip(speeds[num][:n], speeds[den][:n]) if b > 0]
        lo, hi = bootstrap_median(values, rng)
        ratios.append({"ratio": label, "median": statistics.median(values), "ci95": [lo, hi], "n": len(values)})
    return {"model": args.model, "mlx_backend": mlx_backend(), "rows": rows, "ratios": ratios}


def render(result: dict, machine: dict, command: str) -> str:
    lines = [f"# MLX ({result['mlx_backend']}) against llama.cpp, same f32 weights", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['physical_cores']} cores, {machine['ram_gib']} GiB, {machine['os']}, "
             f"llama-cpp-python {machine['llama_cpp_python']}; load average at start {machine['load_average_start']}.",
             "", f"Model: {result['model']}. MLX ran on its **{result['mlx_backend']}**"
             + (": this says nothing about MLX on Metal." if result["mlx_backend"] == "CPU backend" else "."), "",
             "llama.cpp runs as users run it (f16 KV cache), MLX in the checkpoint's f32, so their greedy "
             "tokens may part at near-ties; the last column checks each runtime's auto against its own plain "
             "output (tests/test_mlx_runtime.py compares MLX with llama.cpp at f32).", "",
             "| runtime | mode | decode tok/s (median) | 95% CI | n | greedy tokens = its own plain |",
             "|---|---|---:|---|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['runtime']} | {r['mode']} | {r['tok_s']:.1f} | {r['ci95'][0]:.1f}-{r['ci95'][1]:.1f} | "
                     f"{r['n']} | {r['same_tokens_as_plain']} |")
    lines += ["", "Paired speed ratios (same round and prompt; median and 95% bootstrap interval over the pairs):", "",
              "| ratio | median | 95% CI | pairs |", "|---|---:|---|---:|"]
    for r in result["ratios"]:
        lines.append(f"| {r['ratio']} | {r['median']:.2f}x | {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f} | {r['n']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (MLX has no such setting)")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after the round in progress at this time")
    p.add_argument("--out", type=Path, default=Path("bench/MLX_RESULTS.md"))
    args = p.parse_args(argv)
    from edgespec.bench.run import describe_machine

    machine = describe_machine()
    result = run(args)
    command = "python -m edgespec.bench.mlx_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(render(result, machine, command))
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, **result}, indent=1))
    print(render(result, machine, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
