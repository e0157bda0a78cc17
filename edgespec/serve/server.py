"""An OpenAI-compatible HTTP server over an engine: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (streaming as server-sent events, or not), and `/health`.

Speculative decoding runs inside, with the mode and draft chosen at start. Every response carries
OpenAI's `usage` (with `prompt_tokens_details.cached_tokens`) and an `edgespec` extension field:
the speculative stats of the generation, how long it queued, and what the prefix cache did.

Requests are served one at a time in arrival order from a bounded queue (`edgespec.serve.aio`), or with
a `ParallelEngine` (`serve --parallel N`) up to N at once, every active request advanced in one
batched target pass per step (`edgespec.serve.slots`); a full queue answers 429. Each request has a time
limit; the body size, the prompt's length, max_tokens and the stop strings are bounded (a 400 or 413
naming the field), a client that disconnects cancels its generation, and an API key can be required (it
must be when binding to anything but loopback; compared in constant time). Errors are OpenAI-style JSON:
`{"error": {"message", "type", "param", "code"}}`. `/openapi.json` describes the routes, the request
bodies and this server's limits.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Literal, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec.serve.aio import AsyncEngine, AsyncGeneration, QueueFullError, RequestTimeoutError
from edgespec.engine import MAX_TOP_LOGPROBS, Engine, GenerationConfig, GenerationResult, TokenLogprob
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.machine.guard import MemoryBudgetError
from edgespec.serve.prefix_cache import PrefixCache
from edgespec.runtimes.base import GrammarVocabulary, SavedState
from edgespec.serve.slots import ParallelEngine, SlotScheduler, StepFailedError
from edgespec.structured import Constraint, ConstraintError, Grammar
from edgespec.tools import (Tool, ToolError, hermes_tags, history_message, parse_tool_calls, parse_tools,
                            resolve_choice, template_renders_tools, tool_constraint, tool_note)


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    mode: str = "auto"
    draft_max: int | None = None
    api_keys: tuple[str, ...] = ()     # any of these as 'Authorization: Bearer KEY'; none = no auth
    max_queue: int = 8                  # requests waiting behind the running one
    timeout_s: float = 300.0            # per request, queueing included
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256       # when a request gives none (capped by the context left)
    max_request_bytes: int = 1 << 20
    # What one request may ask for, so that none can take the process's memory or CPU for itself:
    max_prompt_chars: int = 1 << 18     # the prompt's text (all messages together), before tokenizing
    max_messages: int = 1024
    max_stop: int = 4                   # stop strings, as OpenAI
    max_stop_chars: int = 256           # each; every one is matched against the text as it grows
    max_tools: int = 128                # as OpenAI
    max_schema_bytes: int = 64 << 10    # the tools' JSON together, and a response_format's schema: compiled to a grammar
    prefix_cache_bytes: int = 256 << 20
    reuse_prefix: bool = True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, port: int, api_keys: Sequence[str]) -> None:
    """Refuse an exposed server without a key, and a port already taken, before loading models."""
    if not is_loopback(host) and not api_keys:
        raise EdgespecError(f"binding to {host} exposes the server to the network; give --api-key KEY "
                            "(or set EDGESPEC_API_KEY), or bind to 127.0.0.1")
    if not 0 < port < 65536:
        raise EdgespecError(f"--port must be between 1 and 65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise EdgespecError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port "
                                "or --host") from exc


# --- requests ---------------------------------------------------------------------------------

class _Request(BaseModel):
    """Fields both endpoints take. A field not declared here is refused with a 400 naming it (see
    `_Service.parse`): a client asking for audio, n > 1 or anything else we do not do is told so."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)               # extension (llama.cpp's default)
    min_p: float = Field(0.05, ge=0.0, lt=1.0)  # extension (llama.cpp's default)
    repeat_penalty: float = Field(1.0, gt=0.0)  # extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1)
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra fields are let through here: clients send back the assistant messages they received
    # (refusal, annotations, audio: null), and the template ignores what it does not know.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None                 # a tool result: the call it answers
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None   # text | json_object | json_schema (strict or not: enforced)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


def _stops(req: _Request) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _validation_error(exc: "ValidationError | RequestValidationError") -> ApiError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = ".".join(str(p) for p in first["loc"]) or None
    where = f"'{param}': " if param else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return ApiError(400, f"invalid request: {where}{first['msg']}{more}", param=param, code="invalid_value")


# --- what the routes share -----------------------------------------------------------------

class _Service:
    """What the endpoints share: the engine behind its queue, the limits, the model's name."""

    def __init__(self, engine: "Engine | ParallelEngine", config: ServerConfig):
        parallel = engine if isinstance(engine, ParallelEngine) else None
        engine = parallel.front if parallel is not None else engine  # slot 0's engine tokenizes for all
        self.engine = engine
        self.config = config
        # A prefix cache keeps KV blobs: a runtime that cannot save its KV (layered ONNX, Core ML) serves without one.
        saves = all(SavedState in rt.capabilities for rt in (engine.target, engine.draft_runtime) if rt is not None)
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes > 0 and saves else None
        guard = (parallel or engine).memory_guard
        if guard is not None and self.prefix_cache is not None:  # under --budget: the first thing it sheds
            from edgespec.machine.guard import PrefixCacheReleaser

            guard.offer(PrefixCacheReleaser(self.prefix_cache))
        self.started = int(time.time())
        # Refuse a bad mode now, and let `auto` measure its costs before the first request.
        self.mode, _ = engine.policy_for(GenerationConfig(mode=config.mode, draft_max=config.draft_max))
        if parallel is not None:  # requests batched step by step, one sequence each
            self.queue = SlotScheduler(parallel, max_queue=config.max_queue, prefix_cache=self.prefix_cache,
                                       reuse_prefix=config.reuse_prefix)
        else:  # one generation at a time
            self.queue = AsyncEngine(engine, max_queue=config.max_queue, prefix_cache=self.prefix_cache,
                                     reuse_prefix=config.reuse_prefix)
        t, d = engine.target, engine.draft_runtime
        self.fingerprint = f"edgespec-{t.name}-{t.path.name}" + (f"+{d.path.name}" if d else "")
        # Tool calls in the model's own Hermes format where its template renders tools and teaches it.
        template = t.chat_template()
        self.renders_tools = template_renders_tools(template)
        self.call_tags = hermes_tags(template, lambda text: t.tokenize(text, add_special=False, parse_special=True),
                                     t.token_bytes) if self.renders_tools else None

    # -- requests to generations ------------------------------------------------------------------

    async def parse(self, request, model: type[BaseModel]) -> Any:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body ({int(declared)} bytes) exceeds the limit of {limit} bytes",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        if not body:
            raise ApiError(400, "the request has no body; send a JSON object", code="invalid_json")
        try:
            req = model.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model != self.config.model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist here; this server serves "
                                f"{self.config.model_id!r} (see /v1/models)", code="model_not_found", param="model")
        if req.n != 1:
            raise ApiError(400, "n must be 1: this server generates one choice per request", param="n")
        for name in req.model_extra or {}:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
        self.check_limits(req)
        return req

    def check_limits(self, req: _Request) -> None:
        """Refuse, before any tokenizing, what would cost more memory or CPU than one request may take."""
        config = self.config
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        asked = getattr(req, field)
        if asked is not None and asked > config.max_tokens_limit:
            raise ApiError(400, f"{field} ({asked}) exceeds this server's limit of {config.max_tokens_limit}",
                           param=field, code="max_tokens_too_large")
        stops = _stops(req)
        if len(stops) > config.max_stop:
            raise ApiError(400, f"at most {config.max_stop} stop sequences", param="stop", code="too_many_stops")
        if any(len(s) > config.max_stop_chars for s in stops):
            raise ApiError(400, f"a stop sequence may have at most {config.max_stop_chars} characters", param="stop",
                           code="stop_too_long")
        if isinstance(req, ChatRequest):
            self._check_schemas(req)
            if len(req.messages) > config.max_messages:
                raise ApiError(400, f"at most {config.max_messages} messages per request", param="messages",
                               code="too_many_messages")
            chars = sum((len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or ()))
                        + (len(json.dumps(m.tool_calls)) if m.tool_calls else 0) for m in req.messages)
            field = "messages"
        else:
            prompt = req.prompt
            chars = len(prompt) if isinstance(prompt, str) else sum(len(p) if isinstance(p, str) else 1 for p in prompt)
            field = "prompt"
        if chars > config.max_prompt_chars:
            raise ApiError(400, f"the prompt ({chars} characters) exceeds this server's limit of "
                                f"{config.max_prompt_chars}", param=field, code="prompt_too_long")

    def _check_schemas(self, req: "ChatRequest") -> None:
        """Tools and a response_format schema become a grammar: bound how many, and how large."""
        config = self.config
        tools = getattr(req, "tools", None)
        if isinstance(tools, list) and len(tools) > config.max_tools:
            raise ApiError(400, f"at most {config.max_tools} tools per request", param="tools", code="too_many_tools")
        fmt = getattr(req, "response_format", None)
        for field, value in (("tools", tools), ("response_format", fmt)):
            size = len(json.dumps(value, separators=(",", ":"))) if value is not None else 0
            if size > config.max_schema_bytes:
                raise ApiError(400, f"{field} ({size} bytes of JSON) exceeds this server's limit of "
                                    f"{config.max_schema_bytes} bytes", param=field, code="schema_too_large")

    def generation_config(self, req: _Request, n_prompt: int, max_tokens: int | None,
                          logprobs: int | None, constraint: Constraint | None = None) -> GenerationConfig:
        n_ctx = self.engine.target.n_ctx
        room = n_ctx - n_prompt
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, self.config.max_tokens_limit, room)
        if room < 1 or n_prompt + max_tokens > n_ctx:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {n_ctx} tokens; shorten the prompt or ask for fewer tokens",
                           code="context_length_exceeded", param="max_tokens")
        stop = _stops(req)
        try:
            bias = tuple((int(t), float(b)) for t, b in (req.logit_bias or {}).items())
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        if any(not 0 <= t < self.engine.target.vocab.n_vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias token ids must be in [0, {self.engine.target.vocab.n_vocab})",
                           param="logit_bias")
        try:
            return GenerationConfig(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, min_p=req.min_p, repeat_penalty=req.repeat_penalty,
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                    logit_bias=bias, seed=req.seed, stop=stop, mode=self.config.mode,
                                    draft_max=self.config.draft_max, logprobs=logprobs, constraint=constraint)
        except EdgespecError as exc:
            raise ApiError(400, str(exc), param="logit_bias" if "logit_bias" in str(exc) else None) from None

    def chat_answer(self, req: "ChatRequest") -> tuple[Constraint | None, list[Tool], "str | Tool | None"]:
        """What the answer must match (response_format, or the tools under tool_choice), the tools, and
        the tool choice (None: no tool calls)."""
        try:
            tools = parse_tools(req.tools or [])
            choice = resolve_choice(tools, req.tool_choice)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        fmt = req.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "response_format type must be text, json_object or json_schema", param="response_format")
        answer = None  # the JSON schema an answer must match, if the response_format asks for one
        if kind == "json_object":
            answer = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema must be {'name': ..., 'schema': {...}}",
                               param="response_format.json_schema")
            answer = spec.get("schema", {})
        try:
            constraint = None if answer is None else (Constraint.json_object() if kind == "json_object"
                                                      else Constraint.json_schema(answer))
            if choice is None:
                self.check_satisfiable(constraint)
        except ConstraintError as exc:
            raise ApiError(400, str(exc), param="response_format") from None
        if choice is None:
            return constraint, tools, None
        try:  # the model calls tools (as tool_choice says) or answers in the response format
            constraint = tool_constraint(tools, choice, req.parallel_tool_calls, answer, tags=self.call_tags)
            self.check_satisfiable(constraint)
        except ConstraintError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        return constraint, tools, choice

    def check_satisfiable(self, constraint: Constraint | None) -> None:
        """A constraint no output can match is refused now, before the request queues (a stream's status
        line would be sent already): the grammar over the model's vocabulary, built and dropped, says so
        when its first mask is empty (ConstraintError). A millisecond or so."""
        rt = self.engine.target
        if constraint is not None and GrammarVocabulary in rt.capabilities:
            Grammar(rt.grammar_tokenizer(), constraint, n_vocab=rt.vocab.n_vocab, eog=rt.vocab.eog, position=0)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            n_vocab = self.engine.target.vocab.n_vocab
            if any(not 0 <= t < n_vocab for t in prompt):
                raise ApiError(400, f"token ids must be in [0, {n_vocab})", param="prompt")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "give one prompt per request", param="prompt")
            prompt = prompt[0]
        return self._tokens(prompt, raw=True)

    def chat_prompt(self, req: ChatRequest, tools: list[Tool] = (), choice: "str | Tool | None" = None) -> list[int]:
        """The messages through the model's chat template, with the tools (OpenAI's dicts) when a call may
        be made; a template that ignores tools gets a system note describing them."""
        renders_tools = self.renders_tools
        messages = []
        for m in req.messages:
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(p.text for p in m.content)
            else:
                content = m.content or ""
            message = {"role": "system" if m.role == "developer" else m.role, "content": content}
            message.update({k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id),
                                              ("name", m.name)) if v is not None})
            messages.append(history_message(message, renders_tools))
        if choice is not None and (not renders_tools or choice != "auto"):
            note = tool_note(tools, choice, req.parallel_tool_calls, native=self.call_tags is not None)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
            else:
                messages.insert(0, {"role": "system", "content": note})
        return self._tokens(messages, raw=False, tools=req.tools if choice is not None else None)

    def _tokens(self, prompt, raw: bool, tools: list | None = None) -> list[int]:
        try:
            ids = self.engine.prompt_tokens(prompt, raw=raw, tools=tools)
        except EdgespecError as exc:
            raise ApiError(400, str(exc), param="prompt" if raw else "messages") from None
        if not ids:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        return ids

    def submit(self, prompt_ids: list[int], config: GenerationConfig) -> AsyncGeneration:
        try:
            return self.queue.submit(prompt_ids, config, timeout=self.config.timeout_s)
        except QueueFullError as exc:  # a full queue, or the memory guard not admitting (code memory_pressure)
            raise ApiError(429, str(exc), "rate_limit_error", code=getattr(exc, "code", "queue_full"),
                           headers={"Retry-After": "1"}) from None

    # -- generations to responses -----------------------------------------------------------------

    def usage(self, result: GenerationResult) -> dict:
        n = len(result.tokens)
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
                "total_tokens": result.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens}}

    def extension(self, gen: AsyncGeneration, result: GenerationResult) -> dict:
        return {**result.stats.to_dict(), "finish_reason": result.finish_reason, "queue_s": gen.info.get("queue_s"),
                "prefix_cache": gen.info.get("prefix_cache"), "draft_max": self.config.draft_max,
                "tokens": result.tokens}  # the generated ids (as llama-server's return_tokens): exact comparisons

    def visible_logprobs(self, result: GenerationResult) -> list[TokenLogprob]:
        """The log-probabilities of the tokens whose text was returned (a stop string cuts the rest)."""
        limit, at, out = len(result.text.encode("utf-8")), 0, []
        for lp in result.logprobs or []:
            if at >= limit:
                break
            out.append(lp)
            at += len(self.engine.target.token_bytes(lp.token))
        return out

    def _piece_text(self, token: int) -> tuple[str, bytes]:
        raw = self.engine.target.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        content = []
        for lp in logprobs:
            text, raw = self._piece_text(lp.token)
            top = []
            for t, v in lp.top:
                t_text, t_raw = self._piece_text(t)
                top.append({"token": t_text, "logprob": v, "bytes": list(t_raw)})
            content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, logprobs: list[TokenLogprob], offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            text, _ = self._piece_text(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self._piece_text(t)[0]: v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


async def _until_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _run_to_end(request, gen: AsyncGeneration) -> GenerationResult | None:
    """The whole generation, or None when the client went away first (its generation is cancelled)."""
    runner = asyncio.ensure_future(gen.text())
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if runner in done:
            return _result_or_raise(runner)
        gen.cancel()
        runner.cancel()
        return None
    finally:
        watcher.cancel()
        if not gen.done:
            gen.cancel()


def _result_or_raise(task: asyncio.Future) -> GenerationResult:
    try:
        return task.result()
    except RequestTimeoutError as exc:
        raise ApiError(504, f"{exc}; ask for fewer tokens or try again", "timeout_error", code="timeout") from None
    except ContextOverflowError as exc:
        raise ApiError(400, str(exc), code="context_length_exceeded") from None
    except StepFailedError as exc:  # the model failed, not the request: another try may pass
        raise ApiError(503, str(exc), "server_error", code="unavailable", headers={"Retry-After": "1"}) from None
    except MemoryBudgetError as exc:  # the guard refused work at the budget: the process, not the request
        raise ApiError(503, str(exc), "server_error", code="memory_budget", headers={"Retry-After": "5"}) from None
    except EdgespecError as exc:
        raise ApiError(400, str(exc)) from None


# --- the routes -------------------------------------------------------------------------------
# Module-level functions: each reaches the engine, its queue and the limits through the app's
# `_Service` (`request.app.state.service`); `create_app` only wires them.

def _service(request: Request) -> _Service:
    return request.app.state.service


async def authorized(request: Request) -> _Service:
    """The service, once the request carries one of the API keys (when keys are required)."""
    service = _service(request)
    keys = service.config.api_keys
    if keys:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # Digests of equal length, every key compared: the time taken tells nothing of any key.
        sent = hashlib.sha256(key.strip().encode()).digest()
        matches = [hmac.compare_digest(sent, hashlib.sha256(k.encode()).digest()) for k in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise ApiError(401, "invalid or missing API key; send the header 'Authorization: Bearer KEY'",
                           "authentication_error", code="invalid_api_key")
    return service


async def health(request: Request):
    service = _service(request)
    q = service.queue
    return {"status": "ok", "model": service.config.model_id, "mode": service.mode,
            "queue": {"running": q.running is not None, "waiting": q.waiting, "max_waiting": q.max_queue},
            "requests": dict(q.counters),
            "slots": q.stats() if isinstance(q, SlotScheduler) else None,
            "prefix_cache": service.prefix_cache.stats() if service.prefix_cache is not None else None}


def _model_card(service: _Service) -> dict:
    t, d, config = service.engine.target, service.engine.draft_runtime, service.config
    return {"id": config.model_id, "object": "model", "created": service.started, "owned_by": "edgespec",
            "edgespec": {"file": t.path.name, "draft": d.path.name if d else None, "mode": service.mode,
                         "n_ctx": t.n_ctx, "max_tokens_limit": config.max_tokens_limit}}


async def list_models(service: _Service = Depends(authorized)):
    return {"object": "list", "data": [_model_card(service)]}


async def get_model(name: str, service: _Service = Depends(authorized)):
    if name != service.config.model_id:
        raise ApiError(404, f"the model {name!r} does not exist here", code="model_not_found")
    return _model_card(service)


async def completions(request: Request, service: _Service = Depends(authorized)):
    req: CompletionRequest = await service.parse(request, CompletionRequest)
    prompt_ids = service.completion_prompt(req)
    return await _generate(request, service, req, prompt_ids, req.max_tokens, _CompletionStyle(service, req.logprobs))


async def chat_completions(request: Request, service: _Service = Depends(authorized)):
    req: ChatRequest = await service.parse(request, ChatRequest)
    constraint, tools, choice = service.chat_answer(req)
    prompt_ids = service.chat_prompt(req, tools, choice)
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return await _generate(request, service, req, prompt_ids, max_tokens,
                           _ChatStyle(service, n_top, tools if choice is not None else []), constraint)


# --- one generation, answered whole or as server-sent events ------------------------------------

class _CompletionStyle:
    """How /v1/completions words a choice. Both styles give the fields between a choice's index and its
    finish_reason: `opening` (streamed before any text, or None), `delta` (a streamed piece), `end`
    (the streamed choice that carries the finish reason) and `whole` (the answer not streamed)."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, service: _Service, logprobs: int | None):
        self.service = service
        self.logprobs = logprobs  # what the generation is asked for: None = no log-probabilities
        self._offset = 0          # characters streamed so far (the logprobs' text_offset)

    def opening(self) -> dict | None:
        return None

    def delta(self, piece) -> dict:
        lp = None
        if self.logprobs is not None:
            lp = self.service.completion_logprobs(piece.logprobs, self._offset)
            self._offset += len(piece.text)
        return {"text": piece.text, "logprobs": lp}

    def end(self) -> dict:
        return {"text": "", "logprobs": None}

    def held(self, result: GenerationResult) -> list[dict]:
        """Streamed choices held back until the end (none here)."""
        return []

    def finish(self, result: GenerationResult) -> str:
        return _finish(result)

    def whole(self, result: GenerationResult) -> dict:
        lp = None
        if self.logprobs is not None:
            lp = self.service.completion_logprobs(self.service.visible_logprobs(result))
        return {"text": result.text, "logprobs": lp}


class _ChatStyle(_CompletionStyle):
    """How /v1/chat/completions words a choice."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, service: _Service, logprobs: int | None, tools: list[Tool] = ()):
        super().__init__(service, logprobs)
        self.tools = list(tools)  # tools a call may be made to: an answer that is a call becomes tool_calls
        self._held: list[str] | None = [] if self.tools else None  # text held while it may be a call

    def opening(self) -> dict | None:
        return {"delta": {"role": "assistant", "content": ""}, "logprobs": None}

    def delta(self, piece) -> dict | None:
        if self._held is not None:  # a call starts with '{' or '<tool_call>': hold text until it cannot be one
            self._held.append(piece.text)
            text = "".join(self._held).lstrip()
            if not text or text[0] in "{<":
                return None
            piece, self._held = replace(piece, text="".join(self._held)), None
        lp = self.service.chat_logprobs(piece.logprobs) if self.logprobs is not None else None
        return {"delta": {"content": piece.text}, "logprobs": lp}

    def calls(self, result: GenerationResult) -> list[dict] | None:
        return parse_tool_calls(result.text, self.tools) if self.tools else None

    def held(self, result: GenerationResult) -> list[dict]:
        if self._held is None:
            return []
        calls = self.calls(result)
        if calls is None:
            return [{"delta": {"content": "".join(self._held)}, "logprobs": None}] if self._held else []
        return [{"delta": {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, "logprobs": None}]

    def finish(self, result: GenerationResult) -> str:
        return "tool_calls" if self.calls(result) is not None else _finish(result)

    def end(self) -> dict:
        return {"delta": {}, "logprobs": None}

    def whole(self, result: GenerationResult) -> dict:
        lp = self.service.chat_logprobs(self.service.visible_logprobs(result)) if self.logprobs is not None else None
        calls = self.calls(result)
        if calls is not None:
            return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "logprobs": lp}
        return {"message": {"role": "assistant", "content": result.text}, "logprobs": lp}


def _choice(fields: dict, finish_reason: str | None = None) -> dict:
    return {"index": 0, **fields, "finish_reason": finish_reason}


async def _generate(request: Request, service: _Service, req: _Request, prompt_ids: list[int],
                    max_tokens: int | None, style: _CompletionStyle, constraint: Constraint | None = None):
    """Queue the generation; answer it as events (`req.stream`) or whole once it ends."""
    gen_config = service.generation_config(req, len(prompt_ids), max_tokens, style.logprobs, constraint)
    gen = service.submit(prompt_ids, gen_config)
    head = {"id": f"{style.id_prefix}-{uuid.uuid4().hex}", "object": style.object, "created": int(time.time()),
            "model": service.config.model_id, "system_fingerprint": service.fingerprint}
    if req.stream:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(_events(service, gen, {**head, "object": style.chunk_object}, style, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await _run_to_end(request, gen)
    if result is None:
        return Response(status_code=499)
    return {**head, "choices": [_choice(style.whole(result), style.finish(result))],
            "usage": service.usage(result), "edgespec": service.extension(gen, result)}


async def _events(service: _Service, gen: AsyncGeneration, head: dict, style: _CompletionStyle,
                  include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of one streamed generation, errors included (the status line is sent already)."""
    try:
        opening = style.opening()
        if opening is not None:
            yield _event({**head, "choices": [_choice(opening)]})
        try:
            async for piece in gen:
                if piece.text or piece.logprobs:
                    fields = style.delta(piece)
                    if fields is not None:
                        yield _event({**head, "choices": [_choice(fields)]})
            result = gen.result
            for fields in style.held(result):
                yield _event({**head, "choices": [_choice(fields)]})
            yield _event({**head, "choices": [_choice(style.end(), style.finish(result))],
                          "usage": service.usage(result), "edgespec": service.extension(gen, result)})
            if include_usage:
                yield _event({**head, "choices": [], "usage": service.usage(result)})
        except RequestTimeoutError as exc:
            yield _event(ApiError(504, f"{exc}; ask for fewer tokens", "timeout_error", code="timeout").body())
        except StepFailedError as exc:
            yield _event(ApiError(503, str(exc), "server_error", code="unavailable").body())
        except EdgespecError as exc:
            yield _event(ApiError(400, str(exc)).body())
        except Exception as exc:  # noqa: BLE001 - the status line is sent already: say it in the stream
            yield _event(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body())
        yield "data: [DONE]\n\n"
    finally:  # the client went away, or the stream ended: either way nothing more to generate
        if not gen.done:
            gen.cancel()


# --- the app: errors as OpenAI's JSON, the routes wired -----------------------------------------

async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request, exc):
    return JSONResponse(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                 else None).body(), status_code=exc.status_code)


async def _bad_parameter(request, exc: RequestValidationError):
    return await _api_error(request, _validation_error(exc))


async def _internal(request, exc):
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                        status_code=500)


@asynccontextmanager
async def _lifespan(app):
    yield
    app.state.service.queue.close()


ROUTES = (("GET", "/health", health), ("GET", "/v1/models", list_models), ("GET", "/v1/models/{name:path}", get_model),
          ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat_completions))


def create_app(engine: "Engine | ParallelEngine", config: ServerConfig):
    """The FastAPI app serving `engine` (a `ParallelEngine`: its slots batched). The engine is used only
    from the app's worker thread."""
    app = FastAPI(title="edgespec", version="0.1.0", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.service = _Service(engine, config)
    app.openapi = lambda: openapi_schema(app)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _bad_parameter)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    for method, path, route in ROUTES:
        app.add_api_route(path, route, methods=[method])
    return app


# --- the OpenAPI schema -------------------------------------------------------------------------

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
_ERRORS = {400: "invalid request (the reason names the field)", 401: "missing or wrong API key",
           404: "no such model or path", 413: "request body too large", 429: "the queue is full; retry later",
           503: "the model failed a step; retry", 504: "the request ran past its time limit"}


def openapi_schema(app: FastAPI) -> dict:
    """The routes' OpenAPI schema with what FastAPI cannot see: the request bodies (parsed by hand, under
    the body limit) and this server's limits on them, the error responses and the API key."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    config: ServerConfig = app.state.service.config
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="An OpenAI-compatible server with speculative decoding (edgespec).")
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                 ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs["$defs"])
    _limits_into(components["schemas"], config)
    components["schemas"]["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    if config.api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            answers = {"200": {"description": "the answer", "content": {"application/json": {"schema": {}}}}}
            if path in BODIES:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{BODIES[path].__name__}"}}}}
                answers["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
                answers |= {str(code): {"description": why, **error} for code, why in _ERRORS.items()}
            elif path != "/health":
                answers |= {str(code): {"description": _ERRORS[code], **error} for code in (401, 404)}
            if config.api_keys and path != "/health":
                op["security"] = [{"bearer": []}]
            op["responses"] = answers
    app.openapi_schema = schema
    return schema


def _limits_into(schemas: dict, config: ServerConfig) -> None:
    """Write the server's limits (ServerConfig) into the request schemas, as the checks in `_Service` apply them."""
    stop = {"anyOf": [{"type": "string", "maxLength": config.max_stop_chars},
                      {"type": "array", "maxItems": config.max_stop,
                       "items": {"type": "string", "maxLength": config.max_stop_chars}},
                      {"type": "null"}], "default": None}
    for name in ("CompletionRequest", "ChatRequest"):
        schemas[name]["additionalProperties"] = False  # any other field: 400 unsupported_parameter
        props = schemas[name]["properties"]
        props["stop"] = {**stop, "title": props["stop"].get("title", "Stop")}
        props["model"]["enum"] = [config.model_id]  # the one model served (another name: 404)
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["anyOf"][0]["maximum"] = config.max_tokens_limit
    chat = schemas["ChatRequest"]["properties"]
    chat["messages"]["maxItems"] = config.max_messages
    for option in chat.get("tools", {}).get("anyOf", ()):
        if option.get("type") == "array":
            option["maxItems"] = config.max_tools
    for option in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if option.get("type") == "string":
            option["maxLength"] = config.max_prompt_chars


def _finish(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def run_server(engine: "Engine | ParallelEngine", config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
               verbose: bool = False, ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); HTTPS when given a certificate and its key."""
    import uvicorn

    app = create_app(engine, config)
    service = app.state.service
    slots = f", {engine.n_slots} slots x {engine.slot_ctx} tokens" if isinstance(engine, ParallelEngine) else ""
    engine = service.engine
    draft = f", draft {engine.draft_runtime.path.name}" if engine.draft_runtime else ""
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if ssl_certfile else "http"
    print(f"edgespec serve: {scheme}://{shown}:{port}/v1 serving {config.model_id!r} (mode {service.mode}{draft}, "
          f"context {engine.target.n_ctx}{slots}, queue {config.max_queue}, "
          f"{'API key required' if config.api_keys else 'no API key'})", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, host=host.strip("[]"), port=port, log_level="info" if verbose else "warning",
                                  access_log=verbose, timeout_graceful_shutdown=5,
                                  ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)).run()
