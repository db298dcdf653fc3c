#!/usr/bin/env bash
# On a bare lent NVIDIA machine (see docs/PERF.md): unpack the carried Vulkan loader, install
# the carried wheels and zdsl, then run the given command. Needs carry/ from make-carry.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
for f in carry/gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-deps --no-index carry/whl/*.whl 2>&1 | grep -v "^WARNING" || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING" || true
"$@"
