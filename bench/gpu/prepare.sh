#!/usr/bin/env bash
# Prepare what bench/gpu/run.py needs on a GPU machine with no network, here where PyPI is reachable:
#   bench/gpu/carry/llama_cpp_python-0.3.36-stripped.tar.gz   the sdist without models, docs, examples,
#       tests, tools, .git and the ggml backends other than CPU and CUDA (77 MB -> about 4 MB)
#   bench/gpu/carry/wheels/*.whl   edgespec's run-time dependencies and the build's (scikit-build-core,
#       setuptools, pip) for CPython 3.12 on manylinux x86-64, less numpy (torch's machine has it)
# then prints the size of the working tree plus the carry against the device tool's 64 MiB.
#
#   bash bench/gpu/prepare.sh            # then carry bench/gpu/carry (git-ignored) with the tree
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
CARRY=bench/gpu/carry
VERSION=0.3.36
mkdir -p "$CARRY/wheels"

# 1. The sdist from the registry, stripped to what the CUDA build reads.
stripped="$CARRY/llama_cpp_python-$VERSION-stripped.tar.gz"
if [ ! -f "$stripped" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # pip prepares the sdist's metadata in an isolated build environment (a minute), and checks the
  # index's hash; the registry this machine uses may be a mirror without PyPI's JSON API.
  echo "downloading the llama-cpp-python $VERSION sdist (77 MB)" >&2
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
  mv "$tmp/llama_cpp_python-$VERSION.tar.gz" "$tmp/sdist.tar.gz"
  tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
  src="$tmp/llama_cpp_python-$VERSION"
  rm -rf "$src"/{.git,.github,docker,docs,examples,tests,scripts}
  (cd "$src/vendor/llama.cpp" && rm -rf models docs examples tests benches media gguf-py scripts conversion pocs \
     tools app skills grammars requirements ci licenses ./*.py)
  # Backends other than CPU and CUDA are added only when switched on (ggml_add_backend); HIP and MUSA
  # reuse the CUDA sources and stay.
  for d in "$src"/vendor/llama.cpp/ggml/src/ggml-*/; do
    case "$(basename "$d")" in ggml-cpu|ggml-cuda|ggml-hip|ggml-musa) ;; *) rm -rf "$d" ;; esac
  done
  tar czf "$stripped.partial" -C "$tmp" "llama_cpp_python-$VERSION" && mv "$stripped.partial" "$stripped"
  echo "wrote $stripped ($(du -h "$stripped" | cut -f1))" >&2
fi

# 2. Wheels: edgespec's dependencies from pyproject.toml (not llama-cpp-python: it is built there),
#    llama-cpp-python's own (diskcache, typing-extensions), and the build's.
mapfile -t deps < <("$PY" -c '
import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not d.lower().startswith("llama-cpp-python"):
        print(d.split(";")[0].strip())')
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$CARRY/wheels" "${deps[@]}" diskcache "typing-extensions>=4.5" "scikit-build-core>=0.9.2" \
  "setuptools>=69" wheel pip
rm -f "$CARRY"/wheels/numpy-*.whl   # torch's machine has numpy; pip keeps the installed one

# 3. What the device tool carries: the working tree (tracked and untracked files git does not ignore) plus this.
"$PY" - "$CARRY" <<'EOF'
import os, subprocess, sys
carry = sys.argv[1]
tree = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True).stdout
tree_bytes = sum(os.path.getsize(p) for p in tree.decode().split("\0") if p and os.path.isfile(p))
carry_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(carry) for f in fs)
mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
total = tree_bytes + carry_bytes
print(f"working tree {mib(tree_bytes)} + {carry} {mib(carry_bytes)} = {mib(total)} of the 64 MiB a call carries"
      + ("" if total < 64 * 2**20 else "  <-- TOO LARGE"))
sys.exit(0 if total < 64 * 2**20 else 1)
EOF
