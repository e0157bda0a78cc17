"""ONNX Runtime runtime: an optimum-exported with-past decoder behind the Runtime protocol.

The model is a directory as `exporters/onnx_export.py` writes it (model.onnx, model_int8.onnx and/or
model_q4.onnx with config.json, generation_config.json and the tokenizer files), or one of those
.onnx files (a bundle's onnx/target and onnx/draft are found by edgespec.loader). The graph's interface is
`input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key/.value` of shape
(1, n_head_kv, past, head_dim) in; `logits` (1, t, n_vocab) for every position fed and
`present.{i}.key/.value` = concat(past, new) of shape (1, n_head_kv, past + t, head_dim) out.

KV cache. One preallocated array holds every KV tensor twice (two "sides"). A side stores each
tensor as a contiguous (1, n_head_kv, n_past, head_dim) block at the start of its n_ctx-row slot,
which is what the graph reads without a copy. A call binds the past to one side and the present
output to the other (IO binding on raw pointers), then the sides swap. Copies that remain:

* the graph's own Concat writes the whole present (n_past + t rows) every call: O(n_past) memory
  traffic per decode, the price of this graph interface (llama.cpp appends t rows in place);
* `truncate(n)` below n_past re-lays the first n rows out contiguously on the other side (one copy
  of n rows): the head-major layout's row stride is the sequence length, so a shorter sequence is
  a different layout;
* the asked logits rows are copied out of the bound logits buffer (n_logits x n_vocab), so every
  caller owns the array it gets;
* with a GPU provider the bound buffers live in host memory, so KV and logits go to the device and
  back on every call (device-resident KV is not done).

Memory. Weights: the model file and its external data (ONNX Runtime reads them into its own memory,
and may pre-pack some; that is not measured). KV: 2 sides x 2 x n_layer x n_head_kv x n_ctx x
head_dim x itemsize (fp32 for every export here: 4 bytes), twice llama.cpp's f32 cache and four
times its f16 default, because the graph reads one side while it writes the other; pages are
committed only as positions are used. Logits: the graph returns logits for every position fed, so
long prompts run `prefill_chunk` tokens (default 64) at a time into one bound buffer of
prefill_chunk x n_vocab float32 (12.6 MB for a 49k vocabulary) instead of n_tokens x n_vocab.
ONNX Runtime's activation arena is not counted.

Tokenizer and vocabulary: `edgespec.runtimes.hf_vocab.HFVocab` (llama.cpp's answers for every id).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.runtimes.base import GrammarVocabulary, MemoryReport, ModelIdentity, SavedState, Sizing, TokenSequence
from edgespec.runtimes.formats import ONNX_FILES
from edgespec.runtimes.hf_vocab import HFVocab, HFVocabMethods, read_json
from edgespec.runtimes.identity import file_identity

# Best first: what provider="auto" picks among the ones this onnxruntime build has.
PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider",
                  "CPUExecutionProvider")
PROVIDER_ALIASES = {"tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider",
                    "cuda": "CUDAExecutionProvider", "coreml": "CoreMLExecutionProvider",
                    "cpu": "CPUExecutionProvider"}
# Listed by get_available_providers() but not a device to run a model on (it calls a remote endpoint).
_NOT_DEVICES = {"AzureExecutionProvider"}

_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32}


def _need_ort():
    try:
        import onnxruntime
    except ImportError:
        raise EdgespecError("the ONNX runtime needs onnxruntime: pip install 'edgespec[export]' "
                            "(or onnxruntime-gpu for CUDA)") from None
    return onnxruntime


@dataclass(frozen=True)
class OnnxOptions:
    n_ctx: int = 4096            # 0 = the model's max_position_embeddings
    n_threads: int | None = None  # ONNX Runtime intra-op threads; None = physical cores
    provider: str = "auto"       # auto | tensorrt | cuda | coreml | cpu, or a full ExecutionProvider name
    quant: str = "auto"          # which file of a directory: auto (fp32, else int8, else int4) | fp32 | int8 | int4
    prefill_chunk: int = 64      # most tokens per graph run: the logits block is prefill_chunk x n_vocab
    verbose: bool = False        # ONNX Runtime's own warnings
    kv_resident_bytes: int | None = None  # set: run the target's layer graphs with this much KV in memory
                                          # and the rest in a file (runtimes/onnx_layered.py)

    def __post_init__(self) -> None:
        if self.n_ctx < 0 or self.prefill_chunk < 1:
            raise EdgespecError("n_ctx must be >= 0 and prefill_chunk >= 1")
        if self.quant not in ("auto", "fp32", "int8", "int4"):
            raise EdgespecError(f"unknown ONNX quantization {self.quant!r}; use auto, fp32, int8 or int4")


def choose_provider(asked: str, available: Sequence[str]) -> tuple[str, str]:
    """(provider, why) for an option value and the providers this onnxruntime build lists."""
    devices = [p for p in available if p not in _NOT_DEVICES]
    if asked == "auto":
        usable = [p for p in PROVIDER_ORDER if p in devices] or ["CPUExecutionProvider"]
        best = usable[0]
        if len(usable) == 1:
            return best, f"{best}: the only provider this onnxruntime build has"
        return best, (f"{best}: the best this onnxruntime build has (of {', '.join(usable)}; "
                      "order TensorRT, CUDA, CoreML, CPU)")
    name = PROVIDER_ALIASES.get(asked.lower(), asked)
    if name not in devices:
        raise EdgespecError(f"ONNX Runtime provider {asked!r} is not available: this onnxruntime build has "
                            f"{', '.join(devices) or 'none'}; use provider 'auto', or install the onnxruntime "
                            "package built for it (onnxruntime-gpu for CUDA and TensorRT)")
    return name, f"{name}: asked for"


def model_file(path: str | os.PathLike, quant: str = "auto") -> Path:
    """The .onnx file a path names: the file itself, or the asked quantization in an export directory."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix != ".onnx":
            raise ModelFileError(f"{path} is not an .onnx file; give an ONNX export directory or its model.onnx")
        return path
    if not path.is_dir():
        raise ModelFileError(f"ONNX model not found: {path}; give a directory made by "
                             "`edgespec export CHECKPOINT --format onnx` or an .onnx file in it")
    present = {q: path / f for q, f in ONNX_FILES.items() if (path / f).is_file()}
    if not present:
        raise ModelFileError(f"{path} holds no ONNX model (model.onnx, model_int8.onnx or model_q4.onnx); "
                             "export one with `edgespec export CHECKPOINT --format onnx`")
    if quant == "auto":
        return next(iter(present.values()))  # ONNX_FILES lists fp32, int8, int4: the preference order
    if quant not in present:
        raise ModelFileError(f"{path} has no {quant} ONNX model ({ONNX_FILES.get(quant, '?')}); "
                             f"it has {', '.join(present)}")
    return present[quant]


def _ort_reason(exc: Exception) -> str:
    """ONNX Runtime's error text cut to its first line, without the "[ONNXRuntimeError] : 7 :" prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[ONNXRuntimeError]"):
        text = text.split(":", 2)[-1].strip().replace(" : ", ": ", 1)
    return re.sub(r"Load model from .*? failed:\s*", "", text)[:200]  # the caller names the file already


class OnnxRuntime(HFVocabMethods, TokenSequence):
    """An exported with-past ONNX decoder and one KV sequence. Implements `edgespec.runtimes.base.Runtime`."""

    name = "onnxruntime"
    capabilities = frozenset({ModelIdentity, SavedState, GrammarVocabulary})  # one sequence: no trees

    def __init__(self, path: str | os.PathLike, options: OnnxOptions = OnnxOptions(), *,
                 identity: dict | None = None):
        ort = _need_ort()
        self.options = options
        self.path = model_file(path, options.quant)
        self.identity = identity or file_identity(self.path)  # names the model in compatibility_key
        self.directory = self.path.parent
        self._session = None
        self.provider, self.provider_reason = choose_provider(options.provider, ort.get_available_providers())
        self.n_threads = options.n_threads or _physical_cores()
        self.n_batch = options.prefill_chunk  # profile key and stats read n_batch, as for llama.cpp
        self._config = read_json(self.directory / "config.json")
        self._load_session(ort)
        self._read_interface()
        self._load_tokenizer()
        self.n_ctx = options.n_ctx or int(self._config.get("max_position_embeddings") or 4096)
        t, h, d = len(self._kv_in), self.n_head_kv, self.head_dim
        # [side, tensor, n_ctx * h * d]: see the module docstring. np.empty commits pages on first write.
        self._kv = np.empty((2, t, self.n_ctx * h * d), dtype=self._kv_dtype)
        slot = self._kv.strides[1]
        self._kv_ptr = [[self._kv.ctypes.data + side * self._kv.strides[0] + i * slot for i in range(t)]
                        for side in (0, 1)]
        self._side = 0  # the side holding the KV of the tokens held
        self._logits = np.empty((options.prefill_chunk, self.n_vocab), dtype=self._logits_dtype)
        self._ids = np.zeros((1, options.prefill_chunk), dtype=self._int_type["input_ids"])
        self._positions = np.arange(self.n_ctx, dtype=self._int_type.get("position_ids", np.int64))[None]
        self._mask = np.ones((1, self.n_ctx), dtype=self._int_type["attention_mask"])
        self._binding = self._session.io_binding()
        self._start_sequence(self.n_ctx)
        self._max_logit_rows = 0
        self.n_decode_calls = 0
        self.n_decoded_tokens = 0

    # -- loading ----------------------------------------------------------------------------------

    @property
    def sizing(self) -> Sizing:
        return Sizing(n_batch=self.n_batch, n_threads=self.n_threads)

    def _load_session(self, ort) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.n_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 2 if self.options.verbose else 3
        providers = [self.provider]
        if self.provider == "TensorrtExecutionProvider" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.append("CUDAExecutionProvider")  # nodes TensorRT cannot take run on CUDA, not the CPU
        if self.provider != "CPUExecutionProvider":
            providers.append("CPUExecutionProvider")
        try:
            self._session = ort.InferenceSession(str(self.path), opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, Fail, NoSuchFile)
            raise ModelFileError(f"ONNX Runtime cannot load {self.path} ({_ort_reason(exc)}): the file is truncated, "
                                 "corrupt or not an ONNX model; export it again with `edgespec export --format onnx`"
                                 ) from None
        running = self._session.get_providers()[0]
        if running != self.provider:  # listed by the build but failed to start (missing CUDA libraries, ...)
            if self.options.provider != "auto":
                raise EdgespecError(f"ONNX Runtime could not start {self.provider} (its libraries or device are "
                                    f"missing) and fell back to {running}; use provider 'auto' or 'cpu'")
            self.provider_reason = f"{running}: {self.provider} is listed by this onnxruntime build but failed to start"
            self.provider = running

    def _read_interface(self) -> None:
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        self._kv_in = [n for n in inputs if n.startswith("past_key_values.")]
        missing = [n for n in ("input_ids", "attention_mask") if n not in inputs] + \
            [n for n in ("logits",) if n not in outputs]
        if not self._kv_in or missing:
            what = "no past_key_values.* inputs" if not self._kv_in else f"no {', '.join(missing)}"
            raise ModelFileError(f"{self.path} is not a decoder with past key/values ({what}); export it with "
                                 "`edgespec export --format onnx` (optimum task text-generation-with-past)")
        self._kv_out = [n.replace("past_key_values.", "present.", 1) for n in self._kv_in]
        if any(n not in outputs for n in self._kv_out):
            raise ModelFileError(f"{self.path}: some past_key_values inputs have no present output; export it again")
        shapes = {tuple(inputs[n].shape[1::2]) for n in self._kv_in}  # (n_head_kv, head_dim)
        types = {inputs[n].type for n in self._kv_in}
        if len(shapes) != 1 or not all(isinstance(x, int) for x in next(iter(shapes))) or len(types) != 1:
            raise ModelFileError(f"{self.path}: past key/value inputs of differing or unknown shapes {sorted(shapes)}; "
                                 "only uniform (batch, n_head_kv, past, head_dim) caches are supported")
        self.n_head_kv, self.head_dim = next(iter(shapes))
        self.n_layer = len(self._kv_in) // 2
        self._kv_dtype = _NP_TYPES.get(types.pop(), np.float32)
        self._logits_dtype = _NP_TYPES.get(outputs["logits"].type, np.float32)
        self._int_type = {n: _NP_TYPES.get(inputs[n].type, np.int64)
                          for n in ("input_ids", "attention_mask", "position_ids") if n in inputs}
        width = outputs["logits"].shape[-1]
        self.n_vocab = int(width) if isinstance(width, int) else int(self._config.get("vocab_size") or 0)
        if self.n_vocab <= 0:
            raise ModelFileError(f"{self.path}: the logits width is not fixed and config.json has no vocab_size")

    def _load_tokenizer(self) -> None:
        self._vocab = HFVocab(self.directory, self.n_vocab, self._config)
        self.vocab = self._vocab.info

    # -- KV sequence ------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append tokens; return float32 logits of the last `n_logits` of them (a fresh array)."""
        ids = self._check_append(tokens, n_logits, np.int64)
        n = len(ids)
        if self._session is None:
            raise EdgespecError(f"{self.path.name} was closed; it can no longer evaluate tokens")
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        first = n - n_logits  # index of the first token whose logits are asked for
        chunk = self.options.prefill_chunk
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            self._run(ids[start:start + m])
            lo = max(first - start, 0)
            if lo < m:
                out[start + lo - first:start + m - first] = self._logits[lo:m]
        self._max_logit_rows = max(self._max_logit_rows, min(n, chunk))
        return out

    def _run(self, ids: np.ndarray) -> None:
        """One graph run over at most prefill_chunk tokens: past from one side, present into the other."""
        p, t = self._n_past, len(ids)
        h, d, dtype = self.n_head_kv, self.head_dim, self._kv_dtype
        io = self._binding
        self._ids[0, :t] = ids
        io.bind_input("input_ids", "cpu", 0, self._ids.dtype, (1, t), self._ids.ctypes.data)
        io.bind_input("attention_mask", "cpu", 0, self._mask.dtype, (1, p + t), self._mask.ctypes.data)
        if "position_ids" in self._int_type:
            io.bind_input("position_ids", "cpu", 0, self._positions.dtype, (1, t),
                          self._positions.ctypes.data + p * self._positions.itemsize)
        src, dst = self._kv_ptr[self._side], self._kv_ptr[1 - self._side]
        for i, (name_in, name_out) in enumerate(zip(self._kv_in, self._kv_out)):
            io.bind_input(name_in, "cpu", 0, dtype, (1, h, p, d), src[i])
            io.bind_output(name_out, "cpu", 0, dtype, (1, h, p + t, d), dst[i])
        io.bind_output("logits", "cpu", 0, self._logits.dtype, (1, t, self.n_vocab), self._logits.ctypes.data)
        try:
            self._session.run_with_iobinding(io)
        except Exception as exc:  # the held KV is untouched: the present went to the other side
            raise EdgespecError(f"ONNX Runtime failed evaluating {t} tokens at position {p}: "
                                f"{_ort_reason(exc)}") from None
        self._side = 1 - self._side
        self._tokens[p:p + t] = ids
        self._n_past = p + t
        self.n_decode_calls += 1
        self.n_decoded_tokens += t

    def _kv_view(self, side: int, n: int) -> np.ndarray:
        """Side `side`'s KV of n positions: (tensor, n_head_kv, n, head_dim), contiguous per tensor."""
        size = self.n_head_kv * n * self.head_dim
        return self._kv[side, :, :size].reshape(len(self._kv_in), self.n_head_kv, n, self.head_dim)

    def truncate(self, n: int) -> None:
        """Roll the KV back to its first n positions (one copy of n rows onto the other side)."""
        if not self._check_truncate(n):
            return
        if n:
            np.copyto(self._kv_view(1 - self._side, n), self._kv_view(self._side, self._n_past)[:, :, :n])
            self._side = 1 - self._side
        self._n_past = n

    # -- saved state ------------------------------------------------------------------------------

    def compatibility_key(self) -> dict:
        """What must match for saved KV and cached profiles: model file, onnxruntime build and provider, context."""
        ort = _need_ort()
        return {"model": self.identity, "runtime": f"onnxruntime {ort.__version__} {self.provider}",
                "n_ctx": self.n_ctx, "kv_dtype": np.dtype(self._kv_dtype).name}

    def save_state(self) -> bytes:
        """The held KV, tensor by tensor (the layout the graph reads)."""
        return self._kv_view(self._side, self._n_past).tobytes()

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None:
        """Restore KV saved by `save_state` for exactly these tokens."""
        n = len(tokens)
        view = self._kv_view(self._side, n) if n <= self.n_ctx else None
        if view is None or len(blob) != view.nbytes:
            raise EdgespecError("the saved KV state does not fit this model (different model or context); "
                                "start a new session")
        view[...] = np.frombuffer(blob, dtype=self._kv_dtype).reshape(view.shape)
        self._tokens[:n] = np.asarray(tokens, dtype=np.int32)
        self._n_past = n

    # -- memory and lifetime ----------------------------------------------------------------------

    def weight_bytes(self) -> int:
        """The model file plus its external data files (named after it, as onnx writes them)."""
        total = self.path.stat().st_size
        for f in self.directory.iterdir():
            if f.is_file() and f.name.startswith((self.path.name + "_data", self.path.name + ".data")):
                total += f.stat().st_size
        return total

    def memory(self) -> MemoryReport:
        """Weights (file bytes), the KV buffers as allocated (both sides), the logits block; under
        `other`, the small reused input arrays. ONNX Runtime's own arena is not included."""
        inputs = self._ids.nbytes + self._positions.nbytes + self._mask.nbytes + self._tokens.nbytes
        return MemoryReport(weights=self.weight_bytes(), kv_cache=int(self._kv.nbytes),
                            logits=int(self._logits.nbytes), other={"inputs": inputs})

    def close(self) -> None:
        self._session = None
        self._binding = None

    def __enter__(self) -> "OnnxRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _physical_cores() -> int:
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return max(1, os.cpu_count() or 1)

