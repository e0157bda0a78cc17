"""Saved state restores the same continuation, and refuses a different model, context or KV type."""

from __future__ import annotations

import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.persist import load_state, save_state


def test_save_and_restore_continue_identically(smollm2_path, tmp_path):
    cfg = GenerationConfig(max_tokens=24, temperature=0, mode="ar")
    with Engine(load_runtime(smollm2_path)) as a:
        ids = a.prompt_tokens("Describe a lighthouse.")
        uninterrupted = a.generate_tokens(ids, cfg).tokens
        a.target.truncate(0)
        a.target.decode(ids[:-1], 0)  # the engine's invariant: all but the last prompt token
        save_state(tmp_path / "s.state", {"target": a.target}, meta={"note": "x"})
    with Engine(load_runtime(smollm2_path)) as b:
        assert load_state(tmp_path / "s.state", {"target": b.target}) == {"note": "x"}
        assert b.target.n_past == len(ids) - 1
        calls = b.target.n_decode_calls
        assert b.generate_tokens(ids, cfg).tokens == uninterrupted
        assert b.target.n_decode_calls - calls == len(uninterrupted)  # no prefill: the KV came from the file


@pytest.mark.parametrize("change", [dict(n_ctx=2048), dict(type_k="q8_0")])
def test_mismatch_is_refused_clearly(smollm2_path, tmp_path, change):
    rt = load_runtime(smollm2_path)
    rt.decode([1, 2, 3], 0)
    save_state(tmp_path / "s.state", {"target": rt})
    other = load_runtime(smollm2_path, **change)
    with pytest.raises(EdgespecError, match="differs"):
        load_state(tmp_path / "s.state", {"target": other})
    assert other.n_past == 0


def test_other_model_is_refused(smollm2_path, smollm2_draft, tmp_path):
    rt = load_runtime(smollm2_path)
    rt.decode([1, 2, 3], 0)
    save_state(tmp_path / "s.state", {"target": rt})
    with pytest.raises(EdgespecError, match="model differs"):
        load_state(tmp_path / "s.state", {"target": load_runtime(smollm2_draft)})
