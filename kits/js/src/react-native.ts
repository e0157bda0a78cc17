/**
 * React Native entry point: onnxruntime-react-native (iOS and Android; CPU, and Core ML / NNAPI where
 * asked) and a bundle folder on the device. Not run in this project's CI (no device or simulator there);
 * the engine it drives is the one the Node and browser tests run.
 */

import * as ort from "onnxruntime-react-native";
import type { BundleOptions, BundleSource } from "./bundle.js";
import type { Engine } from "./engine.js";
import { openEngine, type Ort } from "./index.js";

export * from "./index.js";
export { ort };

/** How the app reads files (for example react-native-fs: `readFile(path, "base64")` then decode). */
export interface DeviceFiles {
  readFile(path: string): Promise<Uint8Array>;
  exists(path: string): Promise<boolean>;
  size(path: string): Promise<number>;
}

/** A bundle folder on the device's file system; ONNX Runtime opens the model files by path. */
export function deviceSource(folder: string, files: DeviceFiles): BundleSource {
  const root = folder.replace(/\/$/, "");
  const full = (path: string) => `${root}/${path}`;
  return {
    location: root,
    async read(path) {
      return (await files.exists(full(path))) ? files.readFile(full(path)) : null;
    },
    async size(path) {
      return (await files.exists(full(path))) ? files.size(full(path)) : null;
    },
    modelPath: full,
  };
}

export interface ReactNativeOptions extends BundleOptions {
  executionProviders?: string[]; // default ["cpu"]; e.g. ["coreml", "cpu"] on iOS, ["nnapi", "cpu"] on Android
}

/** Open a bundle folder on the device. */
export async function openBundle(folder: string, files: DeviceFiles, options: ReactNativeOptions = {}): Promise<Engine> {
  const sessionOptions = { executionProviders: options.executionProviders ?? ["cpu"], ...(options.sessionOptions ?? {}) };
  return openEngine(ort as unknown as Ort, deviceSource(folder, files), { ...options, sessionOptions });
}
