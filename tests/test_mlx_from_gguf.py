"""GGUF -> MLX (exporters/gguf_to_mlx.py): a GGUF the exporters wrote, read back into an MLX repo.

f32: the checkpoint's own weights, so MLX gives the checkpoint's logits exactly. Q8_0: kept as MLX
8-bit groups of 32 holding the same numbers (checked by MLX's own dequantization against gguf-py's),
so it equals the GGUF dequantized to f32 up to the kernel; other types refused in one line.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

if sys.platform == "darwin" and platform.machine() != "arm64":
    pytest.skip("MLX has no build for Intel Macs", allow_module_level=True)
import mlx_lm  # noqa: E402,F401

from edgespec.engine import Engine, GenerationConfig  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
from lossless import compare_greedy  # noqa: E402
from test_onnx_runtime import corpus_ids, prompts  # noqa: E402

MAX_TOKENS = 24


def mlx_runtime(path, **options):
    from edgespec.runtimes.mlx import MlxOptions, MlxRuntime

    return MlxRuntime(path, MlxOptions(**{"n_ctx": 512, **options}))


@pytest.fixture(scope="module")
def ggufs(hf_tiny, tmp_path_factory):
    from edgespec.exporters.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("gguf-for-mlx")
    llama = export_gguf(hf_tiny["llama"], root, ["f32", "q8_0", "q4_k_m"], stem="llama").files
    qwen2 = export_gguf(hf_tiny["qwen2"], root, ["f32"], stem="qwen2").files
    return {"llama": llama, "qwen2": qwen2}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_an_f32_gguf_becomes_the_checkpoint_on_mlx(ggufs, hf_tiny, tmp_path, name):
    from edgespec.exporters.gguf_to_mlx import gguf_to_mlx

    out = gguf_to_mlx(ggufs[name]["f32"], tmp_path / name)
    ids = corpus_ids(hf_tiny[name], 64)
    with mlx_runtime(out) as back, mlx_runtime(hf_tiny[name]) as ckpt:
        assert back.vocab == ckpt.vocab
        assert all(back.token_bytes(t) == ckpt.token_bytes(t) for t in range(ckpt.vocab.n_vocab))
        text = "Hello <|im_end|> world 12345"
        assert back.tokenize(text, add_special=True, parse_special=True) == \
            ckpt.tokenize(text, add_special=True, parse_special=True)
        assert back.chat_template() == ckpt.chat_template()
        assert np.array_equal(back.decode(ids, len(ids)), ckpt.decode(ids, len(ids)))


def test_a_q8_0_gguf_keeps_its_numbers_as_mlx_8bit(ggufs, hf_tiny, tmp_path):
    import gguf
    import mlx.core as mx

    from edgespec.exporters.gguf_to_mlx import gguf_to_mlx

    q8 = gguf_to_mlx(ggufs["llama"]["q8_0"], tmp_path / "q8")
    deq = gguf_to_mlx(ggufs["llama"]["q8_0"], tmp_path / "q8-f32", mode="fp32")
    assert json.loads((q8 / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 8,
                                                                          "mode": "affine"}
    assert "quantization" not in json.loads((deq / "config.json").read_text())
    kept, floats = mx.load(str(q8 / "model.safetensors")), mx.load(str(deq / "model.safetensors"))
    reader = gguf.GGUFReader(ggufs["llama"]["q8_0"])
    assert sum(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in reader.tensors) >= 7
    for name in [k.removesuffix(".scales") for k in kept if k.endswith(".scales")]:
        w = mx.dequantize(kept[f"{name}.weight"], kept[f"{name}.scales"], kept[f"{name}.biases"], group_size=32, bits=8)
        assert np.array_equal(np.array(w), np.array(floats[f"{name}.weight"])), name  # the same numbers
    assert (q8 / "model.safetensors").stat().st_size < (deq / "model.safetensors").stat().st_size / 2.5

    cfg = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="ar")
    identical = 0
    with Engine(mlx_runtime(q8)) as a, Engine(mlx_runtime(deq)) as b, mlx_runtime(deq) as reference:
        for ids in prompts(hf_tiny["llama"], 8):
            cmp = compare_greedy(reference, ids, b.generate_tokens(ids, cfg).tokens, a.generate_tokens(ids, cfg).tokens)
            identical += cmp.identical
            assert cmp.near_tie, cmp
    print(f"\nQ8_0 as MLX 8-bit vs dequantized: greedy identical {identical}/8")
    with Engine(mlx_runtime(q8), mlx_runtime(q8)) as spec:  # speculation on the 8-bit model is exact on itself
        ids = prompts(hf_tiny["llama"], 1)[0]
        assert spec.generate_tokens(ids, GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, mode="draft",
                                                          draft_max=3)).tokens == \
            spec.generate_tokens(ids, cfg).tokens


def test_types_mlx_cannot_hold_are_refused_in_one_line_or_dequantized(ggufs, tmp_path):
    from edgespec.exporters.gguf_to_mlx import gguf_to_mlx

    # the tiny model's rows (64) are too short for k-quants' 256-blocks: llama.cpp fell back to Q5_0
    with pytest.raises(EdgespecError, match=r"^llama\.q4_k_m\.gguf holds Q5_0 weights, which MLX has no "
                                            r"quantization for .*--quant mlx:fp32"):
        gguf_to_mlx(ggufs["llama"]["q4_k_m"], tmp_path / "q4")
    assert not (tmp_path / "q4").exists()
    out = gguf_to_mlx(ggufs["llama"]["q4_k_m"], tmp_path / "q4-f16", mode="fp16")
    with mlx_runtime(out) as rt:
        assert np.isfinite(rt.decode([5, 6, 7], 1)).all()


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "EDGESPEC_DEBUG": "", **(env or {})}, timeout=300)


def test_cli_export_of_a_gguf_to_mlx(ggufs, tmp_path):
    out = tmp_path / "m"
    proc = cli("export", ggufs["llama"]["q8_0"], "--format", "mlx", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    proc = cli("generate", "Hello", "--target", out, "--runtime", "mlx", "-n", "4", "--temperature", "0",
               env={"EDGESPEC_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    for args, message in (
            (("--format", "gguf"), "error: a GGUF exports to MLX only (--format mlx)"),
            (("--format", "mlx", "--quant", "mlx:int4"), "error: a GGUF becomes MLX as it is (keep: Q8_0 as MLX 8-bit) or dequantized"),
            (("--format", "mlx"), "error: llama.q4_k_m.gguf holds Q5_0")):
        src = ggufs["llama"]["q4_k_m" if message.endswith("Q5_0") else "q8_0"]
        proc = cli("export", src, *args, "--out", tmp_path / "x")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(message), proc.stderr
