"""Gated delta-net layers at decode time (one new token) and for a prompt's chunk of tokens, after
the model doc's DELTANET section.

One dispatch per layer, between the input projections and the output projection: `deltanet_step`,
per value head, its two gate projections (β and α: one row each of the normed input, too small to
be worth a dispatch of their own), the causal depthwise conv (+ silu) of the q, k and v channels it
reads, L2-normalised q and k, the gated delta rule on the f32 state, the read-out o and the gated
RMSNorm of o, fused: the state (64 KiB per head at d = 128) is read once and written once, and
neither the conv output nor o leaves the workgroup. A prompt's chunk runs only the recurrence token
after token (`deltanet_prefill`, by state columns), between conv rows and gated norm rows.

Layouts (all f32):

- conv weight `ssm_conv1d.weight` as stored ({4, C} in GGUF order): [channel][tap], tap KC − 1 the
  current token.
- conv state: a ring of KC slots of C channels, [slot][channel]: the input (`mix`) of position p is
  stored in slot p % KC, so the taps of position p read slots (p − KC + 1) % KC … (p − 1) % KC and
  nobody reads the slot being written. Workgroups that share a key head read the same q and k
  channels, so an in-place shift would race; the ring never moves a value. It is zeroed with the
  sequence (inputs before position 0 are zeros), and the position advances by one per step.
- delta state: [value head][i = key dim][j = value dim], row-major (j contiguous).
- gate weights `w_ba`: `ssm_beta` then `ssm_alpha`, one buffer of 2 × heads rows in one GGUF type
  (models/qwen35/weights.py stacks them).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u8, u32
from zdsl.kernels import dmmv, inputs
from zdsl.kernels.dmmv import q8_step
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values, store_q8_1, write_normed
from zdsl.kernels.quant import FORMATS, fmt
from zdsl.kernels.reduce import SUBGROUPS, workgroup_sums

# the gate weights' types built ahead (others specialize on demand)
GATE_QTYPES = ["q8_0", "q4_k", "q5_k", "q6_k", "f16", "f32"]


def gate_parts(qtype: str) -> int:
    """Invocations per block of the gate weights: the int8 path's where the type has one."""
    f = FORMATS[qtype]
    return f.iparts or f.parts


def _layout_fits(v) -> bool:
    quads = v.D // 4  # invocations per state row, four value columns each
    return v.D % 4 == 0 and v.WG % quads == 0 and v.D % (v.WG // quads) == 0 and v.WG % v.SG == 0


def _step_fits(v) -> bool:
    return _layout_fits(v) and v.WG % gate_parts(v.QTYPE) == 0


def gate_dots(w_ba, x, xq, xd, h, k, QTYPE: str, SG: int):
    """This invocation's shares of β's and α's rows of head h times the normed input: int8
    products with its Q8_1 form (xq, xd) where the type has an int8 decoder, as the graph's other
    projections of it, else f32 with x. The whole workgroup walks the blocks."""
    f = fmt(QTYPE)
    nblocks = k // f.block
    rows = [(w_ba, r * (nblocks * f.nbytes)) for r in (h, zdsl.num_workgroups() + h)]
    everyone = dmmv.Rows(2, 1, SG)
    if f.iparts:
        acc = dmmv.block_loop(f.iparts, nblocks, everyone, 2, 1, lambda b, part: q8_step(f, rows, xq, xd, [0], b, part))
    else:
        acc = dmmv.block_dots(f, f.setup(), rows, x, [0], nblocks, everyone)
    return acc[0][0], acc[1][0]


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


def _conv_head(conv, kh, h, n_k_heads, D: int, WG: int):
    """q and k of key head kh and v of value head h through the causal conv and silu, into
    shared memory (then a barrier), with this invocation's shares of q·q, k·k and q·k.
    conv(ch, shared_channel) gives channel ch's conv output (shared_channel: a q or k channel,
    which the other workgroups of key head kh read too)."""
    qs, ks, vs = zdsl.shared(f32, D), zdsl.shared(f32, D), zdsl.shared(f32, D)
    qq, kk, qk = zdsl.var(0.0), zdsl.var(0.0), zdsl.var(0.0)
    for i in zdsl.range(zdsl.local_index(), D, WG):
        qi = conv(kh * D + i, True)
        ki = conv((n_k_heads + kh) * D + i, True)
        vs[i] = conv((2 * n_k_heads + h) * D + i, False)
        qs[i], ks[i] = qi, ki
        qq.set(zdsl.fma(qi, qi, qq))
        kk.set(zdsl.fma(ki, ki, kk))
        qk.set(zdsl.fma(qi, ki, qk))
    zdsl.barrier()
    return SimpleNamespace(q=qs, k=ks, v=vs, sums=[qq, kk, qk])


def _decay(ssm_a, dt_bias, h, a):
    """e^g, g = ssm_a_h · softplus(a + dt_bias_h)."""
    return zdsl.exp(ssm_a[h] * zdsl.softplus(a + dt_bias[h]))


def _delta_rule(lay: _Layout, S, qkv, qq, kk, qk, decay, beta, eps):
    """One token's gated delta rule on this invocation's rows S of the state (qkv from
    `_conv_head`, qq, kk, qk its workgroup sums): returns the new rows and o (four columns), in
    one pass as o = (e^g S_oldᵀq + (k·q) δ) / √D with δ = β (v − e^g S_oldᵀk)."""
    rq, rk = zdsl.rsqrt(qq + eps), zdsl.rsqrt(kk + eps)
    qs, ks, vs, c, rows = qkv.q, qkv.k, qkv.v, lay.c, lay.rows
    v = zdsl.vec(*[vs[4 * c + e] for e in range(4)])
    k_rows = [ks[i] * rk for i in rows]
    u = S[0] * k_rows[0]
    y = S[0] * (qs[rows[0]] * rq)
    for s, k_i, i in zip(S[1:], k_rows[1:], rows[1:]):
        u = u + s * k_i
        y = y + s * (qs[i] * rq)
    if lay.RP > 1:  # sum the row parts of each column quad
        red_u, red_y = zdsl.shared(f32.vec(4), lay.WG), zdsl.shared(f32.vec(4), lay.WG)
        red_u[lay.t], red_y[lay.t] = u, y
        zdsl.barrier()
        u, y = red_u[c], red_y[c]  # the same sums, in the same order, in every row part
        for p in range(1, lay.RP):
            u = u + red_u[p * lay.quads + c]
            y = y + red_y[p * lay.quads + c]
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
    """Every buffer once (the conv ring: KC − 1 slots read, one written), the state read and written."""
    H, Hv, D = s.k, s.v_heads, v.D
    C = (2 * s.n_k_heads + Hv) * D
    out = 4 * Hv * D + (Hv * D + Hv * D // 4 if v.Q8 else 0)
    return (4 * C * (1 + 2 * v.KC) + 32 + 4 * Hv * D + 2 * Hv * inputs.row_bytes(v.QTYPE, H) + 4 * H + H + H // 4
            + 8 * Hv + 4 * D + 8 * Hv * D * D + out)


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128], "WG": [256, 512], "Q8": [False, True], "QTYPE": GATE_QTYPES, "SG": SUBGROUPS},
             where=_step_fits, sizes=("v_heads",), grid=lambda v, s: s.v_heads, traffic=_step_traffic)
def deltanet_step(mix: Buffer[f32], conv_w: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32], z: Buffer[f32],
                  w_ba: Buffer[u8], x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], ssm_a: Buffer[f32],
                  dt_bias: Buffer[f32], norm_w: Buffer[f32],
                  state: Buffer[f32], out: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], n_k_heads: u32, k: u32,
                  eps: f32, row: u32 = 0, D: Const = 128, KC: Const = 4, WG: Const = 256, Q8: Const = False, QTYPE: Const = "q8_0",
                  SG: Const = 32):
    """Value head h = workgroup_id, key head kh = h % n_k_heads, position p = step[0]; mix = the
    raw [q (n_k_heads × D) | k (n_k_heads × D) | v (heads × D)] projection, C channels. The
    workgroup first convolves the channels it reads (q and k of kh, v of h): conv_c =
    silu(Σ_k conv_w[c, k] · x_c(p − KC + 1 + k)), the past inputs from the ring `conv_state`
    (module doc), and stores mix_c in slot p % KC (q and k by workgroup kh only, so each value
    has one writer). Meanwhile all its invocations project the head's gates from the normed
    input x (k values; as Q8_1 in xq, xd for int8 types): b = w_ba[h] · x, a = w_ba[heads + h] · x
    (QTYPE rows; WG a multiple of the type's invocations per block). With q, k L2-normalised
    (eps), β = sigmoid(b_h), g = ssm_a_h · softplus(a_h + dt_bias_h), S the head's D × D state:
        S ← e^g S;  u = Sᵀk;  S ← S + k (β (v − u))ᵀ;  o = Sᵀq / √D
    computed in one pass as o = (e^g S_oldᵀq + (k·q) δ) / √D with δ = β (v − e^g S_oldᵀk), then
    out_h = rmsnorm(o) · norm_w · silu(z_h); with Q8 also as Q8_1 (oq, od: the output
    projection's int8 input; q8_1.py; D a multiple of 32). Invocation (row part p, column quad c) keeps rows
    p, p + RP, … of columns 4c..4c+3 in registers (RP = 4·WG / D row parts), so each row of S
    is one contiguous read and write per D/4 invocations. mix, z, x, xq, xd, out, oq and od are
    at row `row` (one sequence of a batch, batch.py). The launch names v_heads (the grid)."""
    if not _step_fits(SimpleNamespace(D=D, WG=WG, SG=SG, QTYPE=QTYPE)):
        raise zdsl.ZdslError(f"deltanet_step needs 4 | D, D/4 | WG, WG / (D/4) | D and whole {QTYPE} blocks per "
                             f"workgroup, not D={D}, WG={WG}")
    h = zdsl.workgroup_id()
    kh = h % n_k_heads
    C = (2 * n_k_heads + zdsl.num_workgroups()) * D
    n = zdsl.num_workgroups() * D  # a row of z and out
    mix, z, out, x = mix.at(row * C), z.at(row * n), out.at(row * n), x.at(row * k)
    xq, xd = xq.at(row * (k // 4)), xd.at(row * (k // 16))  # Q8_1: a word per 4 values, (d, d·Σq) per 32
    if Q8:
        oq, od = oq.at(row * (n // 4)), od.at(row * (n // 16))
    lay = _Layout(D, WG)
    # every load first: the state's are in flight while the conv runs and q and k are normalised
    S = [state.vec4[(h * D + i) * lay.quads + lay.c] for i in lay.rows]
    gate = z.vec4[h * lay.quads + lay.c]
    b_part, a_part = gate_dots(w_ba, x, xq, xd, h, k, QTYPE, SG)
    now = step[0] % KC
    past = [(now + 1 + j) % KC for j in range(KC - 1)]  # ring slot of tap j's input, oldest first
    owner = h < n_k_heads  # the one workgroup of key head kh that stores its q and k inputs

    def conv(ch, shared_channel):
        """Channel ch's conv output; stores its input in the ring (q and k: by the owner)."""
        taps = [conv_state[past[j] * C + ch] for j in range(KC - 1)] + [mix[ch]]
        if shared_channel:
            with zdsl.if_(owner):
                conv_state[now * C + ch] = taps[-1]
        else:
            conv_state[now * C + ch] = taps[-1]
        return conv_silu(conv_w, ch, taps, KC)

    qkv = _conv_head(conv, kh, h, n_k_heads, D, WG)
    qq, kk, qk, b, a = workgroup_sums([*qkv.sums, b_part, a_part], WG, SG)
    S, o = _delta_rule(lay, S, qkv, qq, kk, qk, _decay(ssm_a, dt_bias, h, a), zdsl.sigmoid(b), eps)
    for s, i in zip(S, lay.rows):
        state.vec4[(h * D + i) * lay.quads + lay.c] = s
    _store_out(lay, o, gate, norm_w, h * lay.quads + lay.c, out, oq, od, eps, Q8, SG, "deltanet_step")


@deltanet_step.reference
def deltanet_step_ref(mix, conv_w, conv_state, pos, z, w_ba, x, xq, xd, qtype, ssm_a, dt_bias, norm_w, state, n_k_heads,
                      eps):
    """Straight from the model doc, in float64. mix: (C,) the raw q|k|v projection; conv_w: (C, KC);
    conv_state: (KC, C), the ring (module doc: slot s holds the input of the last position ≡ s mod
    KC); pos: the position; z: (Hv·D,); w_ba: the 2·Hv gate rows (β's, then α's) as `qtype`
    bytes, dequantized by gguf-py; x: (k,) the normed input, xq, xd: its Q8_1 form (what the gates
    read for types with an int8 decoder); ssm_a, dt_bias: (Hv,); norm_w: (D,);
    state: (Hv, D, D). Returns (out (Hv·D,), new delta state, new conv state)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    Hv, D = state.shape[0], state.shape[1]
    xs = q8_1_values(xq, xd) if FORMATS[qtype].iparts else f(x)
    b, a = np.split(dmmv.dequant_rows(w_ba, qtype, 2 * Hv, len(x)) @ xs, 2)
    Hk = n_k_heads
    KC = conv_state.shape[0]
    # the inputs of positions pos − KC + 1 … pos, oldest first; tap KC − 1 is the current token
    hist = [f(conv_state[(pos - KC + 1 + k) % KC]) for k in range(KC - 1)] + [f(mix)]
    pre = sum(f(conv_w)[:, k] * hist[k] for k in range(KC))
    conv = pre / (1 + np.exp(-pre))
    ring = np.array(conv_state, np.float32, copy=True)
    ring[pos % KC] = mix
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
    return out.reshape(-1).astype(np.float32), S.astype(np.float32), ring


@deltanet_step.example
def deltanet_step_example(use, rng, check):
    D, KC, q, q8 = use.fixed["D"], use.fixed["KC"], use.fixed["QTYPE"], use.fixed["Q8"]
    Hk, Hv, H, eps = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["k"], use.sizes["eps"]
    C = (2 * Hk + Hv) * D
    pos = 1001  # the taps read a wrapped ring
    args = dict(mix=inputs.normal(rng, C), conv_w=inputs.normal(rng, C * KC, 0.5), conv_state=inputs.normal(rng, KC * C),
                step=inputs.step_words(pos, pos + 1), z=inputs.normal(rng, Hv * D, 2.0),
                w_ba=inputs.rows(rng, q, 2 * Hv, H), **inputs.activations(rng, H, False),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32), dt_bias=inputs.normal(rng, Hv),
                norm_w=inputs.normal(rng, D), state=inputs.normal(rng, Hv * D * D, 0.5), out=np.zeros(Hv * D, np.float32),
                n_k_heads=Hk, k=H, eps=eps, v_heads=Hv)
    args.update(zip(("xq", "xd"), q8_1_buffers(args["x"])))
    if q8:
        args.update(oq=np.zeros(Hv * D // 4, np.uint32), od=np.zeros(Hv * D // 16, np.float32))
    s0, ring0 = args["state"].copy(), args["conv_state"].copy()

    def expect(p):
        given = {n: args[n] for n in ("mix", "z", "w_ba", "x", "xq", "xd", "ssm_a", "dt_bias", "norm_w")}
        out, state, ring = deltanet_step_ref(**given, qtype=q, conv_w=args["conv_w"].reshape(C, KC),
                                             conv_state=ring0.reshape(KC, C), pos=pos, state=s0.reshape(Hv, D, D),
                                             n_k_heads=Hk, eps=eps)
        q8_out = {"od": (inputs.q8_1_scales(out), 1e-4)} if q8 else {}
        return {"out": (out, 1e-4), **q8_out, "state": (state, 1e-5), "conv_state": (ring, 0)}
    return zdsl.Example(args, expect, lambda n: {"state": inputs.copies(args["state"], n)})


def chunk_taps(mix, conv_state, first, i, ch, C, KC: int):
    """Channel ch's inputs of positions p0 + i − KC + 1 … p0 + i for token i of a chunk at p0,
    oldest first: mix rows for positions ≥ p0, the ring (slot `first` holds p0's) for earlier ones."""
    taps = []
    for j in range(KC - 1):
        r = i + (j + 1)  # KC more than the tap's offset from p0
        in_chunk = r >= KC
        from_mix = mix.load((r - KC) * C + ch, mask=in_chunk, other=0.0)
        from_ring = conv_state.load(((first + r) % KC) * C + ch, mask=r < KC, other=0.0)
        taps.append(zdsl.where(in_chunk, from_mix, from_ring))
    return taps + [mix[i * C + ch]]


# ---- a prompt's chunk: conv rows, the delta rule by columns, the gated norm rows ----------------

@zdsl.kernel(workgroup="D", subgroup="SG", variants={"D": [128], "SG": SUBGROUPS}, where=lambda v: v.D % v.SG == 0,
             key=("channels",), sizes=("t",), grid=lambda v, s: (s.channels // v.D, s.t),
             traffic=lambda v, s: 4 * s.channels * (2 * s.t + v.KC + v.KC - 1))
def deltanet_conv_rows(mix: Buffer[f32], conv_w: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32],
                       conv: Buffer[f32], channels: u32, n_k_heads: u32, eps: f32, D: Const = 128, KC: Const = 4,
                       SG: Const = 32):
    """conv[i·C + c] = silu of channel c's causal conv for token i = workgroup_id(1) of a chunk at
    p0 = step[0] (C = channels; the same sums, in the same order, as deltanet_step's), with each
    head of q and k (the first 2·n_k_heads heads of D channels) L2-normalised (eps): the delta
    rule's inputs, none of it a recurrence, for every token at once. Workgroup (head, token) does
    one head of D channels. Reads the ring, writes nothing of it (deltanet_prefill does)."""
    head, i = zdsl.workgroup_id(0), zdsl.workgroup_id(1)
    ch = head * D + zdsl.local_index()
    x = zdsl.var(conv_silu(conv_w, ch, chunk_taps(mix, conv_state, step[0] % KC, i, ch, channels, KC), KC))
    with zdsl.if_(head < 2 * n_k_heads):  # a q or k head: uniform over the workgroup
        (ss,) = workgroup_sums([x * x], D, SG)
        x.set(x * zdsl.rsqrt(ss + eps))
    conv[i * channels + ch] = x


@deltanet_conv_rows.reference
def deltanet_conv_rows_ref(mix, conv_w, conv_state, pos, n_k_heads, D, eps):
    """(T, C) silu(conv) of mix (T, C) after the ring conv_state (KC, C) at position pos, the
    q and k heads (the first 2·n_k_heads of D channels) L2-normalised; float64."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    T, KC = mix.shape[0], conv_state.shape[0]
    hist = np.concatenate([f(conv_state[[(pos - KC + 1 + j) % KC for j in range(KC - 1)]]), f(mix)])
    pre = sum(hist[j:j + T] * f(conv_w)[:, j] for j in range(KC))
    conv = pre / (1 + np.exp(-pre))
    qk = conv[:, :2 * n_k_heads * D].reshape(T, 2 * n_k_heads, D)
    conv[:, :2 * n_k_heads * D] = (qk / np.sqrt((qk * qk).sum(axis=-1, keepdims=True) + eps)).reshape(T, -1)
    return conv


@deltanet_conv_rows.example
def deltanet_conv_rows_example(use, rng, check):
    D, KC, C, T = use.fixed["D"], use.fixed["KC"], use.sizes["channels"], use.sizes["t"]
    Hk, eps = use.sizes["n_k_heads"], use.sizes["eps"]
    pos = 1001
    args = dict(mix=inputs.normal(rng, T * C), conv_w=inputs.normal(rng, C * KC, 0.5),
                conv_state=inputs.normal(rng, KC * C), step=inputs.step_words(pos, pos + T),
                conv=np.zeros(T * C, np.float32), channels=C, n_k_heads=Hk, eps=eps, t=T)
    want = deltanet_conv_rows_ref(args["mix"].reshape(T, C), args["conv_w"].reshape(C, KC),
                                  args["conv_state"].reshape(KC, C), pos, Hk, D, eps)
    return zdsl.Example(args, lambda p: {"conv": (want.reshape(-1), 1e-5)})


def _columns_fit(v) -> bool:
    """R rows per lane (whole 16-byte loads), P = D / R lanes per column (a power of two within a
    subgroup), whole columns per workgroup; U tokens' inputs twice over in registers beside the
    state (U · R ≤ 32: about the registers of R = 32 one token at a time)."""
    P = v.D // v.R
    return (v.R % 4 == 0 and v.D % v.R == 0 and P & (P - 1) == 0 and v.SG % P == 0 and v.WG % v.SG == 0
            and v.D % (v.WG // P) == 0 and v.U * v.R <= 32)


def _prefill_traffic(v, s) -> int:
    """Every buffer once: t rows of conv, gate logits and o, the state read and written, the
    chunk's last min(t, KC) mix rows into the ring."""
    Hv, D, T = s.v_heads, v.D, s.t
    C = (2 * s.n_k_heads + Hv) * D
    return 4 * C * (T + 2 * min(T, v.KC)) + 32 + 8 * T * Hv + 8 * Hv + 8 * Hv * D * D + 4 * T * Hv * D


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128], "R": [8, 16, 32], "WG": [64, 128], "U": [1, 2, 4], "SG": SUBGROUPS}, where=_columns_fit,
             sizes=("v_heads",), grid=lambda v, s: s.v_heads * v.D * (v.D // v.R) // v.WG, traffic=_prefill_traffic)
def deltanet_prefill(conv: Buffer[f32], ba: Buffer[f32], ssm_a: Buffer[f32], dt_bias: Buffer[f32], state: Buffer[f32],
                     o: Buffer[f32], mix: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32], t: u32,
                     n_k_heads: u32, D: Const = 128, R: Const = 8, KC: Const = 4, WG: Const = 64, U: Const = 4,
                     SG: Const = 32):
    """The gated delta rule for a chunk of t tokens at positions p0 = step[0] … p0 + t − 1, from
    deltanet_conv_rows' rows (q and k normalised) and the gate logits ba the graph projected for
    the chunk ([b_0 … b_{heads−1}, a_0 … a_{heads−1}] per token), into t rows of raw o ([token]
    [head][D], for deltanet_gated_norm). Each value column j of head h's state is a recurrence of
    its own, with β = sigmoid(b_h), e^g = e^(ssm_a_h · softplus(a_h + dt_bias_h)):
        S[:, j] ← e^g S[:, j];  u_j = kᵀS[:, j];  S[:, j] += k β (v_j − u_j);  o_j = qᵀS[:, j] / √D
    (one pass: o_j = (e^g qᵀS_old + (q·k) δ_j) / √D, δ_j = β (v_j − e^g kᵀS_old)). So the token
    loop is short and the grid wide: P = D / R adjacent lanes hold a column, R rows each in
    registers, and combine their sums by shuffles; no barrier, no shared memory, and the next
    token's inputs are loaded while this one's sums run (the loop is bound by its chain of dependent
    operations, and by each copy of a prefetched input waiting on its load). U tokens a trip, the
    next U tokens' inputs loaded at its top, so a trip's copies wait on loads that U steps have
    covered: R = 8, U = 4 by default, 96 VGPRs on gfx1201. On the H100, a 512-token chunk of the
    35B-A3B's heads (µs a layer, 2026-11-26): R 16 U 1 355, R 16 U 2 359, R 8 U 2 307, R 8 U 4
    276 (WG 128: 278). Value head h reads key head h % n_k_heads; the launch names v_heads.
    Nothing here reads the ring, so every workgroup takes a share of storing the chunk's last
    min(t, KC) mix rows in their slots (p % KC), leaving the ring as t deltanet_step dispatches
    would, and the state too up to rounding (the sums run in another order)."""
    if not _columns_fit(SimpleNamespace(D=D, R=R, WG=WG, SG=SG, U=U)):
        raise zdsl.ZdslError(f"deltanet_prefill needs 4 | R, R | D, a power of two D/R dividing SG, SG | WG, "
                             f"WG·R/D | D and U·R ≤ 32, not D={D}, R={R}, WG={WG}, SG={SG}, U={U}")
    P = D // R
    cols = WG // P  # columns per workgroup
    blocks = D // cols  # workgroups per head
    h, Hv = zdsl.workgroup_id() // blocks, zdsl.num_workgroups() // blocks
    kh = h % n_k_heads
    lane = zdsl.local_index()
    j = (zdsl.workgroup_id() % blocks) * cols + lane // P
    top = (lane % P) * R  # this lane's rows: top … top + R − 1
    C = (2 * n_k_heads + Hv) * D
    S = [zdsl.var(zdsl.vec(*[state[(h * D + top + r + e) * D + j] for e in range(4)])) for r in range(0, R, 4)]
    a_h, dt_h = ssm_a[h], dt_bias[h]

    def inputs_of(i):
        """Token i's q and k (this lane's rows, as quads), v_j and the gate logits b and a."""
        q, k = ((i * C + head * D + top) // 4 for head in (kh, n_k_heads + kh))
        return ([conv.vec4[q + r] for r in range(R // 4)] + [conv.vec4[k + r] for r in range(R // 4)]
                + [conv[i * C + (2 * n_k_heads + h) * D + j], ba[i * 2 * Hv + h], ba[i * 2 * Hv + Hv + h]])

    def advance(now, i):
        """Token i: the state's update and o's row, from its inputs `now`."""
        q, k, (v, b, a) = now[:R // 4], now[R // 4:R // 2], now[R // 2:]
        u, y, qk = S[0] * k[0], S[0] * q[0], q[0] * k[0]
        for s, k_r, q_r in zip(S[1:], k[1:], q[1:]):
            u, y, qk = zdsl.fma(s, k_r, u), zdsl.fma(s, q_r, y), zdsl.fma(q_r, k_r, qk)
        u, y, qk = (x.x + x.y + x.z + x.w for x in (u, y, qk))
        for m in (P >> n for n in range(1, P.bit_length())):  # the column's P lanes, butterfly
            u, y, qk = u + zdsl.subgroup_shuffle_xor(u, m), y + zdsl.subgroup_shuffle_xor(y, m), \
                qk + zdsl.subgroup_shuffle_xor(qk, m)
        decay = zdsl.exp(a_h * zdsl.softplus(a + dt_h))
        delta = zdsl.sigmoid(b) * (v - decay * u)
        for s, k_r in zip(S, k):
            s.set(zdsl.fma(k_r, zdsl.vec(delta, delta, delta, delta), s * decay))
        with zdsl.if_(top == 0):
            o[(i * Hv + h) * D + j] = (decay * y + qk * delta) * (1.0 / math.sqrt(D))

    now = [[zdsl.var(x) for x in inputs_of(zdsl.min(t - 1, n) if n else 0)] for n in range(U)]
    for i in zdsl.range(0, t, U):
        ahead = [inputs_of(zdsl.min(i + U + n, t - 1)) for n in range(U)]
        for n in range(U):
            if U == 1:
                advance(now[n], i)
            else:
                with zdsl.if_(i + n < t):  # the last trip's tokens past t leave the state alone
                    advance(now[n], i + n)
        for regs, nxt in zip(now, ahead):
            for x, value in zip(regs, nxt):
                x.set(value)
    for s, r in zip(S, range(0, R, 4)):
        for e, value in enumerate((s.x, s.y, s.z, s.w)):
            state[(h * D + top + r + e) * D + j] = value
    # slot (first + t + n) % KC takes position p0 + t − KC + n, the mix row t − KC + n, if in the chunk
    first = step[0] % KC
    for n in zdsl.range(zdsl.global_id(), KC * C, zdsl.num_workgroups() * WG):
        row, ch = n // C, n % C
        with zdsl.if_(t + row >= KC):
            conv_state[((first + t + row) % KC) * C + ch] = mix[(t + row - KC) * C + ch]


@deltanet_prefill.reference
def deltanet_prefill_ref(conv, mix, conv_state, pos, ba, ssm_a, dt_bias, state, n_k_heads):
    """Straight from the model doc, in float64, token after token, for positions pos … pos + T − 1.
    conv: (T, C) deltanet_conv_rows' rows (q and k normalised); mix: (T, C); conv_state: (KC, C),
    the ring (slot s: the input of the last position ≡ s mod KC before pos); ba: (T, 2·Hv) the β
    logits then the α inputs; ssm_a, dt_bias: (Hv,); state: (Hv, D, D). Returns (raw o (T, Hv, D),
    new delta state, new conv ring)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    Hv, D = state.shape[0], state.shape[1]
    T, KC, Hk = mix.shape[0], conv_state.shape[0], n_k_heads
    ring = np.array(conv_state, np.float32, copy=True)
    for p in range(max(pos, pos + T - KC), pos + T):
        ring[p % KC] = mix[p - pos]
    heads = np.arange(Hv) % Hk  # value head h reads key head h % n_k_heads
    conv = f(conv)
    q = conv[:, :Hk * D].reshape(T, Hk, D)[:, heads]
    k = conv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D)[:, heads]
    v = conv[:, 2 * Hk * D:].reshape(T, Hv, D)
    beta = 1 / (1 + np.exp(-f(ba)[:, :Hv]))
    decay = np.exp(f(ssm_a) * np.logaddexp(0.0, f(ba)[:, Hv:] + f(dt_bias)))
    S = f(state).copy()
    o = np.empty((T, Hv, D))
    for i in range(T):
        S *= decay[i][:, None, None]
        u = np.einsum("hij,hi->hj", S, k[i])
        S += k[i][:, :, None] * (beta[i][:, None] * (v[i] - u))[:, None, :]
        o[i] = np.einsum("hij,hi->hj", S, q[i]) / np.sqrt(D)
    return o, S, ring


@deltanet_prefill.example
def deltanet_prefill_example(use, rng, check):
    D, KC = use.fixed["D"], use.fixed["KC"]
    Hk, Hv, T = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["t"]
    C = (2 * Hk + Hv) * D
    pos = 1001  # a wrapped ring
    conv = inputs.normal(rng, T * C).reshape(T, C)
    qk = conv[:, :2 * Hk * D].reshape(T, 2 * Hk, D)
    conv[:, :2 * Hk * D] = (qk / np.linalg.norm(qk, axis=-1, keepdims=True)).reshape(T, -1)  # as conv_rows leaves them
    args = dict(conv=conv.reshape(-1), ba=inputs.normal(rng, T * 2 * Hv),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32), dt_bias=inputs.normal(rng, Hv),
                state=inputs.normal(rng, Hv * D * D, 0.5), o=np.zeros(T * Hv * D, np.float32),
                mix=inputs.normal(rng, T * C), conv_state=inputs.normal(rng, KC * C),
                step=inputs.step_words(pos, pos + T), t=T, n_k_heads=Hk, v_heads=Hv)
    s0, ring0 = args["state"].copy(), args["conv_state"].copy()

    def expect(p):
        o, state, ring = deltanet_prefill_ref(conv, args["mix"].reshape(T, C), ring0.reshape(KC, C), pos,
                                              args["ba"].reshape(T, -1), args["ssm_a"], args["dt_bias"],
                                              s0.reshape(Hv, D, D), Hk)
        return {"o": (o.reshape(-1), 1e-4), "state": (state.reshape(-1), 1e-5), "conv_state": (ring.reshape(-1), 0)}
    return zdsl.Example(args, expect, lambda n: {"state": inputs.copies(args["state"], n)})


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [32, 64], "Q8": [False, True], "SG": SUBGROUPS},
             where=lambda v: v.WG % v.SG == 0, key=("d",), sizes=("rows",), grid=lambda v, s: s.rows,
             traffic=lambda v, s: s.rows * (12 * s.d + (s.d + s.d // 4 if v.Q8 else 0)) + 4 * s.d)
def deltanet_gated_norm(o: Buffer[f32], z: Buffer[f32], norm_w: Buffer[f32], out: Buffer[f32], oq: Buffer[u32],
                        od: Buffer[f32], d: u32, eps: f32, Q8: Const = False, WG: Const = 32, SG: Const = 32):
    """out = rmsnorm(o) · norm_w · silu(z) per row of d values (a token's value head; norm_w is
    the heads' one vector), with Q8 also as Q8_1 (oq, od; d a multiple of 32): deltanet_prefill's
    read-out made what the output projection reads, for every row of the chunk at once (the
    launch's `rows`, one workgroup each), out of the token loop."""
    write_normed(o, norm_w, out, oq if Q8 else None, od if Q8 else None, d, eps, WG, SG, row=zdsl.workgroup_id(),
                 gate=z)


@deltanet_gated_norm.reference
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
    want = deltanet_gated_norm_ref(args["o"].reshape(rows, d), args["z"].reshape(rows, d), args["norm_w"], eps)
    q8_out = {"od": (inputs.q8_1_scales(want), 1e-4)} if use.fixed["Q8"] else {}
    return zdsl.Example(args, lambda p: {"out": (want.reshape(-1), 1e-4), **q8_out})
