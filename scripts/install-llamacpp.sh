#!/usr/bin/env bash
# Optional peer build: llama-cpp-python compiled from source (CPU only) into .venv, so that
# `pytest -m llamacpp` can compare our numpy reference with llama.cpp's own Qwen3.5 graph.
# Source, not a wheel: the wheel on PyPI may lag the vendored llama.cpp that knows qwen35.
# Takes many minutes on 2 cores; idempotent (skips when llama_cpp already imports).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
[ -x "$PY" ] || ./scripts/setup.sh
if "$PY" -c 'import llama_cpp' 2>/dev/null; then
    echo "llama-cpp-python already installed: $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')"
    exit 0
fi
# No llava/mtmd library, no tools or examples: only libllama and its Python bindings.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$PY" -m pip install --no-binary llama-cpp-python --no-cache-dir "llama-cpp-python>=0.3.36" "$@"
"$PY" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
