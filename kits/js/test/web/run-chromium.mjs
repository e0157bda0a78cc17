// Drives headless Chromium (the system's package; playwright-core never downloads a browser) through one
// page and writes what it produced. Usage: node run-chromium.mjs URL OUT.json [CHROMIUM] [TIMEOUT_S]
// The test page leaves window.__results; the example page (examples/web) is used as a person would:
// wait until it has loaded the bundle, press "generate", read the text area once the stream ends.
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, out, executablePath = "/usr/bin/chromium", timeoutS = "500"] = process.argv.slice(2);
const profile = mkdtempSync(join(tmpdir(), "edgespec-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath, headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
try {
  const page = context.pages()[0] ?? await context.newPage();
  page.on("console", (m) => console.log(`[page] ${m.text()}`));
  page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
  await page.goto(url);
  const timeout = Number(timeoutS) * 1000;
  let results;
  if (url.includes("/examples/web/")) {
    await page.waitForSelector("body[data-ready]", { timeout });
    await page.click("#go");
    await page.waitForSelector("body[data-done]", { timeout });
    results = { output: await page.$eval("#output", (e) => e.value), stats: await page.$eval("#stats", (e) => e.textContent),
      pieces: Number(await page.$eval("body", (e) => e.dataset.pieces ?? 0)) };
  } else {
    await page.waitForFunction(() => window.__results !== undefined, null, { timeout });
    results = await page.evaluate(() => window.__results);
  }
  if (results.fatal) {
    console.error(results.fatal);
    process.exitCode = 1;
  }
  writeFileSync(out, JSON.stringify(results));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
