"""Gated delta-net layers at decode time (one new token), after the model doc's DELTANET section.

Two dispatches per layer, between the input projections and the output projection:

- `deltanet_conv`: the causal depthwise conv over the last 4 inputs of every q|k|v channel, silu,
  and the shift of the conv state.
- `deltanet_step`: per value head, L2-normalised q and k, the gated delta rule on the f32 state,
  the read-out o and the gated RMSNorm of o, fused: the state (64 KiB per head at d = 128) is read
  once and written once, and o never leaves the workgroup.

Layouts (all f32):

- conv weight `ssm_conv1d.weight` as stored ({4, C} in GGUF order): [channel][tap], tap 3 the
  current token.
- conv state: [tap][channel], (KC − 1) × C; row 0 the oldest input.
- delta state: [value head][i = key dim][j = value dim], row-major (j contiguous).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.kernels.dmmv import workgroup_sums

SUBGROUPS = [8, 16, 32, 64]


@zdsl.kernel(workgroup="WG", variants={"WG": [64, 256]})
def deltanet_conv(mix: Buffer[f32], w: Buffer[f32], state: Buffer[f32], out: Buffer[f32], channels: u32,
                  KC: Const = 4, WG: Const = 256):
    """out[c] = silu(Σ_k w[c, k] · hist_c[k]) with hist_c = (state[0, c], …, state[KC−2, c], mix[c]);
    then state[k, c] = hist_c[k + 1]. One invocation per channel (no subgroup operations).
    Grid: ceil(channels / WG)."""
    c = zdsl.global_id()
    with zdsl.if_(c < channels):
        hist = [state[k * channels + c] for k in range(KC - 1)] + [mix[c]]
        acc = w[c * KC] * hist[0]
        for k in range(1, KC):
            acc = zdsl.fma(w[c * KC + k], hist[k], acc)
        out[c] = zdsl.silu(acc)
        for k in range(KC - 1):
            state[k * channels + c] = hist[k + 1]


@deltanet_conv.reference
def deltanet_conv_ref(mix, w, state):
    """mix: (C,); w: (C, KC); state: (KC − 1, C). Returns (out, new state)."""
    hist = np.concatenate([np.asarray(state, np.float64), np.asarray(mix, np.float64)[None]], axis=0)
    pre = (hist * np.asarray(w, np.float64).T).sum(axis=0)
    return (pre / (1 + np.exp(-pre))).astype(np.float32), hist[1:].astype(np.float32)


def _step_fits(v) -> bool:
    quads = v.D // 4  # invocations per state row, four value columns each
    return v.D % 4 == 0 and v.WG % quads == 0 and v.D % (v.WG // quads) == 0 and v.WG % v.SG == 0


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"D": [128], "WG": [256, 512], "SG": SUBGROUPS}, where=_step_fits)
def deltanet_step(conv: Buffer[f32], z: Buffer[f32], b: Buffer[f32], a: Buffer[f32], ssm_a: Buffer[f32],
                  dt_bias: Buffer[f32], norm_w: Buffer[f32], state: Buffer[f32], out: Buffer[f32],
                  n_k_heads: u32, eps: f32, D: Const = 128, WG: Const = 256, SG: Const = 32):
    """Value head h = workgroup_id, key head kh = h % n_k_heads; conv = [q (n_k_heads × D) |
    k (n_k_heads × D) | v (heads × D)] after deltanet_conv; b, a: the head's raw beta and alpha
    projections. With q, k L2-normalised (eps), β = sigmoid(b_h), g = ssm_a_h · softplus(a_h +
    dt_bias_h), S the head's D × D state:
        S ← e^g S;  u = Sᵀk;  S ← S + k (β (v − u))ᵀ;  o = Sᵀq / √D
    computed in one pass as o = (e^g S_oldᵀq + (k·q) δ) / √D with δ = β (v − e^g S_oldᵀk), then
    out_h = rmsnorm(o) · norm_w · silu(z_h). Invocation (row part p, column quad c) keeps rows
    p, p + RP, … of columns 4c..4c+3 in registers (RP = 4·WG / D row parts), so each row of S
    is one contiguous read and write per D/4 invocations. Grid: number of value heads."""
    if not _step_fits(SimpleNamespace(D=D, WG=WG, SG=SG)):
        raise zdsl.ZdslError(f"deltanet_step needs 4 | D, D/4 | WG, and WG / (D/4) | D, not D={D}, WG={WG}")
    quads = D // 4
    RP = WG // quads
    h = zdsl.workgroup_id()
    kh = h % n_k_heads
    t = zdsl.local_index()
    c, part = t % quads, t // quads
    rows = [part + RP * r for r in range(D // RP)]
    # every load first: the state's are in flight while q and k are normalised
    S = [state.vec4[(h * D + i) * quads + c] for i in rows]
    v = conv.vec4[(2 * n_k_heads * D + h * D) // 4 + c]
    gate = z.vec4[h * quads + c]
    decay = zdsl.exp(ssm_a[h] * zdsl.softplus(a[h] + dt_bias[h]))
    beta = zdsl.sigmoid(b[h])

    qs, ks = zdsl.shared(f32, D), zdsl.shared(f32, D)
    qq, kk, qk = zdsl.var(0.0), zdsl.var(0.0), zdsl.var(0.0)
    for i in zdsl.range(t, D, WG):
        qi, ki = conv[kh * D + i], conv[(n_k_heads + kh) * D + i]
        qs[i], ks[i] = qi, ki
        qq.set(zdsl.fma(qi, qi, qq))
        kk.set(zdsl.fma(ki, ki, kk))
        qk.set(zdsl.fma(qi, ki, qk))
    zdsl.barrier()
    qq_all, kk_all, qk_all = workgroup_sums([qq, kk, qk], WG, SG)
    rq, rk = zdsl.rsqrt(qq_all + eps), zdsl.rsqrt(kk_all + eps)

    k_rows = [ks[i] * rk for i in rows]
    u = S[0] * k_rows[0]
    y = S[0] * (qs[rows[0]] * rq)
    for s, k_i, i in zip(S[1:], k_rows[1:], rows[1:]):
        u = u + s * k_i
        y = y + s * (qs[i] * rq)
    if RP > 1:  # sum the row parts of each column quad
        red = zdsl.shared(f32, 8 * WG)
        for e in range(4):
            red[8 * t + e] = u[e]
            red[8 * t + 4 + e] = y[e]
        zdsl.barrier()
        sums = []
        for e in range(8):
            total = red[8 * c + e]
            for p in range(1, RP):
                total = total + red[8 * (p * quads + c) + e]
            sums.append(total)
        u, y = zdsl.vec(*sums[:4]), zdsl.vec(*sums[4:])
    delta = beta * (v - decay * u)
    for s, k_i, i in zip(S, k_rows, rows):
        state.vec4[(h * D + i) * quads + c] = s * decay + delta * k_i
    o = (decay * y + (qk_all * rq * rk) * delta) * (1.0 / math.sqrt(D))

    (ss,) = workgroup_sums([zdsl.where(part == 0, zdsl.dot(o, o), 0.0)], WG, SG)
    with zdsl.if_(part == 0):
        out.vec4[h * quads + c] = o * zdsl.rsqrt(ss / D + eps) * norm_w.vec4[c] * (gate / (1.0 + zdsl.exp(-gate)))


@deltanet_step.reference
def deltanet_step_ref(conv, z, b, a, ssm_a, dt_bias, norm_w, state, n_k_heads, eps):
    """Straight from the model doc, in float64. conv: (C,) after deltanet_conv; z: (Hv·D,);
    b, a, ssm_a, dt_bias: (Hv,); norm_w: (D,); state: (Hv, D, D). Returns (out (Hv·D,), new state)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    Hv, D = state.shape[0], state.shape[1]
    Hk = n_k_heads
    conv = f(conv)
    q = conv[:Hk * D].reshape(Hk, D)
    k = conv[Hk * D:2 * Hk * D].reshape(Hk, D)
    v = conv[2 * Hk * D:].reshape(Hv, D)
    q = q / np.sqrt((q * q).sum(axis=1, keepdims=True) + eps)
    k = k / np.sqrt((k * k).sum(axis=1, keepdims=True) + eps)
    beta = 1 / (1 + np.exp(-f(b)))
    g = f(ssm_a) * np.logaddexp(0.0, f(a) + f(dt_bias))
    S = f(state).copy()
    out = np.empty((Hv, D))
    z = f(z).reshape(Hv, D)
    for h in range(Hv):
        kh = h % Hk
        S[h] *= np.exp(g[h])
        u = S[h].T @ k[kh]
        S[h] += np.outer(k[kh], beta[h] * (v[h] - u))
        o = S[h].T @ q[kh] / np.sqrt(D)
        out[h] = o / np.sqrt(np.mean(o * o) + eps) * f(norm_w) * z[h] / (1 + np.exp(-z[h]))
    return out.reshape(-1).astype(np.float32), S.astype(np.float32)
