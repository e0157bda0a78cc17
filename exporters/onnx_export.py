"""Hugging Face checkpoint -> ONNX (optimum-onnx, task text-generation-with-past), then ONNX Runtime
quantization: int8 dynamic (weights int8, activations quantized at run time) and 4-bit weight-only
(MatMulNBits, blocks of 32, symmetric).

The exported graph's interface, checked after export (`check_io`):

* inputs  ``input_ids`` (batch, seq), ``attention_mask`` (batch, past+seq), ``position_ids`` (batch, seq),
  ``past_key_values.{i}.key`` / ``.value`` (batch, n_head_kv, past, head_dim) for every layer i;
* outputs ``logits`` (batch, seq, n_vocab) for every position, ``present.{i}.key`` / ``.value``.

`OnnxCausalLM` runs such a model chunk by chunk, feeding each call's `present` back as `past`, which is
how the checks below (and a speculative verifier: k+1 tokens per call) use it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint, load_checkpoint
from edgespec.exporters.progress import SILENT, Progress
from edgespec.runtimes.formats import ONNX_FILES, ONNX_QUANTS  # noqa: F401  (what the ONNX runtime reads)

_EXTERNAL_DATA_LIMIT = 1_800_000_000  # protobuf's 2 GiB cap, with room for the graph itself


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # pragma: no cover - the export extra brings them
        raise EdgespecError(f"ONNX export needs {module.split('.')[0]}: pip install 'edgespec[export]'") from None


@dataclass(frozen=True)
class OnnxArtifacts:
    directory: Path
    files: dict[str, Path]      # quant -> model file (its external data, if any, sits beside it)
    inputs: list[str]
    outputs: list[str]


def export_onnx(source: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike,
                quants: Sequence[str] = ("fp32", "int8", "int4"), *, progress: Progress = SILENT) -> OnnxArtifacts:
    """Export to `out_dir` (model.onnx, model_int8.onnx, model_q4.onnx, config and tokenizer files)."""
    for q in quants:
        if q not in ONNX_QUANTS:
            raise EdgespecError(f"unknown ONNX quantization {q!r}; use one of {', '.join(ONNX_QUANTS)}")
    ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main_export = _need("optimum.exporters.onnx").main_export
    progress.begin(f"ONNX: exporting {ckpt.name} (optimum-onnx, text-generation-with-past)")
    _quiet_loggers()
    main_export(str(ckpt.path), output=str(out_dir), task="text-generation-with-past", device="cpu",
                do_validation=False, trust_remote_code=False)
    progress.end()
    fp32 = out_dir / ONNX_FILES["fp32"]
    if not fp32.is_file():
        raise EdgespecError(f"optimum-onnx wrote no {fp32.name} for {ckpt.name}")
    inputs, outputs = check_io(fp32, ckpt)
    files = {"fp32": fp32}
    big = ckpt.n_params() * 4 > _EXTERNAL_DATA_LIMIT
    if "int8" in quants:
        progress.begin("ONNX: int8 dynamic quantization")
        qz = _need("onnxruntime.quantization")
        qz.quantize_dynamic(str(fp32), str(out_dir / ONNX_FILES["int8"]), weight_type=qz.QuantType.QInt8,
                            per_channel=True, op_types_to_quantize=["MatMul"], use_external_data_format=big)
        files["int8"] = out_dir / ONNX_FILES["int8"]
        progress.end()
    if "int4" in quants:
        progress.begin("ONNX: 4-bit weight-only quantization (MatMulNBits)")
        onnx = _need("onnx")
        nbits = _need("onnxruntime.quantization.matmul_nbits_quantizer")
        quantizer = nbits.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True)
        quantizer.process()
        files["int4"] = out_dir / ONNX_FILES["int4"]
        quantizer.model.save_model_to_file(str(files["int4"]), use_external_data_format=big)
        progress.end()
    if "fp32" not in quants:  # the float model was only the quantizers' input
        fp32.unlink()
        Path(str(fp32) + "_data").unlink(missing_ok=True)
        del files["fp32"]
    for stray in out_dir.glob("*.onnx.data"):  # leftovers some onnx versions write next to a quantized copy
        if not any(stray.name.startswith(f.name) for f in files.values()):
            stray.unlink()
    ckpt.close()
    return OnnxArtifacts(out_dir, files, inputs, outputs)


def _quiet_loggers() -> None:
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "optimum", "transformers", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)


def check_io(model_path: Path, ckpt: Checkpoint) -> tuple[list[str], list[str]]:
    """Fail unless the model has exactly the with-past interface the runtimes expect."""
    onnx = _need("onnx")
    model = onnx.load(str(model_path), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    kv = [f"past_key_values.{i}.{kind}" for i in range(ckpt.n_layer) for kind in ("key", "value")]
    want_in = ["input_ids", "attention_mask", "position_ids", *kv]
    want_out = ["logits", *[n.replace("past_key_values", "present") for n in kv]]
    if sorted(inputs) != sorted(want_in) or sorted(outputs) != sorted(want_out):
        raise EdgespecError(f"{model_path.name}: unexpected ONNX interface (inputs {inputs[:5]}..., outputs "
                            f"{outputs[:3]}...); expected {want_in[:5]}... and {want_out[:3]}...")
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            dims = [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]
            if dims[1] != ckpt.n_head_kv or dims[3] != ckpt.head_dim:
                raise EdgespecError(f"{model_path.name}: {value.name} has shape {dims}, expected "
                                    f"(batch, {ckpt.n_head_kv}, past, {ckpt.head_dim})")
    return inputs, outputs


class OnnxCausalLM:
    """A with-past ONNX decoder in ONNX Runtime (CPU), one sequence, KV carried between calls."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        ort = _need("onnxruntime")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._kv_names = [n for n in self._inputs if n.startswith("past_key_values.")]
        first = self._inputs[self._kv_names[0]].shape
        self.n_head_kv, self.head_dim = int(first[1]), int(first[3])
        self._int = {n: (np.int64 if "int64" in self._inputs[n].type else np.int32)
                     for n in ("input_ids", "attention_mask", "position_ids")}
        self.reset()

    def reset(self) -> None:
        self.past = {n: np.zeros((1, self.n_head_kv, 0, self.head_dim), np.float32) for n in self._kv_names}
        self.n_past = 0

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """Append tokens; return their logits, shape (len(tokens), n_vocab)."""
        t = len(tokens)
        feed = {
            "input_ids": np.asarray([tokens], dtype=self._int["input_ids"]),
            "attention_mask": np.ones((1, self.n_past + t), dtype=self._int["attention_mask"]),
            "position_ids": np.arange(self.n_past, self.n_past + t, dtype=self._int["position_ids"])[None],
            **self.past,
        }
        names = [o.name for o in self.session.get_outputs()]
        values = dict(zip(names, self.session.run(None, feed)))
        self.past = {n: values[n.replace("past_key_values", "present")] for n in self._kv_names}
        self.n_past += t
        return values["logits"][0]

    def logits(self, chunks: Sequence[Sequence[int]]) -> np.ndarray:
        self.reset()
        return np.concatenate([self.decode(list(c)) for c in chunks])


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "generation_config.json", "config.json"]
    copied = []
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (src / n).is_file():
            shutil.copy2(src / n, dst / n)
            copied.append(n)
    return copied


def hf_logits(checkpoint_dir: str | os.PathLike, tokens: Sequence[int]) -> np.ndarray:
    """The Hugging Face model's own logits (transformers, fp32, eager attention) for `tokens`."""
    torch = _need("torch")
    transformers = _need("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].numpy()


def onnx_quality(artifacts: OnnxArtifacts, reference: np.ndarray, tokens: Sequence[int]) -> dict:
    """Each ONNX model against reference logits: max |diff| and top-1 agreement. The tokens go in three
    calls (a prefill, one token, the rest) so the past-key-values path is part of what is checked."""
    tokens = list(tokens)
    cut = max(1, len(tokens) // 2)
    chunks = [tokens[:cut], tokens[cut:cut + 1], tokens[cut + 1:]]
    chunks = [c for c in chunks if c]
    out = {}
    for q, path in artifacts.files.items():
        logits = OnnxCausalLM(path).logits(chunks)
        out[q] = {"positions": len(tokens),
                  "max_abs_logit_diff": round(float(np.abs(logits - reference).max()), 6),
                  "top1_agreement": round(float((logits.argmax(1) == reference.argmax(1)).mean()), 4)}
    return out
