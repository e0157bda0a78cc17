"""ONNX Runtime over a decoder exported as layer graphs (exporters/onnx_layers.py), with managed KV.

The runtime owns the KV cache (edgespec.runtimes.kvstore.KVStore): each layer's K and V live in fixed-size
blocks, in RAM or in a file, and a layer graph gets only its own layers' past and
returns only the new rows. With a `resident_budget_bytes`, the layers that do not fit stay in the
file tier; while one layer group runs, a background thread copies the next group's blocks into a
staging buffer (double buffering). A context whose KV exceeds the budget still decodes, with the
output of an unlimited budget (the same graphs see the same numbers).

One call of `decode(tokens, n_logits)` runs, per chunk of at most `n_batch` tokens: embed.onnx
(ids, positions -> hidden, RoPE tables), each layer graph in order (hidden, mask, past -> hidden,
new rows, written to the store), then head.onnx on only the rows whose logits are asked for.

Memory: the weights (every graph's bytes; ONNX Runtime reads them into its own memory), the
resident KV (RAM-tier blocks in use plus the two staging buffers; at most the budget), the asked
logits rows. ONNX Runtime's per-graph arenas are off: with one session per layer group each arena
would keep its own copy of the activation peak, so together they would grow with the layer count;
and on glibc the malloc mmap threshold is pinned (`malloc_mmap_threshold`, see _fix_mmap_threshold)
so freed activations go back to the OS instead of fragmenting the heap. Offloaded KV lives in the
page cache (or on disk), not in the process: see `kv_stats()`.

Tokenizer: the tokenizer files beside the graphs, read by `runtimes/hf_vocab.HFVocab`, as the ONNX
and Core ML runtimes read theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.runtimes.base import GrammarVocabulary, MemoryReport, ModelIdentity, Sizing, TokenSequence
from edgespec.runtimes.formats import LAYERS_FORMAT as FORMAT, LAYERS_MANIFEST as MANIFEST, LAYERS_SCHEMA as SCHEMA
from edgespec.runtimes.formats import sha256_file
from edgespec.runtimes.hf_vocab import HFVocab, HFVocabMethods
from edgespec.runtimes.kvstore import DEFAULT_BLOCK_TOKENS, KVGeometry, KVStore
from edgespec.runtimes.onnxrt import _need_ort, _ort_reason, _physical_cores



@dataclass(frozen=True)
class LayeredOptions:
    n_ctx: int = 4096                        # 0 = the model's context length
    n_threads: int | None = None             # ONNX Runtime intra-op threads per graph; None = physical cores
    n_batch: int = 64                        # most tokens per pass through the layers (prefill chunk)
    resident_budget_bytes: int | None = None  # KV bytes kept in this process; None = all of it
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # positions per KV block
    offload_dir: str | None = None           # where the file tier's file goes (default: the temp dir)
    prefetch: bool = True                    # fetch the next group's KV while the current one runs
    verify_files: bool = True                # check every graph's sha256 against the manifest at load
    malloc_mmap_threshold: int | None = 256 << 10  # glibc: see _fix_mmap_threshold; None = leave malloc alone

    def __post_init__(self) -> None:
        if self.n_ctx < 0 or self.n_batch < 1 or self.block_tokens < 1:
            raise EdgespecError("n_ctx must be >= 0, n_batch and block_tokens >= 1")
        if self.resident_budget_bytes is not None and self.resident_budget_bytes < 0:
            raise EdgespecError("the resident KV budget must be >= 0 bytes")


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise ModelFileError(f"{directory} is not a layered ONNX export (no {MANIFEST}); export one with "
                             "edgespec.exporters.onnx_layers.export_onnx_layers")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is corrupt ({exc}); export the layers again") from None
    if manifest.get("format") != FORMAT or manifest.get("schema") != SCHEMA:
        raise ModelFileError(f"{path} is not a layered ONNX manifest of schema {SCHEMA} (format "
                             f"{manifest.get('format')!r}); export the layers again")
    return manifest


def check_files(directory: Path, manifest: dict, hashes: bool) -> None:
    """Every file the manifest lists must be there with its size (and sha256 when `hashes`)."""
    for name, info in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ModelFileError(f"{path} is missing from the layered export; export the layers again")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise ModelFileError(f"{path} has {size} bytes, the manifest says {info['bytes']}: the file is truncated "
                                 "or corrupt; export the layers again")
        if hashes and sha256_file(path) != info["sha256"]:
            raise ModelFileError(f"{path}: sha256 differs from {MANIFEST}: the file is corrupt; "
                                 "export the layers again")


def _fix_mmap_threshold(nbytes: int) -> bool:
    """glibc only, process-wide: serve allocations of at least `nbytes` from maps of their own, returned
    to the OS when freed. glibc's default threshold rises to 32 MiB once large blocks are freed (as
    loading the graphs does), after which the tensors of the layer graphs, a little larger at each
    step as the past grows, came from the heap and fragmented it: on SmolLM2 (30 graphs) +34 MiB over a
    1k-token prefill with 4.5 MiB of KV resident, and a load peak 190 MiB higher. Speed was unchanged."""
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
    except (AttributeError, ValueError, OSError):  # not glibc (macOS, musl, Windows)
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def causal_mask(n_past: int, n_new: int) -> np.ndarray:
    """Additive float32 mask (1, 1, n_new, n_past + n_new): new token i sees positions <= n_past + i."""
    cols = np.arange(n_past + n_new)[None, :]
    rows = np.arange(n_new)[:, None]
    return np.where(cols > n_past + rows, np.float32(-np.inf), np.float32(0.0))[None, None]


class LayeredOnnxRuntime(HFVocabMethods, TokenSequence):
    """Layer graphs and one KV sequence in a managed store. Implements `edgespec.runtimes.base.Runtime`."""

    name = "onnxruntime-layered"
    capabilities = frozenset({ModelIdentity, GrammarVocabulary})  # one sequence, no trees; no saved state

    def __init__(self, path: str | os.PathLike, options: LayeredOptions | None = None, **overrides):
        ort = _need_ort()
        self.options = options = replace(options or LayeredOptions(), **overrides)
        self.path = Path(path).expanduser()
        self._store = None
        if options.malloc_mmap_threshold:
            _fix_mmap_threshold(options.malloc_mmap_threshold)
        manifest = read_manifest(self.path)
        check_files(self.path, manifest, options.verify_files)
        self.manifest = manifest
        geo = manifest["geometry"]
        self.n_layer, self.n_vocab = int(geo["n_layer"]), int(geo["n_vocab"])
        self.n_head_kv, self.head_dim = int(geo["n_head_kv"]), int(geo["head_dim"])
        self.n_ctx = options.n_ctx or int(geo["context_length"])
        self.n_threads = options.n_threads or _physical_cores()
        self.n_batch = options.n_batch
        self.groups = [list(g["layers"]) for g in manifest["groups"]]

        self._embed = self._session(ort, manifest["embed"])
        self._layer_sessions = [self._session(ort, g["file"]) for g in manifest["groups"]]
        self._head = self._session(ort, manifest["head"])
        self._past_names = [[(f"past_key.{i}", f"past_value.{i}") for i in g] for g in self.groups]
        self._vocab = HFVocab(self.path, self.n_vocab)
        self.vocab = self._vocab.info

        geometry = KVGeometry(self.n_layer, self.n_head_kv, self.head_dim, manifest.get("dtype", "float32"))
        self._store = KVStore(geometry, self.n_ctx, self.groups, block_tokens=options.block_tokens,
                              resident_budget_bytes=options.resident_budget_bytes,
                              offload_dir=options.offload_dir, prefetch=options.prefetch)
        self._positions = np.arange(self.n_ctx, dtype=np.int64)[None]
        self._start_sequence(self.n_ctx)
        self._max_logit_rows = 0
        self.n_decode_calls = 0
        self.n_decoded_tokens = 0

    @property
    def sizing(self) -> Sizing:
        return Sizing(n_batch=self.n_batch, n_threads=self.n_threads)

    def _session(self, ort, name: str):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.n_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # One session per graph: per-session arenas would each keep their own activation peak, and
        # spinning pools would keep burning cores while the next graph runs.
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = self.path / name
        try:
            session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, Fail, ...)
            raise ModelFileError(f"ONNX Runtime cannot load {path} ({_ort_reason(exc)}): the file is corrupt; "
                                 "export the layers again") from None
        return session

    # -- KV sequence ------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append tokens; return float32 logits of the last `n_logits` of them (a fresh array)."""
        ids = self._check_append(tokens, n_logits, np.int64)
        n = len(ids)
        if self._store is None:
            raise EdgespecError(f"{self.path.name} was closed; it can no longer evaluate tokens")
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        first = n - n_logits
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            hidden = self._run_layers(ids[start:start + m])
            lo = max(first - start, 0)
            if lo < m:  # the head sees only the rows whose logits were asked for
                (logits,) = self._head.run(None, {"hidden": np.ascontiguousarray(hidden[:, lo:m])})
                out[start + lo - first:start + m - first] = logits[0]
        self._max_logit_rows = max(self._max_logit_rows, n_logits)
        return out

    def _run_layers(self, ids: np.ndarray) -> np.ndarray:
        """Embed `ids`, run every layer group over them (KV from and to the store); the last hidden state."""
        p, t = self._n_past, len(ids)
        store = self._store
        pending = store.prefetch(0, p)  # overlaps the embedding
        try:
            hidden, cos, sin = self._embed.run(None, {"input_ids": ids[None],
                                                      "position_ids": self._positions[:, p:p + t]})
            mask = causal_mask(p, t)
            for gi, session in enumerate(self._layer_sessions):
                past = store.result(pending)
                pending = store.prefetch(gi + 1, p) if gi + 1 < len(self.groups) else None
                feed = {"hidden": hidden, "cos": cos, "sin": sin, "attention_mask": mask}
                for (kname, vname), (k, v) in zip(self._past_names[gi], past):
                    feed[kname], feed[vname] = k, v
                outs = session.run(None, feed)
                hidden = outs[0]
                for j, layer in enumerate(self.groups[gi]):
                    store.write(layer, p, outs[1 + 2 * j], outs[2 + 2 * j])
        except Exception as exc:
            if pending is not None:  # let the prefetch finish before its buffer is reused
                try:
                    store.result(pending)
                except Exception:
                    pass
            if isinstance(exc, EdgespecError):
                raise
            raise EdgespecError(f"ONNX Runtime failed evaluating {t} tokens at position {p}: "
                                f"{_ort_reason(exc)}") from None
        self._tokens[p:p + t] = ids
        self._n_past = p + t
        self.n_decode_calls += 1
        self.n_decoded_tokens += t
        return hidden

    def truncate(self, n: int) -> None:
        """Roll back to the first n positions: the store's rows past n get overwritten later."""
        self._check_truncate(n)
        self._n_past = n

    # -- identity, memory and lifetime -------------------------------------------------------------

    def compatibility_key(self) -> dict:
        """What must match for cached profiles: the graphs (by their manifest), onnxruntime, context, budget."""
        ort = _need_ort()
        digest = hashlib.sha256(json.dumps(self.manifest["files"], sort_keys=True).encode()).hexdigest()
        return {"model": {"name": self.manifest.get("source"), "layers_sha256": digest},
                "runtime": f"onnxruntime {ort.__version__} layered", "n_ctx": self.n_ctx,
                "kv_dtype": self.manifest.get("dtype", "float32"),
                "resident_budget_bytes": self.options.resident_budget_bytes}

    def weight_bytes(self) -> int:
        names = [self.manifest["embed"], *(g["file"] for g in self.manifest["groups"]), self.manifest["head"]]
        return sum(self.manifest["files"][n]["bytes"] for n in names)

    def kv_stats(self) -> dict:
        """Where the KV is and what moving it cost: resident and offloaded bytes, RAM and file layers,
        seconds fetching (background), waiting for a fetch (foreground) and writing, bytes moved."""
        return self._store.kv_stats()

    def memory(self) -> MemoryReport:
        """Weights (graph file bytes), the RAM-tier KV blocks in use and the asked logits rows; under
        `other`, the two staging buffers in use. `total` sums bytes this process holds, so the
        offloaded KV (page cache or disk) and the transfer statistics are reported by `kv_stats()`."""
        s = self._store
        return MemoryReport(weights=self.weight_bytes(), kv_cache=s.ram_tier_bytes(),
                            logits=self._max_logit_rows * self.n_vocab * 4, other={"kv_staging": s.staging_bytes()})

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._embed = self._head = None
        self._layer_sessions = []

    def __enter__(self) -> "LayeredOnnxRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
