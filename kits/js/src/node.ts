/** Node entry point: onnxruntime-node (CPU by default) and bundles on the file system. */

import { readFile, stat } from "node:fs/promises";
import { resolve } from "node:path";
import * as ort from "onnxruntime-node";
import type { BundleOptions, BundleSource } from "./bundle.js";
import type { Engine } from "./engine.js";
import { openEngine } from "./index.js";

export * from "./index.js";
export { ort };

/** A bundle folder on disk. ONNX Runtime opens the model files itself (no copy through JS). */
export function folderSource(folder: string): BundleSource {
  const root = resolve(folder);
  const full = (path: string) => resolve(root, path);
  const missing = (err: unknown) => (err as NodeJS.ErrnoException)?.code === "ENOENT" ||
    (err as NodeJS.ErrnoException)?.code === "ENOTDIR";
  return {
    location: root,
    async read(path) {
      try {
        return new Uint8Array(await readFile(full(path)));
      } catch (err) {
        if (missing(err)) return null;
        throw err;
      }
    },
    async size(path) {
      try {
        const s = await stat(full(path));
        return s.isFile() ? s.size : null;
      } catch (err) {
        if (missing(err)) return null;
        throw err;
      }
    },
    modelPath: full,
  };
}

export interface NodeOptions extends BundleOptions {
  threads?: number; // ONNX Runtime intra-op threads (default: ONNX Runtime's choice)
}

/** Open a bundle folder: `const engine = await openBundle("./bundle"); await engine.generate("Hi")`. */
export async function openBundle(folder: string, options: NodeOptions = {}): Promise<Engine> {
  const sessionOptions = {
    executionProviders: ["cpu"], interOpNumThreads: 1,
    ...(options.threads ? { intraOpNumThreads: options.threads } : {}), ...(options.sessionOptions ?? {}),
  };
  return openEngine(ort, folderSource(folder), { ...options, sessionOptions });
}
