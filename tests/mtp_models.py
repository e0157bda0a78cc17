"""A tiny random-weight model with a multi-token-prediction (MTP / NextN) head, made here.

No MTP model can be downloaded on these machines, so the MTP tests make one: a GLM-4.5 MoE
(`Glm4MoeForCausalLM`, the transformers config of GLM-4.5 / 4.5-Air) with two trunk layers and one
NextN block, converted by llama.cpp's own `convert_hf_to_gguf.py` (the vendored tree, its `gguf-py` first
on the path). GLM-4.5 MoE is an architecture llama.cpp both converts with its nextn layers and runs as an
MTP draft context (src/models/glm4-moe.cpp has a DECODER_MTP graph), and it is attention-only, so the
drafter is tested apart from recurrent-state rollback.

transformers' Glm4MoeForCausalLM has no NextN block (it drops the layers past num_hidden_layers), so the
checkpoint gets one added under the names the converter reads from the safetensors
(``model.layers.{N}.eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head.norm`` plus a full MoE decoder layer).

The tokenizer is the byte-level BPE of tests/hf_models.py with GLM's special tokens added (the converter's
GLM vocabulary reads ``[gMASK]``, ``<|user|>``, ``<|endoftext|>``, ``<|observation|>``). A tokenizer trained
here has a pre-tokenizer hash llama.cpp's table does not list, so the conversion runs the converter's
own main() with that one lookup answered "gpt-2" (the pre-tokenizer it was trained with).

Random weights: the head drafts tokens, but how often the target accepts them says nothing about a real
MTP head; the tests here check exactness, not acceptance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GLM_SPECIALS = ["[gMASK]", "<|user|>", "<|observation|>"]

# Runs convert_hf_to_gguf.main() from the vendored tree with the pre-tokenizer hash lookup answered.
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src + "/gguf-py", src]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
import convert_hf_to_gguf as convert
from conversion import base
for cls in (getattr(base, "TextModel", None), getattr(base, "ModelBase", None)):
    if cls is not None and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert.main()
"""


def write_mtp_checkpoint(directory: str | os.PathLike, *, seed: int = 0, vocab_size: int = 400,
                         hidden: int = 64, n_layer: int = 2, n_nextn: int = 1) -> Path:
    """Save a tiny random Glm4MoeForCausalLM with `n_nextn` NextN blocks and a trained tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PreTrainedTokenizerFast

    from tests.hf_models import CHATML, train_tokenizer

    directory = Path(directory)
    tok = train_tokenizer("gpt2", vocab_size)
    tok.add_special_tokens(GLM_SPECIALS)
    n_tok = tok.get_vocab_size()
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = Glm4MoeConfig(
        vocab_size=n_tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, partial_rotary_factor=0.5,
        moe_intermediate_size=hidden // 2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False, use_qk_norm=False,
        bos_token_id=tok.token_to_id("[gMASK]"), eos_token_id=eos, pad_token_id=pad)
    config.num_nextn_predict_layers = n_nextn
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():  # norms start at 1; vary them so a wrong norm mapping shows
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
        for layer in model.model.layers[config.first_k_dense_replace:]:  # a router with preferences
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)

    # The NextN blocks transformers leaves out: a MoE decoder layer (a noisy copy of the last trunk
    # layer) plus the projection that mixes the target's hidden state with the next token's embedding.
    weights_path = directory / "model.safetensors"
    weights = load_file(weights_path)
    gen = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{n_layer - 1}."
    for i in range(n_nextn):
        prefix = f"model.layers.{n_layer + i}."
        for name, value in list(weights.items()):
            if name.startswith(last):
                noise = torch.randn(value.shape, generator=gen) * 0.05
                weights[prefix + name[len(last):]] = (value + noise).contiguous()
        weights[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            weights[prefix + norm + ".weight"] = torch.rand(hidden, generator=gen) + 0.5
    save_file(weights, weights_path, metadata={"format": "pt"})

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[gMASK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = n_nextn
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def convert_with_llama_cpp(checkpoint: str | os.PathLike, out: str | os.PathLike, *, outtype: str = "f32",
                           extra: tuple[str, ...] = ()) -> Path:
    """Convert `checkpoint` with the vendored llama.cpp convert_hf_to_gguf.py; the GGUF's path."""
    from edgespec.exporters.llama_source import llama_cpp_source

    src = Path(llama_cpp_source())
    out = Path(out)
    cmd = [sys.executable, "-c", _CONVERT, str(src), str(checkpoint), "--outfile", str(out), "--outtype", outtype,
           *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out


def write_mtp_gguf(directory: str | os.PathLike, *, seed: int = 0, name: str = "tiny-mtp.gguf",
                   n_nextn: int = 1) -> Path:
    """A tiny GLM-4.5-MoE GGUF with `n_nextn` NextN (MTP) blocks, made and converted in `directory`."""
    directory = Path(directory)
    checkpoint = write_mtp_checkpoint(directory / "hf", seed=seed, n_nextn=n_nextn)
    return convert_with_llama_cpp(checkpoint, directory / name)
