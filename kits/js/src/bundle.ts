/**
 * Opening an edgespec bundle (exporters/bundle.py writes it): the manifest `edgespec.json` decides which
 * ONNX files run (formats.onnx target / draft, by quantization) and which tokenizer (tokenizer.files).
 * Every file is checked against the manifest's size before it is used, so a missing or truncated file
 * is one clear error, not an ONNX Runtime stack trace; `verify: true` also checks sha256.
 *
 * Files come through a `BundleSource`: the Node entry point reads the file system, the web entry point
 * fetches URLs, a React Native app passes its own reader.
 */

import { BundleError } from "./errors.js";
import { OnnxModel, type Ort } from "./model.js";
import { checkVocabCompatible, type TokenizerFiles, Vocab } from "./vocab.js";

export const MANIFEST = "edgespec.json";
export const SCHEMA = 1;
const QUANT_ORDER = ["fp32", "int8", "int4"]; // what quant "auto" prefers, as the Python runtime

export interface BundleSource {
  /** Where the bundle is, for messages (a folder or a URL). */
  readonly location: string;
  /** A file's bytes, or null when it does not exist. */
  read(path: string): Promise<Uint8Array | null>;
  /** A file's size without reading it, or null when it does not exist (sources that can, e.g. Node). */
  size?(path: string): Promise<number | null>;
  /** A path ONNX Runtime opens itself (Node, React Native), so a model is not copied through JS. */
  modelPath?(path: string): string;
}

export interface BundleOptions {
  quant?: "auto" | "fp32" | "int8" | "int4"; // which ONNX file of the bundle (auto: fp32, else int8, else int4)
  draftQuant?: "auto" | "fp32" | "int8" | "int4"; // the draft's (auto: as `quant` where the bundle has it)
  nCtx?: number; // context length; default min(4096, the model's context)
  prefillChunk?: number; // most tokens per graph run (logits block prefillChunk x n_vocab); default 64
  noDraft?: boolean; // do not load the bundle's draft model
  verify?: boolean; // also check every file's sha256 (reads each file once more)
  sessionOptions?: Record<string, unknown>; // passed to InferenceSession.create (threads, providers)
}

export interface OpenedBundle {
  manifest: Record<string, any>;
  target: OnnxModel;
  draft: OnnxModel | null;
  vocab: Vocab;
}

interface Artifact {
  file: string;
  quant: string;
  bytes?: number;
  sha256?: string;
  external_data?: string[];
}

const textDecoder = new TextDecoder("utf-8", { fatal: true });

class BundleReader {
  constructor(readonly source: BundleSource, readonly manifest: Record<string, any>, readonly verify: boolean) {}

  /** The manifest's record of a file, refusing a file the manifest does not list. */
  private entry(path: string): { bytes: number; sha256: string } {
    const info = this.manifest.files?.[path];
    if (!info || typeof info.bytes !== "number") {
      throw new BundleError(`${this.source.location}: its manifest lists no file ${path}; the manifest is not ` +
        "one edgespec export wrote; export the bundle again");
    }
    return info;
  }

  private missing(path: string): BundleError {
    return new BundleError(`${this.source.location} is missing ${path} (its manifest lists it); copy the whole ` +
      "bundle folder again, or export it again");
  }

  private wrongSize(path: string, got: number, want: number): BundleError {
    return new BundleError(`${this.source.location}: ${path} is ${got} bytes, the manifest says ${want} ` +
      "(truncated or replaced); copy the whole bundle folder again, or export it again");
  }

  async bytes(path: string): Promise<Uint8Array> {
    const info = this.entry(path);
    const data = await this.source.read(path);
    if (data === null) throw this.missing(path);
    if (data.byteLength !== info.bytes) throw this.wrongSize(path, data.byteLength, info.bytes);
    if (this.verify) await this.checkHash(path, data, info.sha256);
    return data;
  }

  async json(path: string): Promise<Record<string, any>> {
    return parseJson(await this.bytes(path), `${this.source.location}/${path}`);
  }

  /** A model for ONNX Runtime: a path where the source has one (after a size check), else its bytes. */
  async model(path: string): Promise<Uint8Array | string> {
    if (this.source.modelPath && this.source.size && !this.verify) {
      const info = this.entry(path);
      const size = await this.source.size(path);
      if (size === null) throw this.missing(path);
      if (size !== info.bytes) throw this.wrongSize(path, size, info.bytes);
      return this.source.modelPath(path);
    }
    return this.bytes(path);
  }

  private async checkHash(path: string, data: Uint8Array, want: string): Promise<void> {
    const digest = new Uint8Array(await globalThis.crypto.subtle.digest("SHA-256", data as BufferSource));
    const got = Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
    if (got !== want) {
      throw new BundleError(`${this.source.location}: ${path} does not match the sha256 in the manifest ` +
        "(corrupt or replaced); copy the whole bundle folder again, or export it again");
    }
  }
}

function parseJson(data: Uint8Array, where: string): Record<string, any> {
  try {
    const value = JSON.parse(textDecoder.decode(data));
    if (value && typeof value === "object" && !Array.isArray(value)) return value;
  } catch {
    // fall through
  }
  throw new BundleError(`${where} is not valid JSON; export the bundle again`);
}

function dirname(path: string): string {
  const i = path.lastIndexOf("/");
  return i < 0 ? "" : path.slice(0, i + 1);
}

/** Read and check the manifest: the schema this kit reads, and an ONNX pair in it. */
export async function readManifest(source: BundleSource): Promise<Record<string, any>> {
  const data = await source.read(MANIFEST);
  if (data === null) {
    throw new BundleError(`${source.location} is not an edgespec bundle (no ${MANIFEST}); give the folder ` +
      "`edgespec export --format onnx` wrote");
  }
  const manifest = parseJson(data, `${source.location}/${MANIFEST}`);
  if (manifest.schema !== SCHEMA) {
    throw new BundleError(`${source.location}/${MANIFEST} has schema ${JSON.stringify(manifest.schema)}; this kit ` +
      `reads schema ${SCHEMA}; export the bundle again with this edgespec version`);
  }
  const onnx = manifest.formats?.onnx;
  if (!onnx || !Array.isArray(onnx.target) || onnx.target.length === 0) {
    const has = Object.keys(manifest.formats ?? {}).join(", ") || "none";
    throw new BundleError(`${source.location} has no ONNX models (formats: ${has}); export it with ` +
      "`edgespec export --format onnx`");
  }
  if (typeof manifest.files !== "object" || manifest.files === null) {
    throw new BundleError(`${source.location}/${MANIFEST} has no file table; export the bundle again`);
  }
  return manifest;
}

function pick(artifacts: Artifact[], quant: string, role: string, where: string): Artifact {
  if (quant === "auto") {
    for (const q of QUANT_ORDER) {
      const a = artifacts.find((x) => x.quant === q);
      if (a) return a;
    }
    return artifacts[0];
  }
  const a = artifacts.find((x) => x.quant === quant);
  if (!a) {
    throw new BundleError(`${where} has no ${quant} ONNX ${role}; it has ${artifacts.map((x) => x.quant).join(", ")}`);
  }
  return a;
}

async function tokenizerFiles(reader: BundleReader, dir: string, listed: Set<string>): Promise<TokenizerFiles> {
  const optional = async (name: string) => (listed.has(dir + name) ? reader.json(dir + name) : {});
  if (!listed.has(dir + "tokenizer.json")) {
    throw new BundleError(`${reader.source.location}: no ${dir}tokenizer.json in the manifest; export the bundle again`);
  }
  const template = listed.has(dir + "chat_template.jinja")
    ? textDecoder.decode(await reader.bytes(dir + "chat_template.jinja")) : null;
  return {
    tokenizer: await reader.json(dir + "tokenizer.json"),
    tokenizerConfig: await optional("tokenizer_config.json"),
    config: await optional("config.json"),
    generationConfig: await optional("generation_config.json"),
    chatTemplate: template,
  };
}

async function loadModel(ort: Ort, reader: BundleReader, artifact: Artifact, options: BundleOptions,
                         nCtx: number, nVocabHint: number): Promise<OnnxModel> {
  const sessionOptions: Record<string, unknown> = { ...(options.sessionOptions ?? {}) };
  const model = await reader.model(artifact.file);
  if (typeof model !== "string" && artifact.external_data?.length) { // bytes: hand ORT the data files too
    sessionOptions.externalData = await Promise.all(artifact.external_data.map(async (f) => ({
      path: f.slice(dirname(artifact.file).length), data: await reader.bytes(f),
    })));
  }
  return OnnxModel.load(ort, model, `${reader.source.location}/${artifact.file}`,
    { nCtx, prefillChunk: options.prefillChunk ?? 64, sessionOptions }, nVocabHint);
}

/** Open a bundle's ONNX target (and draft), its tokenizer, and check that the pair's vocabularies match. */
export async function openBundleWith(ort: Ort, source: BundleSource, options: BundleOptions = {}): Promise<OpenedBundle> {
  const manifest = await readManifest(source);
  const reader = new BundleReader(source, manifest, options.verify ?? false);
  const onnx = manifest.formats.onnx;
  const where = source.location;
  const quant = options.quant ?? "auto";
  const targetArt = pick(onnx.target, quant, "target", where);
  const draftArts: Artifact[] = Array.isArray(onnx.draft) ? onnx.draft : [];
  const draftQuant = options.draftQuant ?? (draftArts.some((a) => a.quant === quant) ? quant : "auto");
  const draftArt = draftArts.length && !options.noDraft ? pick(draftArts, draftQuant, "draft", where) : null;
  const prefillChunk = options.prefillChunk ?? 64;
  if (!(Number.isInteger(prefillChunk) && prefillChunk >= 1)) {
    throw new BundleError(`prefillChunk must be an integer >= 1, got ${prefillChunk}`);
  }

  const listed = new Set(Object.keys(manifest.files));
  const tokDir = dirname((manifest.tokenizer?.files ?? []).find((f: string) => f.endsWith("tokenizer.json")) ??
    "tokenizer/tokenizer.json");
  const targetTok = await tokenizerFiles(reader, tokDir, listed);
  const context = Number(manifest.context_length) || Number(targetTok.config.max_position_embeddings) || 4096;
  const nCtx = options.nCtx ?? Math.min(4096, context);
  if (!(Number.isInteger(nCtx) && nCtx >= 1)) throw new BundleError(`nCtx must be an integer >= 1, got ${nCtx}`);
  if (nCtx > context) {
    throw new BundleError(`nCtx ${nCtx} is longer than the model's context of ${context} tokens; use nCtx <= ${context}`);
  }

  const target = await loadModel(ort, reader, targetArt, options, nCtx, Number(targetTok.config.vocab_size) || 0);
  let draft: OnnxModel | null = null;
  try {
    const vocab = new Vocab(targetTok, target.nVocab, `${where}/${tokDir}tokenizer.json`);
    if (draftArt) {
      // The draft's own directory carries its tokenizer (a self-draft shares the target's directory).
      const dDir = dirname(draftArt.file);
      const draftTok = listed.has(dDir + "tokenizer.json") ? await tokenizerFiles(reader, dDir, listed) : targetTok;
      draft = await loadModel(ort, reader, draftArt, options, nCtx, Number(draftTok.config.vocab_size) || 0);
      checkVocabCompatible(vocab, new Vocab(draftTok, draft.nVocab, `${where}/${dDir}tokenizer.json`));
    }
    return { manifest, target, draft, vocab };
  } catch (err) {
    await target.close();
    await draft?.close();
    throw err;
  }
}
