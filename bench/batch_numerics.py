"""How far llama.cpp's batched logits are from its single-token logits on the same tokens.

    python -m edgespec.bench.batch_numerics [--prompt grounded-json-yaml] [--tokens 64] [--batch 4] [--threads 1]

Greedy speculation is exact only up to this: a verify pass evaluates k + 1 tokens as one batch, and
llama.cpp's CPU kernels for a batch (repacked weights, activations quantized per block of rows) round
differently from the one-token kernels plain decoding uses. The script decodes a prompt's greedy
continuation one token at a time, then re-evaluates it in batches of --batch tokens from the same KV,
and prints the largest |batch - single| logit difference per batch, over the whole row and between the
row's top two tokens (the difference that can flip a greedy choice).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="grounded-json-yaml", help="a prompt id of bench/prompts.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    from edgespec.bench.run import load_prompts
    from edgespec.engine import Engine, GenerationConfig
    from edgespec.models import store
    from edgespec.runtimes.llamacpp import LlamaCppOptions, LlamaCppRuntime

    prompt = next(x for x in load_prompts() if x.id == args.prompt)
    rt = LlamaCppRuntime(store.resolve(args.model), LlamaCppOptions(n_ctx=4096, n_threads=args.threads, flash_attn=False))
    with Engine(rt) as engine:
        ids = engine.prompt_tokens(list(prompt.messages))
        out = engine.generate_tokens(ids, GenerationConfig(max_tokens=args.tokens, temperature=0, mode="ar")).tokens
        path = ids + list(out)
        start = len(ids) - 1
        rt.truncate(0)
        rt.decode(path[:start], 0)
        single = np.stack([rt.decode([t], 1)[0] for t in path[start:]])
        whole, top2 = [], []
        for at in range(0, len(out) - args.batch, args.batch):
            rt.truncate(start + at)
            batch = rt.decode(path[start + at:start + at + args.batch], args.batch)
            ref = single[at:at + args.batch]
            whole.append(float(np.abs(batch - ref).max()))
            a, b = np.argsort(-ref, axis=1)[:, 0], np.argsort(-ref, axis=1)[:, 1]
            rows = np.arange(len(ref))
            top2.append(float(np.abs((batch[rows, a] - batch[rows, b]) - (ref[rows, a] - ref[rows, b])).max()))
    print(json.dumps({"model": args.model, "prompt": args.prompt, "batch": args.batch, "threads": args.threads,
                      "max_abs_diff_per_batch": [round(x, 3) for x in whole],
                      "max_top2_gap_change_per_batch": [round(x, 3) for x in top2],
                      "max_abs_diff": round(max(whole), 3), "max_top2_gap_change": round(max(top2), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
