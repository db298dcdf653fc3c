"""RMS normalisation: `out = x · rsqrt(mean(x²) + eps) · w` over each row of n values.

A row is whatever one weight vector normalises: a token's hidden state (n = hidden), or one
head of a per-head norm (n = head dim, rows = tokens × heads, heads contiguous), so the same
kernel serves the layer norms and the q/k norms. `rms_norm_gated` multiplies by silu(z) of the
same shape: the delta-net output norm. Every weight already carries the converter's "+1"
(see the model doc), so there is no offset here.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.kernels.dmmv import workgroup_sums

SUBGROUPS = [8, 16, 32, 64]


def rms_scale(load, n, eps, WG: int, SG: int):
    """rsqrt(mean(x²) + eps) of the n values load(j) (j < n), valid in every invocation."""
    acc = zdsl.var(0.0)
    for j in zdsl.range(zdsl.local_index(), n, WG):
        x = load(j)
        acc.set(zdsl.fma(x, x, acc))
    (total,) = workgroup_sums([acc], WG, SG)
    return zdsl.rsqrt(total / n.to(f32) + eps)


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS})
def rms_norm(x: Buffer[f32], w: Buffer[f32], out: Buffer[f32], n: u32, eps: f32, WG: Const = 256, SG: Const = 32):
    """out[r, :] = x[r, :] · rsqrt(mean(x[r]²) + eps) · w for rows of n values (any n).
    Grid: rows (tokens, or tokens × heads for a per-head norm with n = head dim)."""
    base = zdsl.workgroup_id() * n
    scale = rms_scale(lambda j: x[base + j], n, eps, WG, SG)
    for j in zdsl.range(zdsl.local_index(), n, WG):
        out[base + j] = x[base + j] * scale * w[j]


@rms_norm.reference
def rms_norm_ref(x, w, eps):
    """x: (..., n) rows; w: (n,)."""
    x = np.asarray(x, np.float64)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS})
def rms_norm_gated(x: Buffer[f32], z: Buffer[f32], w: Buffer[f32], out: Buffer[f32], n: u32, eps: f32,
                   WG: Const = 64, SG: Const = 32):
    """out[r, :] = rmsnorm(x[r, :]) · w · silu(z[r, :]) for rows of n values: the delta-net gated
    output norm with rows = value heads and n = head dim. Grid: rows."""
    base = zdsl.workgroup_id() * n
    scale = rms_scale(lambda j: x[base + j], n, eps, WG, SG)
    for j in zdsl.range(zdsl.local_index(), n, WG):
        out[base + j] = x[base + j] * scale * w[j] * zdsl.silu(z[base + j])


@rms_norm_gated.reference
def rms_norm_gated_ref(x, z, w, eps):
    z = np.asarray(z, np.float64)
    return (rms_norm_ref(x, w, eps) * (z / (1 + np.exp(-z)))).astype(np.float32)
