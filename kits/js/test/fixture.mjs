// The fixture tests/test_js_kit.py writes: bundles, prompts and the Python engine's outputs, computed in
// the same run. The Node tests compare against it and write what they produced to EDGESPEC_JS_OUT.
import { readFileSync, writeFileSync } from "node:fs";

const path = process.env.EDGESPEC_JS_FIXTURE;
if (!path) {
  throw new Error("EDGESPEC_JS_FIXTURE is not set: these tests compare against the Python engine; run them through " +
    "`python -m pytest tests/test_js_kit.py`, which exports the bundles and writes the fixture");
}
export const fixture = JSON.parse(readFileSync(path, "utf8"));

const outputs = {};
/** Record a result under a name (written to EDGESPEC_JS_OUT at once, so a later failure loses nothing). */
export function record(name, value) {
  outputs[name] = value;
  if (process.env.EDGESPEC_JS_OUT) writeFileSync(process.env.EDGESPEC_JS_OUT + `.${process.pid}.json`, JSON.stringify(outputs));
}
