/**
 * Drafters propose the tokens the target then verifies in one pass (edgespec/drafters/). A drafter
 * sees the committed context (prompt and emitted tokens; its last token is the one the target has not
 * evaluated yet) and returns up to k tokens, with the distributions it drew them from when sampling, or
 * null when it is deterministic (prompt lookup: one-hot).
 */

import type { OnnxModel } from "./model.js";
import type { Sampler } from "./sampling.js";

export interface Draft {
  tokens: Int32Array; // m <= k tokens
  probs: Float64Array | null; // m x nVocab draft distributions; null = deterministic
}

export const EMPTY_DRAFT: Draft = { tokens: new Int32Array(0), probs: null };

export interface Drafter {
  readonly name: string;
  /** Prefill whatever the drafter needs for this context (counted in time to first token). */
  prepare(context: Int32Array): Promise<void>;
  /** Up to k tokens continuing `context`. */
  propose(context: Int32Array, k: number, sampler: Sampler): Promise<Draft>;
}

/** Keep a model's KV for the longest prefix it shares with `tokens`; return that length. */
export function syncTo(model: OnnxModel, tokens: Int32Array): number {
  const held = model.tokens;
  const n = Math.min(held.length, tokens.length);
  let kept = 0;
  while (kept < n && held[kept] === tokens[kept]) kept++;
  if (kept < model.nPast) model.truncate(kept);
  return kept;
}

/**
 * A small model with the target's vocabulary drafts k tokens autoregressively. Its KV holds the
 * committed context except the last token, like the target's; after a verification `syncTo` keeps the
 * accepted prefix, and the tokens it has not seen go into its next decode together. Memory: the draft's
 * weights and KV plus k rows of probabilities when sampling.
 */
export class DraftModelDrafter implements Drafter {
  readonly name = "draft";

  constructor(readonly model: OnnxModel) {}

  async prepare(context: Int32Array): Promise<void> {
    const kept = syncTo(this.model, context.subarray(0, context.length - 1));
    if (kept < context.length - 1) await this.model.decode(context.subarray(kept, context.length - 1), 0);
  }

  async propose(context: Int32Array, k: number, sampler: Sampler): Promise<Draft> {
    let kept = syncTo(this.model, context);
    if (kept === context.length) { // everything seen: re-evaluate the last token to get its row
      this.model.truncate(kept - 1);
      kept -= 1;
    }
    const V = this.model.nVocab;
    let pending: Int32Array = context.subarray(kept);
    const tokens = new Int32Array(k);
    const probs = sampler.greedy ? null : new Float64Array(k * V);
    for (let i = 0; i < k; i++) {
      const logits = await this.model.decode(pending, 1);
      const row = sampler.rows(logits, V, context, tokens.subarray(0, i));
      tokens[i] = sampler.pick(row);
      if (probs) probs.set(row, i * V);
      pending = tokens.subarray(i, i + 1);
    }
    return { tokens, probs };
  }
}

/**
 * Drafts by copying: find the latest earlier occurrence of the context's last n tokens and propose what
 * followed it (Saxena 2023; llama.cpp's lookup). Tries n from ngramMax down to ngramMin; the draft never
 * runs past the end of the context. A scan of the context, no model, no allocation but the draft.
 */
export class PromptLookupDrafter implements Drafter {
  readonly name = "lookup";

  constructor(readonly ngramMax = 4, readonly ngramMin = 1) {
    if (!(ngramMin >= 1 && ngramMin <= ngramMax)) throw new RangeError("need 1 <= ngramMin <= ngramMax");
  }

  async prepare(): Promise<void> {}

  async propose(context: Int32Array, k: number): Promise<Draft> {
    const nCtx = context.length;
    for (let n = Math.min(this.ngramMax, nCtx - 1); n >= this.ngramMin; n--) {
      const suffix = nCtx - n;
      // windows start at 0 .. nCtx-n-1 (each has a token after it); the latest match wins
      for (let s = nCtx - n - 1; s >= 0; s--) {
        let j = 0;
        while (j < n && context[s + j] === context[suffix + j]) j++;
        if (j === n) {
          const start = s + n;
          return { tokens: context.slice(start, Math.min(start + k, nCtx)), probs: null };
        }
      }
    }
    return EMPTY_DRAFT;
  }
}
