"""`edgespec generate` as a user runs it: a real process, real models, its stdout, stderr and exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CONTRACT_STATS = {"mode", "generated", "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
                  "rounds", "ttft_s", "decode_s", "tokens_per_s"}


def edgespec(*args, stdin: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGESPEC_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=timeout, env=env)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {proc.stderr!r}"
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]
    assert proc.stdout == ""


def test_generate_json_follows_the_contract(smollm2_path, smollm2_draft):
    proc = edgespec("generate", "Write a function that adds two numbers.", "--target", smollm2_path,
                    "--draft", smollm2_draft, "--mode", "draft", "--temperature", "0", "--max-tokens", "24", "--json",
                    "--threads", 2)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(out) >= {"text", "tokens", "prompt_tokens", "finish_reason", "stats"}
    assert CONTRACT_STATS <= set(out["stats"])
    s = out["stats"]
    assert s["mode"] == "draft" and s["generated"] == len(out["tokens"]) <= 24
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-3)
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / s["rounds"], abs=1e-3)
    assert s["tokens_per_s"] == pytest.approx(s["generated"] / s["decode_s"], rel=1e-2)
    assert out["finish_reason"] in ("stop", "length") and out["text"].strip()


def test_generate_streams_text_then_a_stats_line(smollm2_path):
    proc = edgespec("generate", "Say hello.", "--target", smollm2_path, "--temperature", "0", "-n", "16",
                    "--mode", "lookup")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    stats = proc.stderr.strip().splitlines()
    assert len(stats) == 1 and "tok/s" in stats[0] and "mode lookup" in stats[0]  # llama.cpp's log is silent


def test_greedy_json_is_reproducible_and_equals_the_library(smollm2_path):
    from conftest import load_runtime
    from edgespec.engine import Engine, GenerationConfig

    args = ("generate", "Name a colour.", "--target", smollm2_path, "--temperature", "0.9", "--seed", "5",
            "-n", "12", "--json", "--mode", "lookup")
    a, b = json.loads(edgespec(*args).stdout), json.loads(edgespec(*args).stdout)
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 5
    with Engine(load_runtime(smollm2_path)) as engine:
        lib = engine.generate("Name a colour.", GenerationConfig(temperature=0.9, seed=5, max_tokens=12, mode="lookup"))
    assert lib.tokens == a["tokens"]


def test_stop_string_and_stdin(smollm2_path):
    proc = edgespec("generate", "-", "--target", smollm2_path, "--temperature", "0", "-n", "40", "--raw",
                    "--stop", "3", "--json", stdin="1, 2, 3, 4, 5, 6, 1, 2,")
    out = json.loads(proc.stdout)
    assert "3" not in out["text"] and out["finish_reason"] == "stop"


def test_missing_model_file(tmp_path):
    assert_user_error(edgespec("generate", "hi", "--target", tmp_path / "nope.gguf"), "not found")


def test_corrupt_and_truncated_models(tmp_path, tiny_pair):
    from tiny_models import write_corrupt_copies

    bad = write_corrupt_copies(tiny_pair["target"], tmp_path)
    assert_user_error(edgespec("generate", "hi", "--target", bad["truncated"]), "truncated")
    assert_user_error(edgespec("generate", "hi", "--target", bad["garbage"]), "not a GGUF")


def test_mismatched_pair(smollm2_path, tiny_pair):
    assert_user_error(edgespec("generate", "hi", "--target", smollm2_path, "--draft", tiny_pair["target"]),
                      "vocabulary")


def test_empty_prompt(smollm2_path):
    assert_user_error(edgespec("generate", "   ", "--target", smollm2_path), "empty")


def test_context_overflow_before_anything_runs(smollm2_path):
    assert_user_error(edgespec("generate", "word " * 100, "--target", smollm2_path, "--ctx", "64"),
                      "exceeds the context")


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--mode", "fast"], "unknown mode"),
    (["--mode", "draft"], "needs a draft model"),
    (["--cache-type-k", "q3"], "KV cache type"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--no-such-option"], "no-such-option"),
])
def test_invalid_option_values(smollm2_path, args, needle):
    assert_user_error(edgespec("generate", "hi", "--target", smollm2_path, *args), needle)


def test_unknown_catalog_name():
    assert_user_error(edgespec("generate", "hi", "--target", "gpt-17"), "gpt-17")


def test_debug_shows_the_traceback(tmp_path):
    proc = edgespec("generate", "hi", "--target", tmp_path / "nope.gguf", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_help_explains_every_option():
    proc = edgespec("generate", "--help")
    assert proc.returncode == 0
    for option in ("--target", "--draft", "--mode", "--max-tokens", "--temperature", "--top-k", "--top-p",
                   "--seed", "--raw", "--json", "--draft-max", "--stop"):
        assert option in proc.stdout


def test_audit_dir_without_verifier_is_one_line_and_exit_2(tmp_path):
    """--audit-dir records the cloud verifier's passes; on the OpenAI server it is refused, not ignored."""
    assert_user_error(edgespec("serve", "--audit-dir", tmp_path, "--port", "0"), "--audit-dir", "--verifier")
