"""The llama.cpp runtime: rows of logits on demand, rollback, long prompts, memory, bad files."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.errors import ContextOverflowError, EdgespecError, ModelFileError
from edgespec.runtimes.base import Runtime, sync_to


@pytest.fixture(scope="module")
def smol(smollm2_path):
    rt = load_runtime(smollm2_path)
    yield rt
    rt.close()


def test_implements_the_runtime_protocol(smol):
    assert isinstance(smol, Runtime)
    assert smol.vocab.n_vocab == 49152 and smol.vocab.vocab_type == "bpe"
    assert smol.vocab.eos in smol.vocab.eog


def test_decode_returns_only_the_rows_asked_for(smol):
    ids = smol.tokenize("The quick brown fox jumps over the lazy dog", add_special=True, parse_special=False)
    smol.truncate(0)
    assert smol.decode(ids, 0).shape == (0, smol.n_vocab)
    smol.truncate(0)
    rows = smol.decode(ids, 3)
    assert rows.shape == (3, smol.n_vocab) and rows.dtype == np.float32 and np.isfinite(rows).all()
    assert smol.n_past == len(ids) and list(smol.tokens) == ids
    # the logits buffer it accounts for is the rows asked for, not n_ctx x n_vocab
    assert smol.memory().logits <= len(ids) * smol.n_vocab * 4 < smol.n_ctx * smol.n_vocab * 4


def test_rollback_gives_the_logits_of_a_fresh_evaluation(smollm2_path, smol):
    prefix = smol.tokenize("def add(a, b):\n    return", add_special=True, parse_special=False)
    smol.truncate(0)
    smol.decode(prefix, 0)
    smol.decode([11, 22, 33, 44, 55], 5)       # a rejected draft
    smol.truncate(len(prefix))
    after_rollback = smol.decode([264], 1)[0]

    fresh = load_runtime(smollm2_path)
    fresh.decode(prefix, 0)
    expected = fresh.decode([264], 1)[0]
    fresh.close()
    np.testing.assert_allclose(after_rollback, expected, atol=1e-4)
    assert int(after_rollback.argmax()) == int(expected.argmax())


def test_prompt_longer_than_the_batch_is_split(smollm2_path):
    chunked = load_runtime(smollm2_path, n_batch=16)
    one_by_one = load_runtime(smollm2_path, n_batch=1)
    ids = chunked.tokenize("one two three four five six seven eight nine ten " * 8, add_special=True,
                           parse_special=False)
    assert len(ids) > 3 * chunked.n_batch
    a = chunked.decode(ids, 20)    # the rows asked for span two chunks
    b = one_by_one.decode(ids, 20)
    assert chunked.n_decode_calls == -(-len(ids) // 16) and one_by_one.n_decode_calls == len(ids)
    # Batches of up to 16 take the same CPU kernels as single tokens here (identical logits); allow
    # for other CPUs, whose batch kernels round differently.
    np.testing.assert_allclose(a, b, atol=0.5)
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.95
    chunked.close(), one_by_one.close()


def test_sync_keeps_the_common_prefix(smol):
    smol.truncate(0)
    smol.decode([1, 2, 3, 4, 5], 0)
    assert sync_to(smol, np.array([1, 2, 3, 9, 9], dtype=np.int32)) == 3
    assert list(smol.tokens) == [1, 2, 3]


def test_context_overflow_is_a_clear_error(smollm2_path):
    rt = load_runtime(smollm2_path, n_ctx=64)  # llama.cpp rounds small contexts up
    with pytest.raises(ContextOverflowError, match=f"context of {rt.n_ctx} tokens"):
        rt.decode(list(range(100, 110 + rt.n_ctx)), 1)
    assert rt.n_past == 0
    rt.close()


def test_memory_report_counts_weights_and_kv(smollm2_path):
    f16 = load_runtime(smollm2_path, n_ctx=512)
    q8 = load_runtime(smollm2_path, n_ctx=512, type_k="q8_0", type_v="q8_0")
    m16, m8 = f16.memory(), q8.memory()
    assert 90e6 < m16.weights < 100e6
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims: 30 * 3 * 64 * 2 (K and V) * 2 bytes = 23040 B/token
    assert m16.kv_cache == 512 * 23040
    assert m8.kv_cache == pytest.approx(m16.kv_cache * 34 / 64)
    assert np.isfinite(q8.decode([1, 2, 3], 1)).all()  # quantized V switched flash attention on
    f16.close(), q8.close()


def test_kv_type_options_are_checked():
    from edgespec.runtimes.llamacpp import LlamaCppOptions

    with pytest.raises(EdgespecError, match="unknown KV cache type"):
        LlamaCppOptions(type_k="q3")
    with pytest.raises(EdgespecError, match="needs flash attention"):
        LlamaCppOptions(type_v="q8_0", flash_attn=False)


def test_bad_model_files_are_refused_clearly(tmp_path, tiny_pair):
    from tiny_models import write_corrupt_copies

    with pytest.raises(ModelFileError, match="not found"):
        load_runtime(tmp_path / "missing.gguf")
    bad = write_corrupt_copies(tiny_pair["target"], tmp_path)
    with pytest.raises(ModelFileError, match="truncated, corrupt"):
        load_runtime(bad["truncated"])
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_runtime(bad["garbage"])


def test_quantize_writes_a_loadable_model_atomically(smollm2_draft, smollm2_path, tmp_path):
    from edgespec.runtimes.llamacpp import quantize

    rt = load_runtime(smollm2_draft)
    assert rt.memory().weights < load_runtime(smollm2_path).memory().weights
    rt.close()
    with pytest.raises(EdgespecError, match="unknown quantization"):
        quantize(smollm2_path, tmp_path / "x.gguf", "q9_z")
    assert list(tmp_path.iterdir()) == []
