"""Hugging Face checkpoint -> the decoder as separate ONNX graphs: embedding, layers (one graph per
layer or per group of G layers), head.

A standard with-past ONNX export (onnx_export.py) wants every layer's whole past KV at every call. Cut
into layer graphs, the runtime (runtimes/onnx_layered.py) owns the cache: it feeds each graph only its
own layers' past, from wherever that KV lives (RAM, a memory-mapped file), and gets back only the
rows of the new tokens. The layer code is the Core ML exporter's trace-friendly decoder
(coreml_export.build_decoder, layer_qkv, layer_output); only the attention over a past passed in is
written here.

Graphs (float32, opset 17, dynamic T new tokens and P past positions):

* ``embed.onnx``  ``input_ids`` int64 (1, T), ``position_ids`` int64 (1, T)
                  -> ``hidden`` (1, T, n_embd), ``cos``, ``sin`` (1, 1, T, head_dim) (RoPE, scaling included)
* ``layer_{i}.onnx`` (G = 1) or ``layers_{i}-{j}.onnx`` (layers i..j):
                  ``hidden``, ``cos``, ``sin``, ``attention_mask`` (1, 1, T, P+T) additive float32
                  (0 = attend), ``past_key.{l}`` / ``past_value.{l}`` (1, n_head_kv, P, head_dim) for each
                  layer l of the group -> ``hidden_out``, ``new_key.{l}`` / ``new_value.{l}``
                  (1, n_head_kv, T, head_dim)
* ``head.onnx``   ``hidden`` (1, R, n_embd) -> ``logits`` (1, R, n_vocab): final norm and lm_head, given
                  only the rows whose logits are wanted, so a prefill never makes T x n_vocab logits.

``layers.json`` (the manifest) names the graphs, the layer groups, the geometry, the dtype, every
file with its bytes and sha256, and the check made after export: the graphs composed over a few
chunks against transformers' logits (max |diff|).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec import atomic
from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint, load_checkpoint
from edgespec.exporters.progress import SILENT, Progress
from edgespec.runtimes.formats import LAYERS_FORMAT as FORMAT, LAYERS_MANIFEST as MANIFEST, LAYERS_SCHEMA as SCHEMA
from edgespec.runtimes.formats import sha256_file

OPSET = 17


def _torch():
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import torch
    except ImportError:  # pragma: no cover - the export extra brings them
        raise EdgespecError("layered ONNX export needs torch and onnx: pip install 'edgespec[export]'") from None
    return torch


@dataclass(frozen=True)
class LayeredArtifact:
    directory: Path
    manifest: dict

    @property
    def check(self) -> dict | None:
        return self.manifest.get("check")


def group_file(layers: list[int]) -> str:
    return f"layer_{layers[0]}.onnx" if len(layers) == 1 else f"layers_{layers[0]}-{layers[-1]}.onnx"


def _modules(decoder):
    """The three kinds of graph as torch modules around the decoder's own weights."""
    torch = _torch()
    from edgespec.exporters.coreml_export import layer_output, layer_qkv, rope_cos_sin

    n_head, n_kv, hd = decoder.n_head, decoder.n_kv, decoder.hd
    group = n_head // n_kv

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = decoder.embed
            self.register_buffer("inv_freq", decoder.inv_freq.clone(), persistent=False)

        def forward(self, input_ids, position_ids):
            cos, sin = rope_cos_sin(self.inv_freq, position_ids[0].to(torch.float32))
            return self.embed(input_ids), cos, sin

    def attend(q, k, v, past_k, past_v, mask):
        # GQA without copying the past: the `group` query heads that share a KV head sit next to each
        # other, so q folds to (1, n_kv, group*T, hd) and multiplies that head's keys directly. The past
        # and the new rows are scored separately and never concatenated (no copy of the past either).
        t = q.shape[2]
        qg = q.reshape(1, n_kv, -1, hd)
        scores = torch.cat([torch.matmul(qg, past_k.transpose(-1, -2)), torch.matmul(qg, k.transpose(-1, -2))], -1)
        total = scores.shape[-1]
        scores = scores.view(1, n_kv, group, t, total) * (hd ** -0.5) + mask.unsqueeze(2)
        probs = torch.softmax(scores, dim=-1).view(1, n_kv, -1, total)
        p = past_k.shape[2]
        out = torch.matmul(probs[..., :p], past_v) + torch.matmul(probs[..., p:], v)
        return out.reshape(1, n_head, t, hd)

    class Layers(torch.nn.Module):
        def __init__(self, ids: list[int]):
            super().__init__()
            self.layers = torch.nn.ModuleList(decoder.layers[i] for i in ids)

        def forward(self, hidden, cos, sin, mask, *past):
            h, new = hidden, []
            for j, layer in enumerate(self.layers):
                q, k, v = layer_qkv(layer, h, cos, sin, -1, n_head, n_kv, hd)
                h = layer_output(layer, h, attend(q, k, v, past[2 * j], past[2 * j + 1], mask), -1, n_head, hd)
                new += [k, v]
            return (h, *new)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lm_head = decoder.norm, decoder.lm_head

        def forward(self, hidden):
            return self.lm_head(self.norm(hidden))

    return Embed, Layers, Head


def _export(module, args, path: Path, inputs: list[str], outputs: list[str], axes: dict) -> None:
    torch = _torch()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, do_constant_folding=True)


def export_onnx_layers(source: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike, *, group_size: int = 1,
                       check: bool = True, progress: Progress = SILENT) -> LayeredArtifact:
    """Write embed.onnx, the layer graphs, head.onnx, the tokenizer files and layers.json to `out_dir`.

    With `check`, the graphs are run over a few chunks of sample text through the layered runtime and
    compared with transformers' logits; the result is in the manifest under "check".
    """
    torch = _torch()
    from edgespec.exporters import EXPORTER_VERSION
    from edgespec.exporters.coreml_export import build_decoder
    from edgespec.exporters.onnx_export import copy_tokenizer_files

    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    if group_size < 1 or group_size > ckpt.n_layer:
        raise EdgespecError(f"group size must be between 1 and the model's {ckpt.n_layer} layers, got {group_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a directory without a manifest is an unfinished export
    groups = [list(range(i, min(i + group_size, ckpt.n_layer))) for i in range(0, ckpt.n_layer, group_size)]
    progress.begin(f"layered ONNX: loading {ckpt.name} weights")
    decoder = build_decoder(ckpt, max_context=1, cache_dtype=torch.float32)  # the cache buffers go unused
    Embed, Layers, Head = _modules(decoder)
    progress.end()

    t, p, n_kv, hd = 3, 2, ckpt.n_head_kv, ckpt.head_dim  # example sizes; every one is a dynamic axis
    tokens = {0: "batch", 1: "tokens"}
    progress.begin("layered ONNX: embedding graph")
    _export(Embed(), (torch.zeros((1, t), dtype=torch.int64), torch.arange(t, dtype=torch.int64)[None]),
            out / "embed.onnx", ["input_ids", "position_ids"], ["hidden", "cos", "sin"],
            {"input_ids": tokens, "position_ids": tokens, "hidden": tokens, "cos": {2: "tokens"}, "sin": {2: "tokens"}})
    progress.end()
    progress.begin(f"layered ONNX: {ckpt.n_layer} layers in {len(groups)} graph(s)", total=len(groups))
    hidden = torch.zeros((1, t, ckpt.n_embd))
    rope = torch.zeros((1, 1, t, hd))
    mask = torch.zeros((1, 1, t, p + t))
    for ids in groups:
        past = [torch.zeros((1, n_kv, p, hd)) for _ in range(2 * len(ids))]
        past_names = [f"past_{kind}.{i}" for i in ids for kind in ("key", "value")]
        new_names = [f"new_{kind}.{i}" for i in ids for kind in ("key", "value")]
        axes = {"hidden": tokens, "hidden_out": tokens, "cos": {2: "tokens"}, "sin": {2: "tokens"},
                "attention_mask": {2: "tokens", 3: "total"},
                **{n: {2: "past"} for n in past_names}, **{n: {2: "tokens"} for n in new_names}}
        _export(Layers(ids), (hidden, rope, rope, mask, *past), out / group_file(ids),
                ["hidden", "cos", "sin", "attention_mask", *past_names], ["hidden_out", *new_names], axes)
        progress.advance()
    progress.end()
    progress.begin("layered ONNX: head graph")
    _export(Head(), (hidden,), out / "head.onnx", ["hidden"], ["logits"],
            {"hidden": {1: "rows"}, "logits": {1: "rows"}})
    progress.end()
    del decoder

    tokenizer_files = copy_tokenizer_files(ckpt.path, out)
    graphs = ["embed.onnx", *(group_file(g) for g in groups), "head.onnx"]
    manifest = {
        "format": FORMAT, "schema": SCHEMA,
        "exporter": {"version": EXPORTER_VERSION, "torch": torch.__version__, "opset": OPSET},
        "source": ckpt.name, "architecture": ckpt.architecture, "family": ckpt.family,
        "dtype": "float32",
        "geometry": {"n_layer": ckpt.n_layer, "n_embd": ckpt.n_embd, "n_head": ckpt.n_head,
                     "n_head_kv": ckpt.n_head_kv, "head_dim": ckpt.head_dim, "n_vocab": ckpt.n_vocab,
                     "context_length": ckpt.context_length},
        "group_size": group_size,
        "embed": "embed.onnx", "head": "head.onnx",
        "groups": [{"file": group_file(g), "layers": g} for g in groups],
        "tokenizer": tokenizer_files,
        "files": {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
                  for name in graphs + tokenizer_files},
        "check": None,
    }
    _write_manifest(out, manifest)
    if check:
        progress.begin("layered ONNX: checking the composed graphs against transformers")
        manifest["check"] = check_layers(out, ckpt.path)
        _write_manifest(out, manifest)
        progress.end()
        progress.note(f"layered ONNX vs transformers: max |logit diff| {manifest['check']['max_abs_logit_diff']:.2e} "
                      f"over {manifest['check']['positions']} positions")
    if not isinstance(source, Checkpoint):
        ckpt.close()
    return LayeredArtifact(out, manifest)


def _write_manifest(out: Path, manifest: dict) -> None:
    atomic.write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def check_layers(directory: str | os.PathLike, checkpoint_dir: str | os.PathLike, n_tokens: int = 48,
                 threads: int = 2) -> dict:
    """The layer graphs composed by the layered runtime (a prefill, one token, a verify-sized chunk and
    the rest, so the past path is exercised) against transformers' fp32 logits of the same tokens."""
    from edgespec.exporters.gguf_export import sample_tokens
    from edgespec.exporters.onnx_export import hf_logits
    from edgespec.runtimes.onnx_layered import LayeredOnnxRuntime

    tokens = list(sample_tokens(Path(checkpoint_dir), n_tokens))
    ref = hf_logits(checkpoint_dir, tokens)
    cut = max(1, len(tokens) // 2)
    chunks = [c for c in (tokens[:cut], tokens[cut:cut + 1], tokens[cut + 1:cut + 6], tokens[cut + 6:]) if c]
    with LayeredOnnxRuntime(directory, n_ctx=len(tokens), n_threads=threads) as rt:
        got = np.concatenate([rt.decode(c, len(c)) for c in chunks])
    return {"positions": len(tokens), "chunks": [len(c) for c in chunks],
            "max_abs_logit_diff": float(np.abs(got - ref).max()),
            "top1_agreement": float((got.argmax(1) == ref.argmax(1)).mean()),
            "reference": "transformers fp32, eager attention"}

