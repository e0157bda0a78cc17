"""A Hugging Face tokenizer (tokenizer.json and its config files) answering the Runtime protocol's
vocabulary questions exactly as llama.cpp answers them for the GGUF export of the same checkpoint.

Shared by the runtimes that run exported files (ONNX Runtime, layered ONNX, Core ML). Ids come from
the `tokenizers` library. `parse_special=False` sets its `encode_special_tokens`, so added tokens
marked special ("<|im_end|>") are encoded as plain text, while non-special added tokens are still
matched: llama.cpp's rule (it skips CONTROL tokens only). BOS/EOS are added by the flags
tokenizer_config.json (or the post-processor) gives, as gguf's SpecialVocab writes them into a GGUF.
Token texts, types, bytes and end-of-generation tokens follow llama.cpp (tests/test_onnx_runtime.py
checks every id against the llama.cpp runtime).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from edgespec.errors import ModelFileError
from edgespec.runtimes.base import VocabInfo

# llama.cpp finds special tokens by their text (src/llama-vocab.cpp); a GGUF from our exporter carries
# only bos/eos ids, so these rules decide its end-of-generation set and which tokens render as nothing.
_EOT_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<end_of_utterance>"}
_FIM_EOG_TEXTS = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",                      # FIM pad
                  "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",          # FIM repo
                  "<|file_sep|>"}                                                                # FIM file sep
EOG_TEXTS = frozenset(_EOT_TEXTS | _FIM_EOG_TEXTS | {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>"})
# Made CONTROL (rendered as no bytes) besides the end-of-generation ones: FIM prefix / suffix / middle.
_CONTROL_TEXTS = EOG_TEXTS | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"}
_RENDERED_TEXTS = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}  # gpt-oss: always shown as text


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is not valid JSON ({exc}); export the model again") from None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is stored as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_DECODER = _byte_decoder()


def _decode_byte_level(text: str) -> bytes:
    """A stored BPE token's bytes; a character outside the byte alphabet is written as llama.cpp does."""
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


class HFVocab:
    """The vocabulary of an exported model directory (or a bundle's tokenizer/): `info` is its VocabInfo."""

    def __init__(self, directory: str | os.PathLike, n_vocab: int, config: dict | None = None):
        import gguf
        from tokenizers import Tokenizer

        from edgespec.runtimes.hf_tokenizer import HFTokenizer

        self.directory, self.n_vocab = Path(directory), n_vocab
        hf = HFTokenizer.load(self.directory)  # refuses what is not byte-level BPE, as the exporters do
        self._tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        # The GGUF exporter's view of the vocabulary: text and token type per id (pads past the tokenizer).
        self._texts, types = hf.tokens_and_types(self.n_vocab)
        control = {int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED)}
        eog_ids = {i for i, t in enumerate(self._texts) if t in EOG_TEXTS}
        # o200k_harmony / solar-open: with <|return|> and <|call|> (or <|calls|> and <|flush|>), <|end|> is text
        present = set(self._texts) & EOG_TEXTS
        harmony_end = {"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present
        rendered = _RENDERED_TEXTS | ({"<|end|>"} if harmony_end else set())
        eog_ids = {i for i in eog_ids if self._texts[i] not in rendered}
        # llama.cpp renders CONTROL and UNUSED tokens as no bytes (CONTROL wins over USER_DEFINED), and makes
        # the special-looking texts CONTROL; the `rendered` ones it resets to USER_DEFINED.
        self._silent = np.array([(ty in control or tx in _CONTROL_TEXTS) and tx not in rendered
                                 for tx, ty in zip(self._texts, types)], dtype=bool)
        self._user_defined = np.array([ty == int(gguf.TokenType.USER_DEFINED) or tx in rendered
                                       for tx, ty in zip(self._texts, types)], dtype=bool)
        self._bytes: list[bytes | None] = [None] * self.n_vocab
        self._grammar_tokenizer = None
        self._template = self._read_chat_template(hf.config)

        config = read_json(self.directory / "config.json") if config is None else config
        generation = read_json(self.directory / "generation_config.json")
        bos = self._special_id(hf.config.get("bos_token"), config.get("bos_token_id"), generation.get("bos_token_id"))
        eos = self._special_id(hf.config.get("eos_token"), config.get("eos_token_id"), generation.get("eos_token_id"))
        self._add_bos = self._add_flag(hf, "bos", bos)
        self._add_eos = self._add_flag(hf, "eos", eos)
        # generation_config may list several end tokens (Llama 3 instruct); Hugging Face stops at each.
        extra = generation.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
        eog = eog_ids | {t for t in [eos, *extra] if isinstance(t, int) and 0 <= t < self.n_vocab}
        self.info = VocabInfo(n_vocab=self.n_vocab, vocab_type="bpe", bos=bos, eos=eos, add_bos=self._add_bos,
                               eog=frozenset(eog))

    def _special_id(self, token, *fallback_ids) -> int | None:
        """tokenizer_config's token (a string or {"content": ...}) by id, else the first id config files give."""
        content = token.get("content") if isinstance(token, dict) else token
        if isinstance(content, str):
            found = self._tokenizer.token_to_id(content)
            if found is not None:
                return int(found)
        for value in fallback_ids:
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and 0 <= value < self.n_vocab:
                return value
        return None

    def _add_flag(self, hf, kind: str, token: int | None) -> bool:
        """add_bos_token / add_eos_token from tokenizer_config.json, else whether the post-processor adds it."""
        flag = hf.config.get(f"add_{kind}_token")
        if isinstance(flag, bool):
            return flag and token is not None
        post = hf.data.get("post_processor") or {}
        for proc in post.get("processors", [post]):
            single = (proc.get("single") or []) if proc.get("type") == "TemplateProcessing" else []
            if len(single) > 1:
                edge = single[0] if kind == "bos" else single[-1]
                name = edge.get("SpecialToken", {}).get("id")
                if name is not None and self._tokenizer.token_to_id(name) == token:
                    return True
        return False

    def _read_chat_template(self, tokenizer_config: dict) -> str | None:
        template = tokenizer_config.get("chat_template")
        if template is None and (self.directory / "chat_template.jinja").is_file():
            template = (self.directory / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = read_json(self.directory / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: the default one, as a GGUF stores it
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._tokenizer.encode_special_tokens = not parse_special
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special:
            if self._add_bos:
                ids.insert(0, self.info.bos)
            if self._add_eos:
                ids.append(self.info.eos)
        return ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes[token]
        if piece is None:
            if self._silent[token]:
                piece = b""
            elif self._user_defined[token]:  # added tokens are stored as their text, not byte-encoded
                piece = self._texts[token].encode("utf-8")
            else:
                piece = _decode_byte_level(self._texts[token])
            self._bytes[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        return self._texts[token]

    def chat_template(self) -> str | None:
        return self._template

    def grammar_tokenizer(self):
        """llguidance's tokenizer from this tokenizer.json, for constrained output (built once)."""
        if self._grammar_tokenizer is None:
            from llguidance import LLTokenizer

            self._grammar_tokenizer = LLTokenizer(self._tokenizer.to_str(), n_vocab=self.n_vocab,
                                                  eos_token=self.info.eos)
        return self._grammar_tokenizer


class HFVocabMethods:
    """The Runtime protocol's vocabulary methods, answered by the runtime's `_vocab` (an HFVocab)."""

    _vocab: HFVocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self._vocab.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self._vocab.token_text(token)

    def chat_template(self) -> str | None:
        return self._vocab.chat_template()

    def grammar_tokenizer(self):
        return self._vocab.grammar_tokenizer()
