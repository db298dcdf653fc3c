"""What an arrival counter costs, against a dispatch of its own (docs/PERF.md, 2026-11-23).

Usage: python3 arrivals.py [DEVICE (default 0)] [CHAIN (default 40)]

Chains of dependent dispatches of N workgroups, each writing its share of a vector, then:
mode 0, nothing more (norm: a norm_q8_1 dispatch after each); mode 1, zdsl.last_workgroup on
one counter; mode 2, a two-level counter (groups of 64, then one). With norm, the last
workgroup of modes 1 and 2 norms a 2048-wide vector (q8_1.write_normed)."""
import sys
import time

import numpy as np

import zdsl
from chains import keep_busy
from zdsl import Buffer, Coherent, Const, f32, u32
from zdsl.autotune.database import choose
from zdsl.kernels import q8_1
from zdsl.kernels.q8_1 import write_normed
from zdsl.runtime import open_device


def last_of(counter, index, of):
    """True in the last of `of` workgroups arriving at counter[index] (which it resets): the
    same fence, barrier and atomic as zdsl.last_workgroup, with a count of our own."""
    zdsl.memory_barrier()
    zdsl.barrier()
    flag = zdsl.shared(u32, 1)
    with zdsl.if_(zdsl.local_index() == 0):
        last = zdsl.atomic_add(counter, index, 1) == of - 1
        zdsl.memory_barrier()
        flag[0] = zdsl.where(last, 1, 0, u32)
        with zdsl.if_(last):
            counter[index] = 0
    zdsl.barrier()
    return flag[0] == 1


def arrive(counter, MODE, G=64):
    if MODE == 1:
        return zdsl.last_workgroup(counter, 0)
    groups = zdsl.num_workgroups(0)
    g = zdsl.workgroup_id(0) // G
    flag = zdsl.var(0, u32)
    with zdsl.if_(last_of(counter, 1 + g, zdsl.min(groups - g * G, G))):
        with zdsl.if_(last_of(counter, 0, (groups + (G - 1)) // G)):
            flag.set(1)
    return flag == 1


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256]})
def chain(x: Coherent[f32], counter: Buffer[u32], norm_w: Buffer[f32], hn: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32],
          n: u32, nn: u32, MODE: Const = 0, NORM: Const = False, WG: Const = 64, SG: Const = 32):
    i = zdsl.global_id()
    with zdsl.if_(i < n):
        x[i] = x[i] * 0.999 + 0.001
    if MODE:
        with zdsl.if_(arrive(counter, MODE)):
            if NORM:
                write_normed(x, norm_w, hn, xq, xd, nn, 1e-6, WG, SG)
            else:
                with zdsl.if_(zdsl.local_index() == 0):
                    hn[0] = x[0]

dev = open_device(sys.argv[1] if len(sys.argv) > 1 else "0")
nv = choose(q8_1.norm_q8_1, dev.info, {"n": 2048})
L = int(sys.argv[2]) if len(sys.argv) > 2 else 40
for WG in (64, 256):
    for N in ((256, 1024, 2048, 4096) if L > 4 else (3, 130)):
        n = N * WG
        x = dev.upload(np.ones(n, np.float32)); cnt = dev.alloc(4 * 1024); norm_w = dev.upload(np.ones(2048, np.float32))
        hn = dev.alloc(4 * 2048); xq = dev.alloc(2048); xd = dev.alloc(4 * 128)
        s0 = dev.sequence(); s0.fill(cnt); s0.run(); s0.free()
        for mode, norm in ((0, False), (0, True), (1, False), (2, False), (1, True), (2, True)):
            v = chain.specialize(WG=WG, MODE=mode, NORM=norm and mode > 0, SG=dev.info.subgroup_size)
            seq = dev.sequence()
            for l in range(L):
                v.dispatch(seq, N, x=x, counter=cnt, norm_w=norm_w, hn=hn, xq=xq, xd=xd, n=n, nn=2048)
                if norm and mode == 0:  # the current design: a norm dispatch of its own
                    nv.dispatch(seq, 1, x=x, norm_w=norm_w, hn=hn, xq=xq, xd=xd, n=2048, eps=1e-6)
            keep_busy(lambda: seq.run(3))
            ts = []
            for r in range(7):
                t = time.perf_counter(); seq.run(20); ts.append((time.perf_counter() - t) / 20 / L * 1e6)
            seq.free()
            print(f"WG={WG:3d} N={N:5d} mode={mode} norm={int(norm)}: {np.median(ts):6.2f} us/dispatch", flush=True)
        assert not cnt.read(np.uint32, (1024,)).any()
        for b in (x, cnt, norm_w, hn, xq, xd): b.free()
