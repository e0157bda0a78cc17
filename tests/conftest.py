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
