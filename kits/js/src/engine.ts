/**
 * The engine: prompts in, tokens and text out, through one speculative loop (edgespec/engine.py).
 * Each round reads like the papers' pseudocode:
 *
 *     k          = min(draftMax, remaining - 1)   // 0 is plain decoding: the same loop, no draft
 *     draft      = drafter.propose(context, k)    // x_1..x_k (and q_1..q_k when sampling)
 *     rows       = target.decode([last] + draft)  // p_1..p_{k+1} in one pass
 *     n, token   = verify(draft, q, p)            // accept a prefix, then correct or add a bonus token
 *     target.truncate(...); commit(draft[:n] + [token])
 *
 * Invariant between rounds: the target's KV holds every committed token but the last one, which is fed
 * with the next draft; the draft model keeps the same invariant. A new generation keeps the KV of the
 * prefix it shares with the previous one (prompt caching across calls).
 */

import { ContextOverflowError, EdgespecError } from "./errors.js";
import { type Draft, type Drafter, DraftModelDrafter, EMPTY_DRAFT, PromptLookupDrafter, syncTo } from "./drafters.js";
import type { OnnxModel } from "./model.js";
import { checkSampling, DEFAULT_SAMPLING, Sampler, type SamplingParams } from "./sampling.js";
import { GenerationStats } from "./stats.js";
import { acceptGreedy, acceptSampling, type Verifier } from "./verify.js";
import { checkVocabCompatible, type ChatMessage, type Vocab } from "./vocab.js";

export type Mode = "ar" | "lookup" | "draft";
export const MODES: readonly Mode[] = ["ar", "lookup", "draft"];
export const DEFAULT_DRAFT_MAX = 4; // tokens drafted per round by lookup and the draft model, as in Python

export interface GenerationConfig {
  maxTokens: number;
  temperature: number; // 0 = greedy
  topK: number;
  topP: number;
  minP: number;
  repeatPenalty: number;
  seed?: number; // undefined = a fresh seed, reported in the stats
  stop: string[];
  mode: Mode; // ar = plain decoding, lookup = prompt lookup, draft = the bundle's draft model
  draftMax?: number; // tokens drafted per round (default 4)
  raw: boolean; // true: the prompt is used as is, no chat template
}

/** llama.cpp's sampling defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), as the Python engine. */
export const DEFAULT_CONFIG: GenerationConfig = {
  maxTokens: 256, temperature: DEFAULT_SAMPLING.temperature, topK: DEFAULT_SAMPLING.topK,
  topP: DEFAULT_SAMPLING.topP, minP: DEFAULT_SAMPLING.minP, repeatPenalty: 1, stop: [], mode: "ar", raw: false,
};

export interface GenerationResult {
  text: string;
  tokens: number[];
  promptTokens: number;
  finishReason: "stop" | "length";
  stats: GenerationStats;
}

export type Prompt = string | ChatMessage[];

function resolveConfig(partial: Partial<GenerationConfig>): GenerationConfig {
  const c: GenerationConfig = { ...DEFAULT_CONFIG, ...partial, stop: [...(partial.stop ?? DEFAULT_CONFIG.stop)] };
  if (!(Number.isInteger(c.maxTokens) && c.maxTokens >= 1)) {
    throw new EdgespecError(`maxTokens must be an integer >= 1, got ${c.maxTokens}`);
  }
  if (c.draftMax !== undefined && !(Number.isInteger(c.draftMax) && c.draftMax >= 0)) {
    throw new EdgespecError(`draftMax must be an integer >= 0, got ${c.draftMax}`);
  }
  if (!MODES.includes(c.mode)) throw new EdgespecError(`unknown mode ${JSON.stringify(c.mode)}; use ${MODES.join(", ")}`);
  if (c.stop.some((s) => typeof s !== "string" || !s)) throw new EdgespecError("stop strings must not be empty");
  if (c.seed !== undefined && !(Number.isSafeInteger(c.seed) && c.seed >= 0)) {
    throw new EdgespecError(`seed must be a non-negative integer, got ${c.seed}`);
  }
  checkSampling(samplingOf(c));
  return c;
}

function samplingOf(c: GenerationConfig): SamplingParams {
  return { temperature: c.temperature, topK: c.topK, topP: c.topP, minP: c.minP, repeatPenalty: c.repeatPenalty,
    repeatLastN: DEFAULT_SAMPLING.repeatLastN };
}

/** Everything one generation carries between rounds. */
export interface State {
  context: Int32Array; // prompt then emitted tokens; capacity nPrompt + maxTokens
  n: number; // tokens committed
  nPrompt: number;
  maxTokens: number;
  sampler: Sampler;
  stats: GenerationStats;
  finishReason: "stop" | "length" | null;
  tStart: number;
}

/** What one generation runs with: its state, its drafter and the most tokens drafted per round. */
export interface Round {
  state: State;
  drafter: Drafter | null;
  kMax: number;
}

const now = () => performance.now() / 1000;

/**
 * A target model, optionally a draft model, the bundle's tokenizer, and the speculative loop. One
 * generation at a time (each model holds one KV sequence): a second call waits for the first to end.
 */
export class Engine {
  readonly drafters: Map<string, Drafter> = new Map();
  private lock: Promise<void> = Promise.resolve();

  constructor(readonly target: OnnxModel, readonly vocab: Vocab, readonly draft: OnnxModel | null = null,
              draftVocab: Vocab | null = null) {
    if (draft && draftVocab) checkVocabCompatible(vocab, draftVocab);
    this.drafters.set("lookup", new PromptLookupDrafter());
    if (draft) this.drafters.set("draft", new DraftModelDrafter(draft));
  }

  async close(): Promise<void> {
    await this.target.close();
    await this.draft?.close();
  }

  /** Token ids for a prompt: a string (chat-templated unless raw) or chat messages. */
  promptTokens(prompt: Prompt, raw = false): number[] {
    if (typeof prompt === "string") {
      if (!prompt.trim()) throw new EdgespecError("the prompt is empty; give some text to continue or answer");
      if (raw) return this.vocab.tokenize(prompt, true, false);
      prompt = [{ role: "user", content: prompt }];
    }
    const text = this.vocab.renderChat(prompt);
    const bos = this.vocab.info.bos === null ? "" : this.vocab.tokenText(this.vocab.info.bos);
    const addBos = !(bos && text.startsWith(bos)); // templates often write BOS themselves
    return this.vocab.tokenize(text, addBos, true);
  }

  /** Text pieces as they are produced (an async iterator); `.result` holds the whole result at the end. */
  stream(prompt: Prompt, config: Partial<GenerationConfig> = {}): GenerationStream {
    const c = resolveConfig(config);
    return new GenerationStream(this, this.promptTokens(prompt, c.raw), c, null);
  }

  async generate(prompt: Prompt, config: Partial<GenerationConfig> = {}): Promise<GenerationResult> {
    return this.stream(prompt, config).collect();
  }

  /** Token ids in, result out: no template, no stop strings. `verifier` replaces the acceptance rule
   * (tests use it to show the statistical check has power). */
  async generateTokens(promptIds: ArrayLike<number>, config: Partial<GenerationConfig> = {},
                       verifier: Verifier | null = null): Promise<GenerationResult> {
    return new GenerationStream(this, Array.from(promptIds), resolveConfig({ ...config, stop: [] }), verifier).collect();
  }

  /** Acquire the engine for a stream that releases it when it ends. */
  async acquire(): Promise<() => void> {
    const previous = this.lock;
    let release!: () => void;
    this.lock = new Promise<void>((r) => (release = r));
    await previous;
    return release;
  }

  // -- the speculative loop ----------------------------------------------------------------------

  private drafterFor(c: GenerationConfig): [Drafter | null, number] {
    if (c.mode === "ar") return [null, 0];
    const drafter = this.drafters.get(c.mode);
    if (!drafter) {
      throw new EdgespecError("mode draft needs a draft model, and this bundle has none; use mode lookup or ar, " +
        "or export the bundle with --draft or --self-draft");
    }
    const k = c.draftMax ?? DEFAULT_DRAFT_MAX;
    return k > 0 ? [drafter, k] : [null, 0];
  }

  /** Check the budget, then prefill target and drafter (all of it counts as time to first token). */
  async start(promptIds: number[], c: GenerationConfig, drafter: Drafter | null): Promise<State> {
    const nPrompt = promptIds.length;
    if (nPrompt === 0) throw new EdgespecError("the prompt has no tokens; give some text");
    if (nPrompt + c.maxTokens > this.target.nCtx) {
      throw new ContextOverflowError(`prompt (${nPrompt} tokens) plus maxTokens (${c.maxTokens}) exceeds the context ` +
        `of ${this.target.nCtx} tokens; use a shorter prompt, fewer maxTokens or a larger nCtx`);
    }
    for (const t of promptIds) {
      if (!(Number.isInteger(t) && t >= 0 && t < this.target.nVocab)) {
        throw new EdgespecError(`prompt token ${t} is not an id of this vocabulary (0..${this.target.nVocab - 1})`);
      }
    }
    const seed = c.seed ?? Math.floor(Math.random() * 2 ** 52);
    const mode = c.mode;
    const state: State = {
      context: new Int32Array(nPrompt + c.maxTokens), n: nPrompt, nPrompt, maxTokens: c.maxTokens,
      sampler: new Sampler(samplingOf(c), seed), stats: new GenerationStats(mode, seed), finishReason: null,
      tStart: now(),
    };
    state.context.set(promptIds);
    state.stats.promptTokens = nPrompt;
    const prompt = state.context.subarray(0, nPrompt);
    const kept = syncTo(this.target, prompt.subarray(0, nPrompt - 1)); // reuse the KV of a shared prefix
    if (kept < nPrompt - 1) await this.target.decode(prompt.subarray(kept, nPrompt - 1), 0);
    state.stats.cachedTokens = kept;
    state.stats.prefilledTokens = nPrompt - 1 - kept;
    if (drafter) await drafter.prepare(prompt);
    state.stats.prefillS = now() - state.tStart;
    return state;
  }

  private async draftStep(s: State, drafter: Drafter | null, k: number): Promise<Draft> {
    if (!drafter || k <= 0) return EMPTY_DRAFT;
    const t = now();
    const draft = await drafter.propose(s.context.subarray(0, s.n), k, s.sampler);
    s.stats.draftS += now() - t;
    return draft;
  }

  /** One target pass over the last committed token and the draft; accept a prefix. */
  private async verifyStep(s: State, draft: Draft, verifier: Verifier | null): Promise<[number, number]> {
    const t = now();
    const committed = s.context.subarray(0, s.n);
    const unseen = committed.subarray(this.target.nPast);
    const fed = new Int32Array(unseen.length + draft.tokens.length);
    fed.set(unseen);
    fed.set(draft.tokens, unseen.length);
    const V = this.target.nVocab;
    const logits = await this.target.decode(fed, draft.tokens.length + 1);
    const rows = s.sampler.rows(logits, V, committed, draft.tokens);
    const verify = verifier ?? (s.sampler.greedy ? acceptGreedy : acceptSampling);
    const [nAccepted, token] = verify(draft.tokens, draft.probs, rows, V, s.sampler.rng);
    this.target.truncate(s.n + nAccepted); // keep the last token and the accepted drafts
    s.stats.verifyS += now() - t;
    return [nAccepted, token];
  }

  /** Commit the accepted tokens, applying end-of-generation and length stops. Returns what was added. */
  private acceptStep(s: State, draft: Draft, nAccepted: number, token: number, drafterName: string): Int32Array {
    s.stats.recordRound(drafterName, draft.tokens.length, nAccepted, s.n);
    let added = new Int32Array(nAccepted + 1);
    added.set(draft.tokens.subarray(0, nAccepted));
    added[nAccepted] = token;
    const eog = this.vocab.info.eog;
    for (let i = 0; i < added.length; i++) {
      if (eog.has(added[i])) {
        added = added.subarray(0, i);
        s.finishReason = "stop";
        break;
      }
    }
    const remaining = s.maxTokens - (s.n - s.nPrompt);
    if (added.length >= remaining) {
      added = added.subarray(0, remaining);
      s.finishReason = s.finishReason ?? "length";
    }
    s.context.set(added, s.n);
    s.n += added.length;
    s.stats.generated += added.length;
    if (s.stats.ttftS === 0 && added.length) s.stats.ttftS = now() - s.tStart;
    return added;
  }

  /** Choose the drafter, then prefill: the state `rounds` continues from. */
  async begin(promptIds: number[], c: GenerationConfig): Promise<Round> {
    const [drafter, kMax] = this.drafterFor(c);
    return { state: await this.start(promptIds, c, drafter), drafter, kMax };
  }

  /** The loop: yields the tokens each round adds until a stop (the state then holds the result). */
  async *rounds(r: Round, verifier: Verifier | null): AsyncGenerator<Int32Array, void> {
    const { state: s, drafter, kMax } = r;
    const tDecode = now();
    try {
      while (s.finishReason === null) {
        // The verify pass always emits one token of its own, so drafting past remaining - 1 is waste.
        const k = Math.min(kMax, s.maxTokens - (s.n - s.nPrompt) - 1);
        const draft = await this.draftStep(s, drafter, k);
        const [nAccepted, token] = await this.verifyStep(s, draft, verifier);
        const name = drafter && draft.tokens.length ? drafter.name : "none";
        const added = this.acceptStep(s, draft, nAccepted, token, name);
        if (added.length) yield added;
      }
    } finally {
      s.stats.decodeS = now() - tDecode;
    }
  }
}

/** Token bytes in, text pieces out: UTF-8 safe (a character split over tokens waits for its last byte)
 * and holding back text that could still become a stop string. */
export class TextAssembler {
  text = "";
  stopped = false;
  private sent = 0;
  private readonly overlap: number;
  private readonly decoder = new TextDecoder("utf-8");

  constructor(readonly stops: string[] = []) {
    this.overlap = Math.max(1, ...stops.map((s) => s.length)) - 1; // a stop may begin this far back
  }

  feed(data: Uint8Array, final = false): string {
    this.text += this.decoder.decode(data, { stream: !final });
    const from = Math.max(0, this.sent - this.overlap);
    const hits = this.stops.map((s) => this.text.indexOf(s, from)).filter((i) => i >= 0);
    if (hits.length) {
      this.text = this.text.slice(0, Math.min(...hits));
      this.stopped = true;
      final = true;
    }
    const ready = final ? this.text.length : this.text.length - this.undecided();
    const piece = ready > this.sent ? this.text.slice(this.sent, ready) : "";
    this.sent = Math.max(this.sent, ready);
    return piece;
  }

  /** Length of the longest tail of the text that could still grow into a stop string. */
  private undecided(): number {
    let best = 0;
    for (const s of this.stops) {
      for (let n = 1; n < s.length; n++) if (n > best && this.text.endsWith(s.slice(0, n))) best = n;
    }
    return best;
  }
}

/** The text pieces of one generation as an async iterator; `result` is set once iteration ends. */
export class GenerationStream implements AsyncIterable<string> {
  result: GenerationResult | null = null;
  private used = false;

  constructor(readonly engine: Engine, readonly promptIds: number[], readonly config: GenerationConfig,
              readonly verifier: Verifier | null) {}

  async *[Symbol.asyncIterator](): AsyncIterator<string> {
    if (this.used) throw new EdgespecError("a generation stream can be iterated once; start a new one");
    this.used = true;
    const release = await this.engine.acquire();
    try {
      const text = new TextAssembler(this.config.stop);
      const round = await this.engine.begin(this.promptIds, this.config);
      const loop = this.engine.rounds(round, this.verifier);
      try {
        for await (const added of loop) {
          const piece = text.feed(concatBytes(Array.from(added, (t) => this.engine.vocab.tokenBytes(t))));
          if (piece) yield piece;
          if (text.stopped) break;
        }
      } finally {
        await loop.return();
      }
      if (!text.stopped) {
        const piece = text.feed(new Uint8Array(0), true);
        if (piece) yield piece;
      }
      const s = round.state;
      this.result = { text: text.text, tokens: Array.from(s.context.subarray(s.nPrompt, s.n)),
        promptTokens: s.nPrompt, finishReason: text.stopped ? "stop" : s.finishReason ?? "stop", stats: s.stats };
    } finally {
      release();
    }
  }

  /** Iterate to the end and return the result. */
  async collect(): Promise<GenerationResult> {
    for await (const _ of this) {
      // pieces are assembled into result.text
    }
    return this.result!;
  }
}

function concatBytes(parts: Uint8Array[]): Uint8Array {
  if (parts.length === 1) return parts[0];
  const out = new Uint8Array(parts.reduce((s, p) => s + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
