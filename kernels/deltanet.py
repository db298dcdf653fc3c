"""Gated delta-net layers at decode time (one new token) and for a prompt's chunk of tokens, after
the model doc's DELTANET section.

One dispatch per layer, between the input projections and the output projection: `deltanet_step`,
per value head, its two gate projections (β and α: one row each of the normed input, too small to
be worth a dispatch of their own), the causal depthwise conv (+ silu) of the q, k and v channels it
reads, L2-normalised q and k, the gated delta rule on the f32 state, the read-out o and the gated
RMSNorm of o, fused: the state (64 KiB per head at d = 128) is read once and written once, and
neither the conv output nor o leaves the workgroup. A step of a few tokens of one sequence (a
speculative step) runs them in the same dispatch (its `rows`) in blocks of TOKENS: a block's gates
and conv for all its tokens at once, then the delta rule token after token, the state carried in
registers from one to the next and written after each. A prompt's chunk runs the conv rows, then the
delta rule in blocks of BLOCK tokens (the WY form: `deltanet_chunk_wy` for every block at once,
`deltanet_chunk_scan` carrying the state over them), then the gated norm rows.

Layouts (all f32):

- conv weight `ssm_conv1d.weight` as stored ({4, C} in GGUF order): [channel][tap], tap KC − 1 the
  current token.
- conv state: a ring of conv_slots ≥ KC slots of C channels, [slot][channel] (conv_slots a launch
  parameter): the input (`mix`) of position p is stored in slot p % conv_slots, so the taps of
  position p read slots (p − KC + 1) % conv_slots … (p − 1) % conv_slots and nobody reads the slot
  being written. Workgroups that share a key head read the same q and k channels, so an in-place
  shift would race; the ring never moves a value. It is zeroed with the sequence (inputs before
  position 0 are zeros), and the position advances by one per step. The ring keeps the inputs
  of the last conv_slots positions, so with conv_slots = KC − 1 + Tmax a sequence cut back to
  any of the last Tmax positions (speculative decoding: drafted tokens verified, some rejected)
  still finds the KC − 1 inputs before it in place. conv_slots = KC keeps just what the next
  step needs.
- delta state: a ring of state_slots ≥ 1 slots (a launch parameter) of [value head][i = key
  dim][j = value dim], row-major (j contiguous). The state before position p is read from slot
  p % state_slots and the state after it is written to slot (p + 1) % state_slots, so after T
  steps from p0 slot (p0 + j) % state_slots holds the state after the first j of them, for every
  j ≤ T as long as T < state_slots (state_slots = Tmax + 1 with the conv ring above): a sequence
  continues from any of them by its position alone, with no replay and no copy. A chunk
  (deltanet_chunk_scan) writes only its last state, to slot (p0 + t) % state_slots.
  state_slots = 1 is the in-place update, with the same traffic.
- gate weights `w_ba`: `ssm_beta` then `ssm_alpha`, one buffer of 2 × heads rows in one GGUF type
  (models/qwen35/model/weights.py stacks them).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, f16, f32, u8, u32
from zdsl.kernels import dmmv, inputs
from zdsl.kernels.dmmv import q8_step
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values, store_q8_1, write_normed
from zdsl.kernels.quant import FORMATS, fmt
from zdsl.kernels.reduce import SHARED_LIMIT, SUBGROUPS, workgroup_sum_table, workgroup_sums
from zdsl.kernels.steps import sequences_of

# the gate weights' types built ahead (others specialize on demand)
GATE_QTYPES = ["q8_0", "q4_k", "q5_k", "q6_k", "f16", "f32"]


def gate_parts(qtype: str) -> int:
    """Invocations per block of the gate weights: the int8 path's where the type has one."""
    f = FORMATS[qtype]
    return f.iparts or f.parts


def _layout_fits(v) -> bool:
    quads = v.D // 4  # invocations per state row, four value columns each
    return v.D % 4 == 0 and v.WG % quads == 0 and v.D % (v.WG // quads) == 0 and v.WG % v.SG == 0


DEFAULT_TOKENS = 4  # TOKENS unless the launch says: the one value a launch of one token (MANY False) is built at


def tokens_at_once(rows: int, cpu: bool = False) -> int:
    """deltanet_step's TOKENS for a launch of `rows` tokens: the fewest of 2, 4, 8 that hold them
    all (a block past the last token does its gates and conv for nothing, in parallel, while a
    second block waits on the first), 8 beyond. On a CPU device blocks of one token: there the
    blocks run one after another anyway, and lavapipe compiles a block of one token in a third of
    the time of one of two (the barriers in its loop become coroutine splits)."""
    return 1 if cpu else next((t for t in (2, 4) if rows <= t), 8)


def _step_shared(v) -> int:
    """deltanet_step's shared memory in bytes: q, k and v of each token of a block, the
    subgroups' shares of its five sums and, with several row parts, their sums of u and y (two
    sets for several tokens in one subgroup)."""
    tokens = v.TOKENS if v.MANY else 1
    sets = 2 if v.MANY and v.WG == v.SG else 1
    return 12 * tokens * v.D + (32 * v.WG * sets if 4 * v.WG > v.D else 0) + 20 * tokens * v.WG // v.SG


def _step_fits(v) -> bool:
    # one token alone takes no blocks: its variants are those of the default TOKENS only
    return (_layout_fits(v) and v.WG % gate_parts(v.QTYPE) == 0 and _step_shared(v) <= SHARED_LIMIT
            and (v.MANY or v.TOKENS == DEFAULT_TOKENS))


def gate_dots(w_ba, x, xq, xd, h, k, QTYPE: str, SG: int, bases=(0,)):
    """This invocation's shares of β's and α's rows of head h times the normed inputs that start
    at elements `bases` (a token's row each): int8 products with their Q8_1 form (xq, xd) where the
    type has an int8 decoder, as the graph's other projections of them, else f32 with x. The whole
    workgroup walks the blocks, each block of the two rows loaded once for every token. Returns
    (β's shares, α's shares), one per base."""
    f = fmt(QTYPE)
    nblocks = k // f.block
    rows = [(w_ba, r * (nblocks * f.nbytes)) for r in (h, zdsl.num_workgroups() + h)]
    everyone = dmmv.Rows(2, 1, SG)
    if f.iparts:
        acc = dmmv.block_loop(f.iparts, nblocks, everyone, 2, len(bases),
                              lambda b, part: q8_step(f, rows, xq, xd, list(bases), b, part))
    else:
        acc = dmmv.block_dots(f, f.setup(), rows, x, list(bases), nblocks, everyone)
    return acc[0], acc[1]


class _Layout:
    """Where an invocation sits in a head's D × D state: (row part `part`, column quad `c`) keeps
    rows part, part + RP, … of columns 4c..4c+3 in registers (RP = 4·WG / D row parts), so each
    row of S is one contiguous read and write per D/4 invocations."""

    def __init__(self, D: int, WG: int):
        self.D, self.WG = D, WG
        self.quads = D // 4
        self.RP = WG // self.quads
        self.t = zdsl.local_index()
        self.c, self.part = self.t % self.quads, self.t // self.quads
        self.rows = [self.part + self.RP * r for r in range(D // self.RP)]


def conv_silu(conv_w, ch, taps, KC: int):
    """silu of channel ch's causal conv over its KC inputs `taps`, oldest first (tap KC − 1: the
    current token)."""
    acc = conv_w[ch * KC + KC - 1] * taps[-1]
    for j in range(KC - 1):
        acc = zdsl.fma(conv_w[ch * KC + j], taps[j], acc)
    return zdsl.silu(acc)


def _conv_tokens(conv, kh, h, n_k_heads, D: int, WG: int, TB: int):
    """q and k of key head kh and v of value head h of TB tokens through the causal conv and
    silu, into shared memory (token j's at j·D; then a barrier), with this invocation's shares of
    each token's q·q, k·k and q·k. conv(j, ch, shared_channel) gives channel ch's conv output for
    token j (shared_channel: a q or k channel, which the other workgroups of key head kh read
    too). The workgroup walks the TB·D (token, channel) pairs at once."""
    qs, ks, vs = zdsl.shared(f32, TB * D), zdsl.shared(f32, TB * D), zdsl.shared(f32, TB * D)
    sums = [[zdsl.var(0.0) for _ in range(TB)] for _ in range(3)]  # q·q, k·k, q·k of each token
    for e in zdsl.range(zdsl.local_index(), TB * D, WG):
        j, i = (0, e) if TB == 1 else (e // D, e % D)
        qi = conv(j, kh * D + i, True)
        ki = conv(j, (n_k_heads + kh) * D + i, True)
        vs[e] = conv(j, (2 * n_k_heads + h) * D + i, False)
        qs[e], ks[e] = qi, ki
        for acc, (a, b) in zip(sums, ((qi, qi), (ki, ki), (qi, ki))):
            for t in range(TB):  # the other tokens' sums add 0 · b
                acc[t].set(zdsl.fma(a if TB == 1 else zdsl.where(j == t, a, 0.0), b, acc[t]))
    zdsl.barrier()
    return qs, ks, vs, sums


def _decay(ssm_a, dt_bias, h, a):
    """e^g, g = ssm_a_h · softplus(a + dt_bias_h)."""
    return zdsl.exp(ssm_a[h] * zdsl.softplus(a + dt_bias[h]))


def _delta_rule(lay: _Layout, S, qkv, qq, kk, qk, decay, beta, eps, red):
    """One token's gated delta rule on this invocation's rows S of the state (qkv: the token's
    q, k and v in shared memory, from `_conv_tokens`, and where; qq, kk, qk their workgroup sums;
    red: the shared vectors that sum the row parts, and where in them): returns the new rows and
    o (four columns), in one pass as o = (e^g S_oldᵀq + (k·q) δ) / √D with
    δ = β (v − e^g S_oldᵀk)."""
    rq, rk = zdsl.rsqrt(qq + eps), zdsl.rsqrt(kk + eps)
    (qs, ks, vs, at), c, rows = qkv, lay.c, lay.rows
    v = zdsl.vec(*[vs[at + 4 * c + e] for e in range(4)])
    k_rows = [ks[at + i] * rk for i in rows]
    u = S[0] * k_rows[0]
    y = S[0] * (qs[at + rows[0]] * rq)
    for s, k_i, i in zip(S[1:], k_rows[1:], rows[1:]):
        u = u + s * k_i
        y = y + s * (qs[at + i] * rq)
    if lay.RP > 1:  # sum the row parts of each column quad
        red_u, red_y, base = red
        red_u[base + lay.t], red_y[base + lay.t] = u, y
        zdsl.barrier()
        u, y = red_u[base + c], red_y[base + c]  # the same sums, in the same order, in every row part
        for p in range(1, lay.RP):
            u = u + red_u[base + p * lay.quads + c]
            y = y + red_y[base + p * lay.quads + c]
    delta = beta * (v - decay * u)
    new = [s * decay + delta * k_i for s, k_i in zip(S, k_rows)]
    return new, (decay * y + (qk * rq * rk) * delta) * (1.0 / math.sqrt(lay.D))


def _store_out(lay: _Layout, o, gate, norm_w, at, out, oq, od, eps, Q8: bool, SG: int, kernel: str):
    """rmsnorm(o) · norm_w · silu(gate) into out.vec4[at] (row part 0 stores), with Q8 also as
    Q8_1 (oq, od: the output projection's int8 input; q8_1.py)."""
    (ss,) = workgroup_sums([zdsl.where(lay.part == 0, zdsl.dot(o, o), 0.0)], lay.WG, SG)
    value = o * zdsl.rsqrt(ss / lay.D + eps) * norm_w.vec4[lay.c] * (gate / (1.0 + zdsl.exp(-gate)))
    with zdsl.if_(lay.part == 0):
        out.vec4[at] = value
    if Q8:
        if lay.D % 32:
            raise zdsl.ZdslError(f"{kernel} writes Q8_1 blocks of 32 values: D = {lay.D} is not a multiple of 32")
        store_q8_1(value, at, lay.part == 0, oq, od)  # every row part has the value; part 0 stores


def _step_traffic(v, s) -> int:
    """Every buffer once a row (the gate rows too: the cache keeps them, the count does not), the
    conv ring's KC − 1 slots before p0 read and one a row written, the state read once and written
    once a row (once at the end with state_slots = 1: in place)."""
    H, Hv, D, R = s.k, s.v_heads, v.D, getattr(s, "rows", 1)
    C = (2 * s.n_k_heads + Hv) * D
    out = 4 * Hv * D + (Hv * D + Hv * D // 4 if v.Q8 else 0)
    writes = R if getattr(s, "state_slots", 1) > 1 else 1
    return (4 * C * (2 * R + 2 * v.KC - 1) + 32 + 8 * Hv + 4 * D + 4 * Hv * D * D * (1 + writes)
            + R * (4 * Hv * D + 2 * Hv * inputs.row_bytes(v.QTYPE, H) + 4 * H + H + H // 4 + out))


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128], "WG": [256, 512], "Q8": [False, True], "QTYPE": GATE_QTYPES, "MANY": [False, True],
                       "TOKENS": [2, 4, 8], "SG": SUBGROUPS},
             where=_step_fits, sizes=("v_heads", "rows", "sequences"),
             grid=lambda v, s: (s.v_heads, 1, getattr(s, "sequences", 1)), traffic=_step_traffic)
def deltanet_step(mix: Buffer[f32], conv_w: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32], z: Buffer[f32],
                  w_ba: Buffer[u8], x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], ssm_a: Buffer[f32],
                  dt_bias: Buffer[f32], norm_w: Buffer[f32],
                  state: Buffer[f32], out: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], n_k_heads: u32, k: u32,
                  eps: f32, conv_slots: u32, state_slots: u32, row: u32 = 0, rows: u32 = 1, seq_bytes: u32 = 0,
                  MANY: Const = False,
                  D: Const = 128, KC: Const = 4, WG: Const = 256, Q8: Const = False, QTYPE: Const = "q8_0",
                  TOKENS: Const = DEFAULT_TOKENS, SG: Const = 32):
    """Value head h = workgroup_id, key head kh = h % n_k_heads, `rows` tokens of one sequence at
    positions p = p0 + r (p0 = step[0], r = 0 … rows − 1), in order; mix = the raw
    [q (n_k_heads × D) | k (n_k_heads × D) | v (heads × D)] projection, C channels. The tokens
    go in blocks of TOKENS (MANY; one token alone without): for every token of a block at once
    the workgroup first convolves the channels it reads (q and k of kh, v of h): conv_c =
    silu(Σ_k conv_w[c, k] · x_c(p − KC + 1 + k)), and stores mix_c in slot p % conv_slots of the
    ring `conv_state` (module doc; q and k by workgroup kh only, so each value has one writer).
    The inputs of positions ≥ p0 come from this launch's mix rows, earlier ones from the ring
    (chunk_taps): another workgroup (the owner) writes the q and k slots of this launch's rows,
    so reading them back would race. Nothing written is read by the launch as long as
    rows ≤ conv_slots − KC + 1 (the slots of p0 … p0 + rows − 1 are not those of p0 − KC + 1 …
    p0 − 1). Meanwhile all its invocations project the head's gates from each token's normed input
    x (k values; as Q8_1 in xq, xd for int8 types): b = w_ba[h] · x, a = w_ba[heads + h] · x
    (QTYPE rows, each block loaded once for the block's tokens; WG a multiple of the type's
    invocations per block). Then token after token, with q, k L2-normalised
    (eps), β = sigmoid(b_h), g = ssm_a_h · softplus(a_h + dt_bias_h), S the head's D × D state:
        S ← e^g S;  u = Sᵀk;  S ← S + k (β (v − u))ᵀ;  o = Sᵀq / √D
    computed in one pass as o = (e^g S_oldᵀq + (k·q) δ) / √D with δ = β (v − e^g S_oldᵀk), then
    out_h = rmsnorm(o) · norm_w · silu(z_h); with Q8 also as Q8_1 (oq, od: the output
    projection's int8 input; q8_1.py; D a multiple of 32). S is read once, from slot
    p0 % state_slots of the ring `state`, and carried in registers from row to row; the state
    after row r goes to slot (p0 + r + 1) % state_slots (module doc), every row's, so the
    sequence can be cut back to any of them; with state_slots = 1 (in place) only the last.
    Invocation (row part p, column quad c) keeps rows p, p + RP, … of columns 4c..4c+3 in
    registers (RP = 4·WG / D row parts), so each row of S is one contiguous read and write per D/4
    invocations. Token r's mix, z, x, xq, xd, out, oq and od are at row `row` + r (a batch's
    sequences one row each, batch.py; a step of several tokens of one sequence, token_rows.py).
    The launch names v_heads (the grid), and `sequences` where several step together, one token
    each (a batch): sequence s = the grid's z reads and writes row `row` + s, its row of the step
    values and its own ring and state (steps.sequences_of)."""
    if not _step_fits(SimpleNamespace(D=D, WG=WG, SG=SG, QTYPE=QTYPE, MANY=MANY, TOKENS=TOKENS)):
        raise zdsl.ZdslError(f"deltanet_step needs 4 | D, D/4 | WG, WG / (D/4) | D, whole {QTYPE} blocks per "
                             f"workgroup and at most {SHARED_LIMIT:,} bytes of shared memory, not D={D}, WG={WG}"
                             + (f", TOKENS={TOKENS}" if MANY else ""))
    row, step, conv_state, state = sequences_of(row, step, seq_bytes, conv_state, state)
    h = zdsl.workgroup_id()
    kh = h % n_k_heads
    C = (2 * n_k_heads + zdsl.num_workgroups()) * D
    n = zdsl.num_workgroups() * D  # a row of z and out
    lay = _Layout(D, WG)

    def at_state(slot, i):
        return ((slot * zdsl.num_workgroups() + h) * D + i) * lay.quads + lay.c

    # the state's loads first: in flight while the first tokens' conv runs and q and k are normalised
    s_in = step[0] % state_slots  # the state before p0; the one after token r goes r + 1 slots on
    S = [zdsl.var(state.vec4[at_state(s_in, i)]) for i in lay.rows]
    first = step[0] % conv_slots  # the ring slot of p0 (slots computed from it: no u32 overflow)
    owner = h < n_k_heads  # the one workgroup of key head kh that stores its q and k inputs
    chunk = mix.at(row * C)  # this launch's mix rows, for the taps of positions ≥ p0
    TB = TOKENS if MANY else 1
    # the row parts' sums of u and y (_delta_rule). A token writes them a barrier after the token
    # before it read them: _store_out's, or with one subgroup (no such barrier) it writes the
    # other of two sets
    sets = 2 if MANY and WG == SG else 1
    red = (zdsl.shared(f32.vec(4), sets * WG), zdsl.shared(f32.vec(4), sets * WG)) if lay.RP > 1 else None
    for r0 in zdsl.range(0, rows, TB) if MANY else [0]:  # one row: the body once (a loop around barriers costs)

        def conv(j, ch, shared_channel):
            """Channel ch's conv output for token j of the block; stores its input in the ring (q
            and k: by the owner; a token past the last: its loads are the last one's, it stores
            nothing)."""
            r = r0 + j if TB == 1 else zdsl.min(r0 + j, rows - 1)
            taps = chunk_taps(chunk, conv_state, first, r, ch, C, KC, conv_slots)
            store = owner if shared_channel else None
            if TB > 1:
                store = r0 + j < rows if store is None else store & (r0 + j < rows)
            with zdsl.if_(store) if store is not None else contextlib.nullcontext():
                conv_state[((first + r) % conv_slots) * C + ch] = taps[-1]
            return conv_silu(conv_w, ch, taps, KC)

        # every token of the block at once: its gates, its conv, and the sums they need (one
        # token's z row early, in flight meanwhile; a block's tokens load theirs in the loop)
        z_early = None if MANY else z.at(row * n).vec4[h * lay.quads + lay.c]
        xs = [row + (r0 + j if TB == 1 else zdsl.min(r0 + j, rows - 1)) for j in range(TB)]
        b_parts, a_parts = gate_dots(w_ba, x, xq, xd, h, k, QTYPE, SG, [r * k for r in xs])
        qs, ks, vs, sums = _conv_tokens(conv, kh, h, n_k_heads, D, WG, TB)
        values = [*sums[0], *sums[1], *sums[2], *b_parts, *a_parts]
        total = workgroup_sum_table(values, WG, SG) if MANY else workgroup_sums(values, WG, SG).__getitem__

        def token(j):
            """The delta rule and the output of token r0 + j (j known when traced without MANY)."""
            qq, kk, qk, b, a = (total(i * TB + j) for i in range(5))
            r = r0 + j
            at = row + r
            part = (red[0], red[1], (j % sets) * WG) if red else None
            new, o = _delta_rule(lay, S, (qs, ks, vs, j * D), qq, kk, qk, _decay(ssm_a, dt_bias, h, a),
                                 zdsl.sigmoid(b), eps, part)
            for s_, value in zip(S, new):
                s_.set(value)
            s_out = (s_in + r + 1) % state_slots
            with zdsl.if_((state_slots > 1) | (r + 1 == rows)) if MANY else contextlib.nullcontext():
                for s_, i in zip(S, lay.rows):  # one slot: in place, the last token's is enough
                    state.vec4[at_state(s_out, i)] = s_
            oq_r, od_r = (oq.at(at * (n // 4)), od.at(at * (n // 16))) if Q8 else (oq, od)
            gate = z_early if z_early is not None else z.at(at * n).vec4[h * lay.quads + lay.c]
            _store_out(lay, o, gate, norm_w, h * lay.quads + lay.c, out.at(at * n), oq_r, od_r, eps, Q8, SG,
                       "deltanet_step")

        if MANY:  # then the delta rule, token after token
            for j in zdsl.range(0, zdsl.min(rows - r0, TB)):
                token(j)
                if lay.RP == 1:  # no barrier in the delta rule: _store_out's sums read before the next's writes
                    zdsl.barrier()
            zdsl.barrier()  # every read of the block's q, k, v and sums done before the next block's writes
        else:
            token(0)


def deltanet_step_ref(mix, conv_w, conv_state, pos, z, w_ba, x, xq, xd, qtype, ssm_a, dt_bias, norm_w, state, n_k_heads,
                      eps):
    """Straight from the model doc, in float64. mix: (C,) the raw q|k|v projection; conv_w: (C, KC);
    conv_state: (conv_slots, C), the ring (module doc: slot s holds the input of the last position
    ≡ s mod conv_slots, conv_slots ≥ KC); pos: the position; z: (Hv·D,); w_ba: the 2·Hv gate rows
    (β's, then α's) as `qtype` bytes, dequantized by gguf-py; x: (k,) the normed input, xq, xd: its
    Q8_1 form (what the gates read for types with an int8 decoder); ssm_a, dt_bias: (Hv,); norm_w:
    (D,); state: (state_slots, Hv, D, D), the ring (slot pos % state_slots: the state before pos).
    Returns (out (Hv·D,), new state ring (slot (pos + 1) % state_slots: the state after pos),
    new conv ring)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    slots, Hv, D = state.shape[0], state.shape[1], state.shape[2]
    xs = q8_1_values(xq, xd) if FORMATS[qtype].iparts else f(x)
    b, a = np.split(dmmv.dequant_rows(w_ba, qtype, 2 * Hv, len(x)) @ xs, 2)
    Hk = n_k_heads
    KC, conv_slots = conv_w.shape[1], conv_state.shape[0]
    assert conv_slots >= KC
    # the inputs of positions pos − KC + 1 … pos, oldest first; tap KC − 1 is the current token
    hist = [f(conv_state[(pos - KC + 1 + k) % conv_slots]) for k in range(KC - 1)] + [f(mix)]
    pre = sum(f(conv_w)[:, k] * hist[k] for k in range(KC))
    conv = pre / (1 + np.exp(-pre))
    ring = np.array(conv_state, np.float32, copy=True)
    ring[pos % conv_slots] = mix
    q = conv[:Hk * D].reshape(Hk, D)
    k = conv[Hk * D:2 * Hk * D].reshape(Hk, D)
    v = conv[2 * Hk * D:].reshape(Hv, D)
    q = q / np.sqrt((q * q).sum(axis=1, keepdims=True) + eps)
    k = k / np.sqrt((k * k).sum(axis=1, keepdims=True) + eps)
    beta = 1 / (1 + np.exp(-f(b)))
    g = f(ssm_a) * np.logaddexp(0.0, f(a) + f(dt_bias))
    S = f(state[pos % slots]).copy()
    out = np.empty((Hv, D))
    z = f(z).reshape(Hv, D)
    for h in range(Hv):
        kh = h % Hk
        S[h] *= np.exp(g[h])
        u = S[h].T @ k[kh]
        S[h] += np.outer(k[kh], beta[h] * (v[h] - u))
        o = S[h].T @ q[kh] / np.sqrt(D)
        out[h] = o / np.sqrt(np.mean(o * o) + eps) * f(norm_w) * z[h] / (1 + np.exp(-z[h]))
    states = np.array(state, np.float32, copy=True)
    states[(pos + 1) % slots] = S
    return out.reshape(-1).astype(np.float32), states, ring


def deltanet_steps_ref(mix, conv_w, conv_state, pos, z, w_ba, x, xq, xd, qtype, ssm_a, dt_bias, norm_w, state,
                       n_k_heads, eps):
    """deltanet_step of rows = len(mix) tokens at positions pos … pos + rows − 1: the single-step
    reference row after row, each from the rings the one before left. mix: (rows, C); z:
    (rows, Hv·D); x: (rows, k); xq, xd: (rows, …) its Q8_1 form; the rest as
    deltanet_step_ref's. Returns (outs (rows, Hv·D), state ring, conv ring)."""
    outs = []
    for r in range(len(mix)):
        out, state, conv_state = deltanet_step_ref(mix[r], conv_w, conv_state, pos + r, z[r], w_ba, x[r], xq[r],
                                                   xd[r], qtype, ssm_a, dt_bias, norm_w, state, n_k_heads, eps)
        outs.append(out)
    return np.stack(outs), state, conv_state


def example_rings(use, rng, check: bool, KC: int, rows: int = 1) -> tuple[int, int, int]:
    """(conv_slots, state_slots, position) for an example: the launch's ring sizes at a far
    position (what a timing runs), or for a check drawn ones (conv_slots KC + rows − 1 …
    KC + rows + 6, room for `rows` tokens in a launch; state_slots 1 … 5) at a position past
    both rings' first wrap."""
    if not check:
        return use.sizes["conv_slots"], use.sizes.get("state_slots", 1), 1001
    conv_slots, state_slots = KC + rows - 1 + int(rng.integers(0, 8)), int(rng.integers(1, 6))
    return conv_slots, state_slots, int(rng.integers(conv_slots + state_slots, 2000))


@deltanet_step.example
def deltanet_step_example(use, rng, check):
    D, KC, q, q8 = use.fixed["D"], use.fixed["KC"], use.fixed["QTYPE"], use.fixed["Q8"]
    Hk, Hv, H, eps = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["k"], use.sizes["eps"]
    C = (2 * Hk + Hv) * D
    many = use.fixed.get("MANY", False)  # a loop over rows, or one row
    R = (int(rng.integers(1, 6)) if check else use.sizes.get("rows", 1)) if many else 1  # tokens of the launch
    conv_slots, state_slots, pos = example_rings(use, rng, check, KC, R)
    args = dict(mix=inputs.normal(rng, R * C), conv_w=inputs.normal(rng, C * KC, 0.5),
                conv_state=inputs.normal(rng, conv_slots * C),
                step=inputs.step_words(pos, pos + 1), z=inputs.normal(rng, R * Hv * D, 2.0),
                w_ba=inputs.rows(rng, q, 2 * Hv, H), x=inputs.normal(rng, R * H),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32), dt_bias=inputs.normal(rng, Hv),
                norm_w=inputs.normal(rng, D), state=inputs.normal(rng, state_slots * Hv * D * D, 0.5),
                out=np.zeros(R * Hv * D, np.float32), n_k_heads=Hk, k=H, eps=eps, conv_slots=conv_slots,
                state_slots=state_slots, rows=R, v_heads=Hv)
    args.update(zip(("xq", "xd"), q8_1_buffers(args["x"])))
    if q8:
        args.update(oq=np.zeros(R * Hv * D // 4, np.uint32), od=np.zeros(R * Hv * D // 16, np.float32))
    s0, ring0 = args["state"].copy(), args["conv_state"].copy()

    def expect(p):
        given = {n: args[n].reshape(R, -1) for n in ("mix", "z", "x", "xq", "xd")}
        out, state, ring = deltanet_steps_ref(**given, w_ba=args["w_ba"], ssm_a=args["ssm_a"],
                                              dt_bias=args["dt_bias"], norm_w=args["norm_w"], qtype=q,
                                              conv_w=args["conv_w"].reshape(C, KC),
                                              conv_state=ring0.reshape(conv_slots, C), pos=pos,
                                              state=s0.reshape(state_slots, Hv, D, D), n_k_heads=Hk, eps=eps)
        q8_out = {"od": (inputs.q8_1_scales(out), 1e-4)} if q8 else {}
        return {"out": (out.reshape(-1), 1e-4), **q8_out, "state": (state, 1e-5), "conv_state": (ring, 0)}
    return zdsl.Example(args, expect, lambda n: {"state": inputs.copies(args["state"], n)})


def chunk_taps(mix, conv_state, first, i, ch, C, KC: int, conv_slots):
    """Channel ch's inputs of positions p0 + i − KC + 1 … p0 + i for token i of a chunk at p0,
    oldest first: mix rows for positions ≥ p0, the ring of conv_slots slots (slot `first`
    = p0 % conv_slots would hold p0's) for earlier ones."""
    taps = []
    for j in range(KC - 1):
        r = i + (j + 1)  # KC more than the tap's offset from p0
        in_chunk = r >= KC
        if isinstance(in_chunk, bool):  # i known when traced (a launch of one row): one load, no select
            taps.append(mix[(r - KC) * C + ch] if in_chunk else
                        conv_state[((first + conv_slots + r - KC) % conv_slots) * C + ch])
            continue
        from_mix = mix.load((r - KC) * C + ch, mask=in_chunk, other=0.0)
        # position p0 + r − KC (r < KC where it is read); conv_slots ≥ KC, no underflow
        from_ring = conv_state.load(((first + conv_slots + r - KC) % conv_slots) * C + ch, mask=r < KC, other=0.0)
        taps.append(zdsl.where(in_chunk, from_mix, from_ring))
    return taps + [mix[i * C + ch]]


# ---- a prompt's chunk: conv rows, the delta rule in blocks, the gated norm rows -----------------

@zdsl.kernel(workgroup="D", subgroup="SG", variants={"D": [128], "SG": SUBGROUPS}, where=lambda v: v.D % v.SG == 0,
             key=("channels",), sizes=("t",), grid=lambda v, s: (s.channels // v.D, s.t),
             traffic=lambda v, s: 4 * s.channels * (2 * s.t + v.KC + v.KC - 1))
def deltanet_conv_rows(mix: Buffer[f32], conv_w: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32],
                       conv: Buffer[f32], channels: u32, n_k_heads: u32, eps: f32, conv_slots: u32, D: Const = 128,
                       KC: Const = 4, SG: Const = 32):
    """conv[i·C + c] = silu of channel c's causal conv for token i = workgroup_id(1) of a chunk at
    p0 = step[0] (C = channels; the same sums, in the same order, as deltanet_step's), with each
    head of q and k (the first 2·n_k_heads heads of D channels) L2-normalised (eps): the delta
    rule's inputs, none of it a recurrence, for every token at once. Workgroup (head, token) does
    one head of D channels. Reads the ring of conv_slots slots (module doc), writes nothing of it
    (deltanet_chunk_scan does)."""
    head, i = zdsl.workgroup_id(0), zdsl.workgroup_id(1)
    ch = head * D + zdsl.local_index()
    taps = chunk_taps(mix, conv_state, step[0] % conv_slots, i, ch, channels, KC, conv_slots)
    x = zdsl.var(conv_silu(conv_w, ch, taps, KC))
    with zdsl.if_(head < 2 * n_k_heads):  # a q or k head: uniform over the workgroup
        (ss,) = workgroup_sums([x * x], D, SG)
        x.set(x * zdsl.rsqrt(ss + eps))
    conv[i * channels + ch] = x


def deltanet_conv_rows_ref(mix, conv_w, conv_state, pos, n_k_heads, D, eps):
    """(T, C) silu(conv) of mix (T, C) after the ring conv_state (conv_slots, C) at position pos,
    the q and k heads (the first 2·n_k_heads of D channels) L2-normalised; float64."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    T, KC, slots = mix.shape[0], conv_w.shape[1], conv_state.shape[0]
    assert slots >= KC
    hist = np.concatenate([f(conv_state[[(pos - KC + 1 + j) % slots for j in range(KC - 1)]]), f(mix)])
    pre = sum(hist[j:j + T] * f(conv_w)[:, j] for j in range(KC))
    conv = pre / (1 + np.exp(-pre))
    qk = conv[:, :2 * n_k_heads * D].reshape(T, 2 * n_k_heads, D)
    conv[:, :2 * n_k_heads * D] = (qk / np.sqrt((qk * qk).sum(axis=-1, keepdims=True) + eps)).reshape(T, -1)
    return conv


@deltanet_conv_rows.example
def deltanet_conv_rows_example(use, rng, check):
    D, KC, C, T = use.fixed["D"], use.fixed["KC"], use.sizes["channels"], use.sizes["t"]
    Hk, eps = use.sizes["n_k_heads"], use.sizes["eps"]
    conv_slots, _, pos = example_rings(use, rng, check, KC)
    args = dict(mix=inputs.normal(rng, T * C), conv_w=inputs.normal(rng, C * KC, 0.5),
                conv_state=inputs.normal(rng, conv_slots * C), step=inputs.step_words(pos, pos + T),
                conv=np.zeros(T * C, np.float32), channels=C, n_k_heads=Hk, eps=eps, conv_slots=conv_slots, t=T)
    want = deltanet_conv_rows_ref(args["mix"].reshape(T, C), args["conv_w"].reshape(C, KC),
                                  args["conv_state"].reshape(conv_slots, C), pos, Hk, D, eps)
    return zdsl.Example(args, lambda p: {"conv": (want.reshape(-1), 1e-5)})


def _quads(buf, at, n: int) -> list:
    """buf[at … at + n − 1] (at and n multiples of 4) in 16-byte loads, as n values."""
    return [part for m in range(n // 4) for part in _parts(buf.vec4[at // 4 + m])]


def _parts(v) -> tuple:
    return v.x, v.y, v.z, v.w


def _dot(vectors, scalars):
    """Σ vectors[f] · scalars[f]."""
    acc = vectors[0] * scalars[0]
    for v, x in zip(vectors[1:], scalars[1:]):
        acc = acc + v * x
    return acc


def _unroll(n: int, most: int) -> int:
    """The largest divisor of n that is at most `most`."""
    return max(u for u in range(1, most + 1) if n % u == 0)


BLOCK = 64  # tokens of a block of the WY form: the graph's L (its wy buffer is sized for it)


def wy_floats(L: int) -> int:
    """Floats of one block's entry in the wy buffer: T' and P (L × L each, row-major), then G (L)."""
    return (2 * L + 1) * L


def wy_size(t: int, v_heads: int, L: int) -> int:
    """Floats of the wy buffer for a chunk of up to t tokens: an entry per block and value head."""
    return zdsl.cdiv(t, L) * v_heads * wy_floats(L)


def _wy_threads(v) -> int:
    """A column of β V (D) or of the identity (L) each, in whole subgroups."""
    return zdsl.cdiv(v.D + v.L, v.SG) * v.SG


def _wy_traffic(v, s) -> int:
    """Every block's q, k and v rows and gate logits read, its U rows and wy entry written."""
    Hv, D, T, L = s.v_heads, v.D, s.t, v.L
    return 4 * T * Hv * (3 * D + 2 + D) + 4 * zdsl.cdiv(T, L) * Hv * wy_floats(L)


@zdsl.kernel(workgroup=_wy_threads, subgroup="SG", variants={"D": [128], "L": [BLOCK], "SG": SUBGROUPS},
             where=lambda v: v.D % 4 == 0 and v.L % 4 == 0, sizes=("v_heads",),
             grid=lambda v, s: (s.v_heads, zdsl.cdiv(s.t, v.L)), traffic=_wy_traffic)
def deltanet_chunk_wy(conv: Buffer[f32], ba: Buffer[f32], ssm_a: Buffer[f32], dt_bias: Buffer[f32], wy: Buffer[f32],
                      u: Buffer[f32], t: u32, n_k_heads: u32, D: Const = 128, L: Const = 64, SG: Const = 32):
    """The delta rule of a chunk's tokens in blocks of L, in the WY form (the block's tokens at
    once, not one after another): what each block of value head h needs besides the state it
    starts from, all of it independent of that state, so every block of every head at once
    (workgroup (h, block)). With G_r the running sum of the log decays g = ssm_a_h ·
    softplus(a + dt_bias_h) over the block's tokens up to r, γ_r = e^G_r and β = sigmoid(b):

        A[r, s] = β_r e^(G_r − G_s) k_r·k_s   (s < r)      T = (I + A)⁻¹
        T' = T diag(β γ)    P[r, s] = e^(G_r − G_s) q_r·k_s / √D   (s ≤ r)    U = T diag(β) V

    into the block's wy entry (T', P, G) and U into u's rows ([token][head][D], as raw o, which
    deltanet_chunk_scan then overwrites). The scan carries the state S over the blocks:
    Δ = U − T' K S, O = diag(γ) Q S / √D + P Δ, S ← γ_last S + Kᵀ diag(e^(G_last − G)) Δ.
    T comes from forward substitution, one column per invocation (L rows unrolled in registers,
    A in shared memory): invocation j < D solves the column j of β V (U), D + s the column s of
    the identity (T). Past the chunk's t tokens β = g = 0: such a token changes nothing, and its
    rows and columns of T', P and U are 0 (U's are not written)."""
    h, c, Hv = zdsl.workgroup_id(0), zdsl.workgroup_id(1), zdsl.num_workgroups(0)
    kh, C, tid, WG = h % n_k_heads, (2 * n_k_heads + Hv) * D, zdsl.local_index(), _wy_threads(
        SimpleNamespace(D=D, L=L, SG=SG))
    first = c * L
    n = zdsl.min(t - first, L)  # the block's tokens
    entry = (c * Hv + h) * wy_floats(L)
    Tw, Pw, Gw = entry, entry + L * L, entry + 2 * L * L

    def row(r):
        """Token r of the block, the last one for r past it (rows past t are not read)."""
        return (first + zdsl.min(r, n - 1)) * C

    beta, g, G = zdsl.shared(f32, L), zdsl.shared(f32, L), zdsl.shared(f32, L)
    with zdsl.if_(tid < L):
        i = first + zdsl.min(tid, n - 1)
        live = tid < n
        beta[tid] = zdsl.where(live, zdsl.sigmoid(ba[i * 2 * Hv + h]), 0.0)
        g[tid] = zdsl.where(live, ssm_a[h] * zdsl.softplus(ba[i * 2 * Hv + Hv + h] + dt_bias[h]), 0.0)
    zdsl.barrier()
    with zdsl.if_(tid < L):
        run = zdsl.var(0.0)
        for s in zdsl.range(0, tid + 1):
            run += g[s]
        G[tid] = run
        wy[Gw + tid] = run
    zdsl.barrier()

    # the Gram matrices of the block, 4 × 4 tiles of (r, s); tiles above the diagonal are zeros
    A = zdsl.shared(f32.vec(4), L * L // 4)  # A[r][s..s+3] at (r·L + s) / 4
    quarter = L // 4
    for tile in zdsl.range(tid, quarter * quarter, WG):
        rr, ss = tile // quarter, tile % quarter
        kk = [[zdsl.var(0.0) for _ in range(4)] for _ in range(4)]
        qk = [[zdsl.var(0.0) for _ in range(4)] for _ in range(4)]
        with zdsl.if_(ss <= rr):
            rows = [row(4 * rr + e) for e in range(4)]
            cols = [row(4 * ss + e) for e in range(4)]
            UG = _unroll(D // 4, 2)
            for d0 in zdsl.range(0, D // 4, UG):  # UG steps of four: their loads first
                kr = [[conv.vec4[(x + (n_k_heads + kh) * D) // 4 + d0 + m] for x in rows] for m in range(UG)]
                qr = [[conv.vec4[(x + kh * D) // 4 + d0 + m] for x in rows] for m in range(UG)]
                kc = [[conv.vec4[(x + (n_k_heads + kh) * D) // 4 + d0 + m] for x in cols] for m in range(UG)]
                for m in range(UG):
                    for e in range(4):
                        for f in range(4):
                            kk[e][f] += zdsl.dot(kr[m][e], kc[m][f])
                            qk[e][f] += zdsl.dot(qr[m][e], kc[m][f])
        for e in range(4):
            r = 4 * rr + e
            a, p = [], []
            for f in range(4):
                s = 4 * ss + f
                decay = zdsl.exp(zdsl.min(G[r] - G[s], 0.0))  # ≤ 1 where it is used (s ≤ r)
                a.append(zdsl.where((s < r) & (r < n), beta[r] * decay * kk[e][f], 0.0))
                p.append(zdsl.where((s <= r) & (r < n), decay * qk[e][f] * (1.0 / math.sqrt(D)), 0.0))
            A[(r * L) // 4 + ss] = zdsl.vec(*a)
            for f in range(4):
                wy[Pw + r * L + 4 * ss + f] = p[f]
    zdsl.barrier()

    # forward substitution, rows unrolled: x_r −= Σ_{s<r} A[r, s] x_s
    j = tid
    x = []
    for r in range(L):
        v = conv.load(row(r) + (2 * n_k_heads + h) * D + j, mask=j < D, other=0.0)
        x.append(zdsl.where(j < D, beta[r] * v, zdsl.where(j == D + r, 1.0, 0.0)))
    for r in range(1, L):
        acc = x[r]
        for s4 in range(0, r, 4):
            a = A[(r * L + s4) // 4]
            for f, part in enumerate(_parts(a)[:min(4, r - s4)]):
                acc = acc - part * x[s4 + f]
        x[r] = acc
    with zdsl.if_(j < D):
        for r in range(L):
            with zdsl.if_(r < n):
                u[((first + r) * Hv + h) * D + j] = x[r]
    with zdsl.else_():
        with zdsl.if_(j < D + L):
            col = j - D
            scale = beta[col] * zdsl.exp(G[col])
            for r in range(L):
                wy[Tw + r * L + col] = x[r] * scale


def _rule_inputs(conv, ba, ssm_a, dt_bias, n_k_heads, D):
    """float64 q, k, v (T, Hv, D; value head h reads key head h % n_k_heads), β and the log decay
    g (T, Hv) of a chunk from its conv rows (T, C) and gate logits (T, 2·Hv)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    conv, ba = f(conv), f(ba)
    T, Hv = ba.shape[0], ba.shape[1] // 2
    heads = np.arange(Hv) % n_k_heads
    q = conv[:, :n_k_heads * D].reshape(T, n_k_heads, D)[:, heads]
    k = conv[:, n_k_heads * D:2 * n_k_heads * D].reshape(T, n_k_heads, D)[:, heads]
    v = conv[:, 2 * n_k_heads * D:].reshape(T, Hv, D)
    return q, k, v, 1 / (1 + np.exp(-ba[:, :Hv])), f(ssm_a) * np.logaddexp(0.0, ba[:, Hv:] + f(dt_bias))


def deltanet_chunk_wy_ref(conv, ba, ssm_a, dt_bias, n_k_heads, D, L):
    """float64 (wy entries (blocks, Hv, wy_floats(L)), U (T, Hv, D)) from conv rows (T, C) and
    gate logits (T, 2·Hv), straight from the definitions (T by a linear solve)."""
    q, k, v, beta, g = _rule_inputs(conv, ba, ssm_a, dt_bias, n_k_heads, D)
    T, Hv = beta.shape
    blocks = -(-T // L)
    wy, U = np.zeros((blocks, Hv, wy_floats(L))), np.zeros((T, Hv, D))
    for c in range(blocks):
        at = slice(c * L, min(T, c * L + L))
        m = at.stop - at.start
        for h in range(Hv):
            G = np.cumsum(g[at, h])
            decay = np.tril(np.exp(G[:, None] - G[None, :]))
            A = np.tril(beta[at, h][:, None] * decay * (k[at, h] @ k[at, h].T), -1)
            Tm = np.linalg.inv(np.eye(m) + A)
            Tp, P = np.zeros((L, L)), np.zeros((L, L))
            Tp[:m, :m] = Tm * (beta[at, h] * np.exp(G))[None, :]
            P[:m, :m] = decay * (q[at, h] @ k[at, h].T) / np.sqrt(D)
            wy[c, h] = np.concatenate([Tp.reshape(-1), P.reshape(-1), np.pad(G, (0, L - m), mode="edge")])
            U[at, h] = Tm @ (beta[at, h][:, None] * v[at, h])
    return wy, U


def chunk_inputs(rng, Hk, Hv, D, T):
    """Random conv rows as deltanet_conv_rows leaves them (q and k normalised) and gate logits."""
    C = (2 * Hk + Hv) * D
    conv = inputs.normal(rng, T * C).reshape(T, C)
    qk = conv[:, :2 * Hk * D].reshape(T, 2 * Hk, D)
    conv[:, :2 * Hk * D] = (qk / np.linalg.norm(qk, axis=-1, keepdims=True)).reshape(T, -1)
    return dict(conv=conv, ba=inputs.normal(rng, T * 2 * Hv).reshape(T, 2 * Hv),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32), dt_bias=inputs.normal(rng, Hv))


@deltanet_chunk_wy.example
def deltanet_chunk_wy_example(use, rng, check):
    D, L = use.fixed["D"], use.fixed["L"]
    Hk, Hv, T = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["t"]
    x = chunk_inputs(rng, Hk, Hv, D, T)
    args = dict(conv=x["conv"].reshape(-1), ba=x["ba"].reshape(-1), ssm_a=x["ssm_a"], dt_bias=x["dt_bias"],
                wy=np.zeros(wy_size(T, Hv, L), np.float32), u=np.zeros(T * Hv * D, np.float32), t=T, n_k_heads=Hk,
                v_heads=Hv)
    wy, U = deltanet_chunk_wy_ref(x["conv"], x["ba"], x["ssm_a"], x["dt_bias"], Hk, D, L)
    return zdsl.Example(args, lambda p: {"wy": (wy.reshape(-1), 1e-4), "u": (U.reshape(-1), 1e-4)})


def _scan_fits(v) -> bool:
    """Column quads of NC / 4 invocations, WG / quads rows of invocations dividing the block's L
    tokens and the state's D rows, the state and a block's Δ in shared memory."""
    quads = v.NC // 4
    rows = v.WG // quads if quads else 0
    return (v.NC % 4 == 0 and v.D % v.NC == 0 and v.WG % quads == 0 and v.L % rows == 0 and v.D % rows == 0
            and v.WG % v.SG == 0 and 4 * (v.D + v.L) * v.NC + 8 * v.L <= SHARED_LIMIT)


def _scan_traffic(v, s) -> int:
    """Each workgroup: every block's q and k rows, wy entry, U and o rows of its columns; the
    state read (one slot) and written (one slot); the chunk's last min(t, conv_slots) mix rows
    into the ring."""
    Hv, D, T, L = s.v_heads, v.D, s.t, v.L
    C = (2 * s.n_k_heads + Hv) * D
    per_wg = 4 * T * 2 * D + 4 * zdsl.cdiv(T, L) * wy_floats(L)
    return (Hv * (D // v.NC)) * per_wg + 4 * T * Hv * D * 2 + 8 * Hv * D * D + 8 * C * min(T, s.conv_slots)


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128], "L": [BLOCK], "NC": [8, 16, 32], "WG": [64, 128, 256], "SG": SUBGROUPS},
             tune={"WG": [512], "US": [16]}, where=_scan_fits, sizes=("v_heads",), grid=lambda v, s: s.v_heads * (v.D // v.NC),
             traffic=_scan_traffic, cpu=dict(NC=8, WG=64))
def deltanet_chunk_scan(conv: Buffer[f32], wy: Buffer[f32], o: Buffer[f32], state: Buffer[f32], mix: Buffer[f32],
                        conv_state: Buffer[f32], step: Buffer[u32], t: u32, n_k_heads: u32, conv_slots: u32,
                        state_slots: u32, D: Const = 128,
                        L: Const = 64, NC: Const = 16, KC: Const = 4, WG: Const = 128, US: Const = 8,
                        SG: Const = 32):
    """The state carried over a chunk's blocks of L tokens (deltanet_chunk_wy's docstring has the
    algebra), NC of value head h's state columns a workgroup: per block, K S and Q S for its
    tokens, Δ = U − T' K S, then o's rows O = γ Q S / √D + P Δ over the U rows in o and the state
    S ← γ_last S + Kᵀ diag(e^(G_last − G)) Δ, products of whole blocks instead of a chain token
    after token. The state's columns are independent, so workgroups split them; S (D × NC) and Δ
    (L × NC) sit in shared memory, an invocation computes four columns of L / (WG / quads) token
    rows and D / (WG / quads) state rows. The state before the chunk (at p0 = step[0]) comes from
    slot p0 % state_slots of the ring `state`, the state after its last token goes to slot
    (p0 + t) % state_slots (module doc), and only that one: a chunk is not cut back. Each
    workgroup reads its columns of the in-slot before the first block and writes them to the
    out-slot after the last, and no other workgroup touches them, so the two slots may be one
    (state_slots = 1: in place, as ever) or two without a race, and the state is read once and
    written once either way. Every workgroup takes a share of storing the chunk's last
    min(t, conv_slots) mix rows in the conv ring's slots (p % conv_slots), as t deltanet_step
    dispatches would leave it."""
    if not _scan_fits(SimpleNamespace(D=D, L=L, NC=NC, WG=WG, SG=SG)):
        raise zdsl.ZdslError(f"deltanet_chunk_scan needs 4 | NC, NC | D, WG / (NC / 4) dividing L and D and "
                             f"{SHARED_LIMIT:,} bytes of shared memory at most, not D={D}, L={L}, NC={NC}, WG={WG}")
    blocks, quads = D // NC, NC // 4
    h, Hv = zdsl.workgroup_id() // blocks, zdsl.num_workgroups() // blocks
    kh, C, tid = h % n_k_heads, (2 * n_k_heads + Hv) * D, zdsl.local_index()
    cq, rg, rows = tid % quads, tid // quads, WG // quads
    # loop steps unrolled, their loads issued first: 4 of the D / 4 in K S, up to US tokens (whole quads)
    UD, US = _unroll(D // 4, 4), 4 * _unroll(L // 4, US // 4)
    j = (zdsl.workgroup_id() % blocks) * NC + 4 * cq  # this invocation's columns j … j + 3
    mine = [rg * (L // rows) + n for n in range(L // rows)]  # its token rows of a block
    its_d = [rg * (D // rows) + n for n in range(D // rows)]  # its state rows
    S_sh, Z = zdsl.shared(f32.vec(4), D * quads), zdsl.shared(f32.vec(4), L * quads)
    G, E = zdsl.shared(f32, L), zdsl.shared(f32, L)
    s_in = step[0] % state_slots  # the state before p0; the one after the chunk goes t slots on
    s_out = (s_in + t) % state_slots
    S = [zdsl.var(state.vec4[(((s_in * Hv + h) * D + d) * D + j) // 4]) for d in its_d]
    for d, s in zip(its_d, S):
        S_sh[d * quads + cq] = s
    k_at, q_at = (n_k_heads + kh) * D, kh * D
    for c in zdsl.range(0, (t + L - 1) // L):
        first = c * L
        n = zdsl.min(t - first, L)
        Tw = (c * Hv + h) * wy_floats(L)
        Pw, Gw = Tw + L * L, Tw + 2 * L * L
        zdsl.barrier()  # S_sh written; nobody reads the last block's Z, G, E any more
        ks = [zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in mine]
        qs = [zdsl.var(zdsl.vec(0.0, 0.0, 0.0, 0.0)) for _ in mine]
        at = [(first + zdsl.min(r, n - 1)) * C for r in mine]
        for d0 in zdsl.range(0, D // 4, UD):  # UD steps of four rows of S: their loads first
            s4 = [[S_sh[(4 * (d0 + m) + e) * quads + cq] for e in range(4)] for m in range(UD)]
            kq = [[(conv.vec4[(x + k_at) // 4 + d0 + m], conv.vec4[(x + q_at) // 4 + d0 + m]) for m in range(UD)]
                  for x in at]
            for rows_kq, k_acc, q_acc in zip(kq, ks, qs):
                for s_m, (kv, qv) in zip(s4, rows_kq):
                    k_acc.set(k_acc + _dot(s_m, _parts(kv)))
                    q_acc.set(q_acc + _dot(s_m, _parts(qv)))
        for r, k_acc in zip(mine, ks):
            Z[r * quads + cq] = k_acc
        for s in zdsl.range(tid, L, WG):
            G[s] = wy[Gw + s]
            E[s] = zdsl.exp(wy[Gw + L - 1] - wy[Gw + s])
        zdsl.barrier()
        delta = [zdsl.var(o.vec4.load((((first + r) * Hv + h) * D + j) // 4, mask=r < n,
                                      other=zdsl.vec(0.0, 0.0, 0.0, 0.0))) for r in mine]
        for s0 in zdsl.range(0, L, US):  # US tokens: their loads first
            z = [Z[(s0 + f) * quads + cq] for f in range(US)]
            rows_t = [_quads(wy, Tw + r * L + s0, US) for r in mine]
            for t_r, dl in zip(rows_t, delta):
                dl.set(dl - _dot(z, t_r))
        zdsl.barrier()
        for r, dl in zip(mine, delta):
            Z[r * quads + cq] = dl  # Δ: 0 past t (U masked, T' rows 0)
        zdsl.barrier()
        out = [zdsl.var(q_acc * (zdsl.exp(G[r]) * (1.0 / math.sqrt(D)))) for r, q_acc in zip(mine, qs)]
        last = zdsl.exp(G[L - 1])
        for s in S:
            s.set(s * last)
        for s0 in zdsl.range(0, L, US):
            z = [Z[(s0 + f) * quads + cq] for f in range(US)]
            rows_p = [_quads(wy, Pw + r * L + s0, US) for r in mine]
            k_rows = [(first + zdsl.min(s0 + f, n - 1)) * C + k_at + its_d[0] for f in range(US)]
            k = [_quads(conv, x, len(its_d)) if len(its_d) % 4 == 0 else [conv[x + m] for m in range(len(its_d))]
                 for x in k_rows]
            for p_r, acc in zip(rows_p, out):
                acc.set(acc + _dot(z, p_r))
            ze = [z_f * E[s0 + f] for f, z_f in enumerate(z)]
            for m, acc in enumerate(S):
                acc.set(acc + _dot(ze, [k_f[m] for k_f in k]))
        for r, acc in zip(mine, out):
            with zdsl.if_(r < n):
                o.vec4[(((first + r) * Hv + h) * D + j) // 4] = acc
        for d, s in zip(its_d, S):
            S_sh[d * quads + cq] = s
    for d, s in zip(its_d, S):
        state.vec4[(((s_out * Hv + h) * D + d) * D + j) // 4] = s
    # slot (first + t + n) % conv_slots takes position p0 + t − conv_slots + n, the mix row
    # t − conv_slots + n, if in the chunk
    first = step[0] % conv_slots
    for n in zdsl.range(zdsl.global_id(), conv_slots * C, zdsl.num_workgroups() * WG):
        row, ch = n // C, n % C
        with zdsl.if_(t + row >= conv_slots):
            conv_state[((first + t + row) % conv_slots) * C + ch] = mix[(t + row - conv_slots) * C + ch]


def deltanet_chunk_scan_ref(conv, mix, conv_state, pos, ba, ssm_a, dt_bias, state, n_k_heads):
    """Straight from the model doc, in float64, token after token, for positions pos … pos + T − 1.
    conv: (T, C) deltanet_conv_rows' rows (q and k normalised); mix: (T, C); conv_state:
    (conv_slots, C), the ring (slot s: the input of the last position ≡ s mod conv_slots before
    pos); ba: (T, 2·Hv) the β logits then the α inputs; ssm_a, dt_bias: (Hv,); state:
    (state_slots, Hv, D, D), the ring (slot pos % state_slots: the state before pos). Returns
    (raw o (T, Hv, D), new state ring (slot (pos + T) % state_slots: the state after the chunk,
    the others as given), new conv ring)."""
    slots, Hv, D = state.shape[0], state.shape[1], state.shape[2]
    T, conv_slots = mix.shape[0], conv_state.shape[0]
    ring = np.array(conv_state, np.float32, copy=True)
    for p in range(max(pos, pos + T - conv_slots), pos + T):
        ring[p % conv_slots] = mix[p - pos]
    q, k, v, beta, g = _rule_inputs(conv, ba, ssm_a, dt_bias, n_k_heads, D)
    decay = np.exp(g)
    S = np.asarray(state[pos % slots], np.float64).copy()
    o = np.empty((T, Hv, D))
    for i in range(T):
        S *= decay[i][:, None, None]
        u = np.einsum("hij,hi->hj", S, k[i])
        S += k[i][:, :, None] * (beta[i][:, None] * (v[i] - u))[:, None, :]
        o[i] = np.einsum("hij,hi->hj", S, q[i]) / np.sqrt(D)
    states = np.array(state, np.float32, copy=True)
    states[(pos + T) % slots] = S
    return o, states, ring


@deltanet_chunk_scan.example
def deltanet_chunk_scan_example(use, rng, check):
    D, KC, L = use.fixed["D"], use.fixed["KC"], use.fixed["L"]
    Hk, Hv, T = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["t"]
    C = (2 * Hk + Hv) * D
    conv_slots, state_slots, pos = example_rings(use, rng, check, KC)
    x = chunk_inputs(rng, Hk, Hv, D, T)
    wy, U = deltanet_chunk_wy_ref(x["conv"], x["ba"], x["ssm_a"], x["dt_bias"], Hk, D, L)
    args = dict(conv=x["conv"].reshape(-1), wy=wy.astype(np.float32).reshape(-1),
                o=U.astype(np.float32).reshape(-1), state=inputs.normal(rng, state_slots * Hv * D * D, 0.5),
                mix=inputs.normal(rng, T * C), conv_state=inputs.normal(rng, conv_slots * C),
                step=inputs.step_words(pos, pos + T), t=T, n_k_heads=Hk, conv_slots=conv_slots,
                state_slots=state_slots, v_heads=Hv)
    s0, ring0 = args["state"].copy(), args["conv_state"].copy()

    def expect(p):
        o, state, ring = deltanet_chunk_scan_ref(x["conv"], args["mix"].reshape(T, C), ring0.reshape(conv_slots, C),
                                                 pos, x["ba"], x["ssm_a"], x["dt_bias"],
                                                 s0.reshape(state_slots, Hv, D, D), Hk)
        return {"o": (o.reshape(-1), 1e-4), "state": (state.reshape(-1), 1e-4), "conv_state": (ring.reshape(-1), 0)}
    return zdsl.Example(args, expect, lambda n: {"state": inputs.copies(args["state"], n),
                                                 "o": inputs.copies(args["o"], n)})


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"WG": [32, 64], "Q8": [False, True], "HALVES": [False, True], "SG": SUBGROUPS},
             where=lambda v: v.WG % v.SG == 0, key=("d",), sizes=("rows",), grid=lambda v, s: s.rows,
             traffic=lambda v, s: s.rows * (12 * s.d + (s.d + s.d // 4 if v.Q8 else 0) + (2 * s.d if v.HALVES else 0))
             + 4 * s.d)
def deltanet_gated_norm(o: Buffer[f32], z: Buffer[f32], norm_w: Buffer[f32], out: Buffer[f32], oq: Buffer[u32],
                        od: Buffer[f32], h: Buffer[f16], d: u32, eps: f32, Q8: Const = False, HALVES: Const = False,
                        WG: Const = 32, SG: Const = 32):
    """out = rmsnorm(o) · norm_w · silu(z) per row of d values (a token's value head; norm_w is
    the heads' one vector), with Q8 also as Q8_1 (oq, od; d a multiple of 32), with HALVES also in
    f16 (h, for an output projection on matrix units): deltanet_chunk_scan's read-out made what
    the output projection reads, for every row of the chunk at once (the launch's `rows`, one
    workgroup each)."""
    write_normed(o, norm_w, out, oq if Q8 else None, od if Q8 else None, d, eps, WG, SG, row=zdsl.workgroup_id(),
                 gate=z, h=h if HALVES else None)


def deltanet_gated_norm_ref(o, z, norm_w, eps):
    """rmsnorm(o) · norm_w · silu(z) over the last axis, float64."""
    o, z = np.asarray(o, np.float64), np.asarray(z, np.float64)
    return o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * norm_w * z / (1 + np.exp(-z))


@deltanet_gated_norm.example
def deltanet_gated_norm_example(use, rng, check):
    d, rows, eps = use.sizes["d"], use.sizes["rows"], use.sizes["eps"]
    args = dict(o=inputs.normal(rng, rows * d, 0.1), z=inputs.normal(rng, rows * d, 2.0), norm_w=inputs.normal(rng, d),
                out=np.zeros(rows * d, np.float32), d=d, eps=eps, rows=rows)
    if use.fixed["Q8"]:
        args.update(oq=np.zeros(rows * d // 4, np.uint32), od=np.zeros(rows * d // 16, np.float32))
    if use.fixed.get("HALVES", False):
        args.update(h=np.zeros(rows * d, np.float16))
    want = deltanet_gated_norm_ref(args["o"].reshape(rows, d), args["z"].reshape(rows, d), args["norm_w"], eps)
    q8_out = {"od": (inputs.q8_1_scales(want), 1e-4)} if use.fixed["Q8"] else {}
    h_out = {"h": (want.reshape(-1).astype(np.float16), 1e-3)} if "h" in args else {}
    return zdsl.Example(args, lambda p: {"out": (want.reshape(-1), 1e-4), **q8_out, **h_out})
