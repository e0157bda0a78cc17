"""Constrained output: a JSON schema, any JSON object, a regex or a Lark/GBNF grammar, as token masks.

The grammar engine is llguidance (Rust; token masks in tens of microseconds, rollback, forced tokens);
we compile nothing ourselves. `Constraint` is what a user asks for (it lives in GenerationConfig);
`Grammar` is one generation's matcher over the target's vocabulary.

The constrained distribution at a position is the target's row with the tokens the grammar forbids
there removed, then the sampling chain (see edgespec.sampling): the mask comes first so a top-k or
top-p cut can never leave nothing to draw (a small model often ranks the one token a schema needs
below its top 40). Greedy is the argmax of the masked row. Under speculation every row of a verify
pass is masked as the grammar stands after the draft's tokens before it (Sampler.rows), which is
what keeps speculation exact; masking only the emitted token would not be (tests/test_structured.py).

A token the model's vocabulary marks end-of-generation is allowed wherever the grammar allows its
end-of-sequence token (the vocabulary's EOS): the chat templates end a turn with <|im_end|> and the
like, and the grammar knows one EOS only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from edgespec.errors import EdgespecError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


class ConstraintError(EdgespecError):
    """A constraint that cannot be used: an invalid schema, a grammar or regex that does not parse, or
    one no output can satisfy. Raised before anything is generated."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build one with the class methods; `source` is the schema as JSON
    text, the regex, or the grammar text ('' for any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")
        self.grammar()  # syntax and schema errors now, before a model is touched

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema))  # key order kept: llguidance emits properties in it

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """llama.cpp's GBNF; llguidance converts it to Lark (llguidance.gbnf_to_lark)."""
        return cls("gbnf", grammar)

    @classmethod
    def grammar_text(cls, text: str) -> "Constraint":
        """A grammar file's text: GBNF when it defines rules with `::=`, else Lark."""
        from llguidance.gbnf_to_lark import is_lark_syntax

        return cls("lark" if is_lark_syntax(text) else "gbnf", text)

    def grammar(self) -> str:
        """The llguidance grammar (compiled once per constraint and cached); ConstraintError if invalid."""
        return _compile(self.kind, self.source)

    def describe(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "lark": "Lark grammar", "gbnf": "GBNF grammar"}[self.kind]


# JSON on one line, spaced as json.dumps writes it: no free whitespace (a small model given the freedom
# loops on spaces and newlines), and the separators models see most (bench/JSON_STYLE_RESULTS.md: forced
# to ',' and ':' the Qwen 1.5B wrote 12 of 138 fields otherwise than its own free answer, spaced 1 of 137).
# A schema's "x-guidance" key overrides these (llguidance's JSON options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@lru_cache(maxsize=64)
def _compile(kind: str, source: str) -> str:
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        else:
            grammar = grammar_from(kind, source)
    except ValueError as exc:
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {_one_line(str(exc))}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {_one_line(messages[0])}")
    return grammar


def json_rule(schema: dict) -> str:
    """A Lark rule body matching JSON valid against `schema`, written as a json_schema constraint's
    (llguidance's inline `%json`; its `x-guidance` key carries the options)."""
    options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return f"%json {json.dumps({**schema, 'x-guidance': options})}"


def _one_line(message: str) -> str:
    return " ".join(message.split())[:300]


class Grammar:
    """One generation's grammar over the target's vocabulary, at the tokens committed so far.

    `position` is how many tokens of the generation's context (prompt included) the matcher has
    consumed; between rounds it is the committed count. Looking ahead (masks for a draft, checking
    a draft) consumes tokens and rolls them back, so the matcher never holds a token verification
    has not accepted.
    """

    def __init__(self, tokenizer: Any, constraint: Constraint, *, n_vocab: int, eog: frozenset[int], position: int):
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask

        self.constraint = constraint
        self.matcher = LLMatcher(tokenizer, constraint.grammar(), log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"invalid {constraint.describe()}: {_one_line(self.matcher.get_error())}")
        self.n_vocab = n_vocab
        self.n_grammar_vocab = tokenizer.vocab_size
        self.eos = tokenizer.eos_token
        self.eog = np.array(sorted(eog | {self.eos}), dtype=np.int64)
        self._eog_set = frozenset(int(t) for t in self.eog)
        self.position = position
        self._bitmask = allocate_token_bitmask(1, self.n_grammar_vocab)
        starts = self._grammar_mask()
        starts[self.eog[self.eog < n_vocab]] = False
        if not starts.any() and not self.matcher.is_accepting():  # e.g. a regex no string matches
            raise ConstraintError(f"the {constraint.describe()} admits no output")

    def _grammar_mask(self) -> np.ndarray:
        """Bool (n_vocab,): llguidance's mask as it stands, every end-of-generation token allowed where
        its EOS is."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.n_grammar_vocab]
        mask = np.zeros(self.n_vocab, dtype=bool)
        n = min(self.n_vocab, len(bits))
        mask[:n] = bits[:n]
        if self.eos < self.n_vocab and mask[self.eos]:
            mask[self.eog[self.eog < self.n_vocab]] = True
        return mask

    def allowed(self) -> np.ndarray:
        """Bool (n_vocab,): the tokens the grammar allows next. All True where the matcher allows
        nothing (only past its end), so a row that is never used stays finite."""
        mask = self._grammar_mask()
        if not mask.any():
            mask[:] = True
        return mask

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance over committed tokens, up to an end-of-generation token; returns how many it took."""
        taken = self._advance(tokens)
        self.position += len(tokens)  # whatever the matcher took, the context moved on
        return taken

    def _advance(self, tokens: Sequence[int]) -> int:
        """Consume the longest prefix the grammar allows (stopping before end-of-generation tokens)."""
        tokens = [int(t) for t in tokens]
        for i, t in enumerate(tokens):
            if t in self._eog_set:
                tokens = tokens[:i]
                break
        n = self.matcher.validate_tokens(tokens) if tokens else 0
        if n and not self.matcher.consume_tokens(tokens[:n]):
            raise RuntimeError(f"llguidance refused tokens it validated: {self.matcher.get_error()}")
        return n

    def valid_prefix(self, tokens: np.ndarray) -> int:
        """How many leading tokens of a draft the grammar allows from here (an end-of-generation
        token ends the draft: nothing after it is ever emitted)."""
        tokens = [int(t) for t in tokens]
        for i, t in enumerate(tokens):
            if t in self._eog_set:
                tokens = tokens[:i]
                break
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self, limit: int) -> np.ndarray:
        """Tokens the grammar forces from here (llguidance's fast-forward tokens), at most `limit`."""
        if limit <= 0:
            return np.zeros(0, dtype=np.int32)
        tokens = self.matcher.compute_ff_tokens()[:limit]
        return np.asarray(tokens[: self.valid_prefix(np.asarray(tokens))], dtype=np.int32)

    def certain(self, tokens: np.ndarray) -> np.ndarray:
        """Bool per token of a run the grammar allows from here (its forced tokens): whether the grammar
        admits that token alone at its position. Its masked distribution is then a point mass whatever
        the model's row says. Forced tokens often are not certain: llguidance forces bytes, which
        other token splits may spell too."""
        out = np.zeros(len(tokens), dtype=bool)
        taken = 0
        for i, token in enumerate(int(t) for t in tokens):
            mask = self._grammar_mask()
            out[i] = bool(mask[token]) and np.count_nonzero(mask) == 1
            if token in self._eog_set or not self.matcher.consume_token(token):
                break
            taken += 1
        self.matcher.rollback(taken)
        return out

    def row_masks(self, context: np.ndarray, continuation: np.ndarray, m: int) -> np.ndarray:
        """Bool (m, n_vocab): the masks of the last m positions of context + continuation (row j
        predicts the token after all but the last m - 1 - j tokens). Rows after a token the grammar
        forbids are all True: such a token is never accepted, so those rows are never used."""
        ahead = np.concatenate([np.asarray(context[self.position:], dtype=np.int64),
                                np.asarray(continuation, dtype=np.int64)])
        first = len(ahead) - m + 1
        if first < 0:
            raise ValueError(f"the grammar is at {self.position} tokens, past the rows asked for")
        masks = np.ones((m, self.n_vocab), dtype=bool)
        taken = self._advance(ahead[:first])
        if taken == first:
            for j in range(m):
                masks[j] = self.allowed()
                if j + 1 == m:
                    break
                token = int(ahead[first + j])
                if token in self._eog_set or self.matcher.validate_tokens([token]) != 1:
                    break
                self.matcher.consume_token(token)
                taken += 1
        self.matcher.rollback(taken)
        return masks
