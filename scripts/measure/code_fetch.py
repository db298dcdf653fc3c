"""What a dependent dispatch pays to fetch its shader code (docs/DESIGN.md).

Usage: python3 code_fetch.py [DEVICE (default 0)] [CHAIN (default 40)]

Inside the decode step a kernel's first use costs far more than a second use right after it, and
the gap grows with the shader's size (scripts/measure/stage_costs.py). The guess: 2 GB of weights
stream through the L2 cache every token, so each dispatch fetches its instructions from memory.

A chain of L dependent dispatches of a kernel that does no memory work but runs N unrolled
integer steps (its code grows with N; every step is executed once), 132 workgroups of 64:
- "same": one pipeline for every link, its code hot after the first;
- "distinct": a pipeline of its own per link (the constants differ), code in L2 at best;
- "distinct+flush": the same after 128 MB have been copied through the cache (the first link
  reads the copy, so it waits for it), so every link's code comes from memory (the flush is
  timed alone and subtracted)."""
import time

import numpy as np

import zdsl
from chains import device_and_links, keep_busy
from zdsl import Buffer, Const, u32
from zdsl.autotune.timing import copy_vec4
from zdsl.lang.language import cdiv


@zdsl.kernel(workgroup=64)
def busy(src: Buffer[u32], dst: Buffer[u32], N: Const = 64, SALT: Const = 0):
    """dst[i] = N rounds of xor-shift-multiply from src[0] + i, four independent chains; the
    multipliers depend on SALT, so each SALT is a shader of its own."""
    i = zdsl.global_id()
    vs = [src[0] + i + c for c in range(4)]
    for j in range(N):
        for c in range(4):
            m = (0x9E3779B1 + 2 * (j * 4 + c) + 2 * 7919 * SALT) | 1
            vs[c] = (vs[c] ^ (vs[c] >> (3 + (j + c) % 13))) * m
    dst[i] = vs[0] ^ vs[1] ^ vs[2] ^ vs[3]


def chain_us(dev, variants, flush, L, groups=132):
    bufs = [dev.alloc(4 * 64 * groups) for _ in range(2)]
    seq = dev.sequence()
    if flush:
        a, b = flush
        v, n4 = copy_vec4.specialize(), a.nbytes // 16
        v.dispatch(seq, cdiv(n4, 256 * v.params["UNROLL"]), src=a, dst=b, n4=n4)
    for l in range(L):
        if variants:
            src = flush[1] if flush and l == 0 else bufs[l % 2]
            variants[l % len(variants)].dispatch(seq, groups, src=src, dst=bufs[(l + 1) % 2])
    keep_busy(lambda: seq.run(3))
    ts = []
    for _ in range(9):
        t = time.perf_counter()
        seq.run(10)
        ts.append((time.perf_counter() - t) / 10 * 1e6)
    seq.free()
    for x in bufs:
        x.free()
    return float(np.median(ts))


def main():
    dev, L = device_and_links()
    flush = (dev.alloc(128 << 20), dev.alloc(128 << 20))
    alone = chain_us(dev, [], flush, L)
    print(f"flush alone: {alone:.1f} us", flush=True)
    for N in (16, 64, 256, 1024):
        distinct = [busy.specialize(N=N, SALT=s) for s in range(L)]
        for v in distinct:
            v.pipeline(dev)
        same = chain_us(dev, distinct[:1], None, L) / L
        dist = chain_us(dev, distinct, None, L) / L
        cold = (chain_us(dev, distinct, flush, L) - alone) / L
        stats = distinct[0].pipeline(dev, statistics=True).statistics or {}
        size = {k: v for k, v in stats.items() if "size" in k.lower() or "instruction" in k.lower()}
        print(f"N={N:5d} spirv {len(distinct[0].spirv):7d} B {size}: same {same:6.2f}, distinct {dist:6.2f}, "
              f"distinct+flush {cold:6.2f} us/link", flush=True)
    print("statistics:", distinct[0].pipeline(dev, statistics=True).statistics)


if __name__ == "__main__":
    main()
