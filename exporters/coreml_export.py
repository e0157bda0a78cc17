"""Hugging Face checkpoint -> one stateful, multifunction Core ML package (prefill, decode, verify).

transformers' own modules do not trace under torch 2.13 (its masking utilities fail inside
torch.jit.trace), so `StatefulDecoder` is a small trace-friendly llama/qwen2 decoder written here that
loads the checkpoint's weights and keeps its KV cache as registered buffers, which coremltools turns
into Core ML *states* (iOS 18 / macOS 15): the cache lives inside the model between calls.

Calling convention of every function (Apple's stateful-LLM layout):

* ``input_ids``   int32 (1, T): the new tokens;
* ``causal_mask`` float16 (1, 1, T, P+T): additive mask over the P cached positions and the T new
  ones (0 = attend, -inf or a large negative = masked). Its last dimension tells the model where the
  new tokens go: positions P .. P+T-1, written into the cache at those rows;
* output ``logits`` float16 (1, T, n_vocab); states ``k_cache`` / ``v_cache`` float16
  (n_layer, n_head_kv, max_context, head_dim).

Functions: ``prefill`` (T flexible, 1..prefill_max), ``decode`` (T = 1) and ``verify`` (T = k+1: the last
accepted token and k drafted ones, the speculative check in one call). Rolling back a rejected draft
needs no cache edit: the next call's mask simply ends before the rejected rows, which get overwritten.

Weights are quantized with coremltools.optimize: int8 per channel, or int4 in blocks of 32 (per_block,
iOS 18). The functions share one copy of the weights in the saved package.

Numerical parity of the package needs Core ML itself (macOS 15+). On any OS, `decoder_logits` runs the
very torch module that is converted, so its logits can be checked against transformers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint, load_checkpoint
from edgespec.exporters.progress import SILENT, Progress
from edgespec.runtimes.formats import COREML_FUNCTIONS as FUNCTIONS, causal_mask, describe_feature  # noqa: F401

COREML_QUANTS = ("int8", "int4", "fp16")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise EdgespecError("Core ML export needs torch and coremltools: pip install 'edgespec[export]'") from None
    return torch


def build_decoder(ckpt: Checkpoint, max_context: int, cache_dtype=None):
    """The trace-friendly decoder with the checkpoint's weights (float32), cache of `max_context` rows."""
    torch = _torch()
    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, weight: np.ndarray, eps: float):
            super().__init__()
            self.weight = nn.Parameter(torch.from_numpy(np.array(weight, dtype=np.float32)), requires_grad=False)
            self.eps = eps

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + self.eps) * self.weight

    def linear(prefix: str, bias: bool) -> "nn.Linear":
        w = ckpt.tensor(prefix + ".weight")
        layer = nn.Linear(w.shape[1], w.shape[0], bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(np.array(w)))
            if bias:
                layer.bias.copy_(torch.from_numpy(np.array(ckpt.tensor(prefix + ".bias"))))
        layer.requires_grad_(False)
        return layer

    class Layer(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            p = f"model.layers.{i}."
            has_bias = p + "self_attn.q_proj.bias" in ckpt.tensors
            self.attn_norm = RMSNorm(ckpt.tensor(p + "input_layernorm.weight"), ckpt.rms_eps)
            self.q = linear(p + "self_attn.q_proj", has_bias)
            self.k = linear(p + "self_attn.k_proj", has_bias)
            self.v = linear(p + "self_attn.v_proj", has_bias)
            self.o = linear(p + "self_attn.o_proj", False)
            self.ffn_norm = RMSNorm(ckpt.tensor(p + "post_attention_layernorm.weight"), ckpt.rms_eps)
            self.gate = linear(p + "mlp.gate_proj", False)
            self.up = linear(p + "mlp.up_proj", False)
            self.down = linear(p + "mlp.down_proj", False)

    class StatefulDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_layer, self.n_head, self.n_kv, self.hd = ckpt.n_layer, ckpt.n_head, ckpt.n_head_kv, ckpt.head_dim
            self.max_context = max_context
            self.static_len = 0  # set to T before tracing a function whose input length is fixed
            emb = torch.from_numpy(np.array(ckpt.tensor("model.embed_tokens.weight")))
            self.embed = nn.Embedding.from_pretrained(emb, freeze=True)
            self.layers = nn.ModuleList(Layer(i) for i in range(ckpt.n_layer))
            self.norm = RMSNorm(ckpt.tensor("model.norm.weight"), ckpt.rms_eps)
            head = emb if ckpt.tied_embeddings else torch.from_numpy(np.array(ckpt.tensor("lm_head.weight")))
            self.lm_head = nn.Linear(ckpt.n_embd, ckpt.n_vocab, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(head)
            self.lm_head.requires_grad_(False)
            inv_freq = 1.0 / (ckpt.rope_theta ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd))
            inv_freq = inv_freq / _rope_factors(ckpt, inv_freq)
            self.register_buffer("inv_freq", torch.from_numpy(inv_freq.astype(np.float32)), persistent=False)
            cache = (self.n_layer, self.n_kv, max_context, self.hd)
            dtype = cache_dtype or torch.float16
            self.register_buffer("k_cache", torch.zeros(cache, dtype=dtype))
            self.register_buffer("v_cache", torch.zeros(cache, dtype=dtype))

        def forward(self, input_ids, causal_mask):
            # A fixed-length function passes its length as a constant: coremltools 9 fails to cast the
            # size of a fixed-shape input to an int (TypeError in its `int` op).
            t = self.static_len or input_ids.shape[-1]
            end = causal_mask.shape[-1]
            begin = end - t
            cos, sin = rope_cos_sin(self.inv_freq, torch.arange(t, dtype=torch.float32) + (end - t))
            mask = causal_mask.to(torch.float32)
            h = self.embed(input_ids)
            group = self.n_head // self.n_kv
            for i, layer in enumerate(self.layers):
                q, k, v = layer_qkv(layer, h, cos, sin, t, self.n_head, self.n_kv, self.hd)
                self.k_cache[i:i + 1, :, begin:end, :] = k.to(self.k_cache.dtype)
                self.v_cache[i:i + 1, :, begin:end, :] = v.to(self.v_cache.dtype)
                keys = self.k_cache[i:i + 1, :, :end, :].to(torch.float32)
                values = self.v_cache[i:i + 1, :, :end, :].to(torch.float32)
                if group > 1:
                    keys = keys.repeat_interleave(group, dim=1)
                    values = values.repeat_interleave(group, dim=1)
                scores = torch.matmul(q, keys.transpose(-1, -2)) * (self.hd ** -0.5) + mask
                attn = torch.matmul(torch.softmax(scores, dim=-1), values)
                h = layer_output(layer, h, attn, t, self.n_head, self.hd)
            return self.lm_head(self.norm(h))

    return StatefulDecoder().eval()


# The per-layer steps around attention, shared with the per-layer ONNX graphs (onnx_layers.py), which
# attend over a past passed in rather than over a cache held as state.

def rope_cos_sin(inv_freq, positions):
    """RoPE tables for float positions (T,): cos and sin shaped (1, 1, T, head_dim)."""
    torch = _torch()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]


def layer_qkv(layer, h, cos, sin, t, n_head: int, n_kv: int, hd: int):
    """Norm, projections and RoPE of one layer: q (1, n_head, t, hd), k and v (1, n_kv, t, hd)."""
    x = layer.attn_norm(h)
    q = layer.q(x).view(1, t, n_head, hd).transpose(1, 2)
    k = layer.k(x).view(1, t, n_kv, hd).transpose(1, 2)
    v = layer.v(x).view(1, t, n_kv, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q, hd // 2) * sin
    k = k * cos + _rotate_half(k, hd // 2) * sin
    return q, k, v


def layer_output(layer, h, attn, t, n_head: int, hd: int):
    """Output projection, residual and MLP of one layer, from attention output (1, n_head, t, hd)."""
    torch = _torch()
    h = h + layer.o(attn.transpose(1, 2).reshape(1, t, n_head * hd))
    x = layer.ffn_norm(h)
    return h + layer.down(torch.nn.functional.silu(layer.gate(x)) * layer.up(x))


def _rotate_half(x, half: int):
    torch = _torch()
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope_factors(ckpt: Checkpoint, inv_freq: np.ndarray) -> np.ndarray:
    """Divisors of RoPE frequencies for the checkpoint's rope_scaling (1 = none)."""
    rs = ckpt.config.get("rope_scaling") or {}
    kind = str(rs.get("rope_type") or rs.get("type") or "default").lower()
    if kind == "default":
        return np.ones_like(inv_freq)
    if kind == "linear":
        return np.full_like(inv_freq, float(rs["factor"]))
    if kind == "llama3":
        from edgespec.exporters.gguf_export import _llama3_rope_factors

        return _llama3_rope_factors(ckpt).astype(np.float64)
    raise EdgespecError(f"{ckpt.path.name}: rope_scaling {rs} is not supported by the Core ML exporter")


def decoder_logits(decoder, chunks: list[list[int]]) -> np.ndarray:
    """Run the torch decoder over token chunks in order (as prefill, decode, verify calls would);
    return the logits of every token, shape (sum of lengths, n_vocab)."""
    torch = _torch()
    out, n_past = [], 0
    with torch.no_grad():
        for chunk in chunks:
            ids = torch.tensor([chunk], dtype=torch.int32)
            mask = torch.from_numpy(causal_mask(n_past, len(chunk), np.float32))
            out.append(decoder(ids, mask)[0].numpy())
            n_past += len(chunk)
    return np.concatenate(out)


# --- conversion ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CoreMLArtifact:
    path: Path               # the .mlpackage directory
    quant: str
    max_context: int
    prefill_max: int
    verify_tokens: int       # k+1


def export_coreml(source: str | os.PathLike | Checkpoint, out: str | os.PathLike, *, quant: str = "int8",
                  max_context: int = 512, prefill_max: int = 128, draft_max: int = 4,
                  progress: Progress = SILENT) -> CoreMLArtifact:
    """Convert to `out` (an .mlpackage): functions prefill / decode / verify, KV cache as state."""
    torch = _torch()
    try:
        import coremltools as ct
        import coremltools.optimize as cto
    except ImportError:  # pragma: no cover
        raise EdgespecError("Core ML export needs coremltools: pip install 'edgespec[export]'") from None
    if quant not in COREML_QUANTS:
        raise EdgespecError(f"unknown Core ML quantization {quant!r}; use one of {', '.join(COREML_QUANTS)}")
    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    max_context = min(max_context, ckpt.context_length)
    prefill_max = min(prefill_max, max_context)
    verify_t = draft_max + 1
    decoder = build_decoder(ckpt, max_context)
    out = Path(out)
    work = Path(tempfile.mkdtemp(prefix=".coreml-", dir=out.parent))
    try:
        shapes = {
            "prefill": (ct.RangeDim(1, prefill_max, default=min(8, prefill_max)), min(8, prefill_max)),
            "decode": (1, 1),
            "verify": (verify_t, verify_t),
        }
        parts = {}
        for fn, (t_spec, t_example) in shapes.items():
            progress.begin(f"Core ML: converting {fn}")
            example = (torch.zeros((1, t_example), dtype=torch.int32),
                       torch.zeros((1, 1, t_example, t_example), dtype=torch.float32))
            decoder.static_len = 0 if fn == "prefill" else t_example
            with torch.no_grad():
                traced = torch.jit.trace(decoder, example, check_trace=False)
            ctx = ct.RangeDim(1, max_context, default=t_example)
            mlmodel = ct.convert(
                traced,
                inputs=[ct.TensorType("input_ids", shape=(1, t_spec), dtype=np.int32),
                        ct.TensorType("causal_mask", shape=(1, 1, t_spec, ctx), dtype=np.float16)],
                outputs=[ct.TensorType("logits", dtype=np.float16)],
                states=[ct.StateType(ct.TensorType(shape=tuple(decoder.k_cache.shape), dtype=np.float16), name="k_cache"),
                        ct.StateType(ct.TensorType(shape=tuple(decoder.v_cache.shape), dtype=np.float16), name="v_cache")],
                minimum_deployment_target=ct.target.iOS18,
                compute_units=ct.ComputeUnit.CPU_AND_GPU,
                skip_model_load=True,
            )
            if quant != "fp16":
                progress.begin(f"Core ML: quantizing {fn} weights to {quant}")
                mlmodel = _quantize(cto, mlmodel, quant)
            parts[fn] = work / f"{fn}.mlpackage"
            mlmodel.save(str(parts[fn]))
            progress.end()
        progress.begin("Core ML: merging functions into one package")
        desc = ct.utils.MultiFunctionDescriptor()
        for fn, path in parts.items():
            desc.add_function(str(path), src_function_name="main", target_function_name=fn)
        desc.default_function_name = "decode"
        merged = work / "merged.mlpackage"
        ct.utils.save_multifunction(desc, str(merged))
        final = work / "final" / out.name
        final.parent.mkdir()
        _write_metadata(merged, final, ckpt, quant, max_context, prefill_max, verify_t)
        if out.exists():
            shutil.rmtree(out)
        os.replace(final, out)
        progress.end()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ckpt.close()
    return CoreMLArtifact(out, quant, max_context, prefill_max, verify_t)


def _quantize(cto, mlmodel, quant: str):
    if quant == "int8":
        op = cto.coreml.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                                weight_threshold=1024)
    else:
        op = cto.coreml.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                                block_size=32, weight_threshold=1024)
    return cto.coreml.linear_quantize_weights(mlmodel, config=cto.coreml.OptimizationConfig(global_config=op))


def _write_metadata(package: Path, final: Path, ckpt: Checkpoint, quant: str, max_context: int,
                    prefill_max: int, verify_t: int) -> None:
    """Copy `package` to `final` with the calling convention in its user metadata (readable anywhere)."""
    import coremltools as ct

    from edgespec.exporters import EXPORTER_VERSION

    spec = ct.utils.load_spec(str(package))
    meta = spec.description.metadata.userDefined
    meta.update({"edgespec.exporter": EXPORTER_VERSION, "edgespec.source": ckpt.name,
                 "edgespec.quant": quant, "edgespec.max_context": str(max_context),
                 "edgespec.prefill_max": str(prefill_max), "edgespec.verify_tokens": str(verify_t),
                 "edgespec.functions": ",".join(FUNCTIONS)})
    ct.utils.save_spec(spec, str(final), weights_dir=str(package / "Data" / "com.apple.CoreML" / "weights"))


# --- inspection (any OS) ----------------------------------------------------------------------------

def describe_package(package: str | os.PathLike) -> dict:
    """What a package holds, read from its spec and MIL program without running it (works on Linux):
    functions with their inputs, outputs and states, weight types per function, and the size on disk."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as mil_load
    from coremltools.converters.mil.mil import types

    package = Path(package)
    spec = ct.utils.load_spec(str(package))
    desc = spec.description

    program = mil_load(spec, specification_version=spec.specificationVersion,
                       file_weights_dir=str(package / "Data" / "com.apple.CoreML" / "weights"))
    functions = {}
    for fn in desc.functions:
        quantized: dict[str, int] = {}
        float_matrices = 0
        ops: dict[str, int] = {}
        for op in program.functions[fn.name].operations:
            ops[op.op_type] = ops.get(op.op_type, 0) + 1
            if op.op_type.startswith("constexpr_"):
                name = types.builtin_to_string(op.data.dtype if hasattr(op, "data") else op.indices.dtype)
                quantized[name] = quantized.get(name, 0) + 1
            elif op.op_type == "const" and op.outputs[0].val is not None:
                val = op.outputs[0].val
                if getattr(val, "ndim", 0) == 2 and val.size > 1024 and val.dtype.kind == "f":
                    float_matrices += 1
        functions[fn.name] = {"inputs": [describe_feature(f) for f in fn.input], "outputs": [describe_feature(f) for f in fn.output],
                              "states": [describe_feature(f) for f in fn.state], "quantized_weights": quantized,
                              "float_weight_matrices": float_matrices, "ops": ops}
    size = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    weights = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    return {
        "functions": functions,
        "default_function": desc.defaultFunctionName,
        "spec_version": spec.specificationVersion,
        "metadata": dict(desc.metadata.userDefined),
        "bytes": size,
        "weight_bytes": weights.stat().st_size if weights.is_file() else 0,
    }
