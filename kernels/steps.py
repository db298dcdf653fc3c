"""Per-step bookkeeping on the GPU, so decode steps can run back to back without the host."""

from __future__ import annotations

import zdsl
from zdsl import Buffer, u32

STEP_WORDS = 8  # a step record: [0] position, [1] length, [2] token id, [3] sampler counter
STEP_STRIDE = 256  # bytes between rows' step values in a buffer of several: Vulkan's largest storage-offset alignment


def sequences_of(row, step, seq_bytes, *own):
    """Row s = the grid's z of a launch of several rows (a batch's sequences, one token each, or
    one sequence's tokens): its row `row` + s, its step values step[s · STEP_WORDS] and its own
    buffers `own` seq_bytes on (caches, partials, states: each row's, bound as the pieces of one
    buffer, the same cache for a sequence's tokens)."""
    s = zdsl.workgroup_id(2)
    return (row + s, step.at(s * STEP_WORDS), *[b.at(s * (seq_bytes // b.dtype.nbytes)) for b in own])


@zdsl.kernel(workgroup=1)
def advance(step: Buffer[u32]):
    """Move the step values on to the next token: position step[0] and length step[1] + 1
    (the sampler has already put the next input token in step[2])."""
    step[0] = step[0] + 1
    step[1] = step[1] + 1
