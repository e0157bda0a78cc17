"""Offline exporters: Hugging Face checkpoints in, quantized artifacts and a manifest out.

`edgespec export` (and `edgespec.exporters.bundle.export_bundle`) is the entry point; one module per
format (`gguf_export`, `onnx_export`, `coreml_export`), plus `bundle` (temp dir, manifest, atomic
move) and `selfdraft` (a draft derived from the target). Heavy dependencies (torch, transformers,
optimum-onnx, onnxruntime, coremltools) come with the `export` extra and are imported only by the
format that needs them: the GGUF path needs only `gguf`, numpy and llama.cpp (plus `tokenizers` for
its tokenizer parity check).
"""

EXPORTER_VERSION = "0.1.0"
