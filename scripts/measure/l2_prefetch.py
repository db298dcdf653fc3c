"""Whether prefetching weights into L2 beside a small dispatch pays (docs/PERF.md, 2026-11-23).

Usage: python3 l2_prefetch.py [DEVICE (default 0)] [CHAIN (default 40)]

A chain of layers: norm (one workgroup) -> qkv (Q5_K 2048 -> 8192) + gate (Q4_K 2048 -> 4096),
each layer with weights of its own (cold): as is, with a kernel reading the layer's weights
dispatched beside the norm (prefetch*), and with every layer on the first layer's weights (hot).
Also the prefetches alone and a norm followed by a tiny projection."""
import sys
import time

import numpy as np

import zdsl
from zdsl import Buffer, Const, u32
from zdsl.autotune.database import choose
from zdsl.autotune.problems import _rows
from zdsl.kernels import dmmv, dmmv_q8, q8_1
from zdsl.lang.language import cdiv
from zdsl.runtime import open_device


@zdsl.kernel(workgroup="WG", variants={"WG": [256]})
def prefetch(w: Buffer[u32], sink: Buffer[u32], n4: u32, WG: Const = 256, PER: Const = 4):
    base = zdsl.workgroup_id() * (WG * PER) + zdsl.local_index()
    idx = [base + u * WG for u in range(PER)]
    vs = [w.vec4.load(i, mask=i < n4, other=0) for i in idx]
    acc = vs[0]
    for v in vs[1:]:
        acc = acc ^ v
    s = acc.x ^ acc.y ^ acc.z ^ acc.w
    with zdsl.if_(s == 0x9E3779B9):
        sink[zdsl.global_id()] = s

dev = open_device(sys.argv[1] if len(sys.argv) > 1 else "0")
info = dev.info
H, L = 2048, int(sys.argv[2]) if len(sys.argv) > 2 else 40
rng = np.random.default_rng(0)
qkv = [dev.upload(_rows(rng, "q5_k", 8192, H), name=f"qkv{l}") for l in range(L)]
zw = [dev.upload(_rows(rng, "q4_k", 4096, H), name=f"z{l}") for l in range(L)]
norm_w = dev.upload(np.ones(H, np.float32))
x = dev.upload(rng.standard_normal(H).astype(np.float32))
hn = dev.alloc(4 * H); xq = dev.alloc(H); xd = dev.alloc(4 * H // 16)
mix = dev.alloc(4 * 8192); z = dev.alloc(4 * 4096)
sink = dev.alloc(4 * 1 << 22)
print("weights MB", qkv[0].nbytes / 1e6, zw[0].nbytes / 1e6, flush=True)
norm = choose(q8_1.norm_q8_1, info, {"n": H})
pv = prefetch.specialize()
pv8 = prefetch.specialize(PER=8)
def proj(seq, w, y, q, m):
    v = choose(dmmv_q8.dmmv_q8, info, {"QTYPE": q, "k": H, "m": m}, QTYPE=q)
    v.dispatch(seq, cdiv(m, dmmv.rows_per_workgroup(v)), w=w, xq=xq, xd=xd, y=y, k=H, m=m)
def pf(seq, w, slot, per=4):
    n4 = w.nbytes // 16
    (pv if per == 4 else pv8).dispatch(seq, cdiv(n4, 256 * per), w=w, sink=sink.slice(4 * slot * 65536, 4*65536), n4=n4)
def record(mode):
    seq = dev.sequence()
    for l in range(L):
        lw = 0 if mode == "hot" else l
        norm.dispatch(seq, 1, x=x, norm_w=norm_w, hn=hn, xq=xq, xd=xd, n=H, eps=1e-6)
        if mode == "prefetch":
            pf(seq, qkv[lw], 0); pf(seq, zw[lw], 1)
        if mode == "prefetch8":
            pf(seq, qkv[lw], 0, 8); pf(seq, zw[lw], 1, 8)
        if mode == "prefetch_qkv":
            pf(seq, qkv[lw], 0)
        proj(seq, qkv[lw], mix, "q5_k", 8192)
        proj(seq, zw[lw], z, "q4_k", 4096)
    return seq
def prefetch_only():
    seq = dev.sequence()
    for l in range(L):
        pf(seq, qkv[l], 0); pf(seq, zw[l], 1)
        norm.dispatch(seq, 1, x=x, norm_w=norm_w, hn=hn, xq=xq, xd=xd, n=H, eps=1e-6)
    return seq
def normonly():
    seq = dev.sequence()
    for l in range(L):
        norm.dispatch(seq, 1, x=x, norm_w=norm_w, hn=hn, xq=xq, xd=xd, n=H, eps=1e-6)
        proj(seq, zw[0], z, "q4_k", 32)  # tiny dependent
    return seq
seqs = {m: record(m) for m in ("cold", "prefetch", "prefetch8", "prefetch_qkv", "hot")}
seqs["prefetch_only"] = prefetch_only()
seqs["norm_chain"] = normonly()
for s in seqs.values():
    s.run(5)
res = {m: [] for m in seqs}
for r in range(7):
    for m, s in seqs.items():
        t = time.perf_counter(); s.run(20); res[m].append((time.perf_counter() - t) / 20 / L * 1e6)
for m, v in res.items():
    print(f"{m:14s} {np.median(v):7.2f} us per layer  (min {min(v):.2f})", flush=True)
