"""What to install on this machine and which catalog models fit it, from a `HardwareReport`.

`doctor_document(report)` is the whole of `edgespec doctor --json`: the report's `to_dict()` plus
`advice`, a list of {"topic", "message", "command", "settings"}. Commands are exact and copyable;
where edgespec has not checked one on such hardware, the message says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgespec.machine.hardware import (DisplayGPU, HardwareReport, default_gpu_layers, device_memory_bytes,
                                       memory_kind, offload_device, parse_llama_system_info)

LLAMA_CPP_VERSION = "0.3.36"
_PIP_LLAMA = f"pip install --force-reinstall --no-cache-dir llama-cpp-python=={LLAMA_CPP_VERSION}"

# Rough room a loaded model needs beyond its file: KV cache at a 4k context, compute buffers.
# The memory planner has the real numbers once a model is open; this only ranks catalog entries.
_OVERHEAD_FACTOR = 1.2
_OVERHEAD_BYTES = 512 * 1024**2
GIB = 1024**3


@dataclass
class Advice:
    topic: str  # "llama_cpp", "onnxruntime", "coreml", "mlx", "nvml", "models"
    message: str
    command: str | None = None
    settings: dict[str, Any] | None = None


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def cuda_build_command(arch: str | None, cudacxx: str | None = None) -> str:
    args = "-DGGML_CUDA=on" + (f" -DCMAKE_CUDA_ARCHITECTURES={arch}" if arch else "")
    prefix = f"CUDACXX={cudacxx} " if cudacxx else ""
    return f'{prefix}CMAKE_ARGS="{args}" {_PIP_LLAMA}'


def metal_build_command() -> str:
    return f'CMAKE_ARGS="-DGGML_METAL=on" {_PIP_LLAMA}'


def cpu_build_command() -> str:
    return f"pip install llama-cpp-python=={LLAMA_CPP_VERSION}"


def vulkan_build_command() -> str:
    """From a checkout: Debian's Vulkan toolchain, the header guard Debian 12 needs, its own venv."""
    return "bash scripts/install.sh --vulkan"


def vulkan_pip_command() -> str:
    """Where the Vulkan headers are 1.3.261 or newer (Debian 13, Ubuntu 24.04, the LunarG SDK)."""
    return f'CMAKE_ARGS="-DGGML_VULKAN=on" {_PIP_LLAMA}'


def rocm_build_command() -> str:
    return f'CMAKE_ARGS="-DGGML_HIP=on" {_PIP_LLAMA}'


def _consumer_gpu_advice(r: HardwareReport, gpus: list[DisplayGPU]) -> Advice:
    """AMD, Intel (or NVIDIA without its driver) GPUs from /sys/class/drm: the build that fits, and
    what doctor could not confirm."""
    probe = r.display_gpus
    g = gpus[0]
    vulkan = [d for d in (probe.vulkan or []) if d.type != "CPU"] if probe else []
    what = f"{g.vendor.upper() if g.vendor == 'amd' else g.vendor.capitalize()} GPU {g.device_id or '?'} " \
           f"(driver {g.driver or '?'}, {g.source})"
    if vulkan:
        seen = f"Vulkan sees {vulkan[0].name} ({vulkan[0].driver or '?'} driver, Vulkan {vulkan[0].api_version or '?'})"
    elif probe and probe.vulkan is not None:
        seen = "not verified: vulkaninfo lists no hardware Vulkan device, so install the GPU's Vulkan driver " \
               "(Mesa's radv / anv: apt-get install mesa-vulkan-drivers) first"
    else:
        seen = f"not verified: no Vulkan driver confirmed ({probe.vulkan_reason if probe else 'not read'})"
    if g.vendor == "amd" and probe and probe.rocm:
        return Advice("llama_cpp", f"{what}: ROCm {probe.rocm} is installed, so build llama.cpp with HIP "
                      f"(Vulkan works too: `{vulkan_build_command()}`); {seen}. Not checked by edgespec on an AMD GPU.",
                      rocm_build_command())
    if g.vendor == "nvidia":
        return Advice("llama_cpp", f"{what} without NVIDIA's driver (/proc/driver/nvidia absent): install the "
                      "driver and CUDA toolkit for the CUDA build, or run it through Vulkan with this command; "
                      f"{seen}. Not checked by edgespec on this GPU.", vulkan_build_command())
    return Advice("llama_cpp", f"{what}: build llama.cpp with Vulkan, as Ollama and LM Studio run these GPUs "
                  f"(Debian/Ubuntu, from a checkout; elsewhere with Vulkan headers >= 1.3.261: `{vulkan_pip_command()}`); "
                  f"{seen}. Not checked by edgespec on this GPU (its Vulkan path is tested on Mesa's software device).",
                  vulkan_build_command())


def _llama_advice(r: HardwareReport) -> list[Advice]:
    llama = r.llama_cpp
    out: list[Advice] = []
    offload = llama.gpu_offload is True
    if llama.status == "unknown":
        out.append(Advice("llama_cpp", f"could not ask the installed llama.cpp build what it supports: {llama.reason}"))

    nvidia = [g for g in r.gpus.devices]
    # GPUs the kernel knows that NVML did not list: AMD, Intel, an NVIDIA card without NVIDIA's driver
    consumer = [g for g in (r.display_gpus.devices if r.display_gpus else [])
                if g.vendor in ("amd", "intel") or (g.vendor == "nvidia" and not nvidia)]
    vk_device = offload_device(r)
    if r.jetson is not None:
        j = r.jetson
        if not offload:
            jp = j.jetpack or "?"
            out.append(Advice(
                "llama_cpp",
                f"{j.model or 'Jetson ' + (j.soc or '?')} (JetPack {jp}, L4T {j.l4t_release or '?'}): build llama.cpp with "
                f"CUDA for sm_{j.cuda_arch or '?'} from source on the board (takes long; needs JetPack's CUDA in "
                "/usr/local/cuda). JetPack 5 or 6 is expected; JetPack 4's CUDA 10.2 is probably too old. "
                "Not checked by edgespec on a Jetson.",
                cuda_build_command(j.cuda_arch, "/usr/local/cuda/bin/nvcc")))
    elif nvidia:
        g = nvidia[0]
        if not offload:
            toolkit = r.gpus.cuda_toolkit
            need = ("" if toolkit else " It needs the CUDA toolkit (nvcc), which was not found: install it first.")
            out.append(Advice(
                "llama_cpp",
                f"{g.name or 'an NVIDIA GPU'} (compute capability {g.compute_capability or '?'}) is here but the "
                f"installed llama.cpp build cannot offload to it: rebuild it with CUDA"
                f"{f' (CUDA toolkit {toolkit})' if toolkit else ''}.{need} Not checked by edgespec on a GPU.",
                cuda_build_command(g.sm)))
    elif r.apple is not None:
        if not offload:
            out.append(Advice(
                "llama_cpp",
                f"{r.apple.chip or 'Apple Silicon'}: rebuild llama.cpp with Metal (llama-cpp-python usually "
                "enables it on Apple Silicon by itself; this build does not offload). Not checked by edgespec on a Mac.",
                metal_build_command()))
    elif consumer and not (offload and vk_device):
        out.append(_consumer_gpu_advice(r, consumer))
    if llama.status == "not installed":
        if not out:
            out.append(Advice("llama_cpp", "llama-cpp-python is not installed: install the CPU build.",
                              cpu_build_command()))
        return out
    gpu_found = bool(nvidia or consumer or vk_device) or r.apple is not None or r.jetson is not None
    if offload and (nvidia or r.apple is not None or r.jetson is not None or vk_device):
        where = f" ({vk_device['name']}: {vk_device['description']})" if vk_device and not nvidia else ""
        seen = (r.display_gpus.vulkan or []) if r.display_gpus else []
        software = bool(vk_device) and not nvidia and any(d.type == "CPU" and d.name == vk_device["description"]
                                                          for d in seen)
        caveat = (" It is a software Vulkan device that runs on the CPU (Mesa's lavapipe): good for testing the "
                  "GPU path, slower than the CPU build; unset GGML_VK_VISIBLE_DEVICES to stop using it."
                  if software else "")
        out.append(Advice("llama_cpp", f"llama.cpp build offloads to the GPU{where} (backends: "
                          f"{', '.join(llama.backends)}); edgespec offloads all layers unless told otherwise.{caveat}",
                          settings={"n_gpu_layers": -1}))
    elif not gpu_found and llama.status == "ok":
        built = parse_llama_system_info(llama.system_info or "").get("CPU", {})
        missing = [f for f, flag in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX"))
                   if f in r.cpu.simd and built.get(flag) != "1"]
        if missing and built:
            out.append(Advice("llama_cpp", f"this CPU has {missing[0]} but the llama.cpp build does not use it: "
                              "rebuild it for this CPU.", f'CMAKE_ARGS="-DGGML_NATIVE=on" {_PIP_LLAMA}'))
        else:
            used = [k for k, v in built.items() if v == "1" and k.startswith(("AVX", "AMX", "SVE", "SME", "NEON",
                                                                                "DOTPROD", "MATMUL_INT8"))]
            out.append(Advice("llama_cpp", "the CPU build of llama.cpp is the right one here (no GPU found); "
                              f"it is built with {', '.join(used) or 'no SIMD features it reports'}."))
    return out


def _onnx_advice(r: HardwareReport) -> list[Advice]:
    ort = r.onnxruntime
    providers = set(ort.providers)
    if r.jetson is not None:
        if "CUDAExecutionProvider" not in providers:
            return [Advice("onnxruntime", f"onnxruntime-gpu for Jetson is not on PyPI for aarch64: install the wheel "
                           f"NVIDIA builds for JetPack {r.jetson.jetpack or '?'} (Jetson Zoo / Jetson AI Lab pip "
                           "index) in place of onnxruntime. Not checked by edgespec on a Jetson.")]
        return []
    if r.gpus.devices:
        if "CUDAExecutionProvider" not in providers:
            cmd = ("pip uninstall -y onnxruntime && " if ort.package == "onnxruntime" else "") + "pip install onnxruntime-gpu"
            cuda = r.gpus.devices[0].cuda_driver_version
            return [Advice("onnxruntime", "for the ONNX runtime on this NVIDIA GPU use onnxruntime-gpu; it must not be "
                           "installed beside onnxruntime, and its wheel's CUDA major version must be one the driver "
                           f"supports (driver CUDA {cuda or '?'}). Not checked by edgespec on a GPU.", cmd)]
        return []
    if r.apple is not None:
        if ort.status == "not installed":
            return [Advice("onnxruntime", "for the ONNX runtime: the macOS onnxruntime wheel includes the Core ML "
                           "execution provider.", "pip install onnxruntime")]
        if ort.status == "ok" and "CoreMLExecutionProvider" not in providers:
            return [Advice("onnxruntime", "this onnxruntime has no CoreMLExecutionProvider; reinstall the PyPI wheel.",
                           "pip install --force-reinstall onnxruntime")]
        return []
    if ort.status == "not installed":
        return [Advice("onnxruntime", "optional, for the ONNX runtime: the CPU wheel.", "pip install onnxruntime")]
    return []


MLX_INSTALL = "pip install 'edgespec[mlx]'"
MLX_EXAMPLE = 'edgespec generate "..." --runtime mlx --target hf:mlx-community/Qwen2.5-Coder-1.5B-Instruct-4bit'


def _mlx_advice(r: HardwareReport) -> list[Advice]:
    """On Apple Silicon: MLX on Metal, or llama.cpp's Metal build; elsewhere: MLX's CPU backend if installed."""
    mlx = r.mlx
    unverified = ("doctor does not time models: whether MLX or llama.cpp's Metal build is faster for a given "
                  "model is not verified here; run the same prompt with --runtime mlx and with the Metal build "
                  "and compare their tok/s (bench/mlx_bench.py does it interleaved)")
    if r.apple is None:
        if mlx.status == "ok":
            return [Advice("mlx", f"MLX {mlx.version} is installed with its CPU backend only (Metal needs an Apple "
                           "Silicon Mac): --runtime mlx runs Hugging Face checkpoints and MLX repos here on the CPU. "
                           "On a CPU the llama.cpp runtime (the default) is the one edgespec tunes for speed.")]
        if mlx.status == "unknown" and mlx.version:
            return [Advice("mlx", f"MLX {mlx.version} is installed but {mlx.reason}.")]
        return []
    if mlx.status == "not installed":
        return [Advice("mlx", f"{r.apple.chip or 'Apple Silicon'}: MLX runs models on the GPU through Metal; install "
                       "it and run a Hugging Face checkpoint or an MLX repo with --runtime mlx. "
                       "llama.cpp's Metal build (above) runs GGUF files on the same GPU. " + unverified + ".",
                       MLX_INSTALL)]
    if mlx.status != "ok":
        return [Advice("mlx", f"MLX {mlx.version or ''} could not be asked about Metal: {mlx.reason}; reinstall it.",
                       f"pip install --force-reinstall mlx && {MLX_INSTALL}")]
    if not mlx.metal:
        return [Advice("mlx", f"MLX {mlx.version} reports no Metal device (mx.metal.is_available() is False), so it "
                       "would run on the CPU; reinstall the macOS mlx wheel (it needs macOS 14+ on Apple Silicon).",
                       "pip install --force-reinstall mlx")]
    if not mlx.mlx_lm:
        return [Advice("mlx", f"MLX {mlx.version} sees Metal, but mlx-lm (which loads the models) is missing.",
                       MLX_INSTALL)]
    return [Advice("mlx", f"MLX {mlx.version} sees Metal (default device {mlx.device}): run with --runtime mlx on "
                   "the GPU. " + unverified + ".", MLX_EXAMPLE)]


def _other_advice(r: HardwareReport) -> list[Advice]:
    out = []
    if r.gpus.status == "unavailable" and r.gpus.devices:
        out.append(Advice("nvml", "the NVIDIA driver is loaded but NVML could not be asked; install nvidia-ml-py "
                          "so edgespec can read GPU memory and compute capability.", "pip install nvidia-ml-py"))
    if r.apple is not None and r.coreml.coremltools is None and not r.coreml.can_run:
        if "not installed" in r.coreml.reason:
            out.append(Advice("coreml", "for the Core ML runtime install coremltools.", "pip install coremltools==9.0"))
    return out


def _catalog() -> list[Any] | None:
    try:
        from edgespec.models import catalog

        return list(catalog.entries())
    except Exception:  # the catalog is optional for advice; doctor must still answer
        return None


def _default_model() -> str:
    from edgespec.models import catalog

    return catalog.DEFAULT_MODEL


def _recommended_pair(budget: int, basis: "SpeedBasis | None" = None) -> tuple[Any, int, float | None] | None:
    """(pair, predicted peak, predicted target tok/s) of the recommended pair (models/pairs.json) to use:
    the largest within the memory budget whose target decodes at USABLE_TOK_S or faster by `basis`, else
    the fastest that fits. Without a basis (a GPU never profiled) the largest that fits."""
    try:
        from edgespec.models import pairs
    except Exception:  # advice must answer even where the pairs catalog cannot load
        return None
    fitting = sorted((p for p in pairs.pairs() if p.usable and p.expected_bytes() <= budget), key=lambda p: p.expected_bytes(),
                     reverse=True)
    if not fitting:
        return None
    if basis is None:
        return fitting[0], fitting[0].expected_bytes(), None
    speed = {p.name: basis.tok_s(p.target.file_bytes) for p in fitting}
    usable = [p for p in fitting if speed[p.name] >= USABLE_TOK_S]
    pair = usable[0] if usable else max(fitting, key=lambda p: speed[p.name])
    return pair, pair.expected_bytes(), speed[pair.name]


def _mtp_note(pair) -> str:
    """Says so where the pair's target file carries an MTP (NextN) head: it drafts without the draft model."""
    heads = getattr(pair.target, "mtp_heads", 0)
    return f"; its target carries an MTP head ({heads} NextN layer{'s' if heads > 1 else ''}: --mode mtp)" if heads else ""


def model_need_bytes(*size_bytes: int) -> int:
    """Rough memory to run these model files together (weights, plus KV cache and buffers for each)."""
    return int(sum(size_bytes) * _OVERHEAD_FACTOR) + _OVERHEAD_BYTES * len(size_bytes)


def _model_budget(r: HardwareReport) -> tuple[int | None, str]:
    kind = memory_kind(r)
    if kind == "discrete":
        name = r.gpus.devices[0].name if r.gpus.devices else (offload_device(r) or {}).get("description")
        return device_memory_bytes(r), f"GPU memory of {name}"
    if kind == "unified" and r.apple is not None:
        total = device_memory_bytes(r)
        # macOS lets Metal wire about 2/3 to 3/4 of RAM by default (recommendedMaxWorkingSetSize, not read here).
        return (int(total * 2 / 3) if total else None), "2/3 of unified memory (Metal's default working-set cap, assumed)"
    available = r.memory.available_bytes or r.memory.usable_bytes
    if r.memory.limit_bytes and available:
        available = min(available, r.memory.limit_bytes)
    return available, "available RAM" + (" shared with the GPU" if kind == "unified" else "")


def _models_advice(r: HardwareReport) -> list[Advice]:
    entries = _catalog()
    if entries is None:
        return [Advice("models", "the model catalog is not importable here; no model advice.")]
    budget, what = _model_budget(r)
    if budget is None:
        return [Advice("models", "memory size is unavailable, so no model advice.")]
    by_name = {e.name: e for e in entries}
    pairs = [(e, by_name[e.draft]) for e in entries if e.draft and e.draft in by_name]
    pairs.sort(key=lambda p: p[0].size_bytes + p[1].size_bytes, reverse=True)
    singles = sorted(entries, key=lambda e: e.size_bytes, reverse=True)
    gpu_layers = default_gpu_layers(r)
    threads = r.cpu.physical_cores or r.cpu.usable_cores or 1
    if r.cpu.usable_cores:
        threads = min(threads, r.cpu.usable_cores)
    on_gpu = gpu_layers != 0
    why_mode = ("on a GPU, verifying k tokens costs about one step, where draft-model speculation usually pays "
                "(edgespec has not measured this hardware)" if on_gpu else
                "on a CPU, draft-model speculation often loses (0.7-0.86x plain decoding with the Qwen2.5-Coder "
                "1.5B + 0.5B pair on a 2-core build machine) while prompt lookup helps on edit-like prompts; `auto` "
                "measures and chooses")
    basis = speed_basis(r)
    recommended = _recommended_pair(budget, basis)
    if recommended is not None:
        pair, need, tok_s = recommended
        if tok_s is None:
            speed, chosen = "its speed on this GPU is not predicted until `edgespec profile` has run", "largest"
        else:
            speed = (f"its target is predicted to decode at about {tok_s:.1f} tok/s here, from {basis.source}"
                     + ("" if tok_s >= USABLE_TOK_S else f", under the {USABLE_TOK_S:g} tok/s a reader keeps up with: "
                        "no recommended pair is faster"))
            chosen = "largest fast enough" if tok_s >= USABLE_TOK_S else "fastest"
        default = " (the default: what `edgespec generate` runs when no model is named)" if pair.target.source == (
            _default_model()) else ""
        return [Advice(
            "models", f"the {chosen} recommended pair that fits is {pair.target.name} with draft {pair.draft.name}{default} "
            f"({_gib(need)} predicted by the memory planner at a 4096-token context, of {_gib(budget)} {what}; "
            f"{speed}){_mtp_note(pair)}; {why_mode}. Fetch it, then run it:",
            f"{pair.pull_command()} && {pair.run_command()} --mode auto",
            {"target": pair.target.source, "draft": pair.draft.source, "mode": "auto", "n_gpu_layers": gpu_layers,
             "n_threads": threads, "need_bytes": need, "budget_bytes": budget, "family": pair.family,
             "pull": [pair.target.source, pair.draft.source],
             "predicted_tok_s": None if tok_s is None else round(tok_s, 1),
             "speed_basis": None if basis is None else basis.source})]
    for target, draft in pairs:
        need = model_need_bytes(target.size_bytes, draft.size_bytes)
        if need <= budget:
            return [Advice(
                "models", f"{target.name} with draft {draft.name} fits ({_gib(need)} needed of {_gib(budget)} "
                f"{what}); {why_mode}.",
                f'edgespec generate "..." --target {target.name} --draft {draft.name} --mode auto',
                {"target": target.name, "draft": draft.name, "mode": "auto", "n_gpu_layers": gpu_layers,
                 "n_threads": threads, "need_bytes": need, "budget_bytes": budget})]
    for entry in singles:
        need = model_need_bytes(entry.size_bytes)
        if need <= budget:
            return [Advice(
                "models", f"no catalog pair fits {_gib(budget)} {what}, not even the default ({_default_model()} "
                f"with its draft, which `edgespec generate` loads when no model is named); {entry.name} alone does "
                f"({_gib(need)}): name it and use prompt lookup drafting.",
                f'edgespec generate "..." --target {entry.name} --mode lookup',
                {"target": entry.name, "draft": None, "mode": "lookup", "n_gpu_layers": gpu_layers,
                 "n_threads": threads, "need_bytes": need, "budget_bytes": budget})]
    return [Advice("models", f"no catalog model fits {_gib(budget)} {what}.")]


def advise(report: HardwareReport) -> list[Advice]:
    return (_llama_advice(report) + _onnx_advice(report) + _mlx_advice(report) + _other_advice(report)
            + _models_advice(report))


def doctor_document(report: HardwareReport) -> dict[str, Any]:
    """`edgespec doctor --json`: the hardware report plus advice, one JSON-ready object."""
    doc = report.to_dict()
    doc["advice"] = [dataclasses.asdict(a) for a in advise(report)]
    doc["memory_guard"] = guard_ladder()
    return doc


def guard_ladder() -> list[dict]:
    """Under --budget, what the run-time guard frees, in order, with the defaults (the draft's share
    depends on the model: `edgespec plan --budget` says it)."""
    from edgespec.machine.guard import default_estimates, ladder_rows

    return ladder_rows(default_estimates(None), {
        "saved_state": "serve's prefix cache when full (--prefix-cache-mb)",
        "suffix_history": "a full history (--history-limit)",
        "kv_pool": "the KV pools past 256 cells each (not --parallel's): see `edgespec plan --budget`",
        "draft_model": "its weights, KV and buffers: see `edgespec plan --budget`", "refuse": "the last step"})


def render_doctor(doc: dict[str, Any], console: Any = None) -> None:
    """Human output of `edgespec doctor`: a table of findings, each with its source, then the advice."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title="edgespec doctor", show_lines=False)
    table.add_column("item")
    table.add_column("value")
    table.add_column("source", style="dim")

    def row(item: str, value: Any, source: str | None) -> None:
        table.add_row(Text(item), Text("-" if value is None else str(value)), Text(source or ""))

    cpu, mem = doc["cpu"], doc["memory"]
    row("platform", f"{doc['platform']['system']} {doc['platform']['machine']}", doc["platform"]["source"])
    row("cpu", cpu["name"] or cpu["unavailable"].get("name"), cpu["sources"].get("name"))
    row("cores (logical / physical / usable)",
        f"{cpu['logical_cores']} / {cpu['physical_cores']} / {cpu['usable_cores']}",
        cpu["sources"].get("physical_cores") or cpu["sources"].get("logical_cores"))
    row("SIMD", f"{cpu['simd_level']}: {' '.join(cpu['simd']) or '-'}",
        cpu["sources"].get("simd") or cpu["unavailable"].get("simd"))
    row("RAM total / available", f"{_gib(mem['total_bytes'])} / {_gib(mem['available_bytes'])}",
        mem["sources"].get("total_bytes") or mem["unavailable"].get("total_bytes"))
    if mem["limit_bytes"]:
        row("memory limit", _gib(mem["limit_bytes"]), mem["sources"].get("limit_bytes"))
    gpus = doc["gpus"]
    if gpus["devices"]:
        for g in gpus["devices"]:
            row(f"GPU {g['index']}", f"{g['name']}, {_gib(g['memory_total_bytes'])}, cc {g['compute_capability']}, "
                f"driver {g['driver_version']} (CUDA {g['cuda_driver_version']})", g["source"])
    else:
        row("NVIDIA GPUs", gpus["status"] + (f": {gpus['reason']}" if gpus["reason"] else ""), gpus["source"])
    if gpus["cuda_toolkit"]:
        row("CUDA toolkit", gpus["cuda_toolkit"], gpus["cuda_toolkit_source"])
    display = doc.get("display_gpus")
    if display:
        for g in display["devices"]:
            row(f"GPU {g['card']}", f"{g['vendor']} {g['device_id']}, driver {g['driver']}"
                + (f", {_gib(g['memory_total_bytes'])}" if g["memory_total_bytes"] else ""), g["source"])
        if display["vulkan"] is not None:
            row("Vulkan devices", ", ".join(f"{d['name']} ({d['type']})" for d in display["vulkan"]) or "none",
                display["sources"].get("vulkan"))
        else:
            row("Vulkan devices", display["vulkan_reason"], None)
        if display["rocm"]:
            row("ROCm", display["rocm"], display["sources"].get("rocm"))
    apple = doc["apple"]
    if apple:
        row("Apple chip", apple["chip"], apple["sources"].get("chip"))
        row("unified memory", _gib(apple["unified_memory_bytes"]), apple["sources"].get("unified_memory_bytes"))
        row("GPU cores / Metal", f"{apple['gpu_cores']} / {apple['metal']}",
            apple["sources"].get("metal") or apple["unavailable"].get("metal"))
    jetson = doc["jetson"]
    if jetson:
        row("Jetson", jetson["model"], jetson["sources"].get("model"))
        row("L4T / JetPack", f"{jetson['l4t_release']} / {jetson['jetpack']}",
            jetson["sources"].get("jetpack") or jetson["unavailable"].get("jetpack"))
        row("CUDA arch", jetson["cuda_arch"], jetson["sources"].get("cuda_arch"))
        row("unified memory", _gib(jetson["unified_memory_bytes"]), jetson["sources"].get("unified_memory_bytes"))
    llama = doc["llama_cpp"]
    row("llama.cpp", f"{llama['version'] or 'not installed'}; GPU offload: "
        f"{ {True: 'yes', False: 'no', None: 'unknown'}[llama['gpu_offload']] }; backends: "
        f"{', '.join(llama['backends']) or '-'}" + (f" ({llama['reason']})" if llama["reason"] else ""),
        llama["source"])
    for d in llama["devices"]:
        if d["type"] != "cpu":
            row(f"llama.cpp device {d['name']}", f"{d['description']} ({d['type']}), "
                f"{_gib(d['memory_free_bytes'])} free of {_gib(d['memory_total_bytes'])}", "ggml_backend_dev_memory")
    ort = doc["onnxruntime"]
    row("onnxruntime", " ".join(x for x in (ort["package"] or "not installed", ort["version"]) if x) + "; "
        f"providers: {', '.join(ort['providers']) or '-'}", ort["source"])
    row("Core ML", ("can run" if doc["coreml"]["can_run"] else "cannot run") + f": {doc['coreml']['reason']}",
        doc["coreml"]["source"])
    mlx = doc["mlx"]
    backend = {True: "Metal and CPU", False: "CPU backend only", None: "unknown"}[mlx["metal"]]
    row("MLX", (f"mlx {mlx['version']}, mlx-lm {mlx['mlx_lm'] or 'not installed'}; {backend}"
                if mlx["status"] == "ok" else mlx["reason"]), mlx["source"])
    row("device key", doc["device_key"], "edgespec.machine.hardware.device_key")
    row("memory kind / GPU layers", f"{doc['memory_kind']} / {doc['gpu_layers']}", "edgespec.machine.hardware")
    console.print(table)
    if doc.get("memory_guard"):
        from edgespec.machine.guard import ladder_lines

        lines = ladder_lines(doc["memory_guard"])
        console.print(Text("\n".join(["under --budget, as memory runs short, the guard frees in order:"] + lines[1:])))
    for a in doc["advice"]:
        console.print(Text.assemble((a["topic"], "bold"), ": ", a["message"]))
        if a["command"]:
            console.print(Text("    " + a["command"]), soft_wrap=True)


# --- fast enough to use: the predicted decode speed of a model here ---------------------------------

# Below this a reply comes slower than people read (about 4-5 words a second): the recommended pair is the
# largest fitting one whose target decodes at least this fast here.
USABLE_TOK_S = 5.0
# Profiles of models smaller than this are mostly per-step overhead, not weight streaming (SmolLM2-135M's
# 13 ms step here reads as 7 GB/s; the 1.5B's 14 tok/s as 15 GB/s): they would predict larger models too slow.
_MIN_BASIS_BYTES = 250 * 1024**2


@dataclass(frozen=True)
class SpeedBasis:
    """Bytes of model a decode step streams per second here, and where that figure comes from."""

    bytes_per_s: float
    source: str

    def tok_s(self, file_bytes: int) -> float:
        """Predicted plain decode speed of a model file of `file_bytes` (every weight read once a token)."""
        return self.bytes_per_s / max(file_bytes, 1)


def speed_basis(r: HardwareReport, profiles_dir=None) -> SpeedBasis | None:
    """From the measured step time of the largest model profiled on this device (`edgespec profile`),
    else from the memory bandwidth measured now; None on a GPU with no profile (its bandwidth is not measured)."""
    import json
    from pathlib import Path

    from edgespec.machine.hardware import device_key, memory_bandwidth_bytes_s

    device = device_key(r)
    if profiles_dir is None:
        from edgespec.machine.profile import profile_dir

        profiles_dir = profile_dir()
    best: tuple[int, float, str] | None = None  # (model bytes, step seconds, model name)
    for path in Path(profiles_dir).glob("*.json") if Path(profiles_dir).is_dir() else ():
        try:
            d = json.loads(path.read_text())
            key, step = d["key"], float(d["verify_s"]["1"])
            if not str(key["target"].get("runtime", "")).startswith("llama-cpp"):
                continue  # the pairs run on llama.cpp; an ONNX step is another runtime's speed
            model = key["target"]["model"]
            size, name = int(model["size"]), str(model.get("name", "?"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if key.get("device") != device or size < _MIN_BASIS_BYTES or step <= 0:
            continue
        if best is None or size > best[0] or (size == best[0] and step < best[1]):
            best = (size, step, name)
    if best is not None:
        size, step, name = best
        return SpeedBasis(size / step, f"the measured step of {name} ({step * 1000:.0f} ms a token)")
    if memory_kind(r) == "discrete" and default_gpu_layers(r) != 0:
        return None
    bw = memory_bandwidth_bytes_s()
    return SpeedBasis(bw, f"the memory bandwidth measured now ({bw / 1e9:.1f} GB/s) and the model's size")
