"""The vocabulary check runs before a pair does, with llama.cpp's rules."""

from __future__ import annotations

import pytest

from conftest import load_runtime
from edgespec.engine import Engine
from edgespec.errors import VocabMismatchError
from tiny_models import write_tiny_llama


def test_same_tokenizer_passes(tiny_pair):
    Engine(load_runtime(tiny_pair["target"]), load_runtime(tiny_pair["bad_draft"])).close()


def test_first_differing_token_is_named(tmp_path, tiny_pair):
    odd = write_tiny_llama(tmp_path / "odd.gguf", seed=3, rename_tokens={260: "zz"})
    with pytest.raises(VocabMismatchError, match=r"differ at token 260.*'zz'"):
        Engine(load_runtime(tiny_pair["target"]), load_runtime(odd))


def test_size_and_special_tokens_are_checked(tmp_path, tiny_pair, smollm2_path):
    with pytest.raises(VocabMismatchError, match="does not match.*(49152 tokens|special tokens)"):
        Engine(load_runtime(tiny_pair["target"]), load_runtime(smollm2_path))
    bigger = write_tiny_llama(tmp_path / "bigger.gguf", seed=4, n_vocab=320)
    with pytest.raises(VocabMismatchError, match="special tokens"):  # its BOS id moved with the size
        Engine(load_runtime(tiny_pair["target"]), load_runtime(bigger))
