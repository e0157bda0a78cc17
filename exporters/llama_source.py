"""The llama.cpp source that llama-cpp-python vendors, fetched once and kept.

    python -m edgespec.exporters.llama_source        # fetch (once) and print the folder

The llama-cpp-python sdist carries the whole llama.cpp tree that edgespec runs: its C++ tools (built by
bench/llama_tools.py), `convert_hf_to_gguf.py` and its matching `gguf-py`. Using that tree, not a newer
llama.cpp, keeps every converted GGUF readable by the runtime that loads it. The sdist comes from the
package registry through `pip download` and is unpacked under ~/.cache/edgespec/llama-src/<version>;
it appears there whole or not at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python pyproject pins; its vendored llama.cpp is the one we run


def source_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgespec" / "llama-src"
    return base / version


def llama_cpp_source(version: str = LLAMA_CPP_PYTHON, log=sys.stderr) -> Path:
    """The vendored llama.cpp tree of llama-cpp-python `version` (the folder holding convert_hf_to_gguf.py)."""
    final = source_dir(version)
    if (final / "convert_hf_to_gguf.py").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-src-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        print(f"fetching the llama-cpp-python {version} sdist (llama.cpp's source)", file=log)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                        "llama-cpp-python", "-d", str(tmp), f"llama-cpp-python=={version}"], check=True)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        vendored = next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))
        shutil.rmtree(final, ignore_errors=True)
        vendored.rename(final)  # same filesystem: the tree appears whole
    return final


def llama_cpp_architectures(version: str = LLAMA_CPP_PYTHON) -> frozenset[str]:
    """The text-model architectures (config.json class names) its convert_hf_to_gguf.py converts."""
    import re

    registry = (llama_cpp_source(version) / "conversion" / "__init__.py").read_text(encoding="utf-8")
    table = registry.split("TEXT_MODEL_MAP", 1)[1].split("}", 1)[0]
    return frozenset(re.findall(r'"(\w+)"\s*:', table))


if __name__ == "__main__":
    print(llama_cpp_source())
