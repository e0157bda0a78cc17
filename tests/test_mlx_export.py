"""`edgespec export --format mlx` (exporters/mlx_export.py through exporters/bundle.py): the pair
converted by mlx_lm.convert into the bundle, loaded back with `--runtime mlx`.

Exactness: the unquantized (fp32) export holds the checkpoint's own weights, so its greedy output
equals the checkpoint's on MLX token for token; the 4- and 8-bit exports are other models, held to
the engine's rule on themselves (speculation equals plain decoding) and their agreement recorded.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

if sys.platform == "darwin" and platform.machine() != "arm64":
    pytest.skip("MLX has no build for Intel Macs", allow_module_level=True)
import mlx_lm  # noqa: E402,F401

from edgespec.engine import Engine, GenerationConfig  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
from test_onnx_runtime import prompts  # noqa: E402

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mlx_bundle(hf_tiny, tmp_path_factory):
    from edgespec.exporters.bundle import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("mlx-bundle") / "pair"
    options = ExportOptions(formats=("mlx",), mlx_quants=("int4", "int8", "fp32"), measure=True)
    return export_bundle(hf_tiny["llama"], out, hf_tiny["llama_draft"], options)


def test_the_bundle_lists_each_quant_of_the_pair_and_is_intact(mlx_bundle):
    from edgespec.exporters.bundle import read_manifest, verify_bundle

    manifest = read_manifest(mlx_bundle)
    entry = manifest["formats"]["mlx"]
    assert [a["quant"] for a in entry["target"]] == ["int4", "int8", "fp32"]
    assert [a["file"] for a in entry["draft"]] == ["mlx/draft.int4", "mlx/draft.int8", "mlx/draft.fp32"]
    assert manifest["runtimes"]["mlx"] == {"target": "mlx/target.int4", "draft": "mlx/draft.int4"}
    assert all(a["bytes"] > 0 and len(a["sha256"]) == 64 for a in entry["target"] + entry["draft"])
    sizes = {a["quant"]: a["bytes"] for a in entry["target"]}
    assert sizes["int4"] < sizes["int8"] < sizes["fp32"]
    for quant, bits in (("int4", 4), ("int8", 8)):
        config = json.loads((mlx_bundle / f"mlx/target.{quant}/config.json").read_text())
        assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    # the checkpoint's tokenizer, byte for byte
    assert (mlx_bundle / "mlx/target.int4/tokenizer.json").read_bytes() == \
        (mlx_bundle / "tokenizer/tokenizer.json").read_bytes()
    quality = manifest["quality"]["mlx"]
    print(f"\nMLX export agreement with the float checkpoint: {quality}")
    assert quality["target"]["fp32"]["top1_agreement"] == 1.0 and quality["target"]["fp32"]["max_abs_logit_diff"] == 0
    assert quality["target"]["int8"]["top1_agreement"] >= quality["target"]["int4"]["top1_agreement"] - 0.05
    assert {"mlx", "mlx-lm"} <= set(manifest["exporter"]["tools"])
    assert verify_bundle(mlx_bundle) == []


def test_the_bundle_runs_with_runtime_mlx_and_fp32_equals_the_checkpoint(mlx_bundle, hf_tiny):
    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    spec = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="draft", draft_max=4)
    ids = prompts(hf_tiny["llama"], 4)
    with Engine.load(mlx_bundle, runtime="mlx", n_ctx=256) as engine:  # the manifest's pair: int4 target and draft
        assert engine.target.directory == mlx_bundle / "mlx/target.int4"
        assert engine.draft_runtime.directory == mlx_bundle / "mlx/draft.int4"
        for p in ids:
            plain = engine.generate_tokens(p, cfg).tokens
            assert engine.generate_tokens(p, spec).tokens == plain  # exact on the quantized model itself
    with Engine.load(mlx_bundle / "mlx/target.fp32", runtime="mlx", n_ctx=256) as exported, \
            Engine.load(hf_tiny["llama"], runtime="mlx", n_ctx=256) as checkpoint:
        for p in ids:
            assert exported.generate_tokens(p, cfg).tokens == checkpoint.generate_tokens(p, cfg).tokens


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "EDGESPEC_DEBUG": "", **(env or {})}, timeout=300)


def test_cli_export_format_mlx_and_its_one_line_errors(hf_tiny, tmp_path):
    out = tmp_path / "b"
    proc = cli("export", hf_tiny["llama"], "--format", "mlx", "--quant", "mlx:int8", "--no-measure", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)  # stdout: the bundle path only (mlx-lm's own prints kept off it)
    assert "mlx    target int8" in proc.stderr
    assert json.loads((out / "edgespec.json").read_text())["runtimes"]["mlx"] == {"target": "mlx/target.int8",
                                                                                "draft": None}
    proc = cli("generate", "Hello", "--target", out, "--runtime", "mlx", "-n", "4", "--temperature", "0",
               env={"EDGESPEC_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr

    proc = cli("export", hf_tiny["llama"], "--format", "mlx", "--quant", "mlx:int3", "--out", tmp_path / "c")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: unknown quantization 'int3' for mlx")

    shadow = tmp_path / "no-mlx"  # as if MLX were not installed
    (shadow / "mlx").mkdir(parents=True)
    (shadow / "mlx" / "__init__.py").write_text("raise ImportError('no MLX here', name='mlx')\n")
    proc = cli("export", hf_tiny["llama"], "--format", "gguf,mlx", "--out", tmp_path / "d",
               env={"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == ("error: the MLX runtime needs mlx and mlx-lm (mlx is not installed): "
                                   "pip install 'edgespec[mlx]'")
    assert not (tmp_path / "d").exists()


def test_a_bundle_without_mlx_says_how_to_export_one(tmp_path):
    from edgespec.models import bundles

    (tmp_path / "edgespec.json").write_text(json.dumps({"runtimes": {"llama.cpp": {"target": "x.gguf"}}}))
    with pytest.raises(EdgespecError, match="has no MLX target; export it with --format mlx"):
        Engine.load(tmp_path, runtime="mlx")
    assert bundles.mlx_draft(tmp_path) is None


def test_self_draft_quant_on_mlx_is_the_target_at_4_bits(hf_tiny, tmp_path):
    from edgespec.exporters.bundle import ExportOptions, export_bundle, read_manifest

    options = ExportOptions(formats=("mlx",), mlx_quants=("int8",), self_draft="quant", measure=False)
    manifest = read_manifest(export_bundle(hf_tiny["llama"], tmp_path / "sd", None, options))
    assert manifest["runtimes"]["mlx"] == {"target": "mlx/target.int8", "draft": "mlx/draft.int4"}
    options = ExportOptions(formats=("mlx",), mlx_quants=("int4",), self_draft="quant", measure=False)
    manifest = read_manifest(export_bundle(hf_tiny["llama"], tmp_path / "sd4", None, options))
    assert manifest["runtimes"]["mlx"]["draft"] is None and "int4 is the fewest bits" in manifest["formats"]["mlx"]["note"]
