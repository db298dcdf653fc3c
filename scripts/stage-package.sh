#!/usr/bin/env bash
# Lay out a zdsl source tree as the importable package it installs as (zdsl/, with kernels/,
# runtime/, models/ and autotune/ inside), without pip: `PYTHONPATH=OUT python3 -m zdsl.cli`.
# Two trees staged side by side can be run against each other in one session (A/B benchmarks).
set -euo pipefail
src=$1 out=$2
rm -rf "$out" && mkdir -p "$out"
cp -r "$src/zdsl" "$out/zdsl"
for part in kernels runtime models autotune; do
    cp -r "$src/$part" "$out/zdsl/$part"
done
