"""The benchmark behind every speed claim: edgespec against plain decoding and its peers, same run.

    python -m edgespec.bench.run [--models qwen|smollm2|all] [--repeats 3] [--max-tokens 128]
                                 [--out bench/out] [--quick]

For each model setup and prompt the prompt is rendered once, with edgespec's chat template, to token
ids; every system gets exactly those ids. Systems, all greedy, in one process with the same threads
and model parameters:

- edgespec `ar` (plain decoding), `draft` at k in {1, 2, 4} (where a draft model exists), `lookup`
  at k in {2, 4, 8}, and `auto` (the adaptive policy, which picks drafter and k each round);
- llama-cpp-python `Llama.create_completion(stream=True)` plain, and with its prompt-lookup drafter
  `LlamaPromptLookupDecoding(num_pred_tokens=N)`, N in {2, 10} (10 is its default).

Timing is the harness's own and the same for every system (see TIMING below); no self-reported
number enters a speed figure. The KV cache is reset before every timed run, for every system, so
no run reuses the previous run's prompt. Writes results.json, results.md and tok_s_vs_k.png.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

DRAFT_KS = (1, 2, 4, 8)   # the fixed settings auto must match: mode x k in {1, 2, 4, 8}
LOOKUP_KS = (1, 2, 4, 8)
PEER_LOOKUP_NS = (2, 10)
# llama-cpp-python's draft_model hook writes every logits row into a buffer of n_batch rows when
# logits_all=False, indexed by absolute position: it crashes once prompt + output passes n_batch.
# A large n_batch (not logits_all=True, which allocates n_ctx rows) keeps it working.
PEER_LOOKUP_N_BATCH = 2048
PLAIN = "edgespec ar"
PEER_PLAIN = "llama-cpp-python"

TIMING = (
    "t0 is taken just before the streaming call (edgespec's GenerationStream over the prompt's token ids; "
    "llama-cpp-python's create_completion(prompt=<the same token ids>, stream=True)). Every non-empty "
    "text piece is timestamped when the harness receives it, together with the number of tokens the "
    "system's generation loop had handed over by then (a counter around edgespec's Engine.rounds and "
    "llama-cpp-python's Llama.generate). ttft = first piece - t0 (prefill included). decode tok/s = "
    "tokens delivered after the first piece / (t_last - t_first): with one token per piece this is "
    "(n - 1) / (t_last - t_first); tokens that arrive together with the first piece (a speculative first "
    "round) are not counted, so no system is credited for work done before t_first. End-of-generation "
    "tokens are not counted. Medians over repeats per prompt, then medians over prompts; ratios are "
    "medians over prompts of per-prompt ratios. Achieved bandwidth = target weight bytes x decode tok/s "
    "(for speculative systems an effective figure that can exceed what the memory delivers)."
)
RESET = (
    "KV reset before every timed run for every system: edgespec truncates target and draft KV to 0 "
    "(engine.target.truncate(0), engine.draft_runtime.truncate(0)); llama-cpp-python calls Llama.reset(). "
    "So ttft always includes a full prefill and no run reuses a previous run's prompt."
)


# --- prompts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...]


def load_prompts(per_category: int | None = None, ids: Sequence[str] | None = None) -> list[Prompt]:
    """The shipped prompts: the first `per_category` of each category, or exactly those named by `ids`."""
    text = resources.files("edgespec.bench").joinpath("prompts.json").read_text(encoding="utf-8")
    out = []
    for category, items in json.loads(text)["categories"].items():
        for item in (items if ids else items[:per_category]):
            if not ids or item["id"] in ids:
                out.append(Prompt(item["id"], category, tuple(item["messages"])))
    unknown = set(ids or ()) - {p.id for p in out}
    if unknown:
        raise ValueError(f"unknown prompt ids {sorted(unknown)}; known: {[p.id for p in load_prompts()]}")
    return out


# --- one timed generation ----------------------------------------------------------------------

@dataclass
class Run:
    system: str
    prompt_id: str
    category: str
    repeat: int
    prompt_tokens: int
    tokens: list[int]
    t0: float
    marks: list[tuple[float, int]]   # (time a piece arrived, tokens delivered by then)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    self_reported: dict = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.marks[0][0] - self.t0 if self.marks else None

    @property
    def decode_tok_s(self) -> float | None:
        if len(self.marks) < 2:
            return None
        (t_first, n_first), (t_last, n_last) = self.marks[0], self.marks[-1]
        return (n_last - n_first) / (t_last - t_first) if t_last > t_first and n_last > n_first else None

    @property
    def e2e_tok_s(self) -> float | None:
        if not self.marks:
            return None
        t_last, n_last = self.marks[-1]
        return n_last / (t_last - self.t0)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds else None


class System:
    """A way to generate. `stream` yields text pieces; `delivered` counts tokens handed over so far."""

    name: str
    family: str   # "edgespec" | "llama-cpp-python"
    mode: str     # "ar" | "draft" | "lookup"
    k: int | None

    def reset(self) -> None: ...
    def stream(self, ids: list[int], max_tokens: int) -> Iterator[str]: ...
    def delivered(self) -> int: ...
    def finish(self) -> dict: ...


def timed_run(system: System, ids: list[int], max_tokens: int) -> tuple[float, list[tuple[float, int]], dict]:
    """The one timing loop every system goes through."""
    system.reset()
    marks: list[tuple[float, int]] = []
    clock = time.perf_counter
    t0 = clock()
    for piece in system.stream(ids, max_tokens):
        if piece:
            marks.append((clock(), system.delivered()))
    return t0, marks, system.finish()


class EdgespecSystem(System):
    family = "edgespec"

    def __init__(self, engine, mode: str, k: int | None):
        self.engine, self.mode, self.k = engine, mode, k
        self.name = f"edgespec {mode}" + (f" k={k}" if k else "")
        self._count = 0
        self._stream = None

    def reset(self) -> None:
        self.engine.target.truncate(0)
        if self.engine.draft_runtime is not None:
            self.engine.draft_runtime.truncate(0)

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[str]:
        from edgespec.engine import Engine, GenerationConfig, GenerationStream

        engine = self.engine
        config = GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=0, mode=self.mode,
                                  draft_max=self.k)
        rounds = Engine.rounds.__get__(engine)
        self._count = 0

        def counted_rounds(*args, **kwargs):
            loop = rounds(*args, **kwargs)
            try:
                for new in loop:
                    self._count += len(new)
                    yield new
            finally:
                loop.close()

        engine.rounds = counted_rounds  # an instance attribute, removed below
        self._stream = GenerationStream(engine, list(ids), config)
        try:
            yield from self._stream
        finally:
            del engine.rounds

    def delivered(self) -> int:
        return self._count

    def finish(self) -> dict:
        result = self._stream.result
        stats = result.stats
        return {"tokens": list(result.tokens), "drafted": stats.drafted, "accepted": stats.accepted,
                "rounds": stats.rounds, "self_reported": {
                    "tokens_per_s": round(stats.tokens_per_s, 3), "ttft_s": round(stats.ttft_s, 6),
                    "decode_s": round(stats.decode_s, 6), "draft_s": round(stats.draft_s, 6),
                    "verify_s": round(stats.verify_s, 6), "finish_reason": result.finish_reason,
                    "chosen": dict(stats.chosen)}}


class _CountingDraft:
    """Wraps llama-cpp-python's prompt-lookup drafter to count the tokens it proposes."""

    def __init__(self, inner):
        self.inner = inner
        self.drafted = 0

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.drafted += len(out)
        return out


class PeerModel:
    """One llama-cpp-python `Llama`, with counters around its generate and eval loops.

    The lookup peers with different N share one instance (only the drafter's num_pred_tokens differs),
    which saves a copy of the weights and the n_batch x n_vocab logits buffer.
    """

    def __init__(self, path: Path, *, n_ctx: int, n_threads: int, flash_attn: bool, eog: frozenset[int],
                 lookup: bool):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.eog = eog
        kwargs = dict(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                      flash_attn=flash_attn, seed=0, verbose=False)
        self.draft = None
        if lookup:
            self.draft = _CountingDraft(LlamaPromptLookupDecoding(num_pred_tokens=PEER_LOOKUP_NS[-1]))
            kwargs.update(n_batch=PEER_LOOKUP_N_BATCH, draft_model=self.draft)
        self.n_batch = kwargs.get("n_batch", 512)
        self.llm = Llama(**kwargs)
        self.tokens: list[int] = []
        self.delivered = 0
        self.evals = 0
        generate, evaluate = self.llm.generate, self.llm.eval

        def counted_generate(*args, **kwargs):
            loop = generate(*args, **kwargs)
            try:
                for token in loop:
                    self.tokens.append(int(token))
                    self.delivered += int(token) not in self.eog
                    yield token
            finally:
                loop.close()

        def counted_eval(tokens):
            self.evals += 1
            return evaluate(tokens)

        # Instance attributes: create_completion calls self.generate, generate calls self.eval.
        self.llm.generate, self.llm.eval = counted_generate, counted_eval

    def start(self, lookup_n: int | None) -> None:
        self.tokens, self.delivered, self.evals = [], 0, 0
        if self.draft is not None:
            self.draft.inner.num_pred_tokens = lookup_n
            self.draft.drafted = 0

    def close(self) -> None:
        self.llm.close()


class LlamaCppPythonSystem(System):
    """llama-cpp-python's own high-level generation, as its users call it."""

    family = "llama-cpp-python"

    def __init__(self, model: PeerModel, lookup_n: int | None = None):
        if (model.draft is None) != (lookup_n is None):
            raise ValueError("a lookup peer needs a PeerModel made with lookup=True, and only it")
        self.model = model
        self.mode, self.k = ("lookup", lookup_n) if lookup_n else ("ar", None)
        self.name = PEER_PLAIN + (f" lookup N={lookup_n}" if lookup_n else "")

    def reset(self) -> None:
        self.model.llm.reset()

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[str]:
        m = self.model
        if m.draft is not None and len(ids) + max_tokens > m.n_batch:
            raise RuntimeError(f"{self.name}: prompt ({len(ids)}) + max tokens ({max_tokens}) exceeds n_batch "
                               f"{m.n_batch}, where llama-cpp-python's draft_model hook crashes")
        m.start(self.k)
        for chunk in m.llm.create_completion(list(ids), max_tokens=max_tokens, temperature=0.0,
                                             repeat_penalty=1.0, seed=0, stream=True):
            yield chunk["choices"][0]["text"]

    def delivered(self) -> int:
        return self.model.delivered

    def finish(self) -> dict:
        m = self.model
        tokens = [t for t in m.tokens if t not in m.eog]
        rounds = max(0, m.evals - 1)  # the first eval is the prompt; each later one verifies a draft
        accepted = max(0, len(m.tokens) - 1 - rounds)
        return {"tokens": tokens, "drafted": m.draft.drafted if m.draft else 0,
                "accepted": accepted if m.draft else 0, "rounds": rounds, "self_reported": {}}


# --- model setups -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    name: str
    target: str
    draft: str | None
    draft_note: str

    def draft_path(self) -> Path | None:
        """The draft's file: the catalog's, or SmolLM2 re-quantized (made once, `smollm2_draft`)."""
        from edgespec.models import store

        if self.draft is None:
            return None
        return smollm2_draft() if self.draft == "smollm2-q4_0" else store.resolve(self.draft)


def bench_cache_dir() -> Path:
    import platformdirs

    home = os.environ.get("EDGESPEC_HOME")
    base = Path(home) if home else Path(platformdirs.user_cache_dir("edgespec"))
    return base / "bench"


def smollm2_draft() -> Path:
    """SmolLM2 has no smaller sibling: its own weights re-quantized Q4_1 -> Q4_0 are the draft."""
    from edgespec.models import store
    from edgespec.runtimes.llamacpp import quantize

    dst = bench_cache_dir() / "smollm2-135m-q4_0.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        quantize(store.resolve("smollm2-135m"), dst, "q4_0")
    return dst


def setups(which: str) -> list[Setup]:
    qwen = Setup("qwen", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
                 "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the catalog pair)")
    smol = Setup("smollm2", "smollm2-135m", "smollm2-q4_0",
                 "SmolLM2-135M re-quantized Q4_1 -> Q4_0 (same model, about the same cost: it shows "
                 "acceptance, not a speed-up)")
    return {"qwen": [qwen], "smollm2": [smol], "all": [smol, qwen]}[which]


# --- machine ---------------------------------------------------------------------------------

def describe_machine() -> dict:
    import llama_cpp
    import psutil

    import edgespec
    from edgespec.machine.hardware import detect_cpu

    cpu = detect_cpu()
    try:
        system_info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    except Exception:  # noqa: BLE001 - descriptive only
        system_info = "unknown"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu.name or cpu.arch,
        "cpu_features": cpu.simd,
        "logical_cores": cpu.logical_cores or os.cpu_count(),
        "physical_cores": cpu.physical_cores or psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": system_info,
        "edgespec": edgespec.__version__,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_start": [round(x, 2) for x in load] if load else None,
    }


# --- the run ---------------------------------------------------------------------------------

@dataclass
class Settings:
    models: str
    repeats: int
    max_tokens: int
    per_category: int | None
    n_threads: int
    n_ctx: int
    flash_attn: bool
    out: Path
    command: str
    peers: bool = True   # llama-cpp-python's own plain and lookup decoding, in the same run
    only: tuple[str, ...] = ()  # --systems: run just these (names as in the tables), plain always included


def publish(module: str, argv: list[str] | None, summary: dict, out: Path | None, **more) -> dict:
    """A small bench's record: its command, the machine and its summary (printed), plus `more`
    (its runs: written with the rest to `out` as JSON)."""
    doc = {"command": f"python -m edgespec.bench.{module} " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": describe_machine(), "summary": summary, **more}
    print(json.dumps({"command": doc["command"], "summary": summary}, indent=1))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    return doc


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _run_record(setup: str, run: Run) -> dict:
    return {"setup": setup, "system": run.system, "prompt": run.prompt_id, "category": run.category,
            "repeat": run.repeat, "prompt_tokens": run.prompt_tokens, "generated": run.generated,
            "ttft_s": run.ttft_s, "decode_tok_s": run.decode_tok_s, "e2e_tok_s": run.e2e_tok_s,
            "drafted": run.drafted, "accepted": run.accepted, "rounds": run.rounds, "tokens": run.tokens,
            "marks": [[round(t - run.t0, 6), n] for t, n in run.marks], "self_reported": run.self_reported}


def _run_from_record(rec: dict) -> Run:
    return Run(rec["system"], rec["prompt"], rec["category"], rec["repeat"], rec["prompt_tokens"], rec["tokens"],
               0.0, [(t, n) for t, n in rec["marks"]], rec["drafted"], rec["accepted"], rec["rounds"],
               rec.get("self_reported", {}))


def read_finished_runs(path: Path, settings_key: dict) -> dict[tuple[str, str, str, int], Run]:
    """Runs an interrupted benchmark already recorded with the same settings (for --resume)."""
    done: dict[tuple[str, str, str, int], Run] = {}
    if not path.exists():
        return done
    lines = path.read_text().splitlines()
    if not lines or json.loads(lines[0]).get("settings") != settings_key:
        raise ValueError(f"{path} was written with other settings; run without --resume, or with the same options")
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the interruption
            continue
        done[(rec["setup"], rec["system"], rec["prompt"], rec["repeat"])] = _run_from_record(rec)
    return done


def run_setup(setup: Setup, prompts: list[Prompt], settings: Settings, progress, task, log=None,
              finished: dict | None = None) -> dict:
    from edgespec.engine import Engine
    from edgespec.models import store

    target_path = store.resolve(setup.target)
    draft_path = setup.draft_path()
    engine = Engine.load(target=target_path, draft=draft_path, n_ctx=settings.n_ctx,
                         n_threads=settings.n_threads, n_gpu_layers=0, flash_attn=settings.flash_attn)
    peers: list[PeerModel] = []
    try:
        systems: list[System] = [EdgespecSystem(engine, "ar", None)]
        if draft_path is not None:
            systems += [EdgespecSystem(engine, "draft", k) for k in DRAFT_KS]
        systems += [EdgespecSystem(engine, "lookup", k) for k in LOOKUP_KS]
        systems.append(EdgespecSystem(engine, "auto", None))  # the adaptive policy, its default k_max
        progress.update(task, description=f"{setup.name}: cost profile for auto mode")
        engine.cost_profile()  # measured once (or read from its disk cache) before anything is timed
        for lookup in (False, True) if settings.peers else ():
            peers.append(PeerModel(target_path, n_ctx=settings.n_ctx, n_threads=settings.n_threads,
                                   flash_attn=settings.flash_attn, eog=engine.target.vocab.eog, lookup=lookup))
        if peers:
            systems.append(LlamaCppPythonSystem(peers[0]))
            systems += [LlamaCppPythonSystem(peers[1], n) for n in PEER_LOOKUP_NS]
        if settings.only:
            systems = [s for s in systems if s.name in settings.only or s.name == PLAIN]
        weights = engine.target.memory().weights
        prompt_ids = {p.id: engine.prompt_tokens(list(p.messages)) for p in prompts}
        for p in prompts:
            if len(prompt_ids[p.id]) + settings.max_tokens > min(settings.n_ctx, PEER_LOOKUP_N_BATCH):
                raise RuntimeError(f"prompt {p.id} ({len(prompt_ids[p.id])} tokens) is too long for the peers")

        finished = finished or {}
        for system in systems:  # warm-up: one short generation each, not timed
            progress.update(task, description=f"{setup.name}: warm-up {system.name}")
            timed_run(system, prompt_ids[prompts[0].id], min(16, settings.max_tokens))
            progress.advance(task)

        runs: list[Run] = []
        for r in range(settings.repeats):
            for i, p in enumerate(prompts):
                # Rotate the order so no system always runs right after the same neighbour.
                shift = (r * len(prompts) + i) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    if (setup.name, system.name, p.id, r) in finished:  # --resume: measured before
                        runs.append(finished[(setup.name, system.name, p.id, r)])
                        progress.advance(task)
                        continue
                    progress.update(task, description=f"{setup.name}: {system.name} | {p.id} | repeat {r + 1}")
                    t0, marks, out = timed_run(system, prompt_ids[p.id], settings.max_tokens)
                    run = Run(system.name, p.id, p.category, r, len(prompt_ids[p.id]), out["tokens"], t0, marks,
                              out["drafted"], out["accepted"], out["rounds"], out["self_reported"])
                    runs.append(run)
                    if log is not None:
                        log.write(json.dumps(_run_record(setup.name, run)) + "\n")
                        log.flush()
                    progress.advance(task)
        return summarize_setup(setup, systems, prompts, prompt_ids, runs, weights, engine, draft_path)
    finally:
        for peer in peers:
            peer.close()
        engine.close()
        gc.collect()


def summarize_setup(setup: Setup, systems: list[System], prompts: list[Prompt], prompt_ids: dict, runs: list[Run],
                    weights: int, engine, draft_path) -> dict:
    by = {(run.system, run.prompt_id): [] for run in runs}
    for run in runs:
        by[(run.system, run.prompt_id)].append(run)
    reference = {p.id: by[(PLAIN, p.id)][0].tokens for p in prompts}

    def per_prompt(name: str, p: Prompt) -> dict:
        rs = by[(name, p.id)]
        idents = [run.tokens == reference[p.id] for run in rs]
        return {
            "category": p.category,
            "prompt_tokens": rs[0].prompt_tokens,
            "generated": [run.generated for run in rs],
            "decode_tok_s": [None if run.decode_tok_s is None else round(run.decode_tok_s, 3) for run in rs],
            "median_tok_s": _median([run.decode_tok_s for run in rs]),
            "median_ttft_s": _median([run.ttft_s for run in rs]),
            "median_e2e_tok_s": _median([run.e2e_tok_s for run in rs]),
            "acceptance_rate": _median([run.acceptance_rate for run in rs]),
            "mean_accepted_length": _median([run.mean_accepted_length for run in rs]),
            "drafted": [run.drafted for run in rs],
            "accepted": [run.accepted for run in rs],
            "rounds": [run.rounds for run in rs],
            "identical": idents,
            "first_divergence": [_first_divergence(run.tokens, reference[p.id]) for run in rs],
            "self_reported": [run.self_reported for run in rs],
        }

    table = {s.name: {p.id: per_prompt(s.name, p) for p in prompts} for s in systems}
    divergences = near_tie_check(engine, prompts, prompt_ids, reference, runs)
    categories = sorted({p.category for p in prompts}, key=["chat", "code", "grounded"].index)

    def ratio_to(name: str, base: str, ids: list[str]) -> float | None:
        if base not in table:  # --no-peers
            return None
        rs = [table[name][i]["median_tok_s"] / table[base][i]["median_tok_s"] for i in ids
              if table[name][i]["median_tok_s"] and table[base][i]["median_tok_s"]]
        return statistics.median(rs) if rs else None

    out_systems = {}
    for s in systems:
        rows = table[s.name]
        groups = {c: [p.id for p in prompts if p.category == c] for c in categories} | {"overall": [p.id for p in prompts]}
        summary = {}
        for g, ids in groups.items():
            tok_s = _median([rows[i]["median_tok_s"] for i in ids])
            idents = [x for i in ids for x in rows[i]["identical"]]
            summary[g] = {
                "median_tok_s": tok_s,
                "x_plain": ratio_to(s.name, PLAIN, ids),
                "x_llama_cpp_python": ratio_to(s.name, PEER_PLAIN, ids),
                "median_ttft_s": _median([rows[i]["median_ttft_s"] for i in ids]),
                "acceptance_rate": _median([rows[i]["acceptance_rate"] for i in ids]),
                "mean_accepted_length": _median([rows[i]["mean_accepted_length"] for i in ids]),
                "gb_s": tok_s * weights / 1e9 if tok_s else None,
                "identical_fraction": sum(idents) / len(idents) if idents else None,
            }
        out_systems[s.name] = {"family": s.family, "mode": s.mode, "k": s.k, "summary": summary,
                               "per_prompt": rows}
    return {
        "target": setup.target,
        "target_path": str(engine.target.path),
        "draft": str(draft_path) if draft_path else None,
        "draft_note": setup.draft_note,
        "weights_bytes": weights,
        "prompt_tokens": {pid: len(ids) for pid, ids in prompt_ids.items()},
        "reference_text": {p.id: _text(engine, reference[p.id]) for p in prompts},
        "systems": out_systems,
        "divergences": divergences,
    }


NEAR_TIE = 0.1  # logits: the size of the batch-vs-single-token differences llama.cpp's CPU kernels show


def near_tie_check(engine, prompts: list[Prompt], prompt_ids: dict, reference: dict, runs: list[Run]) -> list[dict]:
    """For every run whose greedy output left edgespec ar's: the target's logit gap there.

    The target re-runs plain decoding's own path (prefill the prompt but its last token, then one token
    at a time along the reference), so the row is the one that chose the reference token; the gap is
    logit(reference token) - logit(the run's token) >= 0. A gap near zero is a near-tie, where a batched
    verify pass may legitimately pick the other token; a large gap would be a bug.
    """
    import numpy as np

    divergent = []
    for run in runs:
        d = _first_divergence(run.tokens, reference[run.prompt_id])
        if d is not None:
            divergent.append((run, d))
    rows: dict[tuple[str, int], np.ndarray] = {}
    for pid in sorted({run.prompt_id for run, _ in divergent}):
        ref, ids = reference[pid], list(prompt_ids[pid])
        wanted = {d for run, d in divergent if run.prompt_id == pid and d < len(ref) and d < len(run.tokens)}
        if not wanted:
            continue
        seq = ids + ref
        engine.target.truncate(0)
        if len(ids) > 1:
            engine.target.decode(ids[:-1], 0)
        for j in range(max(wanted) + 1):  # the row fed seq[len(ids) - 1 + j] predicts ref[j]
            row = engine.target.decode([seq[len(ids) - 1 + j]], 1)[0]
            if j in wanted:
                rows[(pid, j)] = row
    engine.target.truncate(0)
    out = []
    for run, d in divergent:
        ref = reference[run.prompt_id]
        entry = {"system": run.system, "prompt": run.prompt_id, "repeat": run.repeat, "position": d,
                 "reference_token": ref[d] if d < len(ref) else None,
                 "run_token": run.tokens[d] if d < len(run.tokens) else None, "logit_gap": None}
        row = rows.get((run.prompt_id, d))
        if row is not None:
            top = np.sort(row)[::-1]
            entry["logit_gap"] = round(float(row[ref[d]] - row[run.tokens[d]]), 4)
            entry["top2_margin"] = round(float(top[0] - top[1]), 4)
        out.append(entry)
    return out


def _text(engine, tokens: list[int]) -> str:
    return b"".join(engine.target.token_bytes(t) for t in tokens).decode("utf-8", "replace")


# --- targets ---------------------------------------------------------------------------------

def evaluate_targets(models: dict) -> list[dict]:
    """The README's claims, each with its measured number and met / missed."""
    checks = []
    for name, m in models.items():
        s = m["systems"]

        def get(system, group, key):
            return s.get(system, {}).get("summary", {}).get(group, {}).get(key)

        def add(claim, value, threshold, detail):
            checks.append({"model": name, "claim": claim, "measured": value, "threshold": threshold,
                           "met": None if value is None else value >= threshold, "detail": detail})

        add("plain >= 0.97 x llama-cpp-python create_completion (overall)",
            get(PLAIN, "overall", "x_llama_cpp_python"), 0.97, PLAIN)
        lookups = [n for n in s if n.startswith("edgespec lookup")]
        peers = [n for n in s if n.startswith(PEER_PLAIN + " lookup")]
        if lookups and peers:
            best = max(lookups, key=lambda n: get(n, "grounded", "median_tok_s") or 0)
            best_peer = max(peers, key=lambda n: get(n, "grounded", "median_tok_s") or 0)
            ours, theirs = get(best, "grounded", "median_tok_s"), get(best_peer, "grounded", "median_tok_s")
            add("lookup >= 1.0 x llama-cpp-python prompt lookup (grounded, best k vs best N)",
                ours / theirs if ours and theirs else None, 1.0, f"{best} vs {best_peer}")
            default = "edgespec lookup k=4"
            peer_default = f"{PEER_PLAIN} lookup N=10"
            if default in s and peer_default in s:
                ours, theirs = get(default, "grounded", "median_tok_s"), get(peer_default, "grounded", "median_tok_s")
                add("lookup >= 1.0 x llama-cpp-python prompt lookup (grounded, defaults k=4 vs N=10)",
                    ours / theirs if ours and theirs else None, 1.0, f"{default} vs {peer_default}")
            add("lookup >= 1.3 x plain (grounded, best k)", get(best, "grounded", "x_plain"), 1.3, best)
        if AUTO in s:
            ratios = auto_vs_plain(s)
            worst = min(ratios, key=ratios.get) if ratios else None
            add("auto >= 0.97 x plain on every prompt (lowest per-prompt ratio of medians)",
                ratios[worst] if worst else None, 0.97, f"lowest on {worst}")
            fixed = [n for n in s if n.startswith(("edgespec draft", "edgespec lookup"))]
            best = max(fixed, key=lambda n: get(n, "overall", "median_tok_s") or 0) if fixed else None
            if best:
                add("auto median >= best fixed setting (mode x k in {1, 2, 4, 8}) - 5 %",
                    get(AUTO, "overall", "median_tok_s") / get(best, "overall", "median_tok_s"), 0.95,
                    f"best fixed: {best}")
        spec = [n for n in s if n.startswith("edgespec ") and n != PLAIN]
        idents = [x for n in spec for p in s[n]["per_prompt"].values() for x in p["identical"]]
        add("greedy identical fraction >= 0.9 (all edgespec speculative runs)",
            sum(idents) / len(idents) if idents else None, 0.9, f"{len(idents)} runs")
        divs = [d for d in m.get("divergences", []) if d["system"] != PLAIN and d["logit_gap"] is not None]
        if divs:
            add(f"every greedy divergence starts at a near-tie (target logit gap <= {NEAR_TIE})",
                sum(abs(d["logit_gap"]) <= NEAR_TIE for d in divs) / len(divs), 1.0,
                f"{len(divs)} divergent runs, max gap {max(abs(d['logit_gap']) for d in divs):.3f}")
    return checks


AUTO = "edgespec auto"


def auto_vs_plain(systems: dict) -> dict[str, float]:
    """Per prompt: auto's median decode tok/s over plain's."""
    auto, plain = systems[AUTO]["per_prompt"], systems[PLAIN]["per_prompt"]
    return {pid: auto[pid]["median_tok_s"] / plain[pid]["median_tok_s"] for pid in auto
            if auto[pid]["median_tok_s"] and plain[pid]["median_tok_s"]}


def auto_choices(systems: dict) -> dict[str, int]:
    """Rounds per "drafter:k" over every auto run (k is the length actually drafted, gating included)."""
    total: dict[str, int] = {}
    for p in systems.get(AUTO, {}).get("per_prompt", {}).values():
        for rep in p["self_reported"]:
            for key, n in (rep or {}).get("chosen", {}).items():
                total[key] = total.get(key, 0) + n
    return total


# --- output ----------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def render_markdown(doc: dict) -> str:
    m, st = doc["machine"], doc["settings"]
    lines = ["# edgespec benchmark", "", f"Command: `{st['command']}`", ""]
    if not doc.get("complete", True):
        lines += [f"**Partial results**: written after {', '.join(doc['models'])}; the run had more models to go.", ""]
    lines += [
             "## Machine", "",
             f"- CPU: {m['cpu']} ({m['physical_cores']} physical / {m['logical_cores']} logical cores; "
             f"features: {', '.join(m['cpu_features']) or 'n/a'})",
             f"- RAM: {m['ram_gib']} GiB; OS: {m['os']}; Python {m['python']}",
             f"- llama-cpp-python {m['llama_cpp_python']}; llama.cpp: `{m['llama_cpp_system_info']}`",
             f"- edgespec {m['edgespec']}; date {m['date']}; load average at start {m['load_average_start']}, "
             f"at end {m.get('load_average_end')}", "",
             "## Settings", "",
             f"- greedy (temperature 0), max tokens {st['max_tokens']}, repeats {st['repeats']} (medians), "
             f"n_threads {st['n_threads']} (batch threads too), n_ctx {st['n_ctx']}, flash attention "
             f"{'on' if st['flash_attn'] else 'off'} for every system, f16 KV, mmap, llama.cpp's default "
             "repacked CPU weights",
             f"- prompts: {st['n_prompts']} ({', '.join(f'{k} {v}' for k, v in st['per_category'].items())}), "
             "rendered once with edgespec's chat template; every system gets the same token ids",
             f"- llama-cpp-python lookup peers: n_batch {PEER_LOOKUP_N_BATCH}, logits_all False (its draft_model hook "
             "crashes once prompt + output exceed n_batch with logits_all False; a large n_batch avoids it without "
             "the n_ctx x n_vocab buffer of logits_all True); max_ngram_size 2 (its default)",
             *([f"- resumed: {st['resumed_runs']} runs were measured by an earlier, interrupted invocation with the "
                "same options (--resume); the rest by this one"] if st.get("resumed_runs") else []),
             f"- timing: {doc['definitions']['timing']}",
             f"- reuse: {doc['definitions']['reset']}",
             "- acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / verification passes "
             "(vLLM's definitions; for llama-cpp-python counted from its drafter's proposals and its eval calls)",
             "- identical = greedy output tokens equal to edgespec ar's on the same prompt (first repeat)", ""]
    for name, mod in doc["models"].items():
        cats = [c for c in ("chat", "code", "grounded") if c in st["per_category"]]
        lines += [f"## {mod['target']}", "",
                  f"Draft: {mod['draft_note'] if mod['draft'] else 'none'}. Target weights "
                  f"{mod['weights_bytes'] / 1e9:.3f} GB. Decode tok/s, medians:", "",
                  "| system | " + " | ".join(cats) + " | overall tok/s | x plain | x llama-cpp-python | "
                  "grounded x plain | ttft s | acceptance | mean acc. len | GB/s | identical |",
                  "|---|" + "---:|" * (len(cats) + 9)]
        for sname, sys_ in mod["systems"].items():
            sm = sys_["summary"]
            o = sm["overall"]
            lines.append("| " + " | ".join([
                sname, *(_f(sm[c]["median_tok_s"]) for c in cats), _f(o["median_tok_s"]),
                _f(o["x_plain"], "{:.2f}"), _f(o["x_llama_cpp_python"], "{:.2f}"),
                _f(sm.get("grounded", {}).get("x_plain"), "{:.2f}"), _f(o["median_ttft_s"], "{:.3f}"),
                _f(o["acceptance_rate"], "{:.2f}"), _f(o["mean_accepted_length"], "{:.2f}"),
                _f(o["gb_s"], "{:.1f}"), _f(o["identical_fraction"], "{:.2f}")]) + " |")
        lines.append("")
    lines += ["## Greedy divergences from edgespec ar", "",
              "Each run whose tokens left edgespec ar's output: where, and the target's logit gap between the "
              "reference token and the run's token there (the target re-run along plain decoding's own path). "
              "Gaps near 0 are near-ties where batched and single-token kernels legitimately disagree.", ""]
    for name, mod in doc["models"].items():
        divs = mod.get("divergences", [])
        gaps = [abs(d["logit_gap"]) for d in divs if d["logit_gap"] is not None]
        lines.append(f"- {mod['target']}: {len(divs)} divergent runs"
                     + (f"; logit gap at the divergence: median {statistics.median(gaps):.3f}, max {max(gaps):.3f}"
                        if gaps else ""))
        by_sys: dict[str, list[str]] = {}
        for d in divs:
            gap = "n/a" if d["logit_gap"] is None else f"{d['logit_gap']:.3f}"
            by_sys.setdefault(d["system"], []).append(f"{d['prompt']}@{d['position']} (gap {gap})")
        for sname, items in by_sys.items():
            lines.append(f"  - {sname}: " + ", ".join(sorted(set(items))))
    lines += ["", "## Figures vs targets", "", "| model | claim | measured | target | |", "|---|---|---:|---:|---|"]
    for c in doc["targets"]:
        verdict = "n/a" if c["met"] is None else ("met" if c["met"] else "missed")
        lines.append(f"| {c['model']} | {c['claim']} ({c['detail']}) | {_f(c['measured'], '{:.3f}')} | "
                     f"{c['threshold']} | {verdict} |")
    lines += ["", "## What auto chose", ""]
    for name, mod in doc["models"].items():
        choices = auto_choices(mod["systems"])
        if choices:
            total = sum(choices.values())
            lines.append(f"- {mod['target']}: " + ", ".join(
                f"{'plain' if k.endswith(':0') else k} {n / total:.0%}" for k, n in
                sorted(choices.items(), key=lambda kv: -kv[1])) + f" of {total} rounds")
        if AUTO in mod["systems"] and PLAIN in mod["systems"]:
            ratios = auto_vs_plain(mod["systems"])
            lines.append("  - auto / plain per prompt: " + ", ".join(f"{pid} {r:.2f}" for pid, r in sorted(ratios.items())))
    lines += ["", "Plot: `tok_s_vs_k.png` (tok/s against k for edgespec draft and lookup and llama-cpp-python's "
              "lookup N; plain decoding and auto as horizontal lines; the star is auto's most frequent choice).", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'edgespec[bench]'): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = doc["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row, (name, mod) in enumerate(models.items()):
        systems = mod["systems"]
        for col, group in enumerate(("overall", "grounded")):
            ax = axes[row][col]
            if not any(group in s["summary"] for s in systems.values()):
                ax.set_visible(False)
                continue

            def y(n):
                return systems[n]["summary"].get(group, {}).get("median_tok_s")

            for prefix, label, marker in (("edgespec draft", "edgespec draft model", "o"),
                                          ("edgespec lookup", "edgespec prompt lookup", "s"),
                                          (PEER_PLAIN + " lookup", "llama-cpp-python lookup (k = N)", "^")):
                pts = sorted((s["k"], y(n)) for n, s in systems.items() if n.startswith(prefix) and y(n))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
            for n, style, color, label in ((PLAIN, "-", "gray", "plain"), (PEER_PLAIN, "--", "black", "plain"),
                                           (AUTO, ":", "tab:red", "adaptive")):
                if n in systems and y(n):
                    ax.axhline(y(n), linestyle=style, color=color, label=f"{n} ({label}) {y(n):.1f}")
            choices = auto_choices(systems)
            if choices and y(AUTO):  # auto's most frequent choice, at its k and auto's measured speed
                key = max(choices, key=choices.get)
                drafter, k = key.split(":")
                share = choices[key] / sum(choices.values())
                ax.plot([int(k)], [y(AUTO)], marker="*", markersize=16, color="tab:red", linestyle="none",
                        label=f"auto's choice: {'plain' if k == '0' else drafter + ' k=' + k} ({share:.0%} of rounds)")
            ax.set_title(f"{mod['target']}: {group} prompts")
            ax.set_xlabel("k (tokens drafted per round)")
            ax.set_ylabel("decode tok/s (median)")
            ax.set_xticks(sorted({s["k"] for s in systems.values() if s["k"]}))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(doc: dict, out: Path) -> None:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    doc["machine"]["load_average_end"] = [round(x, 2) for x in load] if load else None
    doc["targets"] = evaluate_targets(doc["models"])
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(render_markdown(doc))
    plot(doc, out / "tok_s_vs_k.png")


# --- entry point -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", choices=("qwen", "smollm2", "all"), default="all")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per system and prompt [3; --quick: 1]")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per generation [128; --quick: 32]")
    p.add_argument("--per-category", type=int, default=None, help="prompts per category [all; --quick: 2]")
    p.add_argument("--prompts", default=None, help="comma-separated prompt ids to run instead (see prompts.json)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every system [2]")
    p.add_argument("--ctx", type=int, default=4096, help="context size for every system [4096]")
    p.add_argument("--flash-attn", action="store_true", help="flash attention on for every system [off]")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--resume", action="store_true",
                   help="keep the runs an interrupted benchmark left in OUT/runs.jsonl (same options) and do the rest")
    p.add_argument("--no-peers", action="store_true", help="leave out llama-cpp-python's own decoding (edgespec only)")
    p.add_argument("--systems", default="", help="comma list of systems to run, e.g. 'edgespec auto' (plain is always run)")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 2 prompts per category, 32 tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = Settings(
        models=args.models,
        repeats=args.repeats or (1 if args.quick else 3),
        max_tokens=args.max_tokens or (32 if args.quick else 128),
        per_category=args.per_category or (2 if args.quick else None),
        n_threads=args.threads, n_ctx=args.ctx, flash_attn=args.flash_attn, out=args.out, peers=not args.no_peers,
        only=tuple(x.strip() for x in args.systems.split(",") if x.strip()),
        command="python -m edgespec.bench.run " + " ".join(argv))
    if settings.repeats < 1 or settings.max_tokens < 2 or (settings.per_category is not None and settings.per_category < 1):
        print("error: need --repeats >= 1, --max-tokens >= 2 and --per-category >= 1", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(settings.per_category, args.prompts.split(",") if args.prompts else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = setups(settings.models)
    settings.out.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()

    def n_systems(s: Setup) -> int:
        if settings.only:
            return 1 + len(set(settings.only) - {PLAIN})
        peers = 1 + len(PEER_LOOKUP_NS) if settings.peers else 0
        return 1 + (len(DRAFT_KS) if s.draft else 0) + len(LOOKUP_KS) + 1 + peers

    total = sum(n_systems(s) * (1 + settings.repeats * len(prompts)) for s in chosen)
    per_category: dict[str, int] = {}
    for p in prompts:
        per_category[p.category] = per_category.get(p.category, 0) + 1
    doc = {
        "definitions": {"timing": TIMING, "reset": RESET},
        "machine": machine,
        "settings": {"command": settings.command, "models": settings.models, "repeats": settings.repeats,
                     "max_tokens": settings.max_tokens, "n_threads": settings.n_threads, "n_ctx": settings.n_ctx,
                     "flash_attn": settings.flash_attn, "n_prompts": len(prompts), "per_category": per_category,
                     "draft_ks": DRAFT_KS, "lookup_ks": LOOKUP_KS, "peer_lookup_ns": PEER_LOOKUP_NS,
                     "peer_lookup_n_batch": PEER_LOOKUP_N_BATCH},
        "complete": False,
        "models": {},
    }
    console = Console(stderr=True)
    runs_path = settings.out / "runs.jsonl"
    settings_key = {"models": settings.models, "repeats": settings.repeats, "max_tokens": settings.max_tokens,
                    "prompts": [p.id for p in prompts], "n_threads": settings.n_threads, "n_ctx": settings.n_ctx,
                    "flash_attn": settings.flash_attn, "peers": settings.peers,
                    "only": list(settings.only)}
    finished = {}
    if args.resume:
        try:
            finished = read_finished_runs(runs_path, settings_key)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        console.print(f"resuming: {len(finished)} runs already measured in {runs_path}")
        doc["settings"]["resumed_runs"] = len(finished)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress, runs_path.open("a" if finished else "w") as log:
        if not finished:
            log.write(json.dumps({"settings": settings_key}) + "\n")
        task = progress.add_task("loading", total=total)
        for setup in chosen:
            doc["models"][setup.name] = run_setup(setup, prompts, settings, progress, task, log, finished)
            doc["complete"] = setup is chosen[-1]
            write_outputs(doc, settings.out)  # after each model, so a long run leaves results as it goes
    models = doc["models"]
    console.print(f"wrote {settings.out / 'results.json'}, results.md, tok_s_vs_k.png")
    for name, mod in models.items():
        for sname, s in mod["systems"].items():
            o = s["summary"]["overall"]
            console.print(f"{name:8s} {sname:34s} {_f(o['median_tok_s']):>7s} tok/s  x plain {_f(o['x_plain'], '{:.2f}')}"
                          f"  x llama-cpp-python {_f(o['x_llama_cpp_python'], '{:.2f}')}"
                          f"  identical {_f(o['identical_fraction'], '{:.2f}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
