"""edgespec: speculative decoding for language models on edge hardware.

    import edgespec
    with edgespec.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b") as engine:
        print(engine.generate("...", edgespec.GenerationConfig(max_tokens=64)).text)
"""

from edgespec.engine import Engine, GenerationConfig

__version__ = "0.1.0"

load = Engine.load  # model names (catalog, path, hf:, ollama:, lmstudio:, bundle) to a ready engine

__all__ = ["Engine", "GenerationConfig", "load", "__version__"]
