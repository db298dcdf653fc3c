"""attn_prefill_coop alone: one 512-token chunk of the 35B-A3B's attention (16 heads of 256 over
2 KV heads) at depths 4,096 and 32,768, f16 and q8_0 caches (docs/DESIGN.md).

Usage: python3 attn_prefill_alone.py [NAME=VALUE,... (a variant; several: each timed)] ...

Median µs of 15 dispatches after 3, on the kernel's own example (tuner.Measure), and the
registers a lane the driver gave the variant."""
import sys
from types import SimpleNamespace

import numpy as np

from zdsl.autotune.tuner import Measure, free
from zdsl.kernels.attention import attn_prefill_coop, attn_prefill_coop_example
from zdsl.runtime import open_device

variants = [{k: int(x) for k, x in (p.split("=") for p in arg.split(","))} for arg in sys.argv[1:]] or [{}]
dev = open_device("0")
measure = Measure(dev, warmup=3, repeats=15, warm_s=0.2, cache_bytes=64 << 20)
for depth in (4096, 32768):
    for kv in ("f16", "q8_0"):
        use = SimpleNamespace(fixed={"D": 256, "G": 8, "Q8": True, "KT": kv, "VT": kv},
                              sizes={"n_kv": 2, "t": 512, "ctx": depth + 512}, buffers={},
                              variant=SimpleNamespace(params={"KT": kv, "VT": kv}))
        example = attn_prefill_coop_example(use, np.random.default_rng(0), False)
        bufs = measure.upload(example, 1)
        row = []
        try:
            for params in variants:
                v = attn_prefill_coop.specialize(D=256, G=8, Q8=True, KT=kv, VT=kv, SG=32, **params)
                us = measure.time(example, bufs, [v])[0]
                stats = v.pipeline(dev, statistics=True).statistics or {}
                regs = next((n for k, n in stats.items() if "egister" in k), "?")
                row.append(f"{params or 'default'} {us:,.0f} µs ({regs} registers)")
        finally:
            free(bufs)
        print(f"depth {depth:,} {kv}: " + " | ".join(row), flush=True)
dev.close()
