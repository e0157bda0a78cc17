#!/usr/bin/env node
// A Node CLI over the kit: streams the generated text to stdout, the stats line to stderr.
//   node examples/node-cli.mjs BUNDLE "PROMPT" [--mode ar|lookup|draft] [--max-tokens N] [--temperature T]
//                              [--draft-max K] [--seed S] [--threads N] [--raw] [--json]
// Errors a user can cause print one line and exit with status 2, as `edgespec generate` does.
import { EdgespecError, openBundle } from "../dist/node.js";

const usage = "usage: node examples/node-cli.mjs BUNDLE PROMPT [--mode ar|lookup|draft] [--max-tokens N] " +
  "[--temperature T] [--draft-max K] [--seed S] [--threads N] [--raw] [--json]";

function parse(argv) {
  const opts = { mode: "ar", maxTokens: 128, temperature: 0.8, raw: false, json: false };
  const positional = [];
  const numbers = { "--max-tokens": "maxTokens", "--temperature": "temperature", "--draft-max": "draftMax",
    "--seed": "seed", "--threads": "threads" };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--raw") opts.raw = true;
    else if (a === "--json") opts.json = true;
    else if (a === "--mode") opts.mode = argv[++i];
    else if (a in numbers) {
      const v = Number(argv[++i]);
      if (!Number.isFinite(v)) throw new EdgespecError(`${a} needs a number`);
      opts[numbers[a]] = v;
    } else if (a.startsWith("--")) throw new EdgespecError(`unknown option ${a}; ${usage}`);
    else positional.push(a);
  }
  if (positional.length !== 2) throw new EdgespecError(usage);
  return { bundle: positional[0], prompt: positional[1], ...opts };
}

async function main() {
  const o = parse(process.argv.slice(2));
  const engine = await openBundle(o.bundle, { threads: o.threads, noDraft: o.mode !== "draft" });
  try {
    const stream = engine.stream(o.prompt, { mode: o.mode, maxTokens: o.maxTokens, temperature: o.temperature,
      draftMax: o.draftMax, seed: o.seed, raw: o.raw });
    for await (const piece of stream) if (!o.json) process.stdout.write(piece);
    const r = stream.result;
    if (o.json) {
      process.stdout.write(JSON.stringify({ text: r.text, tokens: r.tokens, prompt_tokens: r.promptTokens,
        finish_reason: r.finishReason, stats: r.stats.toDict() }) + "\n");
    } else {
      process.stdout.write("\n");
      process.stderr.write(r.stats.summary() + "\n");
    }
  } finally {
    await engine.close();
  }
}

main().catch((err) => {
  if (err instanceof EdgespecError) {
    process.stderr.write(`error: ${err.message}\n`);
    process.exit(2);
  }
  throw err;
});
