// The kit on Node (onnxruntime-node, CPU) against the Python engine's ONNX runtime on the same bundles:
// tokenizer, token bytes, chat prompts, the sampling chain, greedy tokens for plain decoding, prompt
// lookup and the draft model, the stats fields, KV reuse between calls; and samples for the chi-square
// check pytest runs.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { openBundle, Sampler, acceptSampling, sample, Vocab } from "../dist/node.js";
import { fixture, record } from "./fixture.mjs";

const engines = {};
before(async () => {
  for (const [name, b] of Object.entries(fixture.bundles)) {
    engines[name] = await openBundle(b.path, { threads: 1, nCtx: b.n_ctx, quant: b.quant, draftQuant: b.draft_quant });
  }
});
after(async () => {
  for (const e of Object.values(engines)) await e.close();
});

describe("tokenizer", () => {
  test("ids equal the Python tokenizer's", () => {
    for (const c of fixture.tokenize) {
      assert.deepEqual(engines[c.bundle].vocab.tokenize(c.text, c.add_special, true), c.ids, `${c.bundle}: ${c.text}`);
    }
  });
  test("every token's bytes equal the Python runtime's", () => {
    for (const [name, hexes] of Object.entries(fixture.token_bytes)) {
      const vocab = engines[name].vocab;
      assert.equal(vocab.info.nVocab, hexes.length);
      hexes.forEach((hex, id) => assert.equal(Buffer.from(vocab.tokenBytes(id)).toString("hex"), hex, `${name} token ${id}`));
    }
  });
  test("vocabulary facts equal the Python runtime's", () => {
    for (const [name, v] of Object.entries(fixture.vocab)) {
      const info = engines[name].vocab.info;
      assert.deepEqual({ n_vocab: info.nVocab, bos: info.bos, eos: info.eos, add_bos: info.addBos,
        eog: [...info.eog].sort((a, b) => a - b) }, v);
    }
  });
  test("other tokenizer families (pre-tokenizer regexes, NFC, BOS) give the Python ids, bytes and facts", () => {
    for (const t of fixture.tokenizer_dirs ?? []) {
      const read = (name, fallback) => (existsSync(join(t.dir, name)) ? readFileSync(join(t.dir, name), "utf8") : fallback);
      const vocab = new Vocab({
        tokenizer: JSON.parse(read("tokenizer.json")), tokenizerConfig: JSON.parse(read("tokenizer_config.json", "{}")),
        config: JSON.parse(read("config.json", "{}")), generationConfig: JSON.parse(read("generation_config.json", "{}")),
        chatTemplate: read("chat_template.jinja", null),
      }, t.n_vocab, t.dir);
      const info = vocab.info;
      assert.deepEqual({ n_vocab: info.nVocab, bos: info.bos, eos: info.eos, add_bos: info.addBos,
        eog: [...info.eog].sort((a, b) => a - b) }, t.vocab, t.name);
      for (const c of t.cases) assert.deepEqual(vocab.tokenize(c.text, c.add_special, true), c.ids, `${t.name}: ${c.text}`);
      t.token_bytes.forEach((hex, id) => assert.equal(Buffer.from(vocab.tokenBytes(id)).toString("hex"), hex, `${t.name} ${id}`));
    }
  });
  test("chat prompts render and tokenize as in Python", () => {
    for (const c of fixture.chat) assert.deepEqual(engines[c.bundle].promptTokens(c.messages), c.ids);
  });
});

test("the sampling chain gives the Python engine's distributions", () => {
  for (const c of fixture.distributions) {
    const sampler = new Sampler(c.params, 0);
    const logits = Float32Array.from(c.logits.flat());
    const rows = sampler.rows(logits, c.logits[0].length, Int32Array.from(c.context), Int32Array.from(c.continuation));
    const want = c.expected.flat();
    assert.equal(rows.length, want.length);
    for (let i = 0; i < want.length; i++) assert.ok(Math.abs(rows[i] - want[i]) < 1e-9, `${c.name}[${i}]: ${rows[i]} vs ${want[i]}`);
  }
});

describe("greedy tokens equal the Python engine's", () => {
  for (const c of fixture.greedy) {
    test(c.name, async () => {
      const r = await engines[c.bundle].generateTokens(c.prompt, { maxTokens: c.max_tokens, temperature: 0,
        mode: c.mode, draftMax: c.draft_max });
      record(c.name, { tokens: r.tokens, stats: r.stats.toDict() });
      assert.deepEqual(r.tokens, c.expected);
      if (c.mode !== "ar") assert.ok(r.stats.drafted > 0, "the drafter drafted");
      assert.deepEqual(Object.keys(r.stats.toDict()).sort(), fixture.stats_keys);
    });
  }
});

test("a repeated prompt reuses the KV of its prefix", async () => {
  const c = fixture.greedy[0];
  const engine = engines[c.bundle];
  const cfg = { maxTokens: 4, temperature: 0, mode: "ar" };
  await engine.generateTokens(c.prompt, cfg);
  const before = engine.target.nRunTokens;
  const r = await engine.generateTokens(c.prompt, cfg);
  assert.equal(r.stats.cachedTokens, c.prompt.length - 1);
  assert.equal(r.stats.prefilledTokens, 0);
  assert.equal(engine.target.nRunTokens - before, 4, "only the last prompt token and the new ones were evaluated");
});

test("a long prompt is evaluated in chunks: no logits block larger than prefillChunk x n_vocab", () => {
  const long = fixture.greedy.filter((c) => c.prompt.length > 64);
  assert.ok(long.length > 0, "the fixture has a prompt longer than one chunk");
  for (const c of long) assert.ok(engines[c.bundle].target.maxRunTokens <= 64, `${engines[c.bundle].target.maxRunTokens}`);
});

test("streaming yields the text pieces of the result, and stop strings end it", async () => {
  const engine = engines[fixture.stream.bundle];
  const stream = engine.stream(fixture.stream.messages, { maxTokens: 24, temperature: 0, mode: "lookup" });
  let text = "";
  for await (const piece of stream) text += piece;
  assert.equal(text, stream.result.text);
  assert.ok(text.length > 0);
  const stop = text.slice(3, 6);
  const stopped = await engine.generate(fixture.stream.messages, { maxTokens: 24, temperature: 0, mode: "lookup", stop: [stop] });
  assert.equal(stopped.finishReason, "stop");
  assert.equal(stopped.text, text.slice(0, text.indexOf(stop)));
});

test("samples for the chi-square check", async () => {
  for (const c of fixture.sampling) {
    const engine = engines[c.bundle];
    const trustTheDraft = (draft, _q, rows, nVocab, rng) => [draft.length, sample(rows.subarray(draft.length * nVocab,
      (draft.length + 1) * nVocab), rng)];
    const outcomes = [];
    let drafted = 0;
    for (let seed = 0; seed < c.n; seed++) {
      const r = await engine.generateTokens(c.prompt, { ...c.config, seed }, c.wrong ? trustTheDraft : null);
      assert.equal(r.tokens.length, c.config.maxTokens);
      outcomes.push(r.tokens);
      drafted += r.stats.drafted;
    }
    assert.ok(drafted > 0 || c.config.mode === "ar");
    record(c.name, { samples: outcomes, drafted });
  }
  assert.equal(typeof acceptSampling, "function");
});
