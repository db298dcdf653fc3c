"""Per-step bookkeeping on the GPU, so decode steps can run back to back without the host."""

from __future__ import annotations

import zdsl
from zdsl import Buffer, u32

STEP_WORDS = 8  # a step record: [0] position, [1] length, [2] token id, [3] sampler counter


@zdsl.kernel(workgroup=1)
def advance(step: Buffer[u32]):
    """Move the step values on to the next token: position step[0] and length step[1] + 1
    (the sampler has already put the next input token in step[2])."""
    step[0] = step[0] + 1
    step[1] = step[1] + 1
