"""A Hugging Face fast tokenizer (tokenizer.json) as llama.cpp needs it: the ONNX and Core ML runtimes
read their vocabulary through it (runtimes/hf_vocab.py), the GGUF exporter writes it into a GGUF.

Only byte-level BPE tokenizers are handled (GPT-2 style: SmolLM2, Qwen2.5, Llama 3); SentencePiece
vocabularies (Llama 2, TinyLlama) are refused with a clear message.

llama.cpp does not run the tokenizer.json pre-tokenizer: it has a fixed list of pre-tokenizers, one of
which `tokenizer.ggml.pre` names. llama.cpp's own converter guesses the name from a hash of the
tokenization of a fixed text; here the name comes from the structure of the pre-tokenizer, and the
export then checks that llama.cpp tokenizes a text corpus exactly like the Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import gguf

from edgespec.errors import EdgespecError

# The split regexes of the pre-tokenizers llama.cpp knows (src/llama-vocab.cpp), as tokenizer.json
# spells them in a `Split` pre-tokenizer.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEX_PRE = {_QWEN2_REGEX: "qwen2", _LLAMA3_REGEX: "llama-bpe"}

# The names a tokenizer.json structure maps to (each one llama.cpp accepts as tokenizer.ggml.pre).
KNOWN_PRE = ("gpt-2", "smollm", "qwen2", "llama-bpe")

# Text for the tokenizer parity check done after every GGUF export: words, contractions, digits,
# whitespace runs, code, accents, CJK and emoji, where pre-tokenizers differ.
PARITY_TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; don't they? WE'LL SEE. It's 3:45pm on 2024-06-01.",
    "1234567890 3.14159 1,000,000 +42 -7 0x1F 1e-5 98765 12 345 6789",
    "    indented\n\n\n\tline with tab\r\nwindows line   three spaces   end  ",
    "def f(x: int) -> int:\n    return x ** 2 + 1  # square plus one\n\nprint(f(10))\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * c; }  // loop",
    "Café naïve façade résumé — “quotes” and ‘single’ … ellipsis",
    "你好，世界。こんにちは世界。안녕하세요 세계. Привет, мир! مرحبا بالعالم",
    "emoji: 🤖🚀 ✓ ✗ ★ ♥ 👍🏽 and symbols: © ® ™ € £ ¥ ∑ ∞ ≈ ≠",
    "<html><body><p class=\"x\">text</p></body></html>",
    "a  b   c    d\n e\n\n f",
    " leading space",
    "trailing newline\n",
)


class TokenizerError(EdgespecError):
    """The tokenizer cannot be expressed for llama.cpp, or the pair's tokenizers differ."""


@dataclass(frozen=True)
class HFTokenizer:
    """tokenizer.json (+ tokenizer_config.json) of a checkpoint, read without transformers."""

    path: Path          # the checkpoint directory
    data: dict          # tokenizer.json
    config: dict        # tokenizer_config.json ({} when absent)

    @classmethod
    def load(cls, directory: Path) -> "HFTokenizer":
        file = directory / "tokenizer.json"
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenizerError(f"{directory} has no tokenizer.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{file} is not valid JSON ({exc})") from None
        cfg_file = directory / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        tok = cls(directory, data, config)
        tok._check_supported()
        return tok

    def _check_supported(self) -> None:
        model = self.data.get("model", {})
        if model.get("type") != "BPE":
            raise TokenizerError(f"{self.path.name}: tokenizer model {model.get('type')!r} is not supported; the "
                                 "exporters handle byte-level BPE tokenizers (GPT-2 style: SmolLM2, Qwen2.5, Llama 3)")
        if not _has_byte_level(self.data.get("pre_tokenizer")):
            raise TokenizerError(f"{self.path.name}: the tokenizer is a BPE without byte-level pre-tokenization "
                                 "(SentencePiece style, as Llama 2 uses); only byte-level BPE is supported")
        if not model.get("merges"):
            raise TokenizerError(f"{self.path.name}: tokenizer.json has no BPE merges")

    # -- vocabulary as GGUF wants it --------------------------------------------------------------

    def vocab_size(self) -> int:
        ids = list(self.data["model"]["vocab"].values()) + [t["id"] for t in self.data.get("added_tokens", [])]
        return max(ids) + 1

    def tokens_and_types(self, n_vocab: int) -> tuple[list[str], list[int]]:
        """llama.cpp's view of the vocabulary: one text and type per id, padded to the embedding rows.

        Ids with no token (an embedding padded past the tokenizer, as Qwen2.5 does) become `[PAD<i>]`
        of type UNUSED; added tokens marked special are CONTROL, other added tokens USER_DEFINED.
        """
        size = self.vocab_size()
        if size > n_vocab:
            raise TokenizerError(f"{self.path.name}: the tokenizer has {size} tokens but the model's embedding only "
                                 f"{n_vocab} rows (vocab_size in config.json)")
        tokens: list[str | None] = [None] * n_vocab
        types = [int(gguf.TokenType.NORMAL)] * n_vocab
        for text, i in self.data["model"]["vocab"].items():
            tokens[i] = text
        for added in self.data.get("added_tokens", []):
            i = added["id"]
            tokens[i] = added["content"]
            types[i] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
        for i, text in enumerate(tokens):
            if text is None:
                tokens[i] = f"[PAD{i}]"
                types[i] = int(gguf.TokenType.UNUSED)
        return tokens, types  # type: ignore[return-value]

    def llama_cpp_pre(self) -> str:
        """The `tokenizer.ggml.pre` name whose splitting equals this tokenizer.json's pre-tokenizer."""
        norm = self.data.get("normalizer")
        if norm and not (norm.get("type") == "NFC" or (norm.get("type") == "Sequence" and not norm.get("normalizers"))):
            raise TokenizerError(f"{self.path.name}: tokenizer normalizer {json.dumps(norm)[:120]} "
                                 "has no llama.cpp equivalent")
        pre = self.data.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        kinds = [s.get("type") for s in steps]
        byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
        if byte_level is not None and byte_level.get("add_prefix_space"):
            raise TokenizerError(f"{self.path.name}: a byte-level pre-tokenizer with add_prefix_space has no "
                                 "llama.cpp equivalent")
        if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level.get("use_regex", True):
            return "smollm"
        if kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True):
            pattern = steps[0].get("pattern", {}).get("Regex")
            if pattern in SPLIT_REGEX_PRE and steps[0].get("behavior") == "Isolated":
                return SPLIT_REGEX_PRE[pattern]
        raise TokenizerError(f"{self.path.name}: pre-tokenizer {json.dumps(pre)[:160]} matches none that llama.cpp "
                             f"knows here ({', '.join(KNOWN_PRE)})")

    # -- identity ---------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 of what decides token ids: vocabulary, merges, added tokens, normalizer, pre-tokenizer."""
        d = self.data
        canon = {
            "vocab": sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1]),
            "merges": [m if isinstance(m, str) else " ".join(m) for m in d["model"].get("merges", [])],
            "added": sorted((t["id"], t["content"], bool(t.get("special"))) for t in d.get("added_tokens", [])),
            "normalizer": d.get("normalizer"),
            "pre_tokenizer": d.get("pre_tokenizer"),
        }
        return hashlib.sha256(json.dumps(canon, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def _has_byte_level(pre: dict | None) -> bool:
    if not pre:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"

