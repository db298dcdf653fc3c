"""How a matrix-vector product's time grows with its columns (the tokens or streams of a step),
by weight type: dmmv on the 35B-A3B's output head shape (248,320 × 2,048) in Q8_0, Q4_K, Q5_K
and Q6_K with int8 products (Q8_1 activations), at 1, 2, 4 and 8 columns, each with its best
rows-per-group and subgroups (ROWS up to 4 at any column count, past what dmmv builds ahead).
Against the copy bandwidth of the same run: one column reads at it; more columns read the same
weights and add int8 dot products (`dot4_i8`), so where those set the pace the types converge.

Usage: python3 few_columns.py [DEVICE (default 0)] [--f32]; prints one JSON line per (type,
columns). --f32: f32 multiply-adds on f32 activations instead (docs/DESIGN.md compares them).
Run on the GPU machine (docs/PERF.md)."""

from __future__ import annotations

import json
import sys

import numpy as np

from zdsl.autotune import timing
from zdsl.autotune.tuner import Measure, free, launch_of
from zdsl.kernels.dmmv import dmmv
from zdsl.lang.kernel import Launch
from zdsl.runtime import open_device

K, M = 2048, 248_320
TYPES = ("q8_0", "q4_k", "q5_k", "q6_k")
LAYOUTS = [(rows, nsub) for rows in (1, 2, 4) for nsub in (1, 2, 4)]


def best_us(measure, qtype: str, cols: int, q8: bool = True) -> tuple[float, str, int]:
    """The fastest layout's µs, its label and the bytes it moves."""
    fixed = dict(QTYPE=qtype, Q8=q8, COLS=cols, ADD=False)
    launch = Launch(dmmv, dmmv.specialize(**fixed), fixed, dict(fixed, k=K, m=M), dict(k=K, m=M), {}, (1, 1, 1),
                    "head")
    example = dmmv.make_example(launch, np.random.default_rng(0), False)
    best = None
    for rows, nsub in LAYOUTS:
        v = dmmv.specialize(**fixed, ROWS=rows, NSUB=nsub, SG=32)
        nbytes = launch_of(v, example)[1]
        bufs = measure.upload(example, measure.copies(nbytes))
        try:
            us, _ = measure.time(example, bufs, [v])
        finally:
            free(bufs)
        if best is None or us < best[0]:
            best = (us, f"ROWS={rows} NSUB={nsub}", nbytes)
    return best


def main(device: str = "0", f32: bool = False) -> None:
    dev = open_device(device)
    measure = Measure(dev, warmup=5, repeats=40, warm_s=0.5)
    copy_gbps = timing.copy_bandwidth(measure, 256 << 20)
    for qtype in TYPES:
        for cols in (1, 2, 4, 8):
            us, layout, nbytes = best_us(measure, qtype, cols, q8=not f32)
            print(json.dumps(dict(type=qtype, cols=cols, us=round(us, 1), layout=layout,
                                  pct_copy=round(100 * nbytes / us / 1e3 / copy_gbps, 1))), flush=True)
    dev.close()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--f32"]
    main(*args, f32="--f32" in sys.argv[1:])
