"""Model runtimes: evaluate token batches, return logits rows, roll KV back. Nothing about speculation."""
