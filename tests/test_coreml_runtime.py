"""Core ML runtime (runtimes/coreml.py) on a tiny exported bundle.

On any OS: the package's interface read and checked (and a corrupt or mismatched one refused in one
line), the plan of calls and its masks, the vocabulary against llama.cpp's on the bundle's GGUF, the
platform check, and the torch reference runtime, which makes exactly the calls the Core ML runtime
makes, so plan + masks + rollback are checked numerically (and through the engine). Prediction in
Core ML itself needs macOS 15+: those tests are written in full and skipped elsewhere.
"""

from __future__ import annotations

import copy
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

import torch  # noqa: F401  (the export extra; CI installs it)

from lossless import compare_greedy

MAX_CONTEXT = 128
PREFILL_MAX = 16
DRAFT_MAX = 3
STATE = (2, 2, MAX_CONTEXT, 16)  # hf_tiny: 2 layers, 2 KV heads, head_dim 16


def _macos_15_or_later() -> bool:
    if sys.platform != "darwin":
        return False
    major = platform.mac_ver()[0].split(".")[0]
    return major.isdigit() and int(major) >= 15


needs_coreml = pytest.mark.skipif(sys.platform != "darwin" or not _macos_15_or_later(),
                                  reason="Core ML prediction needs macOS 15+; skipped on Linux")


@pytest.fixture(scope="session")
def bundle(hf_tiny, tmp_path_factory):
    """The tiny pair as GGUF f32 (llama.cpp, the reference) and Core ML int8, exported once (~25 s)."""
    from edgespec.exporters.bundle import ExportOptions, export_bundle

    return export_bundle(hf_tiny["llama"], tmp_path_factory.mktemp("coreml-rt") / "pair", draft=hf_tiny["llama_draft"],
                         options=ExportOptions(formats=("gguf", "coreml"), gguf_quants=("f32",), coreml_quant="int8",
                                               coreml_context=MAX_CONTEXT, coreml_prefill=PREFILL_MAX,
                                               draft_max=DRAFT_MAX, measure=False))


@pytest.fixture(scope="session")
def package(bundle):
    return bundle / "coreml" / "target.mlpackage"


def reference(bundle, hf_tiny, role="target", **kw):
    from edgespec.exporters.coreml_reference import TorchReferenceRuntime

    source = hf_tiny["llama"] if role == "target" else hf_tiny["llama_draft"]
    return TorchReferenceRuntime(source, bundle / "coreml" / f"{role}.mlpackage", bundle / "tokenizer", **kw)


def llama_cpp(bundle, role="target"):
    from conftest import load_runtime
    from edgespec.models.bundles import gguf_draft
    from edgespec.models.store import resolve

    # f16 KV and CPU flash attention round activations to f16 (~3e-3 here); the reference needs neither
    return load_runtime(resolve(bundle) if role == "target" else gguf_draft(bundle), n_ctx=MAX_CONTEXT, n_threads=1,
                        type_k="f32", type_v="f32", flash_attn=False)


def prompt_ids(rt, n=24) -> list[int]:
    from hf_models import corpus_texts

    return rt.tokenize(corpus_texts()[0], add_special=True, parse_special=False)[:n]


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


# --- the package ---------------------------------------------------------------------------------

def test_read_package(package):
    from edgespec.exporters.coreml_export import describe_package
    from edgespec.runtimes.coreml import package_info, read_package

    info = read_package(package)
    assert (info.n_vocab, info.state_shape, info.max_context, info.prefill_max, info.verify_tokens, info.draft_max) == \
        (400, STATE, MAX_CONTEXT, PREFILL_MAX, DRAFT_MAX + 1, DRAFT_MAX)
    assert info.lengths == {"prefill": (1, PREFILL_MAX), "decode": (1, 1), "verify": (DRAFT_MAX + 1, DRAFT_MAX + 1)}
    assert info.kv_bytes == 2 * 2 * MAX_CONTEXT * 16 * 2 * 2
    assert info.quant == "int8" and 0 < info.weight_bytes < 400_000
    # The spec-only reader agrees with the exporter's full description (which also loads the weights).
    assert package_info(package, describe_package(package)) == info


def test_corrupt_package_is_one_line(package, tmp_path):
    from edgespec.errors import ModelFileError
    from edgespec.runtimes.coreml import read_package

    with pytest.raises(ModelFileError, match="Core ML package not found") as e:
        read_package(tmp_path / "nothing.mlpackage")
    one_line(e)
    for part in ("Manifest.json", "Data/com.apple.CoreML/model.mlmodel"):
        bad = tmp_path / part.replace("/", "_") / "target.mlpackage"
        shutil.copytree(package, bad)
        (bad / part).write_bytes(b"\x00garbage" * 64)
        with pytest.raises(ModelFileError, match=r"target.mlpackage is not a readable Core ML package .*export it again") as e:
            read_package(bad)
        one_line(e)


def _set_states(fn, index, value):
    for s in fn["states"]:
        s["shape"][index] = value


MISMATCHES = {
    "no verify": (lambda d: d["functions"].pop("verify"), "it has no verify function"),
    "metadata gone": (lambda d: d["metadata"].pop("edgespec.prefill_max"), "edgespec metadata .* missing"),
    "verify length": (lambda d: d["metadata"].update({"edgespec.verify_tokens": "6"}),
                      "verify takes 4 tokens where its metadata implies 6"),
    "prefill length": (lambda d: d["metadata"].update({"edgespec.prefill_max": "32"}),
                       "prefill takes 1..16 tokens where its metadata implies 1..32"),
    "context": (lambda d: d["metadata"].update({"edgespec.max_context": "256"}),
                "causal_mask reaches 128 positions, not max_context 256"),
    "state rows": (lambda d: [_set_states(fn, 2, 64) for fn in d["functions"].values()],
                   "KV state holds 64 positions but its metadata says max_context 128"),
    "states differ": (lambda d: _set_states(d["functions"]["verify"], 1, 4), "KV states of different shapes"),
    "mask dtype": (lambda d: d["functions"]["decode"]["inputs"][1].update({"dtype": "float32"}),
                   "decode does not take input_ids int32 and causal_mask float16"),
    "no state": (lambda d: d["functions"]["prefill"].update({"states": []}), "prefill does not hold k_cache"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_package_is_one_line(package, case):
    from edgespec.errors import ModelFileError
    from edgespec.runtimes.coreml import _describe_interface, package_info

    desc = copy.deepcopy(_describe_interface(package))
    change, message = MISMATCHES[case]
    change(desc)
    with pytest.raises(ModelFileError, match=message) as e:
        package_info(package, desc)
    assert one_line(e).startswith("target.mlpackage is not a Core ML package this runtime can run")


def test_reference_refuses_a_checkpoint_that_is_not_the_source(bundle, hf_tiny):
    from edgespec.errors import ModelFileError
    from edgespec.exporters.coreml_reference import TorchReferenceRuntime

    with pytest.raises(ModelFileError, match="qwen2 is not the source of target.mlpackage") as e:
        TorchReferenceRuntime(hf_tiny["qwen2"], bundle / "coreml" / "target.mlpackage", bundle / "tokenizer")
    one_line(e)


# --- the plan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_past", [0, 7, 90])
def test_plan_calls_fit_the_package(package, n_past):
    from edgespec.runtimes.coreml import plan_calls, read_package

    info = read_package(package)
    for n in range(1, MAX_CONTEXT - n_past + 1):
        calls = plan_calls(info, n_past, n)
        kinds = [c.function for c in calls]
        if n == 1:
            assert kinds == ["decode"]
        elif n == DRAFT_MAX + 1:
            assert kinds == ["verify"]
        else:
            assert set(kinds) == {"prefill"} and len(calls) == -(-n // PREFILL_MAX)
        start = 0
        for c in calls:  # contiguous, each within what its function takes, the mask placing it right
            assert (c.start, c.n_past) == (start, n_past + start)
            lo, hi = info.lengths[c.function]
            assert lo <= c.length <= hi
            mask = c.mask()
            assert mask.shape == (1, 1, c.length, c.n_past + c.length) and mask.dtype == np.float16
            assert mask.shape[-1] <= info.max_context
            attend = mask[0, 0] == 0
            for row in range(c.length):  # a token sees the cache and the new tokens up to itself
                assert attend[row].sum() == c.n_past + row + 1 and attend[row, : c.n_past + row + 1].all()
            start += c.length
        assert start == n


def test_plan_refuses_past_the_context(package):
    from edgespec.errors import ContextOverflowError
    from edgespec.runtimes.coreml import plan_calls, read_package

    info = read_package(package)
    with pytest.raises(ContextOverflowError, match="context of 128 tokens is full"):
        plan_calls(info, 120, 9)
    with pytest.raises(ContextOverflowError, match="context of 64 tokens"):
        plan_calls(info, 60, 5, n_ctx=64)
    assert plan_calls(info, 120, 8)[-1].n_past + plan_calls(info, 120, 8)[-1].length == MAX_CONTEXT


# --- the platform ---------------------------------------------------------------------------------

def test_platform_check():
    from edgespec.runtimes.coreml import CoreMLUnavailableError, check_platform

    with pytest.raises(CoreMLUnavailableError) as e:
        check_platform("linux")
    assert str(e.value) == "Core ML prediction needs macOS 15+; this is Linux"
    with pytest.raises(CoreMLUnavailableError, match=r"needs macOS 15\+; this is macOS 14.6"):
        check_platform("darwin", "14.6")
    check_platform("darwin", "15.1")


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_loading_off_macos_is_refused_in_one_line(bundle, package):
    from edgespec.loader import LoadOptions, load_pair
    from edgespec.runtimes.coreml import CoreMLRuntime, CoreMLUnavailableError

    for load in (lambda: CoreMLRuntime(package, bundle / "tokenizer"),
                 lambda: load_pair(bundle, options=LoadOptions(runtime="coreml"))):
        with pytest.raises(CoreMLUnavailableError) as e:
            load()
        assert str(e.value) == "Core ML prediction needs macOS 15+; this is Linux"
    # --budget is taken on Core ML (the guard alone, as on ONNX Runtime and MLX): what stops it here is the platform
    proc = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "Hi", "--target", str(bundle), "--runtime",
                           "coreml", "--budget", "8G", "-n", "4"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "EDGESPEC_DEBUG": ""})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: Core ML prediction needs macOS 15+; this is Linux"


def test_bundle_paths(bundle, tmp_path):
    import json

    from edgespec.errors import ModelFileError
    from edgespec.models.bundles import coreml as coreml_bundle_paths

    assert coreml_bundle_paths(bundle) == (bundle / "coreml" / "target.mlpackage", bundle / "coreml" / "draft.mlpackage",
                                           bundle / "tokenizer")
    manifest = json.loads((bundle / "edgespec.json").read_text())
    manifest["formats"].pop("coreml")
    (tmp_path / "edgespec.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFileError, match="has no Core ML package; export it with --format coreml"):
        coreml_bundle_paths(tmp_path)


# --- the vocabulary: the same as llama.cpp's on the bundle's GGUF -------------------------------

@pytest.fixture(scope="session")
def other_ggufs(hf_tiny, tmp_path_factory):
    """f32 GGUFs of the other tokenizer styles: SmolLM2 digits, Qwen2 with padded embedding rows, Llama 3 BOS."""
    from edgespec.exporters.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("coreml-rt-gguf")
    return {name: export_gguf(hf_tiny[name], root / name, ["f32"]).files["f32"] for name in ("smollm", "qwen2", "llama3")}


@pytest.mark.parametrize("name", ["bundle", "smollm", "qwen2", "llama3"])
def test_vocabulary_equals_llama_cpp(bundle, hf_tiny, other_ggufs, name):
    from conftest import load_runtime
    from hf_models import corpus_texts

    from edgespec.runtimes.hf_vocab import HFVocab

    if name == "bundle":
        tokenizer, rt = bundle / "tokenizer", llama_cpp(bundle)
    else:
        tokenizer, rt = hf_tiny[name], load_runtime(other_ggufs[name], n_ctx=64, n_threads=1)
    with rt as theirs:
        ours = HFVocab(tokenizer, theirs.n_vocab)
        assert ours.info == theirs.vocab
        assert ours.chat_template() == theirs.chat_template()
        for t in range(theirs.n_vocab):
            assert ours.token_text(t) == theirs.token_text(t), t
            assert ours.token_bytes(t) == theirs.token_bytes(t), t
        texts = corpus_texts()[:12] + ["<|im_start|>user\nhi<|im_end|>\n", "é 🤖 <|endoftext|>x 12345"]
        for text in texts:
            for add_special in (False, True):
                for parse_special in (False, True):
                    kw = dict(add_special=add_special, parse_special=parse_special)
                    assert ours.tokenize(text, **kw) == theirs.tokenize(text, **kw), (text, kw)


# --- the reference path: the Core ML runtime's calls, in torch -------------------------------------

def test_verify_call_equals_token_by_token(bundle, hf_tiny):
    ref = reference(bundle, hf_tiny)
    ids = prompt_ids(ref)
    draft = [50, 60, 70, 80]
    ref.decode(ids, 0)
    batched = ref.decode(draft, DRAFT_MAX + 1)
    assert ref.n_calls == {"prefill": 2, "decode": 0, "verify": 1}
    one = reference(bundle, hf_tiny)
    one.decode(ids, 0)
    single = np.concatenate([one.decode([t], 1) for t in draft])
    assert one.n_calls["decode"] == 4
    assert batched.dtype == np.float32 and batched.shape == (4, 400)
    assert np.abs(batched - single).max() <= 1e-4


def test_declared_capabilities_match_the_reference(bundle, hf_tiny):
    from edgespec.runtimes.base import GrammarVocabulary, Sizing
    from test_runtime_capabilities import declaration_mismatches

    ref = reference(bundle, hf_tiny)
    assert declaration_mismatches(ref) == [] and ref.capabilities == {GrammarVocabulary} and ref.sizing == Sizing()


def test_rollback_then_redecode_equals_fresh(bundle, hf_tiny):
    ref = reference(bundle, hf_tiny)
    ids = prompt_ids(ref)
    ref.decode(ids, 0)
    ref.decode([50, 60, 70, 80], 4)     # a verify; keep 50 and 60, reject the rest
    ref.truncate(len(ids) + 2)
    assert ref.n_past == len(ids) + 2 and ref.tokens.tolist() == ids + [50, 60]
    after = ref.decode([99, 98], 2)
    fresh = reference(bundle, hf_tiny)
    want = fresh.decode(ids + [50, 60, 99, 98], 2)  # one prefill-shaped pass over everything
    assert np.abs(after - want).max() <= 1e-4
    ref.truncate(0)                     # back to nothing, then the prompt again
    assert np.abs(ref.decode(ids, 1) - reference(bundle, hf_tiny).decode(ids, 1)).max() <= 1e-5


def test_chunked_prefill_equals_transformers(bundle, hf_tiny):
    from transformers import AutoModelForCausalLM

    ref = reference(bundle, hf_tiny)
    ids = prompt_ids(ref, 60)
    assert len(ids) == 60
    ours = np.concatenate([ref.decode(ids[:41], 41), ref.decode(ids[41:], 19)])  # 16+16+9, then 16+3
    assert ref.n_calls["prefill"] == 5
    model = AutoModelForCausalLM.from_pretrained(hf_tiny["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


def test_logits_rows_context_and_memory(bundle, hf_tiny):
    from edgespec.errors import ContextOverflowError, EdgespecError

    ref = reference(bundle, hf_tiny)
    ids = prompt_ids(ref, 20)
    assert ref.decode(ids[:10], 0).shape == (0, 400)
    last2 = ref.decode(ids[10:], 2)
    again = reference(bundle, hf_tiny).decode(ids, 20)
    assert np.abs(last2 - again[-2:]).max() <= 1e-5
    with pytest.raises(ValueError):
        ref.decode([], 0)
    with pytest.raises(EdgespecError, match="token id 400 is outside the vocabulary of 400"):
        ref.decode([5, 400], 1)
    ref.decode([1] * (MAX_CONTEXT - 20), 0)
    with pytest.raises(ContextOverflowError, match="context of 128 tokens is full") as e:
        ref.decode([1], 1)
    one_line(e)
    assert ref.n_past == MAX_CONTEXT  # a refused decode holds what it held
    report = ref.memory()
    assert report.kv_cache == 2 * 2 * MAX_CONTEXT * 16 * 2 * 2
    assert report.weights == ref.info.weight_bytes
    assert report.logits == 2 * 400 * 4 and report.other == {"call_logits": PREFILL_MAX * 400 * 2}
    assert reference(bundle, hf_tiny, n_ctx=64).n_ctx == 64
    with pytest.raises(EdgespecError, match="more than the 128 positions the Core ML package target.mlpackage holds"):
        reference(bundle, hf_tiny, n_ctx=256)


def test_reference_greedy_equals_llama_cpp(bundle, hf_tiny):
    """Same weights (f32 GGUF vs the fp32 torch decoder), llama.cpp as the judge of near-ties."""
    from edgespec.engine import Engine, GenerationConfig

    config = GenerationConfig(max_tokens=48, temperature=0, mode="ar")
    ref = reference(bundle, hf_tiny)
    ids = prompt_ids(ref)
    ours = Engine(ref).generate_tokens(ids, config).tokens
    with llama_cpp(bundle) as lc:
        assert np.abs(lc.decode(ids, len(ids)) - reference(bundle, hf_tiny).decode(ids, len(ids))).max() <= 1e-4
        lc.truncate(0)
        theirs = Engine(lc).generate_tokens(ids, config).tokens
        comparison = compare_greedy(lc, ids, theirs, ours)
    assert comparison.near_tie, comparison


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_speculation_through_the_engine_is_lossless_on_the_reference(bundle, hf_tiny, mode):
    from edgespec.engine import Engine, GenerationConfig

    target, draft = reference(bundle, hf_tiny), reference(bundle, hf_tiny, "draft")
    ids = prompt_ids(target)
    engine = Engine(target, draft)
    plain = engine.generate_tokens(ids, GenerationConfig(max_tokens=48, temperature=0, mode="ar")).tokens
    target.n_calls = dict.fromkeys(target.n_calls, 0)
    result = engine.generate_tokens(ids, GenerationConfig(max_tokens=48, temperature=0, mode=mode, draft_max=DRAFT_MAX))
    comparison = compare_greedy(target, ids, plain, result.tokens)
    assert comparison.near_tie, comparison
    assert result.stats.drafted > 0
    if mode == "draft":  # full drafts go to the verify function; the draft model steps with decode
        assert target.n_calls["verify"] > 0 and result.stats.accepted > 0
        assert draft.n_calls["decode"] > 0


# --- Core ML itself (macOS 15+) ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp16_package(hf_tiny, tmp_path_factory):
    """The target with fp16 weights: the same weights as the f32 GGUF up to fp16 rounding."""
    from edgespec.exporters.coreml_export import export_coreml

    return export_coreml(hf_tiny["llama"], tmp_path_factory.mktemp("fp16") / "target.mlpackage", quant="fp16",
                         max_context=MAX_CONTEXT, prefill_max=PREFILL_MAX, draft_max=DRAFT_MAX).path


@needs_coreml
def test_coreml_greedy_equals_llama_cpp(bundle, fp16_package):
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.coreml import CoreMLOptions, CoreMLRuntime

    config = GenerationConfig(max_tokens=48, temperature=0, mode="ar")
    with CoreMLRuntime(fp16_package, bundle / "tokenizer", CoreMLOptions(compute_units="cpu_only")) as rt:
        ids = prompt_ids(rt)
        ours = Engine(rt).generate_tokens(ids, config).tokens
        assert rt.n_calls["decode"] > 0
    with llama_cpp(bundle) as lc:
        theirs = Engine(lc).generate_tokens(ids, config).tokens
        comparison = compare_greedy(lc, ids, theirs, ours)
    assert comparison.near_tie, comparison


@needs_coreml
def test_coreml_calls_match_the_reference(bundle, hf_tiny, package):
    from edgespec.runtimes.coreml import CoreMLRuntime

    ref = reference(bundle, hf_tiny)
    with CoreMLRuntime(package, bundle / "tokenizer") as rt:
        ids = prompt_ids(rt, 40)
        got, want = [], []
        for r, out in ((rt, got), (ref, want)):  # prefill chunks, a verify, a rollback, single steps
            out.append(r.decode(ids[:37], 37))
            out.append(r.decode(ids[37:40] + [50], 4))
            r.truncate(39)
            out.append(r.decode([60], 1))
            out.append(r.decode([61, 62], 2))
        got, want = np.concatenate(got), np.concatenate(want)
        assert rt.n_calls == ref.n_calls
        assert (got.argmax(1) == want.argmax(1)).mean() >= 0.8
        assert np.abs(got - want).max() <= 0.5  # fp16 compute and int8 weights
        assert rt.memory().kv_cache == 2 * 2 * MAX_CONTEXT * 16 * 2 * 2


@needs_coreml
def test_coreml_rollback_equals_fresh(bundle, package):
    from edgespec.runtimes.coreml import CoreMLRuntime

    with CoreMLRuntime(package, bundle / "tokenizer") as rt:
        ids = prompt_ids(rt)
        rt.decode(ids, 0)
        rt.decode([50, 60, 70, 80], 4)
        rt.truncate(len(ids) + 1)
        after = rt.decode([99], 1)
        rt.truncate(0)
        fresh = rt.decode(ids + [50, 99], 1)
    assert np.abs(after - fresh).max() <= 0.05  # fp16 compute, different call shapes
    assert after.argmax() == fresh.argmax()


@needs_coreml
def test_under_a_budget_the_coreml_engine_is_guarded(bundle):
    """Core ML loads get the guard's ladder under --budget (no plan: the runtimes' own reports size it);
    under pressure the draft goes and generation goes on model-free."""
    from edgespec.cli import load_engine
    from edgespec.engine import GenerationConfig
    from edgespec.machine.guard import trim_heap
    from edgespec.machine.memory import current_rss

    engine = load_engine(str(bundle), None, "auto", ctx=MAX_CONTEXT, threads=1, gpu_layers=None, flash_attn=None,
                         cache_type_k="f16", cache_type_v="f16", verbose=False, budget=str(current_rss() * 4),
                         runtime="coreml")
    with engine:
        guard = engine.memory_guard
        assert {r.step for r in guard.releasers} == {"suffix_history", "draft_model"}
        trim_heap()
        guard.budget_bytes = int(current_rss() / 0.98)
        ids = prompt_ids(engine.target)
        assert len(engine.generate_tokens(ids, GenerationConfig(max_tokens=8, temperature=0, mode="auto")).tokens) == 8
        assert engine.draft_runtime is None and "draft_model" in [r["step"] for r in guard.released]


@needs_coreml
def test_coreml_draft_mode_is_lossless_through_the_engine(bundle):
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.loader import LoadOptions, load_pair

    target, draft = load_pair(bundle, options=LoadOptions(runtime="coreml"))
    assert draft is not None
    with Engine(target, draft) as engine:
        ids = prompt_ids(target)
        plain = engine.generate_tokens(ids, GenerationConfig(max_tokens=48, temperature=0, mode="ar")).tokens
        result = engine.generate_tokens(ids, GenerationConfig(max_tokens=48, temperature=0, mode="draft",
                                                               draft_max=DRAFT_MAX))
        comparison = compare_greedy(target, ids, plain, result.tokens)
        assert comparison.near_tie, comparison
        assert target.n_calls["verify"] > 0 and result.stats.drafted > 0
