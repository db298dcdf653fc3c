"""RMS normalisation, `x · rsqrt(mean(x²) + eps) · w`: the reference for the kernels that fold it
in (q8_1.write_normed for the layer norms, the router, attention's q/k norms, the delta-net
step's gated output norm). Every weight already carries the converter's "+1" (see the model
doc), so there is no offset here.
"""

from __future__ import annotations

import numpy as np


def rms_norm_ref(x, w, eps):
    """x: (..., n) rows; w: (n,)."""
    x = np.asarray(x, np.float64)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)
