"""A Hugging Face checkpoint of a real architecture and shape with seeded random weights, for benchmarks.

Where no model can be carried (a GPU machine with no network, say) the exporters can still write a
GGUF of exactly a real model's geometry, so what speculation costs there (the verify pass by size,
the draft step, the memory a plan predicts) is measured on the shapes that matter:

    ckpt = random_checkpoint("qwen2.5-1.5b", directory)
    export_gguf(ckpt, out_dir, ["f16", "q4_k_m"])        # the same path as `edgespec export`

The directory holds what the exporters read besides weights (config.json, a byte-level BPE
tokenizer.json with Qwen2's pre-tokenizer trained on a built-in text, tokenizer_config.json with a
ChatML template); the weights are never written as safetensors: `tensor(name)` draws each one when
the GGUF writer asks for it, from a stream keyed by (seed, tensor name, chunk), in parallel threads:
random sign and mantissa bits under one exponent, straight from the bit generator (about 50 times
cheaper than normal draws: some 600 M 64-bit words, 2.4 G weights, per second on one core here), so
a 7B model's 15 GB of f16 costs seconds, not a 15 GB intermediate file. Memory: one tensor at a time
(the largest, a 7B's embedding, is 1.1 GB of f16).

The tokenizer has about a thousand tokens; the embedding keeps the real vocabulary's rows (151936),
and ids past the tokenizer are `[PAD<i>]` tokens, as the exporter writes for any padded embedding.
Weights have a random sign and a magnitude uniform within one power of two, their rms within 1.4x of
0.02 (Qwen2's initializer range), except the output matrix, whose rms is about
`logit_scale / sqrt(hidden)`: the logits then spread by about `logit_scale`, so next-token
distributions are peaked like a trained model's rather than flat, and a lower-bit copy mostly agrees
with the original (a flat distribution's argmax flips at the slightest noise). The output rows of the
special tokens are zero, so a random model practically never ends its generation by itself.
Acceptance between such copies says nothing about real models; costs and memory do.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint, TensorRef

# config.json fields of real models (Qwen2.5 base configs), plus a tiny one for tests.
QWEN2_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                "use_sliding_window": False, "torch_dtype": "float16"}
CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    # The same architecture at a size CI runs in seconds.
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 2048, "tie_word_embeddings": True,
             "max_position_embeddings": 4096},
}

INIT_STD = 0.02
DEFAULT_LOGIT_SCALE = 8.0
CHUNK_ELEMENTS = 1 << 22  # elements per random stream: results do not depend on the thread count
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_SIZE = 1024

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def config_for(size: str) -> dict:
    """config.json of a named size (see CONFIGS)."""
    if size not in CONFIGS:
        raise EdgespecError(f"unknown model size {size!r}; use one of {', '.join(CONFIGS)}")
    return {**QWEN2_COMMON, **CONFIGS[size], "_name_or_path": f"random-{size}"}


def _tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2ForCausalLM checkpoint, in Hugging Face names, with its shape."""
    E, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    kv = E // H * KV
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                       p + "self_attn.q_proj.weight": (E, E), p + "self_attn.q_proj.bias": (E,),
                       p + "self_attn.k_proj.weight": (kv, E), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, E), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (E, E), p + "mlp.gate_proj.weight": (F, E),
                       p + "mlp.up_proj.weight": (F, E), p + "mlp.down_proj.weight": (E, F)})
    shapes["model.norm.weight"] = (E,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, E)
    return shapes


@dataclass
class RandomCheckpoint(Checkpoint):
    """A Checkpoint whose weights are drawn on demand (f16), never stored; see the module docstring."""

    seed: int = 0
    logit_scale: float = DEFAULT_LOGIT_SCALE
    special_ids: tuple[int, ...] = ()
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)

    def _std(self, name: str) -> float:
        head = name == "lm_head.weight" or (name == "model.embed_tokens.weight" and self.tied_embeddings)
        return self.logit_scale / np.sqrt(self.n_embd) if head else INIT_STD

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float16 (what a real f16 checkpoint holds); norms are ones, the rest normal."""
        shape = self.tensors[name].shape
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return np.ones(shape, dtype=np.float16)
        bits = np.empty(int(np.prod(shape)), dtype=np.uint16)
        exponent = np.uint16(_f16_exponent(self._std(name)) << 10)
        key = zlib.crc32(name.encode())

        def fill(chunk: int) -> None:
            # Random sign and mantissa bits under one exponent: |w| uniform in [2^e, 2^(e+1)). Raw
            # generator words cost a fiftieth of normal draws (a 7B model is 7.6e9 weights).
            start = chunk * CHUNK_ELEMENTS
            part = bits[start:start + CHUNK_ELEMENTS]
            rng = np.random.default_rng([self.seed, key, chunk])
            raw = rng.bit_generator.random_raw(-(-len(part) // 4)).view(np.uint16)[:len(part)]
            np.bitwise_and(raw, np.uint16(0x83FF), out=part)
            np.bitwise_or(part, exponent, out=part)

        n_chunks = -(-len(bits) // CHUNK_ELEMENTS)
        if n_chunks == 1 or self.n_threads == 1:
            for c in range(n_chunks):
                fill(c)
        else:
            with ThreadPoolExecutor(min(self.n_threads, n_chunks)) as pool:
                list(pool.map(fill, range(n_chunks)))
        out = bits.view(np.float16).reshape(shape)
        if name in ("lm_head.weight", "model.embed_tokens.weight") and self._std(name) != INIT_STD:
            out[list(self.special_ids)] = 0  # special tokens score 0, far below the peaked top logits
        return out


def _f16_exponent(std: float) -> int:
    """The f16 exponent field whose magnitudes [2^e, 2^(e+1)) have an rms nearest `std` (rms of a
    uniform magnitude there is 1.528 x 2^e), so the drawn weights' spread is within 1.4x of it."""
    e = int(round(np.log2(std / 1.528)))
    return min(30, max(1, e + 15))


def train_tokenizer(directory: Path, vocab_size: int = TOKENIZER_SIZE) -> dict[str, int]:
    """A byte-level BPE tokenizer.json with Qwen2's pre-tokenizer (NFC, its split regex, byte level),
    trained on the exporter's own sample texts; returns the special tokens' ids."""
    from edgespec.exporters.gguf_export import QUALITY_TEXT
    from edgespec.runtimes.hf_tokenizer import PARITY_TEXTS

    try:
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    except ImportError:  # pragma: no cover - the export extra (and transformers) bring it
        raise EdgespecError("random checkpoints train their tokenizer with the `tokenizers` package: "
                            "pip install tokenizers") from None
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([QUALITY_TEXT, *PARITY_TEXTS] * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def random_checkpoint(size: str | dict, directory: str | os.PathLike, *, seed: int = 0,
                      logit_scale: float = DEFAULT_LOGIT_SCALE, n_threads: int | None = None) -> RandomCheckpoint:
    """Write config and tokenizer files of `size` (a CONFIGS name or a config dict) to `directory` and
    return the checkpoint; its weights exist only as `tensor()` draws."""
    config = config_for(size) if isinstance(size, str) else {**QWEN2_COMMON, **size}
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ids = train_tokenizer(d)
    config = {**config, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False, "chat_template": CHATML,
        "model_max_length": config["max_position_embeddings"]}, indent=1))
    tensors = {name: TensorRef(d / "(drawn on demand)", "F16", shape, 0, int(np.prod(shape)) * 2)
               for name, shape in _tensor_shapes(config).items()}
    return RandomCheckpoint(path=d, config=config, tensors=tensors, family="qwen2", seed=seed,
                            logit_scale=logit_scale, special_ids=tuple(ids.values()),
                            n_threads=n_threads or os.cpu_count() or 1)
