/**
 * A bundle's Hugging Face tokenizer (tokenizer.json and its config files) answering the questions the
 * engine asks, as runtimes/hf_vocab.py answers them: ids come from @huggingface/tokenizers (a maintained
 * JS implementation of HF tokenizers); token bytes, end-of-generation tokens and BOS/EOS follow
 * llama.cpp's rules for the GGUF export of the same checkpoint. Only byte-level BPE tokenizers, as the
 * exporters write.
 *
 * Memory: the tokenizer's own tables, one text per id and a byte cache filled as tokens are emitted.
 */

import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";
import { EdgespecError, VocabMismatchError } from "./errors.js";

const EOT_TEXTS = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
  "_<EOT>", "[EOT]", "<end_of_utterance>"];
const FIM_EOG_TEXTS = ["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
  "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"];
export const EOG_TEXTS = new Set([...EOT_TEXTS, ...FIM_EOG_TEXTS, "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
  "</s>", "<|eom_id|>", "[EOS]", "<eos>", "<turn|>", "<|tool_response>"]);
const CONTROL_TEXTS = new Set([...EOG_TEXTS, "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>",
  "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>",
  "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"]);
const RENDERED_TEXTS = ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"]; // gpt-oss: shown as text

// For models without a template: the Python engine's plain, visible format.
const FALLBACK_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" +
  "{% if add_generation_prompt %}assistant:{% endif %}";

export interface ChatMessage {
  role: string;
  content: string;
}

export interface VocabInfo {
  nVocab: number;
  bos: number | null;
  eos: number | null;
  addBos: boolean;
  eog: ReadonlySet<number>; // every end-of-generation token
}

/** The files a tokenizer is made of, as parsed JSON (missing optional ones as {}). */
export interface TokenizerFiles {
  tokenizer: Record<string, any>;
  tokenizerConfig: Record<string, any>;
  config: Record<string, any>;
  generationConfig: Record<string, any>;
  chatTemplate: string | null; // chat_template.jinja, when present
}

/** GPT-2's byte-level alphabet reversed: the printable character each byte is stored as -> the byte. */
const BYTE_DECODER: Map<string, number> = (() => {
  const printable = new Set<number>();
  for (let b = 0x21; b <= 0x7e; b++) printable.add(b);
  for (let b = 0xa1; b <= 0xac; b++) printable.add(b);
  for (let b = 0xae; b <= 0xff; b++) printable.add(b);
  const map = new Map<string, number>();
  let extra = 0;
  for (let b = 0; b < 256; b++) map.set(String.fromCodePoint(printable.has(b) ? b : 256 + extra++), b);
  return map;
})();

const utf8 = new TextEncoder();

function decodeByteLevel(text: string): Uint8Array {
  const out: number[] = [];
  for (const ch of text) {
    const b = BYTE_DECODER.get(ch);
    if (b === undefined) { // a character outside the byte alphabet: written as llama.cpp does
      const hex = Array.from(utf8.encode(ch), (x) => x.toString(16).padStart(2, "0")).join("");
      out.push(...utf8.encode(`[UNK_BYTE_0x${hex}${text}]`));
    } else {
      out.push(b);
    }
  }
  return Uint8Array.from(out);
}

export class Vocab {
  readonly info: VocabInfo;
  private readonly tokenizer: Tokenizer;
  private readonly texts: string[];
  private readonly silent: Uint8Array;
  private readonly userDefined: Uint8Array;
  private readonly bytes: (Uint8Array | undefined)[];
  private readonly specialTexts: string[]; // added tokens marked special
  private readonly addEos: boolean;
  readonly template: string | null;

  constructor(files: TokenizerFiles, nVocab: number, readonly where: string) {
    const data = files.tokenizer;
    if (data?.model?.type !== "BPE" || !isByteLevel(data)) {
      throw new EdgespecError(`${where}: only byte-level BPE tokenizers are supported (as edgespec export writes)`);
    }
    this.tokenizer = new Tokenizer(data, files.tokenizerConfig);
    const texts: (string | undefined)[] = new Array(nVocab);
    const special = new Uint8Array(nVocab), added = new Uint8Array(nVocab), unused = new Uint8Array(nVocab);
    for (const [text, id] of Object.entries(data.model.vocab as Record<string, number>)) {
      if (id < nVocab) texts[id] = text;
    }
    for (const a of data.added_tokens ?? []) {
      if (a.id >= nVocab) continue;
      texts[a.id] = a.content;
      (a.special ? special : added)[a.id] = 1;
    }
    let size = 0; // a loop, not Math.max(...): a 152k-token vocabulary is too many arguments
    for (const id of Object.values(data.model.vocab as Record<string, number>)) size = Math.max(size, id + 1);
    for (const a of data.added_tokens ?? []) size = Math.max(size, a.id + 1);
    if (size > nVocab) {
      throw new EdgespecError(`${where}: the tokenizer has ${size} tokens but the model's logits only ${nVocab}`);
    }
    for (let i = 0; i < nVocab; i++) {
      if (texts[i] === undefined) {
        texts[i] = `[PAD${i}]`;
        unused[i] = 1;
      }
    }
    this.texts = texts as string[];
    this.specialTexts = this.texts.filter((_, i) => special[i]);
    // o200k_harmony / solar-open: with <|return|> and <|call|> (or <|calls|> and <|flush|>), <|end|> is text
    const present = new Set(this.texts.filter((t) => EOG_TEXTS.has(t)));
    const harmonyEnd = (present.has("<|return|>") && present.has("<|call|>")) ||
      (present.has("<|calls|>") && present.has("<|flush|>"));
    const rendered = new Set([...RENDERED_TEXTS, ...(harmonyEnd ? ["<|end|>"] : [])]);
    this.silent = new Uint8Array(nVocab);
    this.userDefined = new Uint8Array(nVocab);
    const eog = new Set<number>();
    for (let i = 0; i < nVocab; i++) {
      const t = this.texts[i];
      const control = special[i] || unused[i];
      this.silent[i] = (control || CONTROL_TEXTS.has(t)) && !rendered.has(t) ? 1 : 0;
      this.userDefined[i] = (added[i] && !special[i]) || rendered.has(t) ? 1 : 0;
      if (EOG_TEXTS.has(t) && !rendered.has(t)) eog.add(i);
    }
    this.bytes = new Array(nVocab);
    const cfg = files.tokenizerConfig, gen = files.generationConfig;
    const bos = this.specialId(cfg.bos_token, [files.config.bos_token_id, gen.bos_token_id], nVocab);
    const eos = this.specialId(cfg.eos_token, [files.config.eos_token_id, gen.eos_token_id], nVocab);
    const addBos = this.addFlag(data, cfg, "bos", bos);
    this.addEos = this.addFlag(data, cfg, "eos", eos);
    // generation_config may list several end tokens (Llama 3 instruct); Hugging Face stops at each.
    const extra = Array.isArray(gen.eos_token_id) ? gen.eos_token_id : Number.isInteger(gen.eos_token_id) ? [gen.eos_token_id] : [];
    for (const t of [eos, ...extra]) if (Number.isInteger(t) && t >= 0 && t < nVocab) eog.add(t);
    this.info = { nVocab, bos, eos, addBos, eog };
    let template = cfg.chat_template ?? files.chatTemplate ?? null;
    if (Array.isArray(template)) template = template.find((t: any) => t.name === "default")?.template ?? null;
    this.template = typeof template === "string" ? template : null;
  }

  /** tokenizer_config's token (a string or {"content": ...}) by id, else the first id the config files give. */
  private specialId(token: unknown, fallbackIds: unknown[], nVocab: number): number | null {
    const content = token && typeof token === "object" ? (token as any).content : token;
    if (typeof content === "string") {
      const found = this.tokenizer.token_to_id(content);
      if (found !== undefined) return found;
    }
    for (let v of fallbackIds) {
      v = Array.isArray(v) ? v[0] : v;
      if (Number.isInteger(v) && (v as number) >= 0 && (v as number) < nVocab) return v as number;
    }
    return null;
  }

  /** add_bos_token / add_eos_token from tokenizer_config.json, else whether the post-processor adds it. */
  private addFlag(data: any, cfg: any, kind: "bos" | "eos", token: number | null): boolean {
    const flag = cfg[`add_${kind}_token`];
    if (typeof flag === "boolean") return flag && token !== null;
    const post = data.post_processor ?? {};
    for (const proc of post.processors ?? [post]) {
      const single = proc.type === "TemplateProcessing" ? proc.single ?? [] : [];
      if (single.length > 1) {
        const edge = kind === "bos" ? single[0] : single[single.length - 1];
        const name = edge?.SpecialToken?.id;
        if (name !== undefined && this.tokenizer.token_to_id(name) === token) return true;
      }
    }
    return false;
  }

  /**
   * Token ids of a text. `parseSpecial` false (raw prompts) should encode special-token text as plain
   * text; the JS tokenizer has no switch for that, so such a text is refused rather than tokenized
   * differently from the Python engine.
   */
  tokenize(text: string, addSpecial = true, parseSpecial = true): number[] {
    if (!parseSpecial) {
      const found = this.specialTexts.find((s) => text.includes(s));
      if (found) {
        throw new EdgespecError(`the raw prompt contains the special token text ${JSON.stringify(found)}, which the ` +
          "JS tokenizer cannot encode as plain text; remove it, or pass chat messages instead of a raw prompt");
      }
    }
    const ids = this.tokenizer.encode(text, { add_special_tokens: false }).ids;
    if (addSpecial && this.info.addBos && this.info.bos !== null) ids.unshift(this.info.bos);
    if (addSpecial && this.addEos && this.info.eos !== null) ids.push(this.info.eos);
    return ids;
  }

  /** The bytes a token adds to the output (may be part of a UTF-8 character). */
  tokenBytes(token: number): Uint8Array {
    let piece = this.bytes[token];
    if (piece === undefined) {
      if (this.silent[token]) piece = new Uint8Array(0);
      else if (this.userDefined[token]) piece = utf8.encode(this.texts[token]); // added tokens are stored as text
      else piece = decodeByteLevel(this.texts[token]);
      this.bytes[token] = piece;
    }
    return piece;
  }

  tokenText(token: number): string {
    return this.texts[token];
  }

  /** Chat messages to the prompt text with the model's own template (Jinja, as the Python engine). */
  renderChat(messages: ChatMessage[]): string {
    if (!messages.length) throw new EdgespecError("no chat messages given");
    for (const m of messages) {
      if (typeof m?.role !== "string" || typeof m?.content !== "string") {
        throw new EdgespecError("each chat message needs a 'role' and a 'content'");
      }
    }
    const piece = (t: number | null) => (t === null ? "" : this.texts[t]);
    try {
      return new Template(this.template ?? FALLBACK_TEMPLATE).render({
        messages, bos_token: piece(this.info.bos), eos_token: piece(this.info.eos), add_generation_prompt: true,
      }); // @huggingface/jinja defines raise_exception itself
    } catch (err) {
      if (err instanceof EdgespecError) throw err;
      throw new EdgespecError(`the model's chat template failed to render: ${(err as Error).message}; use a raw prompt`);
    }
  }
}

function isByteLevel(data: any): boolean {
  const pre = data.pre_tokenizer ?? {};
  const steps = pre.type === "Sequence" ? pre.pretokenizers ?? [] : [pre];
  return steps.some((s: any) => s?.type === "ByteLevel") || data.decoder?.type === "ByteLevel";
}

const MAX_VOCAB_SIZE_DIFFERENCE = 128;
const CHECK_FROM_TOKEN_ID = 5; // the first few ids are often special tokens that differ harmlessly

/** The first way the draft's vocabulary differs from the target's (llama.cpp's rules, edgespec/vocab.py). */
export function vocabDifference(t: Vocab, d: Vocab): string | null {
  const a = t.info, b = d.info;
  if (a.addBos !== b.addBos || a.bos !== b.bos || a.eos !== b.eos) {
    return `special tokens differ (add_bos/bos/eos: draft ${b.addBos}/${b.bos}/${b.eos}, ` +
      `target ${a.addBos}/${a.bos}/${a.eos})`;
  }
  if (Math.abs(a.nVocab - b.nVocab) > MAX_VOCAB_SIZE_DIFFERENCE) {
    return `${b.nVocab} tokens vs the target's ${a.nVocab} (more than ${MAX_VOCAB_SIZE_DIFFERENCE} apart)`;
  }
  for (let i = CHECK_FROM_TOKEN_ID; i < Math.min(a.nVocab, b.nVocab); i++) {
    if (t.tokenText(i) !== d.tokenText(i)) {
      return `they differ at token ${i}: target ${JSON.stringify(t.tokenText(i))}, draft ${JSON.stringify(d.tokenText(i))}`;
    }
  }
  return null;
}

export function checkVocabCompatible(t: Vocab, d: Vocab): void {
  const difference = vocabDifference(t, d);
  if (difference) {
    throw new VocabMismatchError(`the draft's vocabulary does not match the target's: ${difference}; ` +
      "export the bundle with a draft that has the target's tokenizer");
  }
}
