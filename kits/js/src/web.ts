/** Browser entry point: onnxruntime-web (WebAssembly; WebGPU where asked) and bundles fetched from a URL. */

import * as ort from "onnxruntime-web";
import type { BundleOptions, BundleSource } from "./bundle.js";
import type { Engine } from "./engine.js";
import { openEngine } from "./index.js";

export * from "./index.js";
export { ort };

/** A bundle served over HTTP(S) at `baseUrl` (the folder's URL). A 404 is a missing file. */
export function urlSource(baseUrl: string, fetchImpl: typeof fetch = fetch): BundleSource {
  const base = new URL(baseUrl.endsWith("/") ? baseUrl : baseUrl + "/", globalThis.location?.href);
  return {
    location: base.href.replace(/\/$/, ""),
    async read(path) {
      const response = await fetchImpl(new URL(path, base));
      if (response.status === 404) return null;
      if (!response.ok) throw new Error(`fetching ${new URL(path, base)} failed: HTTP ${response.status}`);
      return new Uint8Array(await response.arrayBuffer());
    },
  };
}

export interface WebOptions extends BundleOptions {
  executionProviders?: string[]; // default ["wasm"]; ["webgpu", "wasm"] where the browser has WebGPU
  wasmPaths?: string; // where ort-wasm*.wasm are served (default: beside onnxruntime-web's script)
  threads?: number; // WebAssembly threads (more than 1 needs a cross-origin isolated page)
}

/** Open a bundle at a URL: `const engine = await openBundle("/models/bundle/")`. */
export async function openBundle(baseUrl: string, options: WebOptions = {}): Promise<Engine> {
  if (options.wasmPaths) ort.env.wasm.wasmPaths = options.wasmPaths;
  ort.env.wasm.numThreads = options.threads ?? 1;
  const sessionOptions = { executionProviders: options.executionProviders ?? ["wasm"], ...(options.sessionOptions ?? {}) };
  return openEngine(ort, urlSource(baseUrl), { ...options, sessionOptions });
}
