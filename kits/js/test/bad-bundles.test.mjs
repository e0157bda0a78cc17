// Bad bundles reject with one clear error (a BundleError or VocabMismatchError naming the problem and
// what to do), before anything runs. Each case is a copy of the tiny bundle with one thing broken.
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { cpSync, mkdtempSync, readFileSync, rmSync, truncateSync, unlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { BundleError, EdgespecError, openBundle, VocabMismatchError } from "../dist/node.js";
import { fixture } from "./fixture.mjs";

const source = fixture.bundles.tiny.path;
const root = mkdtempSync(join(tmpdir(), "edgespec-bad-"));
after(() => rmSync(root, { recursive: true, force: true }));

let count = 0;
function broken(edit) {
  const dir = join(root, `b${count++}`);
  cpSync(source, dir, { recursive: true });
  edit(dir);
  return dir;
}
const manifestOf = (dir) => JSON.parse(readFileSync(join(dir, "edgespec.json"), "utf8"));
const writeManifest = (dir, m) => writeFileSync(join(dir, "edgespec.json"), JSON.stringify(m));

async function rejects(dir, kind, pattern) {
  await assert.rejects(openBundle(dir, { threads: 1, nCtx: 64 }), (err) => {
    assert.ok(err instanceof kind, `${err?.name}: ${err?.message}`);
    assert.match(err.message, pattern);
    assert.ok(!err.message.includes("\n"), "one line");
    return true;
  });
}

test("a folder without a manifest", async () => {
  await rejects(broken((d) => unlinkSync(join(d, "edgespec.json"))), BundleError,
    /is not an edgespec bundle \(no edgespec\.json\); give the folder `edgespec export --format onnx` wrote$/);
});

test("a manifest that is not JSON", async () => {
  await rejects(broken((d) => writeFileSync(join(d, "edgespec.json"), "{ not json")), BundleError,
    /edgespec\.json is not valid JSON; export the bundle again$/);
});

test("a manifest of another schema", async () => {
  await rejects(broken((d) => writeManifest(d, { ...manifestOf(d), schema: 2 })), BundleError,
    /has schema 2; this kit reads schema 1; export the bundle again/);
});

test("a manifest without ONNX models", async () => {
  await rejects(broken((d) => {
    const m = manifestOf(d);
    m.formats = { gguf: { target: [], draft: [] } };
    writeManifest(d, m);
  }), BundleError, /has no ONNX models \(formats: gguf\); export it with `edgespec export --format onnx`$/);
});

test("a model file missing", async () => {
  await rejects(broken((d) => unlinkSync(join(d, "onnx/draft/model.onnx"))), BundleError,
    /is missing onnx\/draft\/model\.onnx \(its manifest lists it\); copy the whole bundle folder again/);
});

test("a truncated model file", async () => {
  await rejects(broken((d) => truncateSync(join(d, "onnx/target/model.onnx"), 1000)), BundleError,
    /onnx\/target\/model\.onnx is 1000 bytes, the manifest says \d+ \(truncated or replaced\)/);
});

test("a tokenizer file missing", async () => {
  await rejects(broken((d) => unlinkSync(join(d, "tokenizer/tokenizer.json"))), BundleError,
    /is missing tokenizer\/tokenizer\.json/);
});

test("a corrupt model whose size the manifest was made to match", async () => {
  await rejects(broken((d) => {
    const f = join(d, "onnx/target/model.onnx");
    const bytes = readFileSync(f);
    bytes.fill(7, 0, 4096);
    writeFileSync(f, bytes);
  }), BundleError, /ONNX Runtime cannot load .*model\.onnx \(.*\): the file is truncated, corrupt or not an ONNX model/);
});

test("sha256 verification passes an intact bundle and catches a changed file of the right size", async () => {
  await (await openBundle(source, { threads: 1, nCtx: 64, verify: true })).close();
  const dir = broken((d) => {
    const f = join(d, "tokenizer/tokenizer_config.json");
    writeFileSync(f, readFileSync(f, "utf8").replace('"add_bos_token": false', '"add_bos_token": fals '));
  });
  await assert.rejects(openBundle(dir, { threads: 1, nCtx: 64, verify: true }),
    (err) => err instanceof BundleError && /does not match the sha256 in the manifest/.test(err.message));
});

test("a draft whose vocabulary differs from the target's", async () => {
  // Swap two tokens' ids in the draft's tokenizer (and record the new file in the manifest, so only the
  // vocabulary check can catch it).
  await rejects(broken((d) => {
    const path = "onnx/draft/tokenizer.json";
    const tok = JSON.parse(readFileSync(join(d, path), "utf8"));
    const vocab = tok.model.vocab;
    const [a, b] = Object.keys(vocab).filter((t) => vocab[t] >= 100).slice(0, 2);
    [vocab[a], vocab[b]] = [vocab[b], vocab[a]];
    const data = Buffer.from(JSON.stringify(tok));
    writeFileSync(join(d, path), data);
    const m = manifestOf(d);
    m.files[path] = { bytes: data.length, sha256: createHash("sha256").update(data).digest("hex") };
    writeManifest(d, m);
  }), VocabMismatchError, /^the draft's vocabulary does not match the target's: they differ at token \d+: target ".*", draft ".*"; export the bundle with a draft that has the target's tokenizer$/);
});

test("bad options are refused with a clear message", async () => {
  await assert.rejects(openBundle(source, { nCtx: 100000 }), /nCtx 100000 is longer than the model's context of \d+ tokens/);
  await assert.rejects(openBundle(source, { quant: "int8" }), /has no int8 ONNX target; it has fp32$/);
  const engine = await openBundle(source, { threads: 1, nCtx: 64, noDraft: true });
  try {
    await assert.rejects(engine.generateTokens([5, 6], { mode: "draft" }), /mode draft needs a draft model/);
    await assert.rejects(engine.generateTokens([5, 6], { maxTokens: 100 }), /exceeds the context of 64 tokens/);
    await assert.rejects(engine.generateTokens([5, 6], { maxTokens: 4, topP: 0 }), /topP must be in \(0, 1\]/);
    await assert.rejects(engine.generateTokens([5, 99999], { maxTokens: 4 }), /prompt token 99999 is not an id of this vocabulary/);
    await assert.rejects(engine.generate("", {}), EdgespecError);
  } finally {
    await engine.close();
  }
});
