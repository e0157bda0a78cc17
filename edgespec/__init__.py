"""edgespec: speculative decoding for language models on edge hardware."""

__version__ = "0.1.0"
