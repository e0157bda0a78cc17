"""Hugging Face checkpoint -> GGUF, with our own converter on the `gguf` package, then llama.cpp quantization.

llama.cpp's converter script ships in no installable package, so this is a small one for the llama
and qwen2 families (SmolLM2, Llama 3.x, Qwen2.5):

* tensors are renamed with `gguf.TensorNameMap`; llama's q/k projections are permuted from Hugging
  Face's rotate-half RoPE layout to the interleaved layout llama.cpp's llama graph uses (qwen2 runs
  NEOX RoPE in llama.cpp, so its weights go as they are, biases included);
* the vocabulary is written in id order with token types, BPE merges, special token ids, add-BOS/EOS
  flags and the chat template (`gguf.SpecialVocab`), and `tokenizer.ggml.pre` from the pre-tokenizer;
* weights stream one tensor at a time from memory-mapped safetensors into the file (f32 or f16; 1-D
  tensors stay f32 as llama.cpp expects), then `llama_model_quantize` writes q8_0, q4_k_m, ...

After writing, `check_tokenizer_parity` tokenizes a text corpus with llama.cpp and with the Hugging
Face tokenizer; any difference is reported (and fails the export unless allowed).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

import gguf

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import (LLAMA_CPP_FAMILY, SUPPORTED_ARCHITECTURES, Checkpoint, CheckpointError,
                                           load_checkpoint)
from edgespec.exporters.progress import SILENT, Progress
from edgespec.runtimes.hf_tokenizer import PARITY_TEXTS, HFTokenizer

FLOAT_TYPES = ("f32", "f16")
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
_FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}


@dataclass(frozen=True)
class PlannedTensor:
    gguf_name: str
    hf_name: str | None        # None for tensors computed here (rope_freqs)
    shape: tuple[int, ...]
    dtype: type


def gguf_quant_types() -> tuple[str, ...]:
    """Every GGUF type `export_gguf` writes: the float types and llama.cpp's quantized file types."""
    from edgespec.runtimes.llamacpp import QUANT_TYPES

    return tuple(dict.fromkeys((*FLOAT_TYPES, *QUANT_TYPES)))


def check_quant_types(quants: Sequence[str]) -> None:
    known = gguf_quant_types()
    for q in quants:
        if q not in known:
            raise EdgespecError(f"unknown GGUF quantization {q!r}; use one of {', '.join(known)}")


def convert_to_gguf(source: str | os.PathLike | Checkpoint, out: str | os.PathLike, *, outtype: str = "f16",
                    n_layers: int | None = None, name: str | None = None, tokenizer_pre: str | None = None,
                    progress: Progress = SILENT) -> Path:
    """Write `source` (a checkpoint directory) as one GGUF file of float type `outtype`.

    `n_layers` keeps only the first layers (a layer-truncated self-draft). `tokenizer_pre` overrides
    the detected llama.cpp pre-tokenizer name. Writes `out` directly: callers work in a temp dir.
    """
    if outtype not in FLOAT_TYPES:
        raise EdgespecError(f"GGUF conversion writes f32 or f16, not {outtype!r} (quantize afterwards)")
    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    n_keep = ckpt.n_layer if n_layers is None else n_layers
    if not 1 <= n_keep <= ckpt.n_layer:
        raise EdgespecError(f"n_layers must be between 1 and {ckpt.n_layer}, got {n_layers}")
    tok = HFTokenizer.load(ckpt.path)
    pre = tokenizer_pre or tok.llama_cpp_pre()
    tokens, types = tok.tokens_and_types(ckpt.n_vocab)
    plan = list(_plan_tensors(ckpt, n_keep, outtype))

    out = Path(out)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[_ARCH[ckpt.family]])
    try:
        _add_metadata(writer, ckpt, n_keep, outtype, name)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(ckpt.path, load_merges=True, n_vocab=ckpt.n_vocab)
        special.add_to_gguf(writer, quiet=True)
        for flag in ("bos", "eos"):  # say it explicitly: llama.cpp's default for BPE is not Hugging Face's
            if flag not in special.add_special_token:
                getattr(writer, f"add_add_{flag}_token")(False)
        for t in plan:
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(t.dtype), nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        progress.begin(f"writing {out.name}", total=len(plan))
        for t in plan:
            writer.write_tensor_data(np.ascontiguousarray(_tensor_data(ckpt, t), dtype=t.dtype))
            progress.advance(1)
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        progress.end()
    finally:
        writer.close()
        ckpt.close()
    return out


def _add_metadata(w: gguf.GGUFWriter, ckpt: Checkpoint, n_layer: int, outtype: str, name: str | None) -> None:
    from edgespec.exporters import EXPORTER_VERSION

    w.add_type("model")
    w.add_name(name or ckpt.name)
    w.add_string("general.source.exporter", f"edgespec-export {EXPORTER_VERSION}")
    w.add_file_type(int(_FILE_TYPE[outtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(ckpt.n_vocab)
    w.add_context_length(ckpt.context_length)
    w.add_embedding_length(ckpt.n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(ckpt.n_ff)
    w.add_head_count(ckpt.n_head)
    w.add_head_count_kv(ckpt.n_head_kv)
    w.add_layer_norm_rms_eps(ckpt.rms_eps)
    w.add_rope_freq_base(ckpt.rope_theta)
    w.add_rope_dimension_count(ckpt.head_dim)
    if ckpt.head_dim != ckpt.n_embd // ckpt.n_head:
        w.add_key_length(ckpt.head_dim)
        w.add_value_length(ckpt.head_dim)
    scaling = _rope_scaling(ckpt)
    if scaling and scaling["type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))


def _rope_scaling(ckpt: Checkpoint) -> dict | None:
    rs = ckpt.config.get("rope_scaling")
    if not rs:
        return None
    kind = str(rs.get("rope_type") or rs.get("type") or "").lower()
    if kind == "default":
        return None
    if kind == "linear" or (kind == "llama3" and ckpt.family == "llama"):
        return {**rs, "type": kind}
    raise CheckpointError(f"{ckpt.path.name}: rope_scaling {rs} is not supported by the GGUF exporter "
                          "(supported: none, linear, llama3)")


def _llama3_rope_factors(ckpt: Checkpoint) -> np.ndarray:
    """Per-frequency RoPE factors of Llama 3.1-style scaling, which llama.cpp reads from `rope_freqs`."""
    rs = ckpt.config["rope_scaling"]
    dim = ckpt.head_dim
    freqs = 1.0 / (ckpt.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(rs.get("factor", 8.0))
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _plan_tensors(ckpt: Checkpoint, n_keep: int, outtype: str) -> Iterator[PlannedTensor]:
    names = gguf.TensorNameMap(_ARCH[ckpt.family], ckpt.n_layer)
    float_t = np.float32 if outtype == "f32" else np.float16
    scaling = _rope_scaling(ckpt)
    if scaling and scaling["type"] == "llama3":
        yield PlannedTensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None,
                            (ckpt.head_dim // 2,), np.float32)
    ordered = sorted(ckpt.tensors, key=_hf_order)
    for hf_name in ordered:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by llama.cpp from rope.freq_base
        if hf_name == "lm_head.weight" and ckpt.tied_embeddings:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        layer = _layer_of(hf_name)
        if layer is not None and layer >= n_keep:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise CheckpointError(f"{ckpt.path.name}: tensor {hf_name} has no GGUF name for {ckpt.family}; "
                                  "the checkpoint has parts this exporter does not handle")
        shape = ckpt.tensors[hf_name].shape
        yield PlannedTensor(gguf_name, hf_name, shape, float_t if len(shape) > 1 else np.float32)


def _hf_order(name: str) -> tuple:
    layer = _layer_of(name)
    head = 0 if "embed_tokens" in name else 3 if name.startswith("lm_head") else 2 if layer is None else 1
    return (head, layer if layer is not None else -1, name)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _tensor_data(ckpt: Checkpoint, t: PlannedTensor) -> np.ndarray:
    if t.hf_name is None:
        return _llama3_rope_factors(ckpt)
    data = ckpt.tensor(t.hf_name)
    if ckpt.family == "llama":
        if t.hf_name.endswith("self_attn.q_proj.weight"):
            data = _permute_rope(data, ckpt.n_head)
        elif t.hf_name.endswith("self_attn.k_proj.weight"):
            data = _permute_rope(data, ckpt.n_head_kv)
    return data


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from Hugging Face's rotate-half order to llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- tokenizer parity ---------------------------------------------------------------------------

def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - the export extra brings it
        raise EdgespecError("the GGUF export checks its tokenizer with the `tokenizers` package: "
                            "pip install 'edgespec[export]'") from None
    return tokenizers


def check_tokenizer_parity(gguf_path: str | os.PathLike, checkpoint_dir: str | os.PathLike,
                           texts: Sequence[str] = PARITY_TEXTS) -> dict:
    """Tokenize `texts` with llama.cpp (from the GGUF) and with the Hugging Face tokenizer.json.

    Returns {"texts", "tokens", "mismatches", "first_mismatch"}; special tokens are not parsed on
    either side, so this compares ordinary text splitting and merging.
    """
    Tokenizer = _tokenizers().Tokenizer
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    hf = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
    mismatches, first, n_tokens = 0, None, 0
    with LlamaCppRuntime(gguf_path, LlamaCppOptions(n_ctx=64, n_batch=64, n_threads=1, n_gpu_layers=0)) as rt:
        for text in texts:
            ours = rt.tokenize(text, add_special=False, parse_special=False)
            theirs = hf.encode(text, add_special_tokens=False).ids
            n_tokens += len(theirs)
            if ours != theirs:
                mismatches += 1
                if first is None:
                    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                    first = {"text": text[:80], "position": k, "llama_cpp": ours[k:k + 5], "hf": theirs[k:k + 5]}
    return {"texts": len(texts), "tokens": n_tokens, "mismatches": mismatches, "first_mismatch": first}


# --- the whole GGUF step --------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFArtifacts:
    files: dict[str, Path]        # quant -> file, in the order asked for
    tokenizer_pre: str
    tokenizer_parity: dict
    agreement: dict[str, dict]    # quant -> top-1 agreement with the float file (when measured)
    base: str                     # the float type written first and quantized from


# Ordinary text (prose, then code) for quality checks: agreement on it is what generation sees.
QUALITY_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books became "
    "cheaper, literacy spread across Europe, and ideas travelled faster than they ever had before. Within fifty "
    "years, printers in more than two hundred cities had produced millions of volumes.\n\n"
    "def mean(values):\n    \"\"\"Return the arithmetic mean of a non-empty list.\"\"\"\n"
    "    return sum(values) / len(values)\n\n\nprint(mean([1, 2, 3, 4]))\n"
)


def sample_tokens(checkpoint_dir: str | os.PathLike, n: int = 128) -> list[int]:
    """Token ids of QUALITY_TEXT (Hugging Face tokenizer), for quality checks on any format."""
    hf = _tokenizers().Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
    ids = hf.encode(QUALITY_TEXT, add_special_tokens=False).ids
    return ids[:n]


def gguf_agreement(reference: str | os.PathLike, candidate: str | os.PathLike, tokens: Sequence[int],
                   n_threads: int = 1) -> dict:
    """Top-1 agreement of `candidate` with `reference` over the next-token predictions of `tokens`."""
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    options = LlamaCppOptions(n_ctx=max(64, len(tokens)), n_batch=max(64, len(tokens)), n_threads=n_threads,
                              n_gpu_layers=0)
    with LlamaCppRuntime(reference, options) as ref:
        a = ref.decode(tokens, len(tokens))
    with LlamaCppRuntime(candidate, options) as cand:
        b = cand.decode(tokens, len(tokens))
    return {"positions": len(tokens), "top1_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 4),
            "max_abs_logit_diff": round(float(np.abs(a - b).max()), 4)}


# --- every other architecture: llama.cpp's own converter --------------------------------------------

def checkpoint_architecture(path: str | os.PathLike) -> str | None:
    """The architecture a local checkpoint directory names in its config.json (None: none to read)."""
    import json

    config = Path(path) / "config.json"
    try:
        names = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return None
    return names[0] if names else None


def convert_with_llama_cpp(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, *, outtype: str = "f16",
                           progress: Progress = SILENT) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py from the vendored tree (its gguf-py first on PYTHONPATH, so
    the GGUF matches the runtime that reads it), run as a subprocess; its last error line on failure."""
    import subprocess
    import sys

    from edgespec.exporters.llama_source import llama_cpp_source

    if outtype not in FLOAT_TYPES:
        raise EdgespecError(f"GGUF conversion writes f32 or f16, not {outtype!r} (quantize afterwards)")
    src = llama_cpp_source()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(src / "gguf-py"), os.environ.get("PYTHONPATH")) if p)}
    progress.begin(f"converting {Path(checkpoint_dir).name} with llama.cpp's convert_hf_to_gguf.py ({outtype})")
    proc = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint_dir), "--outfile",
                           str(out), "--outtype", outtype], env=env, capture_output=True, text=True)
    progress.end()
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise EdgespecError(f"llama.cpp's converter failed on {checkpoint_dir}: {lines[-1] if lines else proc.returncode}")
    return Path(out)


def _export_with_llama_cpp(source: Path, out_dir: Path, quants: list[str], stem: str, n_threads: int | None,
                           progress: Progress) -> GGUFArtifacts:
    """export_gguf for an architecture our converter does not write: llama.cpp converts to a float
    type, the runtime's quantize writes the rest."""
    from edgespec.runtimes.llamacpp import quantize

    floats = [q for q in quants if q in FLOAT_TYPES]
    base = floats[0] if floats else "f16"
    base_path = convert_with_llama_cpp(source, out_dir / f"{stem}.{base}.gguf", outtype=base, progress=progress)
    files: dict[str, Path] = {}
    for q in quants:
        path = out_dir / f"{stem}.{q}.gguf"
        if q == base:
            files[q] = base_path
        elif q in FLOAT_TYPES:
            files[q] = convert_with_llama_cpp(source, path, outtype=q, progress=progress)
        else:
            progress.begin(f"quantizing {stem} to {q}")
            files[q] = quantize(base_path, path, q, n_threads=n_threads)
            progress.end()
    if base not in quants:
        base_path.unlink(missing_ok=True)
    pre = _gguf_pre(files[quants[0]])
    return GGUFArtifacts(files=files, tokenizer_pre=pre, tokenizer_parity={}, agreement={}, base=base)


def _gguf_pre(path: Path) -> str:
    reader = gguf.GGUFReader(path)
    field = reader.get_field("tokenizer.ggml.pre")
    return field.contents() if field is not None else ""


def export_gguf(source: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike, quants: Sequence[str], *,
                stem: str = "model", n_layers: int | None = None, allow_tokenizer_mismatch: bool = False,
                measure: bool = False, n_threads: int | None = None, progress: Progress = SILENT) -> GGUFArtifacts:
    """Convert to a float GGUF, check the tokenizer, quantize to each of `quants` (e.g. q4_k_m, q8_0, f16).

    Files are `<stem>.<quant>.gguf` in `out_dir`; a float intermediate not asked for is deleted.
    `measure` records each quantized file's top-1 agreement with the float one on sample text.
    """
    from edgespec.runtimes.llamacpp import quantize

    quants = list(dict.fromkeys(quants))
    if not quants:
        raise EdgespecError("no GGUF quantization asked for")
    check_quant_types(quants)
    if isinstance(source, Checkpoint) and source.family == LLAMA_CPP_FAMILY:
        source = source.path
    if not isinstance(source, Checkpoint) and n_layers is None:
        arch = checkpoint_architecture(source)
        if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
            from edgespec.exporters.llama_source import llama_cpp_architectures

            known = llama_cpp_architectures()
            if arch not in known:
                raise CheckpointError(f"{Path(source).name}: architecture {arch!r} is not supported; GGUF export "
                                      f"converts {', '.join(SUPPORTED_ARCHITECTURES)} and the {len(known)} "
                                      "architectures llama.cpp's convert_hf_to_gguf.py knows")
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            return _export_with_llama_cpp(Path(source), out_dir, quants, stem, n_threads, progress)
    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    floats = [q for q in quants if q in FLOAT_TYPES]
    # Quantize from f32 unless every source tensor is f16 already (bf16 can overflow f16's range).
    base = floats[0] if floats else ("f16" if all(t.dtype == "F16" for t in ckpt.tensors.values()) else "f32")
    base_path = out_dir / f"{stem}.{base}.gguf"
    pre = HFTokenizer.load(ckpt.path).llama_cpp_pre()
    convert_to_gguf(ckpt, base_path, outtype=base, n_layers=n_layers, progress=progress)
    parity = check_tokenizer_parity(base_path, ckpt.path)
    if parity["mismatches"] and not allow_tokenizer_mismatch:
        raise EdgespecError(f"llama.cpp tokenizes {parity['mismatches']} of {parity['texts']} check texts differently "
                            f"from the Hugging Face tokenizer (pre-tokenizer {pre!r}; first: {parity['first_mismatch']}); "
                            "the GGUF would not match the model's training")
    files: dict[str, Path] = {}
    for q in quants:
        path = out_dir / f"{stem}.{q}.gguf"
        if q == base:
            files[q] = base_path
            continue
        if q in FLOAT_TYPES:
            convert_to_gguf(ckpt, path, outtype=q, n_layers=n_layers, progress=progress)
        else:
            progress.begin(f"quantizing {stem} to {q}")
            quantize(base_path, path, q, n_threads=n_threads)
            progress.end()
        files[q] = path
    agreement: dict[str, dict] = {}
    if measure:
        progress.begin(f"measuring {stem} quantization quality")
        tokens = sample_tokens(ckpt.path)
        for q, path in files.items():
            if path != base_path:
                agreement[q] = gguf_agreement(base_path, path, tokens)
        progress.end()
    if base not in quants:
        base_path.unlink(missing_ok=True)
    return GGUFArtifacts(files=files, tokenizer_pre=pre, tokenizer_parity=parity, agreement=agreement, base=base)
