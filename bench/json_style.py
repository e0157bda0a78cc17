"""What the JSON a schema constraint forces does to the answer: compact against spaced separators.

    python -m edgespec.bench.json_style [--models qwen,smollm2] [--repeats 3] [--threads 2] [--out FILE]

A json_schema constraint leaves the model no free whitespace (a small model given the freedom loops on
spaces and newlines), so the grammar decides the separators: `,` and `:` (compact) or `, ` and `: `
(spaced, as json.dumps and OpenAI's tool arguments write them). The workloads are the structured
bench's extraction requests (bench/structured_workloads.json), greedy, plain decoding (`ar`: no drafter,
so only the constraint differs). Per request:

* fidelity: the fields of each constrained answer against the model's own answer without a constraint
  (its first {...}, however it formats it), leaf by leaf; a leaf the free answer lacks or holds
  otherwise counts as a change. The free answer is not ground truth: what this measures is how much
  forcing a format moves what the model says, which a constraint should not do.
* valid: the answer parses and is valid against the schema (jsonschema).
* time to the answer: decode seconds (prefill excluded: each request's prompt is evaluated once
  before its runs, and every run reuses it), the median over repeats, the variants interleaved with
  the order reversed on odd repeats; ratio spaced / compact per request, geometric mean with a
  bootstrap 90 % interval over requests (bench/stats_ci.py).

Greedy plain decoding is deterministic here, so repeats change times, not text.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jsonschema

from edgespec.bench.stats_ci import geomean_interval, verdict
from edgespec.structured import JSON_OPTIONS

WORKLOADS = Path(__file__).with_name("structured_workloads.json")
MODELS = {"qwen": "qwen2.5-coder-1.5b", "smollm2": "smollm2-135m"}
STYLES = {"compact": {**JSON_OPTIONS, "item_separator": ",", "key_separator": ":"},
          "spaced": {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}}
MAX_TOKENS = 480  # the free answers of the Qwen 1.5B take 234-348 tokens


def first_object(text: str):
    """The first {...} of an answer that parses (the free answer may wrap it in a code fence), or None."""
    start = text.find("{")
    while start != -1:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def leaves(value, path: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{path}.{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{path}[{i}]").items()}
    return {path: value}


def changes(reference: dict, answer: dict) -> list[str]:
    """Leaves where the answer differs from the reference (either side missing counts)."""
    ref, got = leaves(reference), leaves(answer)
    return [k for k in sorted(set(ref) | set(got)) if ref.get(k, ...) != got.get(k, ...)]


def run_model(name: str, args) -> dict:
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.structured import Constraint

    data = json.loads(WORKLOADS.read_text())
    requests = []
    with Engine.load(MODELS[name], n_threads=args.threads) as engine:
        for item in data["extraction"]:
            messages = [{"role": "system", "content": data["extraction_system"]},
                        {"role": "user", "content": f"Text:\n{item['text']}\n\nJSON schema:\n{json.dumps(item['schema'])}"}]

            def generate(style: str | None):
                constraint = None if style is None else Constraint.json_schema(
                    {**item["schema"], "x-guidance": STYLES[style]})
                r = engine.generate(messages, GenerationConfig(temperature=0, mode="ar", max_tokens=MAX_TOKENS,
                                                               constraint=constraint))
                return r.text, r.stats

            generate(None)  # evaluates the prompt once: every run below reuses it
            free_text, _ = generate(None)
            reference = first_object(free_text)
            row = {"id": item["id"], "free": free_text, "styles": {}}
            order = list(STYLES)
            for repeat in range(args.repeats):
                for style in order if repeat % 2 == 0 else order[::-1]:
                    text, stats = generate(style)
                    entry = row["styles"].setdefault(style, {"text": text, "decode_s": [], "tokens": stats.generated,
                                                             "forced": stats.forced})
                    if text != entry["text"]:
                        raise RuntimeError(f"{name} {item['id']} {style}: greedy plain decoding gave two texts")
                    entry["decode_s"].append(stats.decode_s)
            for style, entry in row["styles"].items():
                answer = first_object(entry["text"])
                entry["valid"] = answer is not None and jsonschema.Draft202012Validator(item["schema"]).is_valid(answer)
                entry["changed"] = None if reference is None or answer is None else changes(reference, answer)
                entry["leaves"] = None if reference is None else len(set(leaves(reference)) | set(leaves(answer or {})))
                entry["median_s"] = statistics.median(entry["decode_s"])
            print(f"  {name} {item['id']}: " + ", ".join(
                f"{s} {e['median_s']:.2f} s changed {e['changed'] if e['changed'] is None else len(e['changed'])}"
                for s, e in row["styles"].items()), file=sys.stderr, flush=True)
            requests.append(row)
    ratios = [r["styles"]["spaced"]["median_s"] / r["styles"]["compact"]["median_s"] for r in requests]
    interval = geomean_interval(ratios)
    return {"model": MODELS[name], "requests": requests, "time_ratio": interval.to_dict(),
            "time_verdict": verdict(interval)}


def render(doc: dict) -> str:
    out = ["# JSON style under a schema constraint: compact against spaced separators", "",
           f"Command: `{doc['command']}`  ",
           f"Machine: {doc['machine']}; {doc['seconds']:.0f} s in all.", "",
           "Greedy, plain decoding (`ar`), the structured bench's 6 extraction requests. Changed: leaves of the "
           "constrained answer that differ from the model's own unconstrained answer. Time: decode seconds to "
           "the whole answer, median over repeats, variants interleaved with the order alternated.", ""]
    for m in doc["models"]:
        out += [f"## {m['model']}", "", "| request | compact changed | spaced changed | compact tokens (forced) | "
                "spaced tokens (forced) | compact s | spaced s | valid (compact / spaced) |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        totals = {s: [0, 0] for s in STYLES}
        for r in m["requests"]:
            c, s = r["styles"]["compact"], r["styles"]["spaced"]
            cells = []
            for style, e in (("compact", c), ("spaced", s)):
                if e["changed"] is None:
                    cells.append("-")
                else:
                    totals[style][0] += len(e["changed"])
                    totals[style][1] += e["leaves"]
                    cells.append(f"{len(e['changed'])}/{e['leaves']}")
            out.append(f"| {r['id']} | {cells[0]} | {cells[1]} | {c['tokens']} ({c['forced']}) | "
                       f"{s['tokens']} ({s['forced']}) | {c['median_s']:.2f} | {s['median_s']:.2f} | "
                       f"{'yes' if c['valid'] else 'no'} / {'yes' if s['valid'] else 'no'} |")
        ratio = m["time_ratio"]
        out += ["", f"Changed in all: compact {totals['compact'][0]}/{totals['compact'][1]}, spaced "
                f"{totals['spaced'][0]}/{totals['spaced'][1]}. Time to the answer, spaced / compact: "
                f"{ratio['value']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}] ({m['time_verdict']} against 1).", "",
                "What changed (the free answer's value -> the constrained one):", ""]
        for r in m["requests"]:
            reference = leaves(first_object(r["free"]) or {})
            for style, e in r["styles"].items():
                answer = leaves(first_object(e["text"]) or {})
                for k in (e["changed"] or [])[:6]:
                    out.append(f"- {r['id']} {style} `{k}`: {json.dumps(reference.get(k))} -> {json.dumps(answer.get(k))}")
        out.append("")
    return "\n".join(out)


def machine() -> str:
    from edgespec.bench.run import describe_machine

    m = describe_machine()
    return (f"{m['cpu']}, {m['physical_cores']} cores, {m['ram_gib']} GiB, {m['os']}, llama-cpp-python "
            f"{m['llama_cpp_python']}; load average at start {m['load_average_start']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.json_style", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen,smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/JSON_STYLE_RESULTS.md"))
    args = p.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown or args.repeats < 1:
        print(f"error: --models takes {', '.join(MODELS)}; --repeats >= 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    models = [run_model(n, args) for n in names]
    doc = {"command": "python -m edgespec.bench.json_style " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "seconds": time.perf_counter() - start, "models": models}
    report = render(doc)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
