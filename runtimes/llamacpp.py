"""llama.cpp runtime over llama-cpp-python's low-level API.

Every ctypes call into llama-cpp-python lives in this module: its names change between releases,
so one file is all that has to follow them.

Memory: the model's weights (mmap'd by default), a KV cache of n_ctx cells of the chosen types,
one reusable batch of n_batch tokens, and logits only for the rows asked for — never the
n_ctx x n_vocab buffer that `logits_all=True` allocates.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp as ll

from edgespec.errors import ContextOverflowError, EdgespecError, ModelFileError
from edgespec.runtimes.base import (GrammarVocabulary, MemoryReport, ModelIdentity, NextTokenHeads, NotOffered, SavedState,
                                    SelectedRows, SeveralSequences, Sizing,
                                     TokenSequence, TreeDecoding, VocabInfo, FLOAT_KV, flash_attention, padded_ctx)
from edgespec.runtimes.identity import file_identity


def _read_logits(ctx, i: int, into: np.ndarray) -> None:
    """Output row i of the last llama_decode into `into` (a contiguous float32 row of n_vocab): one
    memmove from llama.cpp's buffer, which the next decode overwrites."""
    row = ll.llama_get_logits_ith(ctx, i)
    if not row:  # llama.cpp has no output for that token: never copy from NULL
        raise EdgespecError(f"llama.cpp returned no logits for batch row {i}")
    ctypes.memmove(into.ctypes.data, row, into.nbytes)


# KV cache element types by name, with bytes per element (block types averaged over their block).
KV_TYPES: dict[str, tuple[int, float]] = {
    "f32": (ll.GGML_TYPE_F32, 4.0),
    "f16": (ll.GGML_TYPE_F16, 2.0),
    "q8_0": (ll.GGML_TYPE_Q8_0, 34 / 32),
    "q5_1": (ll.GGML_TYPE_Q5_1, 24 / 32),
    "q5_0": (ll.GGML_TYPE_Q5_0, 22 / 32),
    "q4_1": (ll.GGML_TYPE_Q4_1, 20 / 32),
    "q4_0": (ll.GGML_TYPE_Q4_0, 18 / 32),
}

# Model file types `quantize` can write, by the names llama.cpp's tools use.
QUANT_TYPES: dict[str, int] = {
    "f32": ll.LLAMA_FTYPE_ALL_F32,
    "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": ll.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q6_k": ll.LLAMA_FTYPE_MOSTLY_Q6_K,
    "q5_k_m": ll.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q5_k_s": ll.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "q5_0": ll.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": ll.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q4_k_s": ll.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": ll.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q3_k_m": ll.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K,
}

_VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv"}


# --- logging: llama.cpp prints to stderr unless told otherwise -------------------------------

class _Log:
    """Routes llama.cpp's log: printed when verbose, else kept (last lines) for error messages."""

    verbose = False
    recent: deque[str] = deque(maxlen=20)
    buffers: list[str] = []  # "... buffer size = X MiB" lines since the last clear (memory accounting)


@ll.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace")
    if "buffer size" in message:
        _Log.buffers.append(message)
    if _Log.verbose:
        print(message, end="", flush=True, file=__import__("sys").stderr)
    elif level in (2, 3) and message.strip():  # warnings and errors explain load failures
        _Log.recent.append(message.strip())


ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
_backend_ready = False


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    _Log.verbose = verbose
    if not _backend_ready:
        ll.llama_backend_init()
        _backend_ready = True


def backend_info() -> dict:
    """What this llama.cpp build can do: GPU offload, the CPU features it was built for, its version."""
    _init_backend(_Log.verbose)
    return {
        "gpu_offload": bool(ll.llama_supports_gpu_offload()),
        "mmap": bool(ll.llama_supports_mmap()),
        "max_devices": int(ll.llama_max_devices()),
        "system_info": ll.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        "build": f"llama-cpp-python {ll.__version__}",
    }


# --- ggml's backend devices (CPU, Vulkan, CUDA, Metal, ...) ----------------------------------------

_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
_ggml = None


def _ggml_lib():
    """libggml as llama-cpp-python loaded it, with the prototypes of the device functions used here
    (llama-cpp-python binds none of them; dlsym on libggml also finds libggml-base's)."""
    global _ggml
    if _ggml is None:
        from llama_cpp._ggml import libggml as lib

        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args, res in (("ggml_backend_dev_count", [], sz), ("ggml_backend_dev_get", [sz], vp),
                                ("ggml_backend_dev_name", [vp], ctypes.c_char_p),
                                ("ggml_backend_dev_description", [vp], ctypes.c_char_p),
                                ("ggml_backend_dev_type", [vp], ctypes.c_int),
                                ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
                                ("ggml_backend_dev_backend_reg", [vp], vp),
                                ("ggml_backend_reg_name", [vp], ctypes.c_char_p),
                                ("ggml_backend_dev_by_name", [ctypes.c_char_p], vp)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _ggml = lib
    return _ggml


def backend_devices() -> list[dict]:
    """The devices this llama.cpp build computes on, in ggml's order: {"index", "name" ("Vulkan0",
    "CUDA0", "CPU"), "description", "type" (cpu, gpu, igpu, accel), "backend" ("Vulkan", "CUDA", ...),
    "memory_free_bytes", "memory_total_bytes"} — memory as the backend itself reports it
    (ggml_backend_dev_memory: the driver's budget where it has one, else the device heap)."""
    _init_backend(_Log.verbose)
    lib = _ggml_lib()
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append({"index": i, "name": (lib.ggml_backend_dev_name(dev) or b"").decode(),
                    "description": (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                    "type": _DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(dev)), "unknown"),
                    "backend": (lib.ggml_backend_reg_name(reg) or b"").decode() if reg else "",
                    "memory_free_bytes": int(free.value), "memory_total_bytes": int(total.value)})
    return out


def _device_handle(name: str) -> int:
    _init_backend(_Log.verbose)
    handle = _ggml_lib().ggml_backend_dev_by_name(name.encode())
    if not handle:
        known = ", ".join(d["name"] for d in backend_devices())
        raise EdgespecError(f"llama.cpp has no device named {name!r} (this build has: {known})")
    return handle


def offload_devices() -> list[dict]:
    """The devices llama.cpp offloads layers to (GPUs, integrated GPUs), not the CPU or its accelerators."""
    return [d for d in backend_devices() if d["type"] in ("gpu", "igpu")]


# --- the runtime -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaCppOptions:
    """How to load a model and size its context. Defaults suit a CPU-only laptop."""

    n_ctx: int = 4096          # 0 = the model's training context
    n_batch: int = 512         # tokens per llama_decode call; longer inputs are split
    n_outputs_max: int = 0     # most logits rows one decode returns (0 = n_batch); the compute buffer holds this many
    n_seq_max: int = 1         # > 1: room for token-tree branches (one sequence each, one unified KV pool)
    n_threads: int | None = None        # None = physical cores
    n_threads_batch: int | None = None  # None = same as n_threads
    n_gpu_layers: int = 0      # -1 = all layers
    devices: tuple[str, ...] | None = None  # offload devices by name ("Vulkan0"); () = none, CPU only; None = all
    flash_attn: bool | None = None      # None = flash_attention (runtimes/base.py) decides
    type_k: str = "f16"
    type_v: str = "f16"
    offload_kqv: bool = True   # keep the KV cache on the GPU when layers are offloaded
    use_mmap: bool = True
    extra_buffers: bool = True  # llama.cpp's repacked CPU weight layouts (faster matmuls); see README on AMX
    load_mtp: bool = False     # also load the model's NextN (MTP) layers (LlamaCppMtpRuntime sets it)
    kv_unified: bool = True    # False: each sequence its own KV stream of n_ctx / n_seq_max cells
    verbose: bool = False

    def __post_init__(self) -> None:
        for kind, name in (("type_k", self.type_k), ("type_v", self.type_v)):
            if name not in KV_TYPES:
                raise EdgespecError(f"unknown KV cache type {kind}={name!r}; use one of {', '.join(KV_TYPES)}")
        if self.type_v not in FLOAT_KV and self.flash_attn is False:
            raise EdgespecError(f"a quantized V cache (type_v={self.type_v}) needs flash attention; "
                                "drop --no-flash-attn or use type_v=f16")
        if self.n_ctx < 0 or self.n_batch < 1:
            raise EdgespecError("n_ctx must be >= 0 and n_batch >= 1")
        if self.n_outputs_max < 0:
            raise EdgespecError("n_outputs_max must be >= 0 (0 = n_batch)")
        if not 1 <= self.n_seq_max <= 256:
            raise EdgespecError(f"n_seq_max must be between 1 and 256, got {self.n_seq_max}")


def _physical_cores() -> int:
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:  # psutil is a dependency; this only guards odd platforms
        return max(1, os.cpu_count() or 1)


def check_gguf_file(path: Path) -> None:
    """Say clearly what is wrong with a model file before llama.cpp sees it."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}; give a path to a .gguf file or a catalog name "
                             "(see `edgespec models list`)")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; give the path of a .gguf file inside it")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with the GGUF magic); "
                             "convert it with `edgespec export` or download a .gguf")


_BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute|output|RS) buffer size =\s+([\d.]+) MiB")


def parse_buffer_sizes(lines: Sequence[str]) -> dict[str, int]:
    """llama.cpp's "CPU_REPACK model buffer size = 596.53 MiB" lines -> {"CPU_REPACK model": bytes, ...}."""
    out: dict[str, int] = {}
    for line in lines:
        for device, kind, mib in _BUFFER_LINE.findall(line):
            key = f"{device} {kind}"
            out[key] = out.get(key, 0) + int(float(mib) * 2**20)
    return out


def _flash_attn_type(flash: bool | None) -> int:
    """llama.cpp's setting for a resolved `flash_attention` (None: its own choice)."""
    return (ll.LLAMA_FLASH_ATTN_TYPE_AUTO if flash is None else
            ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def dry_run_compute_buffers(path: str | os.PathLike, configs: Sequence[dict]) -> list[dict[str, int]]:
    """Compute buffers llama.cpp reserves for each context configuration, without loading weights.

    The model is opened with `no_alloc` (tensor metadata only), so this costs the vocabulary load and
    nothing else. Each config names n_ctx, n_batch, n_outputs_max, type_k, type_v and flash_attn
    (True/False/None). Returns, per config, the parsed buffer sizes plus the n_ctx llama.cpp chose.
    """
    check_gguf_file(Path(path))
    _init_backend(_Log.verbose)
    mparams = ll.llama_model_default_params()
    mparams.no_alloc = True
    mparams.load_mode = ll.LLAMA_LOAD_MODE_NONE  # no_alloc is refused together with mmap
    mparams.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelFileError(f"llama.cpp could not read the metadata of {path}")
    results = []
    try:
        for config in configs:
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = config["n_ctx"]
            cparams.n_batch = cparams.n_ubatch = config.get("n_batch", 512)
            cparams.n_outputs_max = min(config.get("n_outputs_max", 0), cparams.n_batch)
            cparams.n_seq_max = 1
            cparams.type_k = KV_TYPES[config.get("type_k", "f16")][0]
            cparams.type_v = KV_TYPES[config.get("type_v", "f16")][0]
            cparams.flash_attn_type = _flash_attn_type(flash_attention(config.get("flash_attn"), config.get("type_v", "f16")))
            cparams.n_threads = cparams.n_threads_batch = 1
            _Log.buffers.clear()
            ctx = ll.llama_init_from_model(model, cparams)
            if not ctx:
                raise EdgespecError(f"llama.cpp refused the context configuration {config}")
            found = parse_buffer_sizes(_Log.buffers)
            found["n_ctx"] = int(ll.llama_n_ctx(ctx))
            ll.llama_free(ctx)
            results.append(found)
    finally:
        ll.llama_model_free(model)
    return results


def _vocab_info(v, n_vocab: int) -> VocabInfo:
    bos, eos = int(ll.llama_vocab_bos(v)), int(ll.llama_vocab_eos(v))
    eog = frozenset(t for t in range(n_vocab) if ll.llama_vocab_is_eog(v, t))
    return VocabInfo(
        n_vocab=n_vocab,
        vocab_type=_VOCAB_TYPES.get(int(ll.llama_vocab_type(v)), "unknown"),
        bos=bos if bos >= 0 else None,
        eos=eos if eos >= 0 else None,
        add_bos=bool(ll.llama_vocab_get_add_bos(v)),
        eog=eog,
    )


class VocabOnly:
    """A model opened for its vocabulary alone (what the tokenizer costs in memory, no weights): enough
    for `edgespec.vocab.vocab_difference` (`vocab`, `token_text`); `close()` frees it."""

    def __init__(self, path: str | os.PathLike):
        check_gguf_file(Path(path))
        _init_backend(_Log.verbose)
        mparams = ll.llama_model_default_params()
        mparams.vocab_only = True
        self._model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not read the vocabulary of {path}")
        self._vocab_ptr = ll.llama_model_get_vocab(self._model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab_ptr))
        self.vocab = _vocab_info(self._vocab_ptr, self.n_vocab)

    def token_text(self, token: int) -> str:
        return (ll.llama_vocab_get_text(self._vocab_ptr, token) or b"").decode("utf-8", errors="replace")

    def __enter__(self) -> "VocabOnly":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


def _sizing(n_batch: int, n_threads: int, options: LlamaCppOptions) -> Sizing:
    return Sizing(n_batch=n_batch, n_threads=n_threads, n_outputs_max=options.n_outputs_max, n_seq_max=options.n_seq_max,
                  n_gpu_layers=options.n_gpu_layers)


# --- recurrent and hybrid models: rollback through checkpoints of the recurrent state -----------------

CHECKPOINT_DEPTH = 9  # checkpoints kept per sequence: a draft model's k one-token steps (k <= 8) and one more
# Per-token snapshots of the recurrent state that llama.cpp keeps inside each pass (n_rs_seq, for the
# architectures it supports: LFM2, Qwen3.5, Nemotron-H, ...): a rollback of up to this many tokens of
# the last pass is then a plain llama_memory_seq_rm, with no restore and no replay. It costs
# (1 + window) copies of the recurrent state in memory. auto drafts at most 16.
SNAPSHOT_WINDOW = 16


class RecurrentCheckpoints:
    """Rollback for models with recurrent layers (Mamba-2, Gated DeltaNet, LFM2's short convolutions).

    An attention KV cache can be cut at any position (`llama_memory_seq_rm`); a recurrent layer holds
    one state per sequence, the sum of everything it has read, which llama.cpp cannot cut. So before
    every pass the runtime saves the recurrent part of the sequence's state at the position the pass
    starts from (`llama_state_seq_get_data_ext` with PARTIAL_ONLY: the recurrent state alone, not the
    KV); a rollback to n restores the latest checkpoint at or before n, cuts the KV cells after it and
    replays the kept tokens past it. A verify pass that rejects drafts thus costs one restore and one
    replay pass of the accepted tokens (measured in edgespec.machine.profile). The last
    CHECKPOINT_DEPTH checkpoints of each sequence are kept in reused buffers, so a draft model
    stepping one token at a time rolls back without a replay.

    Where llama.cpp keeps per-token snapshots inside a pass (SNAPSHOT_WINDOW), a rollback within the
    last pass needs none of this: it is cut like attention KV. Measured on the tiny LFM2 (2 cores):
    checkpoint 4 us, restore 13 us, a one-token replay pass 2.9 ms against a 3.6 ms verify pass; the
    replay is the cost, so the snapshots (no replay) are used wherever the architecture has them.
    The snapshots hold only the last pass: a rollback across passes (a draft model's one-token
    steps) goes through the checkpoints.
    """

    FLAGS = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

    def __init__(self, ctx, depth: int = CHECKPOINT_DEPTH):
        self._ctx = ctx
        self.depth = depth
        self._rings: dict[int, list[list]] = {}   # seq -> [[position, buffer, bytes used]], oldest first
        self._spare: list = []                    # buffers of dropped checkpoints, reused
        self.n_saved = self.n_restored = 0        # for tests and the profile

    def save(self, seq: int, position: int) -> None:
        """Checkpoint the recurrent state of `seq`, which has read exactly its first `position` tokens."""
        ring = self._rings.setdefault(seq, [])
        if ring and ring[-1][0] == position:
            return  # the same prefix: the state saved there is still this one
        size = int(ll.llama_state_seq_get_size_ext(self._ctx, seq, self.FLAGS))
        if len(ring) >= self.depth:
            entry = ring.pop(0)
        else:
            entry = [0, self._spare.pop() if self._spare else None, 0]
        if entry[1] is None or len(entry[1]) < size:
            entry[1] = (ctypes.c_uint8 * size)()
        entry[0] = position
        entry[2] = int(ll.llama_state_seq_get_data_ext(self._ctx, entry[1], size, seq, self.FLAGS))
        ring.append(entry)
        self.n_saved += 1

    def restore(self, seq: int, n: int) -> int:
        """Put back the latest checkpoint of `seq` at or before position n; drop the later ones. Returns
        its position, or 0 when none is held (the caller then starts the sequence over)."""
        ring = self._rings.get(seq, [])
        while ring and ring[-1][0] > n:
            self._spare.append(ring.pop()[1])
        if not ring:
            return 0
        position, buf, used = ring[-1]
        if ll.llama_state_seq_set_data_ext(self._ctx, buf, used, seq, self.FLAGS) == 0:
            raise EdgespecError("llama.cpp refused a checkpoint of the recurrent state it saved itself")
        self.n_restored += 1
        return position

    def drop_after(self, seq: int, n: int) -> None:
        """Drop the checkpoints of `seq` past position n (the sequence was cut to n another way)."""
        ring = self._rings.get(seq, [])
        while ring and ring[-1][0] > n:
            self._spare.append(ring.pop()[1])

    def forget(self, seq: int) -> None:
        """The sequence was replaced (a saved state loaded, a sequence cleared): its checkpoints no longer apply."""
        self._spare.extend(entry[1] for entry in self._rings.pop(seq, []))

    @property
    def nbytes(self) -> int:
        """Bytes the checkpoint buffers hold, spare ones included."""
        return sum(len(e[1]) for ring in self._rings.values() for e in ring) + sum(len(b) for b in self._spare)


def is_recurrent_model(model) -> bool:
    """Whether a loaded model has recurrent layers (wholly recurrent, or a hybrid with attention)."""
    return bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))


class LlamaCppRuntime(TokenSequence):
    """A GGUF model and one KV sequence in llama.cpp. Implements `edgespec.runtimes.base.Runtime`."""

    name = "llama.cpp"
    capabilities = frozenset({TreeDecoding, ModelIdentity, SavedState, GrammarVocabulary, SelectedRows})

    def __init__(self, path: str | os.PathLike, options: LlamaCppOptions = LlamaCppOptions(), *,
                 identity: dict | None = None):
        self.path = Path(path)
        self.options = options
        self._model = None
        self._ctx = None
        self._batch = None
        self.buffers: dict[str, int] = {}  # what llama.cpp allocated, by buffer (_open_context fills it)
        check_gguf_file(self.path)
        self.identity = identity or file_identity(self.path)  # names the model in compatibility_key
        _init_backend(options.verbose)
        _Log.recent.clear()
        _Log.buffers.clear()

        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = options.n_gpu_layers if options.n_gpu_layers >= 0 else 0x7FFFFFFF
        mparams.load_mode = ll.LLAMA_LOAD_MODE_MMAP if options.use_mmap else ll.LLAMA_LOAD_MODE_NONE
        mparams.use_extra_bufts = options.extra_buffers
        mparams.load_mtp = options.load_mtp
        if options.devices is not None:
            # NULL-terminated; empty keeps every op on the CPU (n_gpu_layers=0 alone still lets llama.cpp
            # run large-batch matmuls on a GPU and reserve a compute buffer there)
            handles = [_device_handle(name) for name in options.devices]
            self._device_list = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)  # kept alive with the model
            mparams.devices = ctypes.cast(self._device_list, ctypes.c_void_p)
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            detail = f" (llama.cpp: {_Log.recent[-1]})" if _Log.recent else ""
            raise ModelFileError(f"llama.cpp could not load {self.path}: the file is truncated, corrupt or of an "
                                 f"unsupported architecture{detail}; download it again or re-export it")
        self._vocab_ptr = ll.llama_model_get_vocab(self._model)
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))

        self.n_threads = options.n_threads or _physical_cores()
        try:
            self._open_context(options.n_ctx or self.n_ctx_train)
        except EdgespecError:
            self.close()
            raise
        self.n_ctx = self.pool_cells  # what the sequence may grow to; the pool may shrink below it later
        self.n_batch = int(ll.llama_n_batch(self._ctx))
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab_ptr))
        self.vocab = self._read_vocab()
        self._grammar_tokenizer = None

        # One batch reused for every decode; plain decodes use sequence 0 only.
        self._batch = ll.llama_batch_init(self.n_batch, 0, options.n_seq_max)
        self._batch_token = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._batch_pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._batch_logits = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))[:] = 1
        for i in range(self.n_batch):
            self._batch.seq_id[i][0] = 0

        self._start_sequence(self.n_ctx)
        self._max_logit_rows = 0
        self.recurrent = is_recurrent_model(self._model)
        self._checkpoints = RecurrentCheckpoints(self._ctx) if self.recurrent else None
        self.snapshot_window = int(ll.llama_n_rs_seq(self._ctx)) if self.recurrent else 0
        self._last_call_start: dict[int, float] = {}  # seq -> position its tokens in the last llama_decode began at
        if self.recurrent:  # a branch of recurrent state cannot be cut back to its path: chains only
            self.capabilities = self.capabilities - {TreeDecoding}
        self.n_decode_calls = 0  # target passes, prefill chunks included (for stats and tests)
        self.n_decoded_tokens = 0  # tokens evaluated, all calls together (prefix reuse shows here)

    @property
    def sizing(self) -> Sizing:
        return _sizing(self.n_batch, self.n_threads, self.options)

    def _open_context(self, n_cells: int) -> None:
        """The llama.cpp context, its KV pool of n_cells (llama.cpp pads to a multiple of 256)."""
        options = self.options
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_cells
        cparams.n_batch = options.n_batch
        cparams.n_ubatch = min(options.n_batch, cparams.n_ubatch or options.n_batch)
        cparams.n_seq_max = options.n_seq_max
        cparams.n_rs_seq = SNAPSHOT_WINDOW  # llama.cpp sets it to 0 for architectures without the snapshots
        cparams.kv_unified = options.kv_unified  # tree branches share one pool; LlamaCppMultiSeqRuntime: a stream each
        cparams.n_outputs_max = min(options.n_outputs_max, options.n_batch)
        cparams.n_outputs_max_per_seq = 0  # as many logits rows per sequence as the batch holds
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = options.n_threads_batch or self.n_threads
        cparams.type_k = KV_TYPES[options.type_k][0]
        cparams.type_v = KV_TYPES[options.type_v][0]
        cparams.offload_kqv = options.offload_kqv
        cparams.no_perf = True
        cparams.flash_attn_type = _flash_attn_type(flash_attention(options.flash_attn, options.type_v))
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            detail = f" (llama.cpp: {_Log.recent[-1]})" if _Log.recent else ""
            raise EdgespecError(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for {self.path}"
                                f"{detail}; try a smaller --ctx or f16 KV types")
        self._mem = ll.llama_get_memory(self._ctx)
        self.buffers.update(parse_buffer_sizes(_Log.buffers))  # a re-created context logs its KV and compute anew
        self.pool_cells = int(ll.llama_n_ctx(self._ctx))

    # -- the KV pool's size: shrunk under memory pressure, grown back as the sequence needs ----------

    @property
    def pool_resizable(self) -> bool:
        """Whether `resize_pool` may re-create the context: one attention sequence, nothing else holding
        the context (an MTP head's context, other sequences) or state outside its cells (recurrent)."""
        return type(self) is LlamaCppRuntime and not self.recurrent and bool(self._ctx)

    def pool_bytes(self, n_cells: int | None = None) -> int:
        """Bytes of a KV pool of n_cells (default: the pool now)."""
        return int(self.kv_bytes_per_token() * (self.pool_cells if n_cells is None else padded_ctx(n_cells)))

    def resize_pool(self, n_cells: int) -> None:
        """Re-create the context with a KV pool of n_cells (at least the held tokens, at most n_ctx),
        the held sequence carried over by llama.cpp's own saved state: the model, its weights and the
        sequence stay; the old pool and compute buffers go back to the system. `_append` grows the
        pool again as the sequence needs, so a shrink costs the requests nothing but this copy."""
        n_cells = min(self.n_ctx, padded_ctx(max(n_cells, self._n_past + 1)))
        if n_cells == self.pool_cells or not self.pool_resizable:
            return
        held, old_cells = self._n_past, self.pool_cells
        blob, tokens = (self.save_state(), self.tokens) if held else (None, None)
        ll.llama_free(self._ctx)
        self._ctx = None
        _Log.buffers.clear()
        try:
            self._open_context(n_cells)
            failed = False
        except EdgespecError:  # no memory for a larger pool: keep the one it had, and the sequence
            self._open_context(old_cells)
            failed = True
        self._n_past = 0
        if blob is not None:
            self.load_state(blob, tokens)
        if failed:
            raise EdgespecError(f"{self.path.name}: no memory to grow the KV pool from {old_cells} to {n_cells} "
                                "cells; the sequence is kept: retry when memory is free, or lower --ctx")

    def _room_for(self, n: int) -> None:
        """Grow a shrunk pool (doubling, at most n_ctx) so that n more tokens fit."""
        if self._n_past + n > self.pool_cells:
            self.resize_pool(max(2 * self.pool_cells, self._n_past + n))

    # -- vocabulary ---------------------------------------------------------------------------

    def _read_vocab(self) -> VocabInfo:
        return _vocab_info(self._vocab_ptr, self.n_vocab)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self._vocab_ptr, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self._vocab_ptr, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self._vocab_ptr, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab_ptr, token, buf, -n, 0, False)
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        return (ll.llama_vocab_get_text(self._vocab_ptr, token) or b"").decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        raw = ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def grammar_tokenizer(self):
        """llguidance's tokenizer over this model's own vocabulary, for constrained output (built on
        first use, about 1 s for 150k tokens, then kept; it reads the model's vocab, so it lives as
        long as the model)."""
        if self._grammar_tokenizer is None:
            import warnings

            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it calls llama_token_get_attr, deprecated in llama-cpp-python
                warnings.simplefilter("ignore", DeprecationWarning)
                self._grammar_tokenizer = lltokenizer_from_vocab(self._vocab_ptr, n_vocab=self.n_vocab)
        return self._grammar_tokenizer

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1024)
        n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, 1024)
        if n < 0:
            return None
        if n >= 1024:
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self._model, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    # -- KV sequence ----------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append tokens to the sequence; return logits of the last `n_logits` (a fresh array)."""
        ids = self._check_append(tokens, n_logits)
        return self._decode(ids, np.arange(len(ids) - n_logits, len(ids)))

    def decode_rows(self, tokens: Sequence[int], rows: Sequence[int]) -> np.ndarray:
        """Append tokens; return logits of tokens[rows] only: llama.cpp computes the output rows of
        the tokens flagged in the batch, nothing for the others."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        ids = self._check_append(tokens, len(rows))
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(ids) or (np.diff(rows) <= 0).any()):
            raise ValueError(f"rows must be increasing indices into the {len(ids)} tokens, got {rows.tolist()}")
        return self._decode(ids, rows)

    def _decode(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        n_logits = len(rows)
        if not self._ctx:  # closed (a memory guard dropped this draft model): fail clearly, never in C
            raise EdgespecError(f"{self.path.name} was closed; it can no longer evaluate tokens")
        rows_max = self.options.n_outputs_max
        if rows_max and n_logits > rows_max:
            raise EdgespecError(f"{n_logits} logits rows asked of a context sized for {rows_max} (the memory "
                                f"plan's draft length + 1); draft at most {rows_max - 1} tokens or re-plan")
        if self._checkpoints is not None:
            self._checkpoints.save(0, self._n_past)
        return self._append(ids, rows)

    def _append(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Evaluate ids after the held tokens (no checkpoint: `_decode` and a rollback's replay call it)."""
        n, n_logits = len(ids), len(rows)
        self._room_for(n)
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        # The rows' bookkeeping in Python: it runs right after a pass, where each numpy call on a short
        # array costs ~15x what it does back to back (plain decoding on SmolLM2: ~0.1 ms a round).
        wanted, j = rows.tolist(), 0  # j: the next row of `out`
        for start in range(0, n, self.n_batch):
            chunk = ids[start:start + self.n_batch]
            m = len(chunk)
            self._batch.n_tokens = m
            self._batch_token[:m] = chunk
            self._batch_pos[:m] = np.arange(self._n_past, self._n_past + m, dtype=np.int32)
            self._batch_logits[:m] = 0
            first = j
            while j < n_logits and wanted[j] < start + m:
                self._batch_logits[wanted[j] - start] = 1
                j += 1
            rc = ll.llama_decode(self._ctx, self._batch)
            self.n_decode_calls += 1
            self.n_decoded_tokens += m
            self._last_call_start[0] = self._n_past
            if rc != 0:
                self.truncate(self._n_past)  # drop whatever part of the chunk got in
                raise EdgespecError(f"llama_decode failed with code {rc} at position {self._n_past} "
                                    "(out of KV cache space or compute memory); use a smaller --ctx or batch")
            self._tokens[self._n_past:self._n_past + m] = chunk
            self._n_past += m
            for r in range(first, j):
                _read_logits(self._ctx, wanted[r] - start, out[r])
        self._max_logit_rows = max(self._max_logit_rows, n_logits)
        return out

    # -- token trees: branches on extra sequences, verified in one pass -----------------------------

    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree appended to the sequence in one llama_decode; logits of every node.

        Node 0 is the root (the next token of the sequence); node i > 0 follows node parents[i].
        The chain through each node's first child stays on sequence 0; every other child opens a
        branch sequence that shares the cells above it, so one pass sees each path as if alone.
        Call `keep_tree_path` next: it keeps one root-to-node path and drops every other branch.
        """
        ids = np.asarray(tokens, dtype=np.int32)
        par = np.asarray(parents, dtype=np.int64)
        n = len(ids)
        if n == 0 or len(par) != n or par[0] != -1 or (n > 1 and not (par[1:] < np.arange(1, n)).all()):
            raise ValueError("a tree needs a root (parent -1) and parents listed before their children")
        if n > self.n_batch or self._n_past + n > self.n_ctx:
            raise ContextOverflowError(f"a tree of {n} nodes does not fit (batch {self.n_batch}, "
                                       f"{self.n_ctx - self._n_past} context cells left)")
        self._room_for(n)
        seq = np.zeros(n, dtype=np.int64)  # the sequence each node opens or continues
        depth = np.zeros(n, dtype=np.int64)
        first_child_taken = set()
        for i in range(1, n):
            p = int(par[i])
            depth[i] = depth[p] + 1
            if p in first_child_taken:
                seq[i] = int(seq.max()) + 1  # a sibling: a new branch
            else:
                seq[i] = seq[p]
                first_child_taken.add(p)
        n_branches = int(seq.max()) + 1
        if n_branches > self.options.n_seq_max:
            raise ValueError(f"the tree has {n_branches} branches; the runtime was made with "
                             f"n_seq_max={self.options.n_seq_max}")
        # A branch sees the sequence so far and its ancestors in the tree: give each node the seqs
        # of every branch passing through it.
        members = [{int(seq[i])} for i in range(n)]
        for i in range(n - 1, 0, -1):
            members[int(par[i])] |= members[i]
        for b in range(1, n_branches):
            ll.llama_memory_seq_cp(self._mem, 0, b, 0, self._n_past)
        # The main chain goes first in the batch, so its cells come before the branches' cells. After
        # keep_tree_path frees the rest, every free cell then lies after every cell of sequence 0, and
        # later tokens fill cells in position order: llama.cpp's results change (by up to ~1 logit)
        # when a sequence's cells are out of position order, which is what drifted before this.
        order = np.concatenate([np.flatnonzero(seq == 0), np.flatnonzero(seq != 0)])
        b = self._batch
        b.n_tokens = n
        self._batch_token[:n] = ids[order]
        self._batch_pos[:n] = self._n_past + depth[order]
        self._batch_logits[:n] = 1
        for row, i in enumerate(order):
            b.n_seq_id[row] = len(members[i])
            for j, s in enumerate(sorted(members[i])):
                b.seq_id[row][j] = s
        rc = ll.llama_decode(self._ctx, b)
        self.n_decode_calls += 1
        self.n_decoded_tokens += n
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:n] = 1
        for i in range(n):
            b.seq_id[i][0] = 0
        self._tree = (ids, par, seq, depth, n_branches)
        if rc != 0:
            self._drop_branches(n_branches)
            ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise EdgespecError(f"llama_decode failed with code {rc} on a tree of {n} nodes")
        out = np.empty((n, self.n_vocab), dtype=np.float32)
        for row, i in enumerate(order.tolist()):
            _read_logits(self._ctx, row, out[i])
        self._max_logit_rows = max(self._max_logit_rows, n)
        return out

    def keep_tree_path(self, path: Sequence[int]) -> int:
        """Keep the part of `path` (root first) that lies on the main chain; drop every branch.

        Returns how many path nodes were kept. When the path leaves the main chain the rest of it
        is not moved onto sequence 0 (the caller re-evaluates those few tokens with its next batch):
        copied branch cells would sit after freed main-chain cells, out of position order, and
        later tokens would change (see decode_tree).
        """
        ids, par, seq, depth, n_branches = self._tree
        self._tree = None
        start = self._n_past
        kept = next((i for i, node in enumerate(path) if seq[node] != 0), len(path))
        self._drop_branches(n_branches)
        if not ll.llama_memory_seq_rm(self._mem, 0, start + kept, -1):
            raise EdgespecError(f"{self.path.name}: llama.cpp cannot roll this model's memory back")
        self._tokens[start:start + kept] = ids[list(path[:kept])]
        self._n_past = start + kept
        return kept

    def _drop_branches(self, n_branches: int) -> None:
        for b in range(1, n_branches):
            ll.llama_memory_seq_rm(self._mem, b, -1, -1)

    def truncate(self, n: int) -> None:
        """Roll the KV back to its first n positions (the rollback speculation needs)."""
        if not self._check_truncate(n):
            return
        if self._checkpoints is not None:
            return self._rollback_recurrent(n)
        if not ll.llama_memory_seq_rm(self._mem, 0, n, -1):
            raise EdgespecError(f"{self.path.name}: llama.cpp cannot remove part of this model's memory "
                                "(recurrent or hybrid architecture); speculative decoding needs rollback, "
                                "use --mode ar")
        self._n_past = n

    def _rollback_recurrent(self, n: int) -> None:
        """Truncate a recurrent or hybrid model to n: restore the latest checkpoint at or before n,
        drop the KV cells after it, replay the kept tokens past it (see RecurrentCheckpoints)."""
        if self._cut_within_last_pass(0, n, self._n_past):
            self._n_past = n
            return
        kept = self._tokens[:n].copy()
        start = self._checkpoints.restore(0, n)
        if not ll.llama_memory_seq_rm(self._mem, 0, start if start else -1, -1):
            raise EdgespecError(f"{self.path.name}: llama.cpp could not roll this model's memory back to a checkpoint")
        self._n_past = start
        if start < n:
            self._append(kept[start:], np.zeros(0, dtype=np.int64))

    def _cut_within_last_pass(self, seq: int, n: int, held: int) -> bool:
        """Roll `seq` back to n by llama.cpp's own snapshots when it can (within the last pass, inside
        the window; single-use until the next pass); False: use the checkpoints. A cut to the pass's
        start itself (a new generation reusing the prompt's prefix) goes through the checkpoint saved
        there: llama.cpp's snapshots follow the tokens of the pass, and cutting them all left a state
        15 logits off on LFM2 (tests/test_hybrid.py, the chi-square with the q8_0 draft)."""
        if not (self.snapshot_window and self._last_call_start.get(seq, np.inf) < n
                and held - n <= self.snapshot_window):
            return False
        if not ll.llama_memory_seq_rm(self._mem, seq, n, -1):
            return False  # already cut once since the pass: llama.cpp refuses, nothing changed
        self._last_call_start[seq] = np.inf
        self._checkpoints.drop_after(seq, n)
        return True

    # -- saved state ----------------------------------------------------------------------------

    def compatibility_key(self) -> dict:
        """What must match for saved KV to be valid here: model, llama.cpp build, context, KV types."""
        return {"model": self.identity, "runtime": f"llama-cpp-python {ll.__version__}",
                "n_ctx": self.n_ctx, "type_k": self.options.type_k, "type_v": self.options.type_v}

    def save_state(self) -> bytes:
        """The KV of the held sequence as llama.cpp serialises it (format tied to the build)."""
        size = ll.llama_state_seq_get_size(self._ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = ll.llama_state_seq_get_data(self._ctx, buf, size, 0)
        return ctypes.string_at(buf, written)  # bytes(buf[:n]) would build a list of n ints first: 15x slower

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None:
        """Restore KV saved by `save_state` for exactly these tokens."""
        self.truncate(0)
        self._room_for(len(tokens))
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if ll.llama_state_seq_set_data(self._ctx, buf, len(blob), 0) == 0:
            raise EdgespecError("llama.cpp refused the saved KV state (different model or build); "
                                "start a new session")
        n = len(tokens)
        self._tokens[:n] = np.asarray(tokens, dtype=np.int32)
        self._n_past = n
        if self._checkpoints is not None:
            self._checkpoints.forget(0)
            self._last_call_start.pop(0, None)

    # -- memory and lifetime --------------------------------------------------------------------

    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V per token over all layers, from the model's geometry and the cache types."""
        arch = self.metadata("general.architecture") or "llama"
        n_layer = int(ll.llama_model_n_layer(self._model))
        n_head = int(ll.llama_model_n_head(self._model))
        n_head_kv = int(ll.llama_model_n_head_kv(self._model))
        n_embd = int(ll.llama_model_n_embd(self._model))
        head_k = int(self.metadata(f"{arch}.attention.key_length") or n_embd // n_head)
        head_v = int(self.metadata(f"{arch}.attention.value_length") or n_embd // n_head)
        per_k = KV_TYPES[self.options.type_k][1]
        per_v = KV_TYPES[self.options.type_v][1]
        return n_layer * n_head_kv * (head_k * per_k + head_v * per_v)

    def memory(self) -> MemoryReport:
        """Weights (the model's bytes) and KV from the geometry; under `other`, what llama.cpp reported
        allocating besides: repacked weight copies, compute and output buffers. For the peak a process
        reaches, mmap'd pages included, see `edgespec.machine.memory.predict`."""
        other = {"batch": self.n_batch * 4 * 4}
        for name, suffix in (("repacked_weights", "_REPACK model"), ("compute", " compute"), ("output", " output")):
            total = sum(v for k, v in self.buffers.items() if k.endswith(suffix))
            if total:
                other[name] = total
        if self._checkpoints is not None:  # recurrent state (with llama.cpp's snapshots), rollback checkpoints
            state = int(ll.llama_state_seq_get_size_ext(self._ctx, 0, RecurrentCheckpoints.FLAGS))
            other["recurrent_state"] = state * (1 + self.snapshot_window) * self.options.n_seq_max
            other["checkpoints"] = self._checkpoints.nbytes
        return MemoryReport(
            weights=int(ll.llama_model_size(self._model)),
            kv_cache=self.pool_bytes(),
            logits=self._max_logit_rows * self.n_vocab * 4,
            other=other,
        )

    def device_buffers(self) -> dict[str, int]:
        """What llama.cpp allocated on offload devices (GPU memory): {"Vulkan0 model": bytes, "Vulkan0 KV": ...}."""
        names = {d["name"] for d in offload_devices()}
        return {k: v for k, v in self.buffers.items() if k.split(" ", 1)[0] in names}

    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: ctypes may already be gone
            pass

    def __enter__(self) -> "LlamaCppRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quantize(src: str | os.PathLike, dst: str | os.PathLike, quant: str, *, n_threads: int | None = None) -> Path:
    """Re-quantize a GGUF in-process with llama.cpp (q8_0, q4_k_m, ...). Writes atomically."""
    src, dst = Path(src), Path(dst)
    if quant not in QUANT_TYPES:
        raise EdgespecError(f"unknown quantization {quant!r}; use one of {', '.join(QUANT_TYPES)}")
    check_gguf_file(src)
    _init_backend(_Log.verbose)
    params = ll.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = n_threads or _physical_cores()
    params.allow_requantize = True  # sources are often already quantized (SmolLM2 ships Q4_1)
    tmp = dst.with_name(f".{dst.name}.partial")
    try:
        rc = ll.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise EdgespecError(f"llama.cpp failed to quantize {src} to {quant} (code {rc})")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


# --- several sequences in one context (the cloud verifier's sessions) -------------------------

class LlamaCppMultiSeqRuntime(LlamaCppRuntime):
    """One model and up to `n_seq` independent KV sequences in one llama.cpp context.

    Each sequence has its own KV stream of n_ctx / n_seq cells (`kv_unified=False`, as llama-server's
    `--parallel` runs; llama.cpp rounds each stream up to a multiple of 256 cells), so a sequence's
    attention reads its own cells only and its rows do not depend on what the other sequences hold:
    with one pool shared by all (`streams=False`) 4 of 8 concurrent greedy answers equalled their solo
    answers on SmolLM2, with a stream each 7 of 8 (bench/PARALLEL_AGREEMENT.md). The memory is the same
    n_ctx cells either way. `decode_batch` evaluates tokens of several sequences in one llama_decode
    call: that is how a verifier batches the work of concurrent sessions.

    Flash attention is off unless asked for (or a quantized V cache needs it): with it, results
    depend on the order of a sequence's cells in the pool, which interleaving sessions scramble.

    The single-sequence methods of `LlamaCppRuntime` (`decode`, `truncate`, `tokens`, `n_past`) are
    not available here: every call names its sequence. Vocabulary, metadata, memory and close are
    inherited. Not thread-safe: one thread owns it.
    """

    capabilities = frozenset({SeveralSequences, ModelIdentity, GrammarVocabulary})
    batched = True  # one llama_decode call for every sequence's tokens

    def __init__(self, path: str | os.PathLike, options: LlamaCppOptions = LlamaCppOptions(), *, n_seq: int = 8,
                 identity: dict | None = None, streams: bool = True):
        if not 1 <= n_seq <= 256:
            raise EdgespecError(f"n_seq must be between 1 and 256, got {n_seq}")
        if options.flash_attn is None and options.type_v in FLOAT_KV:
            # Sessions interleave in the shared pool, so a session's cells leave position order after
            # another's rollback frees cells below them; llama.cpp's CPU flash attention then gives
            # other results (up to ~1.3 logits on SmolLM2 in tests) than the in-order cells of a
            # session alone. Without flash attention the order does not matter.
            options = replace(options, flash_attn=False)
        super().__init__(path, replace(options, n_seq_max=n_seq, kv_unified=not streams), identity=identity)
        self.n_seq = n_seq
        self._seq_tokens: list[list[int]] = [[] for _ in range(n_seq)]

    # The one-sequence API does not apply (trees and saved state included): each call must say which
    # sequence it means.
    decode = decode_rows = truncate = save_state = load_state = decode_tree = keep_tree_path = n_past = tokens = NotOffered(
        "LlamaCppMultiSeqRuntime holds several sequences: use decode_batch / seq_truncate")  # type: ignore[assignment]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} out of range 0..{self.n_seq - 1}")

    def seq_n_past(self, seq: int) -> int:
        self._check_seq(seq)
        return len(self._seq_tokens[seq])

    def seq_tokens(self, seq: int) -> np.ndarray:
        self._check_seq(seq)
        return np.asarray(self._seq_tokens[seq], dtype=np.int32)

    @property
    def cells_used(self) -> int:
        """KV cells held by all sequences together (their streams have n_ctx of them)."""
        return sum(len(t) for t in self._seq_tokens)

    def seq_truncate(self, seq: int, n: int) -> None:
        """Drop the KV of sequence `seq` at positions >= n."""
        self._check_seq(seq)
        held = len(self._seq_tokens[seq])
        if not 0 <= n <= held:
            raise ValueError(f"cannot truncate sequence {seq} to {n}: {held} positions held")
        if n == held:
            return
        if self._checkpoints is not None:
            return self._seq_rollback_recurrent(seq, n)
        if not ll.llama_memory_seq_rm(self._mem, seq, n, -1):
            raise EdgespecError(f"{self.path.name}: llama.cpp cannot remove part of this model's memory "
                                "(recurrent or hybrid architecture); it cannot verify speculative drafts")
        del self._seq_tokens[seq][n:]

    def _seq_rollback_recurrent(self, seq: int, n: int) -> None:
        """`seq_truncate` on a recurrent or hybrid model: restore, cut, replay (see RecurrentCheckpoints)."""
        if self._cut_within_last_pass(seq, n, len(self._seq_tokens[seq])):
            del self._seq_tokens[seq][n:]
            return
        kept = self._seq_tokens[seq][:n]
        start = self._checkpoints.restore(seq, n)
        if not ll.llama_memory_seq_rm(self._mem, seq, start, -1):
            raise EdgespecError(f"{self.path.name}: llama.cpp could not roll this model's memory back to a checkpoint")
        del self._seq_tokens[seq][start:]
        if start < n:
            self._decode_batch([(seq, kept[start:], 0)])

    def seq_clear(self, seq: int) -> None:
        self.seq_truncate(seq, 0)

    def decode_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """Append tokens to several sequences in as few llama_decode calls as the batch size allows.

        `work` holds (seq, tokens, n_logits) with each sequence at most once; returns, for each
        entry, float32 logits of its last n_logits tokens, shape (n_logits, n_vocab). The calls made
        are counted in `n_decode_calls`, and `passes_by_seq` (after the call) says how many of them
        each sequence took part in. On failure every sequence is rolled back to where it was.
        """
        seqs = [int(s) for s, _, _ in work]
        if len(set(seqs)) != len(seqs):
            raise ValueError("decode_batch: a sequence appears twice")
        if self._checkpoints is not None:
            for seq in seqs:
                self._check_seq(seq)
                self._checkpoints.save(seq, len(self._seq_tokens[seq]))
        return self._decode_batch(work)

    def _decode_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        seqs = [int(s) for s, _, _ in work]
        flat_seq, flat_tok, flat_pos, flat_out = [], [], [], []
        outs: list[np.ndarray] = []
        for entry, (seq, tokens, n_logits) in enumerate(work):
            self._check_seq(seq)
            ids = np.asarray(tokens, dtype=np.int32)
            n = len(ids)
            if n == 0 or not 0 <= n_logits <= n:
                raise ValueError(f"decode_batch needs at least one token and 0 <= n_logits <= {n}")
            start = len(self._seq_tokens[seq])
            flat_seq.append(np.full(n, seq, dtype=np.int32))
            flat_tok.append(ids)
            flat_pos.append(np.arange(start, start + n, dtype=np.int32))
            row = np.full(n, -1, dtype=np.int64)
            row[n - n_logits:] = np.arange(n_logits)  # row in this entry's output; -1 = no logits
            flat_out.append(np.stack([np.full(n, entry), row], axis=1))
            outs.append(np.empty((n_logits, self.n_vocab), dtype=np.float32))
        if self.cells_used + sum(len(t) for t in flat_tok) > self.n_ctx:
            raise ContextOverflowError(f"the KV pool of {self.n_ctx} cells is full ({self.cells_used} held)")
        seq_all = np.concatenate(flat_seq)
        tok_all = np.concatenate(flat_tok)
        pos_all = np.concatenate(flat_pos)
        out_all = np.concatenate(flat_out)
        before = {s: len(self._seq_tokens[s]) for s in seqs}
        self.passes_by_seq = {s: 0 for s in seqs}
        for start in range(0, len(tok_all), self.n_batch):
            sl = slice(start, start + self.n_batch)
            m = len(tok_all[sl])
            self._batch.n_tokens = m
            self._batch_token[:m] = tok_all[sl]
            self._batch_pos[:m] = pos_all[sl]
            for i, s in enumerate(seq_all[sl].tolist()):
                self._batch.seq_id[i][0] = s
            wanted = out_all[sl, 1] >= 0
            self._batch_logits[:m] = wanted
            rc = ll.llama_decode(self._ctx, self._batch)
            self.n_decode_calls += 1
            if rc != 0:
                for s, n0 in before.items():  # drop whatever got in, on every sequence
                    ll.llama_memory_seq_rm(self._mem, s, n0, -1)
                    del self._seq_tokens[s][n0:]
                raise EdgespecError(f"llama_decode failed with code {rc} (out of KV cells or compute memory); "
                                    "fewer or shorter sessions, or a larger --ctx")
            for s in np.unique(seq_all[sl]).tolist():
                self.passes_by_seq[s] += 1
                self._last_call_start[s] = int(pos_all[sl][seq_all[sl] == s][0])
            for i, s in enumerate(seq_all[sl].tolist()):
                self._seq_tokens[s].append(int(tok_all[start + i]))
            for i in np.flatnonzero(wanted).tolist():
                entry, r = out_all[start + i].tolist()
                _read_logits(self._ctx, i, outs[entry][r])
        self._max_logit_rows = max(self._max_logit_rows, sum(len(o) for o in outs))
        return outs

    # -- one sequence seen as a one-sequence runtime (the parallel slots of `serve --parallel`) -----

    def sequence(self, seq: int, n_ctx: int) -> "LlamaCppSequence":
        """Sequence `seq` as a `Runtime` of its own with room for `n_ctx` tokens (its share of the pool),
        so the engine's step functions run on it unchanged while `decode_batch` batches every slot."""
        self._check_seq(seq)
        return LlamaCppSequence(self, seq, n_ctx)

    def seq_save_state(self, seq: int) -> bytes:
        """The KV of one sequence as llama.cpp serialises it (format tied to the build)."""
        self._check_seq(seq)
        size = ll.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = ll.llama_state_seq_get_data(self._ctx, buf, size, seq)
        return ctypes.string_at(buf, written)

    def seq_load_state(self, seq: int, blob: bytes, tokens: Sequence[int]) -> None:
        """Restore KV saved by `seq_save_state` (of any sequence) into `seq`, for exactly these tokens."""
        self.seq_clear(seq)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if ll.llama_state_seq_set_data(self._ctx, buf, len(blob), seq) == 0:
            raise EdgespecError("llama.cpp refused the saved KV state (different model or build, or the KV pool "
                                "is full); start a new session")
        self._seq_tokens[seq] = [int(t) for t in tokens]
        if self._checkpoints is not None:
            self._checkpoints.forget(seq)
            self._last_call_start.pop(seq, None)


class LlamaCppSequence:
    """One sequence of a `LlamaCppMultiSeqRuntime` behind the one-sequence `Runtime` protocol.

    `decode` is a batch of this sequence alone; a scheduler that wants one pass over every slot calls
    the owner's `decode_batch` instead and then uses this view for rollback (`truncate`) as usual.
    Holds no memory of its own: the KV cells come from the owner's unified pool.
    """

    capabilities = frozenset({ModelIdentity, SavedState, GrammarVocabulary})  # no trees: the other sequences are other slots

    def __init__(self, owner: LlamaCppMultiSeqRuntime, seq: int, n_ctx: int):
        self.owner = owner
        self.seq = seq
        self.n_ctx = n_ctx
        self.name = owner.name
        self.path = owner.path
        self.vocab = owner.vocab
        self.n_vocab = owner.n_vocab
        self.n_batch = owner.n_batch
        self.n_threads = owner.n_threads
        # one sequence, no tree branches, and its share of the rows a pass may return
        rows = owner.options.n_outputs_max
        self.options = replace(owner.options, n_seq_max=1, n_ctx=n_ctx,
                               n_outputs_max=max(1, rows // owner.n_seq) if rows else 0)

    @property
    def sizing(self) -> Sizing:
        return _sizing(self.n_batch, self.n_threads, self.options)

    @property
    def n_past(self) -> int:
        return self.owner.seq_n_past(self.seq)

    @property
    def tokens(self) -> np.ndarray:
        return self.owner.seq_tokens(self.seq)

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if self.n_past + len(ids) > self.n_ctx:
            raise ContextOverflowError(f"the context of {self.n_ctx} tokens is full ({self.n_past} held, "
                                       f"{len(ids)} more asked); use a larger --ctx or a shorter prompt")
        return self.owner.decode_batch([(self.seq, ids, n_logits)])[0]

    def truncate(self, n: int) -> None:
        self.owner.seq_truncate(self.seq, n)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.owner.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.owner.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self.owner.token_text(token)

    def chat_template(self) -> str | None:
        return self.owner.chat_template()

    def grammar_tokenizer(self):
        return self.owner.grammar_tokenizer()

    def metadata(self, key: str) -> str | None:
        return self.owner.metadata(key)

    def compatibility_key(self) -> dict:
        # Costs and saved state of a sequence in a shared pool (no flash attention) are their own kind.
        return {**self.owner.compatibility_key(), "n_ctx": self.n_ctx, "sequences": self.owner.n_seq}

    def save_state(self) -> bytes:
        return self.owner.seq_save_state(self.seq)

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None:
        self.owner.seq_load_state(self.seq, blob, tokens)

    def memory(self) -> MemoryReport:
        """A share of the owner: its KV cells (n_ctx of the pool); weights and buffers are the owner's."""
        return MemoryReport(weights=0, kv_cache=int(self.owner.kv_bytes_per_token() * self.n_ctx), logits=0)

    def close(self) -> None:
        pass  # the owner closes the context


# -- the model's own MTP (NextN) head as a drafter --------------------------------------------------
#
# llama.cpp runs a NextN head in a second context of the same model (ctx_type = LLAMA_CONTEXT_TYPE_MTP,
# ctx_other = the target's context; its KV holds only the NextN layers). The target context outputs the
# hidden state each NextN block reads ("embeddings nextn"); the head's batch pairs token p with the
# target's hidden row p - 1 (common/speculative.cpp, draft-mtp). The calls that switch those outputs on
# are llama.cpp's staging API (src/llama-ext.h): exported C++ symbols, bound here by their mangled names.

def _staging(mangled: str, argtypes: list, restype):
    """A staging-API function by its Itanium-mangled name (Linux, macOS); None where the library lacks it."""
    try:
        fn = getattr(ll.llama_cpp._lib, mangled)
    except AttributeError:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_set_embeddings_nextn = _staging("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                                 [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)
_get_embeddings_nextn_ith = _staging("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                     [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float))


class LlamaCppMtpRuntime(LlamaCppRuntime):
    """A GGUF with NextN (MTP) layers: the target, keeping the hidden rows its NextN head drafts from.

    Every evaluated position's row is kept (n_ctx x n_embd float32 beside the KV), so the head can catch
    up on the committed text whenever it is next asked, whatever evaluated it. A tree pass or a restored
    state leaves no rows (the head then reads zeros there: worse drafts, never a wrong output)."""

    capabilities = LlamaCppRuntime.capabilities | {NextTokenHeads}

    def __init__(self, path: str | os.PathLike, options: LlamaCppOptions = LlamaCppOptions(), *,
                 identity: dict | None = None):
        if _set_embeddings_nextn is None or _get_embeddings_nextn_ith is None:
            raise EdgespecError("this llama.cpp build does not export the MTP staging API "
                                "(llama_set_embeddings_nextn); --mode mtp needs llama-cpp-python >= 0.3.36 on Linux or macOS")
        super().__init__(path, replace(options, load_mtp=True), identity=identity)
        self.n_next_token_heads = int(ll.llama_model_n_layer_nextn(self._model))
        if self.n_next_token_heads <= 0:
            self.close()
            raise EdgespecError(f"{self.path.name} has no MTP (NextN) layers; --mode mtp needs a model that has them")
        self.n_embd = int(ll.llama_model_n_embd(self._model))
        _set_embeddings_nextn(self._ctx, True, False)  # a hidden row for every evaluated token
        self._hidden = np.zeros((self.n_ctx, self.n_embd), dtype=np.float32)
        self._hidden_ok = np.zeros(self.n_ctx, dtype=bool)
        self._head: LlamaCppMtpHead | None = None

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """As LlamaCppRuntime.decode, one batch at a time so each batch's hidden rows are kept."""
        ids = np.asarray(tokens, dtype=np.int32)
        n = len(ids)
        if n <= self.n_batch:
            return self._decode_keeping_rows(ids, n_logits)
        parts = []
        for start in range(0, n, self.n_batch):
            chunk = ids[start:start + self.n_batch]
            wanted = max(0, min(len(chunk), start + len(chunk) - (n - n_logits)))
            parts.append(self._decode_keeping_rows(chunk, wanted))
        return np.concatenate(parts) if parts else np.empty((0, self.n_vocab), dtype=np.float32)

    def decode_rows(self, tokens: Sequence[int], rows: Sequence[int]) -> np.ndarray:
        """As LlamaCppRuntime.decode_rows (a constraint's certain tokens), keeping the hidden rows of a
        pass that fits one batch (a longer one leaves none: the head reads zeros there)."""
        ids = np.asarray(tokens, dtype=np.int32)
        start = self._n_past
        out = super().decode_rows(ids, rows)
        if len(ids) <= self.n_batch:
            self._keep_hidden_rows(start, len(ids))
        else:
            self._hidden_ok[start:start + len(ids)] = False
        return out

    def _decode_keeping_rows(self, ids: np.ndarray, n_logits: int) -> np.ndarray:
        start = self._n_past
        out = super().decode(ids, n_logits)
        self._keep_hidden_rows(start, len(ids))
        return out

    def _keep_hidden_rows(self, start: int, n: int) -> None:
        """Copy the last batch's n hidden rows (one per token) into positions start..start+n-1."""
        for i in range(n):
            self._hidden[start + i] = np.ctypeslib.as_array(_get_embeddings_nextn_ith(self._ctx, i),
                                                            shape=(self.n_embd,))
        self._hidden_ok[start:start + n] = True

    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        self._hidden_ok[self._n_past:] = False  # tree rows are nodes, not positions
        return super().decode_tree(tokens, parents)

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None:
        super().load_state(blob, tokens)
        self._hidden_ok[:] = False

    def hidden_rows(self, start: int, stop: int) -> np.ndarray:
        rows = np.zeros((max(0, stop - start), self.n_embd), dtype=np.float32)
        lo, hi = max(start, 0), min(stop, self.n_past)
        if hi > lo:
            ok = self._hidden_ok[lo:hi]
            rows[lo - start:hi - start][ok] = self._hidden[lo:hi][ok]
        return rows

    def memory(self) -> MemoryReport:
        """The target's, plus the hidden rows the head reads (n_ctx x n_embd float32). The head's own KV (one
        NextN layer) and compute buffers are llama.cpp's, allocated when the head is first asked."""
        report = super().memory()
        report.other["mtp_hidden_rows"] = int(self._hidden.nbytes)
        return report

    def next_token_head(self) -> "LlamaCppMtpHead":
        if self._head is None:
            self._head = LlamaCppMtpHead(self)
        return self._head

    def close(self) -> None:
        if getattr(self, "_head", None) is not None:
            self._head.close()
            self._head = None
        super().close()


class LlamaCppMtpHead:
    """The NextN head's own llama.cpp context (one sequence): cell p holds token p read with hidden row p - 1."""

    def __init__(self, owner: LlamaCppMtpRuntime):
        self.owner = owner
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = owner.n_ctx
        cparams.n_batch = owner.n_batch
        cparams.n_ubatch = owner.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = owner.n_threads
        cparams.n_threads_batch = owner.options.n_threads_batch or owner.n_threads
        cparams.no_perf = True
        cparams.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = owner._ctx
        cparams.n_rs_seq = 0
        self._ctx = ll.llama_init_from_model(owner._model, cparams)
        if not self._ctx:
            detail = f" (llama.cpp: {_Log.recent[-1]})" if _Log.recent else ""
            raise EdgespecError(f"llama.cpp could not create the MTP context of {owner.path.name}{detail}")
        _set_embeddings_nextn(self._ctx, True, True)  # the head's own hidden row where logits are asked
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_ext_init(self._ctx)
        self.tokens = np.zeros(0, dtype=np.int32)
        self.n_decode_calls = 0

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            ll.llama_memory_seq_rm(self._mem, 0, n, -1)
            self.tokens = self.tokens[:n]

    def decode(self, tokens: Sequence[int], hidden: np.ndarray, n_logits: int) -> tuple[np.ndarray, np.ndarray]:
        """Append tokens (each read with its row of `hidden`); logits and the head's hidden rows of the last n_logits."""
        ids = np.asarray(tokens, dtype=np.int32)
        rows = np.ascontiguousarray(hidden, dtype=np.float32)
        n, n_embd, n_vocab = len(ids), self.owner.n_embd, self.owner.n_vocab
        if 0 < n_logits < n:
            # The MTP graphs write their hidden rows densely from the batch's first token, not by output
            # (glm4-moe: a 24-token batch's last "row" came back as its first): outputs get a batch of their own.
            self.decode(ids[:n - n_logits], rows[:n - n_logits], 0)
            return self.decode(ids[n - n_logits:], rows[n - n_logits:], n_logits)
        if n > self.owner.n_batch or len(self.tokens) + n > self.owner.n_ctx:
            raise ContextOverflowError(f"{n} tokens do not fit the MTP head's context")
        pos0 = len(self.tokens)
        ll.llama_batch_ext_clear(self._batch)
        for i in range(n):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, int(ids[i]))
            ll.llama_batch_ext_set_pos(self._batch, idx, (ctypes.c_int32 * 4)(pos0 + i, 0, 0, 0))
            embd = ll.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
            ll.llama_batch_ext_set_embd_token(self._batch, idx, embd)
            if i >= n - n_logits:
                ll.llama_batch_ext_set_output_logits(self._batch, idx, True)
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        self.n_decode_calls += 1
        if rc != 0:
            ll.llama_memory_seq_rm(self._mem, 0, pos0, -1)
            raise EdgespecError(f"the MTP head's llama_process failed with code {rc} at position {pos0}")
        self.tokens = np.concatenate([self.tokens, ids])
        logits = np.empty((n_logits, n_vocab), dtype=np.float32)
        out_hidden = np.empty((n_logits, n_embd), dtype=np.float32)
        for j, i in enumerate(range(n - n_logits, n)):
            logits[j] = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(n_vocab,))
            out_hidden[j] = np.ctypeslib.as_array(_get_embeddings_nextn_ith(self._ctx, i), shape=(n_embd,))
        return logits, out_hidden

    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
