/**
 * One exported decoder and the KV cache of one token sequence, over onnxruntime-common only (the
 * Node, web and React Native packages inject their `InferenceSession` and `Tensor`). The JS twin of
 * runtimes/onnxrt.py: the graph's interface is input_ids, attention_mask, position_ids and
 * past_key_values.{i}.key/.value (1, n_head_kv, past, head_dim) in; logits (1, t, n_vocab) and
 * present.{i}.key/.value = concat(past, new) out.
 *
 * Memory. KV: the present tensors of the last run are kept as the next run's past: 2 x n_layer x
 * n_head_kv x n_past x head_dim x 4 bytes. During a run there are up to three copies: the past, ORT's
 * present, and the present copied out into a JS array (onnxruntime-node and -web copy every output; the
 * web backend also copies the inputs into the WebAssembly heap). Logits: the graph returns t x n_vocab floats per run;
 * a long prompt runs `prefillChunk` tokens at a time (default 64, as the Python runtime), so no block
 * of more than prefillChunk x n_vocab floats ever exists, and only the rows asked for are copied out.
 * Rolling back is lazy: `truncate(n)` only moves n_past; the next run slices the first n positions out
 * of the held tensors (one copy of n rows, as the Python runtime's truncate).
 */

import type * as OrtCommon from "onnxruntime-common";
import { BundleError, ContextOverflowError, EdgespecError } from "./errors.js";

/** The part of an onnxruntime package the kit uses: onnxruntime-node, -web and -react-native all export it. */
export type Ort = Pick<typeof OrtCommon, "InferenceSession" | "Tensor">;
type Session = OrtCommon.InferenceSession;
type Tensor = OrtCommon.Tensor;
type KVData = Float32Array | Uint16Array;

export interface ModelOptions {
  nCtx: number; // context length (tokens)
  prefillChunk: number; // most tokens per graph run
  sessionOptions?: OrtCommon.InferenceSession.SessionOptions;
}

export class OnnxModel {
  readonly nLayer: number;
  readonly nHeadKv: number;
  readonly headDim: number;
  readonly nVocab: number;
  private readonly kvIn: string[];
  private readonly kvOut: string[];
  private readonly kvType: "float32" | "float16";
  private readonly intType: "int64" | "int32";
  private readonly hasPositions: boolean;
  private past: KVData[]; // per kv tensor: (1, h, pastLen, d) data
  private pastLen = 0; // positions the held tensors cover (>= nPast after a lazy truncate)
  private held: Int32Array; // ids whose KV is held
  // attention_mask (all ones) and position_ids (0..nCtx-1) for every call are views of these, so a call
  // allocates nothing that grows with the context besides the graph's own outputs.
  private readonly ones: BigInt64Array | Int32Array;
  private readonly positions: BigInt64Array | Int32Array;
  private nHeld = 0;
  private closed = false;
  nRuns = 0; // graph runs so far
  nRunTokens = 0; // tokens they evaluated
  maxRunTokens = 0; // the most tokens in one run: its logits block was maxRunTokens x nVocab floats

  private constructor(private readonly ort: Ort, private readonly session: Session, readonly name: string,
                      readonly options: ModelOptions, nVocabHint: number) {
    const inputs = new Map(session.inputMetadata.map((m) => [m.name, m]));
    const outputs = new Map(session.outputMetadata.map((m) => [m.name, m]));
    this.kvIn = session.inputNames.filter((n) => n.startsWith("past_key_values."));
    const missing = ["input_ids", "attention_mask"].filter((n) => !inputs.has(n))
      .concat(outputs.has("logits") ? [] : ["logits"]);
    if (this.kvIn.length === 0 || missing.length) {
      const what = this.kvIn.length === 0 ? "no past_key_values.* inputs" : `no ${missing.join(", ")}`;
      throw new BundleError(`${name} is not a decoder with past key/values (${what}); export it with ` +
        "`edgespec export --format onnx`");
    }
    this.kvOut = this.kvIn.map((n) => n.replace("past_key_values.", "present."));
    if (this.kvOut.some((n) => !outputs.has(n))) {
      throw new BundleError(`${name}: some past_key_values inputs have no present output; export it again`);
    }
    const kv = inputs.get(this.kvIn[0])!;
    const shape = kv.isTensor ? kv.shape : [];
    if (typeof shape[1] !== "number" || typeof shape[3] !== "number") {
      throw new BundleError(`${name}: past key/value inputs of unknown shape [${shape.join(", ")}]; only ` +
        "(batch, n_head_kv, past, head_dim) caches with fixed heads are supported");
    }
    this.nHeadKv = shape[1];
    this.headDim = shape[3];
    this.nLayer = this.kvIn.length / 2;
    this.kvType = kv.isTensor && kv.type === "float16" ? "float16" : "float32";
    const ids = inputs.get("input_ids")!;
    this.intType = ids.isTensor && ids.type === "int32" ? "int32" : "int64";
    this.hasPositions = inputs.has("position_ids");
    const logits = outputs.get("logits")!;
    const width = logits.isTensor ? logits.shape[logits.shape.length - 1] : undefined;
    this.nVocab = typeof width === "number" ? width : nVocabHint;
    if (!(this.nVocab > 0)) {
      throw new BundleError(`${name}: the logits width is not fixed and config.json has no vocab_size`);
    }
    this.past = this.kvIn.map(() => this.emptyKV(0));
    this.held = new Int32Array(options.nCtx);
    if (this.intType === "int32") {
      this.ones = new Int32Array(options.nCtx).fill(1);
      this.positions = Int32Array.from({ length: options.nCtx }, (_, i) => i);
    } else {
      this.ones = new BigInt64Array(options.nCtx).fill(1n);
      this.positions = BigInt64Array.from({ length: options.nCtx }, (_, i) => BigInt(i));
    }
  }

  /** Load a model from bytes or (Node, React Native) a file path. */
  static async load(ort: Ort, model: Uint8Array | string, name: string, options: ModelOptions,
                    nVocabHint = 0): Promise<OnnxModel> {
    let session: Session;
    try {
      session = typeof model === "string" // two overloads of create, one call each
        ? await ort.InferenceSession.create(model, options.sessionOptions ?? {})
        : await ort.InferenceSession.create(model, options.sessionOptions ?? {});
    } catch (err) {
      const reason = String((err as Error)?.message ?? err).split("\n")[0].slice(0, 200);
      throw new BundleError(`ONNX Runtime cannot load ${name} (${reason}): the file is truncated, corrupt or not ` +
        "an ONNX model; export the bundle again with `edgespec export --format onnx`");
    }
    return new OnnxModel(ort, session, name, options, nVocabHint);
  }

  get nCtx(): number {
    return this.options.nCtx;
  }

  get nPast(): number {
    return this.nHeld;
  }

  /** The ids whose KV is held (a view: copy it to keep it). */
  get tokens(): Int32Array {
    return this.held.subarray(0, this.nHeld);
  }

  /** Append tokens; return float32 logits of the last `nLogits` of them, row-major (nLogits x nVocab). */
  async decode(tokens: ArrayLike<number>, nLogits: number): Promise<Float32Array> {
    const n = tokens.length;
    if (n === 0 || nLogits < 0 || nLogits > n) {
      throw new RangeError(`decode needs at least one token and 0 <= nLogits <= ${n}`);
    }
    if (this.nHeld + n > this.nCtx) {
      throw new ContextOverflowError(`the context of ${this.nCtx} tokens is full (${this.nHeld} held, ${n} more ` +
        "asked); use a larger nCtx or a shorter prompt");
    }
    if (this.closed) throw new EdgespecError(`${this.name} was closed; it can no longer evaluate tokens`);
    const V = this.nVocab;
    const out = new Float32Array(nLogits * V);
    const first = n - nLogits; // index of the first token whose logits are asked for
    const chunk = this.options.prefillChunk;
    for (let start = 0; start < n; start += chunk) {
      const m = Math.min(chunk, n - start);
      const logits = await this.run(tokens, start, m);
      const lo = Math.max(first - start, 0);
      if (lo < m) out.set(logits.subarray(lo * V, m * V), (start + lo - first) * V);
    }
    return out;
  }

  /** Drop the KV of every position >= n (the copy happens at the next run). */
  truncate(n: number): void {
    if (!(n >= 0 && n <= this.nHeld)) throw new RangeError(`cannot truncate to ${n}: ${this.nHeld} positions held`);
    this.nHeld = n;
  }

  /** Bytes of KV held now (the present tensors kept as the next past). */
  kvBytes(): number {
    return this.past.reduce((s, t) => s + t.byteLength, 0);
  }

  async close(): Promise<void> {
    if (!this.closed) {
      this.closed = true;
      await this.session.release();
    }
  }

  private emptyKV(len: number): KVData {
    const size = this.nHeadKv * len * this.headDim;
    return this.kvType === "float16" ? new Uint16Array(size) : new Float32Array(size);
  }

  /** The first n positions of a (1, h, pastLen, d) tensor, laid out as (1, h, n, d). */
  private slice(data: KVData, n: number): KVData {
    const h = this.nHeadKv, d = this.headDim, rowsIn = this.pastLen;
    const out = this.emptyKV(n);
    for (let head = 0; head < h; head++) {
      out.set(data.subarray(head * rowsIn * d, (head * rowsIn + n) * d) as never, head * n * d);
    }
    return out;
  }

  private intTensor(data: BigInt64Array | Int32Array, dims: number[]): Tensor {
    return data instanceof Int32Array ? new this.ort.Tensor("int32", data, dims) : new this.ort.Tensor("int64", data, dims);
  }

  private async run(tokens: ArrayLike<number>, start: number, t: number): Promise<Float32Array> {
    if (this.pastLen > this.nHeld) { // a truncate happened: re-lay the kept rows out contiguously
      this.past = this.past.map((data) => this.slice(data, this.nHeld));
      this.pastLen = this.nHeld;
    }
    const p = this.nHeld, h = this.nHeadKv, d = this.headDim;
    const ids = new Int32Array(t);
    for (let i = 0; i < t; i++) ids[i] = tokens[start + i];
    const inputIds = this.intType === "int32" ? ids : BigInt64Array.from(ids, (x) => BigInt(x));
    const feeds: Record<string, Tensor> = {
      input_ids: this.intTensor(inputIds, [1, t]),
      attention_mask: this.intTensor(this.ones.subarray(0, p + t), [1, p + t]),
    };
    if (this.hasPositions) feeds.position_ids = this.intTensor(this.positions.subarray(p, p + t), [1, t]);
    this.kvIn.forEach((name, i) => {
      feeds[name] = new this.ort.Tensor(this.kvType, this.past[i], [1, h, p, d]);
    });
    let results: OrtCommon.InferenceSession.OnnxValueMapType;
    try {
      results = await this.session.run(feeds);
    } catch (err) { // the held KV is untouched
      const reason = String((err as Error)?.message ?? err).split("\n")[0].slice(0, 200);
      throw new EdgespecError(`ONNX Runtime failed evaluating ${t} tokens at position ${p}: ${reason}`);
    }
    this.past = this.kvOut.map((name) => results[name].data as KVData);
    this.pastLen = p + t;
    this.held.set(ids, p);
    this.nHeld = p + t;
    this.nRuns += 1;
    this.nRunTokens += t;
    this.maxRunTokens = Math.max(this.maxRunTokens, t);
    return results.logits.data as Float32Array;
  }
}
