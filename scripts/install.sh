#!/usr/bin/env bash
# Install edgespec into ./.venv from nothing: a CPU build of llama-cpp-python, then edgespec itself.
#   bash scripts/install.sh            # runtime only
#   bash scripts/install.sh --test     # plus the test dependencies, the ray extra (Ray Serve), the mlx extra
#                                      #   (MLX's CPU backend on Linux), and the JS kit's
#                                      #   (kits/js: npm ci from the registry, tsc; Debian's chromium for its browser test)
#   bash scripts/install.sh --bench    # plus the benchmark dependencies (matplotlib)
#   bash scripts/install.sh --export   # plus `edgespec export` (torch 2.13.0 CPU, transformers, optimum-onnx,
#                                      #   onnxruntime, coremltools): about 1.5 GB
#   bash scripts/install.sh --vulkan   # a Vulkan build instead, into ./.venv-vulkan (VENV= to choose): Debian's
#                                      #   Vulkan toolchain and Mesa's software device (lavapipe) via apt-get
#
# VENV (default .venv; .venv-vulkan with --vulkan) is the environment the script makes and fills.
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
vulkan=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test,ray,mlx"; with_test=1 ;;  # Ray Serve tests on a real local Ray; MLX on its CPU backend
    --bench) extras="${extras:+$extras,}bench" ;;
    --export) extras="${extras:+$extras,}export" ;;
    --vulkan) vulkan=1 ;;
    *) echo "error: unknown option $arg (use --test, --bench, --export and/or --vulkan)" >&2; exit 2 ;;
  esac
done

# The Vulkan build lives in its own venv, so the CPU venv (and CI, which uses it) never changes under it.
if [ -n "$vulkan" ]; then
  VENV="${VENV:-.venv-vulkan}"
  LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS -DGGML_VULKAN=on"
  # glslc compiles the backend's shaders; spirv-headers and libvulkan-dev are its build inputs;
  # mesa-vulkan-drivers brings lavapipe, a Vulkan device on the CPU; vulkan-tools brings vulkaninfo.
  vk_packages="glslc libvulkan-dev spirv-headers mesa-vulkan-drivers vulkan-tools"
  # shellcheck disable=SC2086
  if ! dpkg -s $vk_packages >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      echo "installing Debian's Vulkan toolchain and Mesa's Vulkan drivers" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $vk_packages >/dev/null
    else
      echo "error: the Vulkan build needs: sudo apt-get install $vk_packages" >&2; exit 2
    fi
  fi
fi
VENV="${VENV:-.venv}"

[ -x "$VENV"/bin/python ] || "$PYTHON" -m venv "$VENV"
"$VENV"/bin/python -m pip install --quiet --upgrade pip

# Debian 12's Vulkan headers (1.3.239) predate vk::LayerSettingEXT (1.3.261), which the vendored backend
# uses only to switch on the validation layer's best-practice checks when creating its instance. The
# guard creates the instance without that settings chain on older headers; nothing else changes.
# Idempotent: a tree that already has the guard is left as it is.
patch_vulkan_headers_guard() {
  "$VENV"/bin/python - "$1/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
start = "    VkBool32 enable_best_practice = layer_settings;\n"
create = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);\n"
if "EDGESPEC_VK_LAYER_SETTINGS_GUARD" in src:
    sys.exit(0)
head, sep, rest = src.partition(start)
block, sep2, tail = rest.partition(create)
if not sep or not sep2:
    sys.exit(f"error: {path}: the instance-creation block to guard was not found")
guarded = ("#if VK_HEADER_VERSION >= 261  // EDGESPEC_VK_LAYER_SETTINGS_GUARD\n" + start + block + create +
           "#else\n    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n"
           "#endif\n")
open(path, "w").write(head + guarded + tail)
PY
}

key=$(printf '%s|%s|%s%s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$(uname -m)" "${vulkan:+|vk-headers-guard}" \
  | sha256sum | cut -c1-16)
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/edgespec/wheels/$key"
if ! ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $LLAMA_VERSION (CMAKE_ARGS=$LLAMA_CMAKE_ARGS); this takes minutes" >&2
  tmp=$(mktemp -d)
  source="llama-cpp-python==$LLAMA_VERSION"
  if [ -n "$vulkan" ]; then  # built from the patched source tree, not the name
    "$VENV"/bin/python -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "$source"
    tar xzf "$tmp"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$tmp"
    source="$tmp/llama_cpp_python-$LLAMA_VERSION"
    patch_vulkan_headers_guard "$source"
  fi
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$VENV"/bin/python -m pip wheel --no-deps --no-cache-dir \
    -w "$tmp" "$source"
  mkdir -p "$wheels" && mv "$tmp"/llama_cpp_python-*.whl "$wheels"/ && rm -rf "$tmp"
fi
"$VENV"/bin/python -m pip install --quiet "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
"$VENV"/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"

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
echo "installed: $("$VENV"/bin/edgespec --help >/dev/null && echo edgespec) in $(pwd)/$VENV" >&2
