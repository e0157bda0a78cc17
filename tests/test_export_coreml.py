"""Core ML export: one stateful multifunction package (prefill, decode, verify), weights int8 or int4.

On Linux the package's structure is checked (functions, inputs, outputs, states, weight types, size),
and the torch module that gets converted is checked against transformers (max |logit diff| about
2e-6 in fp32 over prefill/decode/verify-shaped calls; asserted <= 1e-4). Running the package needs
Core ML itself: that test runs on macOS 15+ and is skipped elsewhere with the reason.
"""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

import torch  # noqa: E402  (the export extra; CI installs it)

MAX_CONTEXT = 128
DRAFT_MAX = 3


def _macos_15_or_later() -> bool:
    if sys.platform != "darwin":
        return False
    major = platform.mac_ver()[0].split(".")[0]
    return major.isdigit() and int(major) >= 15


@pytest.fixture(scope="module")
def packages(hf_tiny, tmp_path_factory):
    from edgespec.exporters.coreml_export import export_coreml

    root = tmp_path_factory.mktemp("coreml")
    return {
        "int4": export_coreml(hf_tiny["llama"], root / "llama-int4.mlpackage", quant="int4", max_context=MAX_CONTEXT,
                              prefill_max=32, draft_max=DRAFT_MAX),
        "int8": export_coreml(hf_tiny["llama"], root / "llama-int8.mlpackage", quant="int8", max_context=MAX_CONTEXT,
                              prefill_max=32, draft_max=DRAFT_MAX),
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3", "smollm"])
def test_converted_torch_decoder_matches_transformers(hf_tiny, name):
    from transformers import AutoModelForCausalLM

    from edgespec.exporters.checkpoint import load_checkpoint
    from edgespec.exporters.coreml_export import build_decoder, decoder_logits

    decoder = build_decoder(load_checkpoint(hf_tiny[name]), MAX_CONTEXT, cache_dtype=torch.float32)
    ids = list(range(10, 70))
    # The calls the functions make: a prefill, single decode steps, a verify of DRAFT_MAX + 1 tokens.
    chunks = [ids[:30], ids[30:31], ids[31:32], ids[32:32 + DRAFT_MAX + 1], ids[32 + DRAFT_MAX + 1:]]
    ours = decoder_logits(decoder, chunks)
    model = AutoModelForCausalLM.from_pretrained(hf_tiny[name], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


def test_rollback_is_a_shorter_mask(hf_tiny):
    """A rejected draft needs no cache edit: the next call's mask ends before the rejected rows."""
    from edgespec.exporters.checkpoint import load_checkpoint
    from edgespec.exporters.coreml_export import build_decoder, causal_mask

    decoder = build_decoder(load_checkpoint(hf_tiny["llama"]), MAX_CONTEXT, cache_dtype=torch.float32)

    def call(tokens, n_past):
        with torch.no_grad():
            return decoder(torch.tensor([tokens], dtype=torch.int32),
                           torch.from_numpy(causal_mask(n_past, len(tokens), np.float32)))[0].numpy()

    call(list(range(10, 30)), 0)
    call([99, 98, 97, 96], 20)       # a verify whose drafts are all rejected
    after_rollback = call([50], 20)  # continue at position 20 as if they never happened
    call(list(range(10, 30)), 0)
    clean = call([50], 20)
    assert np.abs(after_rollback - clean).max() <= 1e-5


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_package_structure(packages, hf_tiny, quant):
    from edgespec.exporters.coreml_export import describe_package

    art = packages[quant]
    d = describe_package(art.path)
    assert set(d["functions"]) == {"prefill", "decode", "verify"}
    assert d["default_function"] == "decode"
    n_layer, n_kv, head_dim = 2, 2, 16
    for name, fn in d["functions"].items():
        inputs = {i["name"]: i for i in fn["inputs"]}
        assert list(inputs) == ["input_ids", "causal_mask"]
        assert inputs["input_ids"]["dtype"] == "int32" and inputs["causal_mask"]["dtype"] == "float16"
        assert [o["name"] for o in fn["outputs"]] == ["logits"]
        assert [(s["name"], s["shape"], s["dtype"]) for s in fn["states"]] == [
            ("k_cache", [n_layer, n_kv, MAX_CONTEXT, head_dim], "float16"),
            ("v_cache", [n_layer, n_kv, MAX_CONTEXT, head_dim], "float16")]
        assert inputs["causal_mask"]["ranges"][3] == [1, MAX_CONTEXT]  # the mask's length says where tokens go
        # every projection of both layers, the embedding and the head are quantized; no float matrix left
        assert fn["quantized_weights"] == {quant: 2 * 7 + 2}
        assert fn["float_weight_matrices"] == 0
    assert d["functions"]["decode"]["inputs"][0]["shape"] == [1, 1]
    assert d["functions"]["verify"]["inputs"][0]["shape"] == [1, DRAFT_MAX + 1]
    assert d["functions"]["prefill"]["inputs"][0]["ranges"] == [[1, 1], [1, 32]]
    assert d["metadata"]["edgespec.verify_tokens"] == str(DRAFT_MAX + 1)
    # One copy of the weights serves the three functions: the file is about one model's worth.
    n_params = 125_248 if quant == "int4" else None
    if n_params:
        assert d["weight_bytes"] < n_params * 2 * 0.5  # well under one fp16 copy, let alone three


def test_int4_package_is_smaller_than_int8(packages):
    from edgespec.exporters.coreml_export import describe_package

    assert describe_package(packages["int4"].path)["weight_bytes"] < describe_package(packages["int8"].path)["weight_bytes"]


def test_unknown_coreml_quant(hf_tiny, tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.coreml_export import export_coreml

    with pytest.raises(EdgespecError, match="unknown Core ML quantization 'int2'"):
        export_coreml(hf_tiny["llama"], tmp_path / "x.mlpackage", quant="int2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not _macos_15_or_later(), reason="Core ML prediction needs macOS 15+")
def test_package_predictions_match_the_torch_decoder(packages, hf_tiny):
    import coremltools as ct

    from edgespec.exporters.checkpoint import load_checkpoint
    from edgespec.exporters.coreml_export import build_decoder, causal_mask, decoder_logits

    art = packages["int8"]
    ids = list(range(10, 40))
    chunks = [ids[:20], ids[20:21], ids[21:21 + DRAFT_MAX + 1]]
    models = {fn: ct.models.MLModel(str(art.path), function_name=fn) for fn in ("prefill", "decode", "verify")}
    state = models["prefill"].make_state()
    got, n_past = [], 0
    for fn, chunk in zip(("prefill", "decode", "verify"), chunks):
        out = models[fn].predict({"input_ids": np.array([chunk], dtype=np.int32),
                                  "causal_mask": causal_mask(n_past, len(chunk))}, state=state)
        got.append(out["logits"][0].astype(np.float32))
        n_past += len(chunk)
    got = np.concatenate(got)
    want = decoder_logits(build_decoder(load_checkpoint(hf_tiny["llama"]), MAX_CONTEXT, torch.float32), chunks)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.8
    assert np.abs(got - want).max() <= 0.5  # fp16 compute and int8 weights
