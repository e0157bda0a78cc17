"""A draft derived from the target when no draft model exists, and the acceptance a pair reaches.

Two ways, both keeping the target's tokenizer by construction:

* ``quant[:TYPE]``  - the target itself at fewer bits (GGUF: one type below the target's, e.g. q8_0 ->
  q4_k_m, q4_k_m -> q3_k_m; ONNX: its int4 model; Core ML: an int4 package). Cheaper to read per token, same vocabulary,
  high agreement: it pays where decoding is bound by memory bandwidth.
* ``layers[:N]``    - the target's first N layers (default: a quarter) under its own final norm and
  output head: a much cheaper model whose proposals agree less often.

`measure_acceptance` runs the pair through edgespec's own engine (llama.cpp, greedy, draft mode) on
a few sample prompts and reports vLLM-style acceptance numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.exporters.checkpoint import Checkpoint

# One step down from each GGUF type, for a `quant` self-draft without an explicit type.
LOWER_GGUF_QUANT = {
    "f32": "q4_k_m", "f16": "q4_k_m", "bf16": "q4_k_m", "q8_0": "q4_k_m", "q6_k": "q4_k_m", "q5_k_m": "q4_k_m",
    "q5_k_s": "q4_k_m", "q5_0": "q4_k_m", "q5_1": "q4_k_m", "q4_k_m": "q3_k_m", "q4_k_s": "q3_k_m",
    "q4_0": "q3_k_m", "q4_1": "q3_k_m", "q3_k_m": "q2_k",
}

SAMPLE_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Speculative decoding speeds up language models because",
    "Here is a list of the planets of the solar system in order from the sun:",
)


@dataclass(frozen=True)
class SelfDraft:
    method: str                 # "quant" | "layers"
    gguf_quant: str | None      # quant: the draft's GGUF type
    n_layers: int | None        # layers: how many of the target's layers

    def to_dict(self) -> dict:
        return {"method": self.method, "gguf_quant": self.gguf_quant, "n_layers": self.n_layers}


def parse_self_draft(text: str, target: Checkpoint, target_gguf_quant: str | None) -> SelfDraft:
    """`quant`, `quant:q4_0`, `layers` or `layers:8` -> a SelfDraft for this target."""
    method, _, arg = text.partition(":")
    if method == "quant":
        quant = arg or (LOWER_GGUF_QUANT.get(target_gguf_quant or "f16"))
        if quant is None:
            raise EdgespecError(f"there is no GGUF type below {target_gguf_quant}; give one (--self-draft quant:TYPE) "
                                "or use --self-draft layers")
        from edgespec.exporters.gguf_export import check_quant_types

        check_quant_types([quant])
        return SelfDraft("quant", quant, None)
    if method == "layers":
        try:
            n = int(arg) if arg else max(1, target.n_layer // 4)
        except ValueError:
            raise EdgespecError(f"--self-draft layers:N needs a whole number of layers, got {arg!r}") from None
        if not 1 <= n < target.n_layer:
            raise EdgespecError(f"--self-draft layers:{n}: the target has {target.n_layer} layers; keep between 1 "
                                f"and {target.n_layer - 1}")
        return SelfDraft("layers", None, n)
    raise EdgespecError(f"unknown --self-draft {text!r}; use quant[:TYPE] or layers[:N]")


def write_truncated_checkpoint(target: Checkpoint, n_layers: int, out_dir: str | os.PathLike) -> Path:
    """A checkpoint of the target's first `n_layers` layers (embedding, final norm and head kept):
    config with num_hidden_layers = n_layers, one safetensors file with the kept tensors' bytes as they
    are, and the tokenizer files copied."""
    import shutil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(target.config)
    config["num_hidden_layers"] = n_layers
    config["_name_or_path"] = f"{target.name}-first{n_layers}"
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        config["layer_types"] = layer_types[:n_layers]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], n_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for name, ref in target.tensors.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= n_layers:
            continue
        kept[name] = ref
    header, offset = {}, 0
    for name, ref in kept.items():
        size = ref.end - ref.start
        header[name] = {"dtype": ref.dtype, "shape": list(ref.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", "edgespec": f"first {n_layers} layers of {target.name}"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for ref in kept.values():
            with open(ref.file, "rb") as src:
                src.seek(ref.start)
                remaining = ref.end - ref.start
                while remaining:
                    chunk = src.read(min(remaining, 1 << 24))
                    f.write(chunk)
                    remaining -= len(chunk)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (target.path / name).is_file():
            shutil.copy2(target.path / name, out / name)
    return out


# The export's checks are small: one thread is enough, and llama.cpp's spin-waiting worker threads
# slow down about tenfold on a machine whose cores are busy with other work (measured: 4.7 s with one
# thread, 41 s with two, on a loaded 2-core machine).
CHECK_THREADS = 1


def measure_acceptance(target_gguf: str | os.PathLike, draft_gguf: str | os.PathLike, *,
                       prompts: tuple[str, ...] = SAMPLE_PROMPTS, max_tokens: int = 32, draft_max: int = 4,
                       n_threads: int = CHECK_THREADS) -> dict:
    """Greedy speculative generation with the pair on sample prompts; vLLM-style acceptance numbers."""
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    options = LlamaCppOptions(n_ctx=512, n_threads=n_threads, n_gpu_layers=0)
    drafted = accepted = rounds = generated = 0
    target = LlamaCppRuntime(target_gguf, options)
    try:
        draft = LlamaCppRuntime(draft_gguf, options)
    except BaseException:
        target.close()
        raise
    with Engine(target, draft) as engine:
        config = GenerationConfig(max_tokens=max_tokens, temperature=0.0, mode="draft", draft_max=draft_max, raw=True)
        for prompt in prompts:
            result = engine.generate(prompt, config)
            s = result.stats
            drafted, accepted, rounds, generated = (drafted + s.drafted, accepted + s.accepted,
                                                    rounds + s.rounds, generated + s.generated)
    return {
        "prompts": len(prompts), "generated": generated, "drafted": drafted, "accepted": accepted, "rounds": rounds,
        "draft_max": draft_max,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(1 + accepted / rounds, 4) if rounds else 0.0,
    }
