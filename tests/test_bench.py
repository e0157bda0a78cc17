"""The benchmark harnesses run end to end and report a number for every system (no timing is asserted);
the race's statistics (bench/stats_ci.py) and its priced time and oracle (bench/oracle.py) on hand-made
cases whose answers are known."""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from edgespec.bench import oracle as orc
from edgespec.bench.stats_ci import geomean, geomean_interval, verdict
from edgespec.machine.profile import CostProfile
from edgespec.stats import GenerationStats

MS = 1e-3
DRAFT_NUMERICS = 0.02  # the oracle may miss auto's path by a draft-model near-tie (see the race test)


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


def test_structured_bench_times_valid_answers_only():
    """The time-to-a-valid-answer ratio compares wall times only where both systems answered validly,
    as a speedup of edgespec over llama-server's setting with the most valid answers."""
    from edgespec.bench.structured_bench import AUTO, CPP, TIME_RATIO, Run, summarize_model

    def run(system, request, wall, valid, repeat=0):
        return Run(model="m", system=system, kind="extraction", request=request, repeat=repeat, tok_s=10.0,
                   wall_s=wall, valid=valid)

    runs = [run(AUTO, "a", 10.0, True), run(AUTO, "a", 12.0, True, 1), run(CPP, "a", 30.0, True),
            run(CPP, "a", 99.0, False, 1),  # an invalid answer's time never counts
            run(AUTO, "b", 5.0, True), run(CPP, "b", 1.0, False),  # llama-server never valid on b: not compared
            run(CPP + " draft n=4", "a", 5.0, False), run(CPP + " draft n=4", "b", 5.0, False)]
    time_ratio = summarize_model(runs)["ratios"][TIME_RATIO]["extraction"]
    assert time_ratio["best"] == CPP  # the fastest setting never answered validly
    assert time_ratio["requests"] == 1 and time_ratio["ratio"] == pytest.approx(30.0 / 11.0)


def test_json_style_counts_the_fields_a_format_changed():
    """bench/json_style.py compares a constrained answer with the model's free one leaf by leaf: the free
    answer's object found inside a code fence, a changed value, a missing and an extra list item counted."""
    from edgespec.bench.json_style import STYLES, changes, first_object

    free = first_object('Sure:\n```json\n{\n  "city": "Munich",\n  "items": [1, 2],\n  "id": "INV-1"\n}\n```')
    assert free == {"city": "Munich", "items": [1, 2], "id": "INV-1"}
    assert first_object("no JSON here {") is None
    assert changes(free, {"city": "Munich", "items": [1, 2], "id": "INV-1"}) == []
    assert changes(free, {"city": "Keplerstrasse 12", "items": [1], "id": "InV-1"}) == [".city", ".id", ".items[1]"]
    assert changes(free, {**free, "items": [1, 2, 3]}) == [".items[2]"]
    assert STYLES["spaced"]["key_separator"] == ": " and STYLES["compact"]["item_separator"] == ","


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
                      "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    [summary] = doc["summary"].values()
    assert set(summary["systems"]) == {"edgespec ar", "edgespec lookup k=1", "edgespec draft k=1",
                                       "edgespec suffix", "edgespec auto"}
    assert set(summary["classes"]) == {"chat", "code", "grounded", "multi-turn", "structured"}
    items = {r["item"] for r in doc["runs"]}
    assert {"multi-code-review-t1", "multi-code-review-t2", "struct-person-0", "struct-person-1"} <= items
    assert all(r["tok_s"] for r in doc["runs"] if r["generated"] > 1)
    assert any(g["claim"].startswith("multi-turn") for g in doc["goals"])
    assert "## Goals (issues 17 and 23)" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "race_per_prompt.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_is_the_race_with_intervals_priced_speed_and_the_oracle(tmp_path, smollm2_path):
    """`edgespec bench`'s harness on one class, two prompts, two repeats: the systems' order reversed in
    the second repeat, every interval around its point, a claim for each class that its interval allows,
    a priced speed for every edgespec run, and the oracle at least as fast as auto by the same prices."""
    from edgespec.bench import race

    code = race.main(["--models", "smollm2", "--classes", "code", "--per-category", "2", "--repeats", "2",
                      "--max-tokens", "12", "--ks", "1", "--systems", "edgespec lookup k=1", "--no-cpp",
                      "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    runs = doc["runs"]
    items = list(dict.fromkeys(r["item"] for r in runs))
    assert len(items) == 2 and {r["category"] for r in runs} == {"code"}
    for item in items:
        order = {rep: [r["system"] for r in sorted((r for r in runs if r["item"] == item and r["repeat"] == rep),
                                                    key=lambda r: r["order"])] for rep in (0, 1)}
        assert order[0] == list(reversed(order[1])) and len(set(order[0])) == 3, order
    [summary] = doc["summary"].values()
    for group in [*summary["classes"].values(), summary["overall"]]:
        for system, ci in group["x_plain"].items():
            assert ci["low"] <= ci["value"] <= ci["high"], (system, ci)
            per_prompt = [summary["per_prompt"][i]["x_plain"][system] for i in items]
            assert ci["low"] <= statistics.median(per_prompt) <= ci["high"]  # two prompts: the median too
        assert group["x_plain"]["edgespec ar"]["value"] == pytest.approx(1.0)
        assert group["priced_x_plain"]["edgespec ar"]["value"] == pytest.approx(1.0)
        share = group["oracle"]
        assert share["oracle_x"] >= share["auto_x"] / (1 + DRAFT_NUMERICS)
        assert share["fraction"] is None or share["fraction"] <= 1 + DRAFT_NUMERICS
    for c in summary["claims"]:
        assert c["verdict"] == verdict(SimpleNamespace(**c["interval"]))
        assert c["claim"].startswith("auto")
    assert {c["class"] for c in summary["claims"]} == {"code", "overall"}
    for r in runs:
        assert r["priced_tok_s"] > 0 and sum(r["passes_by_rows"].values()) > 0
        if r["system"] != "edgespec auto":
            assert r["oracle"] is None
            continue
        o = r["oracle"]
        # Auto's own path is one the oracle weighs, exactly so where auto copied; where it used the draft
        # model, the teacher-forced pass may break a near-tie the other way than autoregressive drafting did.
        used_draft = any(key.startswith("draft:") for key in r["chosen"])
        assert o["oracle_x"] >= o["auto_x"] / (1 + (DRAFT_NUMERICS if used_draft else 1e-9))
        assert o["shadow_agree"] == o["shadow_positions"] and all(o["shadow_positions"].values())
        assert set(o["oracle_x_alone"]) == {"lookup", "suffix", "draft"}
        assert all(o["oracle_x"] >= x - 1e-9 for x in o["oracle_x_alone"].values())
    markdown = (tmp_path / "results.md").read_text()
    assert "## Claims" in markdown and "auto's share" in markdown
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "intervals.png").stat().st_size > 0


def test_the_structured_oracle_prices_constrained_plain_as_ar_paid(tmp_path, smollm2_path):
    """bench/structured_oracle on two extraction requests: constrained plain's walk over the grammar's
    forced runs prices exactly what `ar` paid where it wrote the same text (so the walk forces what the
    engine forced), auto's own path is one the oracle weighs, and a drafter never wrong bounds them both."""
    from edgespec.bench import structured_oracle

    out = tmp_path / "oracle.md"
    assert structured_oracle.main(["--models", "smollm2", "--limit", "2", "--max-tokens", "40", "--threads", "1",
                                   "--profiles", "2", "--out", str(out)]) == 0
    [model] = json.loads(out.with_suffix(".json").read_text())["models"]
    rows = model["requests"]
    assert len(rows) == 2 and all(r["kind"] == "extraction" for r in rows)
    assert any(r["same_text"] for r in rows)
    for r in rows:
        assert 0 < r["forced_share"] < 1  # a schema forces its keys and punctuation, never the values
        if r["same_text"]:
            assert r["ar_over_plain_walk"] == pytest.approx(1.0, rel=1e-9)
        assert r["oracle_x"] >= r["auto_x"] - 1e-9  # no draft model here: auto's path is one the oracle weighs
        assert r["never_wrong_x"] >= r["oracle_x"] - 1e-9
        assert r["shadow_agree"] == r["shadow_positions"] and all(r["shadow_positions"].values())
    assert "never wrong" in out.read_text()


def test_the_draft_model_predicts_from_masked_rows_under_a_constraint(smollm2_path):
    """Teacher forcing under a grammar predicts what the draft model drafts under it (Engine.constrain:
    from masked rows): every prediction is a token the grammar allows where it stands, and where the
    model's own argmax is allowed the two agree."""
    from conftest import load_runtime
    from edgespec.structured import Constraint, Grammar

    rt = load_runtime(smollm2_path)
    try:
        constraint = Constraint.regex(r"[0-9]{3}-[a-z]{3}-[0-9]{3}")
        prompt = rt.tokenize("Tell me about the weather in Paris.")
        text = np.asarray(rt.tokenize("123-abc-456", add_special=False), dtype=np.int64)
        grammar = lambda: Grammar(rt.grammar_tokenizer(), constraint, n_vocab=rt.vocab.n_vocab, eog=rt.vocab.eog,
                                  position=len(prompt))
        eog = frozenset(rt.vocab.eog)
        masked = orc.teacher_forced(rt, prompt, text, eog, grammar=grammar())
        free = orc.teacher_forced(rt, prompt, text, eog)
        walk, overruled = grammar(), 0
        for i, token in enumerate(text):
            allowed = walk.allowed()
            assert masked[i] != orc.END and allowed[masked[i]]
            if free[i] != orc.END and allowed[free[i]]:
                assert masked[i] == free[i]
            else:
                overruled += 1
            assert walk.consume([int(token)]) == 1
        assert overruled  # the prompt asks for prose: the mask decides somewhere
    finally:
        rt.close()


def test_pass_trace_times_every_pass_beside_its_price(tmp_path, smollm2_path):
    """bench/pass_trace: plain and auto alternated, every target pass timed, and the same passes priced
    by the profile auto used; plain's price is its passes alone, so timed and priced describe one run."""
    from edgespec.bench import pass_trace

    out = tmp_path / "trace.json"
    assert pass_trace.main(["--models", "smollm2", "--classes", "chat", "--repeats", "2", "--max-tokens", "8",
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs, summary = doc["runs"], doc["summary"]
    for item in {r["item"] for r in runs}:
        order = [r["mode"] for r in runs if r["item"] == item]
        assert order == ["ar", "auto", "auto", "ar"]
    for mode in ("ar", "auto"):
        mine = [r for r in runs if r["mode"] == mode]
        assert all(r["rounds"] > 0 and 0 < r["pass_s"] <= r["span_s"] and r["priced_pass_s"] > 0 for r in mine)
        assert summary[mode]["passes_over_priced"] == pytest.approx(
            sum(r["pass_s"] for r in mine) / sum(r["priced_pass_s"] for r in mine))


def test_code_ab_runs_an_earlier_commits_code_beside_the_working_trees(tmp_path, smollm2_path):
    """bench/code_ab: the named modules' classes and functions as they were at a commit take the live
    ones' place for the "old" runs and give it back after; both versions alternate on each prompt.
    Against HEAD the code is the same, so greedy text must be too."""
    from edgespec.bench import code_ab
    from edgespec.policy import AdaptivePolicy, exclusive
    import edgespec.policy as policy

    live, old = code_ab.module_at("HEAD", "edgespec.policy")
    assert live is policy and old is not policy and old.AdaptivePolicy is not AdaptivePolicy
    patches = code_ab.swaps(live, old)
    code_ab.use(patches, "old")
    try:
        assert AdaptivePolicy.choose is old.AdaptivePolicy.choose and policy.exclusive is old.exclusive
    finally:
        code_ab.use(patches, "new")
    assert AdaptivePolicy.choose is not old.AdaptivePolicy.choose and policy.exclusive is exclusive

    out = tmp_path / "ab.json"
    assert code_ab.main(["--base", "HEAD", "--modules", "edgespec.policy", "--classes", "chat", "--limit", "1",
                         "--repeats", "2", "--max-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["version"] for r in doc["runs"]] == ["new", "old", "old", "new"]
    assert doc["summary"]["new_over_old"]["same_text"] and doc["summary"]["new_over_old"]["span"]["n"] == 2
    assert all(r["rounds"] > 0 and 0 < r["pass_s"] <= r["span_s"] for r in doc["runs"])


# --- the statistics and the oracle on hand-made cases ----------------------------------------------------

def test_the_geometric_mean_interval_resamples_prompts_within_their_class():
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    same = geomean_interval([1.05] * 6)
    assert same.low == pytest.approx(1.05) and same.high == pytest.approx(1.05) and verdict(same) == "holds"
    spread = geomean_interval([0.9, 1.0, 1.1, 1.2, 0.95, 1.05])
    assert spread.low < spread.value < spread.high and verdict(spread) == "cannot tell"
    assert spread == geomean_interval([0.9, 1.0, 1.1, 1.2, 0.95, 1.05])  # seeded
    assert verdict(geomean_interval([0.9, 0.92, 0.95, 0.93])) == "loses"
    assert verdict(geomean_interval([1.5])) == "cannot tell"  # one prompt says nothing of its class
    # Stratified: every resample keeps one prompt of each class, so two classes that differ but are each
    # constant give no spread at all, where pooled resampling would.
    strata = geomean_interval({"a": [1.2, 1.2], "b": [0.9, 0.9]})
    assert strata.low == pytest.approx(strata.high) == pytest.approx(geomean([1.2, 1.2, 0.9, 0.9]))
    assert geomean_interval([1.2, 1.2, 0.9, 0.9]).low < strata.low


def _profile(deep: bool = False):
    # CPU-like: each extra row costs 0.4 of a step; the draft model 0.3 of one; asks nearly free.
    # deep: over 512 held tokens a step costs 1.5 times as much and each extra row 0.8 of one
    deep_curve = {n: 15 * MS * (1 + 0.8 * (n - 1)) for n in (1, 2, 4, 8, 17)} if deep else {}
    return CostProfile({n: 10 * MS * (1 + 0.4 * (n - 1)) for n in range(1, 18)}, draft_s=3 * MS,
                       lookup_s=0.01 * MS, suffix_s=0.02 * MS, verify_deep_s=deep_curve, deep_tokens=512 if deep else 0)


def test_a_run_is_priced_by_its_passes_and_drafting():
    pricing = orc.Pricing(_profile(), ("lookup", "suffix"))
    stats = GenerationStats(mode="auto")
    stats.record_round("none", 0, 0)
    stats.record_round("lookup", 3, 2)
    stats.record_round("draft", 2, 2)
    stats.record_round("lookup", 1, 1, forced=2, forced_accepted=2)  # a constraint's 2 forced rows, 1 drafted
    assert stats.passes_by_rows == {1: 1, 4: 2, 3: 1}
    p = _profile()
    expected = p.verify(1) + 2 * p.verify(4) + p.verify(3) + 2 * p.draft_s + 4 * (p.lookup_s + p.suffix_s)
    assert pricing.run_seconds(stats) == pytest.approx(expected)
    plain = GenerationStats(mode="ar")
    for _ in range(5):
        plain.record_round("none", 0, 0)
    assert pricing.run_seconds(plain) == pytest.approx(5 * p.verify(1))


def test_a_run_is_priced_at_the_depth_of_each_pass():
    """Passes over a long prompt cost more (a pass's attention grows with the tokens held): each is
    priced at its own depth, from the stats' sum of depths per pass size."""
    deep = _profile(deep=True)
    pricing = orc.Pricing(deep, ())
    stats = GenerationStats(mode="ar")
    for held in (100, 700, 1500):
        stats.record_round("none", 0, 0, held=held)
    stats.record_round("lookup", 3, 0, held=900)
    assert stats.held_by_rows == {1: 2300, 4: 900}
    expected = sum(deep.verify(1, held) for held in (100, 700, 1500)) + deep.verify(4, 900)
    assert pricing.run_seconds(stats) == pytest.approx(expected)
    assert deep.verify(4, 900) > _profile().verify(4, 900) == _profile().verify(4)  # depth-free: the same anywhere


def _brute_force(h, pricing, k_max):
    """Every sequence of choices, by recursion: the cheapest time to emit the whole text, each pass
    priced after the n_prompt + j tokens it follows, leading with the position's forced tokens."""
    n = len(h.text)
    forced = np.zeros(n, dtype=np.int64) if h.forced is None else h.forced
    kept = forced if h.forced_kept is None else h.forced_kept

    def best(j):
        if j >= n:
            return 0.0
        held, f = h.n_prompt + j, int(forced[j])
        if kept[j] < f:  # the text spells a forced token otherwise: the round ends there whatever was drafted
            return pricing.verify(1 + f, held) + best(j + int(kept[j]) + 1)
        options = [pricing.verify(1 + f, held) + best(j + f + 1)]
        for d, acc in h.accepted.items():
            for k in range(1, k_max + 1):
                options.append(pricing.verify(1 + f + k, held) + pricing.draft(d, k)
                               + best(j + min(f + min(k, int(acc[j + f])) + 1, n - j)))
        return min(options)

    return best(0)


@pytest.mark.parametrize("deep", [False, True], ids=["depth-free", "priced-by-depth"])
def test_the_oracle_is_the_cheapest_path_over_positions(deep):
    pricing = orc.Pricing(_profile(deep), ("lookup",))
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(3, 9))
        h = orc.Hindsight(np.arange(n), {"lookup": rng.integers(0, 5, size=n), "draft": rng.integers(0, 4, size=n)},
                          n_prompt=int(rng.integers(0, 2000)))
        best = orc.oracle(h, pricing, k_max=4)
        assert best.seconds == pytest.approx(_brute_force(h, pricing, 4))
        plain = sum(pricing.verify(1, h.n_prompt + j) for j in range(n))
        assert best.plain_seconds == pytest.approx(plain) and best.speedup >= 1.0
        walked = sum(best.choices.values())
        assert 1 <= walked <= n
    nothing = orc.Hindsight(np.arange(5), {"lookup": np.zeros(5, dtype=np.int64)})
    assert orc.oracle(nothing, pricing, 4).speedup == pytest.approx(1.0)
    assert orc.oracle(nothing, pricing, 4).choices == {"none:0": 5}


def _forced_runs(n, rng):
    """Forced-run lengths as a grammar gives them: a run from j forces the rest of it from j + 1."""
    forced = np.zeros(n, dtype=np.int64)
    j = 0
    while j < n - 1:
        if rng.random() < 0.4:
            length = int(rng.integers(1, n - j))
            forced[j:j + length] = np.arange(length, 0, -1)
            j += length
        j += 1
    return forced


@pytest.mark.parametrize("deep", [False, True], ids=["depth-free", "priced-by-depth"])
def test_the_oracle_under_a_constraint_leads_each_round_with_the_forced_tokens(deep):
    """Constrained: the forced tokens join every round's pass, drafting starts after them, and a forced
    token the text spells otherwise ends the round. Plain decoding under the constraint is the path
    that never drafts; the oracle is the cheapest path, by brute force."""
    pricing = orc.Pricing(_profile(deep), ("lookup",))
    rng = np.random.default_rng(1)
    for trial in range(30):
        n = int(rng.integers(3, 10))
        forced = _forced_runs(n, rng)
        kept = np.where(rng.random(n) < 0.2, np.minimum(forced, rng.integers(0, 3, size=n)), forced)
        h = orc.Hindsight(np.arange(n), {"lookup": rng.integers(0, 5, size=n), "draft": rng.integers(0, 4, size=n)},
                          n_prompt=int(rng.integers(0, 2000)), forced=forced, forced_kept=kept)
        best = orc.oracle(h, pricing, k_max=4)
        assert best.seconds == pytest.approx(_brute_force(h, pricing, 4))
        plain, j = 0.0, 0
        while j < n:  # constrained plain decoding: each round the forced tokens and one more
            plain += pricing.verify(1 + forced[j], h.n_prompt + j)
            j += (forced[j] if kept[j] >= forced[j] else kept[j]) + 1
        assert best.plain_seconds == pytest.approx(plain) and best.speedup >= 1.0
    # Forced tokens are free rows for plain decoding too: where the grammar forces everything, no drafter helps.
    h = orc.Hindsight(np.arange(6), {"lookup": np.full(6, 5)}, forced=np.array([5, 4, 3, 2, 1, 0]))
    best = orc.oracle(h, pricing, 4)
    assert best.choices == {"none:0": 1} and best.speedup == pytest.approx(1.0)
    assert best.plain_seconds == pytest.approx(pricing.verify(6))


def test_acceptance_in_hindsight():
    text = orc.with_end([5, 6, 7, 8], stopped=True)
    assert text.tolist() == [5, 6, 7, 8, orc.END]
    assert orc.accepted_run(np.array([6, 7, 9]), text, 1, frozenset({2})) == 2
    assert orc.accepted_run(np.array([7, 8, 2, 4]), text, 2, frozenset({2})) == 3  # an end token matches the end
    assert orc.runs_of_matches(np.array([5, 0, 7, 8, orc.END]), text).tolist() == [1, 0, 3, 2, 1]

    class Lookup:  # proposes the rest of a fixed answer after the 3-token prompt
        def propose(self, context, k, sampler):
            return SimpleNamespace(tokens=np.array([5, 6, 7, 8][len(context) - 3:][:k], dtype=np.int32))

    logged = [(4, "lookup", np.array([6, 7, 8])), (5, "lookup", np.array([0]))]  # the second is not the answer
    h = orc.hindsight([1, 2, 3], text[:4], frozenset(), 4, shadow_log=logged, model_free={"lookup": Lookup()})
    assert h.recorded == {"lookup": 2} and h.agree == {"lookup": 1}
    assert h.accepted["lookup"].tolist() == [4, 3, 0, 1]  # position 2: auto's own proposal, as recorded


def test_auto_keeps_its_shadow_proposals_only_when_asked():
    from edgespec.drafters import PromptLookupDrafter
    from edgespec.policy import AdaptivePolicy
    from edgespec.sampling import Sampler, SamplingParams

    policy = AdaptivePolicy(_profile(), PromptLookupDrafter(), None, k_max=4)
    assert policy.shadow_log is None
    state = SimpleNamespace(committed=np.array([1, 2, 3, 1, 2], dtype=np.int32), remaining=50, n=5, n_prompt=2,
                            sampler=Sampler(SamplingParams(temperature=0), 0), forced=0)
    policy.choose(state)
    policy.shadow_log = []
    policy.choose(state)
    [(position, name, tokens)] = policy.shadow_log
    assert position == 5 and name == "lookup" and tokens.tolist() == [3, 1, 2]


def test_edgespec_bench_drives_the_race(monkeypatch):
    """`edgespec bench` is the race: its options become the race's arguments (5 repeats by default)."""
    from typer.testing import CliRunner

    from edgespec import cli
    from edgespec.bench import race

    seen = []
    monkeypatch.setattr(race, "main", lambda argv: seen.append(argv) or 0)
    runner = CliRunner()
    assert runner.invoke(cli.app, ["bench", "--models", "smollm2", "--classes", "code", "--no-cpp"]).exit_code == 0
    args = race.parse_args(seen[-1])
    assert (args.models, args.repeats, args.classes, args.no_cpp) == ("smollm2", race.DEFAULT_REPEATS, ["code"], True)
    assert race.DEFAULT_REPEATS >= 5
    assert runner.invoke(cli.app, ["bench", "--quick"]).exit_code == 0
    quick = race.parse_args(seen[-1])
    assert quick.models == "smollm2" and quick.repeats == 2 and quick.no_cpp
    assert race.repeat_order([1, 2, 3], 0) == [1, 2, 3] and race.repeat_order([1, 2, 3], 1) == [3, 2, 1]


def test_the_policy_replay_makes_the_rounds_a_real_auto_run_made(smollm2_path):
    """Replayed on the text a real greedy auto run emitted, the unchanged policy makes the same rounds
    at the same priced cost: the replay (bench/policy_replay.py) models the engine's loop, not a guess of it."""
    from edgespec.bench.policy_replay import replay
    from edgespec.bench.race import shipped_items
    from edgespec.drafters import DraftSources
    from edgespec.drafters.suffix import SuffixHistory
    from edgespec.drafters.table import build_drafters
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.policy import AdaptivePolicy

    engine = Engine.load(smollm2_path, n_ctx=2048, n_threads=1)  # lookup and suffix: no draft model
    # a profile without a key is never corrected by the run's own timings, so both sides price alike;
    # passes dearer over more held tokens (the grounded prompt holds ~490), so both re-price by depth
    engine._profile = profile = CostProfile({1: 10 * MS, 2: 12 * MS, 4: 14 * MS, 8: 20 * MS, 17: 40 * MS},
                                            None, None, 0.01 * MS, suffix_s=0.02 * MS, deep_tokens=512,
                                            verify_deep_s={1: 15 * MS, 2: 19 * MS, 4: 24 * MS, 8: 36 * MS, 17: 80 * MS})
    [item] = [i for i in shipped_items(1) if i.category == "grounded"]
    prompt = engine.prompt_tokens(item.messages)
    fresh = build_drafters(DraftSources(history=SuffixHistory(key=engine.history.key)))  # what the run started with
    config = GenerationConfig(max_tokens=40, temperature=0.0, seed=0, mode="auto")
    k_max = engine.policy_for(config)[1].k_max
    result = engine.generate_tokens(prompt, config)
    engine.close()
    assert result.finish_reason == "length" and result.stats.drafted > 0  # it speculated: something to replay
    text = np.asarray(result.tokens, dtype=np.int64)
    pricing = orc.Pricing(profile, ("lookup", "suffix"))
    policy = AdaptivePolicy(profile, *fresh.values(), k_max=k_max)
    seconds, chosen, _ = replay(policy, np.asarray(prompt, dtype=np.int32), text, orc.Hindsight(text, {}), None, pricing)
    assert chosen == result.stats.chosen and policy.held > 400  # priced at the prompt's depth, not 64
    assert seconds == pytest.approx(pricing.run_seconds(result.stats), rel=1e-12)


def test_flash_attn_bench_runs_both_settings_on_every_prompt_and_mode(tmp_path, smollm2_path):
    """The flash-attention bench, tiny (a chat prompt and a grounded edit, 8 tokens, one repeat): each
    prompt and mode ran with flash attention on and off, and the summary counts what the runs hold."""
    from edgespec.bench import flash_attn_bench

    out = tmp_path / "fa.md"
    assert flash_attn_bench.main(["--models", "smollm2", "--per-class", "1", "--repeats", "1",
                                  "--max-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())["models"]["smollm2"]
    runs = doc["runs"]
    assert sorted((r["class"], r["mode"], r["fa"]) for r in runs) == sorted(
        (c, m, fa) for c in ("chat", "grounded") for m in ("ar", "auto") for fa in ("on", "off"))
    assert all(r["tokens_per_s"] > 0 and len(r["tokens"]) == 8 for r in runs)
    auto = {r["class"]: r for r in doc["summary"] if r["mode"] == "auto"}
    for cls in ("chat", "grounded"):
        texts = {(r["mode"], r["fa"]): r["tokens"] for r in runs if r["class"] == cls}
        assert auto[cls]["as_plain_on"] == int(texts["auto", "on"] == texts["ar", "on"])
        assert auto[cls]["as_plain_off"] == int(texts["auto", "off"] == texts["ar", "off"])
    assert "| smollm2 | auto | grounded | 1 |" in out.read_text()


def test_depth_curve_times_every_point_for_both_flash_settings(tmp_path, smollm2_path):
    """The depth curve, tiny (SmolLM2, 2 depths x 2 sizes, one repeat): a positive time for every point of
    both settings, and the table's steps are each point over the 1-row pass at its depth."""
    from edgespec.bench import depth_curve

    out = tmp_path / "depth.md"
    assert depth_curve.main(["--models", "smollm2-135m:1", "--held", "64,128", "--rows", "1,3",
                             "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())["models"]["smollm2-135m"]
    for fa in ("on", "off"):
        assert set(res[fa]) == {"64", "128"} and all(set(ms) == {"1", "3"} and min(ms.values()) > 0
                                                     for ms in res[fa].values())
    ms = res["off"]["128"]
    assert f"| smollm2-135m, 1 | off | 128 | {ms['1']:.1f} (1.00) | {ms['3']:.1f} ({ms['3'] / ms['1']:.2f}) |" \
        in out.read_text()
