"""Structured output against llama-server: JSON extraction, tool choice and tool conversations (issue 22, item 5).

    python -m edgespec.bench.structured_bench [--models qwen,smollm2] [--repeats 3] [--threads N]
        [--cpp-spec draft:2,draft:4,ngram-simple:3:8] [--cpp-unconstrained] [--no-llama-server]
        [--cpp-max-tokens N] [--kinds extraction,tool_choice,multi_step] [--limit N] [--out bench/STRUCTURED_RESULTS.md]
    python -m edgespec.bench.structured_bench --smoke        # SmolLM2, one request per workload, < 1 min

The requests are data (`bench/structured_workloads.json`): JSON extraction against schema-heavy schemas
whose values are copied from the prompt (`response_format` json_schema, strict), tool choice among 3 to 8
tools (`tool_choice` required) and multi-step tool conversations (assistant `tool_calls` and `tool`
results in the history, the next call required).

Systems, every one driven through its OpenAI endpoint over HTTP (the fairest comparison: the same
request body, the same server-side chat template, tool rendering and grammar work on both sides):

* `edgespec ar`: `edgespec serve --mode ar`, the requests as they are (constrained plain decoding; the
  grammar's forced tokens still lead each round, which is how edgespec decodes under a constraint);
* `edgespec auto`: `edgespec serve --mode auto` (with the catalog draft where the model has one);
* `edgespec ar unconstrained`: the `ar` server, the same requests without `response_format` / `tools`
  (a tool request instead describes its tools in a system note, the words edgespec itself uses);
* `llama-server`: built from the llama.cpp that llama-cpp-python vendors (bench/llama_tools.py), `--jinja`,
  `json_schema` through `response_format`, tools through its chat template, plain decoding;
* `llama-server <spec>` for each `--cpp-spec`: `draft:N` (the draft model, `--spec-draft-n-max N`),
  `ngram-simple:N:M` (its prompt-lookup drafter, n-gram N, up to M drafted), `ngram-mod`, ...;
* `llama-server unconstrained` with `--cpp-unconstrained`: llama.cpp's own mask cost.

Every request is greedy (temperature 0, seed 0), and every server of a model runs at once; within a
repeat the systems take turns per request, in the opposite order on odd repeats. Each repeat starts
every server afresh, so what a server keeps between requests (edgespec's suffix history, prompt
caches) holds only the other requests of the same repeat, never the same request's earlier answer.
Speed is decode tokens/s as each server times itself, prefill excluded (edgespec: the response's
`edgespec.tokens_per_s`; llama-server: `timings.predicted_per_second`); per request the median over
repeats; a ratio is the geometric mean of per-request ratios with its 90 % bootstrap interval over the
requests (bench/stats_ci.py, as the race reports). An output is valid when it ended by itself (not at max_tokens) and is what the
request asked for: a JSON document valid against the schema (jsonschema), or tool calls naming the
request's tools with arguments valid against their parameters. The forced-token share is the part of
edgespec's output the grammar forced (its stats' `forced_accepted` over completion tokens).

Speed per token is not what a user waits for when the systems write different text: llama.cpp's JSON
grammar lets the model pretty-print (a newline and indentation before every key), so its answers run
longer. The time to a valid answer (the request's wall time, prefill included, median over the
repeats whose answer was valid) compares what an app gets, on the requests where both systems answered
validly. `--cpp-max-tokens N` lets llama-server's extraction answers run to N tokens so that its
pretty-printed JSON can finish (edgespec's end by themselves well inside the workload's cap). Wall
times of `edgespec ar` and `edgespec ar unconstrained` are not comparable with the rest: they share a
server, so whichever asks second finds the prompt in its prefix cache; auto and each llama-server
setting have a server of their own, and pay the prompt's prefill every time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from edgespec.bench.stats_ci import Interval, geomean_interval, verdict

WORKLOADS = Path(__file__).with_name("structured_workloads.json")
KINDS = ("extraction", "tool_choice", "multi_step")
AR, AUTO, AR_FREE, CPP, CPP_FREE = ("edgespec ar", "edgespec auto", "edgespec ar unconstrained", "llama-server",
                                    "llama-server unconstrained")
MODELS = {
    "qwen": {"label": "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, draft Qwen2.5-Coder-0.5B Q4_K_M",
             "target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b",
             "cpp_spec": "draft:2,draft:4,ngram-simple:3:8"},
    "smollm2": {"label": "SmolLM2-135M-Instruct Q4_1 (no catalog draft: auto drafts by lookup and suffix)",
                "target": "smollm2-135m", "draft": None, "cpp_spec": "ngram-simple:3:8,ngram-simple:2:4"},
}
GOALS = (  # (claim, numerator, denominator or a constant, workload or None for all, threshold)
    ("mask cost under 5 %: constrained plain >= 0.95x unconstrained plain", AR, AR_FREE, None, 0.95),
    ("constrained auto >= 1.5x constrained plain on schema-heavy extraction", AUTO, AR, "extraction", 1.5),
    ("constrained auto >= 1.3x llama-server's best setting on the same requests", AUTO, "llama-server best", None, 1.3),
    ("the same, in time to a valid answer (requests both answered validly)", AUTO, "llama-server best valid", None, 1.3),
    ("100 % of edgespec's constrained outputs valid against their schema", "valid", None, None, 1.0),
)
TIME_RATIO = "time to a valid answer: llama-server's best setting / constrained auto"


# --- requests --------------------------------------------------------------------------------------

@dataclass
class Request:
    kind: str
    id: str
    messages: list[dict]
    max_tokens: int
    schema: dict | None = None          # extraction: the schema the answer must match
    tools: list[dict] = field(default_factory=list)
    expected_tool: str | None = None

    def body(self, model: str, constrained: bool) -> dict:
        """The OpenAI chat request: constrained as the workload asks, or the same without the constraint."""
        body = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0.0,
                "seed": 0}
        if self.schema is not None:
            if constrained:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": self.id.replace("-", "_"), "schema": self.schema,
                                                           "strict": True}}
            return body
        if constrained:
            return {**body, "tools": self.tools, "tool_choice": "required", "parallel_tool_calls": False}
        from edgespec.tools import parse_tools, tool_note

        note = tool_note(parse_tools(self.tools), "required", parallel=False)  # as the constrained request asks
        return {**body, "messages": [{"role": "system", "content": note}, *self.messages]}


def load_requests(path: Path = WORKLOADS, limit: int | None = None, kinds: tuple[str, ...] = KINDS) -> list[Request]:
    """The workloads' requests of `kinds`, extraction first; `limit` keeps the first N of each kind."""
    data = json.loads(path.read_text())
    tools = data["tools"]
    out = []
    for item in data["extraction"][:limit]:
        schema_text = json.dumps(item["schema"])
        messages = [{"role": "system", "content": data["extraction_system"]},
                    {"role": "user", "content": f"Text:\n{item['text']}\n\nJSON schema:\n{schema_text}"}]
        out.append(Request("extraction", item["id"], messages, item["max_tokens"], schema=item["schema"]))
    for item in data["tool_choice"][:limit]:
        out.append(Request("tool_choice", item["id"], [{"role": "user", "content": item["user"]}], item["max_tokens"],
                           tools=[tools[t] for t in item["tools"]], expected_tool=item["expected"]))
    for item in data["multi_step"][:limit]:
        out.append(Request("multi_step", item["id"], item["messages"], item["max_tokens"],
                           tools=[tools[t] for t in item["tools"]], expected_tool=item["expected"]))
    return [r for r in out if r.kind in kinds]


# --- validity --------------------------------------------------------------------------------------

def check_output(request: Request, message: dict, finish_reason: str | None) -> dict:
    """{"valid", "truncated", "right_tool", "why"}: whether an answer is what the request asked for.

    Truncated (finish_reason "length") answers are never valid. An answer given as text is read the
    way an app would: the whole content as one JSON document (extraction), or tool calls in edgespec's
    object format or the model's native `<tool_call>` blocks (edgespec.tools.parse_tool_calls)."""
    import jsonschema

    from edgespec.tools import parse_tool_calls, parse_tools

    truncated = finish_reason == "length"
    out = {"valid": False, "truncated": truncated, "right_tool": None, "why": ""}
    content = message.get("content") or ""
    if request.schema is not None:
        try:
            jsonschema.validate(json.loads(content), request.schema)
        except json.JSONDecodeError as exc:
            out["why"] = f"not JSON: {exc}"
        except jsonschema.ValidationError as exc:
            out["why"] = f"schema: {exc.message}"
        else:
            out["valid"] = not truncated
        if truncated:
            out["why"] = "truncated at max_tokens"
        return out
    calls = message.get("tool_calls") or parse_tool_calls(content, parse_tools(request.tools)) or []
    by_name = {t["function"]["name"]: t["function"].get("parameters", {}) for t in request.tools}
    if truncated:
        out["why"] = "truncated at max_tokens"
    elif not calls:
        out["why"] = "no tool call"
    for call in calls:
        fn = call.get("function", {})
        if fn.get("name") not in by_name:
            out["why"] = f"unknown tool {fn.get('name')!r}"
            break
        try:
            arguments = fn.get("arguments")
            jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, by_name[fn["name"]])
        except (json.JSONDecodeError, TypeError) as exc:
            out["why"] = f"arguments not JSON: {exc}"
            break
        except jsonschema.ValidationError as exc:
            out["why"] = f"arguments: {exc.message}"
            break
    else:
        out["valid"] = bool(calls) and not truncated
    if calls:
        out["right_tool"] = calls[0].get("function", {}).get("name") == request.expected_tool
    return out


# --- systems -------------------------------------------------------------------------------------

@dataclass
class System:
    name: str
    server: str             # the key of the server process it talks to
    constrained: bool
    edgespec: bool


@dataclass
class Run:
    model: str
    system: str
    kind: str
    request: str
    repeat: int
    tok_s: float | None
    tokens: int = 0
    wall_s: float = 0.0
    finish_reason: str | None = None
    valid: bool = False
    truncated: bool = False
    right_tool: bool | None = None
    why: str = ""
    forced: int = 0
    forced_accepted: int = 0
    drafted: int = 0
    accepted: int = 0
    text: str = ""
    error: str | None = None


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """A --cpp-spec entry as (system name, llama-server flags); `{draft}` stands for the draft's path."""
    kind, *values = spec.split(":")
    if kind == "draft":
        n = values[0] if values else "3"
        return f"llama-server draft n={n}", ["--spec-type", "draft-simple", "-md", "{draft}", "--spec-draft-n-max", n]
    if kind == "ngram-simple":
        n, m = (values + ["12", "48"][len(values):])[:2]
        return (f"llama-server ngram-simple n={n} m={m}",
                ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", n, "--spec-ngram-simple-size-m", m])
    return f"llama-server {kind}", ["--spec-type", kind]


def plan_systems(model: dict, args) -> tuple[list[System], dict[str, list[str]]]:
    """The systems for one model and the server commands they need ("{port}" becomes a free port)."""
    from edgespec.models import store

    threads = str(args.threads)
    target = str(store.pull(model["target"], progress=True))
    edgespec = [sys.executable, "-m", "edgespec.cli", "serve", "--port", "{port}", "--ctx", str(args.ctx),
                "--threads", threads, "--target", target, "--model-name", model["target"]]
    servers = {"edgespec ar": edgespec + ["--mode", "ar"],
               "edgespec auto": edgespec + ["--mode", "auto"]
               + (["--draft", str(store.pull(model["draft"], progress=True))] if model["draft"] else [])}
    systems = [System(AR, "edgespec ar", True, True), System(AUTO, "edgespec auto", True, True),
               System(AR_FREE, "edgespec ar", False, True)]
    if not args.no_llama_server:
        from edgespec.bench.llama_tools import ensure_tools

        server_bin = str(ensure_tools(("llama-server",)) / "llama-server")
        base = [server_bin, "-m", target, "--host", "127.0.0.1", "--port", "{port}", "-c", str(args.ctx), "-np", "1",
                "-t", threads, "-tb", threads, "--jinja", "--no-webui"]
        servers[CPP] = base
        systems.append(System(CPP, CPP, True, False))
        if args.cpp_unconstrained:
            systems.append(System(CPP_FREE, CPP, False, False))
        for spec in (args.cpp_spec if args.cpp_spec is not None else model["cpp_spec"]).split(","):
            if not spec.strip():
                continue
            name, flags = parse_spec(spec.strip())
            if "{draft}" in flags:
                if not model["draft"]:
                    print(f"skipping {name}: {model['target']} has no draft model", file=sys.stderr)
                    continue
                flags = [str(store.pull(model["draft"], progress=True)) if f == "{draft}" else f for f in flags]
            servers[name] = base + flags
            systems.append(System(name, name, True, False))
    if args.systems:
        systems = [s for s in systems if s.name in args.systems]
        servers = {k: v for k, v in servers.items() if any(s.server == k for s in systems)}
    return systems, servers


def ask(url: str, system: System, request: Request, model: str, timeout: float) -> dict:
    """One request to one system: its answer, validity and speed as a Run's fields."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=request.body(model, system.constrained), timeout=timeout)
    except httpx.HTTPError as exc:
        return {"tok_s": None, "wall_s": time.perf_counter() - t0, "error": f"{type(exc).__name__}: {exc}"}
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        return {"tok_s": None, "wall_s": wall, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
    data = r.json()
    choice = data["choices"][0]
    message = choice["message"]
    checked = check_output(request, message, choice.get("finish_reason"))
    text = message.get("content") or json.dumps(message.get("tool_calls"))
    out = {"tokens": data.get("usage", {}).get("completion_tokens", 0), "wall_s": wall,
           "finish_reason": choice.get("finish_reason"), "text": text[:2000], **checked}
    if system.edgespec:
        stats = data.get("edgespec", {})
        out.update(tok_s=stats.get("tokens_per_s"), forced=stats.get("forced", 0),
                   forced_accepted=stats.get("forced_accepted", 0), drafted=stats.get("drafted", 0),
                   accepted=stats.get("accepted", 0))
    else:
        timings = data.get("timings", {})
        out.update(tok_s=timings.get("predicted_per_second"), drafted=timings.get("draft_n", 0),
                   accepted=timings.get("draft_n_accepted", 0))
    return out


def run_model(name: str, requests: list[Request], args, record: Path | None = None) -> list[Run]:
    """Every request on every system of one model, `args.repeats` times, servers fresh each repeat."""
    from edgespec.bench.serve_bench import running

    model = MODELS[name]
    systems, commands = plan_systems(model, args)
    logs = args.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        with ExitStack() as stack:
            urls = {}
            for key, cmd in commands.items():
                print(f"[{name} r{repeat}] starting {key}", file=sys.stderr, flush=True)
                urls[key] = stack.enter_context(running(cmd, logs / f"{name}-{key.replace(' ', '_')}-{repeat}.log"))
            warm_up = replace(min(requests, key=lambda r: len(json.dumps(r.messages))), max_tokens=8)
            for system in systems:  # not recorded: first-use work (the grammar's tokenizer, buffers)
                ask(urls[system.server], system, warm_up, model["target"], args.timeout)
            order = systems if repeat % 2 == 0 else systems[::-1]
            for request in requests:
                for system in order:
                    asked = request
                    if args.cpp_max_tokens and not system.edgespec and request.schema is not None:
                        asked = replace(request, max_tokens=max(request.max_tokens, args.cpp_max_tokens))
                    fields = ask(urls[system.server], system, asked, model["target"], args.timeout)
                    run = Run(model=name, system=system.name, kind=request.kind, request=request.id, repeat=repeat,
                              **fields)
                    runs.append(run)
                    if record is not None:
                        with record.open("a") as f:
                            f.write(json.dumps(asdict(run)) + "\n")
                    print(f"[{name} r{repeat}] {request.id:<22} {system.name:<34} "
                          f"{_f(run.tok_s)} tok/s, {run.tokens} tokens, "
                          f"{'valid' if run.valid else 'INVALID ' + (run.error or run.why)[:60]}",
                          file=sys.stderr, flush=True)
    return runs


# --- summary -------------------------------------------------------------------------------------

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def per_request(runs: list[Run], system: str, kind: str | None = None, metric: str = "tok_s") -> dict[str, float | None]:
    """request id -> median over repeats of decode tok/s (`metric` "tok_s"), or of the wall time of
    the valid answers (`metric` "valid_s"; None where no repeat answered validly)."""
    ids = sorted({r.request for r in runs if r.system == system and (kind is None or r.kind == kind)})
    mine = [r for r in runs if r.system == system]
    if metric == "valid_s":
        return {i: _median([r.wall_s for r in mine if r.request == i and r.valid]) for i in ids}
    return {i: _median([r.tok_s for r in mine if r.request == i]) for i in ids}


def ratio(runs: list[Run], numer: str, denom: str, kind: str | None, metric: str = "tok_s") -> dict:
    """The geometric mean of per-request speedups of numer over denom (tok/s numer / denom, or time
    denom / numer), its bootstrap interval over the requests (resampled within their workload), and how
    many requests it rests on."""
    by_kind = {}
    for k in ([kind] if kind else KINDS):
        a, b = per_request(runs, numer, k, metric), per_request(runs, denom, k, metric)
        values = [(a[i] / b[i] if metric == "tok_s" else b[i] / a[i]) for i in sorted(set(a) & set(b)) if a[i] and b[i]]
        if values:
            by_kind[k] = values
    if not by_kind:
        return {"ratio": None, "low": None, "high": None, "requests": 0}
    ci = geomean_interval(by_kind)
    return {"ratio": ci.value, "low": ci.low, "high": ci.high, "requests": ci.n}


def summarize_model(runs: list[Run]) -> dict:
    systems = list(dict.fromkeys(r.system for r in runs))
    kinds = [k for k in KINDS if any(r.kind == k for r in runs)]
    table = {}
    for s in systems:
        mine = [r for r in runs if r.system == s]
        row = {"all": _median(per_request(runs, s).values())}
        for k in kinds:
            row[k] = _median(per_request(runs, s, k).values())
        ran = [r for r in mine if r.error is None]
        tokens = sum(r.tokens for r in ran)
        tooly = [r for r in ran if r.kind != "extraction"]
        table[s] = {"tok_s": row, "runs": len(mine), "errors": len(mine) - len(ran),
                    "valid": sum(r.valid for r in ran), "truncated": sum(r.truncated for r in ran),
                    "valid_share": sum(r.valid for r in ran) / len(mine) if mine else None,
                    "right_tool_share": (sum(bool(r.right_tool) for r in tooly) / len(tooly)) if tooly else None,
                    "forced_share": (sum(r.forced_accepted for r in ran) / tokens) if tokens else None,
                    "acceptance": (sum(r.accepted for r in ran) / sum(r.drafted for r in ran))
                    if sum(r.drafted for r in ran) else None,
                    "invalid_examples": [f"{r.request}: {r.error or r.why}" for r in mine if not r.valid][:5]}
    cpp = [s for s in systems if s.startswith(CPP) and s != CPP_FREE]
    best, best_valid = {}, {}
    for k in [None, *kinds]:  # llama-server's best setting: the highest median tok/s, per workload
        scored = [(table[s]["tok_s"]["all" if k is None else k] or 0.0, s) for s in cpp]
        best[k or "all"] = max(scored)[1] if scored else None
        # and for the time to a valid answer: the most valid answers, then the least median time
        timed = [(-sum(v is not None for v in t.values()), _median(t.values()) or float("inf"), s)
                 for s in cpp for t in [per_request(runs, s, k, "valid_s")]]
        best_valid[k or "all"] = min(timed)[2] if timed else None
    ratios = {}
    pairs = [("mask cost (constrained plain / unconstrained plain)", AR, AR_FREE),
             ("constrained auto / constrained plain", AUTO, AR),
             ("constrained plain / llama-server plain", AR, CPP),
             ("llama-server mask cost (constrained / unconstrained)", CPP, CPP_FREE)]
    for label, numer, denom in pairs:
        if numer in systems and denom in systems:
            ratios[label] = {k or "all": ratio(runs, numer, denom, k) for k in [None, *kinds]}
    if AUTO in systems and cpp:
        ratios["constrained auto / llama-server's best setting"] = {
            k or "all": {**ratio(runs, AUTO, best[k or "all"], k), "best": best[k or "all"]} for k in [None, *kinds]}
        ratios[TIME_RATIO] = {k or "all": {**ratio(runs, AUTO, best_valid[k or "all"], k, "valid_s"),
                                           "best": best_valid[k or "all"]} for k in [None, *kinds]}
    return {"systems": table, "ratios": ratios, "llama_server_best": best, "kinds": kinds}


def goals(summary: dict) -> list[dict]:
    out = []
    for model, s in summary.items():
        for claim, numer, denom, kind, threshold in GOALS:
            if numer == "valid":
                mine = [v for k, v in s["systems"].items() if k in (AR, AUTO)]
                if not mine:
                    continue
                value = min(v["valid_share"] or 0.0 for v in mine)
                out.append({"model": model, "claim": claim, "value": value, "low": None, "high": None,
                            "threshold": threshold, "met": value >= threshold, "verdict": None})
                continue
            label = {AR_FREE: "mask cost (constrained plain / unconstrained plain)",
                     AR: "constrained auto / constrained plain",
                     "llama-server best": "constrained auto / llama-server's best setting",
                     "llama-server best valid": TIME_RATIO}[denom]
            r = s["ratios"].get(label, {}).get(kind or "all")
            if not r or r["ratio"] is None:
                continue
            ci = Interval(r["ratio"], r["low"], r["high"], 0.90, r["requests"])
            out.append({"model": model, "claim": claim, "value": r["ratio"], "low": r["low"], "high": r["high"],
                        "requests": r["requests"], "threshold": threshold, "met": r["ratio"] >= threshold,
                        "verdict": verdict(ci, threshold)})
    return out


# --- report --------------------------------------------------------------------------------------

def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f} %"


def render(doc: dict) -> str:
    m = doc["machine"]
    lines = ["# Structured output: edgespec against llama-server (issue 22, item 5)", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {m.get('cpu')}, {m.get('logical_cores')} logical cores, {m.get('ram_gib')} GiB, "
             f"{doc['threads']} threads; load average at start {m.get('load_average_start')}, at end "
             f"{doc['load_average_end']}; {doc['seconds']:.0f} s in all.", "",
             doc["method"], ""]
    for model, s in doc["summary"].items():
        kinds = s["kinds"]
        lines += [f"## {MODELS[model]['label']}", "",
                  "| system | tok/s all | " + " | ".join(f"tok/s {k}" for k in kinds)
                  + " | valid | truncated | right tool | forced share | acceptance |",
                  "|---|---:|" + "---:|" * len(kinds) + "---:|---:|---:|---:|---:|"]
        for name, row in s["systems"].items():
            lines.append(f"| {name} | {_f(row['tok_s']['all'])} | " + " | ".join(_f(row['tok_s'][k]) for k in kinds)
                         + f" | {row['valid']}/{row['runs']} ({_pct(row['valid_share'])}) | {row['truncated']} | "
                         f"{_pct(row['right_tool_share'])} | {_pct(row['forced_share'])} | {_pct(row['acceptance'])} |")
        lines += ["", "Ratios: geometric mean of per-request ratios [90 % bootstrap interval over requests]:", "",
                  "| ratio | all | " + " | ".join(kinds) + " |", "|---|" + "---:|" * (len(kinds) + 1)]
        for label, by_kind in s["ratios"].items():
            cells = []
            for k in ["all", *kinds]:
                r = by_kind.get(k, {})
                cell = "-" if r.get("ratio") is None else f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                cells.append(cell + (f" vs {r['best'].removeprefix('llama-server ')}" if r.get("best") else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        bad = {name: row["invalid_examples"] for name, row in s["systems"].items() if row["invalid_examples"]}
        if bad:
            lines += ["", "Invalid outputs (first few per system):", ""]
            lines += [f"- {name}: " + "; ".join(ex) for name, ex in bad.items()]
        lines.append("")
    lines += ["## Goals (issue 22, item 5)", "",
              "Met: the value reaches the goal; the interval says whether the data can tell (holds: all of it at or "
              "above the goal; loses: all of it below).", "",
              "| model | claim | value [90 % interval] | goal | met | interval |", "|---|---|---:|---:|---|---|"]
    for g in doc["goals"]:
        interval = f" [{g['low']:.2f}, {g['high']:.2f}], {g['requests']} requests" if g["low"] is not None else ""
        lines.append(f"| {g['model']} | {g['claim']} | {g['value']:.2f}{interval} | {g['threshold']} | "
                     f"{'yes' if g['met'] else '**no**'} | {g['verdict'] or '-'} |")
    return "\n".join(lines) + "\n"


METHOD = ("Decode tok/s as each server times itself, prefill excluded (edgespec: `edgespec.tokens_per_s` of the "
          "response; llama-server: `timings.predicted_per_second`), median over repeats per request, then the median "
          "over requests; ratios are geometric means of per-request ratios. Greedy (temperature 0, seed 0), every system through its OpenAI endpoint, servers "
          "started afresh each repeat, systems interleaved per request with the order reversed on odd repeats. "
          "Valid: ended by itself and matches the request's schema or tools (jsonschema). Forced share: completion "
          "tokens the grammar forced (edgespec stats `forced_accepted`). Acceptance: accepted / drafted tokens "
          "(llama-server: `timings.draft_n_accepted / draft_n`). 'llama-server's best setting' is, per workload, "
          "the llama-server system with the highest median tok/s there. Time to a valid answer: the request's wall "
          "time (prefill included), median over the repeats that answered validly; compared on the requests where "
          "both systems have a valid answer, against the llama-server setting with the most valid answers (then the "
          "least time).")


# --- command line --------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.structured_bench", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma list of qwen, smollm2 [default: qwen,smollm2; --smoke: smollm2]")
    p.add_argument("--repeats", type=int, default=None, help="[default: 3; --smoke: 1]")
    p.add_argument("--threads", type=int, default=None, help="threads for every server [default: physical cores]")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--limit", type=int, default=None, help="at most this many requests per workload [--smoke: 1]")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of workloads to run [default: {','.join(KINDS)}]")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens [--smoke: 48]")
    p.add_argument("--cpp-spec", default=None, help="llama-server speculative settings, comma list of draft:N, "
                   "ngram-simple:N:M, ngram-mod, ... [default per model: qwen draft:2,draft:4,ngram-simple:3:8; "
                   "smollm2 ngram-simple:3:8,ngram-simple:2:4]")
    p.add_argument("--cpp-unconstrained", action="store_true", help="also llama-server without the constraints")
    p.add_argument("--no-llama-server", action="store_true", help="edgespec's systems only")
    p.add_argument("--cpp-max-tokens", type=int, default=None, help="let llama-server's extraction answers run to N "
                   "tokens (its grammar pretty-prints JSON, which needs more than the workload's cap)")
    p.add_argument("--systems", default="", help="comma list of system names to run [default: all]")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--smoke", action="store_true", help="a quick check: SmolLM2, one request per workload, 1 repeat, "
                   "48 tokens, written to bench/out/structured-smoke.md")
    p.add_argument("--out", type=Path, default=None, help="the markdown report (a .json beside it) "
                   "[default: bench/STRUCTURED_RESULTS.md; --smoke: bench/out/structured-smoke.md]")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.models = args.models or ("smollm2" if smoke else "qwen,smollm2")
    args.repeats = args.repeats or (1 if smoke else 3)
    args.limit = args.limit or (1 if smoke else None)
    args.max_tokens = args.max_tokens or (48 if smoke else None)
    # The server logs and runs.jsonl (kept as the run goes): beside a report given with --out, named
    # after it (STRUCTURED_RESULTS_SMOLLM2.md: structured-runs-smollm2), so one report's runs never
    # overwrite another's; else in bench/out/ (ignored by git).
    name = args.out.stem.lower().replace("_", "-").removeprefix("structured-results").lstrip("-") if args.out else ""
    args.out_dir = (args.out.parent if args.out else Path("bench/out")) / ("structured-runs" + (f"-{name}" if name else ""))
    args.out = args.out or Path("bench/out/structured-smoke.md" if smoke else "bench/STRUCTURED_RESULTS.md")
    args.systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if args.threads is None:
        import psutil

        args.threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    for name in args.models.split(","):
        if name not in MODELS:
            p.error(f"unknown model {name!r}; use {', '.join(MODELS)}")
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    for kind in args.kinds:
        if kind not in KINDS:
            p.error(f"unknown workload {kind!r}; use {', '.join(KINDS)}")
    return args


def main(argv=None) -> int:
    from edgespec.bench.run import describe_machine

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.time()
    machine = describe_machine()
    requests = load_requests(limit=args.limit, kinds=args.kinds)
    if args.max_tokens:
        for r in requests:
            r.max_tokens = min(r.max_tokens, args.max_tokens)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = args.out_dir / "runs.jsonl"
    record.unlink(missing_ok=True)
    runs = []
    for name in args.models.split(","):
        runs += run_model(name, requests, args, record)
    summary = {name: summarize_model([r for r in runs if r.model == name]) for name in args.models.split(",")}
    doc = {"command": "python -m edgespec.bench.structured_bench " + shlex.join(argv), "machine": machine,
           "threads": args.threads, "method": METHOD, "seconds": time.time() - t0,
           "load_average_end": [round(x, 2) for x in os.getloadavg()], "summary": summary}
    doc["goals"] = goals(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**doc, "runs": [asdict(r) for r in runs]}, indent=1))
    args.out.write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
