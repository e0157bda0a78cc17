"""The GPU benchmark (bench/gpu/run.py) end to end on this CPU machine, so it cannot rot before a GPU
is lent: every phase runs (the build and install phases decide to skip, and say why), on tiny
random-weight models made through the same exporter path as the Qwen2.5 shapes. Also the random
checkpoints themselves: real shapes, deterministic weights, a GGUF llama.cpp loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-bench")
    out = work / "out"
    argv = [sys.executable, str(ROOT / "bench/gpu/run.py"), "--sizes", "tiny", "--guard-size", "tiny",
            "--max-tokens", "16", "--repeats", "1", "--prompts", "1", "--threads", "1",
            "--work", str(work / "work"), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"stdout": done.stdout, "json": json.loads((out / "gpu_bench.json").read_text()),
            "md": (out / "gpu_bench.md").read_text(), "out": out, "argv": argv}


def test_every_phase_ran_and_the_skips_say_why(bench_run):
    phases = bench_run["json"]["phases"]
    assert list(phases) == ["build", "install", "models", "doctor", "profile", "generate", "guard", "report"]
    for name in ("models", "doctor", "profile", "generate", "guard", "report"):
        assert phases[name]["status"] == "ok", (name, phases[name])
    # No GPU here: the build is skipped with the reason, and the flags it would use are recorded.
    assert phases["build"]["status"] == "skipped" and phases["build"]["reason"]
    build = bench_run["json"]["build"]
    assert "-DGGML_CUDA=on" in build["cmake_args"] and "CMAKE_CUDA_ARCHITECTURES" in build["cmake_args"]
    assert build["installed_before"]["version"] == "0.3.36"
    assert phases["install"]["status"] == "skipped" and "this tree" in phases["install"]["reason"]
    assert "phase generate" in bench_run["stdout"]  # progress is printed as it goes


def test_models_profile_and_modes_are_in_the_json(bench_run):
    r = bench_run["json"]
    model = r["models"]["tiny"]
    assert model["tokenizer_parity"]["mismatches"] == 0
    assert Path(model["target"]).name == "tiny.f16.gguf" and Path(model["draft"]).name == "tiny.q4_k_m.gguf"
    curve = r["profile"]["tiny"]["curve"]
    assert sorted(map(int, curve["verify_s"])) == list(range(1, 18))  # k = 0..16
    assert set(curve["tree_s"]) == {"1", "2", "3", "4"} and all(v > 0 for v in curve["tree_s"]["4"].values())
    assert json.loads((bench_run["out"] / "profile-tiny.json").read_text())["verify_s"]
    rows = r["generate"]["tiny"]
    assert [(row["mode"], row["k"]) for row in rows] == (
        [("ar", 0)] + [("draft", k) for k in range(1, 9)] + [("lookup", 4), ("suffix", None), ("auto", None)])
    for row in rows:
        assert row["status"] == "ok" and row["generated"] == 16 and row["tokens_per_s"] > 0
    assert rows[0]["x_plain"] == 1.0
    assert all(row["chosen"].get(f"draft:{row['k']}") for row in rows if row["mode"] == "draft")
    assert r["doctor"]["gpu_layers"] == 0 and r["doctor"]["device_key"].startswith("cpu-")


def test_guard_reports_nvml_absent_and_refuses_an_impossible_budget(bench_run):
    g = bench_run["json"]["guard"]
    assert g["nvml"].startswith("absent")
    cases = {c["case"]: c for c in g["cases"]}
    assert cases["generous"]["exit"] == 0 and cases["generous"]["plan_kind"] == "cpu"
    assert cases["generous"]["stats"]["peak_rss_bytes"] <= cases["generous"]["budget_bytes"]
    assert cases["impossible"]["exit"] == 2 and cases["impossible"]["stderr_tail"][-1].startswith("error: nothing fits")
    checks = bench_run["json"]["checks"]
    assert not [c for c in checks if c["ok"] is False], checks
    assert any(c["ok"] is None and "NVML" in c["name"] for c in checks)


def test_markdown_has_the_tables(bench_run):
    md = bench_run["md"]
    for text in ("## Phases", "| build | skipped |", "## tiny", "Verify pass of n tokens", "Tree width 4",
                 "| draft | 8 |", "| auto | auto |", "## Memory guard", "| impossible |", "## Checks"):
        assert text in md, text


def test_random_checkpoint_has_real_shapes_and_seeded_weights(tmp_path):
    from edgespec.exporters.random_checkpoint import random_checkpoint

    ckpt = random_checkpoint("qwen2.5-7b", tmp_path / "7b", seed=3)
    assert abs(ckpt.n_params() - 7.62e9) < 0.01e9  # Qwen2.5-7B: 7.62B parameters
    assert ckpt.tensors["lm_head.weight"].shape == (152064, 3584) and not ckpt.tied_embeddings
    small = random_checkpoint("tiny", tmp_path / "tiny", seed=3)
    again = random_checkpoint("tiny", tmp_path / "tiny2", seed=3, n_threads=1)
    name = "model.layers.1.mlp.down_proj.weight"
    a, b = small.tensor(name), again.tensor(name)
    assert a.dtype == np.float16 and a.shape == (64, 128) and np.array_equal(a, b)  # threads do not change it
    assert 0.02 / 1.5 < float(a.astype(np.float32).std()) < 0.02 * 1.5 and abs(float(a.mean())) < 0.005
    assert not np.array_equal(a, random_checkpoint("tiny", tmp_path / "tiny3", seed=4).tensor(name))
    head = small.tensor("model.embed_tokens.weight")  # tied: the output matrix, peaked logits
    assert np.all(head[list(small.special_ids)] == 0)


def _load_run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench_run", ROOT / "bench/gpu/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_flags_find_cublas_in_a_wheel_and_link_it_unversioned(tmp_path):
    """A toolkit of nvcc alone lacks cuBLAS (this machine's does): the build takes the nvidia-cublas
    wheel's headers and libraries, through a shim of unversioned links; with no driver, VMM is off."""
    run = _load_run_module()
    site = tmp_path / "site"
    (site / "nvidia/cu13/include").mkdir(parents=True)
    (site / "nvidia/cu13/lib").mkdir(parents=True)
    (site / "nvidia/cu13/include/cublas_v2.h").write_text("")
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (site / "nvidia/cu13/lib" / lib).write_text("")
    flags, note = run.cuda_flags(tmp_path / "work", [site], driver=None)
    joined = " ".join(flags)
    assert "-DGGML_CUDA=on" in joined and "-DLLAVA_BUILD=OFF" in joined and "-U__AMX_INT8__" in joined
    toolkit_has_cublas = any((r / "include/cublas_v2.h").is_file() for r in run.toolkit_dirs())
    if not toolkit_has_cublas:
        assert f"-I{site / 'nvidia/cu13/include'}" in joined and note["cublas"].startswith("nvidia-cublas wheel")
        shim = tmp_path / "work/cuda-shim"
        assert f"-DCMAKE_LIBRARY_PATH={shim}" in flags
        assert (shim / "libcublas.so").resolve() == (site / "nvidia/cu13/lib/libcublas.so.13").resolve()
        assert (shim / "libcublasLt.so").is_symlink()
    toolkit_has_driver = any(list(r.glob("lib64/libcuda.so")) + list(r.glob("lib64/stubs/libcuda.so"))
                             for r in run.toolkit_dirs())
    if not toolkit_has_driver:
        assert "-DGGML_CUDA_NO_VMM=ON" in flags and "GGML_CUDA_NO_VMM" in note["cuda_driver"]
    fake_driver = tmp_path / "libcuda.so.1"
    fake_driver.write_text("")
    flags, note = run.cuda_flags(tmp_path / "work2", [site], driver=fake_driver)
    if not toolkit_has_driver:
        assert "-DGGML_CUDA_NO_VMM=ON" not in flags
        assert (tmp_path / "work2/cuda-shim/libcuda.so").resolve() == fake_driver.resolve()


def test_without_phases_drops_both_spellings():
    run = _load_run_module()
    assert run.without_phases(["--sizes", "tiny", "--phases", "build,install", "--repeats", "1"]) == \
        ["--sizes", "tiny", "--repeats", "1"]
    assert run.without_phases(["--phases=build", "--resume"]) == ["--resume"]


def test_policy_predict_reads_the_profile_the_bench_writes(bench_run):
    """Item 3's pipeline: the GPU's measured costs plus acceptance measured elsewhere -> auto's choice."""
    from edgespec.bench.policy_predict import load_profile, predict

    profile = load_profile(bench_run["out"] / "profile-tiny.json")
    assert profile.verify(1) == pytest.approx(float(bench_run["json"]["profile"]["tiny"]["verify_s"]["1"]))
    sure = predict({"draft": np.full(8, 1.0)}, profile)["draft"]  # every draft accepted
    never = predict({"draft": np.zeros(8)}, profile)["draft"]
    assert never["chosen_k"] == 0 and never["predicted_speedup_vs_plain"] == 1.0
    assert sure["expected_tokens_per_pass"] >= 1.0 and sure["predicted_speedup_vs_plain"] >= 1.0


def test_a_second_call_keeps_the_first_calls_phases(bench_run, tmp_path):
    """On the GPU the build gets a call of its own; the report of the next call still holds it."""
    out = tmp_path / "second"
    argv = [a for a in bench_run["argv"]]
    argv[argv.index("--out") + 1] = str(out)
    done = subprocess.run(argv + ["--phases", "doctor,report"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    second = json.loads((out / "gpu_bench.json").read_text())
    assert second["phases"]["build"]["status"] == "skipped" and second["generate"]["tiny"]
    assert "; then " in second["command"] and second["command"].endswith("--phases doctor,report")
    names = [c["name"] for c in second["checks"]]
    assert len(names) == len(set(names))  # doctor ran twice; its checks are not doubled


def test_profile_refuses_bad_curve_options_in_one_line():
    for flags, words in ((["--tree-widths", "x"], "--tree-widths takes whole numbers"),
                         (["--curve", "-1"], "--curve must be between 0 and 512")):
        done = subprocess.run([sys.executable, "-m", "edgespec.cli", "profile", *flags], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {words}") and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
