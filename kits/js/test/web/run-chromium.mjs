// Drives headless Chromium (the system's package; playwright-core never downloads a browser) through one
// page and writes the window.__results it leaves. Usage: node run-chromium.mjs URL OUT.json [CHROMIUM]
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
  await page.waitForFunction(() => window.__results !== undefined, null, { timeout: Number(timeoutS) * 1000 });
  const results = await page.evaluate(() => window.__results);
  if (results.fatal) {
    console.error(results.fatal);
    process.exitCode = 1;
  }
  writeFileSync(out, JSON.stringify(results));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
