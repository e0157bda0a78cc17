// Runs in the browser: the kit's web entry point (onnxruntime-web, WebAssembly) on the fixture's cases.
import { openBundle, ort } from "../../dist/web.js";

const log = (line) => {
  document.getElementById("log").textContent += line + "\n";
  console.log(line);
};

async function main() {
  const fixture = await (await fetch(new URL("../../../fixture.json", location.href))).json();
  const results = { backend: "wasm", cases: {}, checks: [], ort: ort.env.versions?.web ?? null };
  const engines = {};
  for (const [name, b] of Object.entries(fixture.bundles)) {
    engines[name] = await openBundle(new URL(b.url, location.href).href, {
      nCtx: b.n_ctx, quant: b.quant, draftQuant: b.draft_quant, executionProviders: ["wasm"], threads: 1,
    });
  }
  let generated = 0, decodeS = 0;
  for (const c of fixture.greedy) {
    try {
      const r = await engines[c.bundle].generateTokens(c.prompt, { maxTokens: c.max_tokens, temperature: 0,
        mode: c.mode, draftMax: c.draft_max });
      results.cases[c.name] = { tokens: r.tokens, stats: r.stats.toDict() };
      generated += r.stats.generated;
      decodeS += r.stats.decodeS;
      log(`${c.name}: ${r.stats.summary()}`);
    } catch (err) {
      results.cases[c.name] = { error: String(err?.message ?? err) };
    }
  }
  results.tokens_per_s = decodeS > 0 ? generated / decodeS : 0;
  for (const c of fixture.chat ?? []) {
    const ids = engines[c.bundle].promptTokens(c.messages);
    results.checks.push({ check: `chat prompt tokens (${c.bundle})`, ok: JSON.stringify(ids) === JSON.stringify(c.ids) });
  }
  // Streaming through the async iterator, as the example page does.
  const first = Object.keys(engines)[0];
  const stream = engines[first].stream("Hello", { maxTokens: 8, temperature: 0, mode: "lookup" });
  let text = "";
  for await (const piece of stream) text += piece;
  results.checks.push({ check: "streamed text equals the result", ok: text === stream.result.text });
  for (const e of Object.values(engines)) await e.close();
  return results;
}

main().then((r) => { window.__results = r; }, (err) => { window.__results = { fatal: String(err?.stack ?? err) }; });
