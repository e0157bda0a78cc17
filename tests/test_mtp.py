"""The model's own MTP (NextN) head as a drafter (edgespec.drafters.mtp) on a tiny random GLM-4.5-MoE
made here (tests/mtp_models.py, converted by llama.cpp's own convert_hf_to_gguf.py).

Exactness as for every drafter: greedy through the engine's recorded checks with zero tolerance, and
the sampled joint of three tokens against the target's exact one (chi-square) with a negative control.
Random weights: the head's acceptance rate here says nothing about a real MTP model's.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.audit import Fresh, Recorder, check_decisions, check_rows
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import NextTokenHeads
from edgespec.runtimes.formats import gguf_nextn_layers
from edgespec.runtimes.llamacpp import LlamaCppMtpRuntime, LlamaCppOptions, LlamaCppRuntime

PROMPTS = [[5, 17, 33, 40, 12, 9, 17, 33], [100, 101, 102, 103], [7, 8, 9, 7, 8, 9, 7]]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from mtp_models import write_mtp_gguf

    return write_mtp_gguf(tmp_path_factory.mktemp("mtp"))


def mtp_runtime(path, **options):
    return LlamaCppMtpRuntime(path, LlamaCppOptions(**{"n_ctx": 256, "n_threads": 1, "n_batch": 64, **options}))


def test_the_converted_model_has_a_head_and_the_runtime_declares_it(mtp_model):
    assert gguf_nextn_layers(mtp_model) == 1
    with mtp_runtime(mtp_model) as rt:
        assert rt.n_next_token_heads == 1
        assert NextTokenHeads in rt.capabilities
        rt.decode(PROMPTS[0], 1)
        rows = rt.hidden_rows(-1, len(PROMPTS[0]))
        assert not rows[0].any() and all(rows[1:].any(axis=1))  # position -1 reads zeros


def test_a_model_without_nextn_layers_is_refused(tiny_pair):
    assert gguf_nextn_layers(tiny_pair["target"]) == 0
    with pytest.raises(EdgespecError, match="no MTP"):
        mtp_runtime(tiny_pair["target"])


def test_the_head_drafts_from_the_targets_rows(mtp_model):
    """Drafting twice from the same context gives the same chain (the head's KV is rolled back to the
    committed text after each draft), and a chunked catch-up equals a one-batch one."""
    from edgespec.drafters.mtp import MtpDrafter
    from edgespec.sampling import Sampler, SamplingParams

    context = np.asarray(PROMPTS[0] * 3, dtype=np.int32)
    chains = []
    for n_batch in (64, 8):
        with mtp_runtime(mtp_model, n_batch=n_batch) as rt:
            rt.decode(context[:-1], 0)
            drafter = MtpDrafter(rt)
            sampler = Sampler(SamplingParams(temperature=0.0), seed=0)
            first = drafter.propose(context, 4, sampler).tokens.tolist()
            assert drafter.head.tokens.tolist() == context.tolist()
            assert drafter.propose(context, 4, sampler).tokens.tolist() == first
            chains.append(first)
    assert chains[0] == chains[1] and len(chains[0]) == 4


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.95,
                                                                       repeat_penalty=1.1)], ids=["greedy", "chain"])
def test_every_emitted_token_is_the_rules_on_its_recorded_rows(mtp_model, sampling):
    fresh_rt = LlamaCppRuntime(mtp_model, LlamaCppOptions(n_ctx=256, n_threads=1))
    with Engine(mtp_runtime(mtp_model)) as engine:
        assert "mtp" in engine.drafters
        engine.recorder = Recorder()
        drafted = 0
        for seed, prompt in enumerate(PROMPTS):
            engine.recorder.passes.clear()
            result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=24, mode="mtp", draft_max=3,
                                                                     seed=seed, **sampling))
            passes = list(engine.recorder.passes)
            assert check_decisions(passes, prompt, result.tokens) == result.stats.rounds
            check_rows(passes, Fresh(fresh_rt))
            drafted += result.stats.drafted
            if not sampling["temperature"]:
                plain = engine.generate_tokens(prompt, GenerationConfig(max_tokens=24, mode="ar", **sampling))
                assert result.tokens == plain.tokens
    fresh_rt.close()
    assert drafted > 0


@pytest.mark.slow
def test_sampling_through_the_head_keeps_the_targets_distribution(mtp_model):
    """Chi-square of the first three sampled tokens (top-k 4) against the exact joint; the same test
    must reject a verifier that accepts every draft (the negative control)."""
    from test_lossless_sampling import ALPHA, SAMPLING, accept_every_draft, chi_square_pvalue, exact_joint

    prompt = PROMPTS[0]
    plain = LlamaCppRuntime(mtp_model, LlamaCppOptions(n_ctx=256, n_threads=1))
    joint = exact_joint(plain, prompt)
    plain.close()
    with Engine(mtp_runtime(mtp_model)) as engine:
        for verifier, exact in ((None, True), (accept_every_draft, False)):
            samples, drafted = [], 0
            for seed in range(2000):
                result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=3, mode="mtp", draft_max=2,
                                                                         seed=seed, **SAMPLING), verifier=verifier)
                samples.append(tuple(result.tokens))
                drafted += result.stats.drafted
            p = chi_square_pvalue(samples, joint)
            print(f"\nmtp, verifier {getattr(verifier, '__name__', 'exact')}: chi-square p = {p:.3g}, {drafted} drafted")
            assert drafted > 0
            assert (p > ALPHA) == exact


def test_auto_weighs_the_head_by_its_measured_step(mtp_model):
    """The profile times one MTP head step; auto prices the mtp drafter by it (not the draft model's
    step) and stays exact."""
    from edgespec.machine.profile import measure_profile
    from edgespec.policy import AdaptivePolicy

    with Engine(mtp_runtime(mtp_model)) as engine:
        profile = measure_profile(engine.target, budget_s=0.5)
        assert profile.mtp_s and profile.mtp_s > 0 and profile.draft_s is None
        engine._profile = profile
        policy = AdaptivePolicy(profile, *engine.drafters.values(), k_max=3)
        cheap = np.asarray(policy.model_speeds("mtp", 3))
        profile.mtp_s *= 100
        assert (np.asarray(policy.model_speeds("mtp", 3))[1:] < cheap[1:]).all()
        profile.mtp_s /= 100
        engine.recorder = Recorder()
        result = engine.generate_tokens(PROMPTS[0], GenerationConfig(max_tokens=16, mode="auto", temperature=0.0))
        assert check_decisions(list(engine.recorder.passes), PROMPTS[0], result.tokens) == result.stats.rounds


def test_mode_mtp_on_a_model_without_nextn_layers_is_one_line_exit_2(tiny_pair):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "hi", "--mode", "mtp",
                           "--target", str(tiny_pair["target"]), "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no MTP (NextN) layers" in done.stderr


def test_the_header_scan_reads_no_head_from_what_is_not_a_gguf(tmp_path, mtp_model):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    (tmp_path / "cut.gguf").write_bytes(mtp_model.read_bytes()[:200])
    assert gguf_nextn_layers(tmp_path / "x.gguf") == 0 and gguf_nextn_layers(tmp_path / "cut.gguf") == 0
    assert gguf_nextn_layers(tmp_path / "missing.gguf") == 0
    with mtp_runtime(mtp_model) as rt:
        assert rt.memory().other["mtp_hidden_rows"] == rt.n_ctx * rt.n_embd * 4
