"""The TypeScript kit (kits/js) against the Python engine, on the same bundles in the same run.

Node (onnxruntime-node, CPU): tokenizer ids, every token's bytes, chat prompts, the sampling chain, and
greedy tokens for plain decoding, prompt lookup and the draft model must equal the Python ONNX runtime's
exactly, on a tiny exported bundle and on SmolLM2-135M exported by `edgespec export`; sampled output
passes the chi-square check of the Python tests (and the same check rejects a verifier that trusts the
draft); bad bundles reject with one clear error. The web entry point runs in headless Chromium
(Debian's package, WebAssembly backend) on pages served from loopback, and must give the same greedy
tokens, or differ first at a near-tie (WebAssembly kernels round differently from the native ones).

Time on the 2-core build machine (load about 4): 3 minutes for the file, of which the SmolLM2 test
(`slow`) is 1.9 minutes including its HF conversion and `edgespec export`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.bench.js_bench import run_in_chromium
from edgespec.engine import GenerationConfig
from js_kit import (KIT, build_kit, greedy_cases, python_engine, run_node_tests, sampling_chain_cases,
                    token_bytes, vocab_facts)
from lossless import NEAR_TIE_GAP, compare_greedy
from test_lossless_sampling import chi_square_pvalue, exact_joint  # the same sampling settings

TINY_CTX = 256
SMOL_CTX = 1024
N_SAMPLES = 1500
ALPHA = 0.001
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
SMOL_PROMPTS = [
    "Rewrite this function with a list comprehension:\n\ndef squares(n):\n    out = []\n    for i in range(n):\n"
    "        out.append(i * i)\n    return out",
    "What is the capital of France? Answer in one sentence.",
    "Fix the spelling in this sentence and repeat it: The quick brown fox jumsp over the lazy dgo.",
]


@pytest.fixture(scope="module")
def kit():
    build_kit()
    return KIT


@pytest.fixture(scope="module")
def tiny_bundle(hf_tiny, tmp_path_factory) -> Path:
    from edgespec.exporters.bundle import ExportOptions, export_bundle

    return export_bundle(hf_tiny["llama"], tmp_path_factory.mktemp("jsbundle") / "tiny", hf_tiny["llama_draft"],
                         ExportOptions(formats=("onnx",), onnx_quants=("fp32",), measure=False, n_threads=1))


@pytest.fixture(scope="module")
def smol_bundle(smollm2_hf, tmp_path_factory) -> Path:
    """SmolLM2-135M through the CLI: fp32 target, its int4 copy as the draft (--self-draft quant)."""
    out = tmp_path_factory.mktemp("jssmol") / "smollm2"
    proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "export", str(smollm2_hf), "--format", "onnx",
                           "--quant", "onnx:fp32,onnx:int4", "--self-draft", "quant", "--no-measure", "--threads", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def tiny_prompts(engine, count=6, length=12) -> list[list[int]]:
    from hf_models import corpus_texts

    ids = engine.target.tokenize("\n\n".join(corpus_texts()[:4]), add_special=False, parse_special=True)
    step = (len(ids) - length) // count
    return [ids[i * step:i * step + length] for i in range(count)]


def tokenizer_cases(name, engine, texts) -> list[dict]:
    return [{"bundle": name, "text": t, "add_special": a,
             "ids": engine.target.tokenize(t, add_special=a, parse_special=True)} for t in texts for a in (True, False)]


def base_fixture(name, bundle, engine, n_ctx, texts, quant="fp32", draft_quant="fp32") -> dict:
    return {
        "bundles": {name: {"path": str(bundle), "n_ctx": n_ctx, "quant": quant, "draft_quant": draft_quant}},
        "tokenize": tokenizer_cases(name, engine, texts),
        "token_bytes": {name: token_bytes(engine)},
        "vocab": {name: vocab_facts(engine)},
        "chat": [{"bundle": name, "messages": CHAT, "ids": engine.prompt_tokens(CHAT)}],
        "stream": {"bundle": name, "messages": CHAT},
        "distributions": sampling_chain_cases(),
        "sampling": [],
    }


def check_node_run(proc, recorded, fixture):
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, f"node --test failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    for case in fixture["greedy"]:  # every case ran and was compared (a vanished test cannot pass)
        assert case["name"] in proc.stdout, f"node did not report {case['name']!r}"
        assert recorded[case["name"]]["tokens"] == case["expected"], case["name"]
    for mode in {c["mode"] for c in fixture["greedy"]} - {"ar"}:
        drafted = sum(recorded[c["name"]]["stats"]["drafted"] for c in fixture["greedy"] if c["mode"] == mode)
        accepted = sum(recorded[c["name"]]["stats"]["accepted"] for c in fixture["greedy"] if c["mode"] == mode)
        print(f"{mode}: kit accepted {accepted}/{drafted}")
        assert drafted > 0, f"{mode} never drafted"


def tokenizer_dirs(hf_tiny, texts) -> list[dict]:
    """The other tokenizer families of the tiny checkpoints (Llama 3 regex and BOS, Qwen2 regex with NFC
    and a padded vocabulary, SmolLM's digit splitting), as the Python vocabulary answers for them."""
    from edgespec.runtimes.hf_vocab import HFVocab, read_json

    out = []
    for name in ("llama3", "qwen2", "smollm"):
        directory = hf_tiny[name]
        n_vocab = int(read_json(directory / "config.json")["vocab_size"])
        v = HFVocab(directory, n_vocab)
        out.append({"name": name, "dir": str(directory), "n_vocab": n_vocab,
                    "vocab": {"n_vocab": n_vocab, "bos": v.info.bos, "eos": v.info.eos, "add_bos": v.info.add_bos,
                              "eog": sorted(v.info.eog)},
                    "cases": [{"text": t, "add_special": a, "ids": v.tokenize(t, add_special=a, parse_special=True)}
                              for t in texts for a in (True, False)],
                    "token_bytes": [v.token_bytes(i).hex() for i in range(n_vocab)]})
    return out


def test_kit_on_node_matches_python_on_the_tiny_bundle(kit, tiny_bundle, hf_tiny, tmp_path):
    from hf_models import corpus_texts

    with python_engine(tiny_bundle, TINY_CTX) as engine:
        fixture = base_fixture("tiny", tiny_bundle, engine, TINY_CTX,
                               corpus_texts()[:3] + ["<|im_start|>user\nhi<|im_end|>\n", "a <|endoftext|> b 123  x"])
        fixture["tokenizer_dirs"] = tokenizer_dirs(hf_tiny, corpus_texts()[:4] + [
            "Héllo wörld! 12345 6789 ⚡ 東京 \t\n  spaces   x", "<|im_start|>user\nhi<|im_end|>\n", "I'm we'LL 1,000.5"])
        prompts = tiny_prompts(engine) + [tiny_prompts(engine, count=1, length=150)[0]]  # the last: 3 prefill chunks
        fixture["greedy"] = greedy_cases("tiny", engine, prompts, [("ar", 0), ("lookup", 3), ("draft", 3)], 24)
        fixture["stats_keys"] = sorted(engine.generate_tokens(prompts[0], GenerationConfig(max_tokens=2)).stats.to_dict())
        # Sampling: a prompt with repeats, so prompt lookup drafts too; 2 tokens, top-k 4: 16 outcomes.
        prompt = prompts[0][:6] * 2
        joint = exact_joint(engine.target, prompt, 2)
        base = {"maxTokens": 2, "temperature": 1.0, "topK": 4, "topP": 1.0, "minP": 0.0, "draftMax": 2}
        fixture["sampling"] = [
            {"name": f"sampling {mode}{' wrong' if wrong else ''}", "bundle": "tiny", "prompt": prompt, "n": N_SAMPLES,
             "wrong": wrong, "config": {**base, "mode": mode}}
            for mode, wrong in (("ar", False), ("draft", False), ("lookup", False), ("draft", True))]
    proc, recorded = run_node_tests(fixture, tmp_path, ["test/parity.test.mjs", "test/bad-bundles.test.mjs"])
    check_node_run(proc, recorded, fixture)
    assert len(joint) == 16 and abs(sum(joint.values()) - 1) < 1e-9
    for case in fixture["sampling"]:
        samples = [tuple(s) for s in recorded[case["name"]]["samples"]]
        p = chi_square_pvalue(samples, joint)
        print(f"{case['name']}: chi-square p = {p:.4g} over {len(samples)} samples, "
              f"drafted {recorded[case['name']]['drafted']}")
        if case["wrong"]:
            assert p < ALPHA, "the check must reject a verifier that trusts the draft"
        else:
            assert p > ALPHA
    assert "a draft whose vocabulary differs from the target's" in proc.stdout


@pytest.mark.slow
def test_kit_on_node_matches_python_on_smollm2(kit, smol_bundle, tmp_path):
    with python_engine(smol_bundle, SMOL_CTX, "fp32", "int4") as engine:
        assert engine.draft_runtime is not None
        texts = SMOL_PROMPTS + ["Héllo wörld! 12345 ⚡ 東京 \t\n  spaces", "<|im_start|>user\nhi<|im_end|>\n"]
        fixture = base_fixture("smollm2", smol_bundle, engine, SMOL_CTX, texts, "fp32", "int4")
        prompts = [engine.prompt_tokens(p) for p in SMOL_PROMPTS]
        fixture["chat"] += [{"bundle": "smollm2", "messages": [{"role": "user", "content": p}], "ids": ids}
                            for p, ids in zip(SMOL_PROMPTS, prompts)]
        fixture["greedy"] = greedy_cases("smollm2", engine, prompts, [("ar", 0), ("lookup", 4), ("draft", 4)], 32)
        fixture["stats_keys"] = sorted(engine.generate_tokens(prompts[0], GenerationConfig(max_tokens=2)).stats.to_dict())
    proc, recorded = run_node_tests(fixture, tmp_path, ["test/parity.test.mjs"])
    check_node_run(proc, recorded, fixture)


# --- the web entry point in headless Chromium --------------------------------------------------------

def check_web(results: dict, fixture: dict, runtimes: dict) -> None:
    assert results["backend"] == "wasm"
    identical = 0
    for case in fixture["greedy"]:
        got = results["cases"][case["name"]]
        assert "error" not in got, f"{case['name']}: {got.get('error')}"
        cmp = compare_greedy(runtimes[case["bundle"]], case["prompt"], case["expected"], got["tokens"])
        identical += cmp.identical
        assert cmp.near_tie, (f"{case['name']}: the browser diverges at token {cmp.first_divergence} with logit gap "
                              f"{cmp.gap:.3f} > {NEAR_TIE_GAP}")
    print(f"web (WebAssembly) greedy: identical {identical}/{len(fixture['greedy'])}; tok/s "
          f"{results.get('tokens_per_s')}")
    assert identical >= 0.8 * len(fixture["greedy"])
    for check in results["checks"]:
        assert check["ok"], check


def test_web_entry_point_in_headless_chromium(kit, tiny_bundle, tmp_path):
    with python_engine(tiny_bundle, TINY_CTX) as engine:
        prompts = tiny_prompts(engine, count=4)
        fixture = {"bundles": {"tiny": {"url": "../../../tiny/", "n_ctx": TINY_CTX, "quant": "fp32", "draft_quant": "fp32"}},
                   "greedy": greedy_cases("tiny", engine, prompts, [("ar", 0), ("lookup", 3), ("draft", 3)], 24),
                   "chat": [{"bundle": "tiny", "messages": CHAT, "ids": engine.prompt_tokens(CHAT)}]}
        results = run_in_chromium({"tiny": tiny_bundle}, fixture, tmp_path, kit=kit)
        check_web(results, fixture, {"tiny": engine.target})


def test_node_cli_example(kit, tiny_bundle, tmp_path):
    """examples/node-cli.mjs: the Python engine's text for a chat prompt; bad input is one line, status 2."""
    with python_engine(tiny_bundle, TINY_CTX) as engine:
        expected = engine.generate("Hello there", GenerationConfig(max_tokens=10, temperature=0, mode="lookup"))
    cli = ["node", "examples/node-cli.mjs"]
    proc = subprocess.run([*cli, str(tiny_bundle), "Hello there", "--max-tokens", "10", "--temperature", "0",
                           "--mode", "lookup", "--threads", "1", "--json"], cwd=kit, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == expected.tokens and out["text"] == expected.text
    assert out["stats"]["mode"] == "lookup" and set(out["stats"]) == set(expected.stats.to_dict())
    streamed = subprocess.run([*cli, str(tiny_bundle), "Hello there", "--max-tokens", "10", "--temperature", "0"],
                              cwd=kit, capture_output=True, text=True, timeout=120)
    assert streamed.returncode == 0 and streamed.stdout == expected.text + "\n"
    assert streamed.stderr.startswith(f"{len(expected.tokens)} tokens in ")
    bad = subprocess.run([*cli, str(tmp_path / "nope"), "Hello"], cwd=kit, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and "not an edgespec bundle" in bad.stderr


def test_web_example_page_streams_into_the_text_area(kit, tiny_bundle, tmp_path):
    """examples/web: the page loads the bundle, streams a generation into its text area in several pieces,
    and shows the Python engine's text for its default prompt and settings (lookup, 64 tokens, greedy)."""
    with python_engine(tiny_bundle, 512) as engine:
        expected = engine.generate("Write a haiku about caches.", GenerationConfig(max_tokens=64, temperature=0,
                                                                                    mode="lookup"))
    results = run_in_chromium({"tiny": tiny_bundle}, {}, tmp_path, kit=kit,
                              page="examples/web/index.html?bundle=../../../tiny/")
    assert results["output"] == expected.text
    assert results["pieces"] > 1, "the text arrived in one piece, not streamed"
    assert results["stats"].startswith(f"{len(expected.tokens)} tokens in ") and "mode lookup" in results["stats"]
