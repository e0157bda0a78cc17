"""What this machine is: CPU, memory, GPUs (NVIDIA through NVML; AMD, Intel and NVIDIA through /sys/class/drm and
`vulkaninfo`), Apple Silicon, Jetson, and what the installed runtimes can use.

Every value carries where it came from (`sources`: field -> "/proc/cpuinfo", "nvml", "sysctl hw.memsize",
...). A value that could not be read is None, and `unavailable` says why; nothing is guessed silently.
Parsing is kept apart from reading: `parse_*` functions take the text a source gives (so recorded samples
of platforms we cannot run here are testable), and `detect_*` functions read the machine. The readers take
a `root` so a test can point them at a directory laid out like `/`.

No model runtime is imported at module import: llama.cpp is asked through `edgespec.runtimes.llamacpp`
(which holds every ctypes call), onnxruntime and NVML only inside the functions that need them.

`HardwareReport.to_dict()` is the `hardware` half of `edgespec doctor --json`; its schema
(`SCHEMA_VERSION`) is documented in docs/install.md and checked by tests/test_hardware.py.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 2  # 2 added display_gpus and llama_cpp.devices

MemoryKind = Literal["discrete", "unified", "cpu"]


# --- data -----------------------------------------------------------------------------------


@dataclass
class PlatformInfo:
    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    release: str
    machine: str  # "x86_64", "arm64", "aarch64"
    python: str
    source: str = "python platform module"


@dataclass
class CPUInfo:
    arch: str
    name: str | None
    logical_cores: int | None
    physical_cores: int | None
    usable_cores: int | None  # what this process may run on: affinity, capped by a cgroup quota
    simd: list[str]  # lower-case feature names relevant to llama.cpp kernels, e.g. "avx2", "avx512_vnni", "dotprod"
    simd_level: str  # the best one of: amx, avx512, avx2, avx, sse4, sme, sve, i8mm, dotprod, neon, generic
    sources: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class MemoryInfo:
    total_bytes: int | None
    available_bytes: int | None
    limit_bytes: int | None  # a cgroup memory limit below the physical total, else None
    sources: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> int | None:
        """Physical memory this process may use: the total, capped by a cgroup limit."""
        values = [v for v in (self.total_bytes, self.limit_bytes) if v]
        return min(values) if values else None


@dataclass
class GPUInfo:
    index: int
    name: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    driver_version: str | None
    cuda_driver_version: str | None  # the CUDA version the driver supports, "12.4"
    compute_capability: str | None  # "9.0"
    vendor: str = "nvidia"
    source: str = "nvml"
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def sm(self) -> str | None:
        """The CUDA architecture number, "90" for compute capability 9.0 (CMAKE_CUDA_ARCHITECTURES)."""
        return self.compute_capability.replace(".", "") if self.compute_capability else None


@dataclass
class GPUProbe:
    """The answer to "which NVIDIA GPUs are there": `status` ok (devices listed), none, or unavailable."""

    status: Literal["ok", "none", "unavailable"]
    reason: str | None
    source: str
    devices: list[GPUInfo] = field(default_factory=list)
    cuda_toolkit: str | None = None  # nvcc's CUDA version, needed to build llama.cpp with CUDA
    cuda_toolkit_source: str | None = None


@dataclass
class AppleInfo:
    chip: str | None  # "Apple M2"
    unified_memory_bytes: int | None
    performance_cores: int | None
    efficiency_cores: int | None
    gpu_cores: int | None
    metal: str | None  # "Metal 3"
    macos_version: str | None
    sources: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class JetsonInfo:
    model: str | None  # "NVIDIA Jetson AGX Orin Developer Kit"
    soc: str | None  # "tegra234"
    l4t_release: str | None  # "35.4.1"
    jetpack: str | None  # "5.1.2"
    board: str | None  # "t186ref"
    cuda_arch: str | None  # "87", for CMAKE_CUDA_ARCHITECTURES
    cuda_version: str | None  # the CUDA toolkit JetPack installed
    unified_memory_bytes: int | None  # RAM, shared by CPU and GPU
    sources: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class LlamaCppInfo:
    status: Literal["ok", "unknown", "not installed"]
    version: str | None
    gpu_offload: bool | None
    backends: list[str]  # from llama_print_system_info: "CPU", "CUDA", "Metal", ...
    system_info: str | None
    build: str | None
    source: str
    reason: str | None = None
    # ggml's devices (edgespec.runtimes.llamacpp.backend_devices): {"name": "Vulkan0", "type": "gpu", ...}
    devices: list[dict] = field(default_factory=list)


@dataclass
class DisplayGPU:
    """A GPU the kernel's DRM driver knows (/sys/class/drm/cardN/device): any vendor, no vendor library needed."""

    card: str  # "card0"
    vendor: str  # "amd", "intel", "nvidia" or the PCI vendor id
    vendor_id: str  # "0x1002"
    device_id: str | None  # "0x73bf"
    driver: str | None  # "amdgpu", "i915", "xe", "nouveau", "nvidia"
    pci_slot: str | None  # "0000:03:00.0"
    memory_total_bytes: int | None  # amdgpu's mem_info_vram_total; others do not say
    source: str


@dataclass
class VulkanDevice:
    """One device of `vulkaninfo --summary`."""

    name: str | None  # "AMD Radeon RX 6800 (RADV NAVI21)", "llvmpipe (LLVM 15.0.6, 256 bits)"
    type: str | None  # "DISCRETE_GPU", "INTEGRATED_GPU", "CPU", "VIRTUAL_GPU"
    vendor_id: str | None
    driver: str | None  # "radv", "Intel open-source Mesa driver", "llvmpipe"
    api_version: str | None


@dataclass
class DisplayProbe:
    """Consumer GPUs: what /sys/class/drm lists, what Vulkan sees, and whether ROCm is installed."""

    devices: list[DisplayGPU]
    vulkan: list[VulkanDevice] | None  # None: vulkaninfo not run (see vulkan_reason)
    vulkan_reason: str | None
    rocm: str | None  # ROCm's version (or "installed") where /opt/rocm or hipcc exists
    sources: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class OnnxRuntimeInfo:
    status: Literal["ok", "unknown", "not installed"]
    package: str | None  # "onnxruntime", "onnxruntime-gpu", ...
    version: str | None
    providers: list[str]
    source: str
    reason: str | None = None


@dataclass
class CoreMLInfo:
    can_run: bool
    coremltools: str | None  # installed version
    reason: str
    source: str


@dataclass
class MlxInfo:
    status: Literal["ok", "unknown", "not installed"]
    version: str | None  # mlx
    mlx_lm: str | None  # mlx-lm, which the MLX runtime loads models with
    metal: bool | None  # mx.metal.is_available(): MLX can use the Apple GPU
    device: str | None  # MLX's default device: "gpu" (Metal) or "cpu" (the CPU backend)
    source: str
    reason: str | None = None


@dataclass
class HardwareReport:
    platform: PlatformInfo
    cpu: CPUInfo
    memory: MemoryInfo
    gpus: GPUProbe
    apple: AppleInfo | None
    jetson: JetsonInfo | None
    llama_cpp: LlamaCppInfo
    onnxruntime: OnnxRuntimeInfo
    coreml: CoreMLInfo
    mlx: MlxInfo
    display_gpus: DisplayProbe | None = None  # None: not read (not Linux)

    def to_dict(self) -> dict[str, Any]:
        """The machine as plain JSON types, plus what edgespec derives from it (key, memory kind, GPU layers)."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = None if value is None else dataclasses.asdict(value)
        out["memory"]["usable_bytes"] = self.memory.usable_bytes
        for gpu, d in zip(self.gpus.devices, out["gpus"]["devices"]):
            d["sm"] = gpu.sm
        out["device_key"] = device_key(self)
        out["memory_kind"] = memory_kind(self)
        out["gpu_layers"] = default_gpu_layers(self)
        out["device_memory_bytes"] = device_memory_bytes(self)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


# --- reading helpers ------------------------------------------------------------------------


def _read(root: Path, rel: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, "unavailable: why"), for a path under root ("/" on a real machine)."""
    path = root / rel.lstrip("/")
    try:
        return path.read_text(errors="replace"), None
    except FileNotFoundError:
        return None, f"unavailable: {'/' + rel.lstrip('/')} does not exist"
    except OSError as exc:
        return None, f"unavailable: cannot read {'/' + rel.lstrip('/')}: {exc.strerror or exc}"


def _run(argv: list[str], timeout: float = 15.0) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, "unavailable: why") for a diagnostic command."""
    if shutil.which(argv[0]) is None:
        return None, f"unavailable: `{argv[0]}` not found on PATH"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"unavailable: `{' '.join(argv)}` failed: {exc}"
    if done.returncode != 0 and not done.stdout:
        return None, f"unavailable: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()[:200]}"
    return done.stdout, None


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


# --- CPU --------------------------------------------------------------------------------------

# Features llama.cpp's CPU kernels dispatch on, in /proc/cpuinfo spelling (x86 "flags", ARM "Features").
_X86_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")
_ARM_FEATURES = {"asimd": "neon", "asimddp": "dotprod", "i8mm": "i8mm", "bf16": "bf16", "sve": "sve",
                 "sve2": "sve2", "sme": "sme", "asimdhp": "fp16"}
# macOS sysctl names for the same features.
_SYSCTL_FEATURES = {
    "hw.optional.AdvSIMD": "neon", "hw.optional.neon": "neon", "hw.optional.arm.FEAT_DotProd": "dotprod",
    "hw.optional.arm.FEAT_I8MM": "i8mm", "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_SME": "sme",
    "hw.optional.arm.FEAT_FP16": "fp16", "hw.optional.sse4_2": "sse4_2", "hw.optional.avx1_0": "avx",
    "hw.optional.avx2_0": "avx2", "hw.optional.fma": "fma", "hw.optional.avx512f": "avx512f",
    "hw.optional.avx512bw": "avx512bw", "hw.optional.avx512vl": "avx512vl",
}
_LEVELS = (("amx", ("amx_int8", "amx_tile")), ("avx512", ("avx512f",)), ("avx2", ("avx2",)), ("avx", ("avx",)),
           ("sse4", ("sse4_2",)), ("sme", ("sme",)), ("sve", ("sve",)), ("i8mm", ("i8mm",)),
           ("dotprod", ("dotprod",)), ("neon", ("neon",)))


def simd_level(simd: list[str]) -> str:
    """The best SIMD family present, for device keys: "amx" > "avx512" > "avx2" > ... > "neon" > "generic"."""
    have = set(simd)
    for level, needs in _LEVELS:
        if any(n in have for n in needs):
            return level
    return "generic"


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """Linux /proc/cpuinfo -> name, logical (processor entries), physical (distinct physical id/core id
    pairs, None where the file has no topology, as on ARM), flags (the raw set), simd (relevant features)."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    logical = 0
    cores: set[tuple[str, str]] = set()
    flags: set[str] = set()
    name = None
    for block in blocks:
        kv: dict[str, str] = {}
        for line in block.splitlines():
            if ":" in line:
                k, _, v = line.partition(":")
                kv[k.strip()] = v.strip()
        if "processor" in kv and kv["processor"].isdigit():
            logical += 1
        if "physical id" in kv and "core id" in kv:
            cores.add((kv["physical id"], kv["core id"]))
        for key in ("flags", "Features"):
            if key in kv:
                flags.update(kv[key].split())
        for key in ("model name", "Hardware", "Model", "cpu model"):
            if name is None and kv.get(key):
                name = kv[key]
    simd = [f for f in _X86_FEATURES if f in flags] + sorted({v for k, v in _ARM_FEATURES.items() if k in flags})
    return {"name": name, "logical": logical or None, "physical": len(cores) or None,
            "flags": flags, "simd": simd}


def parse_cgroup_cpu_max(text: str) -> float | None:
    """cgroup v2 cpu.max ("200000 100000" -> 2.0 CPUs; "max 100000" -> None, no quota)."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        return int(parts[0]) / int(parts[1])
    except (ValueError, ZeroDivisionError):
        return None


def detect_cpu(root: str | Path = "/", system: str | None = None, sysctl: dict[str, str] | None = None) -> CPUInfo:
    root = Path(root)
    system = system or platform.system()
    arch = platform.machine() or "unknown"
    sources: dict[str, str] = {"arch": "platform.machine()"}
    unavailable: dict[str, str] = {}
    name = logical = physical = None
    simd: list[str] = []

    if system == "Linux":
        text, why = _read(root, "/proc/cpuinfo")
        if text is None:
            unavailable.update({k: why for k in ("name", "physical_cores", "simd")})
        else:
            info = parse_cpuinfo(text)
            name, logical, physical, simd = info["name"], info["logical"], info["physical"], info["simd"]
            sources.update({"name": "/proc/cpuinfo", "logical_cores": "/proc/cpuinfo", "simd": "/proc/cpuinfo"})
            if name is None:
                unavailable["name"] = "unavailable: /proc/cpuinfo names no model on this CPU"
            if physical is not None:
                sources["physical_cores"] = "/proc/cpuinfo (physical id, core id)"
    elif system == "Darwin":
        if sysctl is None:
            sysctl, why = read_sysctl()
            if sysctl is None:
                unavailable.update({k: why for k in ("name", "physical_cores", "simd")})
        if sysctl:
            name = sysctl.get("machdep.cpu.brand_string")
            logical = _int(sysctl.get("hw.logicalcpu") or sysctl.get("hw.ncpu"))
            physical = _int(sysctl.get("hw.physicalcpu"))
            simd = simd_from_sysctl(sysctl)
            sources.update({"name": "sysctl machdep.cpu.brand_string", "logical_cores": "sysctl hw.logicalcpu",
                            "physical_cores": "sysctl hw.physicalcpu", "simd": "sysctl hw.optional.*"})
    else:
        name = platform.processor() or None
        if name:
            sources["name"] = "platform.processor()"
        unavailable["simd"] = f"unavailable: no SIMD probe for {system}"

    if logical is None:
        logical = os.cpu_count()
        sources["logical_cores"] = "os.cpu_count()"
    if physical is None and "physical_cores" not in sources:
        try:
            import psutil

            physical = psutil.cpu_count(logical=False)
            if physical:
                sources["physical_cores"] = "psutil.cpu_count(logical=False)"
                unavailable.pop("physical_cores", None)
        except ImportError:
            pass
        if physical is None:
            unavailable.setdefault("physical_cores", "unavailable: no topology in /proc/cpuinfo or psutil")

    usable = logical
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
        sources["usable_cores"] = "os.sched_getaffinity"
    else:
        sources["usable_cores"] = sources["logical_cores"]
    if system == "Linux":
        quota_text, _ = _read(root, "/sys/fs/cgroup/cpu.max")
        quota = parse_cgroup_cpu_max(quota_text) if quota_text else None
        if quota is not None and usable is not None and quota < usable:
            usable = max(1, int(quota))
            sources["usable_cores"] += " capped by /sys/fs/cgroup/cpu.max"

    return CPUInfo(arch=arch, name=name, logical_cores=logical, physical_cores=physical, usable_cores=usable,
                   simd=simd, simd_level=simd_level(simd), sources=sources, unavailable=unavailable)


# --- memory -----------------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {"MemTotal": bytes, "MemAvailable": bytes, ...}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+(kB))?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def parse_cgroup_memory_max(text: str) -> int | None:
    """cgroup memory.max / memory.limit_in_bytes -> bytes, None for "max" or the v1 "no limit" value."""
    value = _int(text)
    if value is None or value >= 1 << 60:
        return None
    return value


def detect_memory(root: str | Path = "/", system: str | None = None,
                  sysctl: dict[str, str] | None = None) -> MemoryInfo:
    root = Path(root)
    system = system or platform.system()
    sources: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    total = available = limit = None

    if system == "Linux":
        text, why = _read(root, "/proc/meminfo")
        if text is None:
            unavailable.update({"total_bytes": why, "available_bytes": why})
        else:
            info = parse_meminfo(text)
            total, available = info.get("MemTotal"), info.get("MemAvailable")
            for key, value in (("total_bytes", total), ("available_bytes", available)):
                if value is None:
                    unavailable[key] = "unavailable: /proc/meminfo lacks it"
                else:
                    sources[key] = "/proc/meminfo"
        for rel in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            text, _ = _read(root, rel)
            if text is not None:
                limit = parse_cgroup_memory_max(text)
                if limit is not None and total is not None and limit >= total:
                    limit = None
                sources["limit_bytes"] = rel
                break
    elif system == "Darwin":
        if sysctl is None:
            sysctl, why = read_sysctl()
            if sysctl is None:
                unavailable["total_bytes"] = why
        if sysctl and _int(sysctl.get("hw.memsize")) is not None:
            total = _int(sysctl["hw.memsize"])
            sources["total_bytes"] = "sysctl hw.memsize"

    if total is None or available is None:
        try:
            import psutil

            vm = psutil.virtual_memory()
            if total is None:
                total = int(vm.total)
                sources["total_bytes"] = "psutil.virtual_memory()"
                unavailable.pop("total_bytes", None)
            if available is None:
                available = int(vm.available)
                sources["available_bytes"] = "psutil.virtual_memory()"
                unavailable.pop("available_bytes", None)
        except ImportError:
            pass
    return MemoryInfo(total_bytes=total, available_bytes=available, limit_bytes=limit,
                      sources=sources, unavailable=unavailable)


# --- NVIDIA GPUs ----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def nvml_gpus(nvml: Any) -> GPUProbe:
    """Ask NVML (the `pynvml` module of nvidia-ml-py, or a recorded stand-in with the same functions)."""
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error as exc:
        return GPUProbe("unavailable", f"unavailable: NVML did not initialise: {exc}", "nvml")
    try:
        driver = cuda = None
        unavailable: dict[str, str] = {}
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except error as exc:
            unavailable["driver_version"] = f"unavailable: nvmlSystemGetDriverVersion: {exc}"
        try:
            v = int(nvml.nvmlSystemGetCudaDriverVersion())  # 12040 -> "12.4"
            cuda = f"{v // 1000}.{(v % 1000) // 10}"
        except (error, AttributeError) as exc:
            unavailable["cuda_driver_version"] = f"unavailable: nvmlSystemGetCudaDriverVersion: {exc}"
        devices = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            missing = dict(unavailable)
            name = total = free = cc = None
            try:
                name = _text(nvml.nvmlDeviceGetName(handle))
            except error as exc:
                missing["name"] = f"unavailable: nvmlDeviceGetName: {exc}"
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                total, free = int(mem.total), int(mem.free)
            except error as exc:
                missing["memory_total_bytes"] = f"unavailable: nvmlDeviceGetMemoryInfo: {exc}"
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                cc = f"{int(major)}.{int(minor)}"
            except error as exc:
                missing["compute_capability"] = f"unavailable: nvmlDeviceGetCudaComputeCapability: {exc}"
            devices.append(GPUInfo(index=i, name=name, memory_total_bytes=total, memory_free_bytes=free,
                                   driver_version=driver, cuda_driver_version=cuda, compute_capability=cc,
                                   unavailable=missing))
    except error as exc:
        return GPUProbe("unavailable", f"unavailable: NVML query failed: {exc}", "nvml")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # shutting down is best effort; the answer is already in hand
            pass
    if not devices:
        return GPUProbe("none", "NVML reports 0 devices", "nvml")
    return GPUProbe("ok", None, "nvml", devices)


def parse_nvidia_proc_information(text: str) -> dict[str, str]:
    """/proc/driver/nvidia/gpus/<bus>/information ("Model: NVIDIA H200", ...) -> dict."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def cuda_toolkit(root: str | Path = "/") -> tuple[str | None, str | None]:
    """(version, source) of the CUDA toolkit: /usr/local/cuda/version.json, else `nvcc --version`."""
    text, _ = _read(Path(root), "/usr/local/cuda/version.json")
    if text:
        try:
            return str(json.loads(text)["cuda"]["version"]), "/usr/local/cuda/version.json"
        except (ValueError, KeyError, TypeError):
            pass
    if Path(root) == Path("/"):
        out, _ = _run(["nvcc", "--version"])
        m = re.search(r"release (\d+\.\d+)", out or "")
        if m:
            return m.group(1), "nvcc --version"
    return None, None


def detect_gpus(root: str | Path = "/", nvml: Any = None) -> GPUProbe:
    """NVIDIA GPUs through NVML; without it, what the driver's /proc files say. `nvml`: None imports
    pynvml (nvidia-ml-py), False acts as if it were not installed, anything else is used as the module."""
    root = Path(root)
    toolkit, toolkit_src = cuda_toolkit(root)
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            nvml = False
    driver_loaded = (root / "proc/driver/nvidia").exists()
    if nvml is False:
        nvml_why = "nvidia-ml-py not installed (pip install nvidia-ml-py)"
    else:
        probe = nvml_gpus(nvml)
        if probe.status == "ok" or (probe.status == "none" and not driver_loaded):
            probe.cuda_toolkit, probe.cuda_toolkit_source = toolkit, toolkit_src
            return probe
        nvml_why = probe.reason or "NVML reports no devices"
    if not driver_loaded:
        return GPUProbe("none", f"no NVIDIA driver loaded (/proc/driver/nvidia absent; {nvml_why})",
                        "/proc/driver/nvidia", [], toolkit, toolkit_src)
    devices = []
    driver_dir = root / "proc/driver/nvidia/gpus"
    for i, bus in enumerate(sorted(driver_dir.iterdir()) if driver_dir.is_dir() else []):
        rel = f"/proc/driver/nvidia/gpus/{bus.name}/information"
        text, why = _read(root, rel)
        parsed = parse_nvidia_proc_information(text or "")
        gap = f"unavailable: needs NVML ({nvml_why})"
        missing = {k: gap for k in ("memory_total_bytes", "driver_version", "cuda_driver_version",
                                    "compute_capability")}
        if not parsed.get("Model"):
            missing["name"] = why or f"unavailable: {rel} has no Model line"
        devices.append(GPUInfo(index=i, name=parsed.get("Model"), memory_total_bytes=None, memory_free_bytes=None,
                               driver_version=None, cuda_driver_version=None, compute_capability=None,
                               source=rel, unavailable=missing))
    return GPUProbe("unavailable", f"unavailable: the NVIDIA driver is loaded but NVML is not usable ({nvml_why}); "
                    "names from /proc/driver/nvidia only", "/proc/driver/nvidia", devices, toolkit, toolkit_src)


# --- Apple Silicon ----------------------------------------------------------------------------


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl -a` output on macOS ("hw.memsize: 17179869184") -> {key: value}; "key = value" works too."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.]+)\s*(?::|=)\s?(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def simd_from_sysctl(sysctl: dict[str, str]) -> list[str]:
    found = {name for key, name in _SYSCTL_FEATURES.items() if sysctl.get(key, "0").strip() == "1"}
    order = list(_X86_FEATURES) + ["neon", "dotprod", "i8mm", "bf16", "fp16", "sve", "sve2", "sme"]
    return [f for f in order if f in found]


def read_sysctl() -> tuple[dict[str, str] | None, str | None]:
    out, why = _run(["sysctl", "-a"])
    return (parse_sysctl(out), None) if out is not None else (None, why)


def parse_system_profiler_displays(text: str) -> dict[str, Any]:
    """`system_profiler SPDisplaysDataType` -> {"chipset", "gpu_cores", "metal"}."""
    out: dict[str, Any] = {"chipset": None, "gpu_cores": None, "metal": None}
    for line in text.splitlines():
        k, sep, v = line.strip().partition(":")
        if not sep:
            continue
        v = v.strip()
        if k == "Chipset Model" and out["chipset"] is None:
            out["chipset"] = v
        elif k == "Total Number of Cores" and out["gpu_cores"] is None:
            out["gpu_cores"] = _int(v)
        elif k == "Metal Support" and out["metal"] is None:  # macOS 13+: "Metal 3"
            out["metal"] = v
        elif k == "Metal Family" and out["metal"] is None:  # older: "Supported, Metal GPUFamily Apple 7"
            out["metal"] = v
    return out


def apple_from_sources(sysctl: dict[str, str], displays: dict[str, Any] | None,
                       displays_why: str | None = None) -> AppleInfo:
    """Assemble AppleInfo from parsed `sysctl -a` and `system_profiler SPDisplaysDataType`."""
    sources: dict[str, str] = {}
    unavailable: dict[str, str] = {}

    def take(field_name: str, key: str, convert=lambda v: v):
        value = sysctl.get(key)
        if value is None or value == "":
            unavailable[field_name] = f"unavailable: sysctl has no {key}"
            return None
        sources[field_name] = f"sysctl {key}"
        return convert(value)

    chip = take("chip", "machdep.cpu.brand_string")
    memory = take("unified_memory_bytes", "hw.memsize", _int)
    perf = take("performance_cores", "hw.perflevel0.physicalcpu", _int)
    eff = take("efficiency_cores", "hw.perflevel1.physicalcpu", _int)
    macos = take("macos_version", "kern.osproductversion")
    gpu_cores = metal = None
    if displays is None:
        reason = displays_why or "unavailable: system_profiler SPDisplaysDataType not read"
        unavailable.update({"gpu_cores": reason, "metal": reason})
    else:
        for name in ("gpu_cores", "metal"):
            if displays.get(name) is None:
                unavailable[name] = f"unavailable: system_profiler SPDisplaysDataType does not list {name}"
            else:
                sources[name] = "system_profiler SPDisplaysDataType"
        gpu_cores, metal = displays.get("gpu_cores"), displays.get("metal")
    return AppleInfo(chip=chip, unified_memory_bytes=memory, performance_cores=perf, efficiency_cores=eff,
                     gpu_cores=gpu_cores, metal=metal, macos_version=macos, sources=sources,
                     unavailable=unavailable)


def detect_apple(system: str | None = None, machine: str | None = None,
                 sysctl: dict[str, str] | None = None) -> AppleInfo | None:
    """AppleInfo on an Apple Silicon Mac, None elsewhere (an Intel Mac has no unified GPU memory)."""
    if (system or platform.system()) != "Darwin" or (machine or platform.machine()) != "arm64":
        return None
    if sysctl is None:
        sysctl, why = read_sysctl()
        if sysctl is None:
            info = apple_from_sources({}, None, why)
            info.unavailable = {k: why for k in info.unavailable}
            return info
    out, why = _run(["system_profiler", "SPDisplaysDataType"], timeout=30)
    return apple_from_sources(sysctl, parse_system_profiler_displays(out) if out is not None else None, why)


# --- Jetson -----------------------------------------------------------------------------------

# L4T release -> JetPack, from NVIDIA's JetPack archive. A release not listed is reported, not guessed.
L4T_TO_JETPACK = {
    "32.4.3": "4.4", "32.4.4": "4.4.1", "32.5.0": "4.5", "32.5.1": "4.5.1", "32.6.1": "4.6",
    "32.7.1": "4.6.1", "32.7.2": "4.6.2", "32.7.3": "4.6.3", "32.7.4": "4.6.4", "32.7.5": "4.6.5",
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3",
    "35.6.0": "5.1.4", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2",
}
# Tegra SoC -> CUDA architecture (compute capability without the dot).
TEGRA_CUDA_ARCH = {"tegra210": "53", "tegra186": "62", "tegra194": "72", "tegra234": "87"}
_MODEL_CUDA_ARCH = (("Orin", "87"), ("Xavier", "72"), ("TX2", "62"), ("TX1", "53"), ("Nano", "53"))


def parse_nv_tegra_release(text: str) -> dict[str, str]:
    """/etc/nv_tegra_release ("# R35 (release), REVISION: 4.1, GCID: ..., BOARD: t186ref, ...") ->
    {"l4t_release": "35.4.1", "board": ..., "gcid": ..., "date": ...}; {} when it is not that format."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    m = re.match(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", first)
    if not m:
        return {}
    revision = m.group(2).split(".")
    revision += ["0"] * (2 - len(revision))
    out = {"l4t_release": ".".join([m.group(1), *revision[:2]])}
    for key in ("GCID", "BOARD", "EABI", "DATE"):
        km = re.search(rf"{key}:\s*([^,]+)", first)
        if km:
            out[key.lower()] = km.group(1).strip()
    return out


def parse_jetson_model(text: str) -> str | None:
    """/proc/device-tree/model (NUL-terminated) -> "NVIDIA Jetson AGX Orin Developer Kit"."""
    model = text.replace("\x00", "").strip()
    return model or None


def parse_device_tree_compatible(text: str) -> str | None:
    """/proc/device-tree/compatible ("nvidia,p3737-0000+p3701-0000\\0...\\0nvidia,tegra234") -> "tegra234"."""
    for item in text.split("\x00"):
        m = re.fullmatch(r"nvidia,(tegra\d+)", item.strip())
        if m:
            return m.group(1)
    return None


def parse_dpkg_version(text: str, package: str) -> str | None:
    """The Version of an installed package in /var/lib/dpkg/status."""
    for block in re.split(r"\n\s*\n", text):
        if re.search(rf"^Package:\s*{re.escape(package)}\s*$", block, re.M):
            m = re.search(r"^Version:\s*(\S+)", block, re.M)
            if m:
                return m.group(1)
    return None


def jetpack_for_l4t(l4t: str) -> str | None:
    return L4T_TO_JETPACK.get(l4t)


def detect_jetson(root: str | Path = "/") -> JetsonInfo | None:
    """JetsonInfo on a Jetson board (its release file or device tree says so), None elsewhere."""
    root = Path(root)
    release_text, release_why = _read(root, "/etc/nv_tegra_release")
    model_text, model_why = _read(root, "/proc/device-tree/model")
    compat_text, compat_why = _read(root, "/proc/device-tree/compatible")
    model = parse_jetson_model(model_text) if model_text is not None else None
    soc = parse_device_tree_compatible(compat_text) if compat_text is not None else None
    is_jetson = (root / "etc/nv_tegra_release").exists() or soc is not None or "Jetson" in (model or "")
    if not is_jetson:
        return None

    sources: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    if model:
        sources["model"] = "/proc/device-tree/model"
    else:
        unavailable["model"] = model_why or "unavailable: /proc/device-tree/model is empty"
    if soc:
        sources["soc"] = "/proc/device-tree/compatible"
    else:
        unavailable["soc"] = compat_why or "unavailable: /proc/device-tree/compatible names no nvidia,tegra SoC"

    l4t = board = jetpack = None
    if release_text is None:
        unavailable["l4t_release"] = release_why
    else:
        parsed = parse_nv_tegra_release(release_text)
        l4t, board = parsed.get("l4t_release"), parsed.get("board")
        if l4t:
            sources["l4t_release"] = "/etc/nv_tegra_release"
        else:
            unavailable["l4t_release"] = "unavailable: /etc/nv_tegra_release is not in the '# R<n> (release)' format"
        if board:
            sources["board"] = "/etc/nv_tegra_release"
    dpkg_text, _ = _read(root, "/var/lib/dpkg/status")
    dpkg_jetpack = parse_dpkg_version(dpkg_text, "nvidia-jetpack") if dpkg_text else None
    if dpkg_jetpack:
        jetpack = dpkg_jetpack.split("-")[0]
        sources["jetpack"] = "/var/lib/dpkg/status (nvidia-jetpack)"
    elif l4t and jetpack_for_l4t(l4t):
        jetpack = jetpack_for_l4t(l4t)
        sources["jetpack"] = "L4T release via edgespec.machine.hardware.L4T_TO_JETPACK"
    else:
        unavailable["jetpack"] = (f"unavailable: nvidia-jetpack not installed and L4T {l4t} is not in "
                                  "edgespec's JetPack table" if l4t else "unavailable: no L4T release to map")

    cuda_arch = TEGRA_CUDA_ARCH.get(soc or "")
    if cuda_arch:
        sources["cuda_arch"] = "/proc/device-tree/compatible via TEGRA_CUDA_ARCH"
    else:
        cuda_arch = next((arch for word, arch in _MODEL_CUDA_ARCH if word in (model or "")), None)
        if cuda_arch:
            sources["cuda_arch"] = "/proc/device-tree/model via model name"
        else:
            unavailable["cuda_arch"] = f"unavailable: SoC {soc or '?'} / model {model or '?'} not in edgespec's table"

    cuda_version, cuda_src = cuda_toolkit(root)
    if cuda_version:
        sources["cuda_version"] = cuda_src
    else:
        unavailable["cuda_version"] = "unavailable: no /usr/local/cuda/version.json (CUDA toolkit not installed?)"

    mem_text, mem_why = _read(root, "/proc/meminfo")
    memory = parse_meminfo(mem_text).get("MemTotal") if mem_text else None
    if memory:
        sources["unified_memory_bytes"] = "/proc/meminfo MemTotal (shared by CPU and GPU)"
    else:
        unavailable["unified_memory_bytes"] = mem_why or "unavailable: /proc/meminfo lacks MemTotal"
    return JetsonInfo(model=model, soc=soc, l4t_release=l4t, jetpack=jetpack, board=board, cuda_arch=cuda_arch,
                      cuda_version=cuda_version, unified_memory_bytes=memory, sources=sources,
                      unavailable=unavailable)


# --- consumer GPUs on Linux: /sys/class/drm and vulkaninfo ----------------------------------------

PCI_VENDORS = {"0x1002": "amd", "0x8086": "intel", "0x10de": "nvidia"}


def detect_drm_gpus(root: str | Path = "/") -> tuple[list[DisplayGPU], str | None]:
    """GPUs of /sys/class/drm/card<N> (render-only and connector entries such as card0-DP-1 skipped):
    (devices, None) or ([], why)."""
    root = Path(root)
    drm = root / "sys/class/drm"
    if not drm.is_dir():
        return [], "unavailable: /sys/class/drm absent (no DRM driver loaded, or not Linux)"
    out = []
    for card in sorted(drm.iterdir(), key=lambda p: (len(p.name), p.name)):
        if not re.fullmatch(r"card\d+", card.name):
            continue
        rel = f"/sys/class/drm/{card.name}/device"
        vendor_id, _ = _read(root, f"{rel}/vendor")
        if vendor_id is None:
            continue
        vendor_id = vendor_id.strip().lower()
        device_id, _ = _read(root, f"{rel}/device")
        uevent, _ = _read(root, f"{rel}/uevent")
        fields = dict(line.split("=", 1) for line in (uevent or "").splitlines() if "=" in line)
        vram, _ = _read(root, f"{rel}/mem_info_vram_total")
        out.append(DisplayGPU(card=card.name, vendor=PCI_VENDORS.get(vendor_id, vendor_id), vendor_id=vendor_id,
                              device_id=device_id.strip().lower() if device_id else None,
                              driver=fields.get("DRIVER"), pci_slot=fields.get("PCI_SLOT_NAME"),
                              memory_total_bytes=_int(vram), source=rel))
    return out, None


def parse_vulkaninfo_summary(text: str) -> list[VulkanDevice]:
    """`vulkaninfo --summary`'s "Devices:" section (GPU0: / deviceName = ... lines) -> devices."""
    devices: list[dict[str, str]] = []
    in_devices = False
    for line in text.splitlines():
        if line.strip() == "Devices:":
            in_devices = True
        elif in_devices and re.fullmatch(r"GPU\d+:", line.strip()):
            devices.append({})
        elif in_devices and devices and "=" in line:
            k, _, v = line.partition("=")
            devices[-1][k.strip()] = v.strip()
    return [VulkanDevice(name=d.get("deviceName"), type=d.get("deviceType", "").replace("PHYSICAL_DEVICE_TYPE_", "")
                         or None, vendor_id=d.get("vendorID"), driver=d.get("driverName"),
                         api_version=d.get("apiVersion")) for d in devices]


def detect_rocm(root: str | Path = "/") -> tuple[str | None, str | None]:
    """(version or "installed", source) of ROCm: /opt/rocm/.info/version, else /opt/rocm or hipcc."""
    root = Path(root)
    text, _ = _read(root, "/opt/rocm/.info/version")
    if text and text.strip():
        return text.strip(), "/opt/rocm/.info/version"
    if (root / "opt/rocm").is_dir():
        return "installed", "/opt/rocm"
    if root == Path("/") and shutil.which("hipcc"):
        return "installed", "hipcc on PATH"
    return None, None


def detect_display_gpus(root: str | Path = "/", vulkaninfo: str | None = None) -> DisplayProbe:
    """Consumer GPUs of any vendor. `vulkaninfo`: that command's --summary text (tests); None runs it
    where it is installed and `root` is the real "/"."""
    devices, why = detect_drm_gpus(root)
    sources, unavailable = {}, {}
    if why:
        unavailable["devices"] = why
    else:
        sources["devices"] = "/sys/class/drm/card*/device (vendor, device, uevent, mem_info_vram_total)"
    vulkan = vk_why = None
    if vulkaninfo is None and Path(root) == Path("/"):
        vulkaninfo, vk_why = _run(["vulkaninfo", "--summary"])
        if vk_why and "not found" in vk_why:
            vk_why += " (Debian/Ubuntu: apt-get install vulkan-tools)"
    elif vulkaninfo is None:
        vk_why = "unavailable: vulkaninfo is only run on the real machine"
    if vulkaninfo is not None:
        vulkan = parse_vulkaninfo_summary(vulkaninfo)
        sources["vulkan"] = "vulkaninfo --summary"
    rocm, rocm_src = detect_rocm(root)
    if rocm_src:
        sources["rocm"] = rocm_src
    return DisplayProbe(devices=devices, vulkan=vulkan, vulkan_reason=vk_why, rocm=rocm, sources=sources,
                        unavailable=unavailable)


# --- runtimes ---------------------------------------------------------------------------------


def parse_llama_system_info(text: str) -> dict[str, dict[str, str]]:
    """llama_print_system_info ("CUDA : ARCHS = 900 | ... | CPU : SSE3 = 1 | AVX = 1 | ...") ->
    {"CUDA": {"ARCHS": "900", ...}, "CPU": {"SSE3": "1", ...}}."""
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for token in text.split("|"):
        token = token.strip()
        if not token:
            continue
        if " : " in token:
            backend, _, token = token.partition(" : ")
            current = out.setdefault(backend.strip(), {})
        if current is None:
            current = out.setdefault("?", {})
        k, _, v = token.partition("=")
        if k.strip():
            current[k.strip()] = v.strip()
    return out


def detect_llama_cpp() -> LlamaCppInfo:
    version = _dist_version("llama-cpp-python")
    if version is None:
        return LlamaCppInfo("not installed", None, None, [], None, None, "importlib.metadata",
                            "llama-cpp-python is not installed")
    try:
        from edgespec.runtimes import llamacpp

        info = llamacpp.backend_info()
    except (ImportError, AttributeError) as exc:
        return LlamaCppInfo("unknown", version, None, [], None, None, "importlib.metadata",
                            f"unknown (llama.cpp runtime not importable: {exc})")
    except Exception as exc:  # a broken build must not break the diagnosis of it
        return LlamaCppInfo("unknown", version, None, [], None, None, "importlib.metadata",
                            f"unknown (llama.cpp backend_info failed: {type(exc).__name__}: {exc})")
    system_info = str(info.get("system_info", "")) or None
    backends = list(parse_llama_system_info(system_info or ""))
    try:
        devices = llamacpp.backend_devices()
    except Exception:  # an older binding without the device API: the rest of the answer stands
        devices = []
    # llama_print_system_info names only backends with features to print (CPU, CUDA): add the devices' (Vulkan)
    backends = list(dict.fromkeys([d["backend"] for d in devices if d.get("backend")] + backends))
    return LlamaCppInfo("ok", version, bool(info.get("gpu_offload")), backends, system_info,
                        info.get("build"), "edgespec.runtimes.llamacpp.backend_info "
                        "(llama_supports_gpu_offload, llama_print_system_info, ggml_backend_dev_*)",
                        devices=devices)


_ORT_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-silicon", "onnxruntime-directml",
                 "onnxruntime-openvino", "onnxruntime-qnn")


def detect_onnxruntime() -> OnnxRuntimeInfo:
    package = next((p for p in _ORT_PACKAGES if _dist_version(p)), None)
    if package is None:
        return OnnxRuntimeInfo("not installed", None, None, [], "importlib.metadata",
                               "no onnxruntime package is installed")
    version = _dist_version(package)
    try:
        import onnxruntime

        providers = list(onnxruntime.get_available_providers())
    except Exception as exc:  # a broken install is a finding, not a crash
        return OnnxRuntimeInfo("unknown", package, version, [], "importlib.metadata",
                               f"unknown (import onnxruntime failed: {type(exc).__name__}: {exc})")
    return OnnxRuntimeInfo("ok", package, version, providers, "onnxruntime.get_available_providers()")


def detect_coreml(system: str | None = None, macos_version: str | None = None) -> CoreMLInfo:
    """Whether Core ML models can be run here (not just converted: coremltools converts on Linux too)."""
    system = system or platform.system()
    tools = _dist_version("coremltools")
    if system != "Darwin":
        return CoreMLInfo(False, tools, f"Core ML runs only on Apple platforms (this is {system}); "
                          "coremltools can still convert here", "platform.system()")
    macos_version = macos_version or platform.mac_ver()[0]
    major = _int((macos_version or "0").split(".")[0]) or 0
    if major < 15:
        return CoreMLInfo(False, tools, f"macOS {macos_version or '?'}: edgespec's stateful Core ML models "
                          "need macOS 15 or later", "platform.mac_ver()")
    if tools is None:
        return CoreMLInfo(False, None, "coremltools is not installed (pip install coremltools==9.0)",
                          "importlib.metadata")
    return CoreMLInfo(True, tools, f"macOS {macos_version} with coremltools {tools}",
                      "platform.mac_ver(), importlib.metadata")


def detect_mlx() -> MlxInfo:
    """MLX and mlx-lm as installed, and whether MLX reaches Metal (on Linux it has only its CPU backend)."""
    version, lm = _dist_version("mlx"), _dist_version("mlx-lm")
    if version is None:
        return MlxInfo("not installed", None, lm, None, None, "importlib.metadata", "mlx is not installed")
    try:
        import mlx.core as mx

        metal = bool(mx.metal.is_available())
        device = mx.default_device().type.name
    except Exception as exc:  # a broken install is a finding, not a crash
        return MlxInfo("unknown", version, lm, None, None, "importlib.metadata",
                       f"unknown (import mlx.core failed: {type(exc).__name__}: {exc})")
    reason = None if lm else "mlx-lm is not installed (the MLX runtime loads models with it)"
    return MlxInfo("ok", version, lm, metal, device, "mlx.core.metal.is_available(), mlx.core.default_device()",
                   reason)


# --- the whole machine and what follows from it -------------------------------------------------


def detect(root: str | Path = "/", *, llama_cpp: bool = True, onnxruntime: bool = True, mlx: bool = True,
           nvml: Any = None) -> HardwareReport:
    """Read this machine. `llama_cpp=False` / `onnxruntime=False` / `mlx=False` skip asking those runtimes (no imports);
    a runtime not asked is reported with status "unknown" and says so."""
    system = platform.system()
    sysctl = None
    if system == "Darwin":
        sysctl, _ = read_sysctl()
    plat = PlatformInfo(system=system, release=platform.release(), machine=platform.machine(),
                        python=sys.version.split()[0])
    not_asked = "not asked (detect(%s=False))"
    llama = detect_llama_cpp() if llama_cpp else LlamaCppInfo(
        "unknown", _dist_version("llama-cpp-python"), None, [], None, None, "importlib.metadata",
        not_asked % "llama_cpp")
    ort = detect_onnxruntime() if onnxruntime else OnnxRuntimeInfo(
        "unknown", None, None, [], "importlib.metadata", not_asked % "onnxruntime")
    apple = detect_apple(system, sysctl=sysctl) if system == "Darwin" else None
    mlx_info = detect_mlx() if mlx else MlxInfo("unknown", _dist_version("mlx"), _dist_version("mlx-lm"), None,
                                                None, "importlib.metadata", not_asked % "mlx")
    return HardwareReport(
        platform=plat,
        cpu=detect_cpu(root, system, sysctl),
        memory=detect_memory(root, system, sysctl),
        gpus=detect_gpus(root, nvml) if system != "Darwin" else GPUProbe("none", "macOS has no NVIDIA GPUs",
                                                                          "platform.system()"),
        apple=apple,
        jetson=detect_jetson(root) if system == "Linux" else None,
        llama_cpp=llama,
        onnxruntime=ort,
        coreml=detect_coreml(system, apple.macos_version if apple else None),
        mlx=mlx_info,
        display_gpus=detect_display_gpus(root) if system == "Linux" else None,
    )


def offload_device(report: HardwareReport) -> dict | None:
    """The device llama.cpp offloads to when no NVIDIA, Apple or Jetson GPU is known otherwise (a Vulkan or
    ROCm GPU, from llama.cpp's own device list): its first GPU, else its first integrated GPU."""
    devices = report.llama_cpp.devices
    for kind in ("gpu", "igpu"):
        for d in devices:
            if d.get("type") == kind:
                return d
    return None


def _has_gpu(report: HardwareReport) -> bool:
    return (bool(report.gpus.devices) or report.apple is not None or report.jetson is not None
            or offload_device(report) is not None)


def default_gpu_layers(report: HardwareReport) -> int:
    """-1 (all layers) where there is a GPU and the llama.cpp build can offload to it, else 0.
    An unknown build counts as unable: a wrong 0 is slow, a wrong -1 fails to load."""
    return -1 if _has_gpu(report) and report.llama_cpp.gpu_offload else 0


def resolve_gpu_layers(user_value: int | None, report: HardwareReport | None = None) -> int:
    """The user's --gpu-layers when given, else the detected default."""
    if user_value is not None:
        return user_value
    return default_gpu_layers(report if report is not None else detect(onnxruntime=False))


def _uses_gpu(report: HardwareReport, use_gpu: bool | None) -> bool:
    return _has_gpu(report) and (default_gpu_layers(report) != 0 if use_gpu is None else use_gpu)


def memory_kind(report: HardwareReport, use_gpu: bool | None = None) -> MemoryKind:
    """Where the weights live when running: "discrete" GPU memory, "unified" (Apple, Jetson) or "cpu" RAM."""
    if not _uses_gpu(report, use_gpu):
        return "cpu"
    if report.apple is not None or report.jetson is not None:
        return "unified"
    # A Vulkan (or ROCm) device counts as discrete, integrated ones too: llama.cpp allocates its own
    # buffers there, so the device gets its own budget (--gpu-budget), read from llama.cpp.
    return "discrete"


def device_memory_bytes(report: HardwareReport, use_gpu: bool | None = None) -> int | None:
    """Memory the model runs in: the first GPU's total on a discrete GPU, else RAM (capped by a cgroup)."""
    if memory_kind(report, use_gpu) == "discrete":
        if report.gpus.devices:
            return report.gpus.devices[0].memory_total_bytes
        device = offload_device(report)
        return device.get("memory_total_bytes") if device else None
    for unified in (report.apple, report.jetson):
        if unified is not None and unified.unified_memory_bytes:
            return unified.unified_memory_bytes
    return report.memory.usable_bytes


def _slug(text: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", (text or "unknown").strip()).strip("_") or "unknown"


def device_key(report: HardwareReport, use_gpu: bool | None = None) -> str:
    """A short stable key for what the model runs on, for profile and plan caches:
    "cpu-avx512-2t", "cuda-NVIDIA_H200-sm90", "apple-M2", "jetson-AGX_Orin-sm87", "vulkan-llvmpipe_LLVM_15.0.6_256_bits".
    It names the device actually used: a GPU machine with a CPU-only llama.cpp build gets a cpu key."""
    if _uses_gpu(report, use_gpu):
        if report.apple is not None:
            return "apple-" + _slug((report.apple.chip or "unknown").replace("Apple ", ""))
        if report.jetson is not None:
            model = (report.jetson.model or report.jetson.soc or "unknown")
            model = re.sub(r"^NVIDIA\s+|^Jetson\s+|\s+Developer Kit$", "", model)
            model = re.sub(r"^Jetson\s+", "", model)
            return f"jetson-{_slug(model)}-sm{report.jetson.cuda_arch or 'unknown'}"
        if report.gpus.devices:
            gpu = report.gpus.devices[0]
            return f"cuda-{_slug(gpu.name)}-sm{gpu.sm or 'unknown'}"
        device = offload_device(report) or {}
        backend = (device.get("backend") or "gpu").lower()
        return f"{backend}-{_slug(device.get('description') or device.get('name'))}"
    threads = report.cpu.usable_cores or report.cpu.logical_cores or 0
    return f"cpu-{report.cpu.simd_level}-{threads}t"


# --- how fast a model decodes here: decode streams every weight once per token ----------------------

_BANDWIDTH: list[float] = []  # measured once per process


def memory_bandwidth_bytes_s(seconds: float = 0.3) -> float:
    """Bytes per second one pass over a large array reads here (numpy sum over 256 MiB, best of a few
    runs within `seconds`): the ceiling a CPU decode step, which reads every weight once, runs under."""
    if _BANDWIDTH:
        return _BANDWIDTH[0]
    import time

    import numpy as np

    data = np.ones(32 * 1024 * 1024, dtype=np.float64)  # 256 MiB, past every cache
    best, t_end = float("inf"), time.perf_counter() + seconds
    for _ in range(5):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    _BANDWIDTH.append(data.nbytes / best)
    return _BANDWIDTH[0]
