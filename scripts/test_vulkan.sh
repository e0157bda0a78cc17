#!/usr/bin/env bash
# The GPU code path, executed: build llama-cpp-python with Vulkan into .venv-vulkan (scripts/install.sh
# --vulkan; Debian's toolchain and Mesa's software Vulkan device, lavapipe, where no GPU is present) and
# run tests/test_vulkan.py there. Kept out of .ci/run: the Vulkan wheel is a second llama.cpp build
# (~10 minutes on 2 cores the first time) and lavapipe runs every kernel in software, while CI already
# takes about 30 minutes; run this when the GPU side (offload, device memory, the guard) changes.
#   bash scripts/test_vulkan.sh [pytest args]     # e.g. -k memory
# Writes the pytest output to bench/out/vulkan-tests.log as well.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vulkan}"
export VENV
bash scripts/install.sh --vulkan
"$VENV"/bin/python -m pip install --quiet "pytest>=8"  # all tests/test_vulkan.py and its helpers need

# llama.cpp skips CPU-type Vulkan devices (lavapipe) unless told; on a machine with a real GPU, unset it.
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES-0}"
echo "vulkaninfo: $(vulkaninfo --summary 2>/dev/null | grep -m1 deviceName | sed 's/.*= //')" >&2
mkdir -p bench/out
"$VENV"/bin/python -m pytest -v -rs -s tests/test_vulkan.py "$@" 2>&1 | tee bench/out/vulkan-tests.log
exit "${PIPESTATUS[0]}"
