"""Core ML runtime: the exporter's stateful package (prefill / decode / verify) through coremltools.

The package (edgespec.exporters.coreml_export) holds the KV cache as Core ML state and takes, per
call, the new tokens and an additive causal mask whose length says where they go. A decode of T
tokens is a plan of calls: `decode` for one token, `verify` for exactly draft_max + 1, `prefill`
chunks of at most prefill_max otherwise (prefill's length is flexible, so nothing is padded).
Rolling back is moving the length: the next mask ends before the rejected rows, which get
overwritten.

Prediction needs Core ML itself (macOS 15+). Everything else is plain Python that runs anywhere:
reading and checking the package (`read_package`), the plan (`plan_calls`), the vocabulary from the
bundle's tokenizer files (`runtimes/hf_vocab.HFVocab`); exporters/coreml_reference.py runs the same
plan against the torch decoder the exporter converts, so chunking, masks and rollback are checked
numerically without a Mac. A bundle's packages are found by edgespec.loader; this module takes paths.

Memory: the weights (the package's weight file), the KV state (n_layer x n_head_kv x max_context x
head_dim x fp16, K and V: allocated whole when the state is made), and logits rows.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import ContextOverflowError, EdgespecError, ModelFileError
from edgespec.runtimes.base import GrammarVocabulary, MemoryReport, Sizing, TokenSequence
from edgespec.runtimes.formats import COREML_FUNCTIONS as FUNCTIONS, causal_mask, describe_feature
from edgespec.runtimes.hf_vocab import HFVocab, HFVocabMethods

COMPUTE_UNITS = ("cpu_and_gpu", "cpu_only", "cpu_and_ne", "all")
_REEXPORT = "export it again with `edgespec export --format coreml`"


class CoreMLUnavailableError(EdgespecError):
    """Core ML prediction is not available on this machine."""


def check_platform(system: str | None = None, mac_version: str | None = None) -> None:
    """Refuse, in one line, a machine where Core ML cannot run the package (it needs states: macOS 15)."""
    system = sys.platform if system is None else system
    if system != "darwin":
        name = {"linux": "Linux", "win32": "Windows", "cygwin": "Windows"}.get(system, system)
        raise CoreMLUnavailableError(f"Core ML prediction needs macOS 15+; this is {name}")
    version = platform.mac_ver()[0] if mac_version is None else mac_version
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < 15:
        raise CoreMLUnavailableError(f"Core ML prediction needs macOS 15+; this is macOS {version or '(unknown)'}")


# --- the package: interface and calling convention, read without running it ---------------------

@dataclass(frozen=True)
class PackageInfo:
    path: Path
    n_vocab: int
    state_shape: tuple[int, int, int, int]   # (n_layer, n_head_kv, max_context, head_dim), K and V alike
    max_context: int
    prefill_max: int
    verify_tokens: int                        # draft_max + 1
    lengths: dict[str, tuple[int, int]]       # tokens each function takes (lowest, highest), from its spec
    weight_bytes: int
    quant: str | None
    source: str | None

    @property
    def draft_max(self) -> int:
        return self.verify_tokens - 1

    @property
    def kv_bytes(self) -> int:
        """K and V states in fp16."""
        return int(np.prod(self.state_shape)) * 2 * 2


def read_package(path: str | os.PathLike) -> PackageInfo:
    """The package's interface and calling convention, checked; one-line ModelFileError when unusable."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFileError(f"Core ML package not found: {path}; {_REEXPORT}")
    try:
        desc = _describe_interface(path)
    except Exception as exc:  # coremltools raises anything from JSON to protobuf errors on a broken package
        raise ModelFileError(f"{path.name} is not a readable Core ML package ({_one_line(exc)}); {_REEXPORT}") from None
    return package_info(path, desc)


def _describe_interface(path: Path) -> dict:
    """`describe_package`'s functions / metadata / sizes, from the spec alone: describe_package also loads
    the MIL program with every weight, which a runtime does not need to learn the interface."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(path))

    desc = spec.description
    functions = {fn.name: {"inputs": [describe_feature(f) for f in fn.input], "outputs": [describe_feature(f) for f in fn.output],
                           "states": [describe_feature(f) for f in fn.state]} for fn in desc.functions}
    weights = path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    return {"functions": functions, "metadata": dict(desc.metadata.userDefined),
            "weight_bytes": weights.stat().st_size if weights.is_file() else 0,
            "bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file())}


def package_info(path: str | os.PathLike, desc: dict) -> PackageInfo:
    """Check a package description (as `describe_package` or `_describe_interface` give it) against the
    exporter's calling convention; say in one line what does not fit."""
    path = Path(path)

    def bad(why: str) -> ModelFileError:
        return ModelFileError(f"{path.name} is not a Core ML package this runtime can run: {why}; {_REEXPORT}")

    functions, meta = desc.get("functions", {}), desc.get("metadata", {})
    missing = [f for f in FUNCTIONS if f not in functions]
    if missing:
        raise bad(f"it has no {' / '.join(missing)} function")
    try:
        max_context, prefill_max, verify_tokens = (int(meta[f"edgespec.{k}"]) for k in
                                                   ("max_context", "prefill_max", "verify_tokens"))
    except (KeyError, ValueError):
        raise bad("its edgespec metadata (max_context, prefill_max, verify_tokens) is missing or not numbers") from None
    state_shape, n_vocab, lengths = None, None, {}
    for name in FUNCTIONS:
        fn = functions[name]
        inputs = {i["name"]: i for i in fn.get("inputs", [])}
        ids, mask = inputs.get("input_ids"), inputs.get("causal_mask")
        if ids is None or mask is None or ids["dtype"] != "int32" or mask["dtype"] != "float16":
            raise bad(f"{name} does not take input_ids int32 and causal_mask float16")
        states = {s["name"]: s for s in fn.get("states", [])}
        kv = [states.get(n) for n in ("k_cache", "v_cache")]
        if None in kv or kv[0]["shape"] != kv[1]["shape"] or len(kv[0]["shape"]) != 4 or \
                {s["dtype"] for s in kv} != {"float16"}:
            raise bad(f"{name} does not hold k_cache and v_cache float16 states of one 4-d shape")
        if state_shape is None:
            state_shape = tuple(kv[0]["shape"])
        elif tuple(kv[0]["shape"]) != state_shape:
            raise bad(f"its functions hold KV states of different shapes ({name}: {kv[0]['shape']}, "
                      f"{FUNCTIONS[0]}: {list(state_shape)})")
        lengths[name] = _axis_range(ids, 1)
        if _axis_range(mask, 3)[1] != max_context:
            raise bad(f"{name}'s causal_mask reaches {_axis_range(mask, 3)[1]} positions, not max_context {max_context}")
        logits = {o["name"]: o for o in fn.get("outputs", [])}.get("logits")
        if logits is None:
            raise bad(f"{name} has no logits output")
        if len(logits["shape"]) == 3:  # fixed-length functions state it; prefill's is flexible
            n_vocab = logits["shape"][2]
    if state_shape[2] != max_context:
        raise bad(f"its KV state holds {state_shape[2]} positions but its metadata says max_context {max_context}")
    want = {"decode": (1, 1), "verify": (verify_tokens, verify_tokens), "prefill": (1, prefill_max)}
    for name, span in want.items():
        if lengths[name] != span:
            raise bad(f"{name} takes {_span(lengths[name])} tokens where its metadata implies {_span(span)}")
    if not n_vocab:
        raise bad("its decode function does not state the width of its logits")
    return PackageInfo(path, int(n_vocab), state_shape, max_context, prefill_max, verify_tokens, lengths,
                       int(desc.get("weight_bytes") or desc.get("bytes") or 0), meta.get("edgespec.quant"),
                       meta.get("edgespec.source"))


def _axis_range(feature: dict, axis: int) -> tuple[int, int]:
    if feature.get("ranges"):
        lo, hi = feature["ranges"][axis]
        return int(lo), int(hi)
    n = int(feature["shape"][axis])
    return n, n


def _span(span: tuple[int, int]) -> str:
    return str(span[0]) if span[0] == span[1] else f"{span[0]}..{span[1]}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


# --- the plan of calls for one decode -----------------------------------------------------------

@dataclass(frozen=True)
class Call:
    function: str   # "prefill" | "decode" | "verify"
    start: int      # offset of its first token among the tokens of the decode
    n_past: int     # positions cached before it
    length: int     # tokens it takes

    def mask(self) -> np.ndarray:
        """float16 (1, 1, length, n_past + length): its last dimension tells the model where the tokens go."""
        return causal_mask(self.n_past, self.length)


def plan_calls(info: PackageInfo, n_past: int, n_tokens: int, n_ctx: int | None = None) -> list[Call]:
    """The calls that append `n_tokens` after `n_past` cached positions."""
    n_ctx = info.max_context if n_ctx is None else n_ctx
    if n_tokens < 1:
        raise ValueError("a decode needs at least one token")
    if n_past + n_tokens > n_ctx:
        raise ContextOverflowError(f"the context of {n_ctx} tokens is full ({n_past} held, {n_tokens} more asked); "
                                   "use a shorter prompt or fewer --max-tokens, or re-export with a larger "
                                   "--coreml-context")
    if n_tokens == 1:
        return [Call("decode", 0, n_past, 1)]
    if n_tokens == info.verify_tokens:
        return [Call("verify", 0, n_past, n_tokens)]
    step = info.prefill_max
    return [Call("prefill", s, n_past + s, min(step, n_tokens - s)) for s in range(0, n_tokens, step)]


# --- the vocabulary, from the bundle's Hugging Face tokenizer files ------------------------------

# --- runtimes: one sequence, calls planned as above ------------------------------------------------

@dataclass(frozen=True)
class CoreMLOptions:
    n_ctx: int | None = None            # None or 0 = the package's max_context; more is refused
    compute_units: str = "cpu_and_gpu"  # what the exporter converts for; "all" adds the Neural Engine

    def __post_init__(self) -> None:
        if self.compute_units not in COMPUTE_UNITS:
            raise EdgespecError(f"unknown Core ML compute units {self.compute_units!r}; use one of "
                                f"{', '.join(COMPUTE_UNITS)}")
        if self.n_ctx is not None and self.n_ctx < 0:
            raise EdgespecError("n_ctx must be >= 0 (0 = the package's context)")


class _PlannedRuntime(HFVocabMethods, TokenSequence):
    """Sequence bookkeeping shared by the Core ML runtime and its torch reference: `_run(call, ids)`
    evaluates one planned call and returns its logits (T, n_vocab)."""

    name = "coreml"
    capabilities: frozenset[type] = frozenset({GrammarVocabulary})  # no trees, saved state or model file key
    sizing = Sizing()  # its calls have the lengths the package was exported with, not settings of ours

    def __init__(self, info: PackageInfo, vocab: HFVocab, n_ctx: int | None):
        if n_ctx and n_ctx > info.max_context:
            raise EdgespecError(f"a context of {n_ctx} tokens is more than the {info.max_context} positions the Core ML "
                                f"package {info.path.name} holds; use --ctx {info.max_context} or less, or re-export "
                                "with a larger --coreml-context")
        self.info = info
        self.n_ctx = n_ctx or info.max_context
        self.n_vocab = info.n_vocab
        self._vocab = vocab
        self.vocab = vocab.info
        self._start_sequence(self.n_ctx)
        self._max_logit_rows = 0
        self._max_call_rows = 0
        self.n_decode_calls = 0  # calls made, every function together (as llama.cpp's runtime counts)
        self.n_decoded_tokens = 0
        self.n_calls = {f: 0 for f in FUNCTIONS}

    def _run(self, call: Call, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append tokens; float32 logits of the last `n_logits` of them."""
        ids = self._check_append(tokens, n_logits)
        n = len(ids)
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise EdgespecError(f"token id {int(ids[(ids < 0) | (ids >= self.n_vocab)][0])} is outside the "
                                f"vocabulary of {self.n_vocab}")
        calls = plan_calls(self.info, self._n_past, n, self.n_ctx)
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        first = n - n_logits
        for call in calls:
            logits = self._run(call, ids[call.start:call.start + call.length])
            self.n_calls[call.function] += 1
            self.n_decode_calls += 1
            self.n_decoded_tokens += call.length
            self._max_call_rows = max(self._max_call_rows, call.length)
            lo = max(first, call.start)
            if lo < call.start + call.length:
                out[lo - first:call.start + call.length - first] = logits[lo - call.start:]
        # The length moves only once every call succeeded: rows a failed call wrote are overwritten later.
        self._tokens[self._n_past:self._n_past + n] = ids
        self._n_past += n
        self._max_logit_rows = max(self._max_logit_rows, n_logits)
        return out

    def truncate(self, n: int) -> None:
        """Keep the first n positions: the next call's mask ends there, and rows past it get overwritten."""
        self._check_truncate(n)
        self._n_past = n

    def memory(self) -> MemoryReport:
        """Weights (the package's weight file), the whole KV state, logits rows returned; under `other`
        the fp16 logits Core ML hands back per call (every row of the longest call)."""
        return MemoryReport(weights=self.info.weight_bytes, kv_cache=self.info.kv_bytes,
                            logits=self._max_logit_rows * self.n_vocab * 4,
                            other={"call_logits": self._max_call_rows * self.n_vocab * 2})

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CoreMLRuntime(_PlannedRuntime):
    """The exporter's package in Core ML, one KV state shared by its three functions (macOS 15+)."""

    name = "coreml"
    _compiled: Path | None = None  # the compiled model's temporary folder, once made

    def __init__(self, package: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                 options: CoreMLOptions = CoreMLOptions()):
        check_platform()
        info = read_package(package)
        super().__init__(info, HFVocab(tokenizer_dir, info.n_vocab), options.n_ctx)
        self.options = options
        try:
            import coremltools as ct
            from coremltools.models.utils import compile_model
        except ImportError:
            raise EdgespecError("the Core ML runtime needs coremltools: pip install coremltools") from None
        # Compiled once: an MLModel per function would compile (and copy the weights) three times.
        self._compiled = Path(tempfile.mkdtemp(prefix="edgespec-coreml-"))
        try:
            compiled = compile_model(str(info.path), str(self._compiled / "model.mlmodelc"))
            units = getattr(ct.ComputeUnit, options.compute_units.upper())
            self._models = {fn: ct.models.CompiledMLModel(compiled, units, function_name=fn) for fn in FUNCTIONS}
            self._state = self._models["decode"].make_state()
        except Exception as exc:
            self.close()
            raise ModelFileError(f"Core ML could not load {info.path.name} ({_one_line(exc)}); {_REEXPORT}") from None

    def _run(self, call: Call, ids: np.ndarray) -> np.ndarray:
        if self._state is None:
            raise EdgespecError(f"{self.info.path.name} was closed; it can no longer evaluate tokens")
        out = self._models[call.function].predict({"input_ids": ids[None, :], "causal_mask": call.mask()},
                                                  state=self._state)
        return np.asarray(out["logits"], dtype=np.float32)[0]

    def close(self) -> None:
        self._models, self._state = {}, None
        if self._compiled is not None:
            shutil.rmtree(self._compiled, ignore_errors=True)
            self._compiled = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

