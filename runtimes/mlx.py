"""MLX runtime: a Hugging Face checkpoint or an MLX repo (4- and 8-bit included) run by mlx-lm.

MLX runs on Apple Silicon's GPU through Metal, and on Linux and macOS on its CPU backend (the
`mlx[cpu]` wheel), which is what the tests here run. The model is a directory holding config.json,
model*.safetensors and a Hugging Face tokenizer (tokenizer.json): a checkpoint as transformers
saves it, or an MLX repo (`mlx_lm.convert`, mlx-community) whose config names its quantization.

KV cache. mlx-lm's own per-layer caches (`mlx_lm.models.cache.make_prompt_cache`), which grow in
steps of 256 positions. Rollback is `trim_prompt_cache`: it moves the caches' offset back, so the
next pass overwrites the dropped rows; models whose caches cannot be trimmed (rotating windows,
recurrent state) are refused at load, since speculation must roll back.

Logits. A pass over several tokens computes the last hidden states of all of them, but the output
head only for the rows asked for, on the model families whose head is known to be a plain
projection (Llama, Qwen2, Qwen3, and what mlx-lm maps onto them); others compute every row and keep
the tail. Inputs longer than `n_batch` run in passes of `n_batch` tokens. MLX is lazy: each pass
evaluates the asked rows and the caches' new state together, so nothing else is computed.

Several sequences (`MlxMultiSeqRuntime`, for `serve --parallel`): one model in memory and a set of
mlx-lm caches per sequence, each sequence evaluated in a pass of its own. Not batched across
sequences: mlx-lm's BatchKVCache holds a batch left-padded behind one shared write index, `trim(n)`
drops the last n positions of every row at once and a pass appends the same number of tokens to every
row, while speculation accepts a different count per sequence each round, so rolling one sequence
back would mean splitting and re-merging the batch (`extract` / `merge`, copies of the whole cache)
every round. The slots share the weights and keep their own prefixes; their passes take turns. The
cloud verifier's sessions run on llama.cpp.

Saved state: mlx-lm's prompt-cache format (a safetensors file of the caches' state), as bytes.

Tokenizer and vocabulary: `edgespec.runtimes.hf_vocab.HFVocab` (llama.cpp's answers for every id),
as for the ONNX runtime; mlx-lm's tokenizer wrapper is not loaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import ContextOverflowError, EdgespecError, ModelFileError
from edgespec.runtimes.base import (GrammarVocabulary, MemoryReport, ModelIdentity, SavedState, SeveralSequences,
                                    Sizing, TokenSequence)
from edgespec.runtimes.hf_vocab import HFVocab, HFVocabMethods, read_json
from edgespec.runtimes.identity import file_identity

# mlx-lm model modules whose Model.__call__ is `head(self.model(inputs, cache))` with head the
# lm_head, or the embedding's `as_linear` when tied: for these only the asked rows reach the head.
_PLAIN_HEAD_MODULES = frozenset({"llama", "qwen2", "qwen3"})
INSTALL_HINT = "pip install 'edgespec[mlx]'"


def need_mlx():
    """mlx.core and mlx_lm, or one clear error saying how to install them."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        raise EdgespecError(f"the MLX runtime needs mlx and mlx-lm ({exc.name or 'mlx'} is not installed): "
                            f"{INSTALL_HINT}") from None
    return mx


def mlx_versions() -> str:
    """`mlx X mlx-lm Y DEVICE`: what the saved state and measured costs of this runtime depend on."""
    mx = need_mlx()
    lm = importlib.metadata.version("mlx-lm")
    return f"mlx {mx.__version__} mlx-lm {lm} {mx.default_device().type.name}"


@dataclass(frozen=True)
class MlxOptions:
    n_ctx: int = 4096   # 0 = the model's max_position_embeddings
    n_batch: int = 512  # most tokens one pass evaluates (longer inputs are split)

    def __post_init__(self) -> None:
        if self.n_ctx < 0 or self.n_batch < 1:
            raise EdgespecError("n_ctx must be >= 0 and n_batch >= 1")


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files mlx-lm loads from a model directory."""
    return sorted(directory.glob("model*.safetensors"))


def model_directory(path: str | os.PathLike) -> Path:
    """The model directory a path names (the directory itself, or a file in it), checked for the
    files mlx-lm and the tokenizer need."""
    path = Path(path).expanduser()
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise ModelFileError(f"MLX model not found: {path}; give a Hugging Face checkpoint directory or an MLX "
                             "repo (config.json, model*.safetensors, tokenizer.json), or hf:OWNER/REPO")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not weight_files(path):
        missing.append("model*.safetensors")
    if missing:
        raise ModelFileError(f"{path} is not a model MLX can load: no {', '.join(missing)}; give a Hugging Face "
                             "checkpoint directory or an MLX repo")
    return path


def directory_identity(directory: Path) -> dict:
    """Names a model directory by its config and weight files (name, size, mtime, inode each)."""
    files = [directory / "config.json", *weight_files(directory)]
    return {"name": directory.name, "files": [file_identity(f) for f in files]}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


class MlxRuntime(HFVocabMethods, TokenSequence):
    """A model run by mlx-lm and one KV sequence. Implements `edgespec.runtimes.base.Runtime`."""

    name = "mlx"
    capabilities = frozenset({ModelIdentity, SavedState, GrammarVocabulary})  # one sequence: no trees

    def __init__(self, path: str | os.PathLike, options: MlxOptions = MlxOptions(), *,
                 identity: dict | None = None, weights_of: "MlxRuntime | None" = None):
        """Load the model at `path`; or, with `weights_of`, a new sequence on that runtime's loaded
        model (no second copy of the weights), as `MlxMultiSeqRuntime` makes its sequences."""
        mx = need_mlx()
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
        from mlx_lm.utils import load_model

        self.options = options
        if weights_of is not None:
            self.path = self.directory = weights_of.directory
            self.identity = weights_of.identity
            self._config, self._model = weights_of._config, weights_of._model
        else:
            self.path = self.directory = model_directory(path)
            self.identity = identity or directory_identity(self.directory)
            self._config = read_json(self.directory / "config.json")
            try:
                self._model, _ = load_model(self.directory)
            except Exception as exc:  # mlx-lm raises ValueError, KeyError, ... for what it cannot build
                raise ModelFileError(f"MLX cannot load {self.directory} ({_reason(exc)}): its architecture or "
                                     "quantization is not one this mlx-lm supports, or its files are incomplete"
                                     ) from None
        self._make_cache = make_prompt_cache
        self._cache = make_prompt_cache(self._model)
        if not can_trim_prompt_cache(self._cache):
            raise ModelFileError(f"{self.directory}: this model's MLX cache cannot be rolled back (a sliding window "
                                 "or recurrent state), which speculative decoding needs")
        self._plain_head = type(self._model).__module__.rsplit(".", 1)[-1] in _PLAIN_HEAD_MODULES
        self.n_vocab = self._vocab_rows()
        self._vocab = weights_of._vocab if weights_of is not None else HFVocab(self.directory, self.n_vocab,
                                                                                self._config)
        self.vocab = self._vocab.info
        self.n_ctx = options.n_ctx or int(self._config.get("max_position_embeddings") or 4096)
        self.n_batch = options.n_batch
        self._dtype = weights_of._dtype if weights_of is not None else self._activation_dtype()
        self._start_sequence(self.n_ctx)
        self._owns_weights = weights_of is None
        self._max_logit_rows = 0
        self._closed = False
        self.n_decode_calls = 0
        self.n_decoded_tokens = 0
        self._mx = mx

    def _vocab_rows(self) -> int:
        """Rows of the output head: config's vocab_size, else the embedding's rows."""
        size = self._config.get("vocab_size") or (self._config.get("text_config") or {}).get("vocab_size")
        if not size:
            embed = getattr(getattr(self._model, "model", None), "embed_tokens", None)
            size = embed.weight.shape[0] if embed is not None else 0
        if not size:
            raise ModelFileError(f"{self.directory}/config.json has no vocab_size")
        return int(size)

    def _activation_dtype(self) -> str:
        """The dtype activations and the KV are computed in: the embedding's (or first float weight's)."""
        from mlx.utils import tree_flatten

        floats = [v.dtype for k, v in tree_flatten(self._model.parameters()) if "float" in str(v.dtype)]
        embed = getattr(getattr(self._model, "model", None), "embed_tokens", None)
        scales = getattr(embed, "scales", None)  # a quantized embedding: its scales hold the compute dtype
        dtype = scales.dtype if scales is not None else (floats[0] if floats else "unknown")
        return str(dtype).removeprefix("mlx.core.")

    @property
    def sizing(self) -> Sizing:
        return Sizing(n_batch=self.n_batch)  # MLX has no thread setting

    # -- KV sequence ------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Append tokens; return float32 logits of the last `n_logits` of them (a fresh array)."""
        ids = self._check_append(tokens, n_logits)
        if self._closed:
            raise EdgespecError(f"{self.directory.name} was closed; it can no longer evaluate tokens")
        n = len(ids)
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        first = n - n_logits  # index of the first token whose logits are asked for
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            lo = max(first - start, 0)
            rows = self._pass(ids[start:start + m], max(m - lo, 0))
            if rows is not None:
                out[start + lo - first:start + m - first] = rows
        return out

    def _pass(self, ids: np.ndarray, k: int) -> np.ndarray | None:
        """One forward pass over `ids`; the logits of its last k tokens (None when k is 0)."""
        mx = self._mx
        x = mx.array(ids[None].astype(np.int32))
        p, t = self._n_past, len(ids)
        try:
            if self._plain_head:
                hidden = self._model.model(x, self._cache)
                logits = self._head(hidden[:, t - k:]) if k else None
            else:
                logits = self._model(x, cache=self._cache)[:, t - k:] if k else None
            mx.eval([c.state for c in self._cache] + ([logits] if k else []))
        except Exception as exc:
            self._resync(p)
            raise EdgespecError(f"MLX failed evaluating {t} tokens at position {p}: {_reason(exc)}") from None
        self._tokens[p:p + t] = ids
        self._n_past = p + t
        self.n_decode_calls += 1
        self.n_decoded_tokens += t
        self._max_logit_rows = max(self._max_logit_rows, k)
        return np.array(logits[0].astype(mx.float32)) if k else None

    def _head(self, hidden):
        model = self._model
        if getattr(model.args, "tie_word_embeddings", False):
            return model.model.embed_tokens.as_linear(hidden)
        return model.lm_head(hidden)

    def _resync(self, n: int) -> None:
        """After a failed pass: the caches back to the n positions held (they may have advanced)."""
        from mlx_lm.models.cache import trim_prompt_cache

        extra = self._cache[0].offset - n if self._cache else 0
        if extra > 0:
            trim_prompt_cache(self._cache, extra)

    def truncate(self, n: int) -> None:
        """Roll the KV back to its first n positions (the caches' offset moves back; no copy)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if not self._check_truncate(n):
            return
        trimmed = trim_prompt_cache(self._cache, self._n_past - n)
        if trimmed != self._n_past - n:  # checked trimmable at load; a short trim would desync silently
            raise EdgespecError(f"MLX trimmed {trimmed} of {self._n_past - n} cached positions")
        self._n_past = n

    def limit_context(self, n_ctx: int) -> None:
        """Hold at most n_ctx positions from now on (a slot's share of a pool), keeping what is held."""
        held = self.tokens
        self.n_ctx = n_ctx
        self._start_sequence(n_ctx)
        self._tokens[:len(held)], self._n_past = held, len(held)

    def release_cache(self) -> int:
        """Hold nothing, giving the caches' memory back (fresh empty caches replace them; truncate keeps
        the arrays for reuse). Returns the bytes the caches held."""
        held = self.memory().kv_cache
        self._cache = self._make_cache(self._model)
        self._n_past = 0
        self._mx.clear_cache()
        return held

    # -- saved state ------------------------------------------------------------------------------

    def compatibility_key(self) -> dict:
        """What must match for saved KV and cached profiles: model files, mlx and mlx-lm builds and device,
        context, the dtype the KV is held in."""
        return {"model": self.identity, "runtime": mlx_versions(), "n_ctx": self.n_ctx,
                "kv_dtype": self._dtype}

    def save_state(self) -> bytes:
        """The held KV as an mlx-lm prompt-cache file (safetensors), read back as bytes."""
        from mlx_lm.models.cache import save_prompt_cache

        with tempfile.TemporaryDirectory(prefix="edgespec-mlx-") as tmp:
            file = Path(tmp) / "state.safetensors"
            save_prompt_cache(str(file), self._cache, {"n_past": str(self._n_past)})
            return file.read_bytes()

    def load_state(self, blob: bytes, tokens: Sequence[int]) -> None:
        """Restore KV saved by `save_state` for exactly these tokens."""
        from mlx_lm.models.cache import load_prompt_cache

        n = len(tokens)
        refused = EdgespecError("the saved KV state does not fit this model (different model or context); "
                                "start a new session")
        if n > self.n_ctx:
            raise refused
        with tempfile.TemporaryDirectory(prefix="edgespec-mlx-") as tmp:
            file = Path(tmp) / "state.safetensors"
            file.write_bytes(blob)
            try:
                cache, meta = load_prompt_cache(str(file), return_metadata=True)
            except Exception:
                raise refused from None
            self._mx.eval([c.state for c in cache])  # read before the file goes
        mine = self._make_cache(self._model)
        same = (len(cache) == len(mine) and meta.get("n_past") == str(n)
                and all(type(a) is type(b) and a.offset == n for a, b in zip(cache, mine)))
        if not same:
            raise refused
        self._cache = cache
        self._tokens[:n] = np.asarray(tokens, dtype=np.int32)
        self._n_past = n

    # -- memory and lifetime ----------------------------------------------------------------------

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        if self._model is None:  # closed
            return 0
        return int(sum(v.nbytes for _, v in tree_flatten(self._model.parameters())))

    def memory(self) -> MemoryReport:
        """Weights (parameter bytes as loaded; none for a sequence sharing another's), the KV caches as
        allocated (grown in steps of 256 positions), the largest logits block returned; under `other`,
        the token id array. MLX's own buffer cache and activations are not counted."""
        kv = 0
        for c in self._cache:
            for a in (getattr(c, "keys", None), getattr(c, "values", None)):
                kv += int(a.nbytes) if a is not None else 0
        weights = self.weight_bytes() if self._owns_weights else 0  # a sibling sequence shares them
        return MemoryReport(weights=weights, kv_cache=kv,
                            logits=self._max_logit_rows * self.n_vocab * 4, other={"tokens": self._tokens.nbytes})

    def close(self) -> None:
        """Drop the caches and this runtime's hold on the weights (they go with the last runtime holding
        them), and hand MLX's cached buffers back, so a closed draft model's memory is returned."""
        self._closed = True
        self._cache = []
        self._model = None
        self._mx.clear_cache()

    def __enter__(self) -> "MlxRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MlxMultiSeqRuntime(HFVocabMethods):
    """One model in memory and up to `n_seq` independent sequences, each an `MlxRuntime` with caches of its
    own on the shared weights (`serve --parallel`'s slots). Implements `SeveralSequences`.

    `decode_batch` evaluates each named sequence in a pass of its own, one after another (see the
    module's note: mlx-lm's batched caches cannot roll sequences back apart). The pool of n_ctx
    positions is shared: the sequences together hold at most n_ctx. Memory: the weights once, and each
    sequence's caches as they grow (256 positions at a time). Not thread-safe: one thread owns it.
    """

    name = "mlx"
    capabilities = frozenset({SeveralSequences, ModelIdentity, GrammarVocabulary})
    batched = False  # a pass per sequence, in turn

    def __init__(self, path: str | os.PathLike, options: MlxOptions = MlxOptions(), *, n_seq: int = 4,
                 identity: dict | None = None):
        if not 1 <= n_seq <= 256:
            raise EdgespecError(f"n_seq must be between 1 and 256, got {n_seq}")
        self._weights = MlxRuntime(path, options, identity=identity)  # its own cache stays empty
        self._seqs = [MlxRuntime(self._weights.directory, options, weights_of=self._weights)
                      for _ in range(n_seq)]
        self.n_seq = n_seq
        self.options = options
        self.path = self.directory = self._weights.directory
        self.identity = self._weights.identity
        self._vocab = self._weights._vocab
        self.vocab, self.n_vocab = self._weights.vocab, self._weights.n_vocab
        self.n_ctx, self.n_batch = self._weights.n_ctx, self._weights.n_batch

    @property
    def sizing(self) -> Sizing:
        return self._weights.sizing

    def _seq(self, seq: int) -> MlxRuntime:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} out of range 0..{self.n_seq - 1}")
        return self._seqs[seq]

    @property
    def cells_used(self) -> int:
        """Positions held by all sequences together (the pool has n_ctx of them)."""
        return sum(rt.n_past for rt in self._seqs)

    @property
    def n_decode_calls(self) -> int:
        return sum(rt.n_decode_calls for rt in self._seqs)

    def decode_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """Append (seq, tokens, n_logits) to each sequence named, one pass per sequence; the logits of
        each, float32 (n_logits, n_vocab). On failure every sequence is rolled back to where it was."""
        seqs = [int(s) for s, _, _ in work]
        if len(set(seqs)) != len(seqs):
            raise ValueError("decode_batch: a sequence appears twice")
        wanted = sum(len(np.asarray(t).reshape(-1)) for _, t, _ in work)
        if self.cells_used + wanted > self.n_ctx:
            raise ContextOverflowError(f"the KV pool of {self.n_ctx} positions is full ({self.cells_used} held)")
        before = {s: self._seq(s).n_past for s in seqs}
        try:
            return [self._seqs[seq].decode(tokens, n_logits) for seq, tokens, n_logits in work]
        except BaseException:
            for s, n in before.items():
                if self._seqs[s].n_past > n:
                    self._seqs[s].truncate(n)
            raise

    def seq_n_past(self, seq: int) -> int:
        return self._seq(seq).n_past

    def seq_tokens(self, seq: int) -> np.ndarray:
        return self._seq(seq).tokens

    def seq_truncate(self, seq: int, n: int) -> None:
        self._seq(seq).truncate(n)

    def seq_clear(self, seq: int) -> None:
        self._seq(seq).truncate(0)

    def seq_kv_bytes(self, seq: int) -> int:
        """Bytes sequence `seq`'s caches hold: memory of its own, which `seq_release` gives back."""
        return self._seq(seq).memory().kv_cache

    def seq_release(self, seq: int) -> int:
        """Clear sequence `seq` and give its caches' memory back; the bytes they held."""
        return self._seq(seq).release_cache()

    def seq_save_state(self, seq: int) -> bytes:
        return self._seq(seq).save_state()

    def seq_load_state(self, seq: int, blob: bytes, tokens: Sequence[int]) -> None:
        self._seq(seq).load_state(blob, tokens)

    def sequence(self, seq: int, n_ctx: int) -> MlxRuntime:
        """Sequence `seq` as the one-sequence runtime it is, held to n_ctx positions (its share of the pool)."""
        rt = self._seq(seq)
        if not 1 <= n_ctx <= self.n_ctx:
            raise ValueError(f"a sequence's context must be 1..{self.n_ctx}, got {n_ctx}")
        if rt.n_past > n_ctx:
            raise ValueError(f"sequence {seq} holds {rt.n_past} positions, more than {n_ctx}")
        rt.limit_context(n_ctx)
        return rt

    def compatibility_key(self) -> dict:
        return self._weights.compatibility_key()

    def memory(self) -> MemoryReport:
        """The weights once; every sequence's caches and largest logits block."""
        parts = [rt.memory() for rt in self._seqs]
        return MemoryReport(weights=self._weights.weight_bytes(), kv_cache=sum(p.kv_cache for p in parts),
                            logits=sum(p.logits for p in parts),
                            other={"tokens": sum(p.other["tokens"] for p in parts)})

    def close(self) -> None:
        for rt in self._seqs:
            rt.close()
        self._weights.close()

    def __enter__(self) -> "MlxMultiSeqRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
