"""The memory plan against reality: predicted vs measured peaks, budgets, the CLI, saved sessions.

The measured grid runs each point in a fresh process (`python -m edgespec.machine.memprobe measure`) that loads
the setup, prefills a prompt longer than one ubatch (so the whole compute buffer is used), generates,
and reports its peak resident set (VmHWM: anonymous pages and file-backed weight pages alike).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from edgespec.engine import GenerationStream
from edgespec.errors import EdgespecError
from edgespec.machine.memory import MiB, Hardware, ModelSettings, Setup, calibrate, model_facts, predict
from edgespec.machine.planner import candidates, plan, setup_for

TOLERANCE = 0.10
TOLERANCE_MIN = 32 * MiB


@pytest.fixture(scope="module")
def qwen_pair() -> tuple:
    from edgespec.models import store

    return store.resolve("qwen2.5-coder-1.5b"), store.resolve("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def cal():
    return calibrate()


# (name, target, draft, n_ctx, kv type, use_mmap, n_batch, k)
GRID = [
    ("smol-1k-f16", "smol", None, 1024, "f16", True, 512, 0),
    ("smol-4k-q8_0", "smol", None, 4096, "q8_0", True, 512, 0),
    ("smol+draft-2k-q4_0", "smol", "smol_q4_0", 2048, "q4_0", True, 256, 4),
    ("qwen-pair-1k-f16", "qwen", "qwen_draft", 1024, "f16", True, 256, 4),
    ("qwen-2k-q8_0-read", "qwen", None, 2048, "q8_0", False, 256, 0),
    ("qwen-pair-4k-q4_0-read", "qwen", "qwen_draft", 4096, "q4_0", False, 128, 3),
]


def _grid_setup(point, paths, cal):
    name, target, draft, n_ctx, kv, mmap, n_batch, k = point
    t = model_facts(paths[target])
    d = model_facts(paths[draft]) if draft else None
    ts = ModelSettings(n_ctx=n_ctx, type_k=kv, type_v=kv, n_batch=n_batch, n_outputs_max=k + 1, use_mmap=mmap)
    return Setup(t, ts, d, replace(ts, n_outputs_max=1) if d else None, max_draft=k, sampling=False)


@pytest.fixture(scope="module")
def measured_grid(smollm2_path, smollm2_draft, qwen_pair, cal):
    """Every grid point measured in its own fresh process, two at a time, one thread each (a busy machine's
    CPUs are shared anyway, and each process's peak is its own)."""
    from edgespec.machine.memprobe import run_measure_subprocess

    paths = {"smol": smollm2_path, "smol_q4_0": smollm2_draft, "qwen": qwen_pair[0], "qwen_draft": qwen_pair[1]}
    setups = {p[0]: _grid_setup(p, paths, cal) for p in GRID}

    def run(point):
        name, target, draft = point[:3]
        setup = setups[name]
        job = {"target": str(paths[target]), "draft": str(paths[draft]) if draft else None,
               "setup": setup.to_dict(), "prompt_tokens": setup.target_settings.n_batch + 8, "max_tokens": 8,
               "mode": "draft" if draft else "ar", "n_threads": 1}  # threads move the peak by < 1 MiB
        return name, run_measure_subprocess(job)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(run, GRID))
    return {name: (setups[name], results[name]) for name in results}


@pytest.mark.slow
@pytest.mark.parametrize("point", GRID, ids=[p[0] for p in GRID])
def test_predicted_peak_matches_the_measured_one(point, measured_grid, cal):
    setup, measured = measured_grid[point[0]]
    predicted = predict(setup, cal).peak_bytes
    error = predicted - measured["peak"]
    assert abs(error) <= max(TOLERANCE * measured["peak"], TOLERANCE_MIN), (
        f"{point[0]}: predicted {predicted / MiB:.1f} MiB, measured {measured['peak'] / MiB:.1f} MiB")
    # the prediction's own terms agree with what llama.cpp allocated in that process
    buffers = measured["buffers"]["target"]
    assert measured["n_ctx"] == setup.target_settings.n_ctx
    assert abs(buffers["CPU KV"] - setup.target.kv_bytes(point[3], point[4], point[4])) < 0.01 * MiB


@pytest.mark.slow
def test_calibration_came_from_other_configurations(cal):
    """The compute scales are fitted on SmolLM2 dry runs, the residuals on a SmolLM2 run at a context of
    768: no grid point shares that configuration."""
    from edgespec.machine.memprobe import REFERENCE_RUN

    ref = cal.measured["settings"]
    assert ref["n_ctx"] == REFERENCE_RUN["n_ctx"]
    for name, target, draft, n_ctx, kv, mmap, n_batch, k in GRID:
        assert (n_ctx, kv, n_batch) != (ref["n_ctx"], ref["type_k"], ref["n_batch"]), name
    assert 0.9 < cal.ffn_scale < 1.1 and 0.9 < cal.output_scale < 1.1  # the graph's structure holds


# --- budgets that force each step ----------------------------------------------------------------

def _ordered(target, draft, cal, ctx):
    t, d = model_facts(target), model_facts(draft) if draft else None
    hw = Hardware()
    out = []
    for s in candidates(t, d, contexts=(ctx,), max_draft=4, hw=hw, cal=cal):
        out.append((s, predict(setup_for(s, t, d, hw), cal).peak_bytes))
    return out


def _budget_just_below(options) -> int:
    """A budget that none of these settings fits, margin included."""
    from edgespec.machine.planner import _margin

    return min(p + _margin(p) for _, p in options) - MiB


def test_a_tight_budget_quantizes_the_kv_cache(qwen_pair, cal):
    options = _ordered(*qwen_pair, cal, ctx=4096)
    f16_with_draft = [(s, p) for s, p in options if s.draft and s.type_k == "f16"]
    budget = _budget_just_below(f16_with_draft)
    result = plan(*qwen_pair, budget=budget, ctx=4096, hardware=Hardware(), calibration=cal)
    assert result.fits and result.settings.draft
    assert result.settings.type_k == result.settings.type_v == "q8_0"
    assert result.settings.flash_attn is True  # a quantized V cache needs flash attention
    assert any("quantized to q8_0" in n for n in result.notes)
    assert result.predicted_peak_bytes + result.margin_bytes <= budget


def test_a_tighter_budget_drops_the_draft(qwen_pair, cal):
    options = _ordered(*qwen_pair, cal, ctx=2048)
    budget = _budget_just_below([(s, p) for s, p in options if s.draft])
    result = plan(*qwen_pair, budget=budget, ctx=2048, hardware=Hardware(), calibration=cal)
    assert result.fits and not result.settings.draft  # max_draft stays: prompt lookup may still draft
    assert result.settings.type_k == "f16"  # without the draft, the target alone gets its f16 cache back
    assert "draft dropped to fit" in result.notes


def test_an_impossible_budget_names_the_smallest_that_fits(qwen_pair, cal):
    result = plan(*qwen_pair, budget=600 * MiB, ctx=2048, hardware=Hardware(), calibration=cal)
    assert not result.fits
    smallest = result.smallest_budget_bytes
    assert smallest > 600 * MiB
    assert plan(*qwen_pair, budget=smallest, ctx=2048, hardware=Hardware(), calibration=cal).fits
    assert not plan(*qwen_pair, budget=smallest - MiB, ctx=2048, hardware=Hardware(), calibration=cal).fits
    assert "nothing fits" in result.failure_message() and "GiB" in result.failure_message()


def test_without_ctx_the_plan_shrinks_the_context_last(smollm2_path, cal):
    roomy = plan(smollm2_path, budget=2 << 30, hardware=Hardware(), calibration=cal)
    assert roomy.fits and roomy.settings.n_ctx == 4096 and roomy.settings.type_k == "f16"
    at_4k = _ordered(smollm2_path, None, cal, ctx=4096)
    tight = plan(smollm2_path, budget=_budget_just_below(at_4k), hardware=Hardware(), calibration=cal)
    assert tight.fits and tight.settings.n_ctx == 2048 and any("context reduced" in n for n in tight.notes)


def test_on_a_discrete_gpu_the_targets_kv_moves_to_host_and_the_drafts_stays(qwen_pair, cal):
    t, d = (model_facts(p) for p in qwen_pair)
    roomy = Hardware("discrete", ram_bytes=32 << 30, gpu_bytes=24 << 30)
    full = plan(*qwen_pair, budget=16 << 30, gpu_budget=24 << 30, ctx=32768, hardware=roomy, calibration=cal)
    assert full.fits and full.settings.target_gpu_layers == -1 and full.settings.target_offload_kqv
    target_kv = t.kv_bytes(32768)
    gpu_budget = full.prediction.device_peak_bytes - target_kv // 2  # all of it but half the target's KV
    tight = plan(*qwen_pair, budget=16 << 30, gpu_budget=gpu_budget, ctx=32768, hardware=roomy, calibration=cal)
    s = tight.settings
    assert tight.fits and s.draft and s.type_k == "f16"
    assert (s.target_gpu_layers, s.target_offload_kqv) == (-1, False)
    assert (s.draft_gpu_layers, s.draft_offload_kqv) == (-1, True)
    assert tight.prediction.host["target.kv"] == target_kv and "draft.kv" in tight.prediction.device
    assert tight.to_dict()["predicted_gpu_peak_bytes"] <= gpu_budget


# --- the budget applied ------------------------------------------------------------------------------

def test_apply_budget_loads_the_plan_and_reports_the_peak(smollm2_path, smollm2_draft):
    from edgespec.engine import GenerationConfig
    from edgespec.machine.planner import apply_budget

    engine, result = apply_budget(smollm2_path, smollm2_draft, budget="3G", ctx=1024, max_draft=3,
                                  sampling=False, n_threads=1)
    with engine:
        s = result.settings
        assert engine.target.n_ctx == 1024 and engine.target.options.n_outputs_max == s.max_draft + 1 == 4
        assert engine.draft_runtime.options.n_outputs_max == 1
        out = engine.generate("Count from one to five.", GenerationConfig(max_tokens=16, temperature=0, mode="draft"))
    stats = out.stats.to_dict()
    assert stats["predicted_peak_bytes"] == result.predicted_peak_bytes
    # The peak is the process's high-water mark: in a long pytest run earlier tests (torch, the Qwen
    # models) raise it, so the budget itself is checked in fresh processes (the grid above and the guard test).
    import psutil

    assert stats["peak_rss_bytes"] >= psutil.Process().memory_info().rss > 0
    assert max(int(k.split(":")[1]) for k in stats["chosen"]) <= 3  # the plan's draft length caps k


def test_under_pressure_the_engine_drops_the_draft_then_stops(smollm2_path, smollm2_draft):
    """Real pressure: resident ballast grows between rounds until the guard gives up the suffix history,
    the KV pools' headroom and the draft (the generation goes on model-free), then stops with a clear
    error instead of crossing the budget."""
    from edgespec.engine import GenerationConfig
    from edgespec.machine.guard import MemoryBudgetError
    from edgespec.machine.memory import current_rss
    from edgespec.machine.planner import apply_budget
    from test_memory import resident_ballast

    engine, result = apply_budget(smollm2_path, smollm2_draft, budget=current_rss() + 600 * MiB, ctx=1024,
                                  max_draft=4, sampling=False, n_threads=1)
    guard = engine.memory_guard
    assert {r.step for r in guard.releasers} == {"suffix_history", "kv_pool", "draft_model"}
    assert 10 * MiB < guard.estimates()["draft_model"] < 400 * MiB  # the plan's draft terms
    config = GenerationConfig(max_tokens=400, temperature=0, mode="draft")
    ballast = []
    with engine:
        ids = engine.prompt_tokens("Write a long story about a lighthouse keeper and his dog.")
        with pytest.raises(MemoryBudgetError, match="nothing left to free"):
            for _ in GenerationStream(engine, ids, config):
                # hold the process at the soft limit; once the draft is gone, push it past the hard one
                gone = engine.draft_runtime is None
                level = guard.hard * guard.budget_bytes + 8 * MiB if gone else guard.soft * guard.budget_bytes
                need = int(level) - current_rss()
                if need > 0:
                    ballast.append(resident_ballast(need + MiB))
        assert engine.draft_runtime is None and "draft" not in engine.drafters
    taken = [r["step"] for r in guard.released]
    assert "draft_model" in taken and taken.index("kv_pool") < taken.index("draft_model")
    assert guard.events[-1].endswith("stopped")
    for block in ballast:
        block.close()


# --- the command line -----------------------------------------------------------------------------

def edgespec(*args, timeout=300):
    env = {**os.environ, "EDGESPEC_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *map(str, args)], text=True, capture_output=True,
                          timeout=timeout, env=env)


def test_plan_json_schema(smollm2_path, qwen_pair, cal):  # cal: calibrated before, so stderr stays quiet
    proc = edgespec("plan", "--target", qwen_pair[0], "--draft", qwen_pair[1], "--budget", "3G", "--ctx", "2048",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] is True and isinstance(out["predicted_peak_bytes"], int)
    assert {"host", "phases"} <= set(out["breakdown"])
    host = out["breakdown"]["host"]
    assert {"fixed", "target.kv", "target.compute", "draft.kv", "verification"} <= set(host)
    assert out["predicted_peak_bytes"] == max(out["breakdown"]["phases"].values())
    s = out["settings"]
    assert {"n_ctx", "type_k", "type_v", "offload_kqv", "target_gpu_layers", "draft_gpu_layers", "draft",
            "max_draft", "flash_attn"} <= set(s)
    assert s["n_ctx"] == 2048 and s["draft"] is True and s["max_draft"] >= 1
    assert out["predicted_peak_bytes"] + out["margin_bytes"] <= 3 << 30


def test_plan_with_an_impossible_budget_is_one_line_and_exit_2(smollm2_path, cal):
    proc = edgespec("plan", "--target", smollm2_path, "--budget", "64M")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: nothing fits a budget of 64.0 MiB")
    assert "needs at least" in lines[0] and "Traceback" not in proc.stderr and proc.stdout == ""
    proc = edgespec("plan", "--target", smollm2_path, "--budget", "64M", "--json")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    out = json.loads(proc.stdout)
    assert out["fits"] is False and out["smallest_budget_bytes"] > 64 * MiB


def test_generate_with_a_budget_reports_predicted_and_measured_peaks(smollm2_path, cal):
    proc = edgespec("generate", "Say hello.", "--target", smollm2_path, "--budget", "1G", "--ctx", "1024",
                    "--temperature", "0", "-n", "8", "--json", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["predicted_peak_bytes"] > 0 and 0 < stats["peak_rss_bytes"] <= 1 << 30
    proc = edgespec("generate", "Say hello.", "--target", smollm2_path, "--budget", "64M", "-n", "8")
    assert proc.returncode == 2 and proc.stderr.startswith("error: nothing fits")
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = edgespec("generate", "Say hello.", "--target", smollm2_path, "--budget", "1G", "--cache-type-k", "q8_0")
    assert proc.returncode == 2 and "--budget chooses --cache-type-k" in proc.stderr


def _parse_size(text: str) -> int:
    from edgespec.machine.memory import parse_size

    return parse_size(text.replace(" ", "").replace("iB", ""))


def test_chat_with_a_budget_shows_the_measured_peak_against_the_plan(smollm2_path, cal):
    import pexpect
    from test_chat_tty import spawn_chat

    child = spawn_chat("--target", smollm2_path, "--budget", "1G", "--ctx", 1024, "--temperature", 0, "-n", 8,
                       "--mode", "ar", "--threads", 2)
    try:
        child.sendline("Say hello.")
        child.expect(r"peak ([\d.]+ [KMG]iB) \(plan ([\d.]+ [KMG]iB)\)")
        peak, planned = (_parse_size(child.match.group(i)) for i in (1, 2))
        assert 0 < peak <= 1 << 30 and 0 < planned <= 1 << 30
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    proc = edgespec("chat", "--target", smollm2_path, "--budget", "64M")
    assert proc.returncode == 2 and proc.stderr.startswith("error: nothing fits a budget of 64.0 MiB")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_serve_with_a_budget_reserves_the_prefix_cache_and_reports_peaks(smollm2_path, cal, tmp_path):
    import httpx
    from test_server import free_port, running_server

    log = tmp_path / "serve.log"
    with running_server(log, "--target", smollm2_path, "--budget", "1G", "--ctx", 1024,
                        "--prefix-cache-mb", 64) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Say hello.", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        ext = r.json()["edgespec"]
        assert 0 < ext["predicted_peak_bytes"] <= 1 << 30 and 0 < ext["peak_rss_bytes"] <= 1 << 30
    # 1 GiB less a 960 MiB prefix cache leaves too little for the model: the reservation counts.
    proc = edgespec("serve", "--target", smollm2_path, "--budget", "1G", "--prefix-cache-mb", 960,
                    "--port", free_port())
    assert proc.returncode == 2 and proc.stderr.startswith("error: nothing fits"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# --- persistence with planned settings ---------------------------------------------------------------

def test_saved_session_with_quantized_kv_and_a_draft_continues_identically(smollm2_path, smollm2_draft, tmp_path):
    """Planned settings with a q8_0 cache (flash attention on) for target and draft: save after the
    prompt, restore into a new engine, and the continuation equals an uninterrupted run."""
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.persist import load_state, save_state
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    planned = plan(smollm2_path, smollm2_draft, budget=3 << 30, ctx=1024, sampling=False, hardware=Hardware())
    assert planned.fits and planned.settings.draft

    def engine(kv: str) -> Engine:
        s = replace(planned.settings, type_k=kv, type_v=kv)
        assert s.flash_attn is True
        target = LlamaCppOptions(n_threads=1, **s.target_settings().runtime_options())
        draft = LlamaCppOptions(n_threads=1, **s.draft_settings().runtime_options())
        return Engine(LlamaCppRuntime(smollm2_path, target), LlamaCppRuntime(smollm2_draft, draft))

    cfg = GenerationConfig(max_tokens=16, temperature=0, mode="draft", draft_max=planned.settings.max_draft)
    with engine("q8_0") as a:
        ids = a.prompt_tokens("Describe a lighthouse.")
        uninterrupted = a.generate_tokens(ids, cfg).tokens
        for rt in (a.target, a.draft_runtime):  # the engine's invariant: all but the last prompt token
            rt.truncate(0)
            rt.decode(ids[:-1], 0)
        save_state(tmp_path / "s.state", {"target": a.target, "draft": a.draft_runtime})
    with engine("q8_0") as b:
        load_state(tmp_path / "s.state", {"target": b.target, "draft": b.draft_runtime})
        assert b.target.n_past == b.draft_runtime.n_past == len(ids) - 1
        calls = b.target.n_decode_calls
        assert b.generate_tokens(ids, cfg).tokens == uninterrupted
        assert b.target.n_decode_calls - calls <= len(uninterrupted)  # no prefill: the KV came from the file
    with engine("q4_0") as c:
        with pytest.raises(EdgespecError, match="type_k differs"):
            load_state(tmp_path / "s.state", {"target": c.target, "draft": c.draft_runtime})
        assert c.target.n_past == 0


def test_parallel_slots_plan_one_pool_and_every_slots_rows(smollm2_path, cal):
    """--parallel N: --ctx is the pool the slots share (same KV bytes), N x (k + 1) logits rows per pass,
    flash attention off; a pool too small for the slots is refused in one line."""
    from edgespec.serve.slots import SlotsError

    one = plan(smollm2_path, budget=2 << 30, ctx=4096, hardware=Hardware(), calibration=cal)
    four = plan(smollm2_path, budget=2 << 30, ctx=4096, hardware=Hardware(), calibration=cal, parallel=4)
    assert four.fits and four.settings.parallel == 4 and four.settings.flash_attn is False
    assert four.settings.target_settings().n_outputs_max == 4 * one.settings.target_settings().n_outputs_max
    assert four.prediction.host["target.kv"] == one.prediction.host["target.kv"]
    assert four.prediction.host["verification"] == 4 * one.prediction.host["verification"]
    assert four.predicted_peak_bytes > one.predicted_peak_bytes
    assert any("4 slots of 1024 tokens" in line for line in four.summary_lines())
    with pytest.raises(SlotsError, match="per slot"):
        plan(smollm2_path, budget=2 << 30, ctx=1024, hardware=Hardware(), calibration=cal, parallel=16)
