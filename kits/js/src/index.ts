/**
 * @edgespec/kit: edgespec's speculative decoding loop over onnxruntime-common. This module is the
 * platform-free core; import the entry point for your platform (`@edgespec/kit/node`, `/web`,
 * `/react-native`), which injects its ONNX Runtime package and a way to read bundle files.
 */

import { type BundleOptions, type BundleSource, openBundleWith } from "./bundle.js";
import { Engine } from "./engine.js";
import type { Ort } from "./model.js";

export { type BundleOptions, type BundleSource, MANIFEST, openBundleWith, type OpenedBundle, readManifest } from "./bundle.js";
export { DraftModelDrafter, type Draft, type Drafter, PromptLookupDrafter, syncTo } from "./drafters.js";
export {
  DEFAULT_CONFIG, DEFAULT_DRAFT_MAX, Engine, type GenerationConfig, type GenerationResult, GenerationStream,
  type Mode, MODES, type Prompt, TextAssembler,
} from "./engine.js";
export { BundleError, ContextOverflowError, EdgespecError, VocabMismatchError } from "./errors.js";
export { OnnxModel, type Ort } from "./model.js";
export { DEFAULT_SAMPLING, Rng, Sampler, type SamplingParams, sample, tokenDistribution } from "./sampling.js";
export { GenerationStats } from "./stats.js";
export { acceptGreedy, acceptSampling, type Verifier } from "./verify.js";
export { type ChatMessage, Vocab, type VocabInfo, vocabDifference } from "./vocab.js";

/** Open a bundle with a given ONNX Runtime package and file source: the engine, ready to generate. */
export async function openEngine(ort: Ort, source: BundleSource, options: BundleOptions = {}): Promise<Engine> {
  const bundle = await openBundleWith(ort, source, options);
  return new Engine(bundle.target, bundle.vocab, bundle.draft);
}
