/**
 * Turning a logits row into the distribution a token is drawn from: edgespec/sampling.py, same order
 * and rules (llama.cpp's default chain): repetition penalty, top-k, top-p, min-p, temperature.
 *
 * The same function processes target and draft rows, so rejection sampling compares like with like.
 * Rows are views into flat typed arrays (row j of an m x nVocab block is subarray(j*nVocab, ...)).
 */

import { EdgespecError } from "./errors.js";

export interface SamplingParams {
  temperature: number; // 0 = greedy (argmax), which is what speculation keeps exact
  topK: number; // 0 = whole vocabulary
  topP: number; // 1 = off
  minP: number; // 0 = off
  repeatPenalty: number; // 1 = off
  repeatLastN: number;
}

export const DEFAULT_SAMPLING: SamplingParams = {
  temperature: 0.8, topK: 40, topP: 0.95, minP: 0.05, repeatPenalty: 1.0, repeatLastN: 64,
};

export function checkSampling(p: SamplingParams): void {
  const checks: [boolean, string][] = [
    [p.temperature >= 0, `temperature must be >= 0, got ${p.temperature}`],
    [Number.isInteger(p.topK) && p.topK >= 0, `topK must be an integer >= 0 (0 = off), got ${p.topK}`],
    [p.topP > 0 && p.topP <= 1, `topP must be in (0, 1], got ${p.topP}`],
    [p.minP >= 0 && p.minP < 1, `minP must be in [0, 1), got ${p.minP}`],
    [p.repeatPenalty > 0, `repeatPenalty must be > 0 (1 = off), got ${p.repeatPenalty}`],
    [Number.isInteger(p.repeatLastN) && p.repeatLastN >= 0, `repeatLastN must be an integer >= 0, got ${p.repeatLastN}`],
  ];
  for (const [ok, message] of checks) if (!ok) throw new EdgespecError(message);
}

/** A seeded generator (xoshiro128**, seeded through splitmix32): doubles in [0, 1) with 53 random bits.
 * Not numpy's PCG64, so a JS run and a Python run with the same seed draw different samples; both
 * follow the same distribution, which is what the chi-square tests check. */
export class Rng {
  private s = new Uint32Array(4);

  constructor(seed: number) {
    let x = (seed >>> 0) ^ Math.floor(seed / 2 ** 32);
    for (let i = 0; i < 4; i++) {
      x = (x + 0x9e3779b9) >>> 0;
      let z = x;
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
      this.s[i] = (z ^ (z >>> 16)) >>> 0;
    }
  }

  private next32(): number {
    const s = this.s;
    const result = Math.imul(rotl(Math.imul(s[1], 5) >>> 0, 7), 9) >>> 0;
    const t = (s[1] << 9) >>> 0;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return result;
  }

  random(): number {
    return ((this.next32() >>> 5) * 67108864 + (this.next32() >>> 6)) / 9007199254740992;
  }
}

function rotl(x: number, k: number): number {
  return ((x << k) | (x >>> (32 - k))) >>> 0;
}

/** Repetition penalty (llama.cpp's rule) on a copy of the row: shrink the logits of recent tokens. */
export function penalize(row: Float32Array, recent: Int32Array, p: SamplingParams): Float32Array {
  if (p.repeatPenalty === 1 || p.repeatLastN === 0 || recent.length === 0) return row;
  const out = row.slice();
  const seen = new Set(recent.subarray(Math.max(0, recent.length - p.repeatLastN)));
  const penalty = Math.fround(p.repeatPenalty); // float32 arithmetic, as numpy does on float32 logits
  for (const t of seen) {
    const v = row[t];
    out[t] = v > 0 ? v / penalty : v * penalty;
  }
  return out;
}

/** Indices of the k largest values, largest first (ties: lower index first). O(n) plus insertions. */
function topIndices(row: ArrayLike<number>, k: number): Int32Array {
  const idx = new Int32Array(k);
  const val = new Float64Array(k);
  let filled = 0;
  for (let i = 0; i < row.length; i++) {
    const v = row[i];
    if (filled === k && v <= val[k - 1]) continue;
    let j = filled < k ? filled++ : k - 1;
    while (j > 0 && val[j - 1] < v) {
      val[j] = val[j - 1];
      idx[j] = idx[j - 1];
      j--;
    }
    val[j] = v;
    idx[j] = i;
  }
  return idx;
}

/** Dense probabilities (nVocab) after top-k, top-p, min-p and temperature, written into `out`. Needs
 * temperature > 0. */
export function tokenDistribution(row: ArrayLike<number>, p: SamplingParams, out: Float64Array): Float64Array {
  const n = row.length;
  let candidates: Int32Array;
  if (p.topK > 0 && p.topK < n) {
    candidates = topIndices(row, p.topK);
  } else {
    candidates = new Int32Array(n);
    for (let i = 0; i < n; i++) candidates[i] = i;
    candidates.sort((a, b) => (row[b] - row[a]) || (a - b));
  }
  let keep = candidates.length;
  const top0 = row[candidates[0]];
  if (p.topP < 1 || p.minP > 0) {
    const probs = new Float64Array(keep);
    let sum = 0;
    for (let i = 0; i < keep; i++) sum += probs[i] = Math.exp(row[candidates[i]] - top0);
    if (p.topP < 1) { // smallest prefix whose mass reaches topP
      let acc = 0;
      let i = 0;
      for (; i < keep; i++) {
        acc += probs[i] / sum;
        if (acc >= p.topP) break;
      }
      keep = Math.min(keep, i + 1);
    }
    if (p.minP > 0) { // sorted, so the kept set is a prefix
      let count = 0;
      for (let i = 0; i < probs.length; i++) if (probs[i] >= p.minP * probs[0]) count++;
      keep = Math.min(keep, Math.max(1, count));
    }
  }
  out.fill(0);
  let total = 0;
  for (let i = 0; i < keep; i++) {
    const w = Math.exp((row[candidates[i]] - top0) / p.temperature);
    out[candidates[i]] = w;
    total += w;
  }
  for (let i = 0; i < keep; i++) out[candidates[i]] /= total;
  return out;
}

/** One token from a (possibly unnormalised) non-negative vector: inverse CDF at a uniform draw. */
export function sample(probs: ArrayLike<number>, rng: Rng): number {
  let total = 0;
  for (let i = 0; i < probs.length; i++) total += probs[i];
  const u = rng.random() * total;
  let acc = 0;
  for (let i = 0; i < probs.length; i++) {
    acc += probs[i];
    if (acc > u) return i;
  }
  return probs.length - 1;
}

export function argmax(row: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
  return best;
}

/** Processes rows and draws tokens with one seeded generator, so a run can be reproduced. */
export class Sampler {
  readonly rng: Rng;

  constructor(readonly params: SamplingParams, readonly seed: number) {
    checkSampling(params);
    this.rng = new Rng(seed);
  }

  get greedy(): boolean {
    return this.params.temperature === 0;
  }

  /**
   * Process the m = logits.length / nVocab rows of the last positions of context + continuation: row j
   * is the prediction after context + continuation[:len(continuation) - m + 1 + j]. Greedy returns the
   * (penalised) logits, since argmax is all it needs; sampling returns probabilities (Float64Array).
   */
  rows(logits: Float32Array, nVocab: number, context: Int32Array, continuation: Int32Array): Float32Array | Float64Array {
    const p = this.params;
    const penalised = p.repeatPenalty !== 1 && p.repeatLastN > 0;
    if (this.greedy && !penalised) return logits;
    const m = logits.length / nVocab;
    let history = continuation;
    if (penalised) {
      const recent = context.subarray(Math.max(0, context.length - p.repeatLastN));
      history = new Int32Array(recent.length + continuation.length);
      history.set(recent);
      history.set(continuation, recent.length);
    }
    const first = history.length - m + 1;
    const out = this.greedy ? new Float32Array(logits.length) : new Float64Array(logits.length);
    for (let j = 0; j < m; j++) {
      let row = logits.subarray(j * nVocab, (j + 1) * nVocab);
      if (penalised) row = penalize(row, history.subarray(0, first + j), p);
      if (out instanceof Float32Array) out.set(row, j * nVocab);
      else tokenDistribution(row, p, out.subarray(j * nVocab, (j + 1) * nVocab));
    }
    return out;
  }

  /** A token from one processed row: argmax when greedy, a draw otherwise. */
  pick(row: ArrayLike<number>): number {
    return this.greedy ? argmax(row) : sample(row, this.rng);
  }
}
