"""A model of the memory a target + draft setup holds, from GGUF metadata and one calibration per build.

What a llama.cpp process holds, and where each number comes from:

* weights, per device, given the layers offloaded (from the GGUF tensor table). On the CPU a tensor
  lives in one of two places: mmap'd file pages (resident once touched: llama.cpp populates the whole
  tensor span at load, so the span counts) or an anonymous copy in llama.cpp's "repacked" layout for
  faster matmuls (Q4_0 / Q4_K / IQ4_NL on AVX2 and NEON). A repacked tensor's file pages stay mapped
  inside the span, so with mmap a repacked tensor counts twice; reading the file instead of mapping
  it (`use_mmap=False`) holds every tensor once.
* KV cache: n_ctx cells (llama.cpp rounds n_ctx up to a multiple of 256) x layers x (K row + V row),
  rows sized by the cache type (f16: 2 bytes/element, q8_0: 34 bytes per 32, q4_0: 18 per 32). The
  cache is cleared at creation, so all of it is resident.
* compute buffer: the activations of one ubatch of n_batch tokens, reserved by llama.cpp's graph
  allocator. Its structure (3 FFN-wide and 3 or 4 embedding-wide f32 rows per token, the attention
  mask, or the score matrix without flash attention, and n_outputs logits rows at the head) is fixed
  by llama.cpp's graph; the scale of each term is calibrated once per build from llama.cpp's own
  "compute buffer size" for a reference model (see `Calibration`). The plan sets n_outputs_max to
  the verification rows (k + 1, or a tree's size + 1), so the buffer holds those rows, not n_batch.
* verification buffers: the logits rows of a verification pass, held by llama.cpp's output buffer,
  the runtime's copy and the sampler's work arrays.
* the vocabulary (llama.cpp's token tables and BPE merges), a per-model residual and a fixed process
  overhead (Python, numpy, the llama.cpp libraries, edgespec), measured at calibration.

Discrete GPUs hold weights, KV and compute of offloaded layers in VRAM, counted apart from host RAM;
unified memory (Apple Silicon, Jetson) counts both in one pool, and Metal maps mmap'd weights without
copying them. GPU terms follow llama.cpp's layer placement (layer i is on the GPU when
i >= n_layer + 1 - n_gpu_layers; the output layer counts as layer n_layer; token embeddings stay on
the CPU); the fixed GPU overheads are defaults until a calibration on that GPU replaces them.

This module reads GGUF files with the `gguf` package and never imports llama.cpp: whatever needs
llama.cpp (calibration, the GGUF reading too, kept out of the caller's process so the reader's
transient memory never counts against a budget) runs in a fresh subprocess (`edgespec.machine.memprobe`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from edgespec import atomic
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import FLOAT_KV, flash_attention, padded_ctx  # the runtime decides these alike

MiB = 1 << 20
PAGE = 4096

# KV cache element types: (elements per block, bytes per block).
KV_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24),
    "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18),
}

MemoryKind = Literal["cpu", "discrete", "unified"]


def cache_dir() -> Path:
    """Where memory facts and calibrations are cached: $EDGESPEC_HOME/memory, else the user cache dir."""
    home = os.environ.get("EDGESPEC_HOME")
    if home:
        return Path(home).expanduser() / "memory"
    import platformdirs

    return Path(platformdirs.user_cache_dir("edgespec")) / "memory"


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json.dumps(data))


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def row_bytes(n_elements: int, cache_type: str) -> int:
    """Bytes of one KV row of n_elements in a cache type."""
    if cache_type not in KV_BLOCKS:
        raise EdgespecError(f"unknown KV cache type {cache_type!r}; use one of {', '.join(KV_BLOCKS)}")
    block, size = KV_BLOCKS[cache_type]
    if n_elements % block:
        raise EdgespecError(f"KV type {cache_type} needs rows of a multiple of {block} elements, got {n_elements}")
    return n_elements // block * size


# --- what a GGUF file says ---------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str      # ggml type name, upper case as the gguf package spells it ("Q4_K")
    ne0: int       # elements per row
    ne1: int       # rows (1 for vectors)
    nbytes: int
    offset: int    # absolute offset of the data in the file

    @property
    def layer(self) -> int | None:
        """Repeating-layer index for blk.N.*; None for input/output tensors."""
        m = re.match(r"blk\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ModelFacts:
    """Geometry and tensor table of one GGUF model, as the memory model needs them."""

    path: str
    identity: dict
    file_bytes: int
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int
    n_vocab: int
    n_merges: int
    n_ctx_train: int
    tensors: tuple[TensorInfo, ...]
    kv_layers: int | None = None     # layers with a KV cache (a hybrid's attention layers); None = all
    recurrent_state_bytes: int = 0   # one sequence's recurrent state over all recurrent layers (f32)

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_k

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_head_kv * self.head_v

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16", layers: int | None = None) -> int:
        """K and V bytes one token takes over `layers` layers (all by default; a hybrid's attention
        layers are that share of them)."""
        n = self.n_layer if layers is None else layers
        if self.kv_layers is not None:
            n = n * self.kv_layers // self.n_layer
        return n * (row_bytes(self.n_embd_k_gqa, type_k) + row_bytes(self.n_embd_v_gqa, type_v))

    def kv_bytes(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16", layers: int | None = None) -> int:
        return padded_ctx(n_ctx) * self.kv_bytes_per_token(type_k, type_v, layers)

    def placement(self, tensor: TensorInfo, n_gpu_layers: int) -> str:
        """"gpu" or "cpu" for a tensor under llama.cpp's layer placement."""
        g = self.n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, self.n_layer + 1)
        first_gpu = self.n_layer + 1 - g
        if tensor.layer is not None:
            layer = tensor.layer
        elif tensor.name.startswith("output"):  # output.weight, output_norm.*: the output layer
            layer = self.n_layer
        else:                                    # token embeddings and other inputs stay on the CPU
            return "cpu"
        return "gpu" if g > 0 and layer >= first_gpu else "cpu"

    def gpu_layer_count(self, n_gpu_layers: int) -> int:
        return self.n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, self.n_layer + 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tensors"] = [[t.name, t.type, t.ne0, t.ne1, t.nbytes, t.offset] for t in self.tensors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelFacts":
        d = dict(d)
        d["tensors"] = tuple(TensorInfo(*row) for row in d["tensors"])
        return cls(**d)


def facts_from_reader(path: str | os.PathLike) -> ModelFacts:
    """Read a GGUF file's geometry and tensor table with gguf.GGUFReader.

    The reader builds Python objects for every vocabulary entry (hundreds of MB for a 152k vocabulary);
    call this through `model_facts`, which runs it in a subprocess and caches the result.
    """
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(path))

    def value(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        if isinstance(v, list):  # per-layer values (some architectures): the largest one sizes buffers
            v = max(v) if v else default
        return v

    def length(key: str) -> int:
        f = reader.fields.get(key)
        return len(f.data) if f is not None else 0

    arch = value("general.architecture", "llama")
    n_embd = int(value(f"{arch}.embedding_length"))
    n_head = int(value(f"{arch}.attention.head_count"))
    n_head_kv = int(value(f"{arch}.attention.head_count_kv", n_head))
    tensors = tuple(
        TensorInfo(t.name, t.tensor_type.name, int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1,
                   int(t.n_bytes), int(t.data_offset))
        for t in reader.tensors)
    from edgespec.models.store import model_identity

    n_layer = int(value(f"{arch}.block_count"))
    # Recurrent layers: flagged per layer, or the layers without KV heads, or every layer of a
    # wholly recurrent model (ssm keys and no attention).
    flags = reader.fields.get(f"{arch}.attention.recurrent_layers")
    kv_heads = reader.fields.get(f"{arch}.attention.head_count_kv")
    if flags is not None:
        n_recurrent = sum(bool(x) for x in flags.contents())
    elif kv_heads is not None and isinstance(kv_heads.contents(), list):
        n_recurrent = sum(int(x) == 0 for x in kv_heads.contents())
    else:
        n_recurrent = n_layer if value(f"{arch}.ssm.conv_kernel") and not n_head_kv else 0
    if value(f"{arch}.shortconv.l_cache"):   # LFM2: a short convolution's window of inputs
        per_layer = (int(value(f"{arch}.shortconv.l_cache")) - 1) * n_embd
    elif value(f"{arch}.ssm.conv_kernel"):   # Mamba-2, Gated DeltaNet: a conv window and a state matrix
        inner, state = int(value(f"{arch}.ssm.inner_size")), int(value(f"{arch}.ssm.state_size"))
        groups = int(value(f"{arch}.ssm.group_count", 1) or 1)
        per_layer = (int(value(f"{arch}.ssm.conv_kernel")) - 1) * (inner + 2 * groups * state) + state * inner
    else:
        per_layer = 0

    return ModelFacts(
        path=str(path), identity=model_identity(path), file_bytes=path.stat().st_size, arch=arch,
        n_layer=n_layer, n_embd=n_embd,
        n_ff=int(value(f"{arch}.feed_forward_length", 0) or 4 * n_embd),
        n_head=n_head, n_head_kv=n_head_kv,
        head_k=int(value(f"{arch}.attention.key_length", n_embd // n_head)),
        head_v=int(value(f"{arch}.attention.value_length", n_embd // n_head)),
        n_vocab=length("tokenizer.ggml.tokens") or int(value(f"{arch}.vocab_size", 0)),
        n_merges=length("tokenizer.ggml.merges"),
        n_ctx_train=int(value(f"{arch}.context_length", 0)), tensors=tensors,
        kv_layers=n_layer - n_recurrent if n_recurrent else None,
        recurrent_state_bytes=4 * per_layer * n_recurrent if per_layer else 0)


def _run_probe(args: list[str], timeout: float = 600) -> dict:
    """Run `python -m edgespec.machine.memprobe ARGS` in a fresh process; its last stdout line is JSON."""
    done = subprocess.run([sys.executable, "-m", "edgespec.machine.memprobe", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgespecError(f"memory probe `{' '.join(args[:1])}` failed: {tail}")
    out = json.loads(lines[-1])
    if "error" in out:
        raise EdgespecError(out["error"])
    return out


def _facts_key(path: Path) -> str:
    from edgespec.models.store import model_identity

    ident = json.dumps({"id": model_identity(path), "path": str(path.resolve())}, sort_keys=True)
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def model_facts(path: str | os.PathLike) -> ModelFacts:
    """A model's facts, read once per file (in a subprocess) and cached under `cache_dir()/facts`."""
    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"model file not found: {path}")
    cached = cache_dir() / "facts" / f"{_facts_key(path)}.json"
    if cached.is_file():
        try:
            return ModelFacts.from_dict(json.loads(cached.read_text()))
        except (ValueError, TypeError, KeyError):
            cached.unlink(missing_ok=True)
    facts = ModelFacts.from_dict(_run_probe(["facts", str(path)]))
    _write_json_atomic(cached, facts.to_dict())
    return facts


# --- what this llama.cpp build does: the calibration --------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """Per-build constants, measured once by `calibrate()` and cached under `cache_dir()`.

    The compute-buffer scales multiply the structural terms of `compute_buffer_bytes`; they come from
    llama.cpp's own compute buffer sizes for the reference model (SmolLM2-135M) at reference
    configurations, and are then applied to any model and configuration.
    """

    build: str
    cpu_features: tuple[str, ...] = ()          # from llama_print_system_info: "AVX2", "NEON", ...
    repack: bool = True                         # the build has the CPU repack buffer type
    base_bytes: int = 52 * MiB                  # RSS of a process that imported edgespec and llama.cpp
    process_extra_bytes: int = 4 * MiB          # what a running process adds to that once (code pages, heap)
    per_model_bytes: int = 5 * MiB              # per loaded model beyond the modelled terms
    vocab_bytes_per_entry: float = 175.0        # per vocabulary token + BPE merge
    row_copies: float = 4.0                     # logits-row copies a verification pass holds
    ffn_scale: float = 1.0
    mask_scale: float = 1.0
    attn_scale: float = 1.0
    output_scale: float = 1.0
    gpu_host_bytes: int = 350 * MiB             # CUDA/Metal runtime in host RAM (default, not measured here)
    gpu_device_bytes: int = 300 * MiB           # CUDA context and workspaces in VRAM (default)
    measured: dict = field(default_factory=dict)  # the raw calibration measurements, for the record

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        d = dict(d)
        d["cpu_features"] = tuple(d.get("cpu_features", ()))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# What a GPU backend holds besides llama.cpp's buffers, (host RAM, device memory), where it differs from
# the CUDA/Metal defaults of `Calibration`. Vulkan: the loader, the driver and llama.cpp's pipelines and
# staging buffers. A default, not a measurement: Mesa's lavapipe, the only Vulkan device edgespec has run
# on, reports no device usage (free == total), so only llama.cpp's own buffers could be checked there.
GPU_RUNTIME_BYTES: dict[str | None, tuple[int, int]] = {"vulkan": (64 * MiB, 32 * MiB)}


def build_key(build: str, system_info: str) -> str:
    """A file-name-safe key for one llama.cpp build: its version and its compiled features."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", build).strip("_")
    return f"{slug}-{hashlib.sha1(system_info.encode()).hexdigest()[:8]}"


def calibration_path(key: str) -> Path:
    return cache_dir() / f"calibration-{key}.json"


def calibrate(*, build: str | None = None, system_info: str | None = None, force: bool = False,
              reference: str | os.PathLike | None = None, announce: bool = False) -> Calibration:
    """The calibration of this build: from the cache, else measured now in fresh subprocesses.

    build/system_info name the llama.cpp build (asked of it in a subprocess when not given);
    `reference` is the model file to calibrate with (default: memprobe.CALIBRATION_MODEL, SmolLM2-135M).
    """
    if build is None or system_info is None:
        info = _run_probe(["build"], timeout=120)
        build, system_info = info["build"], info["system_info"]
    key = build_key(build, system_info)
    path = calibration_path(key)
    if path.is_file() and not force:
        try:
            return Calibration.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            path.unlink(missing_ok=True)
    args = ["calibrate"] + ([str(reference)] if reference else [])
    if announce:
        print(f"calibrating the memory model for {build} (once per build, about a minute)...", file=sys.stderr,
              flush=True)
    cal = Calibration.from_dict(_run_probe(args, timeout=900))
    _write_json_atomic(path, cal.to_dict())
    return cal


def fit_calibration(build: str, system_info: str, facts: ModelFacts, dry_runs: list[tuple[dict, dict]],
                    vocab_delta: int, runs: dict[str, dict]) -> Calibration:
    """Turn the reference measurements into a Calibration (pure; `memprobe calibrate` measures).

    dry_runs: (config, llama.cpp buffer sizes) pairs; vocab_delta: RSS a vocabulary-only load adds;
    runs: "one" and "two" (the reference model alone, and with a second copy as draft) each with
    `peak` (VmHWM), `base` (RSS before loading) and the `setup` that ran.
    """
    from edgespec.machine.hardware import parse_llama_system_info

    cpu = parse_llama_system_info(system_info).get("CPU", {})
    features = tuple(sorted(k for k, v in cpu.items() if v == "1"))
    cal = Calibration(build=build, cpu_features=features, repack="REPACK" in features)

    def ratios(select, term) -> float:
        vals = [observed / term(cfg) for cfg, observed in
                ((cfg, buf["CPU compute"]) for cfg, buf in dry_runs if select(cfg)) if term(cfg) > 0]
        return sum(vals) / len(vals) if vals else 1.0

    # Terms are fitted where each one dominates the buffer (see compute_buffer_bytes).
    E, F, V = facts.n_embd, facts.n_ff, facts.n_vocab
    fa = lambda c: c.get("flash_attn") is not False  # noqa: E731 - auto means on for CPU builds
    ffn_scale = ratios(lambda c: fa(c) and c["n_outputs_max"] <= 8 and c["type_k"] == "f16",
                       lambda c: 4 * c["n_batch"] * (3 * F + 4 * E) + 2 * c["n_batch"] * padded_ctx(c["n_ctx"]))
    out_scale = ratios(lambda c: fa(c) and c["n_outputs_max"] >= 32,
                       lambda c: 4 * (c["n_outputs_max"] * (V + E) + c["n_batch"] * E))
    attn_scale = ratios(lambda c: not fa(c) and padded_ctx(c["n_ctx"]) >= 4096,
                        lambda c: _attention_scores(facts, c["n_batch"], padded_ctx(c["n_ctx"])))
    cal = replace(cal, ffn_scale=round(ffn_scale, 4), mask_scale=round(ffn_scale, 4),
                  output_scale=round(out_scale, 4), attn_scale=round(attn_scale, 4),
                  vocab_bytes_per_entry=round(vocab_delta / max(1, facts.n_vocab + facts.n_merges), 2))

    # Residuals of the real runs: what the modelled terms miss, per process and per model.
    residual = {}
    for name, run in runs.items():
        setup = Setup.from_dict(run["setup"], {"target": facts, "draft": facts})
        pred = predict(setup, replace(cal, process_extra_bytes=0, per_model_bytes=0), base_bytes=run["base"])
        residual[name] = run["peak"] - pred.peak_bytes
    per_model = max(0, residual["two"] - residual["one"])
    per_process = max(0, residual["one"] - per_model)
    return replace(cal, base_bytes=int(runs["one"]["base"]), process_extra_bytes=int(per_process),
                   per_model_bytes=int(per_model),
                   measured={"dry_runs": [[c, b] for c, b in dry_runs], "vocab_delta": vocab_delta,
                             "runs": runs, "residual": residual, "reference": facts.path})


# --- the prediction ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSettings:
    """How one model is loaded: what the planner chooses and the runtime receives."""

    n_ctx: int = 4096
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None   # None: flash_attention (runtimes/base.py) decides; `flash` says what
    n_batch: int = 512
    n_outputs_max: int = 1           # logits rows one decode may return (k + 1 for a target)
    n_gpu_layers: int = 0            # -1 = all
    offload_kqv: bool = True
    use_mmap: bool = True
    extra_buffers: bool = True

    @property
    def kv_quantized(self) -> bool:
        return self.type_k not in FLOAT_KV or self.type_v not in FLOAT_KV

    @property
    def flash(self) -> bool | None:
        """The flash attention this load gets (see flash_attention)."""
        return flash_attention(self.flash_attn, self.type_v)

    def runtime_options(self) -> dict:
        """Keyword arguments for `LlamaCppOptions`."""
        return {"n_ctx": self.n_ctx, "n_batch": self.n_batch, "n_outputs_max": self.n_outputs_max,
                "n_gpu_layers": self.n_gpu_layers, "flash_attn": self.flash_attn, "type_k": self.type_k,
                "type_v": self.type_v, "offload_kqv": self.offload_kqv, "use_mmap": self.use_mmap,
                "extra_buffers": self.extra_buffers}


@dataclass(frozen=True)
class Hardware:
    """Where memory lives: `cpu` (RAM only), `discrete` (RAM + VRAM) or `unified` (one pool)."""

    kind: MemoryKind = "cpu"
    ram_bytes: int | None = None
    gpu_bytes: int | None = None
    zero_copy_weights: bool = False  # Metal maps mmap'd weights instead of copying them
    name: str = "cpu"
    backend: str | None = None  # the GPU's llama.cpp backend where known: "vulkan" (its overheads differ from CUDA's)

    @classmethod
    def detect(cls, use_gpu: bool | None = None) -> "Hardware":
        from edgespec.machine import hardware as hw

        report = hw.detect(onnxruntime=False)
        kind = hw.memory_kind(report, use_gpu)
        ram = report.memory.usable_bytes
        if kind == "discrete":
            key = hw.device_key(report, use_gpu)
            return cls("discrete", ram, hw.device_memory_bytes(report, use_gpu), False, key,
                       backend=key.split("-", 1)[0] if key.startswith("vulkan-") else None)
        if kind == "unified":
            return cls("unified", hw.device_memory_bytes(report, use_gpu), None, report.apple is not None,
                       hw.device_key(report, use_gpu))
        return cls("cpu", ram, None, False, hw.device_key(report, use_gpu))


@dataclass(frozen=True)
class Setup:
    """A target, optionally a draft, their settings, and the verification width."""

    target: ModelFacts
    target_settings: ModelSettings
    draft: ModelFacts | None = None
    draft_settings: ModelSettings | None = None
    max_draft: int = 0               # k: drafted tokens per round (tree: nodes); rows = k + 1
    sampling: bool = True            # sampling keeps distributions per drafted row too
    hardware: Hardware = Hardware()
    parallel: int = 1                # slots verified in one pass (serve --parallel): rows of each

    def to_dict(self) -> dict:
        return {"target_settings": asdict(self.target_settings),
                "draft_settings": asdict(self.draft_settings) if self.draft_settings else None,
                "has_draft": self.draft is not None, "max_draft": self.max_draft, "sampling": self.sampling,
                "hardware": asdict(self.hardware), "parallel": self.parallel}

    @classmethod
    def from_dict(cls, d: dict, facts: dict[str, ModelFacts]) -> "Setup":
        return cls(target=facts["target"], target_settings=ModelSettings(**d["target_settings"]),
                   draft=facts.get("draft") if d.get("has_draft") else None,
                   draft_settings=ModelSettings(**d["draft_settings"]) if d.get("draft_settings") else None,
                   max_draft=d.get("max_draft", 0), sampling=d.get("sampling", True),
                   hardware=Hardware(**d.get("hardware", {})), parallel=d.get("parallel", 1))


@dataclass
class Prediction:
    """Predicted peak memory, per pool, with the terms that make it up (bytes)."""

    host: dict[str, int]
    device: dict[str, int]
    host_peak_bytes: int             # max over load and run phases
    device_peak_bytes: int
    kind: MemoryKind
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """The number a budget is checked against: host RAM (cpu, discrete) or the one pool (unified)."""
        return self.host_peak_bytes + (self.device_peak_bytes if self.kind == "unified" else 0)

    def breakdown(self) -> dict:
        out: dict[str, Any] = {"host": dict(self.host), "phases": dict(self.phases)}
        if self.device:
            out["device"] = dict(self.device)
        return out


def repacked(tensor: TensorInfo, cal: Calibration) -> bool:
    """Whether llama.cpp's CPU backend keeps this tensor in its repacked layout (mirrors
    ggml_repack_get_optimal_repack_type): 2-D matmul weights of Q4_0 / Q4_K / IQ4_NL with AVX2 or NEON
    dot products, Q2_K with AVX-512; token embeddings are read by row, never repacked."""
    if not cal.repack or tensor.ne1 <= 1 or tensor.name.startswith("token_embd"):
        return False
    f = set(cal.cpu_features)
    avx2, avx512 = "AVX2" in f, "AVX512" in f
    neon = "NEON" in f
    i8mm, dot = "MATMUL_INT8" in f, "DOTPROD" in f
    t, rows = tensor.type, tensor.ne1
    if t == "Q4_0":
        return (avx2 and rows % 8 == 0) or (neon and (i8mm or dot) and rows % 4 == 0)
    if t == "Q4_K":
        return (avx2 or (neon and (i8mm or dot))) and rows % 8 == 0
    if t == "Q2_K":
        return avx512 and rows % 8 == 0
    if t == "IQ4_NL":
        return (avx2 and rows % 8 == 0) or (neon and dot and rows % 4 == 0)
    return False


def _attention_scores(facts: ModelFacts, n_batch: int, n_ctx: int) -> int:
    """Without flash attention: the f32 score matrix of every head plus the f32 mask, and the
    embedding-wide rows around them."""
    return 4 * n_batch * n_ctx * (facts.n_head + 1) + int(4 * n_batch * 5.5 * facts.n_embd)


def compute_buffer_bytes(facts: ModelFacts, s: ModelSettings, cal: Calibration) -> int:
    """The compute buffer llama.cpp reserves for one ubatch (see the module docstring)."""
    T = s.n_batch
    O = min(s.n_outputs_max or T, T)
    E, F, V = facts.n_embd, facts.n_ff, facts.n_vocab
    n_kv = padded_ctx(s.n_ctx)
    flash = s.flash is not False
    if flash:
        ffn = 4 * T * (3 * F + (3 if s.kv_quantized else 4) * E)
        layer = cal.ffn_scale * ffn + cal.mask_scale * 2 * T * n_kv
    else:
        layer = max(cal.ffn_scale * (4 * T * (3 * F + 3 * E) + 4 * T * n_kv),
                    cal.attn_scale * _attention_scores(facts, T, n_kv))
    head = cal.output_scale * 4 * (O * (V + E) + T * E)
    return int(max(layer, head))


def _model_terms(facts: ModelFacts, s: ModelSettings, cal: Calibration, hw: Hardware,
                 prefix: str) -> tuple[dict[str, int], dict[str, int], int]:
    """(host terms, device terms, load-time host transient beyond the steady host terms)."""
    host: dict[str, int] = {}
    dev: dict[str, int] = {}
    gpu = hw.kind != "cpu" and s.n_gpu_layers != 0
    ngl = s.n_gpu_layers if gpu else 0
    on_gpu = [t for t in facts.tensors if facts.placement(t, ngl) == "gpu"]
    on_cpu = [t for t in facts.tensors if facts.placement(t, ngl) == "cpu"]
    zero_copy = hw.kind == "unified" and hw.zero_copy_weights and s.use_mmap
    packed = [t for t in on_cpu if s.extra_buffers and repacked(t, cal)]
    packed_names = {t.name for t in packed}
    mapped = [t for t in on_cpu if t.name not in packed_names] + (on_gpu if zero_copy else [])

    transient = 0
    if s.use_mmap:
        span = (max(t.offset + t.nbytes for t in mapped) - min(t.offset for t in mapped)) if mapped else 0
        host[f"{prefix}.weights_mapped"] = _page_up(span)
        # llama.cpp populates the whole tensor span at load, then unmaps what no CPU tensor uses.
        full = max(t.offset + t.nbytes for t in facts.tensors) - min(t.offset for t in facts.tensors)
        transient = max(0, _page_up(full) - host[f"{prefix}.weights_mapped"])
    else:
        host[f"{prefix}.weights_read"] = sum(t.nbytes for t in on_cpu if t.name not in packed_names)
        if packed:  # the repack stages each tensor in a heap buffer the allocator keeps
            host[f"{prefix}.repack_staging"] = max(t.nbytes for t in packed)
    if packed:
        host[f"{prefix}.weights_repacked"] = sum(t.nbytes for t in packed)
    if on_gpu and not zero_copy:
        dev[f"{prefix}.weights"] = sum(t.nbytes for t in on_gpu)
        if not any(t.name.startswith("output.weight") for t in facts.tensors):
            # tied embeddings: llama.cpp loads token_embd a second time as the output matrix, on the output
            # layer's device (the CPU copy stays for the embedding lookup)
            dev[f"{prefix}.weights"] += sum(t.nbytes for t in facts.tensors if t.name.startswith("token_embd"))

    gpu_layers = sum(1 for il in range(facts.n_layer) if facts.placement(
        TensorInfo(f"blk.{il}.x", "F32", 1, 1, 0, 0), ngl) == "gpu")
    kv_dev_layers = gpu_layers if s.offload_kqv else 0
    kv_host = facts.kv_bytes(s.n_ctx, s.type_k, s.type_v, facts.n_layer - kv_dev_layers)
    if kv_host:
        host[f"{prefix}.kv"] = kv_host
    if kv_dev_layers:
        dev[f"{prefix}.kv"] = facts.kv_bytes(s.n_ctx, s.type_k, s.type_v, kv_dev_layers)

    compute = compute_buffer_bytes(facts, s, cal)
    all_on_gpu = bool(on_gpu) and facts.gpu_layer_count(ngl) == facts.n_layer + 1
    if not on_gpu:
        host[f"{prefix}.compute"] = compute
    elif all_on_gpu:
        # The embedding-wide input rows of the graph stay in the host's compute buffer (the token lookup
        # runs on the CPU): 3 rows per token without flash attention, 2 with (measured with llama.cpp's
        # Vulkan backend, bench/VULKAN_RESULTS.md; not yet checked on CUDA or Metal).
        dev[f"{prefix}.compute"] = compute - 4 * s.n_batch * facts.n_embd * (2 if s.flash is not False else 3)
        host[f"{prefix}.compute"] = 4 * s.n_batch * facts.n_embd * 2  # token embeddings, read on the CPU
    else:
        dev[f"{prefix}.compute"] = compute
        host[f"{prefix}.compute"] = compute
    host[f"{prefix}.output"] = max(1, s.n_outputs_max) * facts.n_vocab * 4
    host[f"{prefix}.vocab"] = int(cal.vocab_bytes_per_entry * (facts.n_vocab + facts.n_merges))
    host[f"{prefix}.overhead"] = cal.per_model_bytes
    return host, dev, transient


SNAPSHOT_ARCHS = frozenset({"lfm2", "lfm2moe", "qwen35", "qwen35moe", "nemotron_h", "nemotron_h_moe"})


def recurrent_bytes(facts: ModelFacts, n_seq: int = 1) -> int:
    """A recurrent or hybrid model's state beyond its KV: one state per sequence, llama.cpp's per-token
    snapshots of it where the architecture keeps them, and the runtime's rollback checkpoints
    (runtimes/llamacpp.py: SNAPSHOT_WINDOW, CHECKPOINT_DEPTH)."""
    from edgespec.runtimes.llamacpp import CHECKPOINT_DEPTH, SNAPSHOT_WINDOW

    copies = 1 + (SNAPSHOT_WINDOW if facts.arch in SNAPSHOT_ARCHS else 0) + CHECKPOINT_DEPTH
    return facts.recurrent_state_bytes * copies * n_seq


def predict(setup: Setup, cal: Calibration, *, base_bytes: int | None = None) -> Prediction:
    """Peak memory of a setup. `base_bytes`: the process's RSS before loading, when known (the running
    process knows it exactly); otherwise the calibrated fixed overhead stands in for it."""
    hw = setup.hardware
    base = cal.base_bytes if base_bytes is None else base_bytes
    host: dict[str, int] = {"fixed": int(base + cal.process_extra_bytes)}
    dev: dict[str, int] = {}
    uses_gpu = hw.kind != "cpu" and (setup.target_settings.n_gpu_layers != 0 or (
        setup.draft_settings is not None and setup.draft is not None and setup.draft_settings.n_gpu_layers != 0))
    if uses_gpu:
        host["gpu_runtime"], dev["gpu_runtime"] = GPU_RUNTIME_BYTES.get(
            hw.backend, (cal.gpu_host_bytes, cal.gpu_device_bytes))

    t_host, t_dev, t_transient = _model_terms(setup.target, setup.target_settings, cal, hw, "target")
    phases = {"load_target": sum(host.values()) + _steady_load(t_host) + t_transient}
    host.update(t_host)
    dev.update(t_dev)
    if setup.draft is not None and setup.draft_settings is not None:
        d_host, d_dev, d_transient = _model_terms(setup.draft, setup.draft_settings, cal, hw, "draft")
        phases["load_draft"] = (sum(host.values()) - host.get("target.compute", 0) + _steady_load(d_host)
                                + d_transient)
        host.update(d_host)
        dev.update(d_dev)
    for prefix, facts, slots in (("target", setup.target, setup.parallel), ("draft", setup.draft, setup.parallel)):
        if facts is not None and facts.recurrent_state_bytes and (prefix == "target" or setup.draft_settings):
            host[f"{prefix}.recurrent"] = recurrent_bytes(facts, slots)
    rows = setup.max_draft + 1
    verify = cal.row_copies * rows * setup.target.n_vocab * 4
    if setup.sampling and setup.max_draft:
        verify += 8 * (2 * setup.max_draft + 1) * setup.target.n_vocab  # float64 distributions per row
    verify *= setup.parallel  # every slot's rows and distributions are held through the same step
    host["verification"] = int(verify)
    phases["run"] = sum(host.values())
    host_peak = max(phases.values())
    return Prediction(host=host, device=dev, host_peak_bytes=host_peak, device_peak_bytes=sum(dev.values()),
                      kind=hw.kind, phases=phases)


def _steady_load(terms: dict[str, int]) -> int:
    """What a model holds right after loading: everything but the compute buffer, which fills at the
    first decode."""
    return sum(v for k, v in terms.items() if not k.endswith(".compute"))


# --- measuring what a process really holds -----------------------------------------------------

def read_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak resident set), RssAnon, RssFile of a process, in bytes (Linux /proc)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def current_rss() -> int:
    status = read_status()
    if "VmRSS" in status:
        return status["VmRSS"]
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    """The process's peak resident set so far (VmHWM; ru_maxrss where /proc is absent)."""
    status = read_status()
    if "VmHWM" in status:
        return status["VmHWM"]
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux kilobytes
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def format_bytes(n: int | float) -> str:
    """Binary units, as budgets are given: 1536 MiB -> "1.50 GiB"."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}" if unit == "GiB" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """"2G", "2GiB", "1.5 GB", "800M", "800MiB", "123456" -> bytes. K/M/G/T are binary (1024-based)
    with or without "i", as memory is sold and as `free -h` prints it."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise EdgespecError(f"cannot read the size {text!r}; write it like 800M, 2G or 1.5GiB")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])
