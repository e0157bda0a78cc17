"""Tiny but real GGUF language models for fast tests through real llama.cpp.

The models are llama-architecture decoders with random f32 weights (about 100k parameters, 0.45 MB
on disk), written with the ``gguf`` package, with a byte-level BPE tokenizer that llama.cpp accepts
(``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre = "gpt-2"``).  One loads in about 10 ms and
generates thousands of tokens per second on one core, so speculative-decoding tests can use real
llama.cpp arithmetic instead of mocks.

Vocabulary (identical for every seed at a given ``n_vocab``, so a draft/target vocabulary check
passes; the default ``n_vocab`` is 300):

* ids ``0..255``: the 256 byte-level symbols, **token id == byte value** (GPT-2 ``bytes_to_unicode``
  spelling, e.g. id 32 is ``"Ġ"``, id 10 is ``"Ċ"``), type NORMAL;
* ids ``256 .. n_vocab-6``: BPE merges learned deterministically from a small built-in English text
  (``"he"``, ``"Ġt"``, ``"Ġthe"``, ...; 39 of them at n_vocab 300), type NORMAL.  The text yields at
  most 241 merges; beyond that (n_vocab > 502) the rest are ``<|unused_K|>`` tokens of type UNUSED.
  n_vocab must be at least 262: llama.cpp refuses a BPE vocabulary without merges;
* the last five ids, type CONTROL: ``<|bos|>``, ``<|endoftext|>``, ``<|pad|>``, ``<|im_start|>``,
  ``<|im_end|>`` (295..299 at n_vocab 300).  ``bos_token_id`` = ``<|bos|>``, ``eos_token_id`` =
  ``<|endoftext|>``, ``padding_token_id`` = ``<|pad|>``, ``eot_token_id`` = ``<|im_end|>``;
  llama.cpp's end-of-generation set is {``<|endoftext|>``, ``<|im_end|>``}.  ``add_bos_token`` is
  **True**, ``add_eos_token`` False.
* ``tokenizer.chat_template`` is ChatML (``<|im_start|>role\ncontent<|im_end|>\n``).

Weights: random normal from ``numpy.random.default_rng(seed)``.  The output matrix has standard
deviation ``logit_scale / sqrt(n_embd)``; since the final RMS norm makes the hidden state's norm about
``sqrt(n_embd)``, ``logit_scale`` is roughly the standard deviation of the logits over the vocabulary.
The default (8.0) makes the next-token distribution peaky (median top-1 probability about 0.8, see
``tests/test_tiny_models.py``); lower it for smoother distributions in statistical tests (4.0: median
top-1 about 0.46).

``perturb_from=S, perturb_scale=eps`` gives the weights of seed ``S`` plus noise, where each tensor's
noise has standard deviation ``eps`` times that tensor's initialisation scale (norm weights: ``eps``).
That is a "good draft" which mostly agrees with the seed-``S`` target (greedy agreement about 0.9 at
eps 0.02, 0.8 at 0.05); a model with another seed is a "bad draft" (agreement about 0).

Pitfalls met on the way (llama.cpp in llama-cpp-python 0.3.36):

* the pre-tokenizer is spelled ``"gpt-2"``; ``"gpt2"`` fails with "unknown pre-tokenizer type";
* tensor names need the ``.weight`` suffix (``token_embd.weight``), the gguf name table has none;
* ``tokenizer.ggml.merges`` must exist and be non-empty for a ``gpt2`` tokenizer;
* an EOS with a made-up name (``<|eos|>``) draws "special_eos_id is not in special_eog_ids";
* with ``logits_all=False``, ``Llama.eval`` does not fill ``Llama.scores``: read the last row with
  ``llama_cpp.llama_get_logits_ith(llm.ctx, -1)``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

import gguf

__all__ = [
    "DEFAULT_N_VOCAB",
    "SPECIAL_TOKENS",
    "bytes_to_unicode",
    "tiny_vocab",
    "special_ids",
    "write_tiny_llama",
    "write_corrupt_copies",
    "write_tiny_pair",
]

DEFAULT_N_VOCAB = 300
DEFAULT_LOGIT_SCALE = 8.0
DEFAULT_SPECIAL_BIAS = -30.0
DEFAULT_TEXT_BIAS = 0.0

SPECIAL_TOKENS = ("<|bos|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Text the BPE merges are learned from: plain English plus a little code, so that ordinary prompts
# tokenize into a mix of merged tokens and single bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
In the beginning there was the word, and the word was with the people of the town. They said that
the weather is nice today and that they would go to the market in the morning. Hello world! This is
a test of the tokenizer, and it should handle the most common English words: the, of, and, to, in,
is, that, it, was, for, on, are, with, as, they, at, be, this, have, from, or, one, had, by, there.
def hello_world():
    print("hello world")
    return the_answer + 1
for i in range(10):
    if i % 2 == 0:
        print(i)
She sells sea shells on the sea shore, and the shells that she sells are sea shells for sure.
When the going gets tough, the tough get going; the rest of them stay at home and read the news.
"""

# GPT-2's pre-tokenizer regex with ASCII classes (Python's re has no \p{L}); it only shapes which
# merges are learned, llama.cpp applies its own "gpt2" pre-tokenizer at run time.
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _learn_merges(n_merges: int) -> list[tuple[str, str]]:
    """Deterministic BPE training on the built-in corpus; returns up to n_merges pairs."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(_CORPUS))
    segs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, freq in words.items():
            s = segs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += freq
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        for w, s in segs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segs[w] = out
    return merges


def tiny_vocab(n_vocab: int = DEFAULT_N_VOCAB) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of the tiny tokenizer with n_vocab entries."""
    n_special = len(SPECIAL_TOKENS)
    if n_vocab < 256 + n_special + 1:  # llama.cpp refuses a BPE vocabulary without merges
        raise ValueError(f"n_vocab must be >= {257 + n_special} (256 bytes, at least one merge, "
                         f"{n_special} special tokens)")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [int(gguf.TokenType.NORMAL)] * 256
    n_merged = n_vocab - 256 - n_special
    merge_pairs = _learn_merges(n_merged)
    for a, b in merge_pairs:
        tokens.append(a + b)
        types.append(int(gguf.TokenType.NORMAL))
    for k in range(n_merged - len(merge_pairs)):
        tokens.append(f"<|unused_{k}|>")
        types.append(int(gguf.TokenType.UNUSED))
    tokens.extend(SPECIAL_TOKENS)
    types.extend([int(gguf.TokenType.CONTROL)] * n_special)
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    return tokens, types, [f"{a} {b}" for a, b in merge_pairs]


def special_ids(n_vocab: int = DEFAULT_N_VOCAB) -> dict[str, int]:
    """Ids of the special tokens: {'bos': ..., 'eos': ..., 'pad': ..., 'im_start': ..., 'im_end': ...}."""
    base = n_vocab - len(SPECIAL_TOKENS)
    return {name: base + i for i, name in enumerate(("bos", "eos", "pad", "im_start", "im_end"))}


def _init_weights(rng: np.random.Generator, *, n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff,
                  logit_scale, bias: np.ndarray) -> dict[str, tuple[np.ndarray, float]]:
    """name -> (array in numpy (out, in) layout, init scale). Order is the file's tensor order."""
    T, N = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    s_in, s_ff = 1.0 / np.sqrt(n_embd), 1.0 / np.sqrt(n_ff)

    def normal(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale), float(scale))

    def ones(n):
        return (np.ones(n, dtype=np.float32), 1.0)

    w: dict[str, tuple[np.ndarray, float]] = {}
    w[N[T.TOKEN_EMBD]] = normal((n_vocab, n_embd), 1.0)
    for i in range(n_layer):
        w[N[T.ATTN_NORM].format(bid=i)] = ones(n_embd)
        w[N[T.ATTN_Q].format(bid=i)] = normal((n_embd, n_embd), s_in)
        w[N[T.ATTN_K].format(bid=i)] = normal((n_embd_kv, n_embd), s_in)
        w[N[T.ATTN_V].format(bid=i)] = normal((n_embd_kv, n_embd), s_in)
        w[N[T.ATTN_OUT].format(bid=i)] = normal((n_embd, n_embd), s_in)
        w[N[T.FFN_NORM].format(bid=i)] = ones(n_embd)
        w[N[T.FFN_GATE].format(bid=i)] = normal((n_ff, n_embd), s_in)
        w[N[T.FFN_UP].format(bid=i)] = normal((n_ff, n_embd), s_in)
        w[N[T.FFN_DOWN].format(bid=i)] = normal((n_embd, n_ff), s_ff)
    w[N[T.OUTPUT_NORM]] = ones(n_embd)
    w[N[T.OUTPUT]] = normal((n_vocab, n_embd), logit_scale * s_in)

    # A constant channel gives the output layer a per-token bias (the llama graph has no output
    # bias): residual dimension 0 is _BIAS_CHANNEL in every embedding and no layer writes to it, so
    # after the final RMS norm it is about _BIAS_CHANNEL / rms(h), and output[:, 0] scales it into
    # `bias`.  The edits come after all random draws, so the weights elsewhere depend only on seed.
    w[N[T.TOKEN_EMBD]][0][:, 0] = _BIAS_CHANNEL
    for i in range(n_layer):
        w[N[T.ATTN_OUT].format(bid=i)][0][0, :] = 0.0
        w[N[T.FFN_DOWN].format(bid=i)][0][0, :] = 0.0
    w[N[T.OUTPUT]][0][:, 0] = bias.astype(np.float32) * np.float32(_RMS_ESTIMATE / _BIAS_CHANNEL)
    return w


# Residual value of the bias channel, and the typical rms of the final hidden state (measured through
# llama.cpp on the default shapes: the realised bias is 0.7 to 1.4 times the requested one).
_BIAS_CHANNEL = 2.0
_RMS_ESTIMATE = 1.6


def _logit_bias(tokens: list[str], types: list[int], special_bias: float, text_bias: float) -> np.ndarray:
    """special_bias on CONTROL/UNUSED tokens, text_bias on tokens spelling printable ASCII."""
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    bias = np.zeros(len(tokens), dtype=np.float64)
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED)):
            bias[i] = special_bias
        else:
            raw = bytes(u2b[c] for c in tok)
            if all(32 <= b < 127 or b in (9, 10) for b in raw):
                bias[i] = text_bias
    return bias


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_vocab: int = DEFAULT_N_VOCAB,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 512,
    logit_scale: float = DEFAULT_LOGIT_SCALE,
    special_bias: float = DEFAULT_SPECIAL_BIAS,
    text_bias: float = DEFAULT_TEXT_BIAS,
    perturb_from: int | None = None,
    perturb_scale: float = 0.0,
    name: str | None = None,
    rename_tokens: dict[int, str] | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a tiny llama-architecture GGUF (f32) to ``path`` and return the path.

    ``perturb_from=S`` uses the weights of seed ``S`` plus noise of relative size ``perturb_scale``
    drawn from a stream keyed by ``seed`` (independent of the weights even when ``seed == S``; with
    ``perturb_scale=0`` the weights equal the seed-``S`` model's).

    ``logit_scale`` scales only the random part of the output matrix, so it acts like an inverse
    temperature: the greedy path of a seed does not depend on it.  ``special_bias`` is added (roughly,
    0.7 to 1.4 times) to the logits of the CONTROL/UNUSED tokens, so that by default the model never
    emits BOS/EOS/chat tokens on its own; ``text_bias`` likewise favours tokens that spell printable
    ASCII (0 by default; 4 makes output look more like text).  ``rename_tokens`` replaces the text of
    some tokens (for vocabulary-mismatch tests).  ``split_max_tensors=N`` writes a split model
    (``STEM-00001-of-0000K.gguf`` ..., at most N tensors per shard, as ``gguf-split`` does) and returns
    the first shard's path.
    """
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError("head dimension must be even for RoPE")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = tiny_vocab(n_vocab)
    for token_id, text in (rename_tokens or {}).items():  # a vocabulary that differs in one token's text
        tokens[token_id] = text
    ids = special_ids(n_vocab)
    dims = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                n_ff=n_ff, logit_scale=logit_scale, bias=_logit_bias(tokens, types, special_bias, text_bias))
    if perturb_from is None:
        weights = _init_weights(np.random.default_rng(seed), **dims)
    else:
        weights = _init_weights(np.random.default_rng(perturb_from), **dims)
        noise_rng = np.random.default_rng([seed, 0x5EED])
        for key, (arr, scale) in weights.items():
            noise = noise_rng.standard_normal(arr.shape, dtype=np.float32)
            weights[key] = (arr + np.float32(perturb_scale * scale) * noise, scale)

    if name is None:
        name = f"tiny-llama-s{seed}" if perturb_from is None else f"tiny-llama-s{perturb_from}-p{perturb_scale:g}-s{seed}"

    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp spells this pre-tokenizer "gpt-2"; "gpt2" is rejected
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    writer.add_pad_token_id(ids["pad"])
    writer.add_eot_token_id(ids["im_end"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    for key, (arr, _scale) in weights.items():
        writer.add_tensor(key + ".weight", np.ascontiguousarray(arr, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
        return shards[0] if shards else path
    return path


def write_tiny_pair(directory: str | os.PathLike[str], *, seed: int = 0, perturb_scale: float = 0.02,
                    bad_seed: int | None = None, **kw) -> dict[str, Path]:
    """Target (seed), good draft (target + noise) and bad draft (another seed) in ``directory``."""
    d = Path(directory)
    bad_seed = seed + 1000 if bad_seed is None else bad_seed
    return {
        "target": write_tiny_llama(d / f"target-s{seed}.gguf", seed=seed, **kw),
        "good_draft": write_tiny_llama(d / f"draft-good-s{seed}.gguf", seed=seed + 1, perturb_from=seed,
                                       perturb_scale=perturb_scale, **kw),
        "bad_draft": write_tiny_llama(d / f"draft-bad-s{bad_seed}.gguf", seed=bad_seed, **kw),
    }


def write_corrupt_copies(src: str | os.PathLike[str], directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Bad inputs made from a good GGUF ``src``, written into ``directory``.

    Keys: ``truncated`` (the first half of src's bytes), ``garbage`` (4 KiB of seeded random bytes
    that do not start with the GGUF magic, named .gguf), ``empty`` (a zero-byte .gguf) and
    ``bad_version`` (src with the format version field set to 999).
    """
    src, d = Path(src), Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    data = src.read_bytes()
    out = {
        "truncated": d / f"{src.stem}.truncated.gguf",
        "garbage": d / "garbage.gguf",
        "empty": d / "empty.gguf",
        "bad_version": d / f"{src.stem}.badversion.gguf",
    }
    out["truncated"].write_bytes(data[: len(data) // 2])
    junk = bytearray(np.random.default_rng(1234).integers(0, 256, size=4096, dtype=np.uint8).tobytes())
    junk[:4] = b"JUNK"
    out["garbage"].write_bytes(bytes(junk))
    out["empty"].write_bytes(b"")
    out["bad_version"].write_bytes(data[:4] + (999).to_bytes(4, "little") + data[8:])
    return out


if __name__ == "__main__":  # python tests/tiny_models.py OUTDIR
    import sys

    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-models")
    for role, p in write_tiny_pair(outdir).items():
        print(role, p, p.stat().st_size)
