"""Timing a chain of dependent dispatches, as the measurement scripts beside this file do."""
import sys
import time

import numpy as np


def device_and_links():
    """The device (argv[1], default 0) and the chain length (argv[2], default 40) a script measures with."""
    from zdsl.runtime import open_device

    return open_device(sys.argv[1] if len(sys.argv) > 1 else "0"), int(sys.argv[2]) if len(sys.argv) > 2 else 40


WARM_S = 1.0


def keep_busy(run, seconds: float = WARM_S) -> None:
    """Call run() (it puts work on the GPU and waits) for at least `seconds`, at least once. An
    idle GPU drops its clocks (the H100: 345 MHz idle, 1,980 MHz under load) and takes a second
    or more to raise them again, so a timing taken right after compiling pipelines, or after any
    pause, runs slow; the decode step, busy back to back, runs at the full clock."""
    start = time.perf_counter()
    run()
    while time.perf_counter() - start < seconds:
        run()


def chain_us(dev, record, links: int, warm_s: float = WARM_S) -> float:
    """µs per link of the chain that record(seq) puts into a sequence of `dev`: the median of 7
    timings of 10 runs, after runs of 3 for at least warm_s seconds (keep_busy)."""
    seq = dev.sequence()
    record(seq)
    keep_busy(lambda: seq.run(3), warm_s)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        seq.run(10)
        ts.append((time.perf_counter() - t) / 10 / links * 1e6)
    seq.free()
    return float(np.median(ts))
