"""Reductions over a workgroup, and the subgroup sizes and shared memory kernels are built for."""

from __future__ import annotations

import zdsl
from zdsl import f32

SUBGROUPS = [8, 16, 32, 64]  # lavapipe runs 8, NVIDIA 32, RDNA 32 or 64
SHARED_LIMIT = 32768  # bytes of workgroup memory a variant may use everywhere (lavapipe's limit)


def workgroup_sums(values, WG: int, SG: int):
    """Sum each value over the workgroup; the results are valid in every invocation."""
    if WG // SG == 1:
        return [zdsl.subgroup_sum(v) for v in values]
    total = workgroup_sum_table(values, WG, SG)
    return [total(i) for i in range(len(values))]


def workgroup_sum_table(values, WG: int, SG: int):
    """Sum each value over the workgroup into shared memory (then a barrier); returns total(i),
    value i's sum, for an index a loop computes at run time (workgroup_sums gives registers,
    which only an index known when traced can pick). The table is read until the workgroup's
    next barrier-separated write of it."""
    sums = [zdsl.subgroup_sum(v) for v in values]
    nsub = WG // SG
    partial = zdsl.shared(f32, len(values) * nsub)
    with zdsl.if_(zdsl.lane_id() == 0):
        for i, s in enumerate(sums):
            partial[i * nsub + zdsl.subgroup_id()] = s
    zdsl.barrier()

    def total(i):
        out = partial[i * nsub]
        for n in range(1, nsub):
            out = out + partial[i * nsub + n]
        return out
    return total

