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


def test_structured_bench_validity_accounting():
    """bench/structured_bench.py's check of one answer: schema-valid JSON, tool calls (OpenAI's fields, or
    text in edgespec's object or the model's <tool_call> format) naming a request's tool with valid
    arguments; a truncated answer is never valid."""
    from edgespec.bench.structured_bench import check_output, load_requests

    extraction, tool, conversation = load_requests(limit=1)
    assert (extraction.kind, tool.kind, conversation.kind) == ("extraction", "tool_choice", "multi_step")
    assert 3 <= len(tool.tools) <= 8 and any(m.get("tool_calls") for m in conversation.messages)
    assert "response_format" in extraction.body("m", True) and "response_format" not in extraction.body("m", False)
    assert tool.body("m", True)["tool_choice"] == "required" and "tools" not in tool.body("m", False)

    def call(name, **arguments):
        return {"content": None, "tool_calls": [{"function": {"name": name, "arguments": json.dumps(arguments)}}]}

    good = call("get_weather", city="Reykjavik", unit="celsius")
    assert check_output(tool, good, "tool_calls") == {"valid": True, "truncated": False, "right_tool": True, "why": ""}
    assert not check_output(tool, good, "length")["valid"]  # cut at max_tokens: never valid
    assert "kelvin" in check_output(tool, call("get_weather", city="X", unit="kelvin"), "tool_calls")["why"]
    assert "unknown tool" in check_output(tool, call("book_hotel", city="X"), "tool_calls")["why"]
    native = {"content": '<tool_call>{"name": "get_stock_price", "arguments": {"ticker": "ASML"}}</tool_call>'}
    assert check_output(tool, native, "stop") == {"valid": True, "truncated": False, "right_tool": False, "why": ""}
    assert check_output(tool, {"content": "It is sunny."}, "stop")["why"] == "no tool call"
    answer = {key: "x" for key in extraction.schema["properties"]}
    assert "schema" in check_output(extraction, {"content": json.dumps(answer)}, "stop")["why"]
    assert check_output(extraction, {"content": '{"invoice_number": "INV'}, "length")["truncated"]


def test_structured_bench_smoke_counts_every_output(tmp_path, smollm2_path):
    """The structured bench's smoke mode on SmolLM2 (edgespec's three systems, one request per workload,
    48 tokens): every output is counted once, as valid, invalid or truncated, and every constrained
    output that ended by itself is valid against its schema or tools."""
    from edgespec.bench import structured_bench

    out = tmp_path / "structured.md"
    assert structured_bench.main(["--smoke", "--no-llama-server", "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    runs = doc["runs"]
    systems = doc["summary"]["smollm2"]["systems"]
    assert set(systems) == {"edgespec ar", "edgespec auto", "edgespec ar unconstrained"}
    assert {r["kind"] for r in runs} == {"extraction", "tool_choice", "multi_step"}
    assert all(r["error"] is None and r["tok_s"] and r["tokens"] > 0 for r in runs), runs
    for name, row in systems.items():
        mine = [r for r in runs if r["system"] == name]
        assert row["runs"] == len(mine) == 3
        assert row["valid"] == sum(r["valid"] for r in mine) and row["truncated"] == sum(r["truncated"] for r in mine)
        assert row["valid_share"] == pytest.approx(row["valid"] / row["runs"])
        assert not any(r["valid"] and r["truncated"] for r in mine)
    constrained = [r for r in runs if r["system"] != "edgespec ar unconstrained"]
    assert all(r["valid"] for r in constrained if not r["truncated"]), constrained
    assert all(r["forced_accepted"] > 0 for r in constrained)  # key names and punctuation the grammar forces
    assert systems["edgespec ar"]["forced_share"] > 0 and systems["edgespec ar unconstrained"]["forced_share"] == 0
    claims = {g["claim"] for g in doc["goals"]}
    assert any(c.startswith("mask cost") for c in claims) and any(c.startswith("100 %") for c in claims)
    assert "## Goals (issue 22, item 5)" in out.read_text()


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
