"""Constrained output (edgespec.structured) stays exact under speculation, for every drafter.

Greedy: constrained output under lookup, draft, suffix and auto equals constrained plain decoding,
token for token on the tiny models (f32; the same check the project makes for unconstrained greedy),
and up to the project's near-tie rule on SmolLM2 (q4 batch numerics). Sampling: the joint
distribution of the first three tokens is computed exactly from the target (its raw rows masked by
the grammar at each position, then the sampling chain) and compared by chi-square with speculative
samples; the grammar is position-dependent (a letter, then a non-letter, ...), so a verifier using
the wrong row's mask fails too. The same test must reject an engine that masks only the emitted
token and accepts drafts by the unmasked rows (what engines do when the grammar sits in the sampler).
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig, Verification
from edgespec.errors import EdgespecError
from edgespec.machine.profile import CostProfile
from edgespec.sampling import Sampler, SamplingParams, sample, token_distribution
from edgespec.structured import Constraint, ConstraintError, Grammar
from edgespec.verify import accept_sampling
from lossless import compare_greedy
from test_lossless_sampling import ALPHA, PROMPT, chi_square_pvalue
from test_onnx_runtime import exported  # noqa: F401  (a session fixture: the tiny checkpoints on ONNX and GGUF)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": Constraint.json_schema(SCHEMA),
    "regex": Constraint.regex(r"(hel+o )+[a-z]{1,6}\."),
    "gbnf": Constraint.gbnf('root ::= "[" item ("," item)* "]"\nitem ::= [0-9] | "hello" | "x" item'),
}
GPU_LIKE = CostProfile({n: 0.01 for n in (1, 2, 3, 4, 6, 8)}, 0.001, 0.0012, 0.00005)  # flat: auto drafts


def text_of(engine, tokens) -> str:
    return b"".join(engine.target.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tiny_engine(tiny_pair):
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512), load_runtime(tiny_pair["good_draft"], n_ctx=512)) as e:
        e._profile = GPU_LIKE
        yield e


# --- constraints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make,fragment", [
    (lambda: Constraint.json_schema({"type": "foo"}), "invalid json schema"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "invalid json schema"),
    (lambda: Constraint.lark("start: ((("), "invalid lark"),
    (lambda: Constraint.regex("(("), "invalid regex"),
    (lambda: Constraint.gbnf("root ::= (("), "gbnf"),
    (lambda: Constraint("yaml", "x"), "unknown constraint kind"),
])
def test_bad_constraints_fail_with_one_clear_line(make, fragment):
    with pytest.raises(ConstraintError) as info:
        make()
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, EdgespecError)  # the CLI's exit-2 path


def test_gbnf_and_lark_files_are_told_apart():
    assert Constraint.grammar_text('root ::= "a"').kind == "gbnf"
    assert Constraint.grammar_text('start: "a"').kind == "lark"


def test_an_unsatisfiable_constraint_is_refused_before_generating(tiny_engine):
    with pytest.raises(ConstraintError, match="admits no output"):
        tiny_engine.generate_tokens(PROMPT, GenerationConfig(max_tokens=4, temperature=0,
                                                             constraint=Constraint.regex(r"[^\s\S]")))


def test_the_server_checks_a_constraint_before_the_request_queues(tiny_engine):
    """The server builds the grammar over the model's vocabulary before queueing (a stream's status line
    goes out first): a constraint whose first mask is empty is a 400, not an error inside a 200 stream."""
    from types import SimpleNamespace

    from edgespec.serve.server import _Service

    service = SimpleNamespace(engine=tiny_engine)
    with pytest.raises(ConstraintError, match="admits no output"):
        _Service.check_satisfiable(service, Constraint.regex(r"[^\s\S]"))
    _Service.check_satisfiable(service, CONSTRAINTS["schema"])
    _Service.check_satisfiable(service, None)


def test_masks_follow_the_grammar_position_by_position(tiny_engine):
    """row_masks over a continuation equals walking the grammar one token at a time, and leaves the
    matcher where it was."""
    rt = tiny_engine.target
    grammar = Grammar(rt.grammar_tokenizer(), CONSTRAINTS["regex"], n_vocab=rt.vocab.n_vocab,
                      eog=rt.vocab.eog, position=0)
    tokens = np.asarray(rt.tokenize("hello hello ab.", add_special=False), dtype=np.int32)
    masks = grammar.row_masks(tokens[:0], tokens[:-1], len(tokens))
    assert grammar.position == 0 and grammar.valid_prefix(tokens) == len(tokens)
    for j, token in enumerate(tokens.tolist()):
        assert masks[j][token] and (masks[j] == grammar.allowed()).all()
        grammar.consume([token])
    assert set(np.flatnonzero(grammar.allowed())) == set(rt.vocab.eog)  # complete: only the end


# --- greedy: exact under every drafter -----------------------------------------------------------

@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_greedy_constrained_speculation_equals_constrained_plain(tiny_engine, name):
    constraint = CONSTRAINTS[name]
    cfg = dict(max_tokens=48, temperature=0, constraint=constraint)
    plain = tiny_engine.generate_tokens(PROMPT, GenerationConfig(mode="ar", **cfg))
    assert plain.stats.drafted == 0
    for mode in ("lookup", "draft", "suffix", "auto"):
        spec = tiny_engine.generate_tokens(PROMPT, GenerationConfig(mode=mode, **cfg))
        assert spec.tokens == plain.tokens, f"{name} under {mode}: {text_of(tiny_engine, spec.tokens)!r}"
    if name == "schema":  # a complete object, valid against its schema
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(tiny_engine, plain.tokens)), SCHEMA)


def test_forced_tokens_are_drafted_and_counted_apart(tiny_engine):
    cfg = GenerationConfig(max_tokens=48, temperature=0, mode="draft", constraint=CONSTRAINTS["schema"])
    stats = tiny_engine.generate_tokens(PROMPT, cfg).stats
    assert stats.forced > 0 and stats.forced_accepted == stats.forced  # '{"', key names, punctuation
    assert stats.to_dict()["forced"] == stats.forced and "forced" in stats.summary()
    assert stats.generated >= stats.accepted + stats.forced_accepted
    plain = tiny_engine.generate_tokens(PROMPT, GenerationConfig(max_tokens=48, temperature=0, mode="ar",
                                                                 constraint=CONSTRAINTS["schema"])).stats
    assert plain.rounds < plain.generated  # plain decoding emits the forced runs in fewer passes too


LONG_KEYS = {"type": "object", "properties": {
    "customer_full_name_as_written": {"type": "string", "enum": ["alpha", "beta"]},
    "number_of_items_in_the_order": {"type": "integer", "minimum": 0, "maximum": 9},
    "delivery_is_requested_before_noon": {"type": "boolean"}},
    "required": ["customer_full_name_as_written", "number_of_items_in_the_order", "delivery_is_requested_before_noon"],
    "additionalProperties": False}


class AllRows:
    """The same runtime, not offering SelectedRows: every row of every pass is computed."""

    def __init__(self, runtime):
        from edgespec.runtimes.base import SelectedRows

        self._runtime = runtime
        self.capabilities = runtime.capabilities - {SelectedRows}

    def __getattr__(self, name):
        return getattr(self._runtime, name)


@pytest.mark.parametrize("mode,temperature", [("ar", 0.0), ("draft", 0.0), ("lookup", 0.0), ("draft", 0.8)])
def test_certain_tokens_need_no_logits_row(tiny_pair, mode, temperature):
    """Where the grammar admits one token, its masked distribution is a point mass: the token is fed
    (its KV) but its row is not computed. Same output as computing every row, fewer rows, every pass
    exact (a skipped row must be a point mass on its token after the mask: edgespec.audit). Sampling
    too: the computed rows' draws are the same, so the same seed gives the same tokens."""
    from edgespec.audit import Fresh, Recorder, check_decisions, check_rows

    config = GenerationConfig(max_tokens=200, temperature=temperature, mode=mode, draft_max=4, seed=7,
                              constraint=Constraint.json_schema(LONG_KEYS))
    runs = {}
    for name, wrap in (("selected", lambda rt: rt), ("all", AllRows)):
        with Engine(wrap(load_runtime(tiny_pair["target"], n_ctx=512)),
                    load_runtime(tiny_pair["good_draft"], n_ctx=512)) as engine:
            engine.recorder = Recorder()
            result = engine.generate_tokens(PROMPT, config)
            passes = list(engine.recorder.passes)
            check_decisions(passes, PROMPT, result.tokens)
            rows = sum(len(p.logits) - len(p.skipped) for p in passes)
            runs[name] = (result, passes, rows, text_of(engine, result.tokens))
    (selected, passes, rows, text), (every, all_passes, all_rows, _) = runs["selected"], runs["all"]
    assert selected.tokens == every.tokens and selected.finish_reason == "stop"
    jsonschema.validate(json.loads(text), LONG_KEYS)
    assert not any(p.skipped for p in all_passes) and any(p.skipped for p in passes)
    assert selected.stats.forced == every.stats.forced > 0  # forced tokens still counted apart
    print(f"\n{mode}: {rows} rows computed instead of {all_rows} ({selected.stats.forced} forced tokens)")
    assert rows < all_rows * 0.75
    fresh_runtime = load_runtime(tiny_pair["target"], n_ctx=512, n_threads=1)
    check_rows(passes, Fresh(fresh_runtime), which=lambda i, p: i < 3)  # the computed rows are the model's own
    fresh_runtime.close()


@pytest.mark.slow
def test_smollm2_json_under_speculation(smollm2_path, smollm2_draft):
    """A real model answering in JSON: valid against the schema, the same under every drafter (up
    to the project's near-tie rule for q4 batch numerics)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                               "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "born", "fields"], "additionalProperties": False}
    with Engine(load_runtime(smollm2_path), load_runtime(smollm2_draft)) as engine:
        ids = engine.prompt_tokens("Who was Ada Lovelace? Answer in JSON with her name, birth year and fields.")
        cfg = dict(max_tokens=80, temperature=0, constraint=Constraint.json_schema(schema))
        plain = engine.generate_tokens(ids, GenerationConfig(mode="ar", **cfg))
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(engine, plain.tokens)), schema)
        for mode in ("lookup", "draft", "suffix", "auto"):
            spec = engine.generate_tokens(ids, GenerationConfig(mode=mode, **cfg))
            assert compare_greedy(engine.target, ids, plain.tokens, spec.tokens).near_tie, mode
            if spec.finish_reason == "stop":
                jsonschema.validate(json.loads(text_of(engine, spec.tokens)), schema)


# --- penalties and logit bias: exact under speculation too ---------------------------------------

def test_presence_frequency_and_bias_follow_the_rules():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 2.0),))
    logits = np.zeros((1, 6), dtype=np.float32)
    row = Sampler(params, 0).rows(logits, np.array([1, 1, 2], dtype=np.int32), np.zeros(0, dtype=np.int32))[0]
    assert row.tolist() == pytest.approx([0, -1.0, -0.75, 2.0, 0, 0])
    with pytest.raises(EdgespecError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(EdgespecError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 500.0),))


def test_penalties_and_bias_are_exact_under_speculation(tiny_engine):
    cfg = dict(max_tokens=40, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.1,
               logit_bias=((104, 3.0), (155, -100.0)))
    plain = tiny_engine.generate_tokens(PROMPT, GenerationConfig(mode="ar", **cfg))
    assert 155 not in plain.tokens
    for mode in ("lookup", "draft", "suffix", "auto"):
        assert tiny_engine.generate_tokens(PROMPT, GenerationConfig(mode=mode, **cfg)).tokens == plain.tokens, mode
    with pytest.raises(EdgespecError, match="logit_bias"):
        tiny_engine.generate_tokens(PROMPT, GenerationConfig(max_tokens=4, logit_bias=((10 ** 6, 1.0),)))


# --- sampling: the constrained distribution, exactly ---------------------------------------------

N_SAMPLES = 3000
N_TOKENS = 3
SAMPLING = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
# A letter, then a printable non-letter, then a letter: each position has its own mask.
ALTERNATING = Constraint.regex(r"([A-Za-z][ -@\[-`{-~])+")


def exact_constrained_joint(runtime, constraint, prompt, n_tokens=N_TOKENS) -> dict:
    """P(t1..tn | prompt): the target's raw row at each prefix, masked by the grammar walked along
    that prefix, then the sampling chain; by enumeration."""
    params = SamplingParams(**SAMPLING)
    joint = {}

    def walk(prefix: tuple, mass: float, grammar: Grammar) -> None:
        if len(prefix) == n_tokens:
            joint[prefix] = mass
            return
        runtime.truncate(0)
        logits = runtime.decode(prompt + list(prefix), 1)[0]
        mask = grammar.allowed()
        probs = token_distribution(np.where(mask, logits, -np.inf), params)
        for token in np.flatnonzero(probs):
            grammar.consume([int(token)])
            walk(prefix + (int(token),), mass * float(probs[token]), grammar)
            grammar.matcher.rollback(1)
            grammar.position -= 1

    walk((), 1.0, Grammar(runtime.grammar_tokenizer(), constraint, n_vocab=runtime.vocab.n_vocab,
                          eog=runtime.vocab.eog, position=len(prompt)))
    runtime.truncate(0)
    return joint


class MaskOnlyTheEmittedToken(Engine):
    """A wrong engine: drafts are judged by the target's unmasked rows, and only the token it emits
    (the correction or the bonus) is drawn from the masked row."""

    def verify_accept(self, state, draft, logits, verifier=None, skipped=()):
        masked = state.sampler.rows(logits, state.committed, draft.tokens)
        unmasked = Sampler(state.sampler.params, 0).rows(logits, state.committed, draft.tokens)
        n, _ = accept_sampling(draft.tokens, draft.probs, unmasked, state.sampler.rng)
        if n < len(draft):
            residual = masked[n].copy()
            if draft.probs is None:
                residual[draft.tokens[n]] = 0.0
            else:
                residual = np.maximum(residual - draft.probs[n], 0.0)
            token = sample(residual if residual.sum() > 0 else masked[n], state.sampler.rng)
        else:
            token = sample(masked[n], state.sampler.rng)
        self.target.truncate(state.n + n)
        return Verification(draft, n, token, logits)


@pytest.fixture(scope="module")
def constrained_joint(tiny_pair):
    rt = load_runtime(tiny_pair["target"], n_ctx=256)
    joint = exact_constrained_joint(rt, ALTERNATING, PROMPT)
    rt.close()
    assert abs(sum(joint.values()) - 1) < 1e-9 and len(joint) == 4 ** N_TOKENS
    return joint


@pytest.fixture(scope="module")
def copy_case(tiny_pair, constrained_joint):
    """A prompt holding the likeliest constrained answer after a space and ending with a space, so
    lookup and suffix copy it from the first round (the tiny model's likeliest letters are nowhere in
    "hello hello"), and its exact joint."""
    prompt = PROMPT + [32, *max(constrained_joint, key=constrained_joint.get), 32]
    rt = load_runtime(tiny_pair["target"], n_ctx=256)
    joint = exact_constrained_joint(rt, ALTERNATING, prompt)
    rt.close()
    return prompt, joint


def constrained_samples(engine, mode, prompt=PROMPT):
    out, drafted = [], 0
    for seed in range(N_SAMPLES):
        result = engine.generate_tokens(prompt, GenerationConfig(seed=seed, max_tokens=N_TOKENS, mode=mode,
                                                                 draft_max=2, constraint=ALTERNATING, **SAMPLING))
        assert len(result.tokens) == N_TOKENS
        out.append(tuple(result.tokens))
        drafted += result.stats.drafted
    return out, drafted


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind,mode", [("good_draft", "ar"), ("good_draft", "draft"), ("bad_draft", "draft"),
                                             ("good_draft", "lookup"), ("good_draft", "suffix"),
                                             ("good_draft", "auto")])
def test_constrained_sampling_matches_the_masked_target(request, tiny_pair, draft_kind, mode):
    prompt, joint = request.getfixturevalue("copy_case") if mode in ("lookup", "suffix") else \
        (PROMPT, request.getfixturevalue("constrained_joint"))
    with Engine(load_runtime(tiny_pair["target"], n_ctx=256), load_runtime(tiny_pair[draft_kind], n_ctx=256)) as e:
        e._profile = GPU_LIKE
        samples, drafted = constrained_samples(e, mode, prompt)
    assert (drafted > 0) == (mode != "ar")
    assert set(samples) <= set(joint), "sampled an outcome the constrained target gives probability 0"
    p = chi_square_pvalue(samples, joint)
    print(f"\nconstrained {mode} with {draft_kind}: chi-square p = {p:.4f}")
    assert p > ALPHA


@pytest.mark.slow
def test_the_test_rejects_masking_only_the_emitted_token(tiny_pair, constrained_joint):
    with MaskOnlyTheEmittedToken(load_runtime(tiny_pair["target"], n_ctx=256),
                                 load_runtime(tiny_pair["good_draft"], n_ctx=256)) as e:
        samples, drafted = constrained_samples(e, "draft")
    assert drafted > 0 and set(samples) <= set(constrained_joint)  # every output valid: only the test can tell
    p = chi_square_pvalue(samples, constrained_joint)
    print(f"\nmasking only the emitted token: p = {p:.2e}")
    assert p < ALPHA


# --- the command line ------------------------------------------------------------------------------

def test_cli_answers_in_the_schema(smollm2_path, tmp_path):
    from test_cli import edgespec

    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(SCHEMA))
    proc = edgespec("generate", "Describe a person as JSON.", "--target", smollm2_path, "--temperature", "0",
                    "-n", "64", "--json-schema", schema_file, "--mode", "lookup", "--threads", 2)
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), SCHEMA)
    assert "forced" in proc.stderr  # the stats line counts what the schema forced
    proc = edgespec("generate", "Say yes or no.", "--target", smollm2_path, "--temperature", "0", "-n", "8",
                    "--regex", "(yes|no)", "--threads", 2)
    assert proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"), proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["--json-schema", '{"type": "foo"}'], "invalid json schema"),
    (["--json-schema", "missing.json"], "neither a file nor a JSON schema"),
    (["--regex", "(("], "invalid regex"),
    (["--regex", "a", "--json-schema", "{}"], "give one"),
    (["--regex", r"[^\s\S]"], "admits no output"),
])
def test_cli_refuses_bad_constraints_in_one_line(smollm2_path, args, needle):
    from test_cli import assert_user_error, edgespec

    assert_user_error(edgespec("generate", "Hi.", "--target", smollm2_path, "-n", "4", *args), needle)


def test_cli_refuses_a_grammar_that_does_not_parse(smollm2_path, tmp_path):
    from test_cli import assert_user_error, edgespec

    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" (')
    assert_user_error(edgespec("generate", "Hi.", "--target", smollm2_path, "--grammar", bad), "gbnf")


# --- ONNX Runtime: the grammar's tokenizer from the exported tokenizer.json ---------------------

def test_constrained_output_on_onnx_equals_llama_cpp(request):
    """The same weights on ONNX Runtime (llguidance's tokenizer from tokenizer.json) and on
    llama.cpp (from the GGUF's vocabulary): the same constrained greedy output, plain and drafted."""
    pytest.importorskip("onnxruntime")
    from test_onnx_runtime import exact_llama, onnx_runtime

    exported = request.getfixturevalue("exported")
    constraint = Constraint.regex(r"[a-z]+( [a-z]+)*\.")
    cfg = dict(max_tokens=24, temperature=0, constraint=constraint)
    with Engine(onnx_runtime(exported["llama"]["onnx"]), onnx_runtime(exported["llama_draft"]["onnx"])) as onnx, \
            Engine(exact_llama(exported["llama"]["gguf"])) as llama:
        ids = onnx.target.tokenize("the cat sat on the mat", add_special=True, parse_special=False)
        plain = onnx.generate_tokens(ids, GenerationConfig(mode="ar", **cfg))
        assert plain.tokens == llama.generate_tokens(ids, GenerationConfig(mode="ar", **cfg)).tokens
        assert plain.tokens == onnx.generate_tokens(ids, GenerationConfig(mode="draft", **cfg)).tokens
        import re
        assert re.fullmatch(r"[a-z]+( [a-z]+)*\.?", text_of(onnx, plain.tokens).strip() or "a")


# --- the OpenAI server: response_format, tools, refused fields (the real client, a real server) ---

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
# Where parallel calls are open, the 135M model asked as ASK lists get_time calls until max_tokens; asked
# plainly it makes the two calls and stops, which shows two calls in one answer.
ASK_BOTH = [{"role": "user", "content": "Call get_weather for Paris and get_time for Tokyo."}]


@pytest.fixture(scope="module")
def tool_server(smollm2_path, tmp_path_factory):
    from test_server import running_server

    log = tmp_path_factory.mktemp("serve-tools") / "server.log"
    with running_server(log, "--target", smollm2_path, "--model-name", "smol", "--mode", "lookup",
                        "--ctx", 2048) as url:
        yield url


@pytest.fixture(scope="module")
def tool_client(tool_server):
    import openai

    return openai.OpenAI(base_url=f"{tool_server}/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema_and_json_object(tool_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    r = tool_client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
        temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = tool_client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=80,
                                            response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def check_calls(message, names):
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_named_and_single_tool_calls(tool_client):
    r = tool_client.chat.completions.create(model="smol", messages=ASK_BOTH, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, {"get_weather", "get_time"})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    r = tool_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message, {"get_time"})
    r = tool_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert len(r.choices[0].message.tool_calls) == 1
    r = tool_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                            temperature=0, max_tokens=60)
    if r.choices[0].finish_reason == "tool_calls":
        check_calls(r.choices[0].message, {"get_weather"})
    else:
        assert r.choices[0].message.content and not r.choices[0].message.content.startswith("{")


def test_streamed_tool_calls(tool_client):
    stream = tool_client.chat.completions.create(model="smol", messages=ASK_BOTH, tools=[WEATHER, TIME], temperature=0,
                                                 tool_choice="required", max_tokens=120, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and sorted(calls) == [0, 1]
    for entry in calls.values():
        assert entry["name"] in ("get_weather", "get_time") and isinstance(json.loads(entry["arguments"]), dict)


def test_a_tool_conversation_goes_through_the_template(tool_client):
    first = tool_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], temperature=0,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = tool_client.chat.completions.create(model="smol", messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=40, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_penalties_and_logit_bias_are_honoured_exactly(tool_client, smollm2_path):
    from edgespec.engine import Engine

    settings = dict(temperature=0, max_tokens=24, presence_penalty=1.0, frequency_penalty=0.5)
    with Engine(load_runtime(smollm2_path, n_ctx=2048, n_threads=1)) as library:
        ids = library.prompt_tokens(ASK)
        plain = library.generate_tokens(ids, GenerationConfig(mode="ar", **settings))
        banned = plain.tokens[0]
        biased = library.generate_tokens(ids, GenerationConfig(mode="ar", logit_bias=((banned, -100.0),), **settings))
    r = tool_client.chat.completions.create(model="smol", messages=ASK, **settings)
    assert r.model_extra["edgespec"]["tokens"] == plain.tokens
    r = tool_client.chat.completions.create(model="smol", messages=ASK, logit_bias={str(banned): -100}, **settings)
    assert r.model_extra["edgespec"]["tokens"] == biased.tokens and banned not in biased.tokens


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False}


def test_tools_or_the_response_format_is_one_grammar(tiny_engine):
    """tool_choice auto with a response_format: a call, or an answer in the format, and nothing else
    (JSON on one line, spaced as json.dumps writes it, either way); a forced call leaves no room for the format."""
    from edgespec.tools import parse_tools, tool_constraint

    rt, tools = tiny_engine.target, parse_tools([WEATHER, TIME])

    def allows(constraint, text, complete=True):
        grammar = Grammar(rt.grammar_tokenizer(), constraint, n_vocab=rt.vocab.n_vocab, eog=rt.vocab.eog, position=0)
        tokens = np.asarray(rt.tokenize(text, add_special=False, parse_special=False), dtype=np.int32)
        taken = grammar.valid_prefix(tokens)
        return taken == len(tokens) and (not complete or grammar.consume(tokens) == len(tokens)
                                         and grammar.matcher.is_accepting())

    call = '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}'
    answer = '{"city": "Paris", "population": 2100000}'
    either = tool_constraint(tools, "auto", parallel=True, answer=CITY)
    assert allows(either, call) and allows(either, answer)
    assert not allows(either, '{"city":"Paris"}') and not allows(either, "Paris is large.", complete=False)
    assert not allows(either, '{ "city": "Paris", "population": 1}', complete=False)  # no free whitespace
    assert not allows(either, '{"city":"Paris","population":1}', complete=False)  # the separators json.dumps writes
    anything = tool_constraint(tools, "auto", parallel=True, answer={"type": "object"})
    assert allows(anything, '{"x": [1, 2]}') and allows(anything, call)
    forced = tool_constraint(tools, "required", parallel=True, answer=CITY)
    assert allows(forced, call) and not allows(forced, answer)


def test_hermes_models_call_in_their_own_format():
    """A template that teaches `<tool_call>` blocks (Qwen2.5) gets them, the tags as its special tokens:
    one block per call, a newline between blocks, JSON valid for the named tool inside; plain text in
    auto mode (never the tags, which text cannot hold), or an answer in the response format. A
    template without the tags keeps the {"tool_calls": [...]} object."""
    from edgespec.models import store
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime
    from edgespec.tools import hermes_tags, parse_tool_calls, parse_tools, tool_constraint, tool_note

    tools = parse_tools([WEATHER, TIME])
    with LlamaCppRuntime(store.resolve("qwen2.5-coder-0.5b"), LlamaCppOptions(n_ctx=256)) as rt:
        tags = hermes_tags(rt.chat_template(), lambda text: rt.tokenize(text, add_special=False, parse_special=True),
                           rt.token_bytes)
        assert tags is not None and [rt.token_text(t) for t in tags] == ["<tool_call>", "</tool_call>"]

        def allows(constraint, text, complete=True):
            grammar = Grammar(rt.grammar_tokenizer(), constraint, n_vocab=rt.vocab.n_vocab, eog=rt.vocab.eog,
                              position=0)
            tokens = np.asarray(rt.tokenize(text, add_special=False, parse_special=True), dtype=np.int32)
            return grammar.valid_prefix(tokens) == len(tokens) and (
                not complete or grammar.consume(tokens) == len(tokens) and grammar.matcher.is_accepting())

        time_call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
        weather_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
        both = f"{time_call}\n{weather_call}"
        required = tool_constraint(tools, "required", parallel=True, tags=tags)
        assert allows(required, time_call) and allows(required, both)
        assert not allows(required, "It is sunny.", complete=False)
        assert not allows(required, '{"tool_calls": [{"name": "get_time"', complete=False)
        assert not allows(required, time_call.replace('"city"', '"town"'), complete=False)
        assert allows(tool_constraint(tools, "required", parallel=False, tags=tags), time_call)
        assert not allows(tool_constraint(tools, "required", parallel=False, tags=tags), both)
        named = tool_constraint(tools, parse_tools([WEATHER])[0], parallel=True, tags=tags)
        assert allows(named, weather_call) and not allows(named, time_call, complete=False)
        auto = tool_constraint(tools, "auto", parallel=True, tags=tags)
        assert allows(auto, both) and allows(auto, "It is sunny in Oslo.")
        assert not allows(auto, "Let me check: " + time_call, complete=False)  # a call is the whole answer
        in_format = tool_constraint(tools, "auto", parallel=True, answer=CITY, tags=tags)
        assert allows(in_format, time_call) and allows(in_format, '{"city": "Paris", "population": 2100000}')
        assert not allows(in_format, "Paris.", complete=False)
        calls = parse_tool_calls(both, tools)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # the note asks for as many calls as the grammar admits
    assert tool_note(tools, "required", parallel=False, native=True) == "Call one of the tools now."
    assert tool_note(tools, "required", parallel=True, native=True) == "Call one or more of the tools now."
    assert "Call one now" in tool_note(tools, "required", parallel=False)
    rendered = {1: b"<tool_call>", 2: b"</tool_call>"}.get
    one_each = {"<tool_call>": [1], "</tool_call>": [2]}.get
    assert hermes_tags("<tool_call>{{ tools }}", one_each, rendered) == (1, 2)
    assert hermes_tags("{{ messages }}", one_each, rendered) is None  # a template that does not teach the tags
    assert hermes_tags("<tool_call>{{ tools }}", lambda text: [1, 2], rendered) is None  # not single tokens
    assert hermes_tags("<tool_call>{{ tools }}", one_each, lambda t: b"") is None  # control tokens: no text


@pytest.fixture(scope="module")
def qwen_tool_client(tmp_path_factory):
    import openai

    from edgespec.models import store
    from test_server import running_server

    log = tmp_path_factory.mktemp("serve-qwen-tools") / "server.log"
    with running_server(log, "--target", store.resolve("qwen2.5-coder-0.5b"), "--model-name", "qwen", "--mode", "ar",
                        "--ctx", 2048) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_a_hermes_model_calls_tools_through_the_openai_client(qwen_tool_client):
    """Qwen2.5 through `serve`: required and a named tool come back as OpenAI tool_calls, plain and
    streamed, from the model's own <tool_call> blocks. (In auto mode this coder model answers with a
    ```json block of text rather than a call; the grammar test above covers auto.)"""
    r = qwen_tool_client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, {"get_weather", "get_time"})
    r = qwen_tool_client.chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message, {"get_time"})
    stream = qwen_tool_client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME],
                                                      tool_choice="required", temperature=0, max_tokens=120,
                                                      stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)  # the tags never leak as text
    assert any(c.choices[0].delta.tool_calls for c in chunks)


# A ChatML template that renders tools and teaches Hermes-style calls, as Qwen2.5's does (in our words).
HERMES_CHATML = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Write each call as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_tiny(tmp_path_factory) -> dict[str, object]:
    """A tiny random Qwen2 checkpoint whose vocabulary holds `<tool_call>` and `</tool_call>` as added
    tokens that render as text (as Qwen2.5's does) and whose template teaches them, as a Hugging Face
    directory (MLX) and an fp32 ONNX export."""
    from edgespec.exporters.onnx_export import export_onnx
    from hf_models import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("hermes-tiny")
    hf = write_tiny_checkpoint(root / "hf", family="qwen2", tokenizer="qwen2", pad_vocab=13, seed=3, max_positions=2048,
                               added=("<tool_call>", "</tool_call>"), chat_template=HERMES_CHATML)
    return {"mlx": hf, "onnx": export_onnx(hf, root / "onnx", ["fp32"]).directory}


@pytest.mark.parametrize("runtime", ["onnx", "mlx"])
def test_hermes_tool_calls_on_onnx_and_mlx(hermes_tiny, runtime, tmp_path):
    """The Hermes path off llama.cpp: the tags found through the Hugging Face tokenizer the ONNX and MLX
    runtimes share, the grammar naming them by id, the blocks read back as OpenAI tool_calls, plain and
    streamed. The weights are random, so only the grammar makes these answers calls; the strings'
    maxLength bounds them."""
    pytest.importorskip("onnxruntime" if runtime == "onnx" else "mlx_lm")
    import openai

    from edgespec.tools import hermes_tags
    from test_server import running_server

    if runtime == "onnx":
        from test_onnx_runtime import onnx_runtime as open_runtime
    else:
        from test_mlx_runtime import mlx_runtime as open_runtime
    with open_runtime(hermes_tiny[runtime]) as rt:
        tags = hermes_tags(rt.chat_template(), lambda text: rt.tokenize(text, add_special=False, parse_special=True),
                           rt.token_bytes)
        assert tags is not None and [rt.token_text(t) for t in tags] == ["<tool_call>", "</tool_call>"]
    with running_server(tmp_path / "server.log", "--target", hermes_tiny[runtime], "--runtime", runtime,
                        "--model-name", "tiny", "--ctx", 2048) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=200)
        r = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message, {"get_weather", "get_time"})
        r = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message, {"get_time"})
        chunks = list(client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False,
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(not c.choices[0].delta.content for c in chunks)  # the tags never leak as text
        assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) >= 1


def test_response_format_with_tools_through_the_openai_client(tool_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    asks = [ASK, [{"role": "user", "content": "The largest city of France and its population, as JSON."}]]
    for messages in asks:  # auto: a call, or an answer in the format
        r = tool_client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER, TIME],
                                                response_format=fmt, temperature=0, max_tokens=120)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message, {"get_weather", "get_time"})
        else:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), CITY)
    r = tool_client.chat.completions.create(model="smol", messages=asks[1], tools=[WEATHER, TIME], response_format=fmt,
                                            tool_choice="required", temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, {"get_weather", "get_time"})
    r = tool_client.chat.completions.create(model="smol", messages=asks[1], tools=[WEATHER], response_format=fmt,
                                            tool_choice="none", temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    stream = tool_client.chat.completions.create(model="smol", messages=asks[1], tools=[WEATHER, TIME], stream=True,
                                                 response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    content, calls, finish = "", 0, None
    for chunk in stream:
        content += chunk.choices[0].delta.content or ""
        calls += len(chunk.choices[0].delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert (finish == "tool_calls" and calls) or (finish == "stop" and isinstance(json.loads(content), dict)), content


@pytest.mark.parametrize("extra,param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"n": 2}, "n"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format"),  # no output can match
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nope"}}}}, "response_format"),
    ({"stream": True, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": 3, "maxItems": 1}}}}, "response_format"),  # refused before the stream
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"presence_penalty": 5}, "presence_penalty"),
])
def test_fields_not_honoured_are_refused_by_name(tool_server, extra, param):
    import httpx

    body = {"model": "smol", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{tool_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{tool_server}/v1/chat/completions", json={"model": "smol", "messages": ASK, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200  # the server keeps serving


# --- `serve --parallel`: each slot its own grammar, masks and rollback -----------------------------

# nearly flat (auto drafts) but rising, so a request's share of a shared pass costs something
SLOTS_PROFILE = CostProfile({n: 0.01 + 0.0002 * n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}, 0.001, 0.0012, 0.00005)


def tools_constraint():
    from edgespec.tools import parse_tools, tool_constraint

    return tool_constraint(parse_tools([WEATHER, TIME]), "required", parallel=True)


def slots_run(tiny_pair, jobs, recorder):
    """Every (prompt, config) submitted at once to 4 slots sharing one pool; their results in order."""
    import asyncio

    from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions
    from edgespec.serve.slots import ParallelEngine, SlotScheduler

    options = LlamaCppOptions(n_ctx=2048, n_threads=1)
    with ParallelEngine(LlamaCppMultiSeqRuntime(tiny_pair["target"], options, n_seq=4),
                        LlamaCppMultiSeqRuntime(tiny_pair["good_draft"], options, n_seq=4), slot_ctx=512) as engine:
        for e in engine.engines:
            e.recorder, e._profile = recorder, SLOTS_PROFILE
        scheduler = SlotScheduler(engine, max_queue=len(jobs))

        async def run_all():
            return await asyncio.gather(*[scheduler.generate(p, c) for p, c in jobs])

        try:
            results = asyncio.run(run_all())
        finally:
            scheduler.close()
        assert scheduler.counters["batched_steps"] > 0 and scheduler.counters["max_active"] == 4
    return results


def test_constrained_requests_under_parallel_equal_their_solo_answers(tiny_pair):
    """Schema, tool-call and regex requests at once in 4 slots (draft, lookup, auto): each request's
    grammar masks its own rows and rolls back its own rejected drafts, so every answer equals the same
    request's constrained answer alone, every pass is the rule's on its recorded rows (zero tolerance),
    and the JSON answers are valid."""
    from edgespec.audit import Recorder, check_decisions
    from test_exactness import PROMPTS

    schema, calls = CONSTRAINTS["schema"], tools_constraint()
    plan = [(schema, "draft"), (calls, "lookup"), (schema, "auto"), (calls, "draft"), (CONSTRAINTS["regex"], "auto"),
            (schema, "lookup")]
    jobs = [(PROMPTS[i], GenerationConfig(max_tokens=64, temperature=0, mode=mode, draft_max=4, constraint=c))
            for i, (c, mode) in enumerate(plan)]
    recorder = Recorder()
    results = slots_run(tiny_pair, jobs, recorder)
    by_prompt = {tuple(ps[0].committed.tolist()): ps for ps in recorder.by_key().values()}
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512), load_runtime(tiny_pair["good_draft"], n_ctx=512)) as solo:
        solo._profile = SLOTS_PROFILE
        valid = 0
        for (prompt, config), result in zip(jobs, results):
            alone = solo.generate_tokens(prompt, config)
            assert result.tokens == alone.tokens, f"{config.mode}: {text_of(solo, result.tokens)!r}"
            check_decisions(by_prompt[tuple(prompt)], prompt, result.tokens)
            if config.constraint.kind == "json_schema" and result.finish_reason == "stop":
                value = json.loads(text_of(solo, result.tokens))
                jsonschema.validate(value, json.loads(config.constraint.source))
                valid += 1
    assert valid >= 3, "too few complete JSON answers to check"
    assert sum(r.stats.drafted for r in results) > 0 and sum(r.stats.forced for r in results) > 0


# --- cloud-edge: the verifier applies the same constraint --------------------------------------------

from test_exactness import audited_verifier, tiny  # noqa: E402,F401  (fixtures: `serve --verifier` in this process)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_constrained_cloud_edge_equals_constrained_local_plain(tiny_pair, audited_verifier, pipelined):
    """The client sends the constraint when it opens the session; the verifier builds its own grammar
    and masks its verify rows as the engine does, the device masks its draft rows: the output equals
    constrained plain decoding here, every verify pass is the rule's on its recorded rows."""
    from edgespec.audit import check_decisions
    from edgespec.cloud.client import CloudEdgeClient, CloudOptions, Gate

    core, url, key = audited_verifier
    gate = Gate(token_threshold=0.0, product_threshold=0.0, max_block=4)
    with Engine(load_runtime(tiny_pair["target"], n_ctx=512)) as local, \
            CloudEdgeClient(load_runtime(tiny_pair["good_draft"], n_ctx=512),
                            CloudOptions(url, api_key=key, tune=False, pipelined=pipelined, gate=gate)) as client:
        for constraint in (CONSTRAINTS["schema"], tools_constraint(), CONSTRAINTS["gbnf"]):
            config = GenerationConfig(max_tokens=64, temperature=0, constraint=constraint)
            plain = local.generate_tokens(PROMPT, replace(config, mode="ar"))
            core.recorder.passes.clear()
            cloud = client.generate_tokens(PROMPT, config)
            assert cloud.stats.offline_tokens == 0 and cloud.stats.drafted > 0
            assert cloud.tokens == plain.tokens, f"{constraint.kind}: {text_of(local, cloud.tokens)!r}"
            check_decisions(list(core.recorder.passes), PROMPT, cloud.tokens)
            assert cloud.finish_reason == "stop" or constraint is not CONSTRAINTS["schema"]
            if constraint.kind == "json_schema" and cloud.finish_reason == "stop":
                jsonschema.validate(json.loads(text_of(local, cloud.tokens)), json.loads(constraint.source))


@pytest.mark.parametrize("constraint,says", [
    ({"kind": "json_schema", "source": '{"type": "foo"}', "start": 3}, "invalid json schema"),
    ({"kind": "regex", "source": r"[^\s\S]", "start": 3}, "admits no output"),
    ({"kind": "yaml", "source": "", "start": 3}, "constraint.kind"),
    ({"kind": "regex", "source": "[0-9]+", "start": 1}, "do not follow"),  # the history after start is letters
])
def test_the_verifier_refuses_a_bad_constraint_in_its_own_words(audited_verifier, constraint, says):
    import httpx

    from edgespec.cloud.protocol import CONTENT_TYPE, SessionRequest, pack, unpack
    from edgespec.sampling import SamplingParams

    core, url, key = audited_verifier
    message = SessionRequest(np.asarray([295, 104, 101], dtype=np.int32), SamplingParams(temperature=0), 1).to_wire()
    r = httpx.post(f"{url}/v1/sessions", content=pack({**message, "constraint": constraint}),
                   headers={"Authorization": f"Bearer {key}", "Content-Type": CONTENT_TYPE}, timeout=30)
    answer = unpack(r.content, core.limits)
    assert r.status_code == 422 and answer["error"] == "bad_constraint" and says in answer["message"], answer
    assert "\n" not in answer["message"]
