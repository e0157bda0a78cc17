"""A GGUF (Llama or Qwen2, as the exporters write them) -> an MLX repo directory `--runtime mlx` loads.

Read with gguf-py, no torch: the config from the GGUF's metadata, the tensors renamed back to Hugging
Face's names (llama's q/k rows un-permuted from llama.cpp's interleaved pairs back to rotate-half),
the tokenizer rebuilt from `tokenizer.ggml.*` and checked against llama.cpp on the exporters' parity
texts (a mismatch is refused).

Weight types, where MLX has the same quantization:

* F32, F16, BF16: kept as float (or cast to `dtype` when dequantizing);
* Q8_0 (blocks of 32, one f16 scale, int8 values): MLX 8-bit affine with groups of 32, scale d and bias
  -128*d over the values shifted to 0..255 — the same numbers, nothing requantized; or dequantized;
* every other type (the k-quants, Q4_0, Q5_*, IQ*): refused in one line, since MLX's affine groups
  cannot hold their super-block scales without requantizing; `--quant mlx:fp32` dequantizes them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.exporters.progress import SILENT, Progress

GGUF_MLX_MODES = ("keep", "fp32", "fp16")  # keep: Q8_0 as MLX 8-bit, floats as they are; else dequantize
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
Q8_GROUP = 32
_UNUSED = 5  # llama.cpp's token type of padding rows the converter names [PADn]: not in the tokenizer


@dataclass
class GGUFForMLX:
    """A GGUF read and checked for conversion (`read_gguf`): nothing written yet."""

    path: Path
    mode: str
    reader: object        # gguf.GGUFReader (a memory map)
    meta: dict            # metadata, without the tokenizer's token lists
    tensors: dict
    config: dict          # the Hugging Face config.json it becomes


def read_gguf(gguf_path: str | os.PathLike, mode: str = "keep") -> GGUFForMLX:
    """Open a GGUF and check everything that can refuse it (architecture, weight types, MLX installed),
    before any work and before any progress display, so a refusal is one line."""
    import gguf

    from edgespec.runtimes.mlx import need_mlx

    if mode not in GGUF_MLX_MODES:
        raise EdgespecError(f"unknown GGUF -> MLX mode {mode!r}; use {', '.join(GGUF_MLX_MODES)}")
    need_mlx()
    src = Path(gguf_path).expanduser()
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{src} is not a GGUF gguf-py can read ({exc})") from None
    big = {f"tokenizer.ggml.{n}" for n in ("tokens", "token_type", "merges", "scores")}
    meta = {name: field.contents() for name, field in reader.fields.items() if name not in big}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelFileError(f"{src.name}: architecture {arch!r}; GGUF -> MLX reads {', '.join(_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelFileError(f"{src.name}: llama 3 rope scaling (rope_freqs) is not read back; convert the "
                             "Hugging Face checkpoint with `edgespec export --format mlx` instead")
    allowed = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
               gguf.GGMLQuantizationType.Q8_0}
    if mode == "keep":
        refused = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in allowed})
        if refused:
            raise EdgespecError(f"{src.name} holds {', '.join(refused)} weights, which MLX has no quantization for "
                                "(it keeps F32, F16, BF16 and Q8_0); dequantize with --quant mlx:fp32 or mlx:fp16, "
                                "or export the Hugging Face checkpoint with --format mlx")
    return GGUFForMLX(src, mode, reader, meta, tensors, _config(meta, arch, tensors))


def gguf_to_mlx(source: str | os.PathLike | GGUFForMLX, out: str | os.PathLike, mode: str = "keep", *,
                progress: Progress = SILENT) -> Path:
    """Write the MLX repo directory `out` (which must not exist) from a GGUF (a path, or `read_gguf`'s
    answer, whose mode then counts); return it."""
    import gguf
    import mlx.core as mx

    plan = source if isinstance(source, GGUFForMLX) else read_gguf(source, mode)
    src, reader, meta, tensors, config = plan.path, plan.reader, plan.meta, plan.tensors, dict(plan.config)
    mode = plan.mode
    keep_q8 = mode == "keep"
    out = Path(out).expanduser()
    if out.exists():
        raise EdgespecError(f"{out} already exists; choose another --out")

    work = out.with_name(f".{out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        progress.begin(f"converting {len(tensors)} tensors to MLX", total=len(tensors))
        weights: dict = {}
        float_dtype = {"fp32": mx.float32, "fp16": mx.float16}.get(mode)
        for name, t in tensors.items():
            hf = _hf_name(name)
            q8 = keep_q8 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            if q8:
                wq, scales, biases = _q8_0_as_mlx(np.asarray(t.data), t.shape[::-1])
                rows = _unpermute(np.arange(wq.shape[0]), name, config)
                weights[f"{hf}.weight"] = mx.array(wq[rows])
                weights[f"{hf}.scales"] = mx.array(scales[rows])
                weights[f"{hf}.biases"] = mx.array(biases[rows])
            else:
                data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(int(n) for n in t.shape[::-1]))
                data = data[_unpermute(np.arange(data.shape[0]), name, config)]
                kept = mx.array(np.ascontiguousarray(data)) if t.tensor_type != gguf.GGMLQuantizationType.F16 \
                    else mx.array(np.ascontiguousarray(data).astype(np.float16))
                weights[f"{hf}.{name.rsplit('.', 1)[1]}"] = kept.astype(float_dtype) if float_dtype else kept
            progress.advance()
        if any(k.endswith(".scales") for k in weights):
            config["quantization"] = {"group_size": Q8_GROUP, "bits": 8, "mode": "affine"}
            config["quantization_config"] = dict(config["quantization"])
        mx.save_safetensors(str(work / "model.safetensors"), weights, metadata={"format": "mlx"})
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        progress.end()
        progress.begin("rebuilding the tokenizer and checking it against llama.cpp")
        _write_tokenizer(reader, meta, work)
        _check_tokenizer(src, work)
        progress.end()
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def mode_for_quant(quant: str | None) -> str:
    """`export FILE.gguf --format mlx --quant ...` -> a gguf_to_mlx mode: none = keep, mlx:fp32 / mlx:fp16
    (or fp32 / fp16) = dequantize."""
    q = (quant or "").strip().lower().removeprefix("mlx:")
    if not q:
        return "keep"
    if q in ("fp32", "fp16"):
        return q
    raise EdgespecError(f"a GGUF becomes MLX as it is (keep: Q8_0 as MLX 8-bit) or dequantized (--quant mlx:fp32 "
                        f"or mlx:fp16), not {quant!r}; for MLX 4- or 8-bit, export the Hugging Face checkpoint")


def _config(meta: dict, arch: str, tensors: dict) -> dict:
    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_vocab = int(tensors["token_embd.weight"].shape[1])
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    cls, model_type = _ARCHITECTURES[arch]
    config = {"architectures": [cls], "model_type": model_type, "hidden_size": n_embd,
              "intermediate_size": int(key("feed_forward_length")), "num_hidden_layers": int(key("block_count")),
              "num_attention_heads": n_head, "num_key_value_heads": int(key("attention.head_count_kv", n_head)),
              "head_dim": int(key("attention.key_length", n_embd // n_head)),
              "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
              "rope_theta": float(key("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(key("context_length", 2048)), "vocab_size": n_vocab,
              "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": "float32"}
    for name, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if field in meta:
            config[name] = int(meta[field])
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def _hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj` (the tensor's module)."""
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if parts[0] in _TOP_NAMES and len(parts) == 2:
        return _TOP_NAMES[parts[0]]
    raise ModelFileError(f"GGUF tensor {name} has no Hugging Face counterpart this reader knows")


def _unpermute(rows: np.ndarray, name: str, config: dict) -> np.ndarray:
    """Row order back from llama.cpp's interleaved rope pairs to Hugging Face's rotate-half halves (llama's
    q and k only; exporters/gguf_export.py permutes them the other way)."""
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if config["model_type"] != "llama" or kind not in ("attn_q", "attn_k"):
        return rows
    n_head = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _q8_0_as_mlx(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 blocks (f16 d, 32 x int8 q; w = d*q) as MLX 8-bit affine groups of 32: values q+128 packed four
    to a uint32 (first in the low byte), scale d, bias -128*d, so scale*(q+128)+bias = d*q exactly."""
    rows, cols = int(shape[0]), int(shape[1])
    blocks = raw.reshape(rows, cols // Q8_GROUP, 2 + Q8_GROUP)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    packed = q.astype(np.uint8).reshape(rows, cols).view(np.uint32)  # little-endian: element 0 in the low byte
    return np.ascontiguousarray(packed), d, -128.0 * d


def _write_tokenizer(reader, meta: dict, out: Path) -> None:
    """tokenizer.json (byte-level BPE, the pre-tokenizer `tokenizer.ggml.pre` names) and tokenizer_config.json."""
    from edgespec.runtimes.hf_tokenizer import _LLAMA3_REGEX, _QWEN2_REGEX

    def field(name):
        f = reader.fields.get(f"tokenizer.ggml.{name}")
        return f.contents() if f is not None else None

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelFileError(f"tokenizer {meta.get('tokenizer.ggml.model')!r}: GGUF -> MLX rebuilds byte-level BPE "
                             "(gpt2) tokenizers only")
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    normalizer = None
    if pre in ("gpt-2", "default"):
        pre_tok = byte_level
    elif pre == "smollm":
        pre_tok = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    elif pre in ("qwen2", "llama-bpe"):
        regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False}]}
        normalizer = {"type": "NFC"} if pre == "qwen2" else None
    else:
        raise ModelFileError(f"pre-tokenizer {pre!r}: GGUF -> MLX rebuilds gpt-2, smollm, qwen2 and llama-bpe")
    tokens, types, merges = field("tokens"), field("token_type"), field("merges") or []
    special = [i for i, t in enumerate(types) if t in (3, 4)]  # CONTROL, USER_DEFINED
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if add_bos and bos is not None:
        post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}},
                                                          {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    data = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i in special],
            "normalizer": normalizer, "pre_tokenizer": pre_tok, "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens) if types[i] != _UNUSED},
                      "merges": list(merges)}}
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    tc = {"add_bos_token": add_bos, "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast",
          "bos_token": tokens[bos] if bos is not None else None, "eos_token": tokens[eos] if eos is not None else None,
          "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template")
    if template:
        tc["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")


def _check_tokenizer(gguf_path: Path, out: Path) -> None:
    from edgespec.exporters.gguf_export import check_tokenizer_parity

    parity = check_tokenizer_parity(gguf_path, out)
    if parity["mismatches"]:
        raise EdgespecError(f"the tokenizer rebuilt from {gguf_path.name} splits {parity['mismatches']} of "
                            f"{parity['texts']} check texts differently from llama.cpp (first: "
                            f"{parity['first_mismatch']}); nothing was written")
