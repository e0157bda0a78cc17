"""Tiny Hugging Face checkpoints the export tests build: transformers configs with random weights and a
byte-level BPE tokenizer trained here with the `tokenizers` library on tests/data/export_corpus.txt.

Tokenizer flavours, each the pre-tokenizer of a real model family (and a `tokenizer.ggml.pre` name
llama.cpp knows):

* ``gpt2``   - ByteLevel with GPT-2's regex                     -> ``gpt-2``
* ``smollm`` - Digits(individual) then ByteLevel (SmolLM2)      -> ``smollm``
* ``qwen2``  - Split(Qwen2 regex) then ByteLevel, NFC (Qwen2.5)  -> ``qwen2``
* ``llama3`` - Split(Llama 3 regex) then ByteLevel, BOS added     -> ``llama-bpe``

Special tokens: ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2) and, for llama3,
``<|begin_of_text|>`` (3) which the post-processor prepends (add_bos). The chat template is ChatML.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "export_corpus.txt"

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

EXPECTED_PRE = {"gpt2": "gpt-2", "smollm": "smollm", "qwen2": "qwen2", "llama3": "llama-bpe"}


def train_tokenizer(kind: str = "gpt2", vocab_size: int = 400, added: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on the repository's export corpus;
    `added`: tokens added after training that are not special, so they render as text (as Qwen2.5
    adds its `<tool_call>` tags)."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                            trainers)

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        tok.pre_tokenizer = byte_level
    elif kind == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif kind in ("qwen2", "llama3"):
        regex = QWEN2_REGEX if kind == "qwen2" else LLAMA3_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        raise ValueError(kind)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|begin_of_text|>"] if kind == "llama3" else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    tok.add_tokens([AddedToken(text, special=False, normalized=False) for text in added])
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tiny_checkpoint(directory: str | os.PathLike, *, family: str = "llama", tokenizer: str = "gpt2",
                          seed: int = 0, vocab_size: int = 400, pad_vocab: int = 0, n_layer: int = 2,
                          hidden: int = 64, n_head: int = 4, n_head_kv: int = 2, ff: int = 128,
                          tie: bool = False, rope_scaling: dict | None = None, init_range: float = 0.1,
                          max_positions: int = 512, perturb_from=None, perturb_scale: float = 0.0,
                          added: tuple[str, ...] = (), chat_template: str = CHATML) -> Path:
    """Save a tiny random LlamaForCausalLM / Qwen2ForCausalLM with a trained tokenizer to `directory`.

    `pad_vocab` extra embedding rows past the tokenizer (as Qwen2.5 has). `perturb_from=(model dir)`
    with `perturb_scale` makes a "good draft": that model's weights plus relative noise.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    tok = train_tokenizer(tokenizer, vocab_size, added)
    n_tok = tok.get_vocab_size()
    ids = {name: tok.token_to_id(name) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>")}
    bos_name = "<|begin_of_text|>" if tokenizer == "llama3" else "<|endoftext|>"
    eos_name = "<|im_end|>"
    common = dict(vocab_size=n_tok + pad_vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=n_layer,
                  num_attention_heads=n_head, num_key_value_heads=n_head_kv, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, initializer_range=init_range, tie_word_embeddings=tie,
                  bos_token_id=ids[bos_name], eos_token_id=ids[eos_name], pad_token_id=ids["<|endoftext|>"])
    if family == "llama":
        config = LlamaConfig(rope_theta=10000.0, rope_scaling=rope_scaling, **common)
        cls = LlamaForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(rope_theta=1000000.0, use_sliding_window=False, **common)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        if family == "qwen2":  # random init zeroes biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, init_range)
        for module in model.modules():  # norms start at 1; vary them so a wrong norm mapping shows
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
        if perturb_from is not None:
            base = cls.from_pretrained(perturb_from, dtype=torch.float32)
            gen = torch.Generator().manual_seed(seed + 7919)
            for (name, p), (_, q) in zip(model.named_parameters(), base.named_parameters()):
                noise = torch.randn(q.shape, generator=gen) * (q.std() if q.numel() > 1 else 1.0)
                p.copy_(q + perturb_scale * noise)
    model.save_pretrained(directory, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos_name, eos_token=eos_name,
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = tokenizer == "llama3"
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return directory


def corpus_texts() -> list[str]:
    """The corpus as check texts: each paragraph, and a few lines on their own."""
    text = CORPUS.read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return paragraphs + lines[::3] + [text]


def is_near_tie(logits_row, a: int, b: int, margin: float) -> bool:
    """True when tokens a and b are within `margin` of each other and of the row's maximum."""
    top = float(logits_row.max())
    return abs(float(logits_row[a]) - float(logits_row[b])) <= margin and top - min(float(logits_row[a]),
                                                                                    float(logits_row[b])) <= margin
