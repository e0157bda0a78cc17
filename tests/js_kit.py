"""Helpers for the TypeScript kit's tests (kits/js): build it, write the fixture of Python expectations
the Node and browser tests compare against, run them, read back what they produced.

The Python side is the ONNX Runtime engine (runtimes/onnxrt.py) on the same bundle, run in the same
test session, so an expectation can never go stale.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

KIT = Path(__file__).resolve().parent.parent / "kits" / "js"


def need_node() -> str:
    node = shutil.which("node")
    assert node, "node (Node.js 20) is not on PATH; the kit's tests need it (scripts/install.sh --test checks for it)"
    return node


def build_kit() -> None:
    """tsc the kit (a few seconds), so the tests run the sources in this checkout."""
    need_node()
    assert (KIT / "node_modules" / "onnxruntime-node").is_dir(), (
        "kits/js/node_modules is missing: run `bash scripts/install.sh --test` (it runs `npm ci` in kits/js)")
    proc = subprocess.run(["npm", "run", "--silent", "build"], cwd=KIT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"tsc failed:\n{proc.stdout}\n{proc.stderr}"


def onnx_runtime(path, n_ctx: int):
    from edgespec.runtimes.onnxrt import OnnxOptions, OnnxRuntime

    return OnnxRuntime(path, OnnxOptions(n_ctx=n_ctx, n_threads=1))


def bundle_files(bundle: Path, quant: str, draft_quant: str) -> tuple[Path, Path | None]:
    manifest = json.loads((bundle / "edgespec.json").read_text())
    onnx = manifest["formats"]["onnx"]
    target = next(a["file"] for a in onnx["target"] if a["quant"] == quant)
    draft = next((a["file"] for a in onnx.get("draft", []) if a["quant"] == draft_quant), None)
    return bundle / target, (bundle / draft if draft else None)


def python_engine(bundle: Path, n_ctx: int, quant: str = "fp32", draft_quant: str = "fp32"):
    from edgespec.engine import Engine

    target, draft = bundle_files(bundle, quant, draft_quant)
    return Engine(onnx_runtime(target, n_ctx), onnx_runtime(draft, n_ctx) if draft else None)


def vocab_facts(engine) -> dict:
    v = engine.target.vocab
    return {"n_vocab": v.n_vocab, "bos": v.bos, "eos": v.eos, "add_bos": v.add_bos, "eog": sorted(v.eog)}


def token_bytes(engine) -> list[str]:
    return [engine.target.token_bytes(t).hex() for t in range(engine.target.vocab.n_vocab)]


def greedy_cases(name: str, engine, prompts: list[list[int]], modes: list[tuple[str, int]], max_tokens: int) -> list[dict]:
    """The Python engine's greedy tokens for each prompt and (mode, k), in the order the kit runs them
    (a shared prefix is reused on both sides, so both evaluate the same batches)."""
    from edgespec.engine import GenerationConfig

    cases = []
    for mode, k in modes:
        for i, ids in enumerate(prompts):
            cfg = GenerationConfig(max_tokens=max_tokens, temperature=0, mode=mode, draft_max=k)
            result = engine.generate_tokens(ids, cfg)
            cases.append({"name": f"{name} {mode} k={k} prompt {i}", "bundle": name, "mode": mode, "draft_max": k,
                          "max_tokens": max_tokens, "prompt": list(ids), "expected": result.tokens})
    return cases


def sampling_chain_cases(seed: int = 0) -> list[dict]:
    """Random logits rows through the Python sampling chain, for the kit to reproduce."""
    from edgespec.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(seed)
    settings = [dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
                dict(temperature=1.0, top_k=10, top_p=1.0, min_p=0.2), dict(temperature=0.9, top_k=40, top_p=0.95,
                                                                          min_p=0.05, repeat_penalty=1.3),
                dict(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.5)]
    cases = []
    for i, s in enumerate(settings):
        params = SamplingParams(**s)
        logits = (rng.standard_normal((3, 64)) * 3).astype(np.float32)
        context = rng.integers(0, 64, 20).astype(np.int32)
        continuation = rng.integers(0, 64, 2).astype(np.int32)
        rows = Sampler(params, 0).rows(logits, context, continuation)
        cases.append({"name": f"chain {i} {s}", "logits": logits.tolist(), "context": context.tolist(),
                      "continuation": continuation.tolist(), "expected": np.asarray(rows, dtype=np.float64).tolist(),
                      "params": {"temperature": params.temperature, "topK": params.top_k, "topP": params.top_p,
                                 "minP": params.min_p, "repeatPenalty": params.repeat_penalty,
                                 "repeatLastN": params.repeat_last_n}})
    return cases


def run_node_tests(fixture: dict, workdir: Path, files: list[str], timeout: int = 900) -> tuple[subprocess.CompletedProcess, dict]:
    """`node --test` on the kit's test files with this fixture; returns the process and what the tests recorded."""
    path = workdir / "fixture.json"
    path.write_text(json.dumps(fixture))
    out = workdir / "js-out"
    for old in glob.glob(f"{out}.*.json"):
        os.remove(old)
    env = {**os.environ, "EDGESPEC_JS_FIXTURE": str(path), "EDGESPEC_JS_OUT": str(out)}
    proc = subprocess.run([need_node(), "--test", "--test-reporter=spec", *files], cwd=KIT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    recorded: dict = {}
    for f in glob.glob(f"{out}.*.json"):
        recorded.update(json.loads(Path(f).read_text()))
    return proc, recorded
