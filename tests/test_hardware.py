"""Hardware detection, recorded samples of other platforms, `edgespec doctor --json`'s schema.

Detection is checked against this machine's own sources (a CPU-only Linux box); Apple, Jetson and
NVML parsing against the samples in tests/data/hardware (see its README for where each came from).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.machine import advice
from edgespec.machine import hardware
from edgespec.machine.hardware import (CoreMLInfo, GPUProbe, HardwareReport, LlamaCppInfo, default_gpu_layers, detect,
                               device_key, memory_kind)

DATA = Path(__file__).parent / "data" / "hardware"
REPO = Path(__file__).resolve().parents[1]
LINUX = platform.system() == "Linux"


# --- a fake pynvml that serves a recorded answer ----------------------------------------------


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Stands in for the `pynvml` module: the same function names, answers from a JSON sample."""

    NVMLError = FakeNVMLError

    def __init__(self, sample: dict | None = None, init_error: str | None = None):
        self.sample, self.init_error = sample or {}, init_error
        self.calls: list[str] = []

    @staticmethod
    def _value(v):
        return v[len("bytes:"):].encode() if isinstance(v, str) and v.startswith("bytes:") else v

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return self._value(self.sample["nvmlSystemGetDriverVersion"])

    def nvmlSystemGetCudaDriverVersion(self):
        return self.sample["nvmlSystemGetCudaDriverVersion"]

    def nvmlDeviceGetCount(self):
        return len(self.sample["devices"])

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.sample["devices"][i]

    def nvmlDeviceGetName(self, h):
        return self._value(h["nvmlDeviceGetName"])

    def nvmlDeviceGetMemoryInfo(self, h):
        m = h["nvmlDeviceGetMemoryInfo"]
        if m is None:
            raise FakeNVMLError("Not Supported")
        return type("c_nvmlMemory_t", (), m)()

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return tuple(h["nvmlDeviceGetCudaComputeCapability"])


def _sample(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def here() -> HardwareReport:
    return detect()


# --- this machine -------------------------------------------------------------------------------


@pytest.mark.skipif(not LINUX, reason="checks Linux sources")
def test_cpu_matches_this_machine(here):
    import psutil

    cpu = here.cpu
    assert cpu.logical_cores == os.cpu_count()
    assert cpu.physical_cores == psutil.cpu_count(logical=False)
    assert cpu.usable_cores == len(os.sched_getaffinity(0))
    assert cpu.sources["logical_cores"] == "/proc/cpuinfo"
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split()) \
        if platform.machine() == "x86_64" else set()
    for feature in ("avx", "avx2", "avx512f", "avx512_vnni", "amx_int8"):
        assert (feature in cpu.simd) == (feature in flags), feature
    assert cpu.simd_level == hardware.simd_level(cpu.simd) != "generic"
    assert cpu.unavailable == {}


@pytest.mark.skipif(not LINUX, reason="checks Linux sources")
def test_memory_matches_proc_meminfo(here):
    total_kb = int(re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1))
    assert here.memory.total_bytes == total_kb * 1024
    assert here.memory.sources["total_bytes"] == "/proc/meminfo"
    assert 0 < here.memory.available_bytes <= here.memory.total_bytes
    assert here.memory.usable_bytes <= here.memory.total_bytes


@pytest.mark.skipif(not LINUX, reason="checks Linux sources")
def test_gpus_apple_jetson_on_this_machine(here):
    if Path("/proc/driver/nvidia").exists():  # on a GPU machine the driver's presence must show up
        assert here.gpus.status in ("ok", "unavailable") and here.gpus.devices
    else:
        assert here.gpus.status == "none" and here.gpus.devices == []
        assert "/proc/driver/nvidia absent" in here.gpus.reason
    assert here.apple is None
    assert here.jetson is None
    assert here.coreml.can_run is False and "Apple" in here.coreml.reason


def test_llama_cpp_build_is_reported(here):
    llama = here.llama_cpp
    assert llama.version == "0.3.36"
    assert llama.status == "ok", llama.reason
    assert "CPU" in llama.backends
    assert isinstance(llama.gpu_offload, bool)
    if not here.gpus.devices:  # this machine: a CPU build, no GPU -> nothing offloads
        assert default_gpu_layers(here) == 0
        assert memory_kind(here) == "cpu"
        assert device_key(here) == f"cpu-{here.cpu.simd_level}-{here.cpu.usable_cores}t"


# --- parsing recorded samples ------------------------------------------------------------------


def test_parse_cpuinfo_x86_sample():
    info = hardware.parse_cpuinfo((DATA / "cpuinfo_xeon_2vcpu.txt").read_text())
    assert info["name"] == "Intel(R) Xeon(R) Processor"
    assert info["logical"] == 2 and info["physical"] == 2
    assert {"avx2", "avx512f", "avx512_vnni", "amx_int8"} <= set(info["simd"])
    assert hardware.simd_level(info["simd"]) == "amx"


def test_parse_cpuinfo_smt_counts_physical_cores():
    block = "processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {c}\nflags\t\t: sse4_2 avx avx2 fma\n"
    text = "\n".join(block.format(i=i, c=c) for i, c in enumerate([0, 1, 0, 1]))
    info = hardware.parse_cpuinfo(text)
    assert info["logical"] == 4 and info["physical"] == 2
    assert hardware.simd_level(info["simd"]) == "avx2"


def test_parse_cpuinfo_arm_sample():
    info = hardware.parse_cpuinfo((DATA / "cpuinfo_cortex_a78ae.txt").read_text())
    assert info["logical"] == 2
    assert info["physical"] is None  # ARM cpuinfo has no topology: not guessed
    assert {"neon", "dotprod", "fp16"} <= set(info["simd"]) and "i8mm" not in info["simd"]
    assert hardware.simd_level(info["simd"]) == "dotprod"


def test_parse_sysctl_m2_sample():
    sysctl = hardware.parse_sysctl((DATA / "sysctl_m2.txt").read_text())
    assert sysctl["hw.memsize"] == "17179869184"
    assert sysctl["machdep.cpu.brand_string"] == "Apple M2"
    displays = hardware.parse_system_profiler_displays((DATA / "system_profiler_displays_m2.txt").read_text())
    assert displays == {"chipset": "Apple M2", "gpu_cores": 10, "metal": "Metal 3"}
    apple = hardware.apple_from_sources(sysctl, displays)
    assert (apple.chip, apple.unified_memory_bytes, apple.performance_cores, apple.efficiency_cores,
            apple.gpu_cores, apple.metal, apple.macos_version) == \
        ("Apple M2", 17179869184, 4, 4, 10, "Metal 3", "14.5")
    assert apple.sources["unified_memory_bytes"] == "sysctl hw.memsize"
    assert apple.unavailable == {}
    assert hardware.simd_from_sysctl(sysctl) == ["neon", "dotprod", "i8mm", "bf16", "fp16"]  # FEAT_SME: 0

    cpu = hardware.detect_cpu(system="Darwin", sysctl=sysctl)
    assert (cpu.name, cpu.logical_cores, cpu.physical_cores, cpu.simd_level) == ("Apple M2", 8, 8, "i8mm")
    mem = hardware.detect_memory(system="Darwin", sysctl=sysctl)
    assert mem.total_bytes == 17179869184 and mem.sources["total_bytes"] == "sysctl hw.memsize"


def test_apple_without_system_profiler_says_so():
    apple = hardware.apple_from_sources({"machdep.cpu.brand_string": "Apple M2"}, None,
                                        "unavailable: `system_profiler` not found on PATH")
    assert apple.chip == "Apple M2" and apple.metal is None
    assert apple.unavailable["metal"] == "unavailable: `system_profiler` not found on PATH"
    assert apple.unavailable["unified_memory_bytes"] == "unavailable: sysctl has no hw.memsize"


def test_parse_nv_tegra_release():
    text = (DATA / "jetson_agx_orin_jp512/etc/nv_tegra_release").read_text()
    assert hardware.parse_nv_tegra_release(text) == {
        "l4t_release": "35.4.1", "gcid": "33958178", "board": "t186ref", "eabi": "aarch64",
        "date": "Tue Aug  1 19:57:35 UTC 2023"}
    assert hardware.parse_nv_tegra_release("# R32 (release), REVISION: 7.1")["l4t_release"] == "32.7.1"
    assert hardware.parse_nv_tegra_release("# R36 (release), REVISION: 4")["l4t_release"] == "36.4.0"
    assert hardware.parse_nv_tegra_release("not a release file") == {}


def test_parse_jetson_model_and_compatible():
    root = DATA / "jetson_agx_orin_jp512/proc/device-tree"
    assert hardware.parse_jetson_model((root / "model").read_text()) == "NVIDIA Jetson AGX Orin Developer Kit"
    assert hardware.parse_device_tree_compatible((root / "compatible").read_text()) == "tegra234"
    assert hardware.parse_jetson_model("\x00") is None


def test_detect_jetson_agx_orin_jetpack5():
    j = hardware.detect_jetson(DATA / "jetson_agx_orin_jp512")
    assert (j.model, j.soc, j.l4t_release, j.jetpack, j.board, j.cuda_arch, j.cuda_version) == \
        ("NVIDIA Jetson AGX Orin Developer Kit", "tegra234", "35.4.1", "5.1.2", "t186ref", "87", "11.4.19")
    assert j.unified_memory_bytes == 63900180 * 1024
    assert j.sources["jetpack"] == "/var/lib/dpkg/status (nvidia-jetpack)"
    assert j.sources["l4t_release"] == "/etc/nv_tegra_release"
    assert j.unavailable == {}


def test_detect_jetson_orin_nano_jetpack6_from_tables():
    j = hardware.detect_jetson(DATA / "jetson_orin_nano_jp62")
    assert (j.l4t_release, j.jetpack, j.cuda_arch, j.soc) == ("36.4.3", "6.2", "87", None)
    assert "L4T_TO_JETPACK" in j.sources["jetpack"]
    assert "model name" in j.sources["cuda_arch"]
    assert set(j.unavailable) == {"soc", "cuda_version"}
    assert all(v.startswith("unavailable:") for v in j.unavailable.values())


def test_unknown_l4t_release_is_not_guessed(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R99 (release), REVISION: 1.0, BOARD: generic\n")
    j = hardware.detect_jetson(tmp_path)
    assert j.l4t_release == "99.1.0" and j.jetpack is None
    assert "not in edgespec's JetPack table" in j.unavailable["jetpack"]
    assert j.model is None and "does not exist" in j.unavailable["model"]


def test_nvml_sample_h200():
    fake = FakeNVML(_sample("nvml_h200.json"))
    probe = hardware.nvml_gpus(fake)
    assert probe.status == "ok" and probe.source == "nvml"
    [g] = probe.devices
    assert (g.name, g.memory_total_bytes, g.driver_version, g.cuda_driver_version, g.compute_capability, g.sm) == \
        ("NVIDIA H200", 150754820096, "550.90.07", "12.4", "9.0", "90")
    assert fake.calls == ["init", "shutdown"]


def test_nvml_sample_bytes_answers_and_two_gpus():
    probe = hardware.nvml_gpus(FakeNVML(_sample("nvml_2x_rtx4090_bytes.json")))
    assert [g.name for g in probe.devices] == ["NVIDIA GeForce RTX 4090"] * 2
    assert [g.index for g in probe.devices] == [0, 1]
    assert probe.devices[0].driver_version == "535.183.01" and probe.devices[0].compute_capability == "8.9"


def test_nvml_partial_answer_is_reported():
    sample = _sample("nvml_h200.json")
    sample["devices"][0]["nvmlDeviceGetMemoryInfo"] = None
    [g] = hardware.nvml_gpus(FakeNVML(sample)).devices
    assert g.memory_total_bytes is None and "Not Supported" in g.unavailable["memory_total_bytes"]
    assert g.name == "NVIDIA H200"


def test_nvml_init_failure_and_driver_fallback(tmp_path):
    probe = hardware.nvml_gpus(FakeNVML(init_error="Driver Not Loaded"))
    assert probe.status == "unavailable" and "Driver Not Loaded" in probe.reason

    # no driver at all: "none", saying why
    probe = hardware.detect_gpus(tmp_path, nvml=FakeNVML(init_error="Driver Not Loaded"))
    assert probe.status == "none" and probe.devices == [] and "Driver Not Loaded" in probe.reason
    probe = hardware.detect_gpus(tmp_path, nvml=False)
    assert probe.status == "none" and "nvidia-ml-py not installed" in probe.reason

    # a driver but no NVML: names from /proc, the rest reported missing
    gpu = tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 123\nBus Type: \t PCIe\n")
    probe = hardware.detect_gpus(tmp_path, nvml=False)
    assert probe.status == "unavailable" and "nvidia-ml-py not installed" in probe.reason
    [g] = probe.devices
    assert g.name == "NVIDIA H200" and g.memory_total_bytes is None
    assert g.source.endswith("/information") and g.unavailable["compute_capability"].startswith("unavailable:")


def test_parse_llama_system_info():
    cuda = hardware.parse_llama_system_info((DATA / "llama_system_info_cuda.txt").read_text())
    assert list(cuda) == ["CUDA", "CPU"]
    assert cuda["CUDA"]["ARCHS"] == "900" and cuda["CPU"]["AVX512"] == "1"
    assert hardware.parse_llama_system_info("") == {}


# --- what cannot be read is said, not crashed on -------------------------------------------------


def test_unreadable_sources_are_reported(tmp_path):
    (tmp_path / "proc/cpuinfo").mkdir(parents=True)  # a directory where a file should be: read fails
    (tmp_path / "proc/meminfo").mkdir(parents=True)
    cpu = hardware.detect_cpu(tmp_path, system="Linux")
    assert cpu.name is None
    assert cpu.unavailable["name"].startswith("unavailable: cannot read /proc/cpuinfo")
    assert cpu.logical_cores == os.cpu_count() and cpu.sources["logical_cores"] == "os.cpu_count()"
    mem = hardware.detect_memory(tmp_path, system="Linux")
    assert mem.total_bytes and mem.sources["total_bytes"] == "psutil.virtual_memory()"

    (tmp_path / "etc/nv_tegra_release").mkdir(parents=True)
    j = hardware.detect_jetson(tmp_path)
    assert j is not None and j.l4t_release is None
    assert j.unavailable["l4t_release"].startswith("unavailable: cannot read /etc/nv_tegra_release")


def test_missing_sources_are_reported(tmp_path):
    cpu = hardware.detect_cpu(tmp_path, system="Linux")
    assert cpu.unavailable["simd"] == "unavailable: /proc/cpuinfo does not exist"
    assert cpu.simd == [] and cpu.simd_level == "generic"
    assert hardware.detect_jetson(tmp_path) is None


# --- derived values: gpu layers, memory kind, device key -------------------------------------------


def _with(report: HardwareReport, **changes) -> HardwareReport:
    return dataclasses.replace(report, **changes)


def _offload(report: HardwareReport, backends: list[str]) -> LlamaCppInfo:
    return LlamaCppInfo("ok", "0.3.36", True, backends, None, "llama-cpp-python 0.3.36", "test")


def _no_offload() -> LlamaCppInfo:
    return LlamaCppInfo("ok", "0.3.36", False, ["CPU"], "CPU : AVX = 1 | AVX2 = 1 | AVX512 = 1 |",
                        "llama-cpp-python 0.3.36", "test")


def _h200(here: HardwareReport, offload: bool) -> HardwareReport:
    gpus = hardware.nvml_gpus(FakeNVML(_sample("nvml_h200.json")))
    gpus.cuda_toolkit = "12.4"
    return _with(here, gpus=gpus, apple=None, jetson=None,
                 llama_cpp=_offload(here, ["CUDA", "CPU"]) if offload else _no_offload())


def _m2(here: HardwareReport, offload: bool) -> HardwareReport:
    sysctl = hardware.parse_sysctl((DATA / "sysctl_m2.txt").read_text())
    displays = hardware.parse_system_profiler_displays((DATA / "system_profiler_displays_m2.txt").read_text())
    return _with(here, gpus=GPUProbe("none", "macOS has no NVIDIA GPUs", "platform.system()"),
                 apple=hardware.apple_from_sources(sysctl, displays), jetson=None,
                 cpu=hardware.detect_cpu(system="Darwin", sysctl=sysctl),
                 memory=hardware.detect_memory(system="Darwin", sysctl=sysctl),
                 coreml=hardware.detect_coreml("Darwin", "14.5"),
                 llama_cpp=_offload(here, ["Metal", "BLAS", "CPU"]) if offload else _no_offload())


def _orin(here: HardwareReport, offload: bool) -> HardwareReport:
    return _with(here, gpus=GPUProbe("none", "no NVIDIA driver loaded", "/proc/driver/nvidia"), apple=None,
                 jetson=hardware.detect_jetson(DATA / "jetson_agx_orin_jp512"),
                 llama_cpp=_offload(here, ["CUDA", "CPU"]) if offload else _no_offload())


def test_derived_values_per_platform(here):
    cases = [
        (_h200(here, True), -1, "discrete", "cuda-NVIDIA_H200-sm90", 150754820096),
        (_m2(here, True), -1, "unified", "apple-M2", 17179869184),
        (_orin(here, True), -1, "unified", "jetson-AGX_Orin-sm87", 63900180 * 1024),
    ]
    for report, layers, kind, key, mem in cases:
        assert (default_gpu_layers(report), memory_kind(report), device_key(report)) == (layers, kind, key)
        assert hardware.device_memory_bytes(report) == mem
    # a GPU the llama.cpp build cannot use: run on the CPU, and key the profile so
    h200_cpu = _h200(here, False)
    assert default_gpu_layers(h200_cpu) == 0 and memory_kind(h200_cpu) == "cpu"
    assert device_key(h200_cpu).startswith("cpu-")
    assert device_key(h200_cpu, use_gpu=True) == "cuda-NVIDIA_H200-sm90"
    assert hardware.resolve_gpu_layers(12, h200_cpu) == 12 and hardware.resolve_gpu_layers(None, h200_cpu) == 0


def test_coreml_rules():
    assert hardware.detect_coreml("Linux").can_run is False
    assert "macOS 15" in hardware.detect_coreml("Darwin", "14.5").reason
    assert isinstance(hardware.detect_coreml("Darwin", "15.1"), CoreMLInfo)


# --- advice ---------------------------------------------------------------------------------------


def _commands(report: HardwareReport) -> list[str]:
    return [a.command for a in advice.advise(report) if a.command]


def test_advice_cuda(here):
    cmds = _commands(_h200(here, False))
    assert ('CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" pip install --force-reinstall '
            "--no-cache-dir llama-cpp-python==0.3.36") in cmds
    assert any(c.endswith("pip install onnxruntime-gpu") for c in cmds)
    assert not any("GGML_CUDA" in c for c in _commands(_h200(here, True)))  # already offloading


def test_advice_metal(here):
    cmds = _commands(_m2(here, False))
    assert 'CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36' in cmds


def _mlx(status="ok", metal=True, lm="0.29.1") -> hardware.MlxInfo:
    if status == "not installed":
        return hardware.MlxInfo(status, None, None, None, None, "importlib.metadata", "mlx is not installed")
    return hardware.MlxInfo(status, "0.32.4", lm, metal, "gpu" if metal else "cpu", "mlx.core", None)


def test_advice_mlx_on_apple_silicon(here):
    def mlx_advice(report):
        return [a for a in advice.advise(report) if a.topic == "mlx"]

    [missing] = mlx_advice(_with(_m2(here, True), mlx=_mlx("not installed")))
    assert missing.command == "pip install 'edgespec[mlx]'" and "--runtime mlx" in missing.message
    assert "not verified" in missing.message  # which is faster is said to be unmeasured, not guessed
    [ready] = mlx_advice(_with(_m2(here, True), mlx=_mlx()))
    assert "sees Metal" in ready.message and "--runtime mlx" in ready.command and "not verified" in ready.message
    [no_metal] = mlx_advice(_with(_m2(here, True), mlx=_mlx(metal=False)))
    assert "no Metal device" in no_metal.message
    [no_lm] = mlx_advice(_with(_m2(here, True), mlx=_mlx(lm=None)))
    assert "mlx-lm" in no_lm.message


def test_mlx_on_linux_is_its_cpu_backend(here):
    [cpu] = [a for a in advice.advise(_with(_h200(here, True), mlx=_mlx(metal=False))) if a.topic == "mlx"]
    assert "CPU backend only" in cpu.message and cpu.command is None
    assert not [a for a in advice.advise(_with(_h200(here, True), mlx=_mlx("not installed"))) if a.topic == "mlx"]
    if here.mlx.status == "ok" and here.apple is None:  # this machine, when the mlx extra is installed
        assert here.mlx.metal is False and here.mlx.device == "cpu"


def test_advice_jetson(here):
    found = [a for a in advice.advise(_orin(here, False)) if a.topic in ("llama_cpp", "onnxruntime")]
    text = " ".join(a.message + " " + (a.command or "") for a in found)
    assert "-DCMAKE_CUDA_ARCHITECTURES=87" in text and "JetPack 5.1.2" in text
    assert "not on PyPI for aarch64" in text


def test_advice_this_cpu_machine(here):
    if here.gpus.devices or here.llama_cpp.status != "ok":
        pytest.skip("checks the CPU-only machine with a working llama.cpp")
    [llama] = [a for a in advice.advise(here) if a.topic == "llama_cpp"]
    assert "CPU build" in llama.message and llama.command is None


def test_model_advice_follows_memory(here, monkeypatch):
    gib = 1024**3
    # memory alone decides here: a machine fast enough for every pair (speed: tests/test_doctor_speed.py)
    monkeypatch.setattr(advice, "speed_basis", lambda report: advice.SpeedBasis(1e15, "a machine fast enough for all"))

    def models_for(available: int) -> dict | None:
        mem = dataclasses.replace(here.memory, available_bytes=available, limit_bytes=None)
        [a] = [a for a in advice.advise(_with(here, memory=mem, gpus=GPUProbe("none", "-", "-"), apple=None,
                                              jetson=None)) if a.topic == "models"]
        return a.settings

    from edgespec.models import pairs

    # The largest recommended pair whose planner-predicted peak fits (models/pairs.json).
    expected = {p.target.source: p.expected_bytes() for p in pairs.pairs() if p.usable}  # runnable pairs only
    for budget in (8 * gib, 3 * gib, 1 * gib):
        got = models_for(budget)
        assert got["need_bytes"] <= budget and got["pull"] == [got["target"], got["draft"]]
        assert got["need_bytes"] == max(v for v in expected.values() if v <= budget)
    assert models_for(8 * gib)["target"] == "hf:Qwen/Qwen3-8B-GGUF:Q4_K_M"
    assert models_for(int(2.05 * gib))["target"] == "qwen2.5-coder-1.5b"  # the catalog pair: catalog names
    assert models_for(int(0.7 * gib)) == {**models_for(int(0.7 * gib)), "target": "smollm2-135m", "draft": None,
                                          "mode": "lookup"}  # no pair fits: the smallest model with lookup
    assert models_for(100 * 1024**2) is None  # nothing fits: says so, recommends nothing
    assert models_for(8 * gib)["n_gpu_layers"] == 0


# --- doctor --json schema ------------------------------------------------------------------------

TOP = {"schema_version": int, "platform": dict, "cpu": dict, "memory": dict, "gpus": dict, "apple": (dict, type(None)),
       "jetson": (dict, type(None)), "llama_cpp": dict, "onnxruntime": dict, "coreml": dict, "mlx": dict, "device_key": str,
       "memory_kind": str, "gpu_layers": int, "device_memory_bytes": (int, type(None)), "advice": list,
       "memory_guard": list, "display_gpus": (dict, type(None))}
SECTIONS = {
    "cpu": {"arch", "name", "logical_cores", "physical_cores", "usable_cores", "simd", "simd_level", "sources",
            "unavailable"},
    "memory": {"total_bytes", "available_bytes", "limit_bytes", "usable_bytes", "sources", "unavailable"},
    "gpus": {"status", "reason", "source", "devices", "cuda_toolkit", "cuda_toolkit_source"},
    "llama_cpp": {"status", "version", "gpu_offload", "backends", "system_info", "build", "source", "reason",
                  "devices"},
    "onnxruntime": {"status", "package", "version", "providers", "source", "reason"},
    "coreml": {"can_run", "coremltools", "reason", "source"},
    "mlx": {"status", "version", "mlx_lm", "metal", "device", "source", "reason"},
    "platform": {"system", "release", "machine", "python", "source"},
}
GPU_KEYS = {"index", "name", "memory_total_bytes", "memory_free_bytes", "driver_version", "cuda_driver_version",
            "compute_capability", "vendor", "source", "unavailable", "sm"}
APPLE_KEYS = {"chip", "unified_memory_bytes", "performance_cores", "efficiency_cores", "gpu_cores", "metal",
              "macos_version", "sources", "unavailable"}
JETSON_KEYS = {"model", "soc", "l4t_release", "jetpack", "board", "cuda_arch", "cuda_version",
               "unified_memory_bytes", "sources", "unavailable"}

DISPLAY_KEYS = {"devices", "vulkan", "vulkan_reason", "rocm", "sources", "unavailable"}
DRM_GPU_KEYS = {"card", "vendor", "vendor_id", "device_id", "driver", "pci_slot", "memory_total_bytes", "source"}
VULKAN_KEYS = {"name", "type", "vendor_id", "driver", "api_version"}
LLAMA_DEVICE_KEYS = {"index", "name", "description", "type", "backend", "memory_free_bytes", "memory_total_bytes"}


def check_schema(doc: dict) -> None:
    assert set(doc) == set(TOP)
    for key, kind in TOP.items():
        assert isinstance(doc[key], kind), key
    assert doc["schema_version"] == hardware.SCHEMA_VERSION == 2
    for section, keys in SECTIONS.items():
        assert set(doc[section]) == keys, section
    assert doc["gpus"]["status"] in ("ok", "none", "unavailable")
    assert doc["memory_kind"] in ("discrete", "unified", "cpu")
    assert doc["gpu_layers"] in (0, -1)
    assert doc["llama_cpp"]["status"] in ("ok", "unknown", "not installed")
    assert isinstance(doc["cpu"]["simd"], list) and isinstance(doc["cpu"]["logical_cores"], int)
    for g in doc["gpus"]["devices"]:
        assert set(g) == GPU_KEYS
    if doc["apple"] is not None:
        assert set(doc["apple"]) == APPLE_KEYS
    if doc["jetson"] is not None:
        assert set(doc["jetson"]) == JETSON_KEYS
    if doc["display_gpus"] is not None:
        assert set(doc["display_gpus"]) == DISPLAY_KEYS
        for g in doc["display_gpus"]["devices"]:
            assert set(g) == DRM_GPU_KEYS
        for d in doc["display_gpus"]["vulkan"] or []:
            assert set(d) == VULKAN_KEYS
    for d in doc["llama_cpp"]["devices"]:
        assert set(d) == LLAMA_DEVICE_KEYS
    for section in ("cpu", "memory"):
        for field, why in doc[section]["unavailable"].items():
            assert doc[section][field] is None or section == "cpu", (section, field)
            assert why.startswith("unavailable:")
    for a in doc["advice"]:
        assert set(a) == {"topic", "message", "command", "settings"}
        assert isinstance(a["message"], str) and a["message"]
        assert a["command"] is None or isinstance(a["command"], str)
    assert json.loads(json.dumps(doc)) == doc


def test_doctor_json_cli_schema():
    done = subprocess.run([sys.executable, "-m", "edgespec.cli", "doctor", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # exactly one JSON object on stdout, nothing else
    check_schema(doc)
    assert doc["device_key"] == device_key(detect())


def test_doctor_json_schema_same_on_every_platform(here):
    for report in (here, _h200(here, True), _h200(here, False), _m2(here, True), _orin(here, False)):
        check_schema(advice.doctor_document(report))


def test_doctor_human_output():
    done = subprocess.run([sys.executable, "-m", "edgespec.cli", "doctor"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    assert "device key" in done.stdout and device_key(detect()) in done.stdout


def test_hardware_module_imports_no_runtime():
    code = ("import sys, edgespec.machine.hardware, edgespec.machine.advice; "
            "print([m for m in ('llama_cpp', 'onnxruntime', 'coremltools', 'pynvml', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("sysctl") is None or platform.system() != "Darwin", reason="macOS only")
def test_detect_apple_on_a_mac(here):  # runs only where there is a Mac; here it is skipped
    assert (here.apple is not None) == (platform.machine() == "arm64")


# --- consumer GPUs: /sys/class/drm, vulkaninfo, ROCm ------------------------------------------------


def _fake_drm(root: Path, cards: dict[str, dict[str, str]]) -> Path:
    """A directory laid out like / with /sys/class/drm/<card>/device/<file> for each card's files."""
    for card, files in cards.items():
        dev = root / "sys/class/drm" / card / "device"
        dev.mkdir(parents=True)
        for name, text in files.items():
            (dev / name).write_text(text)
    (root / "sys/class/drm/card0-DP-1").mkdir(parents=True, exist_ok=True)  # a connector, not a GPU
    (root / "sys/class/drm/renderD128").mkdir(parents=True, exist_ok=True)
    return root


AMD_CARD = {"vendor": "0x1002\n", "device": "0x73DF\n", "uevent": "DRIVER=amdgpu\nPCI_SLOT_NAME=0000:03:00.0\n",
            "mem_info_vram_total": "12868124672\n"}
INTEL_CARD = {"vendor": "0x8086\n", "device": "0x46a6\n", "uevent": "DRIVER=i915\nPCI_SLOT_NAME=0000:00:02.0\n"}
NOUVEAU_CARD = {"vendor": "0x10de\n", "device": "0x2684\n", "uevent": "DRIVER=nouveau\nPCI_SLOT_NAME=0000:01:00.0\n"}


def test_drm_gpus_of_every_vendor(tmp_path):
    root = _fake_drm(tmp_path, {"card0": INTEL_CARD, "card1": AMD_CARD, "card2": NOUVEAU_CARD})
    gpus, why = hardware.detect_drm_gpus(root)
    assert why is None
    assert [(g.card, g.vendor, g.device_id, g.driver, g.pci_slot) for g in gpus] == [
        ("card0", "intel", "0x46a6", "i915", "0000:00:02.0"), ("card1", "amd", "0x73df", "amdgpu", "0000:03:00.0"),
        ("card2", "nvidia", "0x2684", "nouveau", "0000:01:00.0")]
    assert gpus[1].memory_total_bytes == 12868124672 and gpus[0].memory_total_bytes is None
    assert hardware.detect_drm_gpus(tmp_path / "nothing")[1].startswith("unavailable:")


def test_parse_vulkaninfo_summary():
    [lvp] = hardware.parse_vulkaninfo_summary((DATA / "vulkaninfo_summary_llvmpipe.txt").read_text())
    assert (lvp.type, lvp.driver, lvp.api_version) == ("CPU", "llvmpipe", "1.3.230")
    assert lvp.name.startswith("llvmpipe")
    amd, intel = hardware.parse_vulkaninfo_summary((DATA / "vulkaninfo_summary_radv_anv.txt").read_text())
    assert (amd.name, amd.type, amd.vendor_id, amd.driver) == ("AMD Radeon RX 6700 XT (RADV NAVI22)", "DISCRETE_GPU",
                                                               "0x1002", "radv")
    assert intel.type == "INTEGRATED_GPU"


def _consumer(here: HardwareReport, tmp_path: Path, cards: dict, vulkaninfo: str | None, rocm: bool = False,
              llama: LlamaCppInfo | None = None) -> HardwareReport:
    root = _fake_drm(tmp_path, cards)
    if rocm:
        (root / "opt/rocm/.info").mkdir(parents=True)
        (root / "opt/rocm/.info/version").write_text("6.2.0-66\n")
    text = (DATA / vulkaninfo).read_text() if vulkaninfo else None
    return _with(here, gpus=GPUProbe("none", "no NVIDIA driver loaded", "/proc/driver/nvidia"), apple=None,
                 jetson=None, llama_cpp=llama or _no_offload(),
                 display_gpus=hardware.detect_display_gpus(root, vulkaninfo=text))


def _llama_advice(report: HardwareReport) -> list:
    return [a for a in advice.advise(report) if a.topic == "llama_cpp"]


def test_advice_amd_and_intel_get_vulkan(here, tmp_path):
    [a] = _llama_advice(_consumer(here, tmp_path / "amd", {"card0": AMD_CARD}, "vulkaninfo_summary_radv_anv.txt"))
    assert a.command == "bash scripts/install.sh --vulkan"
    assert "AMD GPU 0x73df" in a.message and "Vulkan sees AMD Radeon RX 6700 XT" in a.message
    assert 'CMAKE_ARGS="-DGGML_VULKAN=on"' in a.message and "Not checked" in a.message
    [i] = _llama_advice(_consumer(here, tmp_path / "intel", {"card0": INTEL_CARD}, None))
    assert i.command == "bash scripts/install.sh --vulkan" and "Intel GPU" in i.message
    assert "not verified" in i.message  # no vulkaninfo text: doctor says it could not confirm a driver


def test_advice_software_vulkan_only_is_not_a_driver(here, tmp_path):
    [a] = _llama_advice(_consumer(here, tmp_path, {"card0": AMD_CARD}, "vulkaninfo_summary_llvmpipe.txt"))
    assert "lists no hardware Vulkan device" in a.message and a.command == "bash scripts/install.sh --vulkan"


def test_advice_amd_with_rocm_gets_hip(here, tmp_path):
    [a] = _llama_advice(_consumer(here, tmp_path, {"card0": AMD_CARD}, "vulkaninfo_summary_radv_anv.txt", rocm=True))
    assert a.command == ('CMAKE_ARGS="-DGGML_HIP=on" pip install --force-reinstall --no-cache-dir '
                         "llama-cpp-python==0.3.36")
    assert "ROCm 6.2.0-66" in a.message and "install.sh --vulkan" in a.message


def test_advice_nvidia_without_its_driver(here, tmp_path):
    [a] = _llama_advice(_consumer(here, tmp_path, {"card0": NOUVEAU_CARD}, None))
    assert "without NVIDIA's driver" in a.message and "CUDA" in a.message


VULKAN_DEVICE = {"index": 0, "name": "Vulkan0", "description": "AMD Radeon RX 6700 XT (RADV NAVI22)", "type": "gpu",
                 "backend": "Vulkan", "memory_free_bytes": 12 * 1024**3, "memory_total_bytes": 12868124672}
CPU_DEVICE = {"index": 1, "name": "CPU", "description": "x86", "type": "cpu", "backend": "CPU",
              "memory_free_bytes": 1, "memory_total_bytes": 1}


def test_vulkan_build_offloads_and_keys_its_device(here, tmp_path):
    llama = dataclasses.replace(_offload(here, ["Vulkan", "CPU"]), devices=[VULKAN_DEVICE, CPU_DEVICE])
    report = _consumer(here, tmp_path, {"card0": AMD_CARD}, "vulkaninfo_summary_radv_anv.txt", llama=llama)
    assert (default_gpu_layers(report), memory_kind(report)) == (-1, "discrete")
    assert device_key(report) == "vulkan-AMD_Radeon_RX_6700_XT_RADV_NAVI22"
    assert hardware.device_memory_bytes(report) == 12868124672  # what llama.cpp reports for its device
    [a] = _llama_advice(report)
    assert a.command is None and "offloads to the GPU (Vulkan0" in a.message
    check_schema(advice.doctor_document(report))


def test_a_software_vulkan_device_is_called_one(here, tmp_path):
    lvp = dict(VULKAN_DEVICE, description="llvmpipe (LLVM 15.0.6, 256 bits)")
    llama = dataclasses.replace(_offload(here, ["Vulkan", "CPU"]), devices=[lvp, CPU_DEVICE])
    report = _consumer(here, tmp_path, {}, "vulkaninfo_summary_llvmpipe.txt", llama=llama)
    [a] = _llama_advice(report)
    assert "software Vulkan device" in a.message and "GGML_VK_VISIBLE_DEVICES" in a.message

