"""Can this draft speak for this target? llama.cpp's rules (common/speculative.cpp), checked first."""

from __future__ import annotations

from typing import Protocol

from edgespec.errors import VocabMismatchError
from edgespec.runtimes.base import VocabInfo

MAX_VOCAB_SIZE_DIFFERENCE = 128
CHECK_FROM_TOKEN_ID = 5  # the first few ids are often special tokens that differ harmlessly


class HasVocab(Protocol):
    """What the check reads: a runtime, or a model opened for its vocabulary alone (llamacpp.VocabOnly)."""

    vocab: VocabInfo

    def token_text(self, token: int) -> str: ...


def vocab_difference(target: HasVocab, draft: HasVocab) -> str | None:
    """The first way the draft's vocabulary differs from the target's, or None when the pair fits."""
    t, d = target.vocab, draft.vocab
    if t.vocab_type != d.vocab_type:
        return f"vocabulary type {d.vocab_type} vs the target's {t.vocab_type}"
    if (t.add_bos, t.bos, t.eos) != (d.add_bos, d.bos, d.eos):
        return (f"special tokens differ (add_bos/bos/eos: draft {d.add_bos}/{d.bos}/{d.eos}, "
                f"target {t.add_bos}/{t.bos}/{t.eos})")
    if abs(t.n_vocab - d.n_vocab) > MAX_VOCAB_SIZE_DIFFERENCE:
        return f"{d.n_vocab} tokens vs the target's {t.n_vocab} (more than {MAX_VOCAB_SIZE_DIFFERENCE} apart)"
    for token in range(CHECK_FROM_TOKEN_ID, min(t.n_vocab, d.n_vocab)):
        a, b = target.token_text(token), draft.token_text(token)
        if a != b:
            return f"they differ at token {token}: target {a!r}, draft {b!r}"
    return None


def check_vocab_compatible(target: HasVocab, draft: HasVocab) -> None:
    """Raise VocabMismatchError naming the first difference."""
    difference = vocab_difference(target, draft)
    if difference:
        raise VocabMismatchError(f"the draft's vocabulary does not match the target's: {difference}; "
                                 "pick a draft with the target's tokenizer")
