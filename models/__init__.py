"""The catalog of known models and target/draft pairs, and the local model store."""
