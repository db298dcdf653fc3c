"""Timing on a device: the copy bandwidth every roofline ratio divides by, and launches timed back
to back (independent dispatches overlapping), beside `tuner.Measure.time` (each alone).

Decode is bandwidth-bound: a kernel is as fast as it can be when it moves its bytes at the rate a
plain copy does. The copy is a DSL kernel (16-byte loads and stores over large buffers, read plus
write bytes counted), timed like any kernel, after replaying for a while: GPUs raise their clocks
only under sustained load.
"""

from __future__ import annotations

from time import perf_counter
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32

from .tuner import Measure, free, record

BACK_TO_BACK = 128  # independent dispatches per submission when timing back to back


@zdsl.kernel(workgroup=256, register=False, grid=lambda v, s: -(-s.n4 // (256 * v.UNROLL)),
             traffic=lambda v, s: 32 * s.n4)
def copy_vec4(src: Buffer[f32], dst: Buffer[f32], n4: u32, UNROLL: Const = 4):
    """dst = src over n4 16-byte vectors; each invocation moves UNROLL of them, a workgroup
    apart, so every load and store instruction is one contiguous run."""
    first = zdsl.workgroup_id() * (256 * UNROLL) + zdsl.local_index()
    for j in range(UNROLL):
        i = first + 256 * j
        with zdsl.if_(i < n4):
            dst.vec4[i] = src.vec4[i]


@copy_vec4.example
def copy_example(use, rng, check):
    n4 = use.sizes["n4"]
    src = np.zeros(4 * n4, np.float32)
    return zdsl.Example(dict(src=src, dst=np.zeros(4 * n4, np.float32), n4=n4),
                        lambda p: {"dst": (src, 0)}, lambda n: {"src": [src] * (n - 1)})


def copy_bandwidth(measure: Measure, nbytes: int) -> float:
    """GB/s (read + written) of the copy kernel over buffers of nbytes each, timed alone."""
    n4 = max(1, nbytes // 16)
    example = copy_example(SimpleNamespace(sizes={"n4": n4}), None, False)
    v = copy_vec4.specialize()
    bufs = measure.upload(example, measure.copies(16 * n4))
    try:
        us, _ = measure.time(example, bufs, [v])
    finally:
        free(bufs)
    return 32 * n4 / us / 1e3


def back_to_back(measure: Measure, example, launches, warm_s: float) -> float:
    """Wall-clock µs per run of `launches` when BACK_TO_BACK runs are submitted together, each
    writing outputs of its own (so none waits on another), replayed until warm_s has passed (the
    submit and the wait count)."""
    written = {b[0] for v in launches for b in v.ir.buffers if "w" in b[2]}
    inputs = measure.upload(example, measure.copies(sum(a.nbytes for a in example.args.values()
                                                        if isinstance(a, np.ndarray))))
    outputs = {n: [measure.device.upload(example.args[n], name=f"{n}{i}") for i in range(BACK_TO_BACK)]
               for n in written if n in example.args}
    seq = measure.device.sequence()
    try:
        for i in range(BACK_TO_BACK):
            bufs = {n: b[i % len(b)] for n, b in {**inputs, **outputs}.items()}
            record(seq, example, launches, bufs)
        seq.run()
        times = 1
        while True:
            start = perf_counter()
            seq.run(times=times)
            spent = perf_counter() - start
            if spent >= max(warm_s, 1e-3) or times >= 1 << 12:
                break
            times *= 2
    finally:
        seq.free()
        free(inputs)
        free(outputs)
    return spent / (times * BACK_TO_BACK) * 1e6
