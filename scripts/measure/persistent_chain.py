"""Dependent matrix-vector links in one persistent dispatch, ordered by a grid barrier (docs/PERF.md).

Usage: python3 persistent_chain.py [DEVICE (default 0)] [CHAIN (default 40)]

The links of counter_chain.py (4-bit weights, K = 2048 inputs, each reading the vector the
previous one wrote), but all of them inside one dispatch of G workgroups, few enough to be
resident at once: each workgroup takes rows in a grid-stride loop, and between links every
workgroup arrives at one counter and waits until all G have (zdsl.wait_at_least). Against the
same chain with a pipeline barrier between dispatches ("barrier", as the decode step is
recorded). If the grid barrier costs much less than a dispatch and its barrier, a decode layer
could run as one persistent dispatch."""
import numpy as np

import zdsl
from chains import device_and_links
from counter_chain import K, KW, measure as measure_dispatches, timed_links
from zdsl import Buffer, Coherent, Const, f32, u32


@zdsl.kernel(workgroup="WG", subgroup="SG")
def persistent(w: Buffer[u32], x: Coherent[f32], counter: Buffer[u32], links: u32, rows: u32, N: u32,
               SYNC: Const = "full", ROWS: Const = 1, WG: Const = 64, SG: Const = 32):
    lane = zdsl.lane_id()
    G = zdsl.num_workgroups(0)
    nsub = WG // SG
    per = KW // SG
    xs = zdsl.shared(f32, K)
    for l in zdsl.range(links):
        src = l % 2
        for i in range(K // WG):
            xs[i * WG + zdsl.local_index()] = x[src * N + i * WG + zdsl.local_index()]
        zdsl.barrier()
        for row0 in zdsl.range((zdsl.workgroup_id(0) * nsub + zdsl.subgroup_id()) * ROWS, rows, G * nsub * ROWS):
            for r in range(ROWS):
                acc = zdsl.var(0.0, f32)
                for j in range(per):
                    word = w[(row0 + r) * KW + j * SG + lane]
                    for b in range(8):
                        acc += ((word >> (4 * b)) & 15).to(f32) * xs[(j * 8 + b) * SG + lane]
                total = zdsl.subgroup_sum(acc)
                with zdsl.if_(lane == 0):
                    x[(1 - src) * N + row0 + r] = total * (1.0 / 16384.0)
        if SYNC in ("full", "arrive"):
            zdsl.memory_barrier()
        zdsl.barrier()
        if SYNC != "none":
            with zdsl.if_(zdsl.local_index() == 0):
                zdsl.atomic_add(counter, 0, 1)
        if SYNC in ("full", "unfenced"):
            zdsl.wait_at_least(counter, 0, (l + 1) * G)


SYNCS = ("full", "unfenced", "arrive", "none")


def measure(dev, rows, WG, ROWS, G, L, sync="full"):
    v = persistent.specialize(SYNC=sync, ROWS=ROWS, WG=WG, SG=dev.info.subgroup_size)
    return timed_links(dev, rows, L, lambda seq, w, x, cnt, N: v.dispatch(seq, G, w=w, x=x, counter=cnt, links=L,
                                                                          rows=rows, N=N))


def main():
    dev, L = device_and_links()
    for rows in (64, 2048, 8192):
        for WG, ROWS in ((64, 2), (128, 2), (256, 1)):
            us_b, ref = measure_dispatches(dev, "barrier", rows, WG, ROWS, L)
            line = [f"barrier {us_b:6.2f}"]
            for G in (32, 66, 132, 264):
                us, result = measure(dev, rows, WG, ROWS, G, L)
                ok = "" if np.allclose(result, ref, rtol=1e-5) else " WRONG"
                line.append(f"G={G} {us:6.2f}{ok}")
            mb = rows * KW * 4 / 1e6
            print(f"rows={rows:5d} ({mb:4.1f} MB) WG={WG:3d} ROWS={ROWS}: " + ", ".join(line) + " us/link", flush=True)
    # What the grid barrier's parts cost (G = 132, WG = 256): the whole of it; without the fence
    # before the arrival (not a correct barrier); the arrivals alone, nobody waiting (wrong);
    # nothing between links but the workgroup barrier (wrong: the floor).
    for rows in (64, 2048):
        line = [f"{sync} {measure(dev, rows, 256, 1, 132, L, sync)[0]:6.2f}" for sync in SYNCS]
        print(f"rows={rows:5d} WG=256 G=132: " + ", ".join(line) + " us/link", flush=True)


if __name__ == "__main__":
    main()
