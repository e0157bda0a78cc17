// The example page's script: open the bundle named by ?bundle=, stream each generation into the text area.
import { openBundle } from "../../dist/web.js";

const $ = (id) => document.getElementById(id);
const bundleUrl = new URL(new URLSearchParams(location.search).get("bundle") ?? "../../bundle/", location.href).href;

const engine = await openBundle(bundleUrl, { executionProviders: ["wasm"] }).catch((err) => {
  $("stats").textContent = `cannot open ${bundleUrl}: ${err.message}`;
  throw err;
});
$("go").disabled = false;
$("go").textContent = "generate";
document.body.dataset.ready = "1";

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("go").disabled = true;
  $("output").value = "";
  $("stats").textContent = "";
  try {
    const stream = engine.stream($("prompt").value, { mode: $("mode").value, maxTokens: Number($("max").value),
      temperature: Number($("temperature").value) });
    let pieces = 0;
    for await (const piece of stream) { // each piece as soon as it is decided
      $("output").value += piece;
      document.body.dataset.pieces = String(++pieces);
    }
    $("stats").textContent = stream.result.stats.summary();
    document.body.dataset.done = String(Number(document.body.dataset.done ?? 0) + 1);
  } catch (err) {
    $("stats").textContent = `error: ${err.message}`;
  } finally {
    $("go").disabled = false;
  }
});
