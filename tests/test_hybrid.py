"""Hybrid recurrent models (LFM2, Qwen3-Next, Granite 4 / Mamba-2) speculate exactly.

The models are tiny random-weight ones of the real architectures (bench/hybrid_models.py), converted
by llama.cpp's own converter. A rejected draft must leave no trace in the recurrent state: the
runtime restores a checkpoint and replays the accepted tokens (runtimes/llamacpp.py,
RecurrentCheckpoints). Checked with the engine's exactness checks (edgespec.audit): every decision
re-run with zero tolerance, every row against a fresh evaluation of its committed prefix; and a
negative control (a rejected token left in the recurrent state) that the row check must catch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("transformers")

import llama_cpp as ll

from conftest import load_runtime
from edgespec.audit import ExactnessError, Fresh, Recorder, check_decisions, check_rows
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.machine.profile import CostProfile
from edgespec.runtimes.base import TreeDecoding
from edgespec.runtimes.llamacpp import LlamaCppMultiSeqRuntime, LlamaCppOptions, LlamaCppRuntime, quantize

ARCHS = ("lfm2", "qwen3next", "granitehybrid")
K = 4
FLAT_VERIFY = CostProfile({n: 0.01 for n in (1, 2, 3, 4, 6, 8)}, 0.001, 0.0012, 0.00005)  # auto drafts


def rt(path, **options):
    return load_runtime(path, **{"n_ctx": 512, "n_threads": 1, **options})


@pytest.fixture(scope="module")
def models(hybrid_ggufs, tmp_path_factory):
    """Each architecture with a q8_0 copy of itself as its draft: mostly accepted, sometimes rejected,
    and a recurrent draft model that rolls back too."""
    root = tmp_path_factory.mktemp("hybrid-drafts")
    return {a: (p, quantize(p, root / f"{a}-q8_0.gguf", "q8_0")) for a, p in hybrid_ggufs.items()}


def fresh_for(path):
    return Fresh(rt(path), chunks=(1, 3, K + 1))  # the pass sizes generations use: plain steps, k + 1


def prompt_of(runtime):
    return runtime.tokenize("The cat sat on the mat. The cat sat on the mat. The dog", add_special=True,
                            parse_special=True)


def test_hybrids_are_detected_and_offer_no_trees(models):
    for arch, (path, _) in models.items():
        with rt(path, n_seq_max=4) as runtime:
            assert runtime.recurrent, arch
            assert TreeDecoding not in runtime.capabilities


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_is_exact_on_every_drafter(models, arch, smollm2_path):
    """Every drafter, with two draft models: the q8_0 copy (mostly accepted; a recurrent draft model
    rolling back too) and SmolLM2 (same vocabulary, other weights: nearly every draft rejected)."""
    path, draft = models[arch]
    fresh = fresh_for(path)
    rejected = 0
    for draft_model, modes in ((draft, ("draft", "lookup", "suffix", "auto")), (smollm2_path, ("draft",))):
        with Engine(rt(path), rt(draft_model)) as engine:
            prompt = prompt_of(engine.target)
            plain = engine.generate_tokens(prompt, GenerationConfig(max_tokens=24, mode="ar", temperature=0)).tokens
            for mode in modes:
                engine._profile = FLAT_VERIFY
                engine.recorder = Recorder()
                result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=24, mode=mode, draft_max=K,
                                                                         temperature=0))
                assert result.tokens == plain, mode
                passes = list(engine.recorder.passes)
                assert check_decisions(passes, prompt, result.tokens) == result.stats.rounds
                report = check_rows(passes, fresh)
                rejected += result.stats.drafted - result.stats.accepted
                print(f"\n{arch} {mode} ({draft_model.name}): drafted {result.stats.drafted}, accepted "
                      f"{result.stats.accepted}; {report}")
    assert rejected > 0  # rejected drafts were rolled back
    fresh.runtime.close()


class LeavesRejectedInRecurrentState(LlamaCppRuntime):
    """At its first rollback, cuts the KV back but leaves the recurrent state as the rejected pass
    left it (the next pass reads rows from it). Later rollbacks replay from the start: the
    checkpoints taken since then carry the dirty state's position, which llama.cpp cannot cut."""

    dirtied = False

    def _rollback_recurrent(self, n):
        if self.dirtied:
            self._checkpoints.forget(0)
            return super()._rollback_recurrent(n)
        self.dirtied = True
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = ll.llama_state_seq_get_size_ext(self._ctx, 0, flags)
        dirty = (ctypes.c_uint8 * size)()
        used = ll.llama_state_seq_get_data_ext(self._ctx, dirty, size, 0, flags)
        super()._rollback_recurrent(n)
        ll.llama_state_seq_set_data_ext(self._ctx, dirty, used, 0, flags)


@pytest.mark.parametrize("arch", ARCHS)
def test_negative_control_a_rejected_token_left_in_the_recurrent_state_fails_the_row_check(models, arch,
                                                                                          smollm2_path):
    path, _ = models[arch]
    target = LeavesRejectedInRecurrentState(path, LlamaCppOptions(n_ctx=512, n_threads=1))
    with Engine(target, rt(smollm2_path)) as engine:  # another model with the same vocabulary: drafts rejected
        engine.recorder = Recorder()
        prompt = prompt_of(target)
        result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=16, mode="draft", draft_max=K,
                                                                 temperature=0))
        assert result.stats.drafted > result.stats.accepted
        check_decisions(engine.recorder.passes, prompt, result.tokens)
        fresh = fresh_for(path)
        with pytest.raises(ExactnessError, match="beyond the measured batch-shape spread") as caught:
            check_rows(engine.recorder.passes, fresh)
        fresh.runtime.close()
    print(f"\n{arch}: {caught.value}")


@pytest.mark.parametrize("arch", ARCHS)
def test_several_sequences_roll_back_each_its_own_state(models, arch):
    """--parallel and the cloud verifier: sequences in one pass, each rolled back on its own."""
    path, _ = models[arch]
    rng = np.random.default_rng(1)
    a, b = (rng.integers(100, 40000, 12).tolist() for _ in range(2))
    with LlamaCppMultiSeqRuntime(path, LlamaCppOptions(n_ctx=512, n_threads=1), n_seq=2) as pool, \
            rt(path, flash_attn=False) as alone:  # the pool computes attention without flash attention
        pool.decode_batch([(0, a[:8], 0), (1, b[:6], 0)])
        pool.decode_batch([(0, a[8:], 4), (1, b[6:], 6)])
        pool.seq_truncate(0, 9)
        pool.seq_truncate(1, 7)
        got = pool.decode_batch([(0, [a[9]], 1), (1, [b[7]], 1)])
        for row, prefix in zip(got, (a[:10], b[:8])):
            alone.truncate(0)
            want = alone.decode(prefix, 1)
            assert np.abs(row - want).max() < 1e-3, arch
            assert int(row.argmax()) == int(want.argmax())


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_reuse_and_saved_sessions(models, arch):
    """A second prompt sharing a prefix reuses the state (truncating into the prompt), and a saved
    state restored in another runtime continues as the original."""
    path, _ = models[arch]
    config = GenerationConfig(max_tokens=8, mode="lookup", draft_max=K, temperature=0)
    with Engine(rt(path)) as engine, Engine(rt(path)) as other:
        first = prompt_of(engine.target)
        engine.generate_tokens(first, config)
        second = first[:-3] + engine.target.tokenize(" a bird flew", add_special=False, parse_special=False)
        reused = engine.generate_tokens(second, config)
        assert reused.stats.cached_tokens > 0
        assert reused.tokens == other.generate_tokens(second, config).tokens
        blob, held = engine.target.save_state(), engine.target.tokens
        other.target.load_state(blob, held)
        cont = engine.target.tokenize(" and then", add_special=False, parse_special=False)
        assert np.array_equal(engine.target.decode(cont, 1), other.target.decode(cont, 1))


def test_bad_input_is_one_clear_error(models, tiny_pair):
    path, _ = models["lfm2"]
    with pytest.raises(EdgespecError, match="vocab"):
        Engine(rt(path), rt(tiny_pair["target"]))
    with rt(path) as hybrid, rt(models["qwen3next"][0]) as other:
        blob = other.save_state() if other.decode(prompt_of(other), 0) is not None else b""
        with pytest.raises(EdgespecError):
            hybrid.load_state(blob, prompt_of(other))


def test_the_profile_measures_rollback_and_auto_prices_it(models):
    """Qwen3-Next and Mamba-2 roll back through checkpoints (a restore and a replay pass); LFM2 through
    llama.cpp's own per-token snapshots (a cut, no replay). auto adds the rollback to every drafting round."""
    from edgespec.machine.profile import measure_profile
    from edgespec.policy import AdaptivePolicy

    costs = {}
    for arch in ("lfm2", "granitehybrid"):
        with rt(models[arch][0]) as target:
            assert bool(target.snapshot_window) == (arch == "lfm2")
            costs[arch] = measure_profile(target, budget_s=1.0)
    print(f"\nrollback: {', '.join(f'{a} {p.rollback_s * 1e3:.2f} ms (1-token pass {p.verify(1) * 1e3:.2f} ms)' for a, p in costs.items())}")
    assert costs["granitehybrid"].rollback_s > 0  # a restore and a replay pass (without logits)
    flat = CostProfile({n: 0.01 for n in range(1, 10)}, 0.001, 0.0012, 0.00005)
    priced = CostProfile(dict(flat.verify_s), 0.001, 0.0012, 0.00005, rollback_s=0.01)
    plain, cheap = (np.asarray(AdaptivePolicy(p, k_max=4)._verify_costs(4)) for p in (flat, priced))
    assert plain[0] == cheap[0] and np.allclose(cheap[1:], plain[1:] + 0.01)


def test_the_memory_model_counts_recurrent_state_and_checkpoints(models):
    from edgespec.machine.memory import facts_from_reader, recurrent_bytes
    from edgespec.runtimes.llamacpp import CHECKPOINT_DEPTH

    for arch, (path, _) in models.items():
        facts = facts_from_reader(path)
        with rt(path) as runtime:
            runtime.decode(prompt_of(runtime), 1)
            runtime.decode([runtime.vocab.eos], 1)  # checkpoints the state the prompt left
            state = ll.llama_state_seq_get_size_ext(runtime._ctx, 0, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            assert facts.recurrent_state_bytes <= state < facts.recurrent_state_bytes + 256, arch  # + a header
            assert facts.kv_layers == 1 + (arch == "qwen3next")  # the attention layer (and Qwen3-Next's MTP block)
            report = runtime.memory().other
            assert report["checkpoints"] >= state and report["recurrent_state"] >= state
            assert recurrent_bytes(facts) >= facts.recurrent_state_bytes * (1 + CHECKPOINT_DEPTH)


def test_bad_input_on_the_command_line_is_one_line_and_exit_2(models, tiny_pair):
    """A hybrid target with a draft of another vocabulary."""
    from test_cli import assert_user_error, edgespec

    assert_user_error(edgespec("generate", "hello", "--target", models["lfm2"][0], "--draft", tiny_pair["target"],
                               "--mode", "draft", "--max-tokens", "4"), "vocab")


@pytest.mark.slow  # 3 to 10 minutes on 2 shared cores (the pool's fresh shapes)
@pytest.mark.parametrize("arch", ARCHS)
def test_parallel_slots_on_a_hybrid_are_exact(models, arch):
    """serve --parallel: four requests through slots of one shared context, a recurrent draft model's too."""
    from test_exactness import GREEDY, run_slots

    path, draft = models[arch]
    with rt(path) as runtime:
        text = "The cat sat on the mat. The cat sat on the mat."
        prompts = [runtime.tokenize(t, add_special=True, parse_special=True)
                   for t in (text, "A dog ran. A dog ran.", "one two three one two three", text + " The dog")]
    runs, counters = run_slots({"target": path, "good_draft": draft}, GREEDY, "draft", prompts=prompts, max_tokens=16)
    assert counters["batched_steps"] > 0
    passes = []
    for prompt, (result, own) in runs.items():
        check_decisions(own, prompt, result.tokens)
        passes += own
    pool = LlamaCppMultiSeqRuntime(path, LlamaCppOptions(n_ctx=1024, n_threads=1), n_seq=2)
    fresh = Fresh(rt(path, flash_attn=False), pool, chunks=(1, 3, K + 1))
    print(f"\n{arch} slots: {check_rows(passes, fresh)}")
    fresh.runtime.close()
    pool.close()


@pytest.mark.slow  # about two minutes per architecture: 3 x 600 sampled generations
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_keeps_the_targets_distribution_through_recurrent_rollback(models, arch, smollm2_path):
    """Chi-square of the first three sampled tokens against the exact joint, with two drafts: the q8_0
    copy (mostly accepted, sometimes rejected: partial rollbacks) and SmolLM2 (same vocabulary, other
    weights: every draft rejected, so every round restores a checkpoint); the same test must reject a
    verifier that accepts every SmolLM2 draft (the negative control)."""
    from test_lossless_sampling import ALPHA, SAMPLING, accept_every_draft, chi_square_pvalue, exact_joint

    path, copy = models[arch]
    with rt(path) as plain:
        prompt = prompt_of(plain)
        joint = exact_joint(plain, prompt)
    for draft, verifier, exact in ((copy, None, True), (smollm2_path, None, True),
                                   (smollm2_path, accept_every_draft, False)):
        with Engine(rt(path), rt(draft)) as engine:
            samples, drafted, accepted = [], 0, 0
            for seed in range(600):
                result = engine.generate_tokens(prompt, GenerationConfig(max_tokens=3, mode="draft", draft_max=2,
                                                                         seed=seed, **SAMPLING), verifier=verifier)
                samples.append(tuple(result.tokens))
                drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        p = chi_square_pvalue(samples, joint)
        print(f"\n{arch}, draft {draft.name}, verifier {getattr(verifier, '__name__', 'exact')}: chi-square "
              f"p = {p:.3g}, accepted {accepted} of {drafted} drafted")
        if exact:
            assert drafted > accepted  # rejections happened, so rollback was exercised
        assert (p > ALPHA) == exact


@pytest.mark.parametrize("arch", ARCHS)
def test_a_new_generation_reusing_the_prompt_after_a_fully_accepted_pass_reads_the_right_state(models, arch):
    """The next generation on the same prompt cuts the whole last pass away (prefix reuse, as chat and
    the server's prefix cache do). Cutting through llama.cpp's per-token snapshots to the pass's very
    start left LFM2's state 15 logits off; every row must equal a fresh evaluation of its prefix."""
    path, copy = models[arch]
    fresh = fresh_for(path)
    with Engine(rt(path), rt(copy)) as engine:
        prompt = prompt_of(engine.target)
        engine.recorder = Recorder()
        outputs = [engine.generate_tokens(prompt, GenerationConfig(max_tokens=3, mode="draft", draft_max=2,
                                                                   temperature=0)).tokens for _ in range(3)]
        print(f"\n{arch}: {check_rows(list(engine.recorder.passes), fresh)}")
    fresh.runtime.close()
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_hybrid_bench_measures_rollback_state_and_auto(hybrid_ggufs, tmp_path):
    """bench/hybrid_bench.py end to end on the tiny LFM2 (the bench itself runs the realistic widths):
    every cost measured, the planner reserving the state and its snapshots, auto priced and raced."""
    import json

    from edgespec.bench import hybrid_bench

    out = tmp_path / "HYBRID.md"
    assert hybrid_bench.main(["--archs", "lfm2", "--size", "tiny", "--no-qwen", "--repeats", "1", "--max-tokens", "8",
                              "--threads", "1", "--models-dir", str(hybrid_ggufs["lfm2"].parent), "--out", str(out)]) == 0
    [row] = json.loads(out.with_suffix(".json").read_text())["models"]
    assert row["recurrent"] and row["state_bytes"] >= row["planner_state_bytes"] > 0
    for key in ("checkpoint_s", "restore_s", "pass_s", "cut_by_snapshots_s", "restore_and_replay_s"):
        assert row[key] > 0, key
    assert row["planner_recurrent_bytes"] >= row["planner_state_bytes"] * (1 + row["snapshot_window"])
    assert row["choices"]["priced@0.9"]["x_plain"] >= 1.0  # auto never predicts below plain
    assert set(row["race"]["per_prompt"]) == set(hybrid_bench.PROMPTS)
    assert "rollback by snapshots" in out.read_text()
