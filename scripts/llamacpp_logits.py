#!/usr/bin/env python3
"""Logits from llama.cpp (llama-cpp-python, see scripts/install-llamacpp.sh) for given token ids.

Runs in its own process so that llama.cpp's logging and any abort stay out of the caller:
the first --prompt tokens go in one batch (llama.cpp's chunked delta-net path), the rest one
token at a time (its recurrent path), and all logits are saved as a (T, vocab) float32 .npy.

    scripts/llamacpp_logits.py MODEL.gguf --tokens 1,2,3 --prompt 2 --out logits.npy
"""

import argparse
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--prompt", type=int, default=None, help="tokens evaluated in the first batch (default: all)")
    ap.add_argument("--kv", choices=["f32", "f16"], default="f32", help="KV cache type")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed; run scripts/install-llamacpp.sh", file=sys.stderr)
        return 3

    tokens = [int(t) for t in args.tokens.split(",")]
    prompt = len(tokens) if args.prompt is None else args.prompt
    kv_type = {"f32": 0, "f16": 1}[args.kv]  # GGML_TYPE_F32, GGML_TYPE_F16
    llm = Llama(model_path=args.model, n_ctx=max(64, len(tokens) + 8), n_batch=max(prompt, 1),
                n_ubatch=max(prompt, 1), logits_all=True, n_threads=2, n_threads_batch=2,
                type_k=kv_type, type_v=kv_type, verbose=False)
    llm.eval(tokens[:prompt])
    for t in tokens[prompt:]:
        llm.eval([t])
    np.save(args.out, np.array(llm.scores[: len(tokens)], dtype=np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
