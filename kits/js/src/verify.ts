/**
 * Verification: which drafted tokens the target accepts, and the token it emits after them
 * (edgespec/verify.py). Greedy emits exactly the target's argmax sequence; rejection sampling
 * (Leviathan et al. 2023; Chen et al. 2023) emits tokens distributed exactly as the target's own
 * sampling. Each takes the k drafted tokens, the draft's k processed rows (null: a deterministic
 * drafter) and the target's k + 1 processed rows (row i predicts the token after draft[:i]), as flat
 * arrays of nVocab-wide rows, and returns [nAccepted, nextToken].
 */

import { argmax, Rng, sample } from "./sampling.js";

export type Verifier = (draft: Int32Array, draftProbs: Float64Array | null, targetRows: Float32Array | Float64Array,
                        nVocab: number, rng: Rng) => [number, number];

function row(rows: Float32Array | Float64Array, i: number, nVocab: number) {
  return rows.subarray(i * nVocab, (i + 1) * nVocab);
}

/** Accept while the draft equals the target's argmax; then emit the target's own token. */
export const acceptGreedy: Verifier = (draft, _q, rows, nVocab) => {
  for (let i = 0; i < draft.length; i++) {
    const token = argmax(row(rows, i, nVocab));
    if (token !== draft[i]) return [i, token];
  }
  return [draft.length, argmax(row(rows, draft.length, nVocab))];
};

/**
 * Rejection sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)). On the first rejection
 * draw from the residual max(0, p_i - q_i) normalised; when every token passes, draw the bonus token
 * from p_k. No draft rows means a one-hot q (prompt lookup): acceptance is p_i(x_i) and the residual is
 * p_i without x_i.
 */
export const acceptSampling: Verifier = (draft, q, rows, nVocab, rng) => {
  const k = draft.length;
  const u = new Float64Array(k);
  for (let i = 0; i < k; i++) u[i] = rng.random(); // drawn together, as verify.py does
  for (let i = 0; i < k; i++) {
    const p = rows[i * nVocab + draft[i]];
    const qi = q === null ? 1 : q[i * nVocab + draft[i]];
    if (u[i] * qi < p) continue; // u < p/q, written without dividing by q
    const residual = new Float64Array(row(rows, i, nVocab));
    if (q === null) {
      residual[draft[i]] = 0;
    } else {
      const qrow = row(q, i, nVocab);
      for (let j = 0; j < nVocab; j++) residual[j] = Math.max(residual[j] - qrow[j], 0);
    }
    let mass = 0;
    for (let j = 0; j < nVocab; j++) mass += residual[j];
    // p <= q everywhere can only happen through rounding: fall back to p
    return [i, sample(mass > 0 ? residual : row(rows, i, nVocab), rng)];
  }
  return [k, sample(row(rows, k, nVocab), rng)];
};
