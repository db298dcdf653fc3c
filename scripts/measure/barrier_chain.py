"""The per-stage floor: what a dependent dispatch costs when a pipeline barrier orders it after the
one before, as every stage of the decode step is (docs/DESIGN.md).

Usage: python3 barrier_chain.py [DEVICE (default 0)] [CHAIN (default 40)]

A chain of matrix-vector links (4-bit weights, K = 2048 inputs), each reading the vector the
previous one wrote into shared memory, then its rows, with a pipeline barrier between links. Two
columns: "barrier", the input read through the cache as the decode step reads it, and
"barrier+coherent", read coherently (from L2). Until the rewrite of PERF.md this script was
counter_chain.py and also timed links ordered by arrival counters instead of barriers, which were
measured slower and dropped (`git log --follow` finds that version)."""
import time

import numpy as np

import zdsl
from chains import device_and_links, keep_busy
from zdsl import Buffer, Coherent, Const, f32, u32

K = 2048
KW = K // 8  # words of 8 nibbles per row


def make_link(X):
    """The link kernel, reading its input vector through X (Buffer or Coherent)."""
    @zdsl.kernel(workgroup="WG", subgroup="SG")
    def link(w: Buffer[u32], x: X[f32], src: u32, dst: u32, N: u32,
             ROWS: Const = 1, WG: Const = 64, SG: Const = 32):
        lane = zdsl.lane_id()
        row0 = (zdsl.workgroup_id(0) * (WG // SG) + zdsl.subgroup_id()) * ROWS
        per = KW // SG
        xs = zdsl.shared(f32, K)
        for i in range(K // WG):
            xs[i * WG + zdsl.local_index()] = x[src * N + i * WG + zdsl.local_index()]
        zdsl.barrier()
        for r in range(ROWS):
            acc = zdsl.var(0.0, f32)
            for j in range(per):
                word = w[(row0 + r) * KW + j * SG + lane]
                for b in range(8):
                    acc += ((word >> (4 * b)) & 15).to(f32) * xs[(j * 8 + b) * SG + lane]
            total = zdsl.subgroup_sum(acc)
            with zdsl.if_(lane == 0):
                x[dst * N + row0 + r] = total * (1.0 / 16384.0)
    return link


links = {"barrier": make_link(Buffer), "barrier+coherent": make_link(Coherent)}


def timed_links(dev, rows, L, record):
    """(µs per link, the vector the last of L links wrote) of the chain record(seq, w, x, N) puts
    into a sequence: random 4-bit weights w of `rows` rows, x two vectors of N = max(rows, K) (link
    l reads x[l % 2] and writes the other). The vector is read after one run from x = 1, the timing
    is the median of 7 timings of 20 runs, after keep_busy."""
    w = dev.upload(np.random.default_rng(0).integers(0, 2**32, rows * KW, dtype=np.uint32))
    N = max(rows, K)
    x = dev.upload(np.ones(2 * N, np.float32))
    seq = dev.sequence()
    record(seq, w, x, N)
    seq.run(1)
    result = x.read(np.float32, (2 * N,))[(L % 2) * N:][:rows].copy()
    keep_busy(lambda: seq.run(3))
    ts = []
    for _ in range(7):
        t = time.perf_counter(); seq.run(20); ts.append((time.perf_counter() - t) / 20 / L * 1e6)
    seq.free()
    for b in (w, x):
        b.free()
    return float(np.median(ts)), result


def measure(dev, mode, rows, WG, ROWS, L):
    v = links[mode].specialize(ROWS=ROWS, WG=WG, SG=dev.info.subgroup_size)
    groups = rows // (WG // dev.info.subgroup_size * ROWS)

    def record(seq, w, x, N):
        for l in range(L):
            v.dispatch(seq, groups, w=w, x=x, src=l % 2, dst=(l + 1) % 2, N=N)
    return timed_links(dev, rows, L, record)


def main():
    dev, L = device_and_links()
    for rows in (64, 2048, 8192):
        for WG, ROWS in ((64, 1), (64, 2), (128, 2), (256, 1)):
            if rows < WG // dev.info.subgroup_size * ROWS:
                continue
            line, ref = [], None
            for mode in links:
                us, result = measure(dev, mode, rows, WG, ROWS, L)
                ok = "" if ref is None or np.allclose(result, ref, rtol=1e-5) else " WRONG"
                ref = result if ref is None else ref
                line.append(f"{mode} {us:6.2f}{ok}")
            mb = rows * KW * 4 / 1e6
            print(f"rows={rows:5d} ({mb:4.1f} MB) WG={WG:3d} ROWS={ROWS}: " + ", ".join(line) + " us/link", flush=True)


if __name__ == "__main__":
    main()
