#!/usr/bin/env bash
# Install edgespec into ./.venv from nothing: a CPU build of llama-cpp-python, then edgespec itself.
#   bash scripts/install.sh            # runtime only
#   bash scripts/install.sh --test     # plus the test dependencies, the ray extra (Ray Serve), the mlx extra
#                                      #   (MLX's CPU backend on Linux), and the JS kit's
#                                      #   (kits/js: npm ci from the registry, tsc; Debian's chromium for its browser test)
#   bash scripts/install.sh --bench    # plus the benchmark dependencies (matplotlib)
#   bash scripts/install.sh --export   # plus `edgespec export` (torch 2.13.0 CPU, transformers, optimum-onnx,
#                                      #   onnxruntime, coremltools): about 1.5 GB
#
# llama-cpp-python ships only as source, so pip compiles llama.cpp (4-8 minutes on 2 cores). The
# wheel is kept in ~/.cache/edgespec/wheels under a key of version + build flags, so the next
# install on this machine takes seconds. pip's own wheel cache cannot be trusted for this: it
# ignores CMAKE_ARGS and would hand back a wheel built with other flags.
#
# AMX is switched off in the CPU build: llama.cpp's AMX matmul (llama-cpp-python 0.3.36) crashed
# with SIGSEGV on every multi-token batch on the Sapphire Rapids VMs we test on, which breaks
# prompt prefill and speculative verification alike. Set EDGESPEC_LLAMA_CMAKE_ARGS to build
# differently (for example "-DGGML_CUDA=on"; see docs/install.md).
set -euo pipefail

cd "$(dirname "$0")/.."
LLAMA_VERSION=0.3.36
NO_AMX="-U__AMX_INT8__ -U__AMX_TILE__ -U__AMX_BF16__"
CMAKE_ARGS_DEFAULT="-DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}'"
LLAMA_CMAKE_ARGS="${EDGESPEC_LLAMA_CMAKE_ARGS:-$CMAKE_ARGS_DEFAULT}"
PYTHON="${PYTHON:-python3}"

extras=""
with_test=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test,ray,mlx"; with_test=1 ;;  # Ray Serve tests on a real local Ray; MLX on its CPU backend
    --bench) extras="${extras:+$extras,}bench" ;;
    --export) extras="${extras:+$extras,}export" ;;
    *) echo "error: unknown option $arg (use --test, --bench and/or --export)" >&2; exit 2 ;;
  esac
done

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip

key=$(printf '%s|%s|%s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$(uname -m)" | sha256sum | cut -c1-16)
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/edgespec/wheels/$key"
if ! ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $LLAMA_VERSION (CMAKE_ARGS=$LLAMA_CMAKE_ARGS); this takes minutes" >&2
  tmp=$(mktemp -d)
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" .venv/bin/python -m pip wheel --no-deps --no-cache-dir \
    -w "$tmp" "llama-cpp-python==$LLAMA_VERSION"
  mkdir -p "$wheels" && mv "$tmp"/llama_cpp_python-*.whl "$wheels"/ && rm -rf "$tmp"
fi
.venv/bin/python -m pip install --quiet "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"

# The TypeScript kit's tests (tests/test_js_kit.py) run it on Node and in headless Chromium.
# onnxruntime-node ships its CPU binaries in the npm package; ONNXRUNTIME_NODE_INSTALL=skip stops its
# install script fetching the CUDA provider from an outside download site (only package registries are reachable in CI).
if [ -n "$with_test" ]; then
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "error: the JS kit's tests need Node.js 20 and npm on PATH (apt-get install nodejs npm)" >&2; exit 2
  fi
  (cd kits/js && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error && npm run --silent build)
  if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "installing Debian's chromium for the kit's browser test" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
      echo "error: the kit's browser test needs Chromium at /usr/bin/chromium: sudo apt-get install chromium" >&2; exit 2
    fi
  fi
fi
echo "installed: $(.venv/bin/edgespec --help >/dev/null && echo edgespec) in $(pwd)/.venv" >&2
