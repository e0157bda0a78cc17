"""The MLX runtime (runtimes/mlx.py) on MLX's CPU backend: exactness through the engine, rollback,
parity with llama.cpp on the same f32 weights, and its errors.

The tiny Hugging Face checkpoints (tests/hf_models.py) load into mlx-lm in float32. Exactness is
judged against what MLX itself does: each test that needs a tolerance measures the spread between
a batched and a one-token-at-a-time evaluation of the same tokens on the same runtime, and allows
exactly that (on this CPU it is 0.0, so greedy speculation must reproduce plain decoding token
for token). Against llama.cpp the project's rule for two different kernels holds (tests/lossless.py:
identical, or a first divergence at a near-tie).

Metal is not tested here: it needs a Mac (docs/apple.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import platform

import numpy as np
import pytest

# MLX ships wheels for Linux and Apple Silicon only; where it installs, the mlx extra is required
# (scripts/install.sh --test installs it), so a missing install fails here rather than skipping.
if sys.platform == "darwin" and platform.machine() != "arm64":
    pytest.skip("MLX has no build for Intel Macs", allow_module_level=True)
import mlx_lm  # noqa: E402,F401

from conftest import load_runtime  # noqa: E402
from edgespec.engine import Engine, GenerationConfig  # noqa: E402
from edgespec.errors import ContextOverflowError, EdgespecError  # noqa: E402
from lossless import NEAR_TIE_GAP, compare_greedy  # noqa: E402
from test_onnx_runtime import corpus_ids, prompts  # noqa: E402

FAMILIES = ("llama", "qwen2")
MAX_TOKENS = 40


def mlx_runtime(path, **options):
    from edgespec.runtimes.mlx import MlxOptions, MlxRuntime

    return MlxRuntime(path, MlxOptions(**{"n_ctx": 512, **options}))


def batch_spread(rt, ids) -> float:
    """Largest logit difference between one batched pass over `ids` and feeding them one at a time."""
    rt.truncate(0)
    batched = rt.decode(ids, len(ids))
    rt.truncate(0)
    single = np.stack([rt.decode([t], 1)[0] for t in ids])
    rt.truncate(0)
    return float(np.abs(batched - single).max())


@pytest.fixture(scope="module")
def spread(hf_tiny) -> dict[str, float]:
    """The measured batched-vs-single spread of each tiny model on this machine."""
    out = {}
    for name in (*FAMILIES, "llama_draft"):
        with mlx_runtime(hf_tiny[name]) as rt:
            out[name] = batch_spread(rt, corpus_ids(hf_tiny[name], 64))
    print(f"\nMLX batched vs one-token logits, largest difference: {out}")
    return out


# --- the KV sequence -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_truncate_then_decode_equals_fresh_evaluation(hf_tiny, spread, name):
    ids = corpus_ids(hf_tiny[name], 120)
    rng = np.random.default_rng(0)
    worst = 0.0
    with mlx_runtime(hf_tiny[name], n_batch=16) as rt, mlx_runtime(hf_tiny[name]) as fresh:
        rt.decode(ids[:60], 0)
        for _ in range(12):  # grow and roll back at random, as speculation does
            keep = int(rng.integers(0, rt.n_past + 1))
            rt.truncate(keep)
            assert rt.n_past == keep and rt.tokens.tolist() == ids[:keep]
            grow = int(rng.integers(1, 30))
            got = rt.decode(ids[keep:keep + grow], min(grow, 3))
            fresh.truncate(0)
            want = fresh.decode(ids[:keep + grow], min(grow, 3))
            worst = max(worst, float(np.abs(got - want).max()))
        with pytest.raises(ValueError):
            rt.truncate(rt.n_past + 1)
    print(f"\n{name}: rollback vs fresh {worst}, batched vs single {spread[name]}")
    assert worst <= spread[name]


def test_logits_rows_are_the_tail_of_all_rows_and_long_inputs_are_split(hf_tiny):
    ids = corpus_ids(hf_tiny["llama"], 150)
    with mlx_runtime(hf_tiny["llama"], n_batch=256) as one:
        full = one.decode(ids, len(ids))
    with mlx_runtime(hf_tiny["llama"], n_batch=64) as rt:
        for k in (0, 1, 5, 64, 100, 150):
            rt.truncate(0)
            rows = rt.decode(ids, k)
            assert rows.shape == (k, rt.vocab.n_vocab) and rows.dtype == np.float32
            assert np.array_equal(rows, full[len(ids) - k:])
        assert rt.n_decode_calls == 6 * 3  # 150 tokens in passes of 64, 64 and 22


def test_decoding_past_the_context_is_refused(hf_tiny):
    with mlx_runtime(hf_tiny["llama"], n_ctx=32) as rt:
        rt.decode(list(range(5, 35)), 0)
        with pytest.raises(ContextOverflowError, match=r"^the context of 32 tokens is full \(30 held, 3 more asked\)"):
            rt.decode([5, 6, 7], 1)
        assert rt.n_past == 30
        rt.decode([5, 6], 1)


def test_saved_state_restores_the_same_logits(hf_tiny):
    ids = corpus_ids(hf_tiny["llama"], 40)
    with mlx_runtime(hf_tiny["llama"]) as a, mlx_runtime(hf_tiny["llama"]) as b:
        a.decode(ids[:39], 0)
        blob = a.save_state()
        b.load_state(blob, a.tokens.tolist())
        assert b.tokens.tolist() == ids[:39]
        assert np.array_equal(a.decode(ids[39:], 1), b.decode(ids[39:], 1))
        assert a.compatibility_key() == b.compatibility_key()
        with pytest.raises(EdgespecError, match="does not fit this model"):
            b.load_state(blob, ids[:20])  # a different token count
        with pytest.raises(EdgespecError, match="does not fit this model"):
            b.load_state(b"not a cache", ids[:39])
    with mlx_runtime(hf_tiny["qwen2"]) as other:
        assert other.compatibility_key() != a.compatibility_key()


def test_declared_capabilities_and_sizing(hf_tiny):
    from edgespec.runtimes.base import GrammarVocabulary, ModelIdentity, Runtime, SavedState, Sizing
    from test_runtime_capabilities import declaration_mismatches

    with mlx_runtime(hf_tiny["llama"], n_batch=16) as rt:
        assert isinstance(rt, Runtime)
        assert declaration_mismatches(rt) == [] and rt.capabilities == {ModelIdentity, SavedState, GrammarVocabulary}
        assert rt.sizing == Sizing(n_batch=16)
        key = rt.compatibility_key()
        assert key["runtime"].startswith("mlx ") and " mlx-lm " in key["runtime"] and key["kv_dtype"] == "float32"


def test_memory_report(hf_tiny):
    with mlx_runtime(hf_tiny["llama"]) as rt:
        weights = sum(f.stat().st_size for f in hf_tiny["llama"].glob("*.safetensors"))
        rt.decode(corpus_ids(hf_tiny["llama"], 20), 4)
        mem = rt.memory()
        assert 0.9 * weights <= mem.weights <= weights  # the file's bytes less its header
        # 2 layers x (k, v) x 2 KV heads x 256 positions (one step) x head_dim 16 x 4 bytes
        assert mem.kv_cache == 2 * 2 * 2 * 256 * 16 * 4
        assert mem.logits == 4 * rt.vocab.n_vocab * 4


def test_several_sequences_share_the_weights_and_each_equals_a_runtime_alone(hf_tiny):
    """`MlxMultiSeqRuntime` (serve --parallel's slots): interleaved passes and rollbacks of three
    sequences give, with zero tolerance, the rows a one-sequence runtime gives the same tokens; the
    pool is shared; a failed batch rolls every sequence back; the weights are held once."""
    from edgespec.runtimes.base import SeveralSequences
    from edgespec.runtimes.mlx import MlxMultiSeqRuntime, MlxOptions
    from test_runtime_capabilities import declaration_mismatches

    texts = [corpus_ids(hf_tiny["llama"], 120)[i::3] for i in range(3)]  # three different token streams
    with MlxMultiSeqRuntime(hf_tiny["llama"], MlxOptions(n_ctx=64), n_seq=3) as multi, \
            mlx_runtime(hf_tiny["llama"], n_ctx=64) as alone:
        assert declaration_mismatches(multi) == [] and SeveralSequences in multi.capabilities
        first = multi.decode_batch([(0, texts[0][:12], 2), (2, texts[2][:9], 9)])
        multi.seq_truncate(0, 7)  # a rejected draft
        later = multi.decode_batch([(0, texts[0][7:14], 7), (1, texts[1][:5], 1), (2, texts[2][9:12], 3)])
        for seq, held, rows in zip(range(3), (texts[0][:14], texts[1][:5], texts[2][:12]), later):
            assert multi.seq_tokens(seq).tolist() == held
            alone.truncate(0)
            assert np.array_equal(alone.decode(held, len(rows)), rows), f"sequence {seq}"
        alone.truncate(0)
        assert np.array_equal(alone.decode(texts[2][:9], 9), first[1])
        assert multi.cells_used == 14 + 5 + 12
        with pytest.raises(ContextOverflowError, match="pool of 64 positions is full"):
            multi.decode_batch([(1, texts[1][5:25], 1), (2, texts[2][12:32], 1)])
        with pytest.raises(ValueError, match="holds 12 positions"):
            multi.sequence(2, 8)
        view = multi.sequence(1, 20)  # its share: sequence 1 may hold 20
        with pytest.raises(ContextOverflowError):  # sequence 0's pass goes in, sequence 1's does not fit
            multi.decode_batch([(0, texts[0][14:16], 1), (1, texts[1][5:25], 1)])
        assert [multi.seq_n_past(s) for s in range(3)] == [14, 5, 12]  # both rolled back, sequence 0 included
        assert view.tokens.tolist() == texts[1][:5]
        mem = multi.memory()
        assert mem.weights == alone.memory().weights and view.memory().weights == 0  # the weights once
        assert mem.kv_cache == 3 * alone.memory().kv_cache  # each sequence's caches: one step of 256 positions


def test_vocabulary_and_tokenizer_match_the_onnx_runtime_reading(hf_tiny):
    """The same HFVocab reading as the ONNX runtime (checked there against llama.cpp for every id)."""
    from edgespec.runtimes.hf_vocab import HFVocab

    with mlx_runtime(hf_tiny["qwen2"]) as rt:
        ref = HFVocab(hf_tiny["qwen2"], rt.vocab.n_vocab)
        assert rt.vocab == ref.info and rt.vocab.n_vocab == 400 + 13  # padded rows past the tokenizer
        assert rt.chat_template() == ref.chat_template()
        text = "Hello <|im_end|> world"
        assert rt.tokenize(text, add_special=True, parse_special=True) == ref.tokenize(text)
        assert all(rt.token_bytes(t) == ref.token_bytes(t) for t in range(rt.vocab.n_vocab))


# --- through the engine: greedy exactness --------------------------------------------------------

@pytest.fixture(scope="module")
def mlx_engine(hf_tiny):
    engine = Engine(mlx_runtime(hf_tiny["llama"]), mlx_runtime(hf_tiny["llama_draft"]))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def mlx_plain(hf_tiny, mlx_engine):
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    return [(ids, mlx_engine.generate_tokens(ids, cfg).tokens) for ids in prompts(hf_tiny["llama"], 12)]


@pytest.mark.parametrize("mode,k", [("draft", 1), ("draft", 4), ("lookup", 2), ("lookup", 5), ("auto", None)])
def test_greedy_speculation_on_mlx_equals_plain_decoding(hf_tiny, spread, mlx_engine, mlx_plain, mode, k):
    """Zero tolerance where MLX's numerics allow it: with no batched-vs-single spread every output
    is identical; otherwise a divergence must sit at a tie no wider than twice the spread."""
    from edgespec.machine.profile import CostProfile

    if mode == "auto":  # a GPU-like profile (flat verify cost), so auto really drafts
        mlx_engine._profile = CostProfile({n: 0.01 for n in (1, 2, 3, 4, 6, 8)}, 0.001, 0.0012, 0.00005)
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode=mode, draft_max=k)
    drafted = accepted = 0
    with mlx_runtime(hf_tiny["llama"]) as reference:
        for ids, plain in mlx_plain:
            result = mlx_engine.generate_tokens(ids, cfg)
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
            if spread["llama"] == 0.0:
                assert result.tokens == plain, f"{mode} k={k}: speculative output differs from plain decoding"
            else:
                cmp = compare_greedy(reference, ids, plain, result.tokens)
                assert cmp.identical or abs(cmp.gap) <= 2 * spread["llama"], cmp
    print(f"\n{mode} k={k}: accepted {accepted}/{drafted}")
    assert drafted > 0 and (mode == "lookup" or 0 < accepted < drafted)


# --- parity with llama.cpp on the same f32 weights -----------------------------------------------

def exact_llama(path, n_ctx=512):
    # f16 KV and CPU flash attention round activations to f16; parity needs neither.
    return load_runtime(path, n_ctx=n_ctx, type_k="f32", type_v="f32", flash_attn=False, n_threads=1)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_agree_with_llama_cpp_on_f32_weights(hf_tiny, tmp_path_factory, name):
    from edgespec.exporters.gguf_export import export_gguf

    gguf = export_gguf(hf_tiny[name], tmp_path_factory.mktemp("mlx-gguf"), ["f32"], stem=name).files["f32"]
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    ids0 = prompts(hf_tiny[name], 1)[0]
    with mlx_runtime(hf_tiny[name]) as m, exact_llama(gguf) as ll:
        diff = float(np.abs(m.decode(ids0, len(ids0)) - ll.decode(ids0, len(ids0))).max())
    identical, diverged = 0, []
    with Engine(mlx_runtime(hf_tiny[name])) as ours, Engine(exact_llama(gguf)) as theirs, \
            exact_llama(gguf) as reference:
        for ids in prompts(hf_tiny[name], 12):
            a, b = theirs.generate_tokens(ids, cfg).tokens, ours.generate_tokens(ids, cfg).tokens
            cmp = compare_greedy(reference, ids, a, b)
            identical += cmp.identical
            if not cmp.identical:
                diverged.append((cmp.first_divergence, cmp.gap))
            assert cmp.near_tie, f"diverges at token {cmp.first_divergence}, logit gap {cmp.gap:.3f} > {NEAR_TIE_GAP}"
    print(f"\n{name}: MLX f32 vs llama.cpp f32 logits differ by at most {diff:.2e}; plain greedy identical "
          f"{identical}/12, divergences {diverged}")
    assert identical >= 0.9 * 12


# --- sampling: the target's distribution, and a check that can fail -------------------------------

def test_sampling_on_mlx_follows_the_target_distribution(hf_tiny):
    """Speculative sampling with the tiny draft: the joint distribution of two tokens (top-k 4, 16
    outcomes) against the exact one, by chi-square; the same check must reject a verifier that
    trusts the draft blindly."""
    from test_lossless_sampling import accept_every_draft, chi_square_pvalue, exact_joint

    from edgespec.sampling import SamplingParams  # noqa: F401  (exact_joint's processing)

    sampling = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    prompt = prompts(hf_tiny["llama"], 1)[0]
    target = mlx_runtime(hf_tiny["llama"])
    joint = exact_joint(target, prompt, 2)
    assert len(joint) == 16 and abs(sum(joint.values()) - 1) < 1e-9

    def samples(engine, n, verifier=None):
        out = []
        for seed in range(n):
            cfg = GenerationConfig(seed=seed, max_tokens=2, mode="draft", draft_max=2, **sampling)
            out.append(tuple(engine.generate_tokens(prompt, cfg, verifier=verifier).tokens))
        return out

    with Engine(target, mlx_runtime(hf_tiny["llama_draft"])) as engine:
        p = chi_square_pvalue(samples(engine, 1500), joint)
        wrong = chi_square_pvalue(samples(engine, 1500, accept_every_draft), joint)
    print(f"\nMLX speculative sampling: chi-square p = {p:.4f}; a blindly trusting verifier: p = {wrong:.1e}")
    assert p > 0.001
    assert wrong < 0.001


# --- loading and bad input -----------------------------------------------------------------------

def test_engine_load_runs_a_checkpoint_on_mlx(hf_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    ids = prompts(hf_tiny["llama"], 1)[0]
    cfg = GenerationConfig(max_tokens=12, temperature=0, mode="draft", draft_max=3)
    with Engine.load(hf_tiny["llama"], hf_tiny["llama_draft"], runtime="mlx", n_ctx=256) as engine:
        assert engine.target.name == "mlx" and engine.target.n_ctx == 256
        out = engine.generate_tokens(ids, cfg)
        assert len(out.tokens) == 12 and out.stats.drafted > 0
    with pytest.raises(EdgespecError, match="runtime mlx needs a target"):
        Engine.load(None, runtime="mlx")
    with pytest.raises(EdgespecError, match="MLX model not found"):
        Engine.load(tmp_path / "nothing", runtime="mlx")
    with pytest.raises(EdgespecError, match="no tokenizer.json"):
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "config.json").write_text("{}")
        (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
        Engine.load(tmp_path / "bad", runtime="mlx")


@pytest.fixture(scope="module")
def mlx_4bit(hf_tiny, tmp_path_factory):
    """The tiny Llama quantized to 4 bits by mlx-lm's own converter: an MLX repo as mlx-community ships them."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("mlx-q4") / "llama-4bit"
    convert(str(hf_tiny["llama"]), str(out), quantize=True, q_bits=4, q_group_size=32)
    return out


def test_a_4bit_mlx_repo_loads_and_runs(mlx_4bit, hf_tiny):
    import json

    assert json.loads((mlx_4bit / "config.json").read_text())["quantization"]["bits"] == 4
    ids = prompts(hf_tiny["llama"], 1)[0]
    with mlx_runtime(mlx_4bit) as q4, mlx_runtime(hf_tiny["llama"]) as f32:
        assert q4.vocab == f32.vocab
        assert q4.memory().weights < f32.memory().weights / 3
        rows = q4.decode(ids, 2)
        assert rows.shape == (2, 400) and np.isfinite(rows).all()
        q4.truncate(len(ids) - 1)
        assert np.array_equal(q4.decode(ids[-1:], 1), rows[-1:])  # rollback on the quantized model too


def test_an_mlx_repo_whose_quantization_mlx_cannot_load_is_refused(mlx_4bit, tmp_path):
    import json
    import shutil

    bad = shutil.copytree(mlx_4bit, tmp_path / "q7")
    config = json.loads((bad / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in config:
            config[key]["bits"] = 7  # MLX quantizes to 1-6 or 8 bits
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgespecError, match=r"^MLX cannot load .*q7 \(.*bits 7 is not supported"):
        mlx_runtime(bad)


@pytest.mark.parametrize("parallel", [1, 2])
def test_under_a_budget_mlx_is_guarded_and_unloading_the_draft_gives_its_memory_back(hf_tiny, tmp_path, parallel):
    """MLX loads (one engine, and serve --parallel's slots) get the guard's ladder under --budget, sized by
    the runtimes' own reports; under pressure the draft goes, resident memory falls by what the guard
    estimated, and generation goes on model-free."""
    from edgespec.cli import _load_parallel, load_engine
    from edgespec.machine.guard import trim_heap
    from edgespec.machine.memory import current_rss
    from hf_models import write_tiny_checkpoint

    # a draft big enough that its memory shows in the resident set (about 100 MB of float32), same tokenizer
    big = write_tiny_checkpoint(tmp_path / "big-draft", family="llama", tokenizer="gpt2", seed=5, n_layer=8,
                                hidden=512, n_head=8, n_head_kv=4, ff=1536)
    budget = str(current_rss() * 4)
    flags = dict(ctx=512, threads=1, gpu_layers=None, flash_attn=None, cache_type_k="f16", cache_type_v="f16",
                 verbose=False, budget=budget, runtime="mlx")
    engine = (load_engine(str(hf_tiny["llama"]), str(big), "auto", **flags) if parallel == 1 else
              _load_parallel(str(hf_tiny["llama"]), str(big), parallel, gpu_budget=None, **flags))
    with engine:
        guard = engine.memory_guard
        assert {r.step for r in guard.releasers} == {"suffix_history", "draft_model"}
        estimate = guard.estimates()["draft_model"]
        assert estimate > 80 * 2**20
        trim_heap()
        guard.budget_bytes = int(current_rss() / 0.98)  # pressure: the draft is what there is to give up
        guard.check()
        assert engine.draft_runtime is None
        step = next(r for r in guard.released if r["step"] == "draft_model")
        assert step["rss_before"] - step["rss_after"] >= 0.6 * estimate, (step, estimate)
        front = engine.engines[0] if parallel > 1 else engine
        ids = front.prompt_tokens("Hello there", raw=True)
        assert len(front.generate_tokens(ids, GenerationConfig(max_tokens=6, temperature=0, mode="auto")).tokens) == 6


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "EDGESPEC_DEBUG": "", **(env or {})}, timeout=300)


def test_cli_runs_mlx_and_refuses_bad_input_in_one_line(hf_tiny, tmp_path):
    home = {"EDGESPEC_HOME": str(tmp_path)}
    base = ("generate", "Hello", "--target", hf_tiny["llama"], "--runtime", "mlx", "-n", "6", "--temperature", "0",
            "--ctx", "256")
    proc = cli(*base, "--draft", hf_tiny["llama_draft"], "--mode", "draft", "--json", env=home)
    assert proc.returncode == 0, proc.stderr
    assert '"mode": "draft"' in proc.stdout

    proc = cli(*base, "--draft", hf_tiny["qwen2"], "--mode", "draft", env=home)  # another tokenizer
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: the draft's vocabulary does not match the target's")

    proc = cli(*base, "--budget", "8G", "--json", env=home)  # no plan for MLX: the guard holds it
    assert proc.returncode == 0 and '"tokens"' in proc.stdout, proc.stderr
    proc = cli(*base, "--budget", "1M", env=home)
    assert proc.returncode == 2 and "over the --budget of 1.0 MiB" in proc.stderr, proc.stderr
    proc = cli(*base, "--budget", "8G", "--gpu-budget", "1G", env=home)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--gpu-budget plans llama.cpp's GPU offload; drop it or --runtime mlx" in proc.stderr

    shadow = tmp_path / "no-mlx"  # an `mlx` package that cannot be imported: as if MLX were not installed
    (shadow / "mlx").mkdir(parents=True)
    (shadow / "mlx" / "__init__.py").write_text("raise ImportError('no MLX here', name='mlx')\n")
    proc = cli(*base, env={**home, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == ("error: the MLX runtime needs mlx and mlx-lm (mlx is not installed): "
                                   "pip install 'edgespec[mlx]'")


def test_an_mlx_repo_loads_by_its_hub_name(mlx_4bit, tmp_path, monkeypatch):
    """`--runtime mlx --target hf:OWNER/REPO`: the repo is fetched whole (sha256-checked) through the
    project's hub source, as for `edgespec export`, and runs."""
    from hub_server import HubServer

    files = {p.relative_to(mlx_4bit).as_posix(): p.read_bytes() for p in mlx_4bit.rglob("*") if p.is_file()}
    with HubServer() as server:
        server.add("mlx-community/Tiny-4bit", files)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "edgespec"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with Engine.load("hf:mlx-community/Tiny-4bit", runtime="mlx", n_ctx=128) as engine:
            assert engine.target.directory.parent.name == "snapshots"
            out = engine.generate_tokens([5, 6, 7, 8], GenerationConfig(max_tokens=5, temperature=0, mode="ar"))
            assert len(out.tokens) == 5
    with pytest.raises(EdgespecError, match="--draft auto picks among installed GGUF models"):
        Engine.load(mlx_4bit, "auto", runtime="mlx")
