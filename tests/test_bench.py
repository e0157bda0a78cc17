"""The benchmark harness runs end to end and reports a number for every system (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.slow
def test_bench_quick_smollm2(tmp_path, smollm2_path):
    # Two short prompts and one thread keep it near a minute on 2 shared cores: prefill of the long
    # grounded prompts dominates, and 2 llama.cpp threads on busy cores stall at every graph barrier.
    from edgespec.bench import run as bench

    code = bench.main(["--models", "smollm2", "--quick", "--repeats", "1", "--max-tokens", "8",
                       "--prompts", "chat-hashmap,code-lru", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    systems = doc["models"]["smollm2"]["systems"]
    expected = {"edgespec ar", "edgespec auto", "llama-cpp-python"}
    expected |= {f"edgespec draft k={k}" for k in bench.DRAFT_KS}
    expected |= {f"edgespec lookup k={k}" for k in bench.LOOKUP_KS}
    expected |= {f"llama-cpp-python lookup N={n}" for n in bench.PEER_LOOKUP_NS}
    assert set(systems) == expected
    for name, system in systems.items():
        overall = system["summary"]["overall"]
        for key in ("median_tok_s", "median_ttft_s", "gb_s", "x_plain", "x_llama_cpp_python"):
            assert overall[key] is not None and overall[key] > 0, (name, key, overall[key])
        assert 0.0 <= overall["identical_fraction"] <= 1.0
        for prompt in system["per_prompt"].values():
            assert prompt["generated"][0] > 0
        if system["mode"] == "draft":  # a same-model draft is accepted often
            assert overall["acceptance_rate"] is not None and overall["acceptance_rate"] > 0
    assert systems["edgespec ar"]["summary"]["overall"]["x_plain"] == pytest.approx(1.0)
    assert systems["edgespec ar"]["summary"]["overall"]["identical_fraction"] == 1.0
    assert doc["machine"]["cpu"] and doc["machine"]["llama_cpp_python"]
    assert "t_last - t_first" in doc["definitions"]["timing"]
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.startswith("# edgespec benchmark") and "Figures vs targets" in markdown
    claims = {c["claim"]: c for c in doc["targets"] if c["model"] == "smollm2"}
    auto_claims = [c for name, c in claims.items() if name.startswith("auto ")]
    assert len(auto_claims) == 2 and all(c["measured"] > 0 for c in auto_claims)
    chosen = bench.auto_choices(systems)
    assert sum(chosen.values()) > 0 and all(":" in key for key in chosen)
    assert "What auto chose" in markdown
    if importlib.util.find_spec("matplotlib"):  # the `bench` extra
        assert (tmp_path / "tok_s_vs_k.png").stat().st_size > 0


@pytest.mark.slow
def test_race_runs_every_workload_group(tmp_path, smollm2_path):
    """The race harness (bench/race.py) on two items per workload group: every edgespec system reports
    a speed, later conversation turns are built from earlier answers, and the goals table is filled in."""
    from edgespec.bench import race

    code = race.main(["--models", "smollm2", "--limit", "2", "--max-tokens", "8", "--ks", "1", "--no-cpp",
                      "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "race.json").read_text())
    [summary] = doc["summary"].values()
    assert set(summary["systems"]) == {"edgespec ar", "edgespec lookup k=1", "edgespec draft k=1",
                                       "edgespec suffix", "edgespec auto"}
    assert set(summary["classes"]) == {"chat", "code", "grounded", "multi-turn", "structured"}
    items = {r["item"] for r in doc["runs"]}
    assert {"multi-code-review-t1", "multi-code-review-t2", "struct-person-0", "struct-person-1"} <= items
    assert all(r["tok_s"] for r in doc["runs"] if r["generated"] > 1)
    assert any(g["claim"].startswith("multi-turn") for g in doc["goals"])
    assert "## Goals (issue 17)" in (tmp_path / "RACE_RESULTS.md").read_text()
    assert (tmp_path / "race_per_prompt.png").stat().st_size > 0
