"""Hugging Face checkpoint -> MLX repo directories (what `--runtime mlx` loads), through mlx-lm's own
converter, `mlx_lm.convert`: 4- and 8-bit affine quantization (groups of 64 weights with a scale and
a bias each, as mlx-community ships them) or the weights unquantized in a float dtype.

Each directory is an MLX repo as `mlx_lm.convert` writes it (config.json naming the quantization,
model*.safetensors), with the checkpoint's own tokenizer files copied over the ones mlx-lm re-saves
through transformers, so the token ids are those of the checkpoint byte for byte.

Needs the `mlx` extra (mlx, mlx-lm); the torch toolchain of the other formats is not used.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint, load_checkpoint
from edgespec.exporters.progress import SILENT, Progress

# quant -> mlx_lm.convert arguments. int4/int8: affine, groups of 64 (mlx-lm's and mlx-community's
# default); fp32/fp16/bf16: unquantized, cast to that dtype.
MLX_QUANTS = {
    "int4": {"quantize": True, "q_bits": 4, "q_group_size": 64},
    "int8": {"quantize": True, "q_bits": 8, "q_group_size": 64},
    "fp32": {"dtype": "float32"},
    "fp16": {"dtype": "float16"},
    "bf16": {"dtype": "bfloat16"},
}
DEFAULT_MLX_QUANTS = ("int4",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


@dataclass(frozen=True)
class MlxArtifacts:
    files: dict[str, Path]         # quant -> MLX repo directory
    agreement: dict[str, dict]     # quant -> top-1 agreement with the checkpoint's float weights on MLX


def check_mlx_quants(quants: Sequence[str]) -> None:
    bad = [q for q in quants if q not in MLX_QUANTS]
    if bad:
        raise EdgespecError(f"unknown MLX quantization {bad[0]!r}; use one of {', '.join(MLX_QUANTS)}")


def export_mlx(source: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike, quants: Sequence[str], *,
               stem: str = "model", measure: bool = False, progress: Progress = SILENT) -> MlxArtifacts:
    """Convert to one MLX repo directory per quant, `<out_dir>/<stem>.<quant>/`. `measure` records each
    one's top-1 agreement with the checkpoint itself run on MLX (its own float weights) on sample text."""
    from edgespec.runtimes.mlx import need_mlx

    quants = list(dict.fromkeys(quants))
    if not quants:
        raise EdgespecError("no MLX quantization asked for")
    check_mlx_quants(quants)
    need_mlx()
    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for q in quants:
        path = out_dir / f"{stem}.{q}"
        progress.begin(f"MLX: converting {stem} to {q} (mlx_lm.convert)")
        convert_checkpoint(ckpt.path, path, q)
        progress.end()
        files[q] = path
    agreement: dict[str, dict] = {}
    if measure:
        progress.begin(f"measuring {stem} MLX quantization quality")
        agreement = {q: mlx_agreement(ckpt.path, path) for q, path in files.items()}
        progress.end()
    return MlxArtifacts(files=files, agreement=agreement)


def convert_checkpoint(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, quant: str) -> Path:
    """One `mlx_lm.convert` run into `out` (which must not exist), the checkpoint's tokenizer files kept."""
    from mlx_lm import convert

    check_mlx_quants([quant])
    src, out = Path(checkpoint_dir), Path(out)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its [INFO] lines; the CLI's stdout carries the path
            convert(str(src), str(out), **MLX_QUANTS[quant])
    except Exception as exc:  # mlx-lm raises ValueError, KeyError, ... on what it cannot convert
        shutil.rmtree(out, ignore_errors=True)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise EdgespecError(f"mlx_lm.convert cannot convert {src.name} to {quant} ({reason})") from None
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def mlx_agreement(reference_dir: Path, candidate_dir: Path, n_tokens: int = 128) -> dict:
    """Top-1 agreement of `candidate_dir` with `reference_dir` over the next-token predictions of sample text."""
    from edgespec.exporters.gguf_export import sample_tokens
    from edgespec.runtimes.mlx import MlxOptions, MlxRuntime

    tokens = sample_tokens(reference_dir, n_tokens)
    options = MlxOptions(n_ctx=max(64, len(tokens)))
    with MlxRuntime(reference_dir, options) as ref:
        a = ref.decode(tokens, len(tokens))
    with MlxRuntime(candidate_dir, options) as cand:
        b = cand.decode(tokens, len(tokens))
    return {"positions": len(tokens), "top1_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 4),
            "max_abs_logit_diff": round(float(np.abs(a - b).max()), 4)}
