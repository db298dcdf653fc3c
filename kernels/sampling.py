"""Token sampling on the GPU, in two dispatches that need no host round trip.

`penalty_window` (one invocation, at the start of a step, or once for a prompt chunk) counts the
input tokens into the penalties' window of the last N context tokens and uncounts those that
leave it, so the window holds prompt and generated tokens alike (as llama.cpp's penalties do) at
a cost that does not grow with the context. `sample_candidates` (many workgroups) adds a request's
logit bias, drops the tokens a bitmask does not allow (a grammar's: constrained decoding, the mask
made on the host for each step, a word per 32 tokens), penalises the logits of tokens in the
window and keeps each workgroup's CAP best (logit, id) pairs; `sample_draw` (one
workgroup) merges them into the CAP best of the whole vocabulary and applies, in this order:
top-k, min-p (relative to the most likely token, before temperature), temperature, top-p, then a
draw with a counter-based random number. It writes the token where the next decode step reads it
(`step[2]`), so a recorded command buffer can replay the whole decode loop. The settings
(penalties, top-k, min-p, temperature, top-p, seed) come from a small buffer, `SETTINGS` words,
not from the recording: a request with its own seed or temperature writes 32 bytes instead of
recording a step again.

Order of candidates everywhere: larger logit first, equal logits by lower token id; NaN logits
count as -inf. A free slot holds the sentinel (-inf, 0xFFFFFFFF). `block_topk` selects for the
sampler (up to 256 candidates); `few_topk`, the same selection for a few (the MoE router's 8 of
256 experts), trades its searches for short passes, since the router waits on it every layer.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.kernels.reduce import SHARED_LIMIT, SUBGROUPS
from zdsl.kernels.steps import STEP_WORDS

CAPS = [1, 64, 256]  # candidates kept; 1 is the greedy variant
SENTINEL = 0xFFFFFFFF  # id of an empty candidate slot
NEG_INF_BITS = 0xFF800000
# The settings buffer: a u32 word each, floats as their bits.
SETTINGS = ("repeat_penalty", "presence_penalty", "frequency_penalty", "top_k", "min_p", "inv_temp", "top_p", "seed")
_WHOLE = {"top_k", "seed"}


def settings_words(**values) -> np.ndarray:
    """The settings buffer holding `values` (one for each name in SETTINGS)."""
    return np.array([np.uint32(values[n]) if n in _WHOLE else np.float32(values[n]).view(np.uint32)
                     for n in SETTINGS], np.uint32)


def settings_of(words) -> dict:
    """The values a settings buffer holds (settings_words undone)."""
    words = np.asarray(words, np.uint32)
    return {n: int(w) if n in _WHOLE else float(w.view(np.float32)) for n, w in zip(SETTINGS, words)}


def setting(settings, name: str):
    """In a kernel: the value of setting `name` from the settings buffer."""
    word = settings[SETTINGS.index(name)]
    return word if name in _WHOLE else zdsl.bitcast(word, f32)

# ---- one-workgroup top-C selection ---------------------------------------------------------------


def _precedes(va, ia, vb, ib):
    """(va, ia) comes before (vb, ib): a larger value, or an equal value and a lower id."""
    return (va > vb) | ((va == vb) & (ia < ib))


def _subgroup_topk(items, L, val_sh, id_sh, base):
    """This subgroup's L first items (in candidate order) to val_sh/id_sh[base : base + L]: L rounds
    of a subgroup argmax, each over the items after the previous pick (no barriers needed)."""
    prev_v, prev_i = zdsl.var(np.inf), zdsl.var(0, u32)
    for j in zdsl.range(L):
        best_v, best_i = zdsl.var(-np.inf), zdsl.var(SENTINEL, u32)
        for v, i in items:
            after = (j == 0) | _precedes(prev_v, prev_i, v, i)
            take = after & _precedes(v, i, best_v, best_i)
            best_v.set(zdsl.where(take, v, best_v))
            best_i.set(zdsl.where(take, i, best_i))
        top_v = zdsl.subgroup_max(best_v)
        top_i = zdsl.subgroup_min(zdsl.where(best_v == top_v, best_i, SENTINEL))
        prev_v.set(top_v)
        prev_i.set(top_i)
        with zdsl.if_(zdsl.lane_id() == 0):
            val_sh[base + j] = top_v
            id_sh[base + j] = top_i


def _count_before(val_sh, id_sh, first, n: int, v, i):
    """How many of the n ordered entries at `first` come before (v, i): a binary search unrolled
    at build time."""
    pos = zdsl.var(0, u32)
    step = 1 << (n.bit_length() - 1)
    while step:
        probe = pos + (step - 1)
        j = first + zdsl.min(probe, n - 1)
        ahead = (probe < n) & _precedes(val_sh[j], id_sh[j], v, i)
        pos.set(zdsl.where(ahead, pos + step, pos))
        step //= 2
    return pos


def _fill(val_sh, id_sh, first, C: int, WG: int):
    for j in zdsl.range(zdsl.local_index(), C, WG):
        val_sh[first + j] = -np.inf
        id_sh[first + j] = SENTINEL


def block_topk(load, n, C: int, R: int, WG: int, SG: int):
    """The C first of n items in candidate order, by one workgroup; `load(index, valid)` gives the
    (value, id) of item `index` (ids distinct, below SENTINEL). Rounds of WG·R items: each
    subgroup orders its own SG·R items, then every item of the subgroup lists and of the running
    list finds its rank among them all by binary searches; ranks below C form the new running
    list. Returns (values, ids, first): the shared arrays and where the C ordered items start."""
    S, L = WG // SG, min(C, SG * R)
    lists = S * L
    val_sh, id_sh = zdsl.shared(f32, lists + 2 * C), zdsl.shared(u32, lists + 2 * C)
    _fill(val_sh, id_sh, lists, C, WG)
    cur = zdsl.var(0, u32)
    for start in zdsl.range(0, n, WG * R):
        items = []
        for r in range(R):
            index = start + r * WG + zdsl.local_index()
            valid = index < n
            v, i = load(index, valid)
            items.append((zdsl.where(valid, v, -np.inf), zdsl.where(valid, i, SENTINEL)))
        _subgroup_topk(items, L, val_sh, id_sh, zdsl.subgroup_id() * L)
        src, dst = lists + cur * C, lists + (cur ^ 1) * C
        _fill(val_sh, id_sh, dst, C, WG)
        zdsl.barrier()
        for e in zdsl.range(zdsl.local_index(), lists + C, WG):
            at = zdsl.where(e < lists, e, src + e - lists)
            v, i = val_sh[at], id_sh[at]
            rank = _count_before(val_sh, id_sh, src, C, v, i)
            for s in zdsl.range(S):
                rank += _count_before(val_sh, id_sh, s * L, L, v, i)
            with zdsl.if_((rank < C) & (i != SENTINEL)):
                val_sh[dst + rank] = v
                id_sh[dst + rank] = i
        zdsl.barrier()
        cur.set(cur ^ 1)
    return val_sh, id_sh, lists + cur * C


def few_topk(load, n, C: int, WG: int, SG: int, UNROLL: int = 4):
    """block_topk for a few C (MoE routing: 8 of 256), where the one workgroup's latency is the
    cost: rounds of WG items, one per invocation. Each item's rank in its subgroup comes from one
    pass over the subgroup's lanes (shuffles); the first min(C, SG) of every subgroup and the
    running list are then ranked among each other, each candidate by a cluster of P lanes that
    split the pass over them in shared memory, and ranks below C form the new running list.
    The passes run over the items there are (a round's last subgroups may hold none), UNROLL
    steps at a time: their lengths are not build-time constants, so the driver keeps them as
    short loops, not straight-line code fetched from memory at every use. Same arguments and
    result as block_topk (without R)."""
    S, L = WG // SG, min(C, SG)
    lists = S * L
    P = min(SG, 1 << max(0, (WG // (lists + C)).bit_length() - 1))  # lanes per candidate: a power of two
    val_sh, id_sh = zdsl.shared(f32, lists + 2 * C), zdsl.shared(u32, lists + 2 * C)
    _fill(val_sh, id_sh, lists, C, WG)
    cur = zdsl.var(0, u32)
    lane = zdsl.lane_id()
    for start in zdsl.range(0, n, WG):
        items = zdsl.min(n - start, WG)
        index = start + zdsl.local_index()
        v, i = load(index, index < n)
        # The valid lanes of a subgroup come first: each ranks among them; an empty lane after
        # them takes its lane number, so that every slot of the subgroup's list is written.
        valid_lanes = zdsl.min(items - zdsl.min(items, zdsl.subgroup_id() * SG), SG)
        rank = zdsl.var(0, u32)
        for first in zdsl.range(0, valid_lanes, UNROLL):
            for u in range(UNROLL):
                s = zdsl.min(first + u, SG - 1)
                ahead = _precedes(zdsl.subgroup_shuffle(v, s), zdsl.subgroup_shuffle(i, s), v, i)
                rank += zdsl.where(ahead & (first + u < valid_lanes), 1, 0, u32)
        valid = lane < valid_lanes
        rank = zdsl.where(valid, rank, lane)
        with zdsl.if_(rank < L):
            val_sh[zdsl.subgroup_id() * L + rank] = zdsl.where(valid, v, -np.inf)
            id_sh[zdsl.subgroup_id() * L + rank] = zdsl.where(valid, i, SENTINEL)
        used = (items + (SG - 1)) // SG * L  # the lists written this round
        m = used + C                         # ... and the running list: the candidates
        src, dst = lists + cur * C, lists + (cur ^ 1) * C
        _fill(val_sh, id_sh, dst, C, WG)
        zdsl.barrier()

        def at(j):  # candidate j's slot
            return zdsl.where(j < used, j, src + j - used)

        part = zdsl.local_index() % P
        for e in zdsl.range(zdsl.local_index() // P, (m + (WG // P - 1)) // (WG // P) * (WG // P), WG // P):
            c = at(zdsl.min(e, m - 1))
            v, i = val_sh[c], id_sh[c]
            count = zdsl.var(0, u32)
            for first in zdsl.range(part, m, P * UNROLL):
                for u in range(UNROLL):
                    j = first + u * P
                    o = at(zdsl.min(j, m - 1))
                    count += zdsl.where((j < m) & _precedes(val_sh[o], id_sh[o], v, i), 1, 0, u32)
            rank = zdsl.subgroup_sum(count, cluster=P) if P > 1 else count
            with zdsl.if_((part == 0) & (e < m) & (rank < C) & (i != SENTINEL)):
                val_sh[dst + rank] = v
                id_sh[dst + rank] = i
        zdsl.barrier()
        cur.set(cur ^ 1)
    return val_sh, id_sh, lists + cur * C


def topk_shared_bytes(C: int, R: int, WG: int, SG: int) -> int:
    return 8 * ((WG // SG) * min(C, SG * R) + 2 * C)


def topk_ref(values, ids, C: int):
    """numpy: the C first (value, id) pairs in candidate order, padded with sentinels."""
    values = np.where(np.isnan(values), np.float32(-np.inf), values).astype(np.float32)
    ids = np.asarray(ids, np.uint32)
    real = ids != SENTINEL
    values, ids = values[real], ids[real]
    order = np.lexsort((ids, -values.astype(np.float64)))[:C]
    out_v = np.full(C, -np.inf, np.float32)
    out_i = np.full(C, SENTINEL, np.uint32)
    out_v[:len(order)], out_i[:len(order)] = values[order], ids[order]
    return out_v, out_i


# ---- the random number: a hash of (seed, counter), the same code on the GPU and in numpy ---------

def mix32(x):
    """A 32-bit integer mixer (xor-shift-multiply); works on traced u32 values and numpy uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def uniform_bits(seed, counter):
    """24 random bits for draw `counter` of stream `seed`; the uniform number is bits · 2⁻²⁴."""
    return mix32(mix32(counter ^ 0x9E3779B9) ^ seed) >> 8


def uniform_ref(seed: int, counter: int) -> np.float32:
    with np.errstate(over="ignore"):
        bits = uniform_bits(np.uint32(seed), np.uint32(counter))
    return np.float32(bits) * np.float32(2.0 ** -24)


# ---- the kernels ---------------------------------------------------------------------------------

def _fits(v, extra=0) -> bool:
    return topk_shared_bytes(v.CAP, v.R, v.WG, v.SG) + extra <= SHARED_LIMIT


VARIANTS = {"CAP": CAPS, "WG": [64, 256], "R": [4, 16], "SG": SUBGROUPS}


def mask_words(n_vocab: int) -> int:
    """The words of a bitmask of allowed tokens: one bit each."""
    return -(-n_vocab // 32)


def mask_of(allowed) -> np.ndarray:
    """The bitmask words (bit i % 32 of word i // 32) of a boolean per token."""
    bits = np.asarray(allowed, bool)
    return np.packbits(np.pad(bits, (0, 32 * mask_words(len(bits)) - len(bits))), bitorder="little").view(np.uint32)


def all_allowed(n_vocab: int) -> np.ndarray:
    return mask_of(np.ones(n_vocab, bool))


def candidate_groups(v, n_vocab: int) -> int:
    """The first pass's workgroups, each writing CAP candidates: ceil(n_vocab / (WG·R))."""
    return -(-n_vocab // (v.WG * v.R))


@zdsl.kernel(workgroup=1)
def penalty_window(step: Buffer[u32], ring: Buffer[u32], counts: Buffer[u32], window: u32, n_vocab: u32, t: u32):
    """The window of the last `window` context tokens (the prompt's included, as llama.cpp counts
    them) moves on by t tokens, in order: the input token step[2] at position step[0] of each of t
    step records (STEP_WORDS apart: one at decode, a prompt chunk's at prefill): counts[token] += 1,
    and the token at position − window (kept in ring[position % window]) is uncounted."""
    for i in zdsl.range(0, t):
        pos, token = step[i * STEP_WORDS], step[i * STEP_WORDS + 2]
        slot = pos % window
        with zdsl.if_(pos >= window):
            old = ring[slot]
            with zdsl.if_(old < n_vocab):
                counts[old] = counts[old] - 1
        ring[slot] = token
        with zdsl.if_(token < n_vocab):
            counts[token] = counts[token] + 1


@zdsl.kernel(workgroup="WG", subgroup="SG", variants=VARIANTS, where=_fits, key=("n_vocab",),
             grid=lambda v, s: candidate_groups(v, s.n_vocab),
             traffic=lambda v, s: 12 * s.n_vocab + 4 * mask_words(s.n_vocab)
             + 8 * v.CAP * candidate_groups(v, s.n_vocab))
def sample_candidates(logits: Buffer[f32], bias: Buffer[f32], counts: Buffer[u32], allowed: Buffer[u32],
                      cand: Buffer[u32], settings: Buffer[u32], n_vocab: u32, row: u32 = 0, CAP: Const = 64,
                      WG: Const = 256, R: Const = 16, SG: Const = 32):
    """Workgroup g keeps the CAP first penalised (logit, id) pairs of tokens [g·WG·R, (g+1)·WG·R)
    as cand[2(g·CAP + j)] = the logit's f32 bits, cand[2(g·CAP + j) + 1] = the id, j = 0..CAP-1 in
    order. Each logit has bias[id] added; a token whose bit (id % 32 of allowed[id / 32]) is clear
    has the logit -inf. A token in
    the window (c = counts[id] > 0) has its logit divided by repeat_penalty when positive,
    multiplied by it otherwise, then lowered by presence_penalty + c·frequency_penalty (the
    settings buffer's). The logits are row `row` of a batch's (batch.py)."""
    repeat_penalty, presence_penalty, frequency_penalty = (
        setting(settings, n) for n in ("repeat_penalty", "presence_penalty", "frequency_penalty"))
    logits = logits.at(row * n_vocab)
    base = zdsl.workgroup_id() * (WG * R)

    def load(index, valid):
        t = base + index
        logit = logits.load(t, mask=valid, other=0.0) + bias.load(t, mask=valid, other=0.0)
        bit = (allowed.load(t // 32, mask=valid, other=0) >> (t % 32)) & 1
        logit = zdsl.where(zdsl.isnan(logit) | (bit == 0), -np.inf, logit)
        count = counts.load(t, mask=valid, other=0)
        penalised = (zdsl.where(logit > 0, logit / repeat_penalty, logit * repeat_penalty) - presence_penalty
                     - count.to(f32) * frequency_penalty)
        return zdsl.where(count > 0, penalised, logit), t

    val_sh, id_sh, first = block_topk(load, zdsl.min(n_vocab - base, WG * R), CAP, R, WG, SG)
    out = zdsl.workgroup_id() * CAP
    for j in zdsl.range(zdsl.local_index(), CAP, WG):
        cand[2 * (out + j)] = zdsl.bitcast(val_sh[first + j], u32)
        cand[2 * (out + j) + 1] = id_sh[first + j]


def sample_candidates_ref(logits, counts, repeat_penalty, presence_penalty, frequency_penalty=0.0, CAP=64, WG=256,
                          R=16, allowed=None, bias=None):
    pen = penalise_ref(logits, counts, repeat_penalty, presence_penalty, frequency_penalty, allowed, bias)
    chunk = WG * R
    out = []
    for g in range(-(-len(pen) // chunk)):
        v, i = topk_ref(pen[g * chunk:(g + 1) * chunk], np.arange(g * chunk, min(len(pen), (g + 1) * chunk)), CAP)
        out.append(np.stack([v.view(np.uint32), i], axis=1))
    return np.concatenate(out).reshape(-1)


def penalise_ref(logits, counts, repeat_penalty, presence_penalty, frequency_penalty=0.0, allowed=None, bias=None):
    """The penalised logits, `bias` (one each; None: none) added first; tokens not `allowed` (a
    boolean each; None: all are) at -inf."""
    logits = np.asarray(logits, np.float32)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float32)
    dropped = np.isnan(logits) if allowed is None else np.isnan(logits) | ~np.asarray(allowed, bool)
    logits = np.where(dropped, np.float32(-np.inf), logits)
    counts = np.asarray(counts)
    rp, pp, fp = np.float32(repeat_penalty), np.float32(presence_penalty), np.float32(frequency_penalty)
    with np.errstate(invalid="ignore"):
        penalised = np.where(logits > 0, logits / rp, logits * rp) - pp - counts.astype(np.float32) * fp
    return np.where(counts > 0, penalised, logits).astype(np.float32)


@zdsl.kernel(workgroup="WG", subgroup="SG", variants=VARIANTS, where=lambda v: _fits(v, 4 * v.CAP), key=("n_vocab",),
             traffic=lambda v, s: 8 * v.CAP * candidate_groups(v, s.n_vocab))
def sample_draw(cand: Buffer[u32], step: Buffer[u32], tokens: Buffer[u32], settings: Buffer[u32], n_vocab: u32,
                max_tokens: u32, CAP: Const = 64, WG: Const = 256, R: Const = 16, SG: Const = 32):
    """Draw one token from the candidates of sample_candidates (same CAP, WG, R). Over the CAP first
    candidates z_0 ≥ z_1 ≥ …: keep the top_k first (0: all CAP); keep those with
    exp(z_j − z_0) ≥ min_p; weigh them q_j = exp((z_j − z_0)·inv_temp); keep the shortest prefix
    whose weight reaches top_p of the total; pick the first j whose running sum exceeds u times the
    kept total, u = uniform_bits(seed, step[3])·2⁻²⁴ (sums run in order, j = 0 when none does).
    Writes step[2] = token, tokens[step[0]] = token when step[0] < max_tokens, step[3] += 1.
    top_k … seed: the settings buffer's."""
    top_k, min_p, inv_temp, top_p, seed = (setting(settings, n)
                                           for n in ("top_k", "min_p", "inv_temp", "top_p", "seed"))
    groups = (n_vocab + (WG * R - 1)) // (WG * R)

    def load(index, valid):
        value = zdsl.bitcast(cand.load(2 * index, mask=valid, other=NEG_INF_BITS), f32)
        return value, cand.load(2 * index + 1, mask=valid, other=SENTINEL)

    val_sh, id_sh, first = block_topk(load, groups * CAP, CAP, R, WG, SG)
    n_k = zdsl.where(top_k == 0, CAP, zdsl.min(top_k, CAP))
    z0 = val_sh[first]
    weight = zdsl.shared(f32, CAP)
    for j in zdsl.range(zdsl.local_index(), n_k, WG):
        d = val_sh[first + j] - z0
        keep = (zdsl.exp(d) >= min_p) & (id_sh[first + j] != SENTINEL)
        weight[j] = zdsl.where(keep, zdsl.exp(d * inv_temp), 0.0)
    zdsl.barrier()
    with zdsl.if_(zdsl.local_index() == 0):
        total = zdsl.var(0.0)
        for j in zdsl.range(n_k):
            total += weight[j]
        limit = top_p * total
        kept, n_p = zdsl.var(0.0), zdsl.var(0, u32)
        for j in zdsl.range(n_k):
            inside = (j == 0) | (kept < limit)
            kept.set(zdsl.where(inside, kept + weight[j], kept))
            n_p.set(zdsl.where(inside, j + 1, n_p))
        counter = step[3]
        target = uniform_bits(seed, counter).to(f32) * (2.0 ** -24) * kept
        running, below = zdsl.var(0.0), zdsl.var(0, u32)
        for j in zdsl.range(n_p):
            running += weight[j]
            below.set(zdsl.where(running <= target, below + 1, below))
        token = id_sh[first + zdsl.where(below < n_p, below, 0)]
        step[2] = token
        step[3] = counter + 1
        pos = step[0]
        with zdsl.if_(pos < max_tokens):
            tokens[pos] = token


def choose_ref(values, ids, top_k, min_p, inv_temp, top_p, u):
    """numpy, operation for operation as sample_draw: the token among ordered candidates."""
    C = len(values)
    n_k = C if top_k == 0 else min(top_k, C)
    with np.errstate(invalid="ignore", over="ignore"):
        d = values[:n_k] - values[0]
        keep = (np.exp(d) >= np.float32(min_p)) & (ids[:n_k] != SENTINEL)
        q = np.where(keep, np.exp(d * np.float32(inv_temp)), np.float32(0)).astype(np.float32)
    running = np.cumsum(q, dtype=np.float32)  # sequential float32 sums, as the kernel's loop
    limit = np.float32(top_p) * running[-1]
    n_p = 1 + int(np.count_nonzero(running[:-1] < limit))  # running[j-1] < limit keeps item j
    target = np.float32(u) * running[n_p - 1]
    below = int(np.count_nonzero(running[:n_p] <= target))
    return int(ids[below if below < n_p else 0])


def sample_ref(logits, counts, *, cap, top_k, min_p, inv_temp, top_p, seed, counter, repeat_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, allowed=None, bias=None):
    """numpy: the token the two kernels sample (for any WG, R: the candidates do not depend on them)."""
    pen = penalise_ref(logits, counts, repeat_penalty, presence_penalty, frequency_penalty, allowed, bias)
    values, ids = topk_ref(pen, np.arange(len(pen)), cap)
    return choose_ref(values, ids, top_k, min_p, inv_temp, top_p, uniform_ref(seed, counter))


@sample_candidates.example
def sampling_example(use, rng, check):
    """The candidate pass and the draw, tuned together: the draw runs with the pass's CAP, WG and
    R (the candidates it reads are the pass's), and its subgroup size is chosen with them."""
    from zdsl.kernels import inputs

    V = min(use.sizes["n_vocab"], inputs.CHECK_VOCAB) if check else use.sizes["n_vocab"]
    cap = use.fixed["CAP"]
    values = {k: VARIANTS[k] + sample_candidates.tune.get(k, []) for k in ("WG", "R")}
    groups = -(-V // (min(values["WG"]) * min(values["R"])))  # the most candidate groups any variant writes
    allowed = rng.random(V) < 0.9
    bias = np.where(rng.random(V) < 0.01, rng.uniform(-5, 5, V), 0).astype(np.float32)
    args = dict(logits=inputs.normal(rng, V, 3.0), bias=bias, counts=(rng.random(V) < 0.1).astype(np.uint32),
                allowed=mask_of(allowed), cand=np.zeros(2 * cap * groups, np.uint32), step=inputs.step_words(3, 4, counter=5),
                tokens=np.zeros(1, np.uint32), n_vocab=V, max_tokens=0)
    s = dict(repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.05, top_k=min(40, cap), min_p=0.05,
             inv_temp=1.25, top_p=0.95, seed=7)
    args["settings"] = settings_words(**s)
    counts0 = args["counts"].copy()

    def expect(p):
        a = {**args, **s}
        cand = sample_candidates_ref(a["logits"], counts0, a["repeat_penalty"], a["presence_penalty"],
                                     a["frequency_penalty"], CAP=cap, WG=p["WG"], R=p["R"], allowed=allowed, bias=bias)
        cand_buf = np.full(a["cand"].size, np.nan)
        cand_buf[:cand.size] = cand
        step = inputs.step_words(3, 4, counter=6)
        step[2] = sample_ref(a["logits"], counts0, cap=cap, top_k=a["top_k"], min_p=a["min_p"], inv_temp=a["inv_temp"],
                             top_p=a["top_p"], seed=a["seed"], counter=5, repeat_penalty=a["repeat_penalty"],
                             presence_penalty=a["presence_penalty"], frequency_penalty=a["frequency_penalty"],
                             allowed=allowed, bias=bias)
        return {"cand": (cand_buf, 0), "step": (step, 0)}
    draw = (sample_draw, lambda p: {k: p[k] for k in ("CAP", "WG", "R")}, lambda p: {"SG": p["SG"]})
    return zdsl.Example(args, expect, then=[draw])
