"""RMS normalisation, `x · rsqrt(mean(x²) + eps) · w`, as the kernels that fold it in compute it
(q8_1.write_normed for the layer norms, attention.attn_prep for the q/k norms, the delta-net
step for its gated output norm). Every weight already carries the converter's "+1" (see the
model doc), so there is no offset here.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import f32
from zdsl.kernels.reduce import workgroup_sums


def rms_scale(load, n, eps, WG: int, SG: int):
    """rsqrt(mean(x²) + eps) of the n values load(j) (j < n), valid in every invocation."""
    acc = zdsl.var(0.0)
    for j in zdsl.range(zdsl.local_index(), n, WG):
        x = load(j)
        acc.set(zdsl.fma(x, x, acc))
    (total,) = workgroup_sums([acc], WG, SG)
    return zdsl.rsqrt(total / n.to(f32) + eps)


def rms_norm_ref(x, w, eps):
    """x: (..., n) rows; w: (n,)."""
    x = np.asarray(x, np.float64)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)
