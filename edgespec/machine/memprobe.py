"""What the memory model measures, each run in a fresh process: `python -m edgespec.machine.memprobe COMMAND`.

    facts PATH           GGUF geometry and tensor table (gguf.GGUFReader), as JSON
    build                this llama.cpp build: version and compiled features
    calibrate [MODEL]    the per-build calibration (dry runs, a vocabulary load, two real runs)
    measure SETUP_JSON   load a setup, run one generation, report the peak resident set
    throughput JOB_JSON  decode speed of several setups, interleaved (no memory measured)

A fresh process per measurement is the point: a process's peak resident set (VmHWM) never goes down,
so two measurements in one process would mix. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import json
import sys
import time


def _imports_like_the_cli() -> None:
    """Import what an `edgespec generate` process imports, so the measured base matches it."""
    import edgespec.chat  # noqa: F401  (jinja2, for chat templates)
    import edgespec.cli  # noqa: F401  (typer)
    import edgespec.engine  # noqa: F401  (numpy, the engine)
    from edgespec.runtimes import llamacpp

    llamacpp.backend_info()


def cmd_facts(path: str) -> dict:
    from edgespec.machine.memory import facts_from_reader

    return facts_from_reader(path).to_dict()


def cmd_build() -> dict:
    from edgespec.runtimes import llamacpp

    info = llamacpp.backend_info()
    return {"build": info["build"], "system_info": info["system_info"]}


# Reference configurations: each compute-buffer term dominates in some of them (see memory.py).
DRY_RUNS = [
    {"n_ctx": c, "n_batch": b, "n_outputs_max": o, "type_k": kv, "type_v": kv, "flash_attn": fa}
    for (c, b, o, kv, fa) in [
        (512, 512, 1, "f16", None), (512, 256, 8, "f16", None), (2048, 128, 4, "f16", None),
        (512, 64, 64, "f16", None), (512, 128, 128, "f16", None),
        (8192, 256, 1, "f16", False), (4096, 512, 1, "f16", False),
    ]
]

CALIBRATION_MODEL = "smollm2-135m"  # the smallest catalog model: calibration loads it twice, in seconds
REFERENCE_RUN = {"n_ctx": 768, "type_k": "f16", "type_v": "f16", "n_batch": 512, "n_outputs_max": 5}


def cmd_calibrate(reference: str | None = None) -> dict:
    from dataclasses import asdict

    from edgespec.loader import resolve
    from edgespec.machine.memory import (Hardware, ModelSettings, Setup, current_rss, facts_from_reader,
                                 fit_calibration)
    from edgespec.runtimes import llamacpp

    path = reference or str(resolve(CALIBRATION_MODEL))
    info = llamacpp.backend_info()
    before = current_rss()
    vocab = llamacpp.VocabOnly(path)  # first model this process touches: a clean delta
    vocab_delta = current_rss() - before
    vocab.close()
    facts = facts_from_reader(path)
    dry = list(zip(DRY_RUNS, llamacpp.dry_run_compute_buffers(path, DRY_RUNS)))

    settings = ModelSettings(**REFERENCE_RUN)
    runs = {}
    for name, with_draft in (("one", False), ("two", True)):
        setup = Setup(target=facts, target_settings=settings, draft=facts if with_draft else None,
                      draft_settings=ModelSettings(**{**REFERENCE_RUN, "n_outputs_max": 1}) if with_draft else None,
                      max_draft=4, sampling=False, hardware=Hardware())
        job = {"target": path, "draft": path if with_draft else None, "setup": setup.to_dict(),
               "prompt_tokens": 600, "max_tokens": 16, "mode": "draft" if with_draft else "lookup"}
        result = run_measure_subprocess(job)
        runs[name] = {"peak": result["peak"], "base": result["base"], "setup": setup.to_dict()}
    cal = fit_calibration(info["build"], info["system_info"], facts, dry, vocab_delta, runs)
    out = cal.to_dict()
    out["measured"]["settings"] = asdict(settings)
    return out


def run_measure_subprocess(job: dict, timeout: float = 900, command: str = "measure") -> dict:
    """Run `measure` (or another command) for one job in a fresh interpreter and return its JSON."""
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-m", "edgespec.machine.memprobe", command, json.dumps(job)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measure failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def prompt_ids(runtime, n: int) -> list[int]:
    """n token ids of real text (a paragraph repeated, so prompt lookup finds its drafts)."""
    text = ("def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
            "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
            "        out.append(total / window)\n    return out\n\n")
    ids = runtime.tokenize(text, add_special=False, parse_special=False)
    return (ids * (n // len(ids) + 1))[:n]


def cmd_measure(job: dict) -> dict:
    """Load the setup a job describes, prefill its prompt, generate, and report what the process held."""
    _imports_like_the_cli()
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.machine.memory import current_rss, peak_rss, read_status
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    setup = job["setup"]
    base = current_rss()
    t0 = time.perf_counter()
    threads = job.get("n_threads")  # None: physical cores, as the CLI does
    target = LlamaCppRuntime(job["target"], LlamaCppOptions(n_threads=threads, **setup["target_settings"]))
    draft = None
    if job.get("draft"):
        draft = LlamaCppRuntime(job["draft"], LlamaCppOptions(n_threads=threads, **setup["draft_settings"]))
    load_s = time.perf_counter() - t0
    engine = Engine(target, draft)
    ids = prompt_ids(target, job.get("prompt_tokens", 600))
    k = setup.get("max_draft", 0)
    mode = job.get("mode") or ("draft" if draft else "ar")
    config = GenerationConfig(max_tokens=job.get("max_tokens", 16), temperature=job.get("temperature", 0.0),
                              mode=mode if k else "ar", draft_max=k or None, seed=0)
    result = engine.generate_tokens(ids, config)
    speeds = [result.stats.tokens_per_s]
    for _ in range(job.get("repeats", 1) - 1):  # timing only: the buffers, and so the peak, are the same
        target.truncate(0)
        if draft is not None:
            draft.truncate(0)
        speeds.append(engine.generate_tokens(ids, config).stats.tokens_per_s)
    out = {
        "peak": peak_rss(), "base": base, "status": read_status(), "load_s": round(load_s, 3),
        "n_ctx": target.n_ctx, "buffers": {"target": target.buffers, **({"draft": draft.buffers} if draft else {})},
        "generated": result.stats.generated, "tokens_per_s": sorted(speeds)[len(speeds) // 2], "speeds": speeds,
        "decode_s": result.stats.decode_s, "acceptance_rate": result.stats.acceptance_rate,
        "chosen": result.stats.chosen,
    }
    engine.close()
    return out


def cmd_throughput(job: dict) -> dict:
    """Decode speed of several setups, interleaved: each repeat loads and runs every setup in turn, so a
    busy machine's slow minutes fall on all of them alike. Memory is not measured here (one process)."""
    _imports_like_the_cli()
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    threads = job.get("n_threads", 1)  # one thread: on a shared machine two spin-waiting threads are far slower
    speeds: list[list[float]] = [[] for _ in job["setups"]]
    accept: list[list[float]] = [[] for _ in job["setups"]]
    for _ in range(job.get("repeats", 3)):
        for i, entry in enumerate(job["setups"]):
            setup = entry["setup"]
            target = LlamaCppRuntime(entry["target"], LlamaCppOptions(n_threads=threads, **setup["target_settings"]))
            draft = (LlamaCppRuntime(entry["draft"], LlamaCppOptions(n_threads=threads, **setup["draft_settings"]))
                     if entry.get("draft") else None)
            with Engine(target, draft) as engine:
                k = setup.get("max_draft", 0)
                mode = "draft" if draft else entry.get("mode", "ar")
                config = GenerationConfig(max_tokens=job.get("max_tokens", 32), temperature=0.0, seed=0,
                                          mode=mode if (k and mode != "ar") else "ar", draft_max=k or None)
                result = engine.generate_tokens(prompt_ids(target, job.get("prompt_tokens", 200)), config)
                speeds[i].append(result.stats.tokens_per_s)
                accept[i].append(result.stats.acceptance_rate)
    return {"speeds": speeds, "acceptance": accept}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command == "facts":
            out = cmd_facts(args[0])
        elif command == "build":
            out = cmd_build()
        elif command == "calibrate":
            out = cmd_calibrate(args[0] if args else None)
        elif command == "measure":
            out = cmd_measure(json.loads(args[0]))
        elif command == "throughput":
            out = cmd_throughput(json.loads(args[0]))
        else:
            print(f"unknown command {command!r}", file=sys.stderr)
            return 2
    except Exception as exc:  # reported as JSON: the parent turns it into a clear error
        from edgespec.errors import EdgespecError

        if not isinstance(exc, EdgespecError):
            raise
        out = {"error": str(exc)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
