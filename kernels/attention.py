"""Full-attention layers (grouped-query attention), at decode time and for a prompt's chunks.

Three dispatches per layer at decode (one new token):

- `attn_prep`: per-head RMSNorm of q and k, NEOX RoPE on the first `rope_dims` dims, q written
  out as f32, k and v appended to the f16 KV cache at the current position.
- `attn_decode`: the context cut into at most `nsplit` chunks (`split_rows`); one
  workgroup per (chunk, KV head) walks its chunk once and serves every query head of the group,
  writing partial softmax statistics.
- `attn_combine`: merges the chunks per query head and applies the output gate.

Per-token values come from the `step` buffer (step[0] = position, step[1] = length), so one
recorded command buffer serves every position: the chunk length and the number of chunks in use
are derived from step[1] on the GPU, and workgroups of unused chunks exit at once. Layouts:

- KV caches (`Buffer[f16]`, one each for K and V): [position][kv head][d].
- Partials: [query head][split][d + 2] f32: the chunk's max score m, its Σ exp(score − m), then
  Σ exp(score − m) · v (d values). Scores include the 1/sqrt(d) scale.

Two for a chunk of t prompt tokens at positions step[0] .. step[0] + t − 1 (rows of q, k, v, o
back to back, one per token):

- `attn_prep_rows`: attn_prep for every token of the chunk (the same code), cache rows appended.
- `attn_prefill`: causal attention of the chunk's queries over the cache rows up to each one's
  position, softmax computed online (running max and sum), gated, and as Q8_1 if asked; a
  workgroup owns a block of tokens of one KV head, so each K/V row it loads serves several
  queries. No partials: a chunk has enough queries to fill the GPU without splitting the rows.
- `attn_prefill_coop`: the same on matrix units (flash attention), where the device has them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, f16, f32, u32
from zdsl.kernels import inputs, mma
from zdsl.kernels.kvcache import KV_FORMATS, KVTypes
from zdsl.kernels.norm import rms_scale
from zdsl.kernels.q8_1 import store_q8_1
from zdsl.kernels.reduce import SUBGROUPS
from zdsl.kernels.steps import sequences_of

LOWEST = float(np.finfo(np.float32).min)  # the "no score yet" max: finite, so empty merges give 0, not NaN


# ---- q/k norm, RoPE, KV-cache append --------------------------------------------------------------

def _prep_traffic(v, s, t: int = 1) -> int:
    """Per token q, k and v in, q out, a cache row of each KV head written; the norms' weights."""
    row = KV_FORMATS[v.KT].row_bytes(s.d) + KV_FORMATS[v.VT].row_bytes(s.d)
    return t * (4 * (s.n_head * 3 * s.d + 2 * s.n_kv * s.d) + s.n_kv * row) + 8 * s.d


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS},
             key=("d",), sizes=("sequences",), grid=lambda v, s: (s.n_head + s.n_kv, 1, getattr(s, "sequences", 1)),
             traffic=_prep_traffic)
def attn_prep(qg: Buffer[f32], k: Buffer[f32], v: Buffer[f32], q_norm: Buffer[f32], k_norm: Buffer[f32],
              step: Buffer[u32], q: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16],
              n_head: u32, n_kv: u32, d: u32, rope_dims: u32, rope_base: f32, eps: f32, row: u32 = 0,
              seq_bytes: u32 = 0, WG: Const = 256, KT: Const = "f16", VT: Const = "f16", SG: Const = 32):
    """Workgroup h < n_head: q[h] = rope(rmsnorm(qg[h, :d]) · q_norm) (qg holds [query d | gate d]
    per head). Workgroup n_head + g: k_cache[pos, g] = rope(rmsnorm(k[g]) · k_norm) and
    v_cache[pos, g] = v[g], in the KV formats KT and VT (kvcache.py), pos = step[0]; d is a
    multiple of 4 (of 32 for a quantized format). RoPE pairs dim i with i + rope_dims/2, θ_i = pos · rope_base^(−2i/rope_dims);
    rope_dims is even and ≤ d. qg, k, v and q are read and written at row `row` (one sequence of
    a batch, batch.py). Where K's format rotates (q3_rot), q is rotated as k is. Several rows
    may go in one launch (`sequences`, the grid's z: steps.sequences_of), as in attn_decode and
    attn_combine."""
    row, step, k_cache, v_cache = sequences_of(row, step, seq_bytes, k_cache, v_cache)
    _prep_head(qg, k, v, q_norm, k_norm, q, k_cache, v_cache, zdsl.workgroup_id(), row, step[0],
               n_head, n_kv, d, rope_dims, rope_base, eps, WG, SG, KT, VT)


def _prep_head(qg, k, v, q_norm, k_norm, q, k_cache, v_cache, head, token, pos, n_head, n_kv, d, rope_dims,
               rope_base, eps, WG: int, SG: int, KT: str, VT: str):
    """One workgroup's head of attn_prep: query head `head` < n_head or KV head head − n_head, of
    row `token` of qg, k, v and q (None: the only row), written to cache row `pos`. Invocation
    t holds four consecutive values, t + WG the next four, …, so that a cache format's block of
    32 lies in eight neighbours."""
    is_q = head < n_head
    g = head - n_head  # the KV head (wraps for query heads, where it is never used)
    q_base, k_base, q_out = head * 2 * d, g * d, head * d
    if token is not None:
        q_base, k_base, q_out = q_base + token * n_head * 2 * d, k_base + token * n_kv * d, q_out + token * n_head * d

    def x(j):
        """Element j of this workgroup's head, normalised and weighted."""
        return zdsl.where(is_q, qg.load(q_base + j, mask=is_q, other=0.0), k.load(k_base + j, mask=~is_q, other=0.0))

    scale = rms_scale(x, d, eps, WG, SG)
    half = rope_dims // 2
    log2_base = zdsl.log2(rope_base)

    def rotated(j):
        """Element j normed, weighted and rotated."""
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
        return value

    quads = d >> 2
    row = pos * n_kv + g
    for first in zdsl.range(0, quads, WG):  # uniform trip count: a block's eight store together
        quad = first + zdsl.local_index()
        ok = quad < quads
        at = zdsl.min(quad, quads - 1)
        values = zdsl.vec(*[rotated(4 * at + e) for e in range(4)])
        with zdsl.if_(is_q):
            # q turned as the cache's k are, where K's format rotates: the same scores
            q_values = KV_FORMATS[KT].turn(values, quad % 8)
            with zdsl.if_(ok):
                q.vec4[(q_out >> 2) + at] = q_values
        with zdsl.else_():
            KV_FORMATS[KT].store(k_cache, row, at, values, ok, d)
            KV_FORMATS[VT].store(v_cache, row, at, v.vec4[(k_base >> 2) + at], ok, d)


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


def attn_prep_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, rope_base, eps, kt="f16", vt="f16"):
    """qg: (n_head, 2d); k, v: (n_kv, d); caches (n_ctx, n_kv, …) holding rows in formats kt, vt
    (kvcache.py; of any dtype, as bytes). Returns (q, k_cache, v_cache), the caches as given."""
    q, kc, vc = attn_prep_rows_ref(qg[None], k[None], v[None], q_norm, k_norm, k_cache, v_cache, pos, rope_dims,
                                   rope_base, eps, kt, vt)
    return q[0], kc, vc


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS},
             key=("d", "t"), sizes=("t",), grid=lambda v, s: (s.n_head + s.n_kv, s.t),
             traffic=lambda v, s: _prep_traffic(v, s, s.t))
def attn_prep_rows(qg: Buffer[f32], k: Buffer[f32], v: Buffer[f32], q_norm: Buffer[f32], k_norm: Buffer[f32],
                   step: Buffer[u32], q: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16],
                   n_head: u32, n_kv: u32, d: u32, rope_dims: u32, rope_base: f32, eps: f32,
                   WG: Const = 256, KT: Const = "f16", VT: Const = "f16", SG: Const = 32):
    """attn_prep for a chunk of t tokens at positions step[0] + i (i = workgroup_id(1) < t): row i
    of qg (n_head · 2d), k and v (n_kv · d) gives row i of q (n_head · d) and cache row step[0] + i.
    The launch names t (the grid's y)."""
    token = zdsl.workgroup_id(1)
    _prep_head(qg, k, v, q_norm, k_norm, q, k_cache, v_cache, zdsl.workgroup_id(0), token, step[0] + token,
               n_head, n_kv, d, rope_dims, rope_base, eps, WG, SG, KT, VT)


def attn_prep_rows_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, p0, rope_dims, rope_base, eps, kt="f16",
                       vt="f16"):
    """qg: (T, n_head, 2d); k, v: (T, n_kv, d); caches (n_ctx, n_kv, …) holding rows in formats
    kt, vt (kvcache.py; of any dtype, as bytes). Returns (q (T, n_head, d), k_cache, v_cache) with
    rows p0 .. p0 + T − 1 written, token i rotated at position p0 + i, the caches as given; q
    turned by the Hadamard blocks where kt's rows are."""
    T, d = k.shape[0], k.shape[-1]
    pos = (p0 + np.arange(T))[:, None, None]
    q = rope_ref(rmsnorm_ref(qg[..., :d], q_norm, eps), pos, rope_dims, rope_base)
    q = KV_FORMATS[kt].turned(q)
    kc, vc = k_cache.view(np.uint8).copy(), v_cache.view(np.uint8).copy()
    kc[p0:p0 + T] = KV_FORMATS[kt].encode(rope_ref(rmsnorm_ref(k, k_norm, eps), pos, rope_dims, rope_base))
    vc[p0:p0 + T] = KV_FORMATS[vt].encode(v)
    return q.astype(np.float32), kc.view(k_cache.dtype), vc.view(v_cache.dtype)


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
    """The chunks [start, end) in use, as attn_decode and attn_combine cut them."""
    floor = min(min_chunk, max(-(-length // SHORT_SPLITS), SHORT_CHUNK))
    chunk = max(-(-length // nsplit), floor)
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]


def row_lanes(D: int, SG: int) -> int:
    """Lanes that share one cache row (each holds D / (4 · lanes) float4 pieces of it)."""
    return min(SG, D // 4)


def owns(G: int, C: int) -> bool:
    """Whether each of G heads can keep its softmax statistics in its own C / G lanes of a row
    cluster of C (head_totals): G a power of two ≤ C."""
    return not G & (G - 1) and G <= C


def head_totals(partials, C: int, lane):
    """Each lane's partial dot products (one per head, G = len(partials), owns(G, C)) summed over
    the C lanes of its row cluster by a transposed reduction: each halving exchange sends half
    the remaining values, so lane r ends with the total of its head r // (C / G) after G − 1 +
    log2(C / G) shuffles (instead of G · log2(C))."""
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
    return vals[0]


def from_owner(x, h: int, G: int, C: int, lane):
    """Head h's value of x, which its own lanes hold (head_totals), in every lane of the cluster."""
    return zdsl.subgroup_shuffle(x, lane - lane % C + h * (C // G))


def head_scores(partials, C: int, SG: int, lane):
    """Every head's score from each lane's partial dot products (one per head), summed over the
    C lanes of each row cluster, in every lane: head_totals, then G shuffles hand every total
    to every lane (2G − 1 + log2(C / G) shuffles), or a sum per head where not owns(G, C)."""
    G = len(partials)
    if not owns(G, C):
        return [zdsl.subgroup_sum(x, cluster=C if C < SG else None) for x in partials]
    total = head_totals(partials, C, lane)
    return [from_owner(total, h, G, C, lane) for h in range(G)]


def owned_softmax(m, l, acc, own, vv, C: int, lane, ok=None):
    """online_softmax where each lane keeps only its own head's running max m and sum l (vars;
    own[u]: its head's score for row u, from head_totals): the exponentials are taken in each
    head's lanes, not for every head in every lane, and the head's rescale and weights reach the
    accumulators acc[h][p] of every lane by shuffles. ok(u): whether row u counts."""
    G = len(acc)
    m_new = m
    for score in own:
        m_new = zdsl.max(m_new, score)
    rescale = zdsl.exp(m - m_new)
    weights = [zdsl.exp(score - m_new) for score in own]
    if ok is not None:
        weights = [zdsl.where(ok(u), w, 0.0) for u, w in enumerate(weights)]
    total = l * rescale
    for w in weights:
        total = total + w
    l.set(total)
    m.set(m_new)
    for h in range(G):
        a_h = from_owner(rescale, h, G, C, lane)
        w_h = [from_owner(w, h, G, C, lane) for w in weights]
        for p in range(len(acc[h])):
            a = acc[h][p] * a_h
            for u, w in enumerate(w_h):
                a = a + vv[u][p] * w
            acc[h][p].set(a)


def online_softmax(m, l, acc, row_scores, vv, ok=None):
    """Fold the scores row_scores[u][h] of rows u (V pieces vv[u][p]) into each head h's running
    max m[h], sum l[h] and accumulators acc[h][p] (vars). ok(u, h): whether row u counts for head
    h (its score is then LOWEST), None where every row counts."""
    for h in range(len(m)):
        scores = [row[h] for row in row_scores]
        m_new = m[h]
        for score in scores:
            m_new = zdsl.max(m_new, score)
        rescale = zdsl.exp(m[h] - m_new)
        weights = [zdsl.exp(score - m_new) for score in scores]
        if ok is not None:
            weights = [zdsl.where(ok(u, h), w, 0.0) for u, w in enumerate(weights)]
        total = l[h] * rescale
        for w in weights:
            total = total + w
        l[h].set(total)
        for p in range(len(acc[h])):
            a = acc[h][p] * rescale
            for u, w in enumerate(weights):
                a = a + vv[u][p] * w
            acc[h][p].set(a)
        m[h].set(m_new)


def merge_clusters(m, l, acc, C: int, SG: int):
    """Merge the running softmaxes of the row clusters of C lanes (lanes r, r + C, ... hold the
    same dims): afterwards every cluster holds the totals."""
    mask = C
    while mask < SG:
        for h in range(len(m)):
            m_o = zdsl.subgroup_shuffle_xor(m[h], mask)
            m_new = zdsl.max(m[h], m_o)
            a, b = zdsl.exp(m[h] - m_new), zdsl.exp(m_o - m_new)
            l[h].set(l[h] * a + zdsl.subgroup_shuffle_xor(l[h], mask) * b)
            for p in range(len(acc[h])):
                acc[h][p].set(acc[h][p] * a + zdsl.subgroup_shuffle_xor(acc[h][p], mask) * b)
            m[h].set(m_new)
        mask *= 2


def _load_rows(k_cache, v_cache, rows, quads, D: int, KT: str, VT: str):
    """([row][piece] K, the same of V): this lane's pieces (float4 at dims 4·quads[p]) of each
    cache row in `rows` (row = position · n_kv + KV head), all loads issued before any is used."""
    k, v = KV_FORMATS[KT], KV_FORMATS[VT]
    return ([[k.load(k_cache, row, quad, D) for quad in quads] for row in rows],
            [[v.load(v_cache, row, quad, D) for quad in quads] for row in rows])


def _decode_fits(v) -> bool:
    lanes = row_lanes(v.D, v.SG)
    return v.D % 4 == 0 and lanes & (lanes - 1) == 0 and v.D % (4 * lanes) == 0


def _cache_bytes(v, s) -> int:
    """K and V for ctx rows of every KV head, in their formats."""
    return s.ctx * s.n_kv * (KV_FORMATS[v.KT].row_bytes(v.D) + KV_FORMATS[v.VT].row_bytes(v.D))


def _decode_traffic(v, s) -> int:
    """The whole cache as allocated (the length a step reads grows to it), q and the partials."""
    return _cache_bytes(v, s) + 4 * s.n_kv * v.G * v.D * (1 + s.nsplit) + 8 * s.n_kv * v.G * s.nsplit


@zdsl.kernel(workgroup=lambda v: v.NW * v.SG, subgroup="SG",
             variants={"D": [128, 256], "G": [2, 4, 8], "NW": [1, 4], "U": [2, 4], "SG": SUBGROUPS}, where=_decode_fits,
             sizes=("nsplit", "ctx", "sequences"), grid=lambda v, s: (s.nsplit, s.n_kv, getattr(s, "sequences", 1)),
             traffic=_decode_traffic, cpu=dict(NW=1, DEPTH=1, U=1))
def attn_decode(q: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16], step: Buffer[u32], part: Buffer[f32],
                n_kv: u32, min_chunk: u32, row: u32 = 0, seq_bytes: u32 = 0, G: Const = 8, D: Const = 256,
                NW: Const = 4, U: Const = 2,
                KT: Const = "f16", VT: Const = "f16", DEPTH: Const = 2, SG: Const = 32):
    """Partial attention of the G query heads of KV head g = workgroup_id(1) (query heads
    g·G .. g·G + G − 1) over split s = workgroup_id(0) of the cache rows 0 .. step[1] − 1, cut by
    `split_rows` with nsplit = the grid's x size; splits past the last in use exit at once and
    write nothing. Scores include the 1/√D scale.

    `row_lanes` lanes share a cache row: each reads D / lanes of its dims as float4 and keeps
    those dims of the G queries and G accumulators in registers, so K and V are read once for
    all G heads. A subgroup takes U rows per cluster of lanes per round (their loads in flight
    together, issued DEPTH rounds ahead); the NW subgroups of the workgroup take alternate rounds,
    and their running softmaxes are merged through shared memory at the end. K and V are read in
    their formats KT and VT (kvcache.py), four values at a time, and wait for their round as read
    (`fetch`: half the registers of their values), dequantized only when used. q is read at row
    `row` (one sequence of a batch, batch.py). The launch names nsplit (the grid's x) and ctx
    (the rows the cache holds).

    Where G is a power of two ≤ the lanes of a row (`owns`), each head's running max and sum live
    in its own lanes: the exponentials are taken there, once per head, and shuffled to the
    accumulators (`owned_softmax`), where every lane took every head's before.

    H100, 35B-A3B (D 256, G 8, 2 KV heads), 32,768 rows in 128 splits, µs alone:
    every head's softmax in every lane, q8_0 43.6 (DEPTH 1) and 41.6 (DEPTH 2), f16 40.0 and
    40.7; each head's in its lanes, q8_0 54.6 and 35.9, f16 48.6 and 36.5 (at 512 rows 9.1
    both, as before): DEPTH 2 for every format. U 4 reads about as fast (35.6, 35.1) in 35 KB of
    machine code against 27: between dispatches of a step the weights evict the code from L2,
    which cost U 4 2% of the step at 512 before. The driver gives every variant all 255
    registers a lane. Tried and slower at 32,768 (H200): the group's heads sliced
    over two or four workgroups (128 or 64 registers, the rows read twice or four times: q8_0
    50.1 and 69.8 µs against 41.5), and the split pass on matrix units."""
    if not _decode_fits(SimpleNamespace(D=D, SG=SG)):
        raise zdsl.ZdslError(f"attn_decode needs D / 4 a power of two or a multiple of 4·SG, not D={D}, SG={SG}")
    for kv_type in (KT, VT):
        KV_FORMATS[kv_type].check(D)
    row, step, k_cache, v_cache, part = sequences_of(row, step, seq_bytes, k_cache, v_cache, part)
    C = row_lanes(D, SG)
    P, NC = D // (4 * C), SG // C  # float4 pieces per lane, row clusters per subgroup
    rows_per_round = U * NC
    q = q.at(row * (n_kv * G * D))
    s, g = zdsl.workgroup_id(0), zdsl.workgroup_id(1)
    nsplit, length = zdsl.num_workgroups(0), step[1]
    chunk, used = split_rows(length, nsplit, min_chunk)
    start = s * chunk
    end = zdsl.min(start + chunk, length)
    sub, lane = zdsl.subgroup_id(), zdsl.lane_id()
    r, c = lane % C, lane // C
    with zdsl.if_(s < used):
        sm = 1.0 / math.sqrt(D)
        quads = [P * r + p for p in range(P)]  # a lane's pieces side by side: one run of the row
        qv = [[q.vec4[(g * G + h) * (D // 4) + quad] * sm for quad in quads] for h in range(G)]
        owned = owns(G, C)  # each head's max and sum in its own lanes, else every head's in every lane
        m = zdsl.var(LOWEST) if owned else [zdsl.var(LOWEST) for _ in range(G)]
        l = zdsl.var(0.0) if owned else [zdsl.var(0.0) for _ in range(G)]
        acc = [[zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in range(P)] for _ in range(G)]
        kf, vf = KV_FORMATS[KT], KV_FORMATS[VT]

        def fetch(first):
            """This lane's pieces of the round at `first` as read: its cluster's rows (past the end,
            the last), K's then V's, [row][piece] of tuples of words."""
            rows = [zdsl.min(first + c + NC * u, end - 1) * n_kv + g for u in range(U)]
            return [[[f.fetch(cache, x, quad, D) for quad in quads] for x in rows]
                    for f, cache in ((kf, k_cache), (vf, v_cache))]

        begin, stride = start + sub * rows_per_round, NW * rows_per_round
        # DEPTH rounds in flight: this one's and the next DEPTH − 1, as read (an f16 row or q8_0
        # codes take half the registers of their values)
        rounds = [[[[[zdsl.var(w) for w in piece] for piece in row] for row in rows]
                   for rows in fetch(begin + d * stride)] for d in range(DEPTH)]
        held = rounds[0]
        for first in zdsl.range(begin, end, stride):
            # the loads DEPTH rounds ahead go out before this round's arithmetic, which hides their latency
            ahead = fetch(first + DEPTH * stride)
            kv = [[kf.unpack(piece) for piece in row] for row in held[0]]
            vv = [[vf.unpack(piece) for piece in row] for row in held[1]]
            valid = [first + c + NC * u < end for u in range(U)] if rows_per_round > 1 else None  # the last may run out
            row_scores = []  # [row][head], or [row] of this lane's head where owned
            for u in range(U):
                dots = []
                for h in range(G):
                    x = zdsl.dot(qv[h][0], kv[u][0])
                    for p in range(1, P):
                        x = x + zdsl.dot(qv[h][p], kv[u][p])
                    dots.append(x)
                if owned:
                    score = head_totals(dots, C, lane)
                    row_scores.append(zdsl.where(valid[u], score, LOWEST) if valid else score)
                else:
                    scores = head_scores(dots, C, SG, lane)
                    row_scores.append([zdsl.where(valid[u], x, LOWEST) for x in scores] if valid else scores)
            if owned:
                owned_softmax(m, l, acc, row_scores, vv, C, lane, (lambda u: valid[u]) if valid else None)
            else:
                online_softmax(m, l, acc, row_scores, vv, (lambda u, h: valid[u]) if valid else None)
            for d in range(DEPTH):  # each round moves up one; the new loads go last
                nxt = ahead if d == DEPTH - 1 else rounds[d + 1]
                for now, later in zip(rounds[d][0] + rounds[d][1], nxt[0] + nxt[1]):
                    for piece, words in zip(now, later):
                        for x, y in zip(piece, words):
                            x.set(y)
        if owned:  # every head's max and sum in every lane, as the merges below take them
            m = [zdsl.var(from_owner(m, h, G, C, lane)) for h in range(G)]
            l = [zdsl.var(from_owner(l, h, G, C, lane)) for h in range(G)]
        merge_clusters(m, l, acc, C, SG)
        record = [((g * G + h) * nsplit + s) * (D + 2) for h in range(G)]
        if NW == 1:
            for h in range(G):
                with zdsl.if_(lane == 0):
                    part[record[h]] = m[h]
                    part[record[h] + 1] = l[h]
                with zdsl.if_(lane < C):
                    for p in range(P):
                        for e in range(4):
                            part[record[h] + 2 + 4 * quads[p] + e] = acc[h][p][e]
        else:  # merge the subgroups: statistics first, then the rescaled sums one subgroup at a time
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
                    part[record[h]] = top
                    part[record[h] + 1] = total
                m[h].set(zdsl.exp(m[h] - top))  # from here on: this subgroup's weight
            for w in zdsl.range(NW):  # a GPU loop, as this code is fetched from memory at every use
                with zdsl.if_((sub == w) & (lane < C)):
                    for h in range(G):
                        for p in range(P):
                            i = h * (D // 4) + quads[p]
                            mine = acc[h][p] * m[h]
                            acc_sh[i] = zdsl.where(w == 0, mine, acc_sh[i] + mine)
                zdsl.barrier()
            for i in zdsl.range(zdsl.local_index(), G * D // 4, NW * SG):
                first = ((g * G + i // (D // 4)) * nsplit + s) * (D + 2) + 2 + 4 * (i % (D // 4))
                a = acc_sh[i]
                for e in range(4):
                    part[first + e] = a[e]


def attn_decode_ref(q, k_cache, v_cache, length, nsplit, min_chunk=1):
    """Partials (n_head, nsplit, d + 2) for the splits in use (NaN elsewhere). q: (n_head, d);
    caches (n_ctx, n_kv, d)."""
    n_head, d = q.shape
    group = n_head // k_cache.shape[1]
    out = np.full((n_head, nsplit, d + 2), np.nan)
    for h in range(n_head):
        K = k_cache[:, h // group].astype(np.float64)
        V = v_cache[:, h // group].astype(np.float64)
        for s, (a, b) in enumerate(split_bounds(length, nsplit, min_chunk)):
            scores = K[a:b] @ q[h] / np.sqrt(d)
            w = np.exp(scores - scores.max())
            out[h, s] = np.concatenate([[scores.max(), w.sum()], w @ V[a:b]])
    return out


# ---- merge the splits, gate ------------------------------------------------------------------------

def _combine_traffic(v, s) -> int:
    used = len(split_bounds(s.ctx, s.nsplit, s.min_chunk))
    return 4 * s.n_head * (used * (v.D + 2) + 3 * v.D)


def _combine_lanes(D: int) -> int:
    """Invocations of attn_combine that share a split's record: each holds four dims, eight hold
    a Q8_1 block of 32 (all of a narrower head)."""
    return min(8, D // 4)


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128, 256], "WG": [64, 256], "R": [1, 4], "Q8": [False, True], "SG": SUBGROUPS},
             where=lambda v: v.D % 4 == 0 and v.WG % _combine_lanes(v.D) == 0,
             sizes=("n_head", "ctx", "sequences"),
             grid=lambda v, s: (s.n_head, v.D // (4 * _combine_lanes(v.D)), getattr(s, "sequences", 1)),
             traffic=_combine_traffic)
def attn_combine(part: Buffer[f32], qg: Buffer[f32], step: Buffer[u32], o: Buffer[f32], oq: Buffer[u32],
                 od: Buffer[f32], nsplit: u32, min_chunk: u32, row: u32 = 0, seq_bytes: u32 = 0, D: Const = 256,
                 WG: Const = 256, R: Const = 4,
                 Q8: Const = False, VT: Const = "f16", SG: Const = 32):
    """o[h] = (Σ_s e^(m_s − M) acc_s) / (Σ_s e^(m_s − M) l_s) · sigmoid(gate_h) over the splits
    attn_decode used (same nsplit, min_chunk), M = max_s m_s; gate_h = qg[h, D:2D].

    Workgroup (h, b) makes head h's dims 32·b … 32·b + 31 (a Q8_1 block; a narrower head whole).
    Its invocations are groups of eight, each holding four of those dims, and the groups split
    the head's splits between them (group n: splits n·R …, R records loaded before any is used,
    then n·R + groups·R …), each keeping a running merge; the groups then merge through shared
    memory. So up to WG / 8 groups walk a head's splits at once, and the heads' blocks are apart:
    at depth 32,768 (256 splits) a group takes 2 rounds of loads, where one workgroup a head with
    four groups took 16 (26 µs a layer on the H100). With Q8, o also goes out as Q8_1
    (oq, od: the output projection's int8 input; q8_1.py; D a multiple of 32). The launch names
    n_head and ctx (the rows the cache holds). qg, o, oq and od are at row `row` (one sequence of
    a batch, batch.py). Where V's format VT rotates (q3_rot), the merged sums are turned back."""
    L = _combine_lanes(D)
    NG = WG // L  # groups
    if D % 4 or WG % L:
        raise zdsl.ZdslError(f"attn_combine needs D a multiple of 4 and WG a multiple of {L}, not D={D}, WG={WG}")
    if Q8 and D % 32:
        raise zdsl.ZdslError(f"attn_combine writes Q8_1 blocks of 32 dims: D = {D} is not a multiple of 32")
    row, step, part = sequences_of(row, step, seq_bytes, part)
    h, t = zdsl.workgroup_id(0), zdsl.local_index()
    n = zdsl.num_workgroups(0) * D  # a row's values: n_head · D
    qg, o = qg.at(row * 2 * n), o.at(row * n)
    if Q8:
        oq, od = oq.at(row * (n // 4)), od.at(row * (n // 16))
    lane, group = t % L, t // L
    quad = zdsl.workgroup_id(1) * L + lane  # this invocation's four dims of the head, over 4
    _, used = split_rows(step[1], nsplit, min_chunk)
    top, total = zdsl.var(LOWEST), zdsl.var(0.0)
    acc = zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0))
    for first in zdsl.range(group * R, used, NG * R):
        splits = [first + k for k in range(R)]
        valid = [s < used for s in splits] if R > 1 else None
        recs = [(h * nsplit + (zdsl.min(s, used - 1) if valid else s)) * (D + 2) for s in splits]
        m_s = [part[rec] for rec in recs]
        l_s = [part[rec + 1] for rec in recs]
        acc_s = [zdsl.vec(*[part[rec + 2 + 4 * quad + e] for e in range(4)]) for rec in recs]  # rows: 8-byte aligned
        m_new = top
        for m_k in m_s:
            m_new = zdsl.max(m_new, m_k)
        a = zdsl.exp(top - m_new)
        b = [zdsl.exp(m_k - m_new) for m_k in m_s]
        if valid:  # a clamped record past the last split counts for nothing
            b = [zdsl.where(ok, b_k, 0.0) for ok, b_k in zip(valid, b)]
        new_total, new_acc = total * a, acc * a
        for b_k, l_k, acc_k in zip(b, l_s, acc_s):
            new_total = new_total + l_k * b_k
            new_acc = new_acc + acc_k * b_k
        total.set(new_total)
        acc.set(new_acc)
        top.set(m_new)
    m_sh, l_sh = zdsl.shared(f32, NG), zdsl.shared(f32, NG)
    acc_sh = zdsl.shared(f32.vec(4), WG)
    with zdsl.if_(lane == 0):
        m_sh[group], l_sh[group] = top, total
    acc_sh[t] = acc
    zdsl.barrier()
    m_all = zdsl.var(LOWEST)  # every group merges the same (a group without splits weighs e^(LOWEST − M) = 0)
    for n in zdsl.range(NG):
        m_all.set(zdsl.max(m_all, m_sh[n]))
    denom, num = zdsl.var(0.0), zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0))
    for n in zdsl.range(NG):
        w = zdsl.exp(m_sh[n] - m_all)
        denom.set(denom + l_sh[n] * w)
        num.set(num + acc_sh[n * L + lane] * w)
    gate = qg.vec4[h * (D // 2) + D // 4 + quad]
    merged = KV_FORMATS[VT].turn(num * (1.0 / denom), lane)  # back, where V's rows are turned
    value = merged * zdsl.vec(*[zdsl.sigmoid(gate[e]) for e in range(4)])
    at = h * (D // 4) + quad
    with zdsl.if_(group == 0):
        o.vec4[at] = value
    if Q8:
        store_q8_1(value, at, group == 0, oq, od)


def attn_combine_ref(part, qg, length, nsplit, min_chunk=1, vt="f16"):
    """part: (n_head, nsplit, d + 2) from attn_decode; qg: (n_head, 2d); vt: V's format (whose
    rotation the merge undoes). Returns o: (n_head, d)."""
    d = part.shape[-1] - 2
    used = len(split_bounds(length, nsplit, min_chunk))
    p = np.asarray(part[:, :used], np.float64)
    w = np.exp(p[:, :, 0] - p[:, :, 0].max(axis=1, keepdims=True))
    o = (w[:, :, None] * p[:, :, 2:]).sum(axis=1) / (w * p[:, :, 1]).sum(axis=1, keepdims=True)
    o = KV_FORMATS[vt].turned(o).astype(np.float64)
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


# ---- causal attention of a chunk of tokens (prefill) ----------------------------------------------

def _prefill_fits(v) -> bool:
    """As attn_decode; more than one token per subgroup only where a lane's queries stay within 16
    float4 (attn_decode's G = 8 at D = 256, SG = 32), and as many accumulators."""
    return _decode_fits(v) and (v.BT == 1 or v.BT * v.G * (v.D // (4 * row_lanes(v.D, v.SG))) <= 16)


def _prefill_traffic(v, s) -> int:
    """The cache rows the chunk reads (ctx: the rows the cache holds) once, q, the gates and o."""
    rows = s.t * s.n_kv * v.G
    return _cache_bytes(v, s) + 12 * rows * v.D + (rows * (v.D + v.D // 4) if v.Q8 else 0)


@zdsl.kernel(workgroup=lambda v: v.NW * v.SG, subgroup="SG",
             variants={"D": [128, 256], "G": [2, 4, 8], "BT": [1, 2, 4], "NW": [1, 4], "U": [1, 2],
                       "Q8": [False, True], "SG": SUBGROUPS},
             where=_prefill_fits, key=("t",), sizes=("ctx",),
             grid=lambda v, s: (-(-s.t // (v.NW * v.BT)), s.n_kv), traffic=_prefill_traffic, cpu=dict(NW=1, U=1))
def attn_prefill(q: Buffer[f32], qg: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16], step: Buffer[u32],
                 o: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], n_kv: u32, t: u32, G: Const = 8,
                 D: Const = 256, BT: Const = 1, NW: Const = 4, U: Const = 2, Q8: Const = False, KT: Const = "f16",
                 VT: Const = "f16", SG: Const = 32):
    """Causal attention of a chunk of t tokens at positions p0 + i (p0 = step[0]): token i's query
    head h (q row i, n_kv · G heads of D) attends cache rows 0 .. p0 + i of KV head h // G with
    scale 1/√D; o row i, head h = softmax · V · sigmoid(gate), the gate from qg row i (per head
    [query D | gate D]). With Q8, o also goes out as Q8_1 (oq, od; D a multiple of 32), rows back
    to back as attn_combine writes them.

    Workgroup (b, g) = (workgroup_id(0), workgroup_id(1)) owns tokens b·NW·BT .. + NW·BT − 1 of KV
    head g; each of its NW subgroups BT of them, all G query heads: the subgroup walks the rows
    as attn_decode does (`row_lanes` lanes share a row, U rows per cluster in flight), each K/V
    row it loads serving its BT · G queries (masked past each token's position), and the NW
    subgroups read the same rows at about the same time (from cache after the first). The
    subgroups share nothing: no barriers. K and V are read in their formats KT and VT
    (kvcache.py), dequantized in registers. The launch names ctx (the rows the cache holds)."""
    if not _prefill_fits(SimpleNamespace(D=D, SG=SG, BT=BT, G=G)):
        raise zdsl.ZdslError(f"attn_prefill needs D / 4 a power of two or a multiple of 4·SG, and BT = 1 or "
                             f"BT·G·D / (4·row_lanes) ≤ 16, not D={D}, SG={SG}, BT={BT}, G={G}")
    if Q8 and D % 32:
        raise zdsl.ZdslError(f"attn_prefill writes Q8_1 blocks of 32 dims: D = {D} is not a multiple of 32")
    for kv_type in (KT, VT):
        KV_FORMATS[kv_type].check(D)
    C = row_lanes(D, SG)
    P, NC = D // (4 * C), SG // C  # float4 pieces per lane, row clusters per subgroup
    g, lane = zdsl.workgroup_id(1), zdsl.lane_id()
    r, c = lane % C, lane // C
    first_token = (zdsl.workgroup_id(0) * NW + zdsl.subgroup_id()) * BT
    tokens = [zdsl.min(first_token + j, t - 1) for j in range(BT)]  # past the chunk: computed, not written
    p0 = step[0]
    ends = [p0 + token + 1 for token in tokens]  # token j attends rows 0 .. ends[j] − 1
    queries = [(j, h) for j in range(BT) for h in range(G)]
    heads = [tokens[j] * (n_kv * G) + g * G + h for j, h in queries]  # q / o rows of (token, head)
    sm = 1.0 / math.sqrt(D)
    quads = [r + C * p for p in range(P)]  # strided: eight neighbouring lanes hold a Q8_1 block of o
    qv = [[q.vec4[row * (D // 4) + quad] * sm for quad in quads] for row in heads]
    m = [zdsl.var(LOWEST) for _ in queries]
    l = [zdsl.var(0.0) for _ in queries]
    acc = [[zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in range(P)] for _ in queries]
    end = ends[-1]
    for first in zdsl.range(0, end, U * NC):
        rows = [first + c + NC * u for u in range(U)]
        kv, vv = _load_rows(k_cache, v_cache, [zdsl.min(x, end - 1) * n_kv + g for x in rows], quads, D, KT, VT)
        seen = [[x < e for e in ends] for x in rows]  # [row][token]: the row is in the token's past
        row_scores = []
        for u in range(U):
            dots = []
            for qi in range(len(queries)):
                x = zdsl.dot(qv[qi][0], kv[u][0])
                for p in range(1, P):
                    x = x + zdsl.dot(qv[qi][p], kv[u][p])
                dots.append(x)
            scores = head_scores(dots, C, SG, lane)
            row_scores.append([zdsl.where(seen[u][j], x, LOWEST) for (j, _), x in zip(queries, scores)])
        online_softmax(m, l, acc, row_scores, vv, lambda u, qi: seen[u][queries[qi][0]])
    merge_clusters(m, l, acc, C, SG)
    for qi, (j, _) in enumerate(queries):
        mine = (first_token + j < t) & (lane < C)
        inv = 1.0 / l[qi]
        for p in range(P):
            quad = quads[p]
            gate = qg.vec4[heads[qi] * (D // 2) + D // 4 + quad]
            merged = KV_FORMATS[VT].turn(acc[qi][p] * inv, lane % 8)  # lanes 8k … 8k + 7 hold a block
            value = merged * zdsl.vec(*[zdsl.sigmoid(gate[e]) for e in range(4)])
            with zdsl.if_(mine):
                o.vec4[heads[qi] * (D // 4) + quad] = value
            if Q8:
                store_q8_1(value, heads[qi] * (D // 4) + quad, mine, oq, od)


def attn_prefill_ref(q, qg, k_cache, v_cache, p0):
    """q: (T, n_head, d); qg: (T, n_head, 2d); caches (n_ctx, n_kv, d). Plain softmax attention with a
    causal mask over positions: token i (position p0 + i) sees rows 0 .. p0 + i; query head h reads
    KV head h // (n_head / n_kv); times sigmoid(gate). Returns o (T, n_head, d) f32."""
    T, n_head, d = q.shape
    n = p0 + T
    group = n_head // k_cache.shape[1]
    K = np.repeat(k_cache[:n].astype(np.float64), group, axis=1)  # (n, n_head, d)
    V = np.repeat(v_cache[:n].astype(np.float64), group, axis=1)
    scores = np.einsum("thd,shd->ths", q.astype(np.float64), K) / np.sqrt(d)
    causal = np.arange(n)[None, :] <= p0 + np.arange(T)[:, None]  # (T, n)
    scores = np.where(causal[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    o = np.einsum("ths,shd->thd", p / p.sum(axis=2, keepdims=True), V)
    return (o / (1 + np.exp(-qg[..., d:].astype(np.float64)))).astype(np.float32)


# ---- the same on matrix units ---------------------------------------------------------------------

KV_BLOCK = 64  # the caches hold whole blocks of attn_prefill_coop's rows (its largest BKV)
TAU = 8.0  # a row's running max moves only when a block passes it by this much: p ≤ e⁸ (f16 holds it)


def cache_rows(n_ctx: int) -> int:
    """The rows a KV cache for n_ctx positions holds: whole blocks, which attn_prefill_coop reads."""
    return -(-n_ctx // KV_BLOCK) * KV_BLOCK


def _coop_layout(v):
    """Row strides: of the shared K and V block (f16 × 4 vectors: D values and two of padding, so
    that rows start 16 bytes apart from bank to bank), of a subgroup's S or two O tiles (f32),
    of its P (f16)."""
    return v.D // 4 + 2, max(v.BKV, 32) + 4, v.BKV + 8


def _coop_shared_bytes(v) -> int:
    """The K and V block (before the loop: one subgroup's q), and per subgroup its scores, p and
    its softmax's statistics."""
    SK, SS, SP = _coop_layout(v)
    return 8 * SK * max(2 * v.BKV, 16) + 16 * v.NW * (4 * SS + 2 * SP + 8) + 4 * v.NW


def _coop_fits(v) -> bool:
    """Heads of whole pairs of tiles (the epilogue writes 32 dims, a Q8_1 block, at a time), SG /
    16 lanes a row, the arrays in shared memory, and at least four subgroups: on the H100 (driver
    580) workgroups of one or two gave wrong outputs in an earlier layout (by ~1 with zeroed cache
    rows past the chunk, ~10⁴ with huge ones), four and eight right, and in this layout too
    (test_prefill_coop drawing one or two); the interpreter is right for
    all. Not understood, so not offered (they were slower as well: 6,555–19,230 µs a layer at
    32,768 against 2,861)."""
    return (v.D % 32 == 0 and v.SG in (16, 32, 64) and v.BKV % 16 == 0 and v.NW >= 4
            and _coop_shared_bytes(v) <= mma.SHARED_BYTES)


def _coop_traffic(v, s) -> int:
    """The cache rows once per workgroup (from L2 after the first; half of them on average, the
    rows past a chunk's queries unread), q, the gates and o."""
    rows = s.t * s.n_kv * v.G
    groups = -(-s.t * v.G // (16 * v.NW))
    return _cache_bytes(v, s) * groups // 2 + 12 * rows * v.D + (rows * (v.D + v.D // 4) if v.Q8 else 0)


@zdsl.kernel(workgroup=lambda v: v.NW * v.SG, subgroup="SG",
             variants={"D": [128, 256], "G": [2, 4, 8], "NW": [4, 8], "BKV": [16, 32], "Q8": [False, True],
                       "SG": [32]},
             where=_coop_fits, key=("t",), sizes=("ctx",),
             grid=lambda v, s: (-(-s.t * v.G // (16 * v.NW)), s.n_kv), traffic=_coop_traffic)
def attn_prefill_coop(q: Buffer[f32], qg: Buffer[f32], k_cache: Buffer[f16], v_cache: Buffer[f16],
                      step: Buffer[u32], o: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], n_kv: u32, t: u32,
                      G: Const = 8, D: Const = 256, NW: Const = 4, BKV: Const = 32, Q8: Const = False,
                      KT: Const = "f16", VT: Const = "f16", SG: Const = 32):
    """attn_prefill on matrix units (flash attention): the same outputs, with q, p and the cache
    rows as f16 operands and every sum in f32.

    The query rows of KV head g are the chunk's (token, head) pairs, token-major (row = token · G
    + head); workgroup (b, g) takes 16 · NW of them, 16 a subgroup, whose q it holds as A tiles
    in registers. The workgroup walks the cache rows its queries see in blocks of BKV: the
    block's K and V go into shared memory once (in f16: a quantized cache is decoded on the way,
    kernels/kvcache.py), and every subgroup multiplies its rows by them. Per block:
        S = Q · Kᵀ
        m' = max(m, rowmax S) where it passes m by more than TAU, else m
        P = exp(S − m') masked by position, l = l · e^(m − m') + Σ P
        O = O · e^(m − m') + P · V
    The accumulators stay in the matrix units' registers: a row's scale reaches them only through
    shared memory, so the max moves in steps of TAU (a block rarely passes it once the first
    blocks are in), and a block where some row's does takes O through shared memory to scale it.
    At the end each subgroup's O / l times sigmoid(gate) goes out two tiles (a Q8_1 block) at a
    time.

    Cache rows past the chunk's last position are read (whole blocks) and weighed 0: they must
    hold finite values (the graph zeroes its caches, and the KV buffers hold whole blocks).

    A 512-token chunk of the 35B-A3B (16 heads of 256, 2 KV heads), µs a layer alone at depth
    4,096 / 32,768. On the H100, in the layout before this one (16 query rows a workgroup,
    its four subgroups splitting the cache, every K and V tile read by the units straight from
    the cache, so from L2 once per 16 query rows): 960 / 7,618, about 36 TFLOP/s. On the H200:
    that layout 1,123 / 8,044 (q8_0 6,106 / 12,531: a tile decoded through shared
    memory cost a barrier each); this one, blocks of 32, 397 / 2,947 (q8_0 453 / 4,073), about
    93 TFLOP/s; blocks of 16: 426 / 3,322; eight subgroups (blocks of 16): 552 / 4,016."""
    if not _coop_fits(SimpleNamespace(D=D, SG=SG, BKV=BKV, NW=NW)):
        raise zdsl.ZdslError(f"attn_prefill_coop needs D a multiple of 32, SG of 16, 32 or 64, BKV a multiple of 16, "
                             f"NW ≥ 4 and {mma.SHARED_BYTES:,} bytes of shared memory, not D={D}, SG={SG}, BKV={BKV}, "
                             f"NW={NW}")
    kf, vf = KV_FORMATS[KT], KV_FORMATS[VT]
    for f in (kf, vf):
        f.check(D)
    SK, SS, SP = _coop_layout(SimpleNamespace(D=D, BKV=BKV))
    LR, WG = SG // 16, NW * SG  # the lanes sharing a row's softmax; the workgroup
    kvs = zdsl.shared(f16.vec(4), max(2 * BKV, 16) * SK)  # the block's K rows, then its V rows
    ss = zdsl.shared(f32, NW * 16 * SS)  # per subgroup: S, or two of its O tiles
    ps = zdsl.shared(f16, NW * 16 * SP)
    rs = zdsl.shared(f32, NW * 16)  # per subgroup and row: the block's e^(m − m'), at the end 1 / l
    late = zdsl.shared(u32, NW)  # per subgroup: rows whose max moved with O already begun
    g, sub, lane, tid = zdsl.workgroup_id(1), zdsl.subgroup_id(), zdsl.lane_id(), zdsl.local_index()
    row0, rows = zdsl.workgroup_id(0) * (16 * NW), t * G
    p0 = step[0]

    def qo_row(r):
        """The q / o row of query row r (past the chunk: its last, computed and not written)."""
        r = zdsl.min(r, rows - 1)
        return (r // G) * (n_kv * G) + g * G + r % G

    # q · 1/√D as this subgroup's A tiles, staged through the block's space one subgroup at a time
    sm = 1.0 / math.sqrt(D)
    Q = [zdsl.var(zdsl.mat_load(kvs, 4 * dk, SK, use="a")) for dk in range(D // 16)]  # (whatever is there)
    for w in range(NW):
        zdsl.barrier()  # the last loads are done
        for u in zdsl.range(tid, 4 * D, WG):
            r, quad = u // (D // 4), u % (D // 4)
            kvs[r * SK + quad] = (q.vec4[qo_row(row0 + 16 * w + r) * (D // 4) + quad] * sm).to(f16.vec(4))
        zdsl.barrier()
        with zdsl.if_(sub == w):
            for dk in range(D // 16):
                Q[dk].set(zdsl.mat_load(kvs, 4 * dk, SK, use="a"))
    zdsl.barrier()
    end = p0 + (zdsl.min(row0 + 16 * NW, rows) - 1) // G + 1  # cache rows 0 .. end − 1 serve a query here
    row = lane // LR  # this lane's softmax row, its place in the subgroup's arrays, and its columns
    mine = sub * 16 + row
    cols = [lane % LR + LR * c for c in range(BKV // LR)]
    limit = p0 + zdsl.min(row0 + 16 * sub + row, rows - 1) // G  # the last cache row its token sees
    m, l = zdsl.var(LOWEST), zdsl.var(0.0)
    O = [zdsl.var(zdsl.mat_fill(0.0)) for _ in range(D // 16)]

    def tiles_through_shared(pair, body):
        """O's tiles 2·pair and 2·pair + 1 side by side in the subgroup's rows of ss, then body()."""
        for n in range(2):
            zdsl.mat_store(O[2 * pair + n], ss, sub * 16 * SS + 16 * n, SS)
        zdsl.barrier()
        body()
        zdsl.barrier()

    quads = BKV * (D // 4)  # of K (and of V) in a block
    for kb in zdsl.range(0, end, BKV):
        # the block into shared memory, all loads issued before the first store
        staged = []
        for i in range(-(-quads // WG)):
            u = tid + i * WG
            r, quad = u // (D // 4), u % (D // 4)
            x = (kb + zdsl.min(r, BKV - 1)) * n_kv + g
            staged.append((u, r, quad, kf.load(k_cache, x, quad, D), vf.load(v_cache, x, quad, D)))
        for u, r, quad, kv_k, kv_v in staged:
            with zdsl.if_(u < quads):
                kvs[r * SK + quad] = kv_k.to(f16.vec(4))
                kvs[(BKV + r) * SK + quad] = kv_v.to(f16.vec(4))
        zdsl.barrier()
        S = [zdsl.mat_fill(0.0) for _ in range(BKV // 16)]
        for n in range(BKV // 16):
            for dk in range(D // 16):
                k_tile = zdsl.mat_load(kvs, 16 * n * SK + 4 * dk, SK, use="b", column_major=True)
                S[n] = zdsl.mat_mul_add(Q[dk], k_tile, S[n])
            zdsl.mat_store(S[n], ss, sub * 16 * SS + 16 * n, SS)
        zdsl.barrier()
        seen = [kb + c <= limit for c in cols]
        s = [zdsl.where(ok, ss[mine * SS + c], LOWEST) for ok, c in zip(seen, cols)]
        top = s[0]
        for x in s[1:]:
            top = zdsl.max(top, x)
        if LR > 1:
            top = zdsl.subgroup_max(top, cluster=LR)
        moved = top > m + TAU
        m_new = zdsl.where(moved, top, m)
        alpha = zdsl.exp(m - m_new)
        p = [zdsl.where(ok, zdsl.exp(x - m_new), 0.0) for ok, x in zip(seen, s)]
        total = p[0]
        for x in p[1:]:
            total = total + x
        if LR > 1:
            total = zdsl.subgroup_sum(total, cluster=LR)
        for c, x in zip(cols, p):
            ps[mine * SP + c] = x.to(f16)
        with zdsl.if_(lane % LR == 0):
            rs[mine] = alpha
        begun = zdsl.subgroup_ballot_count(moved & (m > LOWEST))
        with zdsl.if_(lane == 0):
            late[sub] = begun
        l.set(l * alpha + total)
        m.set(m_new)
        zdsl.barrier()
        count = late[0]
        for n in range(1, NW):
            count = count + late[n]
        with zdsl.if_(count > 0):  # uniform: every subgroup reads the same counts
            for pair in range(D // 32):
                def scale():
                    for k in range(128 // SG):  # the subgroup's 16 rows × 8 quads
                        r, quad = k * (SG // 8) + lane // 8, lane % 8
                        at, a = (sub * 16 + r) * SS + 4 * quad, rs[sub * 16 + r]
                        for e in range(4):
                            ss[at + e] = ss[at + e] * a
                tiles_through_shared(pair, scale)
                for n in range(2):
                    O[2 * pair + n].set(zdsl.mat_load(ss, sub * 16 * SS + 16 * n, SS, use="acc"))
        for n in range(BKV // 16):
            p_tile = zdsl.mat_load(ps, sub * 16 * SP + 16 * n, SP, use="a")
            for dt in range(D // 16):
                v_tile = zdsl.mat_load(kvs, (BKV + 16 * n) * SK + 4 * dt, SK, use="b")
                O[dt].set(zdsl.mat_mul_add(p_tile, v_tile, O[dt]))
        zdsl.barrier()  # every subgroup is done with the block before the next one overwrites it
    with zdsl.if_(lane % LR == 0):
        rs[mine] = 1.0 / l
    for pair in range(D // 32):
        def emit():
            """The subgroup's quads of O / l, gated, to o (and Q8_1): 16 rows × 8 quads, a row's
            block of 32 in eight neighbouring lanes."""
            for k in range(128 // SG):
                r, quad = k * (SG // 8) + lane // 8, lane % 8
                at = (sub * 16 + r) * SS + 4 * quad
                value = zdsl.vec(*[ss[at + e] for e in range(4)]) * rs[sub * 16 + r]
                R = row0 + 16 * sub + r
                at_o = qo_row(R) * (D // 4) + 8 * pair + quad
                gate = qg.vec4[qo_row(R) * (D // 2) + D // 4 + 8 * pair + quad]
                value = vf.turn(value, quad)
                value = value * zdsl.vec(*[zdsl.sigmoid(gate[e]) for e in range(4)])
                with zdsl.if_(R < rows):
                    o.vec4[at_o] = value
                if Q8:
                    store_q8_1(value, at_o, R < rows, oq, od)
        tiles_through_shared(pair, emit)


# ---- examples ------------------------------------------------------------------------------------

def _kv_types(use) -> KVTypes:
    return KVTypes(use.variant.params["KT"], use.variant.params["VT"])


def _written(kc, vc, kt: str, vt: str) -> dict:
    """The expected caches (uint8 rows) where they are f16: a quantized row's codes may differ
    from numpy's by a step where a value sits on a rounding boundary (the kernel tests check
    those rows decoded, test_kernels_attention)."""
    out = {}
    if kt == "f16":
        out["k_cache"] = (kc.view(np.float16).astype(np.float32), 2e-3)
    if vt == "f16":
        out["v_cache"] = (vc.view(np.float16).astype(np.float32), 1e-3)
    return out


def _bytes(cache, rows: int, n_kv: int) -> np.ndarray:
    """A cache as the references take it: (rows, n_kv, row bytes) uint8."""
    return cache.view(np.uint8).reshape(rows, n_kv, -1)


def _values(cache, kv_type: str, rows: int, n_kv: int, d: int, turned_back: bool = False) -> np.ndarray:
    """A cache's values (rows, n_kv, d), decoded: as the kernels read them, or `turned_back`
    where the format rotates them (the V that o is made of)."""
    f = KV_FORMATS[kv_type]
    return (f.values if turned_back else f.decode)(cache, d).reshape(rows, n_kv, d)


@attn_prep.example
def attn_prep_example(use, rng, check):
    s = use.sizes
    nh, nkv, d = s["n_head"], s["n_kv"], s["d"]
    kt, vt = _kv_types(use)
    ctx = use.buffers["k_cache"] // (nkv * KV_FORMATS[kt].row_bytes(d))
    ctx = min(ctx, inputs.CHECK_CTX) if check else ctx
    pos = ctx - 1
    args = dict(qg=inputs.normal(rng, nh * 2 * d), k=inputs.normal(rng, nkv * d), v=inputs.normal(rng, nkv * d),
                q_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), k_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
                step=inputs.step_words(pos, pos + 1), q=np.zeros(nh * d, np.float32),
                k_cache=inputs.kv_cache(rng, ctx, nkv, d, kt), v_cache=inputs.kv_cache(rng, ctx, nkv, d, vt),
                **{n: s[n] for n in ("n_head", "n_kv", "d", "rope_dims", "rope_base", "eps")})

    def expect(p):
        a = args
        q, kc, vc = attn_prep_ref(a["qg"].reshape(nh, 2 * d), a["k"].reshape(nkv, d), a["v"].reshape(nkv, d),
                                  a["q_norm"], a["k_norm"], _bytes(a["k_cache"], ctx, nkv), _bytes(a["v_cache"], ctx, nkv),
                                  pos, s["rope_dims"], s["rope_base"], s["eps"], kt, vt)
        return {"q": (q, 1e-4), **_written(kc, vc, kt, vt)}
    return zdsl.Example(args, expect)


@attn_decode.example
def attn_decode_example(use, rng, check):
    D, G = use.fixed["D"], use.fixed["G"]
    kt, vt = _kv_types(use)
    nkv, min_chunk = use.sizes["n_kv"], use.sizes["min_chunk"]
    nh = nkv * G
    ctx, nsplit = ((inputs.CHECK_CTX, -(-inputs.CHECK_CTX // min_chunk)) if check
                   else (use.sizes["ctx"], use.sizes["nsplit"]))
    args = dict(q=inputs.normal(rng, nh * D), k_cache=inputs.kv_cache(rng, ctx, nkv, D, kt),
                v_cache=inputs.kv_cache(rng, ctx, nkv, D, vt), step=inputs.step_words(ctx - 1, ctx),
                part=np.zeros(nh * nsplit * (D + 2), np.float32), n_kv=nkv, min_chunk=min_chunk, nsplit=nsplit, ctx=ctx)

    def expect(p):
        want = attn_decode_ref(args["q"].reshape(nh, D), _values(args["k_cache"], kt, ctx, nkv, D),
                               _values(args["v_cache"], vt, ctx, nkv, D), ctx, nsplit, min_chunk)
        return {"part": (want, 1e-4)}  # NaN where a split is not in use
    return zdsl.Example(args, expect, lambda n: {"k_cache": inputs.copies(args["k_cache"], n),
                                                 "v_cache": inputs.copies(args["v_cache"], n)})


@attn_combine.example
def attn_combine_example(use, rng, check):
    D, q8, nh, min_chunk = use.fixed["D"], use.fixed["Q8"], use.sizes["n_head"], use.sizes["min_chunk"]
    ctx, nsplit = ((inputs.CHECK_CTX, -(-inputs.CHECK_CTX // min_chunk)) if check
                   else (use.sizes["ctx"], use.sizes["nsplit"]))
    part = np.empty((nh, nsplit, D + 2), np.float32)
    part[:, :, 0] = rng.standard_normal((nh, nsplit)) * 3
    part[:, :, 1] = rng.uniform(1, 20, (nh, nsplit))
    part[:, :, 2:] = rng.standard_normal((nh, nsplit, D))
    args = dict(part=part.reshape(-1), qg=inputs.normal(rng, nh * 2 * D), step=inputs.step_words(ctx - 1, ctx),
                o=np.zeros(nh * D, np.float32), nsplit=nsplit, min_chunk=min_chunk, n_head=nh, ctx=ctx)
    if q8:
        args.update(oq=np.zeros(nh * D // 4, np.uint32), od=np.zeros(nh * D // 16, np.float32))

    def expect(p):
        o = attn_combine_ref(part, args["qg"].reshape(nh, 2 * D), ctx, nsplit, min_chunk, use.variant.params["VT"])
        return {"o": (o, 1e-4), **({"od": (inputs.q8_1_scales(o), 1e-4)} if q8 else {})}
    return zdsl.Example(args, expect)


@attn_prep_rows.example
def attn_prep_rows_example(use, rng, check):
    s = use.sizes
    nh, nkv, d, T = s["n_head"], s["n_kv"], s["d"], s["t"]
    kt, vt = _kv_types(use)
    ctx = use.buffers["k_cache"] // (nkv * KV_FORMATS[kt].row_bytes(d))
    ctx = max(min(ctx, inputs.CHECK_CTX), T) if check else ctx
    p0 = ctx - T
    args = dict(qg=inputs.normal(rng, T * nh * 2 * d), k=inputs.normal(rng, T * nkv * d),
                v=inputs.normal(rng, T * nkv * d), q_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
                k_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), step=inputs.step_words(p0, ctx),
                q=np.zeros(T * nh * d, np.float32), k_cache=inputs.kv_cache(rng, ctx, nkv, d, kt),
                v_cache=inputs.kv_cache(rng, ctx, nkv, d, vt), t=T,
                **{n: s[n] for n in ("n_head", "n_kv", "d", "rope_dims", "rope_base", "eps")})

    def expect(p):
        a = args
        q, kc, vc = attn_prep_rows_ref(a["qg"].reshape(T, nh, 2 * d), a["k"].reshape(T, nkv, d),
                                       a["v"].reshape(T, nkv, d), a["q_norm"], a["k_norm"],
                                       _bytes(a["k_cache"], ctx, nkv), _bytes(a["v_cache"], ctx, nkv), p0,
                                       s["rope_dims"], s["rope_base"], s["eps"], kt, vt)
        return {"q": (q, 1e-4), **_written(kc, vc, kt, vt)}
    return zdsl.Example(args, expect)


def _prefill_example(use, rng, check, tol, kt="f16", vt="f16"):
    D, G, q8 = use.fixed["D"], use.fixed["G"], use.fixed["Q8"]
    nkv, T = use.sizes["n_kv"], use.sizes["t"]
    nh = nkv * G
    ctx = max(inputs.CHECK_CTX, T) if check else use.sizes["ctx"]
    rows = cache_rows(ctx)
    p0 = ctx - T  # the last chunk of a full context: the most rows
    args = dict(q=inputs.normal(rng, T * nh * D), qg=inputs.normal(rng, T * nh * 2 * D),
                k_cache=inputs.kv_cache(rng, rows, nkv, D, kt), v_cache=inputs.kv_cache(rng, rows, nkv, D, vt),
                step=inputs.step_words(p0, ctx), o=np.zeros(T * nh * D, np.float32), n_kv=nkv, t=T, ctx=rows)
    if q8:
        args.update(oq=np.zeros(T * nh * D // 4, np.uint32), od=np.zeros(T * nh * D // 16, np.float32))

    def expect(p):
        o = attn_prefill_ref(args["q"].reshape(T, nh, D), args["qg"].reshape(T, nh, 2 * D),
                             _values(args["k_cache"], kt, rows, nkv, D),
                             _values(args["v_cache"], vt, rows, nkv, D, turned_back=True), p0)
        return {"o": (o, tol), **({"od": (inputs.q8_1_scales(o), tol)} if q8 else {})}
    return zdsl.Example(args, expect, lambda n: {"k_cache": inputs.copies(args["k_cache"], n),
                                                 "v_cache": inputs.copies(args["v_cache"], n)})


@attn_prefill.example
def attn_prefill_example(use, rng, check):
    return _prefill_example(use, rng, check, 1e-4, *_kv_types(use))


@attn_prefill_coop.example
def attn_prefill_coop_example(use, rng, check):
    return _prefill_example(use, rng, check, 1e-2, *_kv_types(use))  # q, p and the cache rounded to f16
