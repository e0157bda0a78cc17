"""Recommended pairs (models/pairs.json), their expected memory, and `--draft auto`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from edgespec.errors import EdgespecError
from edgespec.machine.memory import MiB, model_facts
from edgespec.models import hub, pairs
from tiny_models import write_tiny_llama

# bench/MEMORY_RESULTS.md, row "qwen2.5-coder-1.5b | qwen2.5-coder-0.5b | 4096 | f16 | read | 512 | 4": the
# measured peak RSS of the catalog pair (VmHWM of a fresh process) on the build machine.
MEASURED_QWEN_PAIR_MIB = 1949.8


def test_the_catalog_is_consistent():
    families = {p.family for p in pairs.pairs()}
    assert {"qwen2.5", "qwen2.5-coder", "qwen3", "llama-3", "gemma-3", "smollm2", "phi-3"} <= families
    for p in pairs.pairs():
        for m in (p.target, p.draft):
            ref = hub.parse(m.hub)  # a valid hf: name with a quant
            assert ref.quant and ref.repo.endswith("-GGUF"), m.hub
            # head size given explicitly, not width / heads: Qwen3, Gemma 3, Qwen3.5, Gemma 4 (and its assistant)
            assert m.n_embd == m.n_head * m.head_dim or m.arch in ("qwen3", "gemma3", "qwen35", "gemma4",
                                                                   "gemma4-assistant"), m.name
        assert p.draft.file_bytes < p.target.file_bytes * pairs.MAX_DRAFT_SHARE, p.name
        # llama.cpp's rule (common/speculative.cpp): vocabulary sizes at most 128 apart
        assert abs(p.target.n_vocab - p.draft.n_vocab) <= 128, p.name
        assert p.expected_bytes() > p.target.file_bytes + p.draft.file_bytes  # KV, buffers, process on top


def test_facts_from_architecture_numbers_predict_like_the_real_file(smollm2_path):
    """The pair catalog predicts from architecture numbers; on a real file it must agree with the
    planner's prediction from that file's tensor table."""
    real = model_facts(smollm2_path)
    model = dataclasses.replace(pairs._load()[1]["smollm2-135m-instruct"], file_bytes=smollm2_path.stat().st_size)
    assert (real.n_layer, real.n_embd, real.n_ff, real.n_head, real.n_head_kv, real.n_vocab) == (
        model.n_layer, model.n_embd, model.n_ff, model.n_head, model.n_head_kv, model.n_vocab)
    ours = pairs.predict_facts(pairs.model_facts(model), None).peak_bytes
    theirs = pairs.predict_facts(real, None).peak_bytes
    assert abs(ours - theirs) / theirs < 0.02, (ours / MiB, theirs / MiB)


def test_expected_memory_of_the_catalog_pair_matches_its_measured_peak():
    [pair] = [p for p in pairs.pairs() if p.target.catalog == "qwen2.5-coder-1.5b"]
    assert pair.draft.catalog == "qwen2.5-coder-0.5b" and pair.vocab_checked
    predicted = pair.expected_bytes() / MiB
    assert abs(predicted - MEASURED_QWEN_PAIR_MIB) / MEASURED_QWEN_PAIR_MIB < 0.05, predicted


def test_largest_fitting_grows_with_the_budget():
    last = 0
    for gib in (0.5, 1, 2, 4, 8, 16, 32):
        pair = pairs.largest_fitting(int(gib * 2**30))
        size = pair.expected_bytes() if pair else 0
        assert size <= gib * 2**30 and size >= last
        last = size
    assert pairs.largest_fitting(100 * MiB) is None


@pytest.mark.parametrize("target, draft", [
    ("ollama:qwen2.5-coder:7b", "qwen2.5-coder-0.5b-instruct"),
    ("hf:bartowski/google_gemma-3-12b-it-GGUF:Q4_K_M", "gemma-3-1b-it"),
    ("/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "llama-3.2-1b-instruct"),
    ("lmstudio:lmstudio-community/Qwen3-8B-GGUF", "qwen3-0.6b"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b-instruct-awq"),
    ("hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0", None),  # the draft itself: nothing smaller to suggest
    ("smollm2-135m", None),
    ("ollama:qwen2.5:14b", "qwen2.5-0.5b-instruct"),
])
def test_recommended_draft_for_a_target_name(target, draft):
    pair = pairs.recommended_for(target)
    assert (pair.draft.name if pair else None) == draft


# --- --draft auto -----------------------------------------------------------------------------------

@pytest.fixture()
def lmstudio(tmp_path, monkeypatch):
    """An LM Studio folder with candidate drafts for a tiny target (n_embd 64, 2 layers): the smallest has
    another vocabulary (one token's text differs), then a fitting one, then one too large to be a draft."""
    lms = tmp_path / "lms"
    target = write_tiny_llama(tmp_path / "target" / "Tiny-Target-F32.gguf", seed=0)
    write_tiny_llama(lms / "x" / "Odd-GGUF" / "odd-F32.gguf", seed=5, n_embd=16, n_ff=32, n_layer=1, n_head=2,
                     n_head_kv=1, rename_tokens={100: "zzz"})
    write_tiny_llama(lms / "x" / "Good-GGUF" / "good-F32.gguf", seed=1, n_embd=32, n_ff=64, n_layer=1)
    write_tiny_llama(lms / "x" / "Big-GGUF" / "big-F32.gguf", seed=2, n_embd=96, n_ff=192)
    monkeypatch.setenv("EDGESPEC_LMSTUDIO_MODELS", str(lms))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "edgespec"))
    return {"target": target, "lms": lms, "tmp": tmp_path}


def test_auto_draft_is_decided_by_the_vocabulary(lmstudio):
    name, path = pairs.auto_draft(str(lmstudio["target"]))
    assert name == "lmstudio:x/Good-GGUF:F32" and path.name == "good-F32.gguf"


def test_auto_draft_without_a_candidate_names_the_recommended_draft(lmstudio, tmp_path):
    (lmstudio["lms"] / "x" / "Good-GGUF" / "good-F32.gguf").unlink()
    with pytest.raises(EdgespecError, match="found no draft .*1 smaller installed model checked, none shares"):
        pairs.auto_draft(str(lmstudio["target"]))
    # A target whose name says its family: the message names the draft to pull.
    named = tmp_path / "Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf"
    named.write_bytes(lmstudio["target"].read_bytes())
    with pytest.raises(EdgespecError, match=r"recommended draft is hf:Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q8_0: "
                       r"run `edgespec models pull hf:Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q8_0`"):
        pairs.auto_draft(str(named))


def test_generate_with_draft_auto_says_which(lmstudio):
    env = {**os.environ, **{k: os.environ[k] for k in ("EDGESPEC_LMSTUDIO_MODELS", "OLLAMA_MODELS", "HF_HUB_CACHE",
                                                       "EDGESPEC_HOME")}}
    args = [sys.executable, "-m", "edgespec.cli", "generate", "hello", "--target", str(lmstudio["target"]),
            "--draft", "auto", "--mode", "draft", "--raw", "--temperature", "0", "--max-tokens", "8", "--ctx", "256",
            "--json"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "draft auto: lmstudio:x/Good-GGUF:F32" in done.stderr
    assert json.loads(done.stdout)["stats"]["drafted"] > 0
    (lmstudio["lms"] / "x" / "Good-GGUF" / "good-F32.gguf").unlink()
    failed = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 2 and failed.stderr.strip().startswith("error: --draft auto found no draft")
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr


def test_the_2026_families_are_listed_with_hub_sources_and_planner_memory():
    """Qwen3.5 (with its MTP head), LFM2 and Gemma 4 with its assistant (issue 26). They cannot be
    downloaded here: this checks the entries' structure, not the files."""
    by_family = {p.family: p for p in pairs.pairs()}
    assert {"qwen3.5", "lfm2", "gemma-4"} <= set(by_family)
    for family in ("qwen3.5", "lfm2", "gemma-4"):
        p = by_family[family]
        for m in (p.target, p.draft):
            assert hub.parse(m.hub).quant and m.sources, m.name
            assert set(m.unverified) <= {f.name for f in dataclasses.fields(m)}, m.name
        assert 0 < p.expected_bytes() < 8 * 2**30  # small sizes: a laptop's memory
    assert by_family["qwen3.5"].target.mtp_heads == 1  # the hub file keeps the NextN head (--mode mtp)
    gemma = by_family["gemma-4"]
    assert gemma.draft_kind == "assistant" and not gemma.usable  # listed, never recommended nor run as a draft
    assert gemma not in [pairs.largest_fitting(n * 2**30) for n in (4, 8, 16, 64)]
    assert pairs.recommended_for("gemma-4-e4b-it") is not gemma
    assert by_family["lfm2"].usable and by_family["qwen3.5"].usable
