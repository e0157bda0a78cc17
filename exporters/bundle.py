"""A target/draft pair exported to every asked-for format, in one directory with a manifest.

    BUNDLE/
      edgespec.json                 the manifest (below)
      gguf/target.<quant>.gguf      llama.cpp
      gguf/draft.<quant>.gguf
      onnx/target/model*.onnx       ONNX Runtime (fp32, int8, int4), with config and tokenizer files
      onnx/draft/...
      onnx/target-layers/           the target as layer graphs (ExportOptions.onnx_layers; runtimes/onnx_layered.py)
      coreml/target.mlpackage       Core ML (prefill / decode / verify functions, KV cache as state)
      coreml/draft.mlpackage
      mlx/target.<quant>/           MLX (mlx_lm.convert: int4, int8 or unquantized fp32/fp16/bf16), an MLX repo each
      mlx/draft.<quant>/
      tokenizer/                    the Hugging Face tokenizer files (for the ONNX and Core ML runtimes)

Everything is written into a temporary directory beside BUNDLE and moved into place with one rename
at the end, so BUNDLE appears complete or not at all; any failure (bad input, a full disk, Ctrl-C)
removes the temporary directory. The pair's tokenizers are compared before any conversion, and the
two GGUFs are checked again in llama.cpp with edgespec.vocab's rules (the result is in the manifest).

Manifest `edgespec.json` (schema 1): formats and their artifacts (file, quant, bytes, sha256),
`files` (every file with bytes and sha256), tokenizer fingerprint and llama.cpp parity, the vocabulary
check, context length, KV geometry of both models, measured quality (GGUF top-1 agreement with the
float file, ONNX logits against transformers, acceptance of the pair), exporter and tool versions,
and `runtimes.llama.cpp` {target, draft}: the files `edgespec generate --target BUNDLE` runs
(`runtimes.mlx` {target, draft}: the directories `--runtime mlx` runs).
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from edgespec import atomic
from edgespec.errors import EdgespecError, VocabMismatchError
from edgespec.exporters import EXPORTER_VERSION
from edgespec.exporters.checkpoint import LLAMA_CPP_FAMILY, Checkpoint, load_checkpoint
from edgespec.exporters.progress import SILENT, Progress
from edgespec.runtimes.formats import BUNDLE_MANIFEST, sha256_file
from edgespec.runtimes.hf_tokenizer import HFTokenizer
from edgespec.vocab import CHECK_FROM_TOKEN_ID, MAX_VOCAB_SIZE_DIFFERENCE

MANIFEST = BUNDLE_MANIFEST
SCHEMA = 1
FORMATS = ("gguf", "onnx", "coreml", "mlx")
DEFAULT_GGUF_QUANTS = ("q4_k_m",)
DEFAULT_ONNX_QUANTS = ("fp32", "int8", "int4")
DEFAULT_COREML_QUANT = "int4"
# Bits per weight on disk, for the free-space check (quantized types carry their block scales).
_BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q6_k": 6.6, "q5_k_m": 5.7, "q5_k_s": 5.5, "q5_0": 5.5,
         "q5_1": 6, "q4_k_m": 4.9, "q4_k_s": 4.6, "q4_0": 4.5, "q4_1": 5, "q3_k_m": 3.9, "q2_k": 3.4,
         "fp32": 32, "int8": 8.3, "int4": 4.6, "fp16": 16}


@dataclass(frozen=True)
class ExportOptions:
    formats: tuple[str, ...] = ("gguf",)
    gguf_quants: tuple[str, ...] = DEFAULT_GGUF_QUANTS
    onnx_quants: tuple[str, ...] = DEFAULT_ONNX_QUANTS
    coreml_quant: str = DEFAULT_COREML_QUANT
    mlx_quants: tuple[str, ...] = ("int4",)  # exporters/mlx_export.DEFAULT_MLX_QUANTS
    coreml_context: int = 2048       # Core ML KV state rows (memory: see kv_geometry)
    coreml_prefill: int = 256        # longest prefill chunk of the Core ML prefill function
    draft_max: int = 4               # Core ML verify function takes draft_max + 1 tokens
    onnx_layers: bool = False        # with onnx: also the target as layer graphs (onnx/target-layers, managed KV)
    self_draft: str | None = None    # "quant[:TYPE]" | "layers[:N]"
    measure: bool = True             # quality and acceptance checks recorded in the manifest
    force: bool = False              # replace an existing bundle at the output path
    check_space: bool = True
    allow_tokenizer_mismatch: bool = False
    n_threads: int | None = None     # quantization threads (checks run on one: see selfdraft.CHECK_THREADS)


def parse_formats(text: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise EdgespecError(f"unknown format {bad[0] if bad else text!r}; use a comma list of {', '.join(FORMATS)}")
    return formats


def parse_quants(text: str | None) -> dict:
    """`--quant` -> {gguf_quants, onnx_quants, coreml_quant, mlx_quants}. Entries are comma separated: a
    GGUF type (q4_k_m, q8_0, f16, ...), `int8` / `int4` (ONNX, Core ML and MLX), `fp32` (ONNX, MLX),
    `fp16` (Core ML, MLX), `bf16` (GGUF, MLX), or `FORMAT:TYPE` to aim at one format (gguf:q8_0,
    onnx:int8, coreml:int4, mlx:int8)."""
    from edgespec.exporters.coreml_export import COREML_QUANTS
    from edgespec.exporters.gguf_export import gguf_quant_types
    from edgespec.exporters.mlx_export import DEFAULT_MLX_QUANTS, MLX_QUANTS
    from edgespec.exporters.onnx_export import ONNX_QUANTS

    gguf, onnx, coreml, mlx = [], [], [], []
    for raw in (text or "").split(","):
        item = raw.strip().lower()
        if not item:
            continue
        fmt, _, q = item.rpartition(":")
        if fmt and fmt not in FORMATS:
            raise EdgespecError(f"unknown format {fmt!r} in --quant {raw.strip()!r}; use gguf:, onnx:, coreml: or mlx:")
        known_here = {"gguf": gguf_quant_types(), "onnx": ONNX_QUANTS, "coreml": COREML_QUANTS, "mlx": MLX_QUANTS}
        targets = [fmt] if fmt else [f for f in FORMATS if q in known_here[f]]
        if not targets or any(q not in known_here[f] for f in targets):
            where = f" for {fmt}" if fmt else ""
            raise EdgespecError(f"unknown quantization {q!r}{where}; GGUF: {', '.join(gguf_quant_types())}; "
                                f"ONNX: {', '.join(ONNX_QUANTS)}; Core ML: {', '.join(COREML_QUANTS)}; "
                                f"MLX: {', '.join(MLX_QUANTS)}")
        for f in targets:
            {"gguf": gguf, "onnx": onnx, "coreml": coreml, "mlx": mlx}[f].append(q)
    if len(set(coreml)) > 1:
        raise EdgespecError(f"Core ML takes one weight type per package, got {', '.join(coreml)}")
    return {"gguf_quants": tuple(dict.fromkeys(gguf)) or DEFAULT_GGUF_QUANTS,
            "onnx_quants": tuple(dict.fromkeys(onnx)) or DEFAULT_ONNX_QUANTS,
            "coreml_quant": coreml[0] if coreml else DEFAULT_COREML_QUANT,
            "mlx_quants": tuple(dict.fromkeys(mlx)) or DEFAULT_MLX_QUANTS}


# --- the export -----------------------------------------------------------------------------------

def export_bundle(target: str | os.PathLike, out: str | os.PathLike, draft: str | os.PathLike | None = None,
                  options: ExportOptions = ExportOptions(), progress: Progress = SILENT) -> Path:
    """Export the pair to the bundle directory `out`; return its path. Nothing is left behind on failure."""
    out = Path(out).expanduser().absolute()
    for f in options.formats:
        if f not in FORMATS:
            raise EdgespecError(f"unknown format {f!r}; use {', '.join(FORMATS)}")
    if draft is not None and options.self_draft:
        raise EdgespecError("give either --draft or --self-draft, not both")
    _check_out(out, options.force)
    from edgespec.exporters.gguf_export import check_quant_types

    check_quant_types(options.gguf_quants)
    if "mlx" in options.formats:  # before any other format's work: one line when MLX is missing
        from edgespec.exporters.mlx_export import check_mlx_quants
        from edgespec.runtimes.mlx import need_mlx

        check_mlx_quants(options.mlx_quants)
        need_mlx()
    progress.begin("checking the checkpoints")
    gguf_only = set(options.formats) == {"gguf"}
    target_ckpt = load_checkpoint(target, gguf_only=gguf_only)
    draft_ckpt = load_checkpoint(draft, gguf_only=gguf_only) if draft is not None else None
    by_llama_cpp = target_ckpt.family == LLAMA_CPP_FAMILY
    if by_llama_cpp and options.self_draft and not options.self_draft.startswith("quant"):
        raise EdgespecError(f"--self-draft layers needs our own converter ({target_ckpt.architecture} goes through "
                            "llama.cpp's); use --self-draft quant or --draft")
    t_tok = HFTokenizer.load(target_ckpt.path)
    if draft_ckpt is not None:
        difference = tokenizer_difference(t_tok, HFTokenizer.load(draft_ckpt.path))
        if difference:
            raise VocabMismatchError(f"the draft's tokenizer does not match the target's: {difference}; "
                                     "export a draft trained with the target's tokenizer, or use --self-draft")
    if "gguf" in options.formats and not by_llama_cpp:  # (llama.cpp's converter checks its own)
        t_tok.llama_cpp_pre()  # fail now, not after the conversion, on a tokenizer llama.cpp cannot split
    self_draft = None
    if options.self_draft:
        from edgespec.exporters.selfdraft import parse_self_draft

        self_draft = parse_self_draft(options.self_draft, target_ckpt, options.gguf_quants[0])
    progress.end()

    created = _make_parents(out.parent)
    if options.check_space:
        _check_space(out.parent, target_ckpt, draft_ckpt, self_draft, options)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = _export_into(work, target_ckpt, draft_ckpt, t_tok, self_draft, options, progress)
        progress.begin("hashing files and writing the manifest")
        manifest["files"] = _file_table(work)
        _fill_artifact_hashes(manifest)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        _fsync_tree(work)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # mkdtemp made it private; a bundle is an ordinary directory
        progress.end()
        _move_into_place(work, out)
    except BaseException as exc:
        # Look at the disk before the cleanup frees it: a full disk shows up as ENOSPC, as a short
        # write (numpy's tofile), or as llama.cpp failing to write a quantized file.
        full = isinstance(exc, (OSError, EdgespecError)) and (
            getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or _nearly_full(out.parent))
        shutil.rmtree(work, ignore_errors=True)
        _remove_empty(created)
        if full:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise EdgespecError(f"no space left on the device of {out.parent} while exporting ({detail}); "
                                "nothing was kept; free some space or choose another --out") from None
        raise
    finally:
        target_ckpt.close()
        if draft_ckpt is not None:
            draft_ckpt.close()
    return out


def tokenizer_difference(target: HFTokenizer, draft: HFTokenizer) -> str | None:
    """Where two checkpoints' tokenizers differ in a way that breaks speculation, else None.

    The rule is llama.cpp's (edgespec.vocab): same splitting, size within 128, same text for every id
    both have from id 5 on. Checked before any conversion so a bad pair fails in seconds.
    """
    if target.fingerprint() == draft.fingerprint():
        return None
    if (target.data.get("pre_tokenizer"), target.data.get("normalizer")) != \
            (draft.data.get("pre_tokenizer"), draft.data.get("normalizer")):
        return "their pre-tokenizers or normalizers differ, so the same text splits differently"
    nt, nd = target.vocab_size(), draft.vocab_size()
    if abs(nt - nd) > MAX_VOCAB_SIZE_DIFFERENCE:
        return f"the draft has {nd} tokens, the target {nt} (more than {MAX_VOCAB_SIZE_DIFFERENCE} apart)"
    tt, _ = target.tokens_and_types(nt)
    td, _ = draft.tokens_and_types(nd)
    for i in range(CHECK_FROM_TOKEN_ID, min(nt, nd)):
        if tt[i] != td[i]:
            return f"token {i} is {tt[i]!r} in the target but {td[i]!r} in the draft"
    mt = target.data["model"]["merges"]
    md = draft.data["model"]["merges"]
    if mt != md:
        return "their BPE merges differ, so the same text encodes to different ids"
    return None


def _export_into(work: Path, target: Checkpoint, draft: Checkpoint | None, tok: HFTokenizer, self_draft,
                 options: ExportOptions, progress: Progress) -> dict:
    import edgespec
    from edgespec.exporters.selfdraft import write_truncated_checkpoint

    derived_src = None
    if self_draft is not None and self_draft.method == "layers":
        progress.begin(f"self-draft: taking the first {self_draft.n_layers} of {target.n_layer} layers")
        derived_src = write_truncated_checkpoint(target, self_draft.n_layers, work / ".selfdraft-checkpoint")
        draft = load_checkpoint(derived_src)
        progress.end()

    manifest: dict = {
        "schema": SCHEMA,
        "exporter": {"name": "edgespec-export", "version": EXPORTER_VERSION, "edgespec": edgespec.__version__,
                     "tools": _tool_versions(options.formats)},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": _model_entry(target, source=str(target.path)),
        "draft": None,
        "self_draft": self_draft.to_dict() if self_draft else None,
        "context_length": target.context_length,
        "kv_geometry": {"target": target.kv_geometry()},
        "tokenizer": {"fingerprint": tok.fingerprint(), "kind": "byte-level BPE"},
        "vocab_check": None,
        "formats": {},
        "quality": {},
        "runtimes": {},
    }
    if draft is not None:
        manifest["draft"] = _model_entry(draft, source="derived from the target" if derived_src else str(draft.path))
        manifest["kv_geometry"]["draft"] = draft.kv_geometry()
    elif self_draft is not None:  # quant: same geometry as the target
        manifest["draft"] = {**_model_entry(target, source="derived from the target"), "derived": "quant"}
        manifest["kv_geometry"]["draft"] = target.kv_geometry()

    if "gguf" in options.formats:
        _export_gguf_pair(work, target, draft, self_draft, options, progress, manifest)
    if "onnx" in options.formats:
        _export_onnx_pair(work, target, draft, self_draft, options, progress, manifest)
    if "coreml" in options.formats:
        _export_coreml_pair(work, target, draft, self_draft, options, progress, manifest)
    if "mlx" in options.formats:
        _export_mlx_pair(work, target, draft, self_draft, options, progress, manifest)

    from edgespec.exporters.onnx_export import copy_tokenizer_files

    manifest["tokenizer"]["files"] = [f"tokenizer/{n}" for n in copy_tokenizer_files(target.path, work / "tokenizer")]
    if derived_src is not None:
        draft.close()
        shutil.rmtree(derived_src)
    return manifest


def _model_entry(ckpt: Checkpoint, source: str) -> dict:
    return {"name": ckpt.name, "source": source, "architecture": ckpt.architecture, "family": ckpt.family,
            "n_params": ckpt.n_params(), "n_layer": ckpt.n_layer, "n_vocab": ckpt.n_vocab,
            "context_length": ckpt.context_length, "tied_embeddings": ckpt.tied_embeddings}


def _rel(work: Path, path: Path) -> str:
    return path.relative_to(work).as_posix()


def _export_gguf_pair(work, target, draft, self_draft, options, progress, manifest) -> None:
    from edgespec.exporters.gguf_export import export_gguf
    from edgespec.exporters.selfdraft import measure_acceptance

    gdir = work / "gguf"
    quants = list(options.gguf_quants)
    draft_quant = self_draft.gguf_quant if self_draft is not None and self_draft.method == "quant" else None
    t_quants = quants + ([draft_quant] if draft_quant and draft_quant not in quants else [])
    t = export_gguf(target, gdir, t_quants, stem="target", measure=options.measure,
                    allow_tokenizer_mismatch=options.allow_tokenizer_mismatch, n_threads=options.n_threads,
                    progress=progress)
    entry = {"target": [_artifact(work, p, q) for q, p in t.files.items() if q in quants], "draft": [],
             "tokenizer_pre": t.tokenizer_pre}
    manifest["tokenizer"]["llama_cpp_pre"] = t.tokenizer_pre
    manifest["tokenizer"]["llama_cpp_parity"] = t.tokenizer_parity
    quality = {"target": t.agreement, "reference": f"{t.base} GGUF of the same model"}
    draft_files: dict[str, Path] = {}
    if draft is not None:
        d = export_gguf(draft, gdir, quants, stem="draft", measure=options.measure,
                        allow_tokenizer_mismatch=options.allow_tokenizer_mismatch, n_threads=options.n_threads,
                        progress=progress)
        draft_files = d.files
        quality["draft"] = d.agreement
    elif draft_quant:
        src = t.files[draft_quant]
        dst = gdir / f"draft.{draft_quant}.gguf"
        if draft_quant in quants:
            shutil.copyfile(src, dst)
        else:
            os.replace(src, dst)
        draft_files = {draft_quant: dst}
        quality["draft"] = {draft_quant: t.agreement.get(draft_quant)}
    entry["draft"] = [_artifact(work, p, q) for q, p in draft_files.items()]
    manifest["formats"]["gguf"] = entry
    manifest["quality"]["gguf"] = quality
    t_default = t.files[quants[0]]
    d_default = next(iter(draft_files.values()), None)
    manifest["runtimes"]["llama.cpp"] = {"target": _rel(work, t_default),
                                        "draft": _rel(work, d_default) if d_default else None}
    if d_default is not None:
        progress.begin("checking the pair's vocabularies in llama.cpp")
        manifest["vocab_check"] = _vocab_check(t_default, d_default)
        progress.end()
        if not manifest["vocab_check"]["compatible"]:
            raise VocabMismatchError(f"the exported draft's vocabulary does not match the target's in llama.cpp: "
                                     f"{manifest['vocab_check']['difference']}")
        if options.measure:
            progress.begin("measuring the pair's acceptance (llama.cpp, greedy, draft_max 4)")
            acceptance = measure_acceptance(t_default, d_default)
            manifest["quality"]["acceptance"] = {"target": _rel(work, t_default), "draft": _rel(work, d_default),
                                                 **acceptance}
            progress.end()
            progress.note(f"draft acceptance on the sample: {acceptance['acceptance_rate']:.2f} "
                          f"(mean accepted length {acceptance['mean_accepted_length']:.2f})")


def _vocab_check(target_gguf: Path, draft_gguf: Path) -> dict:
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime
    from edgespec.vocab import vocab_difference

    options = LlamaCppOptions(n_ctx=64, n_batch=64, n_threads=1, n_gpu_layers=0)
    with LlamaCppRuntime(target_gguf, options) as t, LlamaCppRuntime(draft_gguf, options) as d:
        difference = vocab_difference(t, d)
        return {"compatible": difference is None, "difference": difference, "n_vocab": [t.n_vocab, d.n_vocab],
                "checked_with": "llama.cpp, edgespec.vocab rules (llama.cpp common/speculative.cpp)"}


def _export_onnx_pair(work, target, draft, self_draft, options, progress, manifest) -> None:
    from edgespec.exporters.gguf_export import sample_tokens
    from edgespec.exporters.onnx_export import export_onnx, hf_logits, onnx_quality

    quants = list(options.onnx_quants)
    derived_quant = self_draft is not None and self_draft.method == "quant"
    t_quants = quants + (["int4"] if derived_quant and "int4" not in quants else [])
    t = export_onnx(target, work / "onnx" / "target", t_quants, progress=progress)
    entry = {"target": [_artifact(work, p, q) for q, p in t.files.items() if q in quants], "draft": [],
             "inputs": t.inputs, "outputs": t.outputs}
    quality = {}
    if options.measure:
        progress.begin("measuring ONNX logits against transformers")
        tokens = sample_tokens(target.path, 64)
        quality["target"] = onnx_quality(t, hf_logits(target.path, tokens), tokens)
        progress.end()
    if draft is not None:
        d = export_onnx(draft, work / "onnx" / "draft", quants, progress=progress)
        entry["draft"] = [_artifact(work, p, q) for q, p in d.files.items()]
        if options.measure:
            tokens = sample_tokens(draft.path, 64)
            quality["draft"] = onnx_quality(d, hf_logits(draft.path, tokens), tokens)
    elif derived_quant:
        entry["draft"] = [_artifact(work, t.files["int4"], "int4")]
    quality["reference"] = "transformers fp32 logits of the same checkpoint"
    if options.onnx_layers:  # the runtime of runtimes/onnx_layered.py: KV offloading needs per-layer graphs
        from edgespec.exporters.onnx_layers import export_onnx_layers

        layers = export_onnx_layers(target, work / "onnx" / "target-layers", check=options.measure, progress=progress)
        entry["target_layers"] = {"directory": _rel(work, layers.directory), "group_size": 1,
                                  "manifest": _rel(work, layers.directory / "layers.json")}
        if layers.check:
            quality["target_layers"] = layers.check
    manifest["formats"]["onnx"] = entry
    manifest["quality"]["onnx"] = quality


def _export_coreml_pair(work, target, draft, self_draft, options, progress, manifest) -> None:
    from edgespec.exporters.coreml_export import describe_package, export_coreml

    cdir = work / "coreml"
    cdir.mkdir(parents=True, exist_ok=True)
    kw = dict(max_context=options.coreml_context, prefill_max=options.coreml_prefill, draft_max=options.draft_max,
              progress=progress)
    t = export_coreml(target, cdir / "target.mlpackage", quant=options.coreml_quant, **kw)
    desc = describe_package(t.path)
    entry = {"target": [_artifact(work, t.path, t.quant)], "draft": [],
             "functions": {name: {"inputs": [i["name"] for i in fn["inputs"]],
                                  "outputs": [o["name"] for o in fn["outputs"]],
                                  "states": [s["name"] for s in fn["states"]],
                                  "quantized_weights": fn["quantized_weights"]} for name, fn in desc["functions"].items()},
             "max_context": t.max_context, "prefill_max": t.prefill_max, "verify_tokens": t.verify_tokens,
             "note": None}
    if draft is not None:
        d = export_coreml(draft, cdir / "draft.mlpackage", quant=options.coreml_quant, **kw)
        entry["draft"] = [_artifact(work, d.path, d.quant)]
    elif self_draft is not None and self_draft.method == "quant":
        if options.coreml_quant == "int4":
            entry["note"] = "no Core ML self-draft: int4 is the lowest linear weight type, and the target has it"
        else:
            d = export_coreml(target, cdir / "draft.mlpackage", quant="int4", **kw)
            entry["draft"] = [_artifact(work, d.path, d.quant)]
    manifest["formats"]["coreml"] = entry


def _export_mlx_pair(work, target, draft, self_draft, options, progress, manifest) -> None:
    from edgespec.exporters.mlx_export import export_mlx

    mdir = work / "mlx"
    quants = list(options.mlx_quants)
    t = export_mlx(target, mdir, quants, stem="target", measure=options.measure, progress=progress)
    entry = {"target": [_artifact(work, p, q) for q, p in t.files.items()], "draft": [], "note": None}
    quality = {"target": t.agreement, "reference": "the checkpoint's own float weights on MLX"}
    draft_files: dict = {}
    if draft is not None:
        d = export_mlx(draft, mdir, quants, stem="draft", measure=options.measure, progress=progress)
        draft_files, quality["draft"] = d.files, d.agreement
    elif self_draft is not None and self_draft.method == "quant":  # the target at MLX's fewest bits
        if quants[0] == "int4":
            entry["note"] = "no MLX self-draft: int4 is the fewest bits exported, and the target has it"
        else:
            d = export_mlx(target, mdir, ["int4"], stem="draft", measure=options.measure, progress=progress)
            draft_files, quality["draft"] = d.files, d.agreement
    entry["draft"] = [_artifact(work, p, q) for q, p in draft_files.items()]
    manifest["formats"]["mlx"] = entry
    manifest["quality"]["mlx"] = quality
    d_default = next(iter(draft_files.values()), None)
    manifest["runtimes"]["mlx"] = {"target": _rel(work, t.files[quants[0]]),
                                   "draft": _rel(work, d_default) if d_default is not None else None}


# --- files, hashes, moving --------------------------------------------------------------------------

def _artifact(work: Path, path: Path, quant: str) -> dict:
    return {"file": _rel(work, path), "quant": quant}


def _file_table(work: Path) -> dict[str, dict]:
    return {_rel(work, p): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(work.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _fill_artifact_hashes(manifest: dict) -> None:
    files = manifest["files"]
    for fmt in manifest["formats"].values():
        for role in ("target", "draft"):
            for art in fmt.get(role, []):
                name = art["file"]
                if name in files:  # a single file
                    art["bytes"], art["sha256"] = files[name]["bytes"], files[name]["sha256"]
                    extra = [k for k in files if k.startswith(name + "_data") or k.startswith(name + ".data")]
                    if extra:  # ONNX external data travels with its model
                        art["external_data"] = extra
                        art["bytes"] += sum(files[k]["bytes"] for k in extra)
                else:  # a directory (.mlpackage)
                    inside = {k: v for k, v in files.items() if k.startswith(name + "/")}
                    art["bytes"] = sum(v["bytes"] for v in inside.values())
                    h = hashlib.sha256()
                    for k in sorted(inside):
                        h.update(f"{k[len(name) + 1:]}\0{inside[k]['sha256']}\n".encode())
                    art["sha256"] = h.hexdigest()


def verify_bundle(bundle: str | os.PathLike) -> list[str]:
    """Recompute every file's size and sha256; return the problems found (empty: the bundle is intact)."""
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    problems = []
    for name, info in manifest.get("files", {}).items():
        path = bundle / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != info["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {info['bytes']}")
        elif sha256_file(path) != info["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems


def read_manifest(bundle: str | os.PathLike) -> dict:
    path = Path(bundle) / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgespecError(f"{bundle} is not an edgespec bundle (no {MANIFEST})") from None
    except json.JSONDecodeError as exc:
        raise EdgespecError(f"{path} is corrupt ({exc}); export the bundle again") from None


def _check_out(out: Path, force: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise EdgespecError(f"--out {out} is a file; give a directory path for the bundle")
        is_bundle = (out / MANIFEST).is_file()
        if not force:
            what = "a bundle" if is_bundle else "a directory"
            raise EdgespecError(f"{out} already exists ({what}); use --force to replace a bundle, or another --out")
        if not is_bundle and any(out.iterdir()):
            raise EdgespecError(f"{out} is a non-empty directory that is not an edgespec bundle; "
                                "--force only replaces bundles; choose another --out")


def _move_into_place(work: Path, out: Path) -> None:
    """The finished bundle takes its name; a crash at any point leaves the old bundle or the new one there."""
    if out.exists() and atomic.exchange(work, out):  # --force: one atomic swap; `work` now holds the old bundle
        shutil.rmtree(work, ignore_errors=True)
    elif out.exists():  # no atomic swap here: a moment without a bundle under `out` (the old one beside it)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        try:
            os.replace(work, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)
    atomic.fsync_dir(out.parent)


def _make_parents(parent: Path) -> list[Path]:
    created = []
    p = parent
    while not p.exists():
        created.append(p)
        p = p.parent
    parent.mkdir(parents=True, exist_ok=True)
    return created


def _remove_empty(created: list[Path]) -> None:
    for p in created:  # deepest first
        try:
            p.rmdir()
        except OSError:
            pass


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def estimate_bytes(target: Checkpoint, draft: Checkpoint | None, self_draft, options: ExportOptions) -> int:
    """Peak disk use of an export: every output, plus the float intermediates that exist meanwhile."""
    def model_bytes(n_params: int) -> int:
        total = 0
        if "gguf" in options.formats:
            base = 16 if all(t.dtype == "F16" for t in target.tensors.values()) else 32
            total += n_params * (base + sum(_BITS[q] for q in options.gguf_quants if q not in ("f32", "f16"))) / 8
        if "onnx" in options.formats:
            total += n_params * (32 + sum(_BITS[q] for q in options.onnx_quants if q != "fp32")) / 8
            if options.onnx_layers:  # fp32 layer graphs (a tied embedding is written twice: embed and head)
                total += n_params * 4
        if "coreml" in options.formats:
            total += n_params * 2 * _BITS[options.coreml_quant] / 8  # parts, then the merged package
        if "mlx" in options.formats:
            total += n_params * sum(_BITS[q] for q in options.mlx_quants) / 8
        return int(total)

    need = model_bytes(target.n_params())
    if draft is not None:
        need += model_bytes(draft.n_params())
    elif self_draft is not None:
        need += target.n_params() * (self_draft.n_layers or target.n_layer) // target.n_layer * 2
    return int(need * 1.1) + (16 << 20)


def _check_space(parent: Path, target, draft, self_draft, options) -> None:
    need = estimate_bytes(target, draft, self_draft, options)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise EdgespecError(f"not enough disk space at {parent}: this export needs about {need / 1e9:.2f} GB, "
                            f"{free / 1e9:.2f} GB are free; free some space or choose another --out")


def _nearly_full(parent: Path) -> bool:
    try:
        return shutil.disk_usage(parent).free < (4 << 20)
    except OSError:
        return False


def _tool_versions(formats: Sequence[str]) -> dict:
    from importlib import metadata

    names = ["gguf", "llama-cpp-python"]
    if "onnx" in formats:
        names += ["optimum-onnx", "onnxruntime", "onnx", "transformers", "torch"]
    if "coreml" in formats:
        names += ["coremltools", "torch"]
    if "mlx" in formats:
        names += ["mlx", "mlx-lm"]
    out = {}
    for n in dict.fromkeys(names):
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out
