/** Errors a user can cause (a bad bundle, bad options, a prompt too long): one message that says what
 * is wrong and what to do. Mirrors edgespec.errors in Python. */
export class EdgespecError extends Error {
  override name = "EdgespecError";
}

/** A bundle file is missing, truncated or not what the manifest says. */
export class BundleError extends EdgespecError {
  override name = "BundleError";
}

/** The draft's vocabulary differs from the target's. */
export class VocabMismatchError extends EdgespecError {
  override name = "VocabMismatchError";
}

/** The prompt plus the tokens asked for do not fit the context. */
export class ContextOverflowError extends EdgespecError {
  override name = "ContextOverflowError";
}
