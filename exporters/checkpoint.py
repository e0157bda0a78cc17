"""A Hugging Face checkpoint on disk: its config, its weights (read lazily), its tokenizer files.

Weights are read straight from the safetensors files with numpy memory maps, so the GGUF path needs
neither torch nor transformers and never holds more than one tensor in memory. F32, F16 and BF16
are understood (bf16 widens exactly to f32).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from edgespec.errors import EdgespecError

# Architectures every exporter handles, by the class name in config.json.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",   # SmolLM / SmolLM2, Llama 3.x, TinyLlama-style configs
    "Qwen2ForCausalLM": "qwen2",   # Qwen2 / Qwen2.5 (attention q/k/v biases)
}

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(EdgespecError):
    """The Hugging Face checkpoint is missing, incomplete or of a kind the exporters do not handle."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies in a safetensors file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes_f32(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 4


@dataclass
class Checkpoint:
    """One local Hugging Face causal-LM checkpoint directory."""

    path: Path
    config: dict
    tensors: dict[str, TensorRef]
    family: str  # "llama" | "qwen2"
    _maps: dict[Path, np.memmap] = field(default_factory=dict, repr=False)

    # -- geometry -------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def n_layer(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def n_embd(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def n_head(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def n_head_kv(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.n_embd // self.n_head)

    @property
    def n_ff(self) -> int:
        return int(self.config["intermediate_size"])

    @property
    def n_vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)

    @property
    def rms_eps(self) -> float:
        return float(self.config.get("rms_norm_eps", 1e-6))

    @property
    def rope_theta(self) -> float:
        return float(self.config.get("rope_theta", 10000.0))

    @property
    def tied_embeddings(self) -> bool:
        return "lm_head.weight" not in self.tensors or bool(self.config.get("tie_word_embeddings", False))

    @property
    def name(self) -> str:
        return str(self.config.get("_name_or_path") or self.path.name).rstrip("/").split("/")[-1] or self.path.name

    def kv_geometry(self) -> dict:
        """What memory planning needs: KV bytes per token = 2 * n_layer * n_head_kv * head_dim * bytes."""
        per_token_f16 = 2 * self.n_layer * self.n_head_kv * self.head_dim * 2
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_head_kv": self.n_head_kv,
                "head_dim": self.head_dim, "n_embd": self.n_embd, "kv_bytes_per_token_f16": per_token_f16}

    def n_params(self) -> int:
        return sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.tensors.values())

    def weight_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())

    # -- weights --------------------------------------------------------------------------------

    def tensor(self, name: str) -> np.ndarray:
        """A tensor as float32 (a read-only view where the file already holds f32)."""
        ref = self.tensors[name]
        data = self._maps.get(ref.file)
        if data is None:
            data = self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
        raw = data[ref.start:ref.end]
        if ref.dtype == "BF16":
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.view(_SAFETENSORS_DTYPES[ref.dtype]).astype(np.float32, copy=False)
        return arr.reshape(ref.shape)

    def names(self) -> Iterator[str]:
        yield from self.tensors

    def close(self) -> None:
        self._maps.clear()

    # -- tokenizer files ------------------------------------------------------------------------

    @property
    def tokenizer_json(self) -> Path:
        return self.path / "tokenizer.json"


def resolve_checkpoint_dir(spec: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id downloaded where this machine can reach the hub."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; give a Hugging Face checkpoint directory "
                              "(config.json, *.safetensors, tokenizer.json)")
    text = str(spec)
    if text.startswith("hf:"):  # edgespec's hub names: the HF cache, sha256-checked (models/hub.py)
        from edgespec.models import hub

        return hub.snapshot(text)
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint directory not found: {text}; give a local Hugging Face checkpoint "
                              "directory or a hub id like org/name")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with the export extra
        raise CheckpointError(f"{text} is not a local directory, and downloading hub ids needs "
                              "huggingface_hub (pip install 'edgespec[export]')") from None
    try:
        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as exc:  # network errors, unknown repo, gated model: all user-fixable
        raise CheckpointError(f"could not download {text} from the Hugging Face hub ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); download it elsewhere "
                              "and give its local directory") from None


LLAMA_CPP_FAMILY = "llama.cpp"  # an architecture only llama.cpp's converter writes (GGUF export alone)


def load_checkpoint(spec: str | os.PathLike, *, gguf_only: bool = False) -> Checkpoint:
    """Open and validate a checkpoint: config, architecture, weights and tokenizer must all be there.

    `gguf_only`: the checkpoint goes to GGUF alone, so any architecture llama.cpp's own converter knows
    is accepted (family LLAMA_CPP_FAMILY; that converter checks its tensors)."""
    path = resolve_checkpoint_dir(spec)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; it is not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from None
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else config.get("model_type", "unknown")
    family = SUPPORTED_ARCHITECTURES.get(arch)
    if family is None:
        from edgespec.exporters.llama_source import llama_cpp_architectures

        known = llama_cpp_architectures()
        if gguf_only and arch in known:
            family = LLAMA_CPP_FAMILY
        else:
            gguf = ("; GGUF export (--format gguf) also converts it with llama.cpp's converter" if arch in known
                    else f"; GGUF export also converts the {len(known)} architectures llama.cpp's converter knows")
            raise CheckpointError(f"{path.name}: architecture {arch!r} is not supported by the exporters; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}{gguf}")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") + (
        ("intermediate_size",) if family != LLAMA_CPP_FAMILY else ())
    for key in required:
        if not isinstance(config.get(key), int):
            raise CheckpointError(f"{config_file} lacks {key!r}; the checkpoint is incomplete")
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json (a fast tokenizer); save the tokenizer with "
                              "transformers' save_pretrained next to the model")
    tensors = _read_safetensors_index(path)
    ckpt = Checkpoint(path=path, config=config, tensors=tensors, family=family)
    if family != LLAMA_CPP_FAMILY:
        _check_weights(ckpt)
    return ckpt


def _read_safetensors_index(path: Path) -> dict[str, TensorRef]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin weights: re-save with safe_serialization=True)" if list(path.glob("*.bin")) else ""
        raise CheckpointError(f"{path} has no *.safetensors weights{extra}")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        shards = set(json.loads(index_file.read_text()).get("weight_map", {}).values())
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path}: weight shard(s) {', '.join(sorted(missing))} missing; the download "
                                  "is incomplete")
        files = [path / s for s in sorted(shards)]
    tensors: dict[str, TensorRef] = {}
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is truncated (not a safetensors file)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{file} is not a safetensors file (bad header length)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{file} has a corrupt safetensors header") from None
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info["dtype"]
            if dtype not in _SAFETENSORS_DTYPES:
                raise CheckpointError(f"{file.name}: tensor {name} has dtype {dtype}; the exporters read F32, F16 "
                                      "and BF16 weights (de-quantize the checkpoint first)")
            start, end = info["data_offsets"]
            if base + end > size:
                raise CheckpointError(f"{file} is truncated (tensor {name} runs past the end of the file)")
            tensors[name] = TensorRef(file, dtype, tuple(info["shape"]), base + start, base + end)
    return tensors


def _check_weights(ckpt: Checkpoint) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(ckpt.n_layer):
        p = f"model.layers.{i}."
        need += [p + s + ".weight" for s in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                             "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    missing = [n for n in need if n not in ckpt.tensors]
    if missing:
        raise CheckpointError(f"{ckpt.path.name}: {len(missing)} tensor(s) missing from the weights, e.g. "
                              f"{missing[0]}; the checkpoint is incomplete or not a {ckpt.architecture}")
    emb = ckpt.tensors["model.embed_tokens.weight"].shape
    if emb != (ckpt.n_vocab, ckpt.n_embd):
        raise CheckpointError(f"{ckpt.path.name}: embedding shape {emb} does not match config.json "
                              f"(vocab_size {ckpt.n_vocab}, hidden_size {ckpt.n_embd})")
    if ckpt.n_head % ckpt.n_head_kv:
        raise CheckpointError(f"{ckpt.path.name}: num_attention_heads {ckpt.n_head} is not a multiple of "
                              f"num_key_value_heads {ckpt.n_head_kv}")
