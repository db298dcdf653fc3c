"""Full-attention layers at decode time (one new token, grouped-query attention): one dispatch
per layer, `attn_decode`, with grid (nsplit, n_kv). Workgroup (s, g) serves the G query heads of
KV head g over chunk s of the cache rows (`split_rows`); a decode step needs no other pass:

1. Every workgroup builds its G queries from the projection qg (per-head RMSNorm, NEOX RoPE on
   the first rope_dims dims, the 1/√D scale) in shared memory; the one whose chunk holds the
   new position also appends that token's k (normed, rotated) and v to the f16 caches.
2. It walks its chunk once for all G heads and writes each head's partial softmax.
3. The last workgroup of KV head g to finish merges the chunks of its G heads and applies the
   output gate: o[h] = attention(h) · sigmoid(gate_h), in f32 and (Q8) as Q8_1.

Each of those was a dispatch of its own until folding them saved two dependent stages per layer
(docs/PERF.md). Per-token values come from the `step` buffer (step[0] = position, step[1] =
length), so one recorded command buffer serves every position: the chunk length and the chunks
in use are derived from step[1] on the GPU, and workgroups of unused chunks exit at once.
Layouts:

- KV caches (`Buffer[f16]`, one each for K and V): [position][kv head][d].
- Partials: [query head][split][d + 4] f32: the chunk's max score m, its Σ exp(score − m), two
  unused words (so the sums below start on 16 bytes), then Σ exp(score − m) · v (d values).
  Scores include the 1/√d scale.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Coherent, Const, f16, f32, u32
from zdsl.kernels.norm import rms_norm_ref
from zdsl.kernels.q8_1 import store_q8_1
from zdsl.kernels.reduce import SUBGROUPS

LOWEST = float(np.finfo(np.float32).min)  # the "no score yet" max: finite, so empty merges give 0, not NaN


# ---- the new token: queries, and its row of the caches --------------------------------------------

def rotate(load, j, pos, rope_dims, log2_base):
    """Element j of a head after NEOX RoPE at position pos, load(j) giving the head before it:
    dims i and i + rope_dims/2 (i < rope_dims/2) turn together by θ_i = pos · base^(−2i/rope_dims);
    dims from rope_dims on stay."""
    value = zdsl.var(load(j))
    half = rope_dims // 2
    with zdsl.if_(j < rope_dims):
        first = j < half
        i = zdsl.where(first, j, j - half)
        partner = load(zdsl.where(first, j + half, j - half))
        # θ in turns, reduced to [-1/2, 1/2] so cos/sin see |angle| ≤ π
        turns = pos.to(f32) * zdsl.exp2(-(2 * i).to(f32) / rope_dims.to(f32) * log2_base) * (0.5 / math.pi)
        angle = (turns - zdsl.round(turns)) * (2 * math.pi)
        value.set(value * zdsl.cos(angle) + zdsl.where(first, -partner, partner) * zdsl.sin(angle))
    return value


def new_token(qg, k, v, q_norm, k_norm, k_cache, v_cache, g, pos, writes_kv, n_kv, rope_dims, rope_base, eps,
              G: int, D: int, NW: int, SG: int):
    """A shared array of the G queries of KV head g (head h at h·D): rope(rmsnorm(qg[g·G + h, :D])
    · q_norm) / √D, qg holding [query D | gate D] per head. Where writes_kv, also the new
    token's row pos of the caches for KV head g: rope(rmsnorm(k[g]) · k_norm) and v[g], as f16,
    visible to this workgroup's loads once it returns."""
    heads = zdsl.where(writes_kv, G + 1, G, u32)  # the k head after the queries
    normed, queries = zdsl.shared(f32, (G + 1) * D), zdsl.shared(f32, G * D)
    for h in zdsl.range(zdsl.subgroup_id(), heads, NW):  # a subgroup per head
        is_q = h < G

        def x(j):
            return zdsl.where(is_q, qg.load((g * G + h) * 2 * D + j, mask=is_q, other=0.0),
                              k.load(g * D + j, mask=~is_q, other=0.0))

        squares = zdsl.var(0.0)
        for j in zdsl.range(zdsl.lane_id(), D, SG):
            xj = x(j)
            squares.set(zdsl.fma(xj, xj, squares))
        scale = zdsl.rsqrt(zdsl.subgroup_sum(squares) / D + eps)
        for j in zdsl.range(zdsl.lane_id(), D, SG):
            normed[h * D + j] = x(j) * scale * zdsl.where(is_q, q_norm[j], k_norm[j])
    zdsl.barrier()
    log2_base = zdsl.log2(rope_base)
    for i in zdsl.range(zdsl.local_index(), heads * D, NW * SG):
        h, j = i // D, i % D
        value = rotate(lambda e: normed[h * D + e], j, pos, rope_dims, log2_base)
        with zdsl.if_(h < G):
            queries[i] = value * (1.0 / math.sqrt(D))
        with zdsl.else_():
            row = (pos * n_kv + g) * D + j
            k_cache[row] = value.to(f16)
            v_cache[row] = v[g * D + j].to(f16)
    zdsl.memory_barrier()  # the new row, before the chunk's loads of it
    zdsl.barrier()
    return queries


def rope_ref(x, pos, rope_dims, base):
    """NEOX RoPE of the first rope_dims dims of x (..., d) at position pos."""
    half = rope_dims // 2
    theta = pos * base ** (-2.0 * np.arange(half) / rope_dims)
    a, b = x[..., :half], x[..., half:rope_dims]
    return np.concatenate([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta),
                           x[..., rope_dims:]], axis=-1)


# ---- split attention over the cache ----------------------------------------------------------------

# Short contexts: up to SHORT_SPLITS chunks of at least SHORT_CHUNK rows (a workgroup walks its
# chunk row after row, so at a few hundred rows more, shorter chunks finish sooner); longer
# ones: chunks of min_chunk rows, so the partials stay a small fraction of the cache read.
SHORT_CHUNK, SHORT_SPLITS = 16, 32


def split_rows(length, nsplit, min_chunk):
    """(rows per split, splits in use): the rows 0..length−1 cut into at most nsplit chunks of at
    least min(min_chunk, max(SHORT_CHUNK, length / SHORT_SPLITS)) rows."""
    floor = zdsl.min(min_chunk, zdsl.max((length + SHORT_SPLITS - 1) // SHORT_SPLITS, SHORT_CHUNK))
    chunk = zdsl.max((length + nsplit - 1) // nsplit, floor)
    return chunk, (length + chunk - 1) // chunk


def split_count(n_ctx: int, min_chunk: int, max_splits: int) -> int:
    """The splits to record (attn_decode's grid) for a context of n_ctx rows: enough for every
    length up to n_ctx as split_rows cuts it, at most max_splits."""
    return max(1, min(max_splits, max(-(-n_ctx // min_chunk), min(SHORT_SPLITS, -(-n_ctx // SHORT_CHUNK)))))


def split_bounds(length: int, nsplit: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """The chunks [start, end) in use, as attn_decode cuts them."""
    floor = min(min_chunk, max(-(-length // SHORT_SPLITS), SHORT_CHUNK))
    chunk = max(-(-length // nsplit), floor)
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]


def row_lanes(D: int, SG: int) -> int:
    """Lanes that share one cache row (each holds D / (4 · lanes) float4 pieces of it)."""
    return min(SG, D // 4)


def head_scores(partials, C: int, SG: int, lane):
    """Every head's score from each lane's partial dot products (one per head), summed over the
    C lanes of each row cluster, in every lane. For G = len(partials) a power of two ≤ C, a
    transposed reduction: each halving exchange sends half the remaining values, so lane r ends
    with the total of head r // (C / G) after G − 1 + log2(C / G) shuffles, and G more shuffles
    hand every total to every lane (2G − 1 + log2(C / G) instead of G · log2(C))."""
    G = len(partials)
    if G == 1 or G & (G - 1) or G > C:
        return [zdsl.subgroup_sum(x, cluster=C if C < SG else None) for x in partials]
    vals, mask = list(partials), C // 2
    while mask:
        if len(vals) > 1:
            half = len(vals) // 2
            upper = (lane & mask) != 0
            keep = [zdsl.where(upper, hi, lo) for lo, hi in zip(vals[:half], vals[half:])]
            send = [zdsl.where(upper, lo, hi) for lo, hi in zip(vals[:half], vals[half:])]
            vals = [k + zdsl.subgroup_shuffle_xor(x, mask) for k, x in zip(keep, send)]
        else:
            vals = [vals[0] + zdsl.subgroup_shuffle_xor(vals[0], mask)]
        mask //= 2
    first = lane - lane % C
    return [zdsl.subgroup_shuffle(vals[0], first + h * (C // G)) for h in range(G)]


def _decode_fits(v) -> bool:
    lanes = row_lanes(v.D, v.SG)
    return v.D % 4 == 0 and lanes & (lanes - 1) == 0 and v.D % (4 * lanes) == 0


def chunk_partials(queries, k_cache, v_cache, part, g, s, nsplit, start, end, n_kv,
                   G: int, D: int, NW: int, U: int, SG: int):
    """Each of the G heads' partial softmax over cache rows start .. end − 1 into record
    (g·G + h, s) of `part` (layout above). `row_lanes` lanes share a cache row: each reads D /
    lanes of its dims as float4 and keeps those dims of the G queries and G accumulators in
    registers, so K and V are read once for all G heads. A subgroup takes U rows per cluster of
    lanes per round (their loads in flight together); the NW subgroups of the workgroup take
    alternate rounds, and their running softmaxes are merged through shared memory at the end."""
    C = row_lanes(D, SG)
    P, NC = D // (4 * C), SG // C  # float4 pieces per lane, row clusters per subgroup
    rows_per_round = U * NC
    sub, lane = zdsl.subgroup_id(), zdsl.lane_id()
    r, c = lane % C, lane // C
    qv = [[zdsl.vec(*[queries[h * D + 4 * (r + C * p) + e] for e in range(4)]) for p in range(P)] for h in range(G)]
    m = [zdsl.var(LOWEST) for _ in range(G)]
    l = [zdsl.var(0.0) for _ in range(G)]
    acc = [[zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in range(P)] for _ in range(G)]
    for first in zdsl.range(start + sub * rows_per_round, end, NW * rows_per_round):
        rows = [first + c + NC * u for u in range(U)]
        valid = [t < end for t in rows] if rows_per_round > 1 else None  # the last round may run out
        if valid:
            rows = [zdsl.min(t, end - 1) for t in rows]
        bases = [(t * n_kv + g) * (D // 4) + r for t in rows]
        kv = [[k_cache.vec4[b + C * p].to(f32) for p in range(P)] for b in bases]
        vv = [[v_cache.vec4[b + C * p].to(f32) for p in range(P)] for b in bases]
        row_scores = []  # [row][head]
        for u in range(U):
            dots = []
            for h in range(G):
                x = zdsl.dot(qv[h][0], kv[u][0])
                for p in range(1, P):
                    x = x + zdsl.dot(qv[h][p], kv[u][p])
                dots.append(x)
            scores = head_scores(dots, C, SG, lane)
            row_scores.append([zdsl.where(valid[u], x, LOWEST) for x in scores] if valid else scores)
        for h in range(G):
            scores = [row[h] for row in row_scores]
            m_new = m[h]
            for score in scores:
                m_new = zdsl.max(m_new, score)
            rescale = zdsl.exp(m[h] - m_new)
            weights = [zdsl.exp(score - m_new) for score in scores]
            if valid:
                weights = [zdsl.where(ok, w, 0.0) for ok, w in zip(valid, weights)]
            total = l[h] * rescale
            for w in weights:
                total = total + w
            l[h].set(total)
            for p in range(P):
                a = acc[h][p] * rescale
                for u, w in enumerate(weights):
                    a = a + vv[u][p] * w
                acc[h][p].set(a)
            m[h].set(m_new)
    mask = C
    while mask < SG:  # merge the row clusters of the subgroup
        for h in range(G):
            m_o = zdsl.subgroup_shuffle_xor(m[h], mask)
            m_new = zdsl.max(m[h], m_o)
            a, b = zdsl.exp(m[h] - m_new), zdsl.exp(m_o - m_new)
            l[h].set(l[h] * a + zdsl.subgroup_shuffle_xor(l[h], mask) * b)
            for p in range(P):
                acc[h][p].set(acc[h][p] * a + zdsl.subgroup_shuffle_xor(acc[h][p], mask) * b)
            m[h].set(m_new)
        mask *= 2
    record = [((g * G + h) * nsplit + s) * (D // 4 + 1) for h in range(G)]  # in float4s
    if NW == 1:
        for h in range(G):
            with zdsl.if_(lane == 0):
                part[4 * record[h]] = m[h]
                part[4 * record[h] + 1] = l[h]
            with zdsl.if_(lane < C):
                for p in range(P):
                    part.vec4[record[h] + 1 + r + C * p] = acc[h][p]
        return
    # merge the subgroups: statistics first, then the rescaled sums one subgroup at a time
    m_sh, l_sh = zdsl.shared(f32, NW * G), zdsl.shared(f32, NW * G)
    acc_sh = zdsl.shared(f32.vec(4), G * D // 4)
    with zdsl.if_(lane == 0):
        for h in range(G):
            m_sh[sub * G + h] = m[h]
            l_sh[sub * G + h] = l[h]
    zdsl.barrier()
    for h in range(G):
        top = m_sh[h]
        for w in range(1, NW):
            top = zdsl.max(top, m_sh[w * G + h])
        total = l_sh[h] * zdsl.exp(m_sh[h] - top)
        for w in range(1, NW):
            total = total + l_sh[w * G + h] * zdsl.exp(m_sh[w * G + h] - top)
        with zdsl.if_(zdsl.local_index() == 0):
            part[4 * record[h]] = top
            part[4 * record[h] + 1] = total
        m[h].set(zdsl.exp(m[h] - top))  # from here on: this subgroup's weight
    for w in zdsl.range(NW):  # a GPU loop, as this code is fetched from memory at every use
        with zdsl.if_((sub == w) & (lane < C)):
            for h in range(G):
                for p in range(P):
                    i = h * (D // 4) + r + C * p
                    mine = acc[h][p] * m[h]
                    acc_sh[i] = zdsl.where(w == 0, mine, acc_sh[i] + mine)
        zdsl.barrier()
    for i in zdsl.range(zdsl.local_index(), G * D // 4, NW * SG):
        part.vec4[((g * G + i // (D // 4)) * nsplit + s) * (D // 4 + 1) + 1 + i % (D // 4)] = acc_sh[i]


def merge_chunks(part, qg, o, oq, od, g, nsplit, used, G: int, D: int, R: int, Q8: bool, WG: int):
    """o[h] = (Σ_s e^(m_s − M) acc_s) / (Σ_s e^(m_s − M) l_s) · sigmoid(gate_h) for the G heads
    h of KV head g over the `used` chunks, M = max_s m_s, gate_h = qg[h, D:2D]; with Q8 also as
    Q8_1 (oq, od: the output projection's int8 input; q8_1.py). Invocation t takes float4s t,
    t + WG, … of those heads' outputs, so eight neighbours hold a Q8_1 block, and loads R
    chunks' records before it uses any."""
    quads, t = G * D // 4, zdsl.local_index()
    for first in zdsl.range(0, quads, WG):
        i = zdsl.min(first + t, quads - 1)
        head, quad = g * G + i // (D // 4), i % (D // 4)
        top, total, acc = zdsl.var(LOWEST), zdsl.var(0.0), zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0))
        for s0 in zdsl.range(0, used, R):
            records = [(head * nsplit + zdsl.min(s0 + c, used - 1)) * (D // 4 + 1) for c in range(R)]
            m_s = [part[4 * rec] for rec in records]
            l_s = [part[4 * rec + 1] for rec in records]
            acc_s = [part.vec4[rec + 1 + quad] for rec in records]
            m_new = top
            for m_c in m_s:
                m_new = zdsl.max(m_new, m_c)
            a = zdsl.exp(top - m_new)
            b = [zdsl.where(s0 + c < used, zdsl.exp(m_c - m_new), 0.0) for c, m_c in enumerate(m_s)]
            new_total, new_acc = total * a, acc * a
            for b_c, l_c, acc_c in zip(b, l_s, acc_s):
                new_total = new_total + l_c * b_c
                new_acc = new_acc + acc_c * b_c
            total.set(new_total)
            acc.set(new_acc)
            top.set(m_new)
        gate = qg.vec4[(head * 2 * D + D) // 4 + quad]
        value = acc * (1.0 / total) / (zdsl.exp(-gate) + 1.0)
        out = g * G * (D // 4) + i
        valid = first + t < quads
        with zdsl.if_(valid):
            o.vec4[out] = value
        if Q8:
            store_q8_1(value, out, valid, oq, od)


@zdsl.kernel(workgroup=lambda v: v.NW * v.SG, subgroup="SG",
             variants={"D": [128, 256], "G": [2, 4, 8], "NW": [1, 4], "U": [2, 4], "R": [4, 8], "Q8": [False, True],
                       "SG": SUBGROUPS}, where=_decode_fits)
def attn_decode(qg: Buffer[f32], k: Buffer[f32], v: Buffer[f32], q_norm: Buffer[f32], k_norm: Buffer[f32],
                step: Buffer[u32], k_cache: Coherent[f16], v_cache: Coherent[f16], part: Coherent[f32],
                arrivals: Buffer[u32], o: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], n_kv: u32, min_chunk: u32,
                rope_dims: u32, rope_base: f32, eps: f32, G: Const = 8, D: Const = 256, NW: Const = 4, U: Const = 2,
                R: Const = 4, Q8: Const = False, SG: Const = 32):
    """One decode step of an attention layer for the G query heads of KV head g = workgroup_id(1)
    (query heads g·G .. g·G + G − 1), over chunk s = workgroup_id(0) of the cache rows 0 ..
    step[1] − 1 as `split_rows` cuts them with nsplit = the grid's x size: the new token's
    queries and cache row (`new_token`, at position step[0] < step[1]), the chunk's partials
    (`chunk_partials`), and in the last of KV head g's workgroups to finish (arrivals[g] counts
    them: 0 before, 0 after) the gated output (`merge_chunks`). rope_dims is even and ≤ D; Q8
    needs D a multiple of 32. Grid: (nsplit, n_kv)."""
    if not _decode_fits(SimpleNamespace(D=D, SG=SG)):
        raise zdsl.ZdslError(f"attn_decode needs D / 4 a power of two or a multiple of 4·SG, not D={D}, SG={SG}")
    if Q8 and D % 32:
        raise zdsl.ZdslError(f"attn_decode writes Q8_1 blocks of 32 dims: D = {D} is not a multiple of 32")
    s, g = zdsl.workgroup_id(0), zdsl.workgroup_id(1)
    nsplit, pos, length = zdsl.num_workgroups(0), step[0], step[1]
    chunk, used = split_rows(length, nsplit, min_chunk)
    with zdsl.if_(s < used):
        queries = new_token(qg, k, v, q_norm, k_norm, k_cache, v_cache, g, pos, s == pos // chunk, n_kv, rope_dims,
                            rope_base, eps, G, D, NW, SG)
        start = s * chunk
        chunk_partials(queries, k_cache, v_cache, part, g, s, nsplit, start, zdsl.min(start + chunk, length), n_kv,
                       G, D, NW, U, SG)
        with zdsl.if_(zdsl.last_workgroup(arrivals, g, of=used)):
            merge_chunks(part, qg, o, oq, od, g, nsplit, used, G, D, R, Q8, NW * SG)


@attn_decode.reference
def attn_decode_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, rope_base, eps):
    """(o, k_cache, v_cache) after the token at `pos` (length pos + 1). qg: (n_head, 2d); k, v:
    (n_kv, d); caches (n_ctx, n_kv, d) f16; o: (n_head, d)."""
    d = k.shape[-1]
    q = rope_ref(rms_norm_ref(qg[:, :d], q_norm, eps), pos, rope_dims, rope_base)
    kc, vc = k_cache.copy(), v_cache.copy()
    kc[pos] = rope_ref(rms_norm_ref(k, k_norm, eps), pos, rope_dims, rope_base)
    vc[pos] = v
    return attention_ref(q, kc, vc, qg, pos + 1), kc, vc


def attention_ref(q, k_cache, v_cache, qg, length):
    """softmax(q·Kᵀ/√d) V over rows 0..length−1 with query head h reading KV head h // (n_head /
    n_kv), times sigmoid(gate_h), from the model doc. (n_head, d) f32."""
    n_head, d = q.shape
    group = n_head // k_cache.shape[1]
    K = np.repeat(k_cache[:length].astype(np.float64).transpose(1, 0, 2), group, axis=0)
    V = np.repeat(v_cache[:length].astype(np.float64).transpose(1, 0, 2), group, axis=0)
    scores = np.einsum("hd,htd->ht", q.astype(np.float64), K) / np.sqrt(d)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    o = np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), V)
    return (o / (1 + np.exp(-qg[:, d:].astype(np.float64)))).astype(np.float32)
