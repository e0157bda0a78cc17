"""The cloud-edge protocol, version 1.2: message schemas, msgpack encoding, strict validation.

Every message is one msgpack map with `v` (the protocol version). Token ids travel as raw
little-endian int32 bytes, draft probabilities as top-k ids plus uint16 weights per drafted token,
never a whole vocabulary row. Decoding refuses anything not in the schema: unknown or missing
keys, wrong types, values out of range, token ids outside the vocabulary. No pickle, no msgpack
extension types. docs/cloud_protocol.md describes the protocol for other implementations.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np

from edgespec.sampling import SamplingParams
from edgespec.structured import KINDS, Constraint, ConstraintError

PROTOCOL_VERSION = 1   # `v` on the wire: the major version; a side refuses any other
PROTOCOL_MINOR = 2     # 1.1 adds VerifyRequest.assume_from/assume_last (several blocks in flight); 1.0 never sends them
#                        1.2 adds SessionRequest.constraint (structured output); sent only when the output is constrained
CONTENT_TYPE = "application/msgpack"
WEIGHT_SCALE = 65535  # compact probabilities are uint16 weights; q_i = w_i / sum(w)
MAX_CONSTRAINT_CHARS = 64 << 10  # a constraint's source text (a JSON schema, regex or grammar), as the server's limit


class ProtocolError(Exception):
    """A message the other side must not have sent. `status` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """What a verifier accepts; the client reads them from the session answer."""

    n_vocab: int
    max_body_bytes: int = 1 << 20
    max_context: int = 2048      # tokens per session (history plus everything generated)
    max_draft: int = 64          # draft tokens per verify request
    max_probs_k: int = 64        # probability entries per drafted token


# --- msgpack -----------------------------------------------------------------------------------

def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(400, "malformed", "msgpack extension types are not part of the protocol")


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes, limits: Limits) -> dict:
    """Bytes to a map, refusing oversized input before parsing and any non-map top level."""
    if len(data) > limits.max_body_bytes:
        raise ProtocolError(413, "too_large", f"message of {len(data)} bytes exceeds {limits.max_body_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True,
                              max_str_len=MAX_CONSTRAINT_CHARS,
                              max_bin_len=limits.max_body_bytes, max_array_len=64, max_map_len=32)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(400, "malformed", f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(400, "malformed", "a message must be a msgpack map")
    return obj


# --- field checks ------------------------------------------------------------------------------

def _fields(obj: dict, required: set[str], optional: set[str] = frozenset()) -> None:
    keys = set(obj)
    if missing := required - keys:
        raise ProtocolError(400, "malformed", f"missing field(s): {', '.join(sorted(missing))}")
    if extra := keys - required - optional:
        raise ProtocolError(400, "malformed", f"unknown field(s): {', '.join(sorted(map(str, extra)))}")
    if obj["v"] != PROTOCOL_VERSION or type(obj["v"]) is not int:
        raise ProtocolError(400, "version", f"protocol version {obj['v']!r} not supported; this side speaks "
                                            f"{PROTOCOL_VERSION}")


def _int(obj: dict, key: str, lo: int, hi: int) -> int:
    value = obj[key]
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(422, "invalid", f"{key} must be an integer in [{lo}, {hi}]")
    return value


def _float(obj: dict, key: str, lo: float, hi: float) -> float:
    value = obj[key]
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise ProtocolError(422, "invalid", f"{key} must be a finite number in [{lo}, {hi}]")
    return float(value)


def encode_tokens(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def decode_tokens(value: Any, key: str, n_vocab: int, lo: int, hi: int) -> np.ndarray:
    """Raw little-endian int32 bytes to token ids, each checked against the vocabulary."""
    if not isinstance(value, bytes) or len(value) % 4:
        raise ProtocolError(400, "malformed", f"{key} must be bytes of little-endian int32 token ids")
    ids = np.frombuffer(value, dtype="<i4").astype(np.int32)
    if not lo <= len(ids) <= hi:
        raise ProtocolError(413 if len(ids) > hi else 422, "invalid", f"{key} must hold {lo} to {hi} tokens, "
                                                                      f"got {len(ids)}")
    if len(ids) and (ids.min() < 0 or ids.max() >= n_vocab):
        raise ProtocolError(422, "bad_token", f"{key} holds a token id outside the vocabulary [0, {n_vocab})")
    return ids


# --- compact draft probabilities ---------------------------------------------------------------

@dataclass(frozen=True)
class CompactProbs:
    """Per drafted token, up to k (id, weight) pairs; the distribution is w / sum(w) on those ids.

    Rows with fewer than k entries are padded with weight 0 (the padding ids are ignored).
    """

    ids: np.ndarray      # (m, k) int32
    weights: np.ndarray  # (m, k) uint16

    def dense(self, n_vocab: int) -> np.ndarray:
        """The (m, n_vocab) float64 distributions: the exact q both sides use."""
        m, k = self.ids.shape
        out = np.zeros((m, n_vocab), dtype=np.float64)
        w = self.weights.astype(np.float64)
        rows = np.repeat(np.arange(m), k).reshape(m, k)
        np.add.at(out, (rows, self.ids), w / w.sum(axis=1, keepdims=True))  # padding adds 0
        return out

    def to_wire(self) -> dict:
        return {"k": int(self.ids.shape[1]), "ids": self.ids.astype("<i4").tobytes(),
                "w": self.weights.astype("<u2").tobytes()}

    @property
    def nbytes(self) -> int:
        return self.ids.size * 4 + self.weights.size * 2


def compact_row(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep a distribution's k most likely tokens and quantize them to uint16 weights.

    Returns (ids, weights, q) where q is the dense distribution the weights stand for. The
    drafter must sample from q, not from `row`: the verifier judges the draft against q.
    """
    nz = np.flatnonzero(row > 0)
    if len(nz) > k:
        nz = nz[np.argpartition(-row[nz], k - 1)[:k]]
    nz = nz[np.argsort(-row[nz], kind="stable")]
    p = row[nz] / row[nz].sum()
    w = np.maximum(np.round(p * WEIGHT_SCALE / p[0]), 0).astype(np.uint16)  # the top token gets 65535
    keep = w > 0
    ids, w = nz[keep].astype(np.int32), w[keep]
    q = np.zeros(len(row), dtype=np.float64)
    q[ids] = w.astype(np.float64) / w.astype(np.float64).sum()
    pad = k - len(ids)
    return np.pad(ids, (0, pad)), np.pad(w, (0, pad)), q


def decode_probs(value: Any, draft: np.ndarray, limits: Limits) -> CompactProbs:
    if not isinstance(value, dict):
        raise ProtocolError(400, "malformed", "probs must be a map {k, ids, w} or nil")
    if set(value) != {"k", "ids", "w"}:
        raise ProtocolError(400, "malformed", "probs must have exactly the fields k, ids, w")
    k = _int(value, "k", 1, limits.max_probs_k)
    m = len(draft)
    if not isinstance(value["ids"], bytes) or len(value["ids"]) != m * k * 4:
        raise ProtocolError(400, "malformed", f"probs.ids must be {m}x{k} little-endian int32")
    if not isinstance(value["w"], bytes) or len(value["w"]) != m * k * 2:
        raise ProtocolError(400, "malformed", f"probs.w must be {m}x{k} little-endian uint16")
    ids = np.frombuffer(value["ids"], dtype="<i4").astype(np.int32).reshape(m, k)
    w = np.frombuffer(value["w"], dtype="<u2").astype(np.uint16).reshape(m, k)
    if ids.size and (ids.min() < 0 or ids.max() >= limits.n_vocab):
        raise ProtocolError(422, "bad_token", f"probs.ids holds a token id outside the vocabulary [0, {limits.n_vocab})")
    for i in range(m):
        live = ids[i][w[i] > 0]
        if len(np.unique(live)) != len(live):
            raise ProtocolError(422, "invalid", f"probs row {i} names a token twice")
        if not (w[i][ids[i] == draft[i]] > 0).any():
            raise ProtocolError(422, "invalid", f"draft token {i} has probability 0 in its own distribution")
    return CompactProbs(ids, w)


# --- messages ------------------------------------------------------------------------------------

SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"}


def sampling_to_wire(p: SamplingParams) -> dict:
    return {k: v for k, v in asdict(p).items() if k in SAMPLING_KEYS}


def decode_sampling(value: Any) -> SamplingParams:
    if not isinstance(value, dict) or set(value) != SAMPLING_KEYS:
        raise ProtocolError(400, "malformed", f"sampling must be a map with {', '.join(sorted(SAMPLING_KEYS))}")
    try:
        return SamplingParams(temperature=_float(value, "temperature", 0, 100),
                              top_k=_int(value, "top_k", 0, 1 << 20), top_p=_float(value, "top_p", 0, 1),
                              min_p=_float(value, "min_p", 0, 1), repeat_penalty=_float(value, "repeat_penalty", 0, 100),
                              repeat_last_n=_int(value, "repeat_last_n", 0, 1 << 16))
    except ProtocolError:
        raise
    except Exception as exc:  # SamplingParams' own range checks (EdgespecError)
        raise ProtocolError(422, "invalid", f"sampling: {exc}") from None


def decode_constraint(value: Any, n_tokens: int) -> tuple[Constraint, int]:
    """`{kind, source, start}`: what the output must match (edgespec.structured.Constraint's fields) and
    where in the history the output starts (the prompt's length). Compiled here: a schema or grammar
    that does not compile is refused (422 `bad_constraint`) before the session starts."""
    if not isinstance(value, dict) or set(value) != {"kind", "source", "start"}:
        raise ProtocolError(400, "malformed", "constraint must be a map with exactly the fields kind, source, start")
    kind, source = value["kind"], value["source"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(422, "bad_constraint", f"constraint.kind must be one of {', '.join(KINDS)}")
    if not isinstance(source, str):
        raise ProtocolError(400, "malformed", "constraint.source must be a string")
    start = _int(value, "start", 1, n_tokens)
    try:
        return Constraint(kind, source), start
    except ConstraintError as exc:
        raise ProtocolError(422, "bad_constraint", str(exc)) from None


@dataclass
class SessionRequest:
    """Start a session (or rebuild one) from the client's whole token history."""

    tokens: np.ndarray           # prompt plus every token committed so far; the last is not yet evaluated
    sampling: SamplingParams
    seed: int                    # the verifier's randomness for this session: rng([seed, n_past]) per round
    resume: str | None = None    # a session id to reuse (its KV for the shared prefix is kept)
    constraint: Constraint | None = None  # 1.2: the output must match it (the verifier masks its rows)
    constraint_start: int = 0    # 1.2: where the constrained output starts in `tokens` (the prompt's length)

    def to_wire(self) -> dict:
        message = {"v": PROTOCOL_VERSION, "tokens": encode_tokens(self.tokens),
                   "sampling": sampling_to_wire(self.sampling), "seed": self.seed, "resume": self.resume}
        if self.constraint is not None:  # absent otherwise: an unconstrained request is a 1.1 request
            message["constraint"] = {"kind": self.constraint.kind, "source": self.constraint.source,
                                     "start": int(self.constraint_start)}
        return message

    @classmethod
    def from_wire(cls, obj: dict, limits: Limits) -> "SessionRequest":
        _fields(obj, {"v", "tokens", "sampling", "seed"}, {"resume", "constraint"})
        tokens = decode_tokens(obj["tokens"], "tokens", limits.n_vocab, 1, limits.max_context - 1)
        resume = obj.get("resume")
        if resume is not None and (not isinstance(resume, str) or not 1 <= len(resume) <= 64):
            raise ProtocolError(422, "invalid", "resume must be a session id or nil")
        request = cls(tokens, decode_sampling(obj["sampling"]), _int(obj, "seed", 0, 2**63 - 1), resume)
        if obj.get("constraint") is not None:
            request.constraint, request.constraint_start = decode_constraint(obj["constraint"], len(tokens))
        return request


@dataclass
class SessionResponse:
    session_id: str
    revision: int
    n_past: int                  # tokens the verifier holds for this session (= len(history))
    passes: int                  # target forward passes spent on this session so far
    n_vocab: int
    vocab_hash: str
    max_draft: int
    max_probs_k: int
    max_context: int
    server_s: float = 0.0

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, **asdict(self)}

    @classmethod
    def from_wire(cls, obj: dict) -> "SessionResponse":
        _fields(obj, {"v"} | set(cls.__dataclass_fields__))
        sid = obj["session_id"]
        if not isinstance(sid, str) or not 1 <= len(sid) <= 64:
            raise ProtocolError(502, "malformed", "session_id must be a short string")
        vh = obj["vocab_hash"]
        if not isinstance(vh, str) or len(vh) > 128:
            raise ProtocolError(502, "malformed", "vocab_hash must be a short string")
        return cls(sid, _int(obj, "revision", 0, 2**62), _int(obj, "n_past", 0, 2**31),
                   _int(obj, "passes", 0, 2**62), _int(obj, "n_vocab", 1, 2**31), vh,
                   _int(obj, "max_draft", 0, 1 << 16), _int(obj, "max_probs_k", 1, 1 << 16),
                   _int(obj, "max_context", 1, 2**31), _float(obj, "server_s", 0, 1e9))


@dataclass
class VerifyRequest:
    """Verify a draft against the session's committed tokens (revision and n_past as the client knows them).

    1.1: a request sent before the one ahead of it was answered names the state it assumes:
    `revision` and `n_past` after the blocks ahead, all accepted, `assume_last` the bonus token it
    assumes the last of them ends with, and `assume_from` the revision its chain of blocks was
    drafted from (that of the chain's first block, sent without assumptions). The verifier waits for
    that revision and answers 409 `stale`, without a forward pass, when the state did not happen.
    """

    revision: int
    n_past: int
    draft: np.ndarray
    probs: CompactProbs | None = None   # None: greedy session, or a deterministic draft (one-hot)
    assume_from: int | None = None      # 1.1: the chain's first revision; with assume_last, or neither
    assume_last: int | None = None      # 1.1: the last committed token this request assumes

    def to_wire(self) -> dict:
        message = {"v": PROTOCOL_VERSION, "revision": self.revision, "n_past": self.n_past,
                   "draft": encode_tokens(self.draft), "probs": None if self.probs is None else self.probs.to_wire()}
        if self.assume_last is not None:  # absent otherwise: a request without them is a 1.0 request
            message.update(assume_from=int(self.assume_from), assume_last=int(self.assume_last))
        return message

    @classmethod
    def from_wire(cls, obj: dict, limits: Limits) -> "VerifyRequest":
        _fields(obj, {"v", "revision", "n_past", "draft"}, {"probs", "assume_from", "assume_last"})
        draft = decode_tokens(obj["draft"], "draft", limits.n_vocab, 0, limits.max_draft)
        probs = obj.get("probs")
        revision = _int(obj, "revision", 0, 2**62)
        request = cls(revision, _int(obj, "n_past", 1, limits.max_context), draft,
                      None if probs is None else decode_probs(probs, draft, limits))
        if ("assume_from" in obj) != ("assume_last" in obj):
            raise ProtocolError(400, "malformed", "assume_from and assume_last come together")
        if "assume_last" in obj:
            request.assume_from = _int(obj, "assume_from", 0, revision - 1)  # a chain starts before its blocks
            last = obj["assume_last"]
            if type(last) is not int:
                raise ProtocolError(422, "invalid", "assume_last must be a token id")
            if not 0 <= last < limits.n_vocab:
                raise ProtocolError(422, "bad_token", f"assume_last is outside the vocabulary [0, {limits.n_vocab})")
            request.assume_last = last
        return request


@dataclass
class VerifyResponse:
    revision: int
    n_past: int          # committed tokens after this verification
    n_accepted: int
    token: int           # the correction (n_accepted < len(draft)) or the bonus token
    passes: int          # target forward passes spent on this session so far
    server_s: float = 0.0  # time the request spent on the server (queue and compute)

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, **asdict(self)}

    @classmethod
    def from_wire(cls, obj: dict, n_vocab: int) -> "VerifyResponse":
        _fields(obj, {"v"} | set(cls.__dataclass_fields__))
        return cls(_int(obj, "revision", 0, 2**62), _int(obj, "n_past", 1, 2**31),
                   _int(obj, "n_accepted", 0, 1 << 16), _int(obj, "token", 0, n_vocab - 1),
                   _int(obj, "passes", 0, 2**62), _float(obj, "server_s", 0, 1e9))


def error_message(code: str, message: str, **extra) -> dict:
    return {"v": PROTOCOL_VERSION, "error": code, "message": message[:400], **extra}


# --- the vocabulary both sides must share -------------------------------------------------------

def vocab_fingerprint(runtime) -> str:
    """sha256 over the vocabulary: size, type, special ids and every token's text."""
    v = runtime.vocab
    h = hashlib.sha256(f"{v.n_vocab}|{v.vocab_type}|{v.bos}|{v.eos}|{sorted(v.eog)}".encode())
    for t in range(v.n_vocab):
        h.update(runtime.token_text(t).encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()
