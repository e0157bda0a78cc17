"""llama.cpp's Vulkan backend, executed: layers, KV and compute on a Vulkan device.

These run only in a Vulkan build of llama-cpp-python (`bash scripts/install.sh --vulkan`, then
`scripts/test_vulkan.sh`, which runs this file in `.venv-vulkan`); elsewhere the module is skipped with
the reason. On the project's machines the device is Mesa's software Vulkan device (lavapipe,
"llvmpipe"): no GPU, but every offload, device buffer and memory query goes through llama.cpp's real
Vulkan backend. llama.cpp skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them,
hence the default below (it must be set before llama.cpp enumerates its devices).

The reference for exactness is the same model on the CPU: the CPU build lives in another venv, so
the reference is this build with n_gpu_layers=0 and no offload device (`devices=()`), where llama.cpp
computes everything with its CPU backend (n_gpu_layers=0 alone still lets it run large-batch matmuls
on the device and reserve a compute buffer there; the device holds nothing with both, tested below).
"""

from __future__ import annotations

import os

os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")

import asyncio  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

llamacpp = pytest.importorskip("edgespec.runtimes.llamacpp", reason="llama-cpp-python is not installed")
VULKAN = [d for d in llamacpp.offload_devices() if d["backend"] == "Vulkan"]
if not VULKAN:
    pytest.skip("this llama.cpp build has no Vulkan device (build it with `bash scripts/install.sh --vulkan`, "
                "run scripts/test_vulkan.sh; Linux needs a Vulkan driver, e.g. Mesa's lavapipe)",
                allow_module_level=True)

from conftest import load_runtime  # noqa: E402
from edgespec.engine import Engine, GenerationConfig  # noqa: E402
from lossless import compare_greedy  # noqa: E402

DEVICE = VULKAN[0]
# Flash attention on the device is off in these tests: with it (llama.cpp's auto choice), llama.cpp
# 0.3.36's Vulkan backend on Mesa 22.3's lavapipe crashes (SIGSEGV in llama_decode), now and then, on
# the first multi-token decode after the KV cache was truncated (bench/VULKAN_RESULTS.md has the repro).
NO_FA = {"flash_attn": False}
ON_DEVICE = DEVICE["name"]  # "Vulkan0": the prefix of llama.cpp's buffer names on the device
MiB = 1 << 20


def _device_buffers(rt) -> dict[str, int]:
    """llama.cpp's own device buffers of a runtime: {"model": bytes, "KV": ..., "compute": ...}."""
    return {k.split(" ", 1)[1]: v for k, v in rt.buffers.items() if k.split(" ", 1)[0] == ON_DEVICE}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[295] + rng.integers(32, 127, size=12).tolist() for _ in range(n)]  # BOS and printable bytes


def _cpu_plain(path, prompts, max_tokens, **options) -> tuple[object, list[list[int]]]:
    """The CPU reference runtime (kept open for compare_greedy) and its plain greedy outputs."""
    ref = load_runtime(path, n_gpu_layers=0, devices=(), **options)
    engine = Engine(ref)
    cfg = GenerationConfig(max_tokens=max_tokens, temperature=0, mode="ar")
    return ref, [engine.generate_tokens(ids, cfg).tokens for ids in prompts]


def _check(engine, ref, prompts, plain, cfg) -> int:
    identical = 0
    for ids, want in zip(prompts, plain):
        got = engine.generate_tokens(ids, cfg).tokens
        cmp = compare_greedy(ref, ids, want, got)
        assert cmp.near_tie, f"{cfg.mode}: diverges from the CPU at {cmp.first_divergence}, gap {cmp.gap}"
        identical += cmp.identical
    return identical


# --- the device and its buffers ---------------------------------------------------------------------


def test_the_device_is_listed_with_its_memory():
    assert DEVICE["type"] in ("gpu", "igpu") and DEVICE["memory_total_bytes"] > 0
    assert 0 < DEVICE["memory_free_bytes"] <= DEVICE["memory_total_bytes"]
    print(f"\n{ON_DEVICE}: {DEVICE['description']} ({DEVICE['type']}), "
          f"{DEVICE['memory_free_bytes'] / MiB:.0f} MiB free of {DEVICE['memory_total_bytes'] / MiB:.0f} MiB")


def test_offload_places_layers_on_the_device(tiny_pair):
    with load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=-1, **NO_FA) as full, \
            load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=1, **NO_FA) as partial, \
            load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=0, devices=()) as cpu:
        f, p = _device_buffers(full), _device_buffers(partial)
        assert {"model", "KV", "compute"} <= set(f), full.buffers
        assert 0 < p["model"] < f["model"] and p.get("KV", 0) < f["KV"]  # 1 of 3 (2 layers + output)
        assert _device_buffers(cpu) == {}  # the reference computes on the CPU only


# --- exactness against the CPU ------------------------------------------------------------------------

PLACEMENTS = [  # (target's n_gpu_layers, draft's)
    pytest.param(-1, 0, id="target-on-device-draft-on-cpu"),
    pytest.param(0, -1, id="target-on-cpu-draft-on-device"),
    pytest.param(-1, -1, id="both-on-device"),
    pytest.param(1, 2, id="both-partial"),
]


@pytest.mark.parametrize("target_gpu,draft_gpu", PLACEMENTS)
def test_greedy_speculation_on_the_device_equals_the_cpu(tiny_pair, target_gpu, draft_gpu):
    prompts = _prompts(6)
    ref, plain = _cpu_plain(tiny_pair["target"], prompts, 40, n_ctx=512)
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=target_gpu, **NO_FA),
                load_runtime(tiny_pair["good_draft"], n_ctx=512, n_gpu_layers=draft_gpu, **NO_FA)) as engine:
        ar = _check(engine, ref, prompts, plain, GenerationConfig(max_tokens=40, temperature=0, mode="ar"))
        draft = _check(engine, ref, prompts, plain, GenerationConfig(max_tokens=40, temperature=0, mode="draft",
                                                                     draft_max=4))
        lookup = _check(engine, ref, prompts, plain, GenerationConfig(max_tokens=40, temperature=0, mode="lookup",
                                                                      draft_max=3))
    ref.close()
    print(f"\nngl target {target_gpu} draft {draft_gpu}: identical ar {ar}/6, draft {draft}/6, lookup {lookup}/6")
    assert ar + draft + lookup >= 15


def test_token_trees_on_the_device_equal_the_cpu(tiny_pair):
    """Auto on a flat (GPU-like) profile verifies trees: one device pass over several branches."""
    from edgespec.machine.profile import CostProfile

    prompts = _prompts(6, seed=1)
    ref, plain = _cpu_plain(tiny_pair["target"], prompts, 40, n_ctx=512)
    trees = []
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512, n_seq_max=4, n_gpu_layers=-1, **NO_FA),
                load_runtime(tiny_pair["good_draft"], n_ctx=512, n_gpu_layers=-1, **NO_FA)) as engine:
        engine._profile = CostProfile({n: 0.01 for n in (1, 2, 4, 8, 16)}, 0.001, 0.0012, 0.00005)
        cfg = GenerationConfig(max_tokens=40, temperature=0, mode="auto")
        for ids, want in zip(prompts, plain):
            result = engine.generate_tokens(ids, cfg)
            trees.append(result.stats.tree_rounds)
            assert compare_greedy(ref, ids, want, result.tokens).near_tie
    ref.close()
    assert sum(1 for n in trees if n) >= 3, trees


def test_parallel_slots_on_the_device_equal_the_cpu(tiny_pair):
    """`serve --parallel`: four slots share each device pass; each output is its own CPU greedy output."""
    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions
    from edgespec.serve.slots import ParallelEngine, SlotScheduler

    prompts = _prompts(4, seed=2)
    ref, plain = _cpu_plain(tiny_pair["target"], prompts, 24, n_ctx=512)
    options = LlamaCppOptions(n_ctx=1024, n_threads=2, n_gpu_layers=-1, **NO_FA)
    work = [(i, mode) for i in range(len(prompts)) for mode in ("draft", "lookup")]
    with ParallelEngine(LlamaCppMultiSeqRuntime(tiny_pair["target"], options, n_seq=4),
                        LlamaCppMultiSeqRuntime(tiny_pair["good_draft"], options, n_seq=4), slot_ctx=256) as engine:
        scheduler = SlotScheduler(engine, max_queue=8)

        async def run_all():
            return await asyncio.gather(*[scheduler.generate(prompts[i], GenerationConfig(
                max_tokens=24, temperature=0, mode=mode, draft_max=3)) for i, mode in work])

        try:
            results = asyncio.run(run_all())
        finally:
            scheduler.close()
        counters = dict(scheduler.counters)
    for (i, mode), r in zip(work, results):
        cmp = compare_greedy(ref, prompts[i], plain[i], r.tokens)
        assert cmp.near_tie, (i, mode, cmp)
    ref.close()
    assert counters["max_active"] >= 2 and counters["batched_steps"] > 0, counters


# --- the profile: the device's cost curve, and auto on it --------------------------------------------


def test_the_profile_measures_the_device_and_auto_uses_it(tiny_pair, tmp_path, monkeypatch):
    from edgespec.machine import hardware
    from edgespec.machine.profile import load_or_measure

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    report = hardware.detect(onnxruntime=False)
    key = hardware.device_key(report)
    assert key.startswith("vulkan-") and hardware.memory_kind(report) == "discrete", key
    assert hardware.default_gpu_layers(report) == -1
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=-1, **NO_FA),
                load_runtime(tiny_pair["good_draft"], n_ctx=512, n_gpu_layers=-1, **NO_FA)) as engine:
        profile, measured = load_or_measure(engine.target, engine.draft_runtime)
        assert measured and profile.key["device"] == key and profile.key["target"]["gpu_layers"] == -1
        assert all(t > 0 for t in profile.verify_s.values()) and profile.draft_s > 0
        print(f"\n{key}: verify_s {{{', '.join(f'{n}: {t * 1e3:.2f} ms' for n, t in profile.verify_s.items())}}}, "
              f"draft {profile.draft_s * 1e3:.2f} ms")
        result = engine.generate_tokens(_prompts(1)[0], GenerationConfig(max_tokens=30, temperature=0, mode="auto"))
        assert engine.cost_profile() is not None and engine.cost_profile().key == profile.key  # auto read the curve
        assert result.stats.generated == 30 or result.stats.generated > 0
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512, n_gpu_layers=0, devices=())) as cpu:
        cpu_profile, _ = load_or_measure(cpu.target, None)
        assert "gpu_layers" not in cpu_profile.key["target"]  # a CPU placement has its own curve


# --- device memory: predicted, reported, budgeted ----------------------------------------------------


def _hardware():
    from edgespec.machine.memory import Hardware

    return Hardware.detect()


def test_device_memory_prediction_matches_llamas_device_buffers(smollm2_path):
    """The planner's device terms (weights, KV, compute) against the sizes llama.cpp logs for its
    device buffers, within 10 % each, for full and partial offload."""
    from edgespec.machine.memory import ModelSettings, Setup, calibrate, model_facts, predict

    hw = _hardware()
    assert hw.kind == "discrete" and hw.gpu_bytes == DEVICE["memory_total_bytes"]
    facts = model_facts(smollm2_path)
    cal = calibrate()
    for ngl in (-1, facts.n_layer // 2):
        settings = ModelSettings(n_ctx=1024, n_batch=512, n_outputs_max=5, n_gpu_layers=ngl, **NO_FA)
        pred = predict(Setup(target=facts, target_settings=settings, hardware=hw, max_draft=4), cal)
        with load_runtime(smollm2_path, **settings.runtime_options()) as rt:
            got = _device_buffers(rt)
        print(f"\nngl {ngl}: predicted {({k: round(v / MiB, 2) for k, v in pred.device.items()})} MiB, "
              f"llama.cpp {({k: round(v / MiB, 2) for k, v in got.items()})} MiB")
        for term, buffer in (("target.weights", "model"), ("target.kv", "KV"), ("target.compute", "compute")):
            assert got[buffer] == pytest.approx(pred.device[term], rel=0.10), (ngl, term, pred.device, got)


def test_gpu_budget_forces_partial_offload_and_is_watched_on_the_device(smollm2_path):
    """--gpu-budget below the full model: the plan offloads only some layers, the loaded device buffers
    fit the budget, and the guard reads device memory through llama.cpp (not NVML)."""
    from edgespec.machine.memory import calibrate, model_facts
    from edgespec.machine.planner import apply_budget, plan

    facts = model_facts(smollm2_path)
    full = plan(smollm2_path, budget=4 << 30, ctx=1024, max_draft=4, hardware=_hardware(), calibration=calibrate())
    assert full.fits and full.settings.target_gpu_layers == -1  # the whole model fits the device's 2 GiB
    gpu_budget = int(full.prediction.device_peak_bytes * 0.75)  # a quarter short of full offload
    engine, the_plan = apply_budget(smollm2_path, None, budget="4G", gpu_budget=gpu_budget, ctx=1024, max_draft=4,
                                n_threads=2)
    with engine:
        s = the_plan.settings
        assert the_plan.fits and 0 < s.target_gpu_layers < facts.n_layer + 1, the_plan.summary_lines()
        held = sum(_device_buffers(engine.target).values())
        assert 0 < held <= gpu_budget, (held, gpu_budget)
        assert held == pytest.approx(the_plan.prediction.device_peak_bytes - the_plan.prediction.device.get("gpu_runtime", 0),
                                     rel=0.10)
        guard = engine.memory_guard
        # a driver with a usage query is read directly; lavapipe reports its heap as free (free == total,
        # unchanging), so there the guard counts llama.cpp's allocations on the device
        heap_only = DEVICE["memory_free_bytes"] == DEVICE["memory_total_bytes"]
        assert guard.device_memory_source == ("llama.cpp buffers" if heap_only else "llama.cpp")
        result = engine.generate_tokens(_prompts(1)[0], GenerationConfig(max_tokens=4, temperature=0, mode="ar"))
        assert result.stats.generated == 4
        if heap_only:
            assert guard.peak_gpu_bytes == held
        print(f"\n--gpu-budget {gpu_budget / MiB:.1f} MiB: {s.target_gpu_layers} of {facts.n_layer + 1} layers "
              f"on {ON_DEVICE}, device buffers {held / MiB:.1f} MiB; guard saw {guard.peak_gpu_bytes} bytes")
