// The kit's side of bench/js_bench.py: runs a job file's generations on Node (onnxruntime-node, CPU) and
// prints one JSON object with every generation's stats. Usage: node bench/node-bench.mjs JOB.json
import { readFileSync } from "node:fs";
import { openBundle } from "../dist/node.js";

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
const engine = await openBundle(job.bundle, { threads: job.threads, nCtx: job.n_ctx, quant: job.quant,
  draftQuant: job.draft_quant });
const runs = [];
try {
  for (const run of job.runs) {
    const r = await engine.generateTokens(run.prompt, { maxTokens: run.max_tokens, temperature: 0, mode: run.mode,
      draftMax: run.draft_max });
    runs.push({ name: run.name, tokens: r.tokens, stats: r.stats.toDict() });
  }
} finally {
  await engine.close();
}
process.stdout.write(JSON.stringify({ runs }) + "\n");
