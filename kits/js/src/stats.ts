/**
 * Generation statistics with vLLM's definitions (edgespec/stats.py), so numbers compare across tools:
 * acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / rounds (tokens emitted
 * per target pass); per-position acceptance; time split into draft, verify and other. Prefill of target
 * and draft belongs to ttftS, never to decodeS.
 */

export class GenerationStats {
  promptTokens = 0;
  cachedTokens = 0; // prompt tokens whose KV was reused from the previous generation
  prefilledTokens = 0; // prompt tokens evaluated at prefill (the last one goes with the first round)
  generated = 0;
  drafted = 0;
  accepted = 0;
  rounds = 0; // target verification passes
  prefillS = 0;
  ttftS = 0; // start to first emitted token, prefill included
  decodeS = 0; // end of prefill to the last token
  draftS = 0;
  verifyS = 0;
  draftedAt: number[] = [];
  acceptedAt: number[] = [];
  chosen: Record<string, number> = {}; // "drafter:k" -> rounds
  passesByRows: Record<string, number> = {}; // rows a pass fed (drafted + 1) -> passes (prices a run by a cost curve)
  heldByRows: Record<string, number> = {}; // rows -> the tokens those passes followed, summed (their price grows with them)

  constructor(readonly mode: string, readonly seed: number) {}

  recordRound(drafter: string, nDrafted: number, nAccepted: number, held = 0): void {
    this.rounds += 1;
    this.drafted += nDrafted;
    this.accepted += nAccepted;
    const key = `${drafter}:${nDrafted}`;
    this.chosen[key] = (this.chosen[key] ?? 0) + 1;
    const rows = String(nDrafted + 1);
    this.passesByRows[rows] = (this.passesByRows[rows] ?? 0) + 1;
    this.heldByRows[rows] = (this.heldByRows[rows] ?? 0) + held;
    while (this.draftedAt.length < nDrafted) {
      this.draftedAt.push(0);
      this.acceptedAt.push(0);
    }
    for (let i = 0; i < nDrafted; i++) this.draftedAt[i] += 1;
    for (let i = 0; i < nAccepted; i++) this.acceptedAt[i] += 1;
  }

  get acceptanceRate(): number {
    return this.drafted ? this.accepted / this.drafted : 0;
  }

  get meanAcceptedLength(): number {
    return this.rounds ? 1 + this.accepted / this.rounds : 0;
  }

  get tokensPerS(): number {
    return this.decodeS > 0 ? this.generated / this.decodeS : 0;
  }

  get otherS(): number {
    return Math.max(0, this.decodeS - this.draftS - this.verifyS);
  }

  /** The same keys as the Python engine's `GenerationStats.to_dict()` (memory fields are not measured here). */
  toDict(): Record<string, unknown> {
    const r = (x: number, d: number) => Math.round(x * 10 ** d) / 10 ** d;
    return {
      mode: this.mode,
      prompt_tokens: this.promptTokens,
      cached_tokens: this.cachedTokens,
      prefilled_tokens: this.prefilledTokens,
      generated: this.generated,
      drafted: this.drafted,
      accepted: this.accepted,
      forced: 0, // tokens a grammar forced: the kit has no constraints (Python's edgespec.structured)
      forced_accepted: 0,
      acceptance_rate: r(this.acceptanceRate, 4),
      mean_accepted_length: r(this.meanAcceptedLength, 4),
      per_position_acceptance: this.draftedAt.map((d, i) => r(this.acceptedAt[i] / Math.max(d, 1), 4)),
      rounds: this.rounds,
      tree_rounds: 0,
      ttft_s: r(this.ttftS, 6),
      prefill_s: r(this.prefillS, 6),
      decode_s: r(this.decodeS, 6),
      draft_s: r(this.draftS, 6),
      verify_s: r(this.verifyS, 6),
      other_s: r(this.otherS, 6),
      tokens_per_s: r(this.tokensPerS, 3),
      chosen: { ...this.chosen },
      passes_by_rows: { ...this.passesByRows },
      held_by_rows: { ...this.heldByRows },
      seed: this.seed,
      predicted_peak_bytes: null,
      peak_rss_bytes: null,
      peak_gpu_bytes: null,
      memory_events: [],
    };
  }

  summary(): string {
    let line = `${this.generated} tokens in ${this.decodeS.toFixed(2)}s (${this.tokensPerS.toFixed(1)} tok/s), ` +
      `ttft ${(this.ttftS * 1000).toFixed(0)} ms, prompt ${this.promptTokens} tokens, mode ${this.mode}`;
    if (this.drafted) {
      line += `, accepted ${this.accepted}/${this.drafted} (${Math.round(this.acceptanceRate * 100)}%), ` +
        `${this.meanAcceptedLength.toFixed(2)} tokens/pass`;
    }
    return line;
  }
}
