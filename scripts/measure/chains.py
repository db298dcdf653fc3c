"""Timing a chain of dependent dispatches, as the measurement scripts beside this file do."""
import sys
import time

import numpy as np


def device_and_links():
    """The device (argv[1], default 0) and the chain length (argv[2], default 40) a script measures with."""
    from zdsl.runtime import open_device

    return open_device(sys.argv[1] if len(sys.argv) > 1 else "0"), int(sys.argv[2]) if len(sys.argv) > 2 else 40


def chain_us(dev, record, links: int, warm_s: float = 0.0) -> float:
    """µs per link of the chain that record(seq) puts into a sequence of `dev`: the median of 7
    timings of 10 runs, after runs of 3 for at least warm_s seconds (one run of 3 at least)."""
    seq = dev.sequence()
    record(seq)
    start = time.perf_counter()
    seq.run(3)
    while time.perf_counter() - start < warm_s:
        seq.run(3)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        seq.run(10)
        ts.append((time.perf_counter() - t) / 10 / links * 1e6)
    seq.free()
    return float(np.median(ts))
