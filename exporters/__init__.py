"""Offline exporters: Hugging Face checkpoints in, quantized artifacts and a manifest out."""
