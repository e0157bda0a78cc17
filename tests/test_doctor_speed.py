"""doctor recommends the pair fast enough to use here, not the largest that fits (issue 26): the
predicted decode speed comes from a measured step (a profile) or the memory bandwidth, and is shown."""

from __future__ import annotations

import json

from edgespec.machine.advice import USABLE_TOK_S, SpeedBasis, _models_advice, _recommended_pair, speed_basis
from edgespec.machine.hardware import detect, device_key
from edgespec.models import pairs

GIB = 1024**3


def test_this_machine_is_not_told_to_run_a_14b_model():
    """The real machine description (2 cores here): Phi-3-medium 14B fits in RAM but would decode at
    about 1 tok/s; the advice names a pair its predicted speed allows, with the figure."""
    report = detect(llama_cpp=True, onnxruntime=False)
    [advice] = _models_advice(report)
    assert "phi-3-medium" not in advice.message and "Phi-3-medium" not in advice.command
    assert "tok/s" in advice.message and advice.settings["predicted_tok_s"] > 0
    if report.cpu.usable_cores and report.cpu.usable_cores <= 4:
        assert "14b" not in advice.settings["target"].lower()


def test_the_largest_fitting_pair_fast_enough_is_chosen_else_the_fastest():
    budget = 64 * GIB
    largest = max((p for p in pairs.pairs() if p.expected_bytes() <= budget), key=pairs.Pair.expected_bytes)
    fast = SpeedBasis(1e15, "a test")
    assert _recommended_pair(budget, fast)[0] is largest
    slow = SpeedBasis(1e6, "a test")
    pair, _, tok_s = _recommended_pair(budget, slow)
    assert tok_s < USABLE_TOK_S and pair.target.file_bytes == min(
        p.target.file_bytes for p in pairs.pairs() if p.expected_bytes() <= budget)
    middle = SpeedBasis(USABLE_TOK_S * 3 * GIB, "a test")  # usable up to 3 GiB targets
    pair, _, tok_s = _recommended_pair(budget, middle)
    assert tok_s >= USABLE_TOK_S and pair.target.file_bytes <= 3 * GIB


def test_a_measured_step_is_the_basis_where_one_was_profiled(tmp_path):
    report = detect(llama_cpp=True, onnxruntime=False)
    model = {"name": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "size": 1_100_000_000}
    profile = {"key": {"device": device_key(report), "target": {"model": model, "runtime": "llama-cpp-python 0.3.36"},
                       "draft": None}, "verify_s": {"1": 0.0714}}
    (tmp_path / "a.json").write_text(json.dumps(profile))
    basis = speed_basis(report, tmp_path)
    assert "measured step of qwen2.5-coder-1.5b" in basis.source and "71 ms" in basis.source
    assert abs(basis.tok_s(1_100_000_000) - 14.0) < 0.1
