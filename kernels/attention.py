"""Full-attention layers at decode time (one new token, grouped-query attention).

Three dispatches per layer:

- `attn_prep`: per-head RMSNorm of q and k, NEOX RoPE on the first `rope_dims` dims, q written
  out as f32, k and v appended to the f16 KV cache at the current position.
- `attn_decode`: the context split into `nsplit` chunks; one subgroup per (chunk, KV head) walks
  its chunk once and serves every query head of the group, writing partial softmax statistics.
- `attn_combine`: merges the chunks per query head and applies the output gate.

Per-token values come from the `step` buffer (step[0] = position, step[1] = length), so one
recorded command buffer serves every position; the chunk length is derived from step[1] on the
GPU. Layouts:

- KV caches (`Buffer[f16]`, one each for K and V): [position][kv head][d].
- Partials: [query head][split][d + 2] f32: the chunk's max score m, its Σ exp(score − m), then
  Σ exp(score − m) · v (d values). Scores include the 1/sqrt(d) scale.
"""

from __future__ import annotations

import math

import numpy as np

import zdsl
from zdsl import Buffer, Const, f16, f32, u32
from zdsl.kernels.norm import rms_scale

SUBGROUPS = [8, 16, 32, 64]
LOWEST = float(np.finfo(np.float32).min)  # the "no score yet" max: finite, so empty merges give 0, not NaN


# ---- q/k norm, RoPE, KV-cache append --------------------------------------------------------------

@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS})
def attn_prep(qg: Buffer[f32], k: Buffer[f32], v: Buffer[f32], q_norm: Buffer[f32], k_norm: Buffer[f32],
              step: Buffer[u32], q: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16],
              n_head: u32, n_kv: u32, d: u32, rope_dims: u32, rope_base: f32, eps: f32,
              WG: Const = 256, SG: Const = 32):
    """Workgroup h < n_head: q[h] = rope(rmsnorm(qg[h, :d]) · q_norm) (qg holds [query d | gate d]
    per head). Workgroup n_head + g: k_cache[pos, g] = rope(rmsnorm(k[g]) · k_norm) and
    v_cache[pos, g] = v[g], as f16, pos = step[0]. RoPE pairs dim i with i + rope_dims/2,
    θ_i = pos · rope_base^(−2i/rope_dims); rope_dims is even and ≤ d. Grid: n_head + n_kv."""
    head = zdsl.workgroup_id()
    is_q = head < n_head
    g = head - n_head  # the KV head (wraps for query heads, where it is never used)
    q_base, k_base = head * 2 * d, g * d

    def x(j):
        """Element j of this workgroup's head, normalised and weighted."""
        return zdsl.where(is_q, qg.load(q_base + j, mask=is_q, other=0.0), k.load(k_base + j, mask=~is_q, other=0.0))

    scale = rms_scale(x, d, eps, WG, SG)
    pos = step[0]
    half = rope_dims // 2
    log2_base = zdsl.log2(rope_base)
    for j in zdsl.range(zdsl.local_index(), d, WG):
        value = zdsl.var(x(j) * scale * zdsl.where(is_q, q_norm[j], k_norm[j]))
        with zdsl.if_(j < rope_dims):
            first = j < half
            i = zdsl.where(first, j, j - half)
            p = zdsl.where(first, j + half, j - half)
            partner = x(p) * scale * zdsl.where(is_q, q_norm[p], k_norm[p])
            # θ in turns, reduced to [-1/2, 1/2] so cos/sin see |angle| ≤ π
            turns = pos.to(f32) * zdsl.exp2(-(2 * i).to(f32) / rope_dims.to(f32) * log2_base) * (0.5 / math.pi)
            angle = (turns - zdsl.round(turns)) * (2 * math.pi)
            value.set(value * zdsl.cos(angle) + zdsl.where(first, -partner, partner) * zdsl.sin(angle))
        with zdsl.if_(is_q):
            q[head * d + j] = value
        with zdsl.else_():
            row = (pos * n_kv + g) * d + j
            k_cache[row] = value.to(f16)
            v_cache[row] = v[k_base + j].to(f16)


def rmsnorm_ref(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_ref(x, pos, rope_dims, base):
    """NEOX RoPE of the first rope_dims dims of x (..., d) at position pos."""
    half = rope_dims // 2
    theta = pos * base ** (-2.0 * np.arange(half) / rope_dims)
    a, b = x[..., :half], x[..., half:rope_dims]
    return np.concatenate([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta),
                           x[..., rope_dims:]], axis=-1)


@attn_prep.reference
def attn_prep_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, rope_base, eps):
    """qg: (n_head, 2d); k, v: (n_kv, d); caches (n_ctx, n_kv, d) f16. Returns (q, k_cache, v_cache)."""
    d = k.shape[-1]
    q = rope_ref(rmsnorm_ref(qg[:, :d], q_norm, eps), pos, rope_dims, rope_base)
    kc, vc = k_cache.copy(), v_cache.copy()
    kc[pos] = rope_ref(rmsnorm_ref(k, k_norm, eps), pos, rope_dims, rope_base)
    vc[pos] = v
    return q.astype(np.float32), kc, vc


# ---- split attention over the cache ----------------------------------------------------------------

def row_lanes(D: int, SG: int) -> int:
    """Lanes that share one cache row (each holds D / (4 · lanes) float4 pieces of it)."""
    return min(SG, D // 4)


def _decode_fits(v) -> bool:
    lanes = row_lanes(v.D, v.SG)
    return v.D % 4 == 0 and lanes & (lanes - 1) == 0 and v.D % (4 * lanes) == 0


@zdsl.kernel(workgroup="SG", subgroup="SG", variants={"D": [128, 256], "G": [1, 2, 4, 8], "SG": SUBGROUPS},
             where=_decode_fits)
def attn_decode(q: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16], step: Buffer[u32], part: Buffer[f32],
                n_kv: u32, G: Const = 8, D: Const = 256, SG: Const = 32):
    """Partial attention of the G query heads of KV head g = workgroup_id(1) (query heads
    g·G .. g·G + G − 1) over chunk s = workgroup_id(0) of the cache rows 0 .. step[1] − 1:
    with nsplit = the grid's x size, chunk = ceil(step[1] / nsplit), rows [s·chunk, (s+1)·chunk).
    A subgroup is one workgroup; `row_lanes` lanes share a cache row (each reads D / lanes of its
    dims as float4 and keeps those dims of q and of the G accumulators in registers), and the
    subgroup's SG / lanes clusters take alternate rows, merged at the end. K and V are read
    once for all G heads. Empty chunks write nothing (the combine skips them).
    Grid: (nsplit, n_kv)."""
    C = row_lanes(D, SG)
    P, NC = D // (4 * C), SG // C  # float4 pieces per lane, clusters per subgroup
    s, g = zdsl.workgroup_id(0), zdsl.workgroup_id(1)
    nsplit, length = zdsl.num_workgroups(0), step[1]
    chunk = (length + nsplit - 1) // nsplit
    start = s * chunk
    end = zdsl.min(start + chunk, length)
    lane = zdsl.lane_id()
    r, c = lane % C, lane // C
    cluster = C if C < SG else None
    with zdsl.if_(start < length):
        sm = 1.0 / math.sqrt(D)
        qv = [[q.vec4[(g * G + h) * (D // 4) + r + C * p] * sm for p in range(P)] for h in range(G)]
        m = [zdsl.var(LOWEST) for _ in range(G)]
        l = [zdsl.var(0.0) for _ in range(G)]
        acc = [[zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in range(P)] for _ in range(G)]
        for first in zdsl.range(start, end, NC):
            t = first + c
            if NC > 1:  # the subgroup's last round may have rows for only some clusters
                valid = t < end
                t = zdsl.min(t, end - 1)
            row = (t * n_kv + g) * (D // 4) + r
            kv = [k_cache.vec4[row + C * p].to(f32) for p in range(P)]
            vv = [v_cache.vec4[row + C * p].to(f32) for p in range(P)]
            for h in range(G):
                dots = zdsl.dot(qv[h][0], kv[0])
                for p in range(1, P):
                    dots = dots + zdsl.dot(qv[h][p], kv[p])
                score = zdsl.subgroup_sum(dots, cluster=cluster)
                m_new = zdsl.max(m[h], score)
                rescale = zdsl.exp(m[h] - m_new)
                weight = zdsl.exp(score - m_new)
                if NC > 1:
                    m_new = zdsl.where(valid, m_new, m[h])
                    rescale = zdsl.where(valid, rescale, 1.0)
                    weight = zdsl.where(valid, weight, 0.0)
                l[h].set(l[h] * rescale + weight)
                for p in range(P):
                    acc[h][p].set(acc[h][p] * rescale + vv[p] * weight)
                m[h].set(m_new)
        mask = C
        while mask < SG:  # merge the clusters' running softmaxes
            for h in range(G):
                m_o = zdsl.subgroup_shuffle_xor(m[h], mask)
                m_new = zdsl.max(m[h], m_o)
                a, b = zdsl.exp(m[h] - m_new), zdsl.exp(m_o - m_new)
                l[h].set(l[h] * a + zdsl.subgroup_shuffle_xor(l[h], mask) * b)
                for p in range(P):
                    acc[h][p].set(acc[h][p] * a + zdsl.subgroup_shuffle_xor(acc[h][p], mask) * b)
                m[h].set(m_new)
            mask *= 2
        for h in range(G):
            base = ((g * G + h) * nsplit + s) * (D + 2)
            with zdsl.if_(lane == 0):
                part[base] = m[h]
                part[base + 1] = l[h]
            with zdsl.if_(lane < C):
                for p in range(P):
                    for e in range(4):
                        part[base + 2 + 4 * (r + C * p) + e] = acc[h][p][e]


def split_bounds(length: int, nsplit: int) -> list[tuple[int, int]]:
    """The non-empty chunks [start, end) of the cache rows, as attn_decode splits them."""
    chunk = -(-length // nsplit)
    return [(s * chunk, min((s + 1) * chunk, length)) for s in range(nsplit) if s * chunk < length]


@attn_decode.reference
def attn_decode_ref(q, k_cache, v_cache, length, nsplit):
    """Partials (n_head, nsplit, d + 2) for the non-empty splits (NaN elsewhere). q: (n_head, d);
    caches (n_ctx, n_kv, d)."""
    n_head, d = q.shape
    group = n_head // k_cache.shape[1]
    out = np.full((n_head, nsplit, d + 2), np.nan)
    for h in range(n_head):
        K = k_cache[:, h // group].astype(np.float64)
        V = v_cache[:, h // group].astype(np.float64)
        for s, (a, b) in enumerate(split_bounds(length, nsplit)):
            scores = K[a:b] @ q[h] / np.sqrt(d)
            w = np.exp(scores - scores.max())
            out[h, s] = np.concatenate([[scores.max(), w.sum()], w @ V[a:b]])
    return out


# ---- merge the splits, gate ------------------------------------------------------------------------

@zdsl.kernel(workgroup="WG", variants={"WG": [64, 256]})
def attn_combine(part: Buffer[f32], qg: Buffer[f32], step: Buffer[u32], o: Buffer[f32], d: u32, nsplit: u32,
                 WG: Const = 256):
    """o[h] = (Σ_s e^(m_s − M) acc_s) / (Σ_s e^(m_s − M) l_s) · sigmoid(gate_h) over the non-empty
    splits of attn_decode (same nsplit), M = max_s m_s; gate_h = qg[h, d:2d]. Grid: n_head."""
    h = zdsl.workgroup_id()
    length = step[1]
    chunk = (length + nsplit - 1) // nsplit
    used = (length + chunk - 1) // chunk
    rec = d + 2
    base = h * nsplit * rec
    top = zdsl.var(LOWEST)
    for s in zdsl.range(used):
        top.set(zdsl.max(top, part[base + s * rec]))
    total = zdsl.var(0.0)
    for s in zdsl.range(used):
        total += zdsl.exp(part[base + s * rec] - top) * part[base + s * rec + 1]
    inv = 1.0 / total
    for j in zdsl.range(zdsl.local_index(), d, WG):
        num = zdsl.var(0.0)
        for s in zdsl.range(used):
            num += zdsl.exp(part[base + s * rec] - top) * part[base + s * rec + 2 + j]
        o[h * d + j] = num * inv * zdsl.sigmoid(qg[h * 2 * d + d + j])


@attn_combine.reference
def attn_combine_ref(part, qg, length, nsplit):
    """part: (n_head, nsplit, d + 2) from attn_decode; qg: (n_head, 2d). Returns o: (n_head, d)."""
    d = part.shape[-1] - 2
    used = len(split_bounds(length, nsplit))
    p = np.asarray(part[:, :used], np.float64)
    w = np.exp(p[:, :, 0] - p[:, :, 0].max(axis=1, keepdims=True))
    o = (w[:, :, None] * p[:, :, 2:]).sum(axis=1) / (w * p[:, :, 1]).sum(axis=1, keepdims=True)
    return (o / (1 + np.exp(-qg[:, d:]))).astype(np.float32)


def attention_ref(q, k_cache, v_cache, qg, length):
    """The whole decode step from the model doc: softmax(q·Kᵀ/√d) V over rows 0..length−1 with
    query head h reading KV head h // (n_head / n_kv), times sigmoid(gate_h). (n_head, d) f32."""
    n_head, d = q.shape
    group = n_head // k_cache.shape[1]
    K = np.repeat(k_cache[:length].astype(np.float64).transpose(1, 0, 2), group, axis=0)
    V = np.repeat(v_cache[:length].astype(np.float64).transpose(1, 0, 2), group, axis=0)
    scores = np.einsum("hd,htd->ht", q.astype(np.float64), K) / np.sqrt(d)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    o = np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), V)
    return (o / (1 + np.exp(-qg[:, d:].astype(np.float64)))).astype(np.float32)
