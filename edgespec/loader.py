"""Model names in, runtimes out: the one place a target and a draft are found and loaded.

A name is a catalog name, a file path, `hf:...`, `ollama:...`, `lmstudio:...` or an exported bundle
directory (models/store.py's `SOURCES` say which file each means), or None for the default model
(`catalog.DEFAULT_MODEL`, which comes with its catalog draft unless a draft is named); a draft may
also be `auto` (an installed model whose vocabulary matches the target's). The runtime decides which
of a bundle's files load:

* llamacpp: GGUF files through llama.cpp; one sequence per runtime (a target with room for token-tree
  branches when it has a draft), or `n_seq` sequences sharing one context (`serve --parallel`, the
  cloud verifier's sessions);
* onnx: a bundle's ONNX target and draft (or ONNX export directories), optionally the target's layer
  graphs with part of the KV in a file (`kv_resident`);
* coreml: a bundle's Core ML packages (macOS 15+);
* mlx: a Hugging Face checkpoint directory, an MLX repo (`hf:OWNER/REPO` fetched whole into the
  Hugging Face cache) or a bundle's MLX target and draft (export --format mlx), run by mlx-lm
  (Metal on a Mac, the CPU backend elsewhere).

Everything that loads models (Engine.load, the CLI, the server, the slots, the memory planner, the
cloud client and verifier) calls this module; runtimes themselves only ever see paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.models import bundles, catalog, store
from edgespec.models.catalog import DEFAULT_MODEL

RUNTIMES = ("llamacpp", "onnx", "coreml", "mlx")
SLOT_RUNTIMES = ("llamacpp", "mlx")  # those holding several sequences (serve --parallel): load_slots
TREE_BRANCHES = 4  # sequences a target may use to verify a token tree (main chain + 3 siblings)

Name = str | os.PathLike


@dataclass(frozen=True)
class LoadOptions:
    runtime: str = "llamacpp"          # llamacpp | onnx | coreml | mlx
    n_ctx: int = 4096                  # 0 = the model's training context (coreml: fixed at export)
    n_threads: int | None = None       # None = physical cores
    n_gpu_layers: int | None = None    # llamacpp; None = all layers where a GPU build has a GPU, else 0
    flash_attn: bool | None = None     # llamacpp; None = runtimes.base.flash_attention decides
    type_k: str = "f16"                # llamacpp KV cache types
    type_v: str = "f16"
    offload_kqv: bool = True           # llamacpp: the KV cache on the GPU with the offloaded layers
    verbose: bool = False              # the runtime's own log
    trees: bool = True                 # llamacpp: a target with a draft gets room for TREE_BRANCHES sequences
    onnx_quant: str = "auto"           # onnx: auto = fp32, else int8, else int4
    onnx_provider: str = "auto"        # onnx: see runtimes/onnxrt.py
    kv_resident: int | str | None = None  # onnx: e.g. "64M": the target's layer graphs, that much KV in memory
    n_batch: int = 512                 # mlx: most tokens one pass evaluates

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise EdgespecError(f"unknown runtime {self.runtime!r}; use llamacpp, onnx, coreml or mlx")

    def llamacpp(self):
        """The llama.cpp options these say (the GPU layers detected when not given)."""
        from edgespec.machine.hardware import resolve_gpu_layers
        from edgespec.runtimes.llamacpp import LlamaCppOptions

        return LlamaCppOptions(n_ctx=self.n_ctx, n_threads=self.n_threads,
                               n_gpu_layers=resolve_gpu_layers(self.n_gpu_layers), flash_attn=self.flash_attn,
                               type_k=self.type_k, type_v=self.type_v, offload_kqv=self.offload_kqv,
                               verbose=self.verbose)


# --- names ---------------------------------------------------------------------------------------

def resolve(name: Name | None, pull_if_missing: bool = True) -> Path:
    """The model file a name means for llama.cpp (None: the default model), pulled on first use."""
    return store.resolve(DEFAULT_MODEL if name is None else name, pull_if_missing)


def model_id(target: Name | None) -> str:
    """The id clients name the model by: its catalog or store name (also for the cached file of a
    catalog model), or else its file name without .gguf."""
    if target is None:
        return DEFAULT_MODEL
    target = str(target)
    if target in catalog.names() or store.source_of(target).prefix:  # hf:, ollama:, lmstudio: names as given
        return target
    path = Path(target).expanduser().resolve()
    for entry in catalog.entries():
        if store.cached_path(entry).resolve() == path:
            return entry.name
    return path.name.removesuffix(".gguf")


def choose_draft(target: Name | None, draft: Name | None, *, mode: str | None = None,
                 notify: Callable[[str], None] | None = None) -> Name | None:
    """The draft to load: `auto` becomes the installed model whose vocabulary matches the target's
    (said through `notify`); with no target and no draft, the default model's catalog draft (the
    default is a pair, whatever the mode, as a bundle brings its own draft); with `mode` "draft" and
    no draft, a catalog target's catalog pair."""
    if target is None and draft is None:
        return catalog.get(DEFAULT_MODEL).draft
    if draft == "auto":
        from edgespec.models.pairs import auto_draft

        name, path = auto_draft(None if target is None else str(target))
        if notify:
            notify(f"draft auto: {name} ({path}): its vocabulary matches the target's")
        return name
    if draft is None and mode == "draft" and target in catalog.names():
        return catalog.get(str(target)).draft
    return draft


def resolve_onnx(name: Name, quant: str = "auto") -> Path:
    """What the ONNX runtime loads: a bundle's ONNX target file (by `quant`: auto = fp32, else int8,
    else int4), or an ONNX export directory / .onnx file as is (the runtime picks the quant file)."""
    path = Path(name).expanduser()
    if bundles.is_bundle(path):
        return bundles.onnx(path, "target", quant)
    if path.exists():
        return path
    if str(name) in catalog.names():
        raise ModelFileError(f"{name} is a catalog GGUF model, which only the llama.cpp runtime runs; "
                             "the ONNX runtime needs an export: `edgespec export CHECKPOINT --format onnx`")
    raise ModelFileError(f"ONNX model not found: {name} (give a bundle, an ONNX export directory "
                         "or an .onnx file)")


def resolve_onnx_layers(name: Name) -> Path:
    """The target's layer graphs (managed KV): a bundle's onnx/target-layers, or a layered export directory."""
    from edgespec.runtimes.formats import LAYERS_MANIFEST

    path = Path(name).expanduser()
    if bundles.is_bundle(path):
        path = bundles.onnx_layers(path)
    if not (path / LAYERS_MANIFEST).is_file():
        raise ModelFileError(f"{name} is not a layered ONNX export (no {LAYERS_MANIFEST}); export one with "
                             "`edgespec export ... --format onnx --onnx-layers`")
    return path


# --- runtimes ------------------------------------------------------------------------------------

def load_pair(target: Name | None = None, draft: Name | None = None, options: LoadOptions = LoadOptions()):
    """(target runtime, draft runtime or None) for `Engine(target, draft)`. Without a draft, a bundle's
    own draft in the runtime's format, or the default model's pair; `auto` as in `choose_draft`."""
    if options.runtime == "onnx":
        return _onnx_pair(target, draft, options)
    if options.runtime == "coreml":
        return _coreml_pair(target)
    if options.runtime == "mlx":
        return _mlx_pair(target, draft, options)
    draft = bundles.gguf_draft(target) if draft is None and target is not None else choose_draft(target, draft)
    llama = options.llamacpp()
    # With trees on, the target gets room for their branches (KV cells are shared).
    target_options = replace(llama, n_seq_max=TREE_BRANCHES) if options.trees and draft else llama
    return open_llamacpp_pair(resolve(target), target_options,
                              resolve(draft) if draft else None, llama)


def load_slots(target: Name | None, draft: Name | None, options: LoadOptions, *, n_seq: int):
    """(target, draft or None) as runtimes holding `n_seq` sequences each: llama.cpp's in one context (no
    target and no draft: the default model with its draft, as in `choose_draft`), or MLX's on shared weights."""
    if options.runtime not in SLOT_RUNTIMES:
        raise EdgespecError(f"several sequences run on llama.cpp and MLX; drop --runtime {options.runtime}")
    if options.runtime == "mlx":
        return _mlx_pair(target, draft, options, n_seq=n_seq)
    draft = choose_draft(target, draft)
    llama = options.llamacpp()
    return open_llamacpp_pair(resolve(target), llama, resolve(draft) if draft else None, llama, n_seq=n_seq)


def load_runtime(name: Name | None, options: LoadOptions = LoadOptions(), *, n_seq: int | None = None):
    """One llama.cpp runtime (with `n_seq` sequences in its context when given)."""
    if options.runtime != "llamacpp":
        raise EdgespecError(f"this command runs llama.cpp; drop --runtime {options.runtime}")
    return open_llamacpp(resolve(name), options.llamacpp(), n_seq=n_seq)


def open_llamacpp(path: Path, llama_options, *, n_seq: int | None = None, mtp: bool = False):
    """A llama.cpp runtime on a resolved model file, with exactly these LlamaCppOptions (a memory plan's).
    `mtp`: a target whose GGUF carries NextN layers opens with its MTP head (the `mtp` drafter)."""
    from edgespec.runtimes.formats import gguf_nextn_layers
    from edgespec.runtimes.llamacpp import LlamaCppMtpRuntime, LlamaCppMultiSeqRuntime, LlamaCppRuntime

    identity = store.model_identity(path)
    if n_seq is None and mtp and gguf_nextn_layers(path) > 0:
        return LlamaCppMtpRuntime(path, llama_options, identity=identity)
    if n_seq is None:
        return LlamaCppRuntime(path, llama_options, identity=identity)
    return LlamaCppMultiSeqRuntime(path, llama_options, n_seq=n_seq, identity=identity)


def open_llamacpp_pair(target_path: Path, target_options, draft_path: Path | None, draft_options, *,
                       n_seq: int | None = None):
    """(target, draft or None) on resolved files; the target is closed again if the draft fails."""
    target_rt = open_llamacpp(target_path, target_options, n_seq=n_seq, mtp=True)
    try:
        draft_rt = open_llamacpp(draft_path, draft_options, n_seq=n_seq) if draft_path is not None else None
    except BaseException:
        target_rt.close()
        raise
    return target_rt, draft_rt


def _onnx_pair(target: Name | None, draft: Name | None, options: LoadOptions):
    """A bundle's ONNX target and draft (the draft unless one is given), or export directories / .onnx
    files given as they are. With `kv_resident` the target is its layer graphs under that KV budget."""
    from edgespec.machine.memory import parse_size
    from edgespec.runtimes.onnxrt import OnnxOptions, OnnxRuntime

    if target is None:
        raise EdgespecError("runtime onnx needs a target: a bundle or an ONNX export directory")
    resident = None if options.kv_resident is None else parse_size(options.kv_resident)
    onnx = OnnxOptions(n_ctx=options.n_ctx, n_threads=options.n_threads, provider=options.onnx_provider,
                       quant=options.onnx_quant, verbose=options.verbose, kv_resident_bytes=resident)
    if draft is None:
        draft = bundles.onnx_draft(target, onnx.quant)

    def open_onnx(name: Name):
        path = resolve_onnx(name, onnx.quant)
        return OnnxRuntime(path, onnx, identity=store.model_identity(path))

    if resident is not None:
        from edgespec.runtimes.onnx_layered import LayeredOnnxRuntime, LayeredOptions

        target_rt = LayeredOnnxRuntime(resolve_onnx_layers(target), LayeredOptions(
            n_ctx=onnx.n_ctx, n_threads=onnx.n_threads, resident_budget_bytes=resident))
    else:
        target_rt = open_onnx(target)
    try:
        draft_rt = open_onnx(draft) if draft else None
    except BaseException:
        target_rt.close()
        raise
    return target_rt, draft_rt


def _coreml_pair(target: Name | None):
    """A bundle's Core ML target and draft (None when it has none); their context was fixed at export."""
    from edgespec.runtimes.coreml import CoreMLRuntime, check_platform

    if target is None:
        raise EdgespecError("runtime coreml needs a target: a bundle exported with --format coreml")
    check_platform()
    target_pkg, draft_pkg, tokenizer = bundles.coreml(target)
    target_rt = CoreMLRuntime(target_pkg, tokenizer)
    try:
        draft_rt = CoreMLRuntime(draft_pkg, tokenizer) if draft_pkg is not None else None
    except BaseException:
        target_rt.close()
        raise
    return target_rt, draft_rt


def resolve_mlx(name: Name) -> Path:
    """What the MLX runtime loads: a checkpoint or MLX repo directory as is, a bundle's MLX target, or
    `hf:OWNER/REPO[@REV]` fetched whole (config, safetensors, tokenizer) into the Hugging Face cache."""
    from edgespec.models import hub

    text = str(name)
    if hub.is_hub_name(text):
        return hub.snapshot(text)
    if bundles.is_bundle(text):
        return bundles.mlx(text, "target")
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text in catalog.names():
        raise ModelFileError(f"{name} is a catalog GGUF model, which the llama.cpp runtime runs; the MLX runtime "
                             "needs a Hugging Face checkpoint directory or an MLX repo (hf:mlx-community/...)")
    raise ModelFileError(f"MLX model not found: {name} (give a Hugging Face checkpoint directory, an MLX repo "
                         "directory or hf:OWNER/REPO)")


def _mlx_pair(target: Name | None, draft: Name | None, options: LoadOptions, *, n_seq: int | None = None):
    """A target and an optional draft, each a checkpoint directory or MLX repo, on mlx-lm (with `n_seq`
    sequences each when given)."""
    from edgespec.runtimes.mlx import MlxMultiSeqRuntime, MlxOptions, MlxRuntime, need_mlx

    need_mlx()  # before any download: one line saying how to install it
    if target is None:
        raise EdgespecError("runtime mlx needs a target: a Hugging Face checkpoint directory, an MLX repo "
                            "directory or hf:OWNER/REPO")
    if draft == "auto":  # auto_draft compares installed GGUF vocabularies
        raise EdgespecError("--draft auto picks among installed GGUF models; with --runtime mlx give the draft's "
                            "checkpoint directory or hf:OWNER/REPO")
    if draft is None:
        draft = bundles.mlx_draft(target)
    mlx = MlxOptions(n_ctx=options.n_ctx, n_batch=options.n_batch)

    def open_mlx(name):
        path = resolve_mlx(name)
        return MlxRuntime(path, mlx) if n_seq is None else MlxMultiSeqRuntime(path, mlx, n_seq=n_seq)

    target_rt = open_mlx(target)
    try:
        draft_rt = open_mlx(draft) if draft else None
    except BaseException:
        target_rt.close()
        raise
    return target_rt, draft_rt
