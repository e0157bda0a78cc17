"""The memory model against what the GGUF files and llama.cpp itself say (unit level, real models)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.errors import EdgespecError
from edgespec.machine.memory import (MiB, Calibration, Hardware, ModelSettings, Setup, compute_buffer_bytes, format_bytes,
                             model_facts, padded_ctx, parse_size, predict, repacked, row_bytes)

X86 = Calibration(build="test", cpu_features=("AVX", "AVX2", "AVX512", "REPACK"))
ARM_DOT = Calibration(build="test", cpu_features=("NEON", "DOTPROD", "REPACK"))


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return model_facts(smollm2_path)


@pytest.fixture(scope="module")
def qwen05():
    from edgespec.models import store

    return model_facts(store.resolve("qwen2.5-coder-0.5b"))


def test_facts_match_the_gguf_geometry(smol, smollm2_path):
    assert (smol.arch, smol.n_layer, smol.n_embd, smol.n_ff) == ("llama", 30, 576, 1536)
    assert (smol.n_head, smol.n_head_kv, smol.head_k, smol.head_v) == (9, 3, 64, 64)
    assert smol.n_vocab == 49152 and smol.n_merges == 48900
    # every tensor's bytes are inside the file, and the tensor data ends at the end of the file
    end = max(t.offset + t.nbytes for t in smol.tensors)
    assert end <= smollm2_path.stat().st_size < end + 64
    assert smol.weight_bytes == sum(t.nbytes for t in smol.tensors) > 90 * MiB


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_kv_bytes_equal_what_llama_cpp_allocates(smol, smollm2_path, kv):
    rt = load_runtime(smollm2_path, n_ctx=1000, type_k=kv, type_v=kv)  # 1000 is padded to 1024
    try:
        assert rt.n_ctx == padded_ctx(1000) == 1024
        assert abs(rt.buffers["CPU KV"] - smol.kv_bytes(1000, kv, kv)) < 0.01 * MiB  # the log rounds to 0.01 MiB
    finally:
        rt.close()


def test_row_bytes_per_cache_type():
    assert row_bytes(256, "f16") == 512
    assert row_bytes(256, "q8_0") == 8 * 34
    assert row_bytes(256, "q4_0") == 8 * 18
    with pytest.raises(EdgespecError, match="multiple of 32"):
        row_bytes(48, "q4_0")


def test_mapped_and_repacked_weights_equal_llama_cpps_buffers(qwen05):
    """The 0.5B model mixes Q5_0, Q8_0, Q6_K and Q4_K: only its Q4_K matrices are repacked on AVX2."""
    rt = load_runtime(qwen05.path, n_ctx=512)
    try:
        from edgespec.machine.memory import _model_terms, calibrate

        cal = calibrate()
        host, dev, _ = _model_terms(qwen05, ModelSettings(n_ctx=512, n_outputs_max=1), cal, Hardware(), "m")
        assert not dev
        if "AVX2" in cal.cpu_features:
            assert sum(1 for t in qwen05.tensors if repacked(t, cal)) == 12
        assert abs(host.get("m.weights_repacked", 0) - rt.buffers.get("CPU_REPACK model", 0)) < 0.01 * MiB
        # the mapped buffer spans every tensor; llama.cpp reports it from the first tensor to the last
        assert abs(host["m.weights_mapped"] - rt.buffers["CPU_Mapped model"]) < 0.01 * MiB + 4096
    finally:
        rt.close()


def test_repack_rules_follow_the_cpu_features(qwen05):
    by_type = {t.type: t for t in qwen05.tensors if t.layer is not None and t.ne1 > 1}
    embd = next(t for t in qwen05.tensors if t.name == "token_embd.weight")
    assert repacked(by_type["Q4_K"], X86) and repacked(by_type["Q4_K"], ARM_DOT)
    assert not repacked(by_type["Q6_K"], X86) and not repacked(by_type["Q8_0"], X86)
    assert not repacked(embd, X86)  # read by row (GET_ROWS), never repacked
    assert not repacked(by_type["Q4_K"], Calibration(build="no-repack", cpu_features=("AVX2",), repack=False))


def test_the_planner_prices_the_flash_attention_the_runtime_gets(smol):
    """One rule (runtimes.base.flash_attention) for the runtime, its dry runs and the planner: the
    caller's choice stands, a quantized V cache turns it on, else llama.cpp decides."""
    cal = Calibration(build="any")
    assert ModelSettings().flash is None and ModelSettings(flash_attn=False).flash is False
    assert ModelSettings(type_k="q8_0", type_v="q4_0").flash is True
    quantized = dict(n_ctx=4096, type_k="q8_0", type_v="q4_0")
    assert compute_buffer_bytes(smol, ModelSettings(**quantized), cal) == \
        compute_buffer_bytes(smol, ModelSettings(**quantized, flash_attn=True), cal)
    assert compute_buffer_bytes(smol, ModelSettings(n_ctx=4096), cal) != \
        compute_buffer_bytes(smol, ModelSettings(n_ctx=4096, flash_attn=False), cal)


def test_compute_buffer_matches_llama_cpp_on_a_model_it_was_not_calibrated_on(qwen05):
    """The scales come from SmolLM2's dry runs; here the 0.5B Qwen at other sizes and KV types."""
    from edgespec.machine.memory import calibrate
    from edgespec.runtimes.llamacpp import dry_run_compute_buffers

    cal = calibrate()
    configs = [dict(n_ctx=c, n_batch=b, n_outputs_max=o, type_k=kv, type_v=kv, flash_attn=None)
               for c, b, o, kv in [(1024, 512, 5, "f16"), (4096, 256, 9, "q8_0"), (2048, 128, 3, "q4_0"),
                                   (1024, 64, 64, "f16")]]
    configs.append(dict(n_ctx=4096, n_batch=128, n_outputs_max=1, type_k="f16", type_v="f16", flash_attn=False))
    for config, buffers in zip(configs, dry_run_compute_buffers(qwen05.path, configs)):
        settings = ModelSettings(**config)
        predicted = compute_buffer_bytes(qwen05, settings, cal)
        assert buffers["n_ctx"] == padded_ctx(config["n_ctx"])
        assert predicted == pytest.approx(buffers["CPU compute"], rel=0.03), config


def test_layer_placement_follows_llama_cpp(smol):
    by_name = {t.name: t for t in smol.tensors}
    embd, blk0, last = by_name["token_embd.weight"], by_name["blk.0.attn_q.weight"], by_name["blk.29.attn_q.weight"]
    norm = by_name["output_norm.weight"]
    assert smol.placement(embd, -1) == "cpu"                     # the input layer never moves
    assert smol.placement(blk0, -1) == smol.placement(last, -1) == "gpu"
    assert smol.placement(norm, 1) == "gpu" and smol.placement(last, 1) == "cpu"  # 1 layer: the output one
    assert smol.placement(last, 2) == "gpu" and smol.placement(blk0, 2) == "cpu"
    assert smol.placement(blk0, 0) == "cpu"


def test_discrete_gpu_splits_weights_kv_and_compute(smol):
    gpu = Hardware("discrete", ram_bytes=16 << 30, gpu_bytes=8 << 30)
    full = ModelSettings(n_ctx=2048, n_gpu_layers=-1, n_outputs_max=5)
    p = predict(Setup(smol, full, max_draft=4, hardware=gpu), X86)
    non_embd = sum(t.nbytes for t in smol.tensors if not t.name.startswith("token_embd"))
    embd = next(t for t in smol.tensors if t.name == "token_embd.weight")
    # SmolLM2 ties its output to token_embd: llama.cpp loads a second copy as the output matrix on the
    # GPU (measured on its Vulkan backend, tests/test_vulkan.py)
    assert not any(t.name == "output.weight" for t in smol.tensors)
    assert p.device["target.weights"] == non_embd + embd.nbytes
    assert p.device["target.kv"] == smol.kv_bytes(2048) and "target.kv" not in p.host
    assert p.host["target.weights_mapped"] >= embd.nbytes  # token embeddings stay mapped in host RAM
    assert p.host["target.weights_mapped"] < smol.weight_bytes / 2
    host_kv = predict(Setup(smol, ModelSettings(n_ctx=2048, n_gpu_layers=-1, offload_kqv=False), hardware=gpu), X86)
    assert host_kv.host["target.kv"] == smol.kv_bytes(2048) and "target.kv" not in host_kv.device
    half = predict(Setup(smol, ModelSettings(n_ctx=2048, n_gpu_layers=16), hardware=gpu), X86)  # 15 blocks + output
    assert half.device["target.kv"] == smol.kv_bytes(2048, layers=15)
    assert half.host["target.kv"] == smol.kv_bytes(2048, layers=15)


def test_unified_memory_counts_one_pool_and_metal_maps_weights_once(smol):
    settings = ModelSettings(n_ctx=2048, n_gpu_layers=-1)
    jetson = predict(Setup(smol, settings, hardware=Hardware("unified", ram_bytes=8 << 30)), X86)
    apple = predict(Setup(smol, settings, hardware=Hardware("unified", ram_bytes=8 << 30, zero_copy_weights=True)), X86)
    assert jetson.peak_bytes == jetson.host_peak_bytes + jetson.device_peak_bytes
    assert "target.weights" in jetson.device and "target.weights" not in apple.device
    assert apple.host["target.weights_mapped"] >= smol.weight_bytes - 64 * 1024  # mapped once, used in place
    assert apple.peak_bytes < jetson.peak_bytes


def test_verification_rows_grow_with_the_draft_length(smol):
    s = ModelSettings(n_ctx=1024)
    rows = [predict(Setup(smol, ModelSettings(n_ctx=1024, n_outputs_max=k + 1), max_draft=k, sampling=False),
                    X86).host["verification"] for k in (1, 4, 8)]
    assert rows[0] < rows[1] < rows[2]
    assert rows[1] == pytest.approx(X86.row_copies * 5 * smol.n_vocab * 4)
    assert predict(Setup(smol, s), X86).host["target.output"] == smol.n_vocab * 4


def test_the_runtime_refuses_more_logits_rows_than_planned(smollm2_path):
    rt = load_runtime(smollm2_path, n_ctx=512, n_outputs_max=3)
    try:
        rt.decode([1, 2, 3], 3)
        with pytest.raises(EdgespecError, match="sized for 3"):
            rt.decode([4, 5, 6, 7], 4)
    finally:
        rt.close()


def test_parse_and_format_sizes():
    assert parse_size("2G") == parse_size("2GiB") == parse_size("2 gb") == 2 << 30
    assert parse_size("800M") == 800 << 20 and parse_size("1.5G") == int(1.5 * (1 << 30))
    assert parse_size("123456") == 123456
    with pytest.raises(EdgespecError, match="800M"):
        parse_size("lots")
    assert format_bytes(1536 * MiB) == "1.50 GiB" and format_bytes(300 * MiB) == "300.0 MiB"


def test_padded_ctx_rounds_like_llama_cpp(smollm2_path):
    rt = load_runtime(smollm2_path, n_ctx=64)
    try:
        assert rt.n_ctx == padded_ctx(64) == 256
    finally:
        rt.close()
    assert padded_ctx(1025) == 1280 and padded_ctx(4096) == 4096


# --- the run-time guard ------------------------------------------------------------------------

def resident_ballast(nbytes: int):
    """Fresh anonymous pages, written so they are resident (a freed heap could hand back pages that are
    resident already, which would not raise the resident set)."""
    import mmap

    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, 4096):
        block[offset] = 1
    return block


def test_cap_choice_shortens_or_drops_the_draft():
    from edgespec.drafters import Draft
    from edgespec.machine.guard import cap_choice
    from edgespec.policy import Choice

    proposal = Draft(np.arange(6, dtype=np.int32))
    c = Choice(drafter=object(), k=6, draft=proposal)
    assert cap_choice(c, None) is c
    short = cap_choice(c, 2)
    assert short.k == 2 and list(short.draft.tokens) == [0, 1]
    off = cap_choice(c, 0)
    assert off.drafter is None and off.k == 0
    assert cap_choice(Choice(drafter=object(), k=2), 4).k == 2


def test_guard_drops_the_draft_then_stops():
    """Pressure is real: the budget is set just under what this process holds now. The draft length is
    kept (halving it freed nothing: llama.cpp sizes its buffers at load); the draft goes, then work stops."""
    from edgespec.machine.guard import MemoryBudgetError, MemoryGuard, trim_heap
    from edgespec.machine.memory import current_rss

    dropped = []
    trim_heap()  # what the guard trims after a step is trimmed already
    guard = MemoryGuard(int(current_rss() / 0.98), max_draft=4, release_draft=lambda: dropped.append(True))
    assert guard.check() == 4 and dropped == [True]
    assert not guard.admitting  # still over the soft line with nothing left: no new requests
    ballast = resident_ballast(max(0, guard.budget_bytes - current_rss()) + 8 * MiB)
    with pytest.raises(MemoryBudgetError, match="nothing left to free"):
        guard.check()
    ballast.close()
    assert [e.split(": ")[-1].split(" (")[0] for e in guard.events] == [
        "unloaded the draft model", "stopped admitting new requests", "stopped"]


def test_guard_without_pressure_keeps_the_plan():
    from edgespec.machine.guard import MemoryGuard
    from edgespec.machine.memory import current_rss

    guard = MemoryGuard(current_rss() * 4, max_draft=3)
    assert [guard.check() for _ in range(3)] == [3, 3, 3] and not guard.events
    assert guard.peak_rss_bytes >= current_rss() // 2


def test_guard_reads_device_memory_through_llama_cpp(monkeypatch):
    """Under --gpu-budget the guard asks llama.cpp's device memory query (any backend, no NVML): the
    drop in the device's free memory since the baseline is this process's use. A driver that reports
    its heap as free (no usage query) falls back to what llama.cpp allocated there."""
    from edgespec.machine import guard as guard_module
    from edgespec.machine.guard import MemoryGuard
    from edgespec.machine.memory import current_rss
    from edgespec.runtimes import llamacpp

    free = {"Vulkan0": 1000 * MiB}
    monkeypatch.setattr(llamacpp, "offload_devices", lambda: [
        {"name": n, "type": "gpu", "memory_free_bytes": f, "memory_total_bytes": 1024 * MiB} for n, f in free.items()])
    assert guard_module.device_memory() == {"Vulkan0": (1000 * MiB, 1024 * MiB)}
    guard = MemoryGuard(current_rss() * 4, gpu_budget_bytes=100 * MiB, max_draft=4,
                        device_baseline=guard_module.device_memory())
    assert guard.device_memory_source == "llama.cpp"
    free["Vulkan0"] = 950 * MiB  # 50 MiB of 100 in use: no pressure
    assert guard.check() == 4 and guard.peak_gpu_bytes == 50 * MiB
    free["Vulkan0"] = 902 * MiB  # 98 of 100, nothing to free: no new requests
    assert guard.check() == 4 and not guard.admitting and "GPU 98.0 MiB of 100.0 MiB" in guard.events[-1]

    free["Vulkan0"] = 1024 * MiB  # a driver without a usage query: free == total, always
    held = [30 * MiB]
    heap = MemoryGuard(current_rss() * 4, gpu_budget_bytes=100 * MiB, max_draft=4, device_allocated=lambda: held[0])
    assert heap.device_memory_source == "llama.cpp buffers" and heap.check() == 4
    held[0] = 99 * MiB
    assert heap.check() == 4 and not heap.admitting and heap.peak_gpu_bytes == 99 * MiB
    monkeypatch.setattr(llamacpp, "offload_devices", lambda: [])
    assert MemoryGuard(current_rss() * 4, gpu_budget_bytes=MiB).device_memory_source in (None, "nvml")
