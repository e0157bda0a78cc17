"""llama.cpp's own C++ tools, built from the llama.cpp that the llama-cpp-python sdist vendors.

    python -m edgespec.bench.llama_tools            # build (once) and print the bin folder

Benches race edgespec against `llama-bench`, `llama-completion` (the non-interactive CLI), `llama-server`, `llama-speculative-simple` and
`llama-lookup` built from exactly the llama.cpp that edgespec runs through llama-cpp-python, with the same
CPU flags (AMX off, as scripts/install.sh builds it; see the README). The sdist comes from the package
registry (edgespec.exporters.llama_source fetches and keeps it unpacked); the build is cached under ~/.cache/edgespec/llama-tools/<key>/bin, keyed
by version, flags and machine, so only the first call pays its minutes (about 5 on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from edgespec.exporters.llama_source import LLAMA_CPP_PYTHON, llama_cpp_source

TOOLS = ("llama-bench", "llama-completion", "llama-server", "llama-speculative-simple", "llama-lookup")
NO_AMX = "-U__AMX_INT8__ -U__AMX_TILE__ -U__AMX_BF16__"  # as scripts/install.sh: AMX matmul crashes here
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def tools_dir() -> Path:
    key = hashlib.sha256("|".join((LLAMA_CPP_PYTHON, *CMAKE_FLAGS, platform.machine())).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgespec" / "llama-tools"
    return base / f"{LLAMA_CPP_PYTHON}-{key}" / "bin"


def ensure_tools(needed: tuple[str, ...] = TOOLS, log=sys.stderr) -> Path:
    """The folder holding the `needed` tools, building all of TOOLS first if the cache lacks one."""
    bin_dir = tools_dir()
    if all((bin_dir / t).is_file() for t in needed):
        return bin_dir
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp's tools needs cmake (apt-get install cmake)")
    source = llama_cpp_source(LLAMA_CPP_PYTHON, log)
    with tempfile.TemporaryDirectory(prefix="llama-tools-") as tmp:
        tmp = Path(tmp)
        build = tmp / "build"
        print(f"building {', '.join(TOOLS)} (minutes)", file=log)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TOOLS],
                       check=True, stdout=subprocess.DEVNULL)
        staging = bin_dir.with_name("bin.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(build / "bin" / tool, staging / tool)
        shutil.rmtree(bin_dir, ignore_errors=True)
        staging.rename(bin_dir)  # all tools appear at once, never a half-built folder
    return bin_dir


if __name__ == "__main__":
    print(ensure_tools())
