"""Gated delta-net layers at decode time (one new token) and for a prompt's chunk of tokens, after
the model doc's DELTANET section.

One dispatch per layer, between the input projections and the output projection: `deltanet_step`,
per value head, its two gate projections (β and α: one row each of the normed input, too small to
be worth a dispatch of their own), the causal depthwise conv (+ silu) of the q, k and v channels it
reads, L2-normalised q and k, the gated delta rule on the f32 state, the read-out o and the gated
RMSNorm of o, fused: the state (64 KiB per head at d = 128) is read once and written once, and
neither the conv output nor o leaves the workgroup. `deltanet_prefill` runs the same fused math
for a chunk of tokens in one dispatch, its gates projected beforehand for the whole chunk.

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
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values, store_q8_1
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
                  eps: f32, D: Const = 128, KC: Const = 4, WG: Const = 256, Q8: Const = False, QTYPE: Const = "q8_0",
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
    is one contiguous read and write per D/4 invocations. The launch names v_heads (the grid)."""
    if not _step_fits(SimpleNamespace(D=D, WG=WG, SG=SG, QTYPE=QTYPE)):
        raise zdsl.ZdslError(f"deltanet_step needs 4 | D, D/4 | WG, WG / (D/4) | D and whole {QTYPE} blocks per "
                             f"workgroup, not D={D}, WG={WG}")
    h = zdsl.workgroup_id()
    kh = h % n_k_heads
    C = (2 * n_k_heads + zdsl.num_workgroups()) * D
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


def _prefill_traffic(v, s) -> int:
    """Every buffer once: T rows of conv, z, β/α logits and out, the chunk's last min(T, KC) mix
    rows into the ring, the state read and written."""
    Hv, D, T = s.v_heads, v.D, s.t
    C = (2 * s.n_k_heads + Hv) * D
    out = T * (4 * Hv * D + (Hv * D + Hv * D // 4 if v.Q8 else 0))
    return (4 * C * (T + 2 * min(T, v.KC)) + 32 + 4 * T * Hv * D + 8 * T * Hv + 8 * Hv + 4 * D
            + 8 * Hv * D * D + out + 4)


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


@zdsl.kernel(workgroup="WG", variants={"WG": [64, 256]}, key=("channels",), sizes=("t",),
             grid=lambda v, s: (-(-s.channels // v.WG), s.t),
             traffic=lambda v, s: 4 * s.channels * (2 * s.t + v.KC + v.KC - 1))
def deltanet_conv_rows(mix: Buffer[f32], conv_w: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32],
                       conv: Buffer[f32], channels: u32, KC: Const = 4, WG: Const = 256):
    """conv[i·C + c] = silu of channel c's causal conv for token i = workgroup_id(1) of a chunk at
    p0 = step[0] (C = channels): the same sums, in the same order, as deltanet_step's. Reads the
    ring, writes nothing of it (deltanet_prefill does, last)."""
    ch = zdsl.workgroup_id(0) * WG + zdsl.local_index()
    i = zdsl.workgroup_id(1)
    with zdsl.if_(ch < channels):
        taps = chunk_taps(mix, conv_state, step[0] % KC, i, ch, channels, KC)
        conv[i * channels + ch] = conv_silu(conv_w, ch, taps, KC)


@deltanet_conv_rows.reference
def deltanet_conv_rows_ref(mix, conv_w, conv_state, pos):
    """(T, C) silu(conv) of mix (T, C) after the ring conv_state (KC, C) at position pos, float64."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    T, KC = mix.shape[0], conv_state.shape[0]
    hist = np.concatenate([f(conv_state[[(pos - KC + 1 + j) % KC for j in range(KC - 1)]]), f(mix)])
    pre = sum(hist[j:j + T] * f(conv_w)[:, j] for j in range(KC))
    return pre / (1 + np.exp(-pre))


@deltanet_conv_rows.example
def deltanet_conv_rows_example(use, rng, check):
    KC, C, T = use.fixed["KC"], use.sizes["channels"], use.sizes["t"]
    pos = 1001
    args = dict(mix=inputs.normal(rng, T * C), conv_w=inputs.normal(rng, C * KC, 0.5),
                conv_state=inputs.normal(rng, KC * C), step=inputs.step_words(pos, pos + T),
                conv=np.zeros(T * C, np.float32), channels=C, t=T)
    want = deltanet_conv_rows_ref(args["mix"].reshape(T, C), args["conv_w"].reshape(C, KC),
                                  args["conv_state"].reshape(KC, C), pos)
    return zdsl.Example(args, lambda p: {"conv": (want.reshape(-1), 1e-5)})


@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"D": [128], "WG": [256, 512], "Q8": [False, True], "SG": SUBGROUPS},
             where=_layout_fits, sizes=("v_heads",), grid=lambda v, s: s.v_heads, traffic=_prefill_traffic)
def deltanet_prefill(mix: Buffer[f32], conv: Buffer[f32], conv_state: Buffer[f32], step: Buffer[u32],
                     z: Buffer[f32], ba: Buffer[f32], ssm_a: Buffer[f32], dt_bias: Buffer[f32], norm_w: Buffer[f32],
                     state: Buffer[f32], out: Buffer[f32], oq: Buffer[u32], od: Buffer[f32], arrivals: Buffer[u32],
                     t: u32, n_k_heads: u32, eps: f32, D: Const = 128, KC: Const = 4, WG: Const = 256,
                     Q8: Const = False, SG: Const = 32):
    """`deltanet_step` for a chunk of t tokens at positions p0 = step[0] … p0 + t − 1 in one
    dispatch, from t rows of conv (the C channels' causal conv and silu, by deltanet_conv_rows
    first: it is no recurrence, so it stays out of the token loop), z (heads × D) and ba (the
    gate logits the graph projected for all t tokens at once: [b_0 … b_{heads−1}, a_0 …
    a_{heads−1}], b = w_ba[h] · x, a = w_ba[heads + h] · x), into t rows of out (with Q8 also
    oq, od: their Q8_1 blocks back to back). Workgroup h (value head; the launch names v_heads,
    the grid) keeps its state in registers (`_Layout`) and runs the tokens in order, each as
    deltanet_step does. deltanet_conv_rows reads the ring, and every workgroup of a key head
    would read its q and k slots, so the ring is written last: by the workgroup that finishes
    last (arrivals[0] counts them: 0 before, 0 after), which stores the chunk's last min(t, KC)
    mix rows in their slots (p % KC), leaving the ring and the state as t deltanet_step
    dispatches would. Token-serial: the chunked (WY) form, which trades the t state passes for
    matrix products, is a later optimisation."""
    if not _layout_fits(SimpleNamespace(D=D, WG=WG, SG=SG)):
        raise zdsl.ZdslError(f"deltanet_prefill needs 4 | D, D/4 | WG and WG / (D/4) | D, not D={D}, WG={WG}")
    h, Hv = zdsl.workgroup_id(), zdsl.num_workgroups()
    kh = h % n_k_heads
    C = (2 * n_k_heads + Hv) * D
    lay = _Layout(D, WG)
    first = step[0] % KC  # the ring slot of p0
    S = [zdsl.var(state.vec4[(h * D + i) * lay.quads + lay.c]) for i in lay.rows]
    for i in zdsl.range(t):
        gate = z.vec4[(i * Hv + h) * lay.quads + lay.c]
        b, a = ba[i * 2 * Hv + h], ba[i * 2 * Hv + Hv + h]

        qkv = _conv_head(lambda ch, shared_channel: conv[i * C + ch], kh, h, n_k_heads, D, WG)
        qq, kk, qk = workgroup_sums(qkv.sums, WG, SG)
        new, o = _delta_rule(lay, S, qkv, qq, kk, qk, _decay(ssm_a, dt_bias, h, a), zdsl.sigmoid(b), eps)
        for s, n in zip(S, new):
            s.set(n)
        _store_out(lay, o, gate, norm_w, (i * Hv + h) * lay.quads + lay.c, out, oq, od, eps, Q8, SG,
                   "deltanet_prefill")
        zdsl.barrier()  # the next token rewrites the shared q, k, v
    for s, i in zip(S, lay.rows):
        state.vec4[(h * D + i) * lay.quads + lay.c] = s
    with zdsl.if_(zdsl.last_workgroup(arrivals)):
        # slot (first + t + j) % KC takes position p0 + t − KC + j, the mix row t − KC + j, if in the chunk
        for n in zdsl.range(lay.t, KC * C, WG):
            j, ch = n // C, n % C
            with zdsl.if_(t + j >= KC):
                conv_state[((first + t + j) % KC) * C + ch] = mix[(t + j - KC) * C + ch]


@deltanet_prefill.reference
def deltanet_prefill_ref(mix, conv_w, conv_state, pos, z, ba, ssm_a, dt_bias, norm_w, state, n_k_heads, eps):
    """Straight from the model doc, in float64, token after token, for positions pos … pos + T − 1.
    mix: (T, C); conv_w: (C, KC); conv_state: (KC, C), the ring (slot s: the input of the last
    position ≡ s mod KC before pos); z: (T, Hv·D); ba: (T, 2·Hv) the β logits then the α inputs;
    ssm_a, dt_bias: (Hv,); norm_w: (D,); state: (Hv, D, D). Returns (out (T, Hv·D), new delta
    state, new conv ring)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    l2norm = lambda x: x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)  # noqa: E731
    Hv, D = state.shape[0], state.shape[1]
    T, KC, Hk = mix.shape[0], conv_state.shape[0], n_k_heads
    # the inputs of positions pos − KC + 1 … pos + T − 1, oldest first
    hist = np.concatenate([f(conv_state[[(pos - KC + 1 + j) % KC for j in range(KC - 1)]]), f(mix)])
    pre = sum(hist[j:j + T] * f(conv_w)[:, j] for j in range(KC))
    conv = silu(pre)
    ring = np.array(conv_state, np.float32, copy=True)
    for p in range(max(pos, pos + T - KC), pos + T):
        ring[p % KC] = mix[p - pos]
    heads = np.arange(Hv) % Hk  # value head h reads key head h % n_k_heads
    q = l2norm(conv[:, :Hk * D].reshape(T, Hk, D))[:, heads]
    k = l2norm(conv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D))[:, heads]
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
    out = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * f(norm_w) * silu(f(z).reshape(T, Hv, D))
    return out.reshape(T, -1).astype(np.float32), S.astype(np.float32), ring


@deltanet_prefill.example
def deltanet_prefill_example(use, rng, check):
    D, KC, q8 = use.fixed["D"], use.fixed["KC"], use.fixed["Q8"]
    Hk, Hv, T, eps = use.sizes["n_k_heads"], use.sizes["v_heads"], use.sizes["t"], use.sizes["eps"]
    C = (2 * Hk + Hv) * D
    pos = 1001  # the taps read a wrapped ring
    conv_w = inputs.normal(rng, C * KC, 0.5)
    args = dict(mix=inputs.normal(rng, T * C), conv_state=inputs.normal(rng, KC * C), step=inputs.step_words(pos, pos + T),
                z=inputs.normal(rng, T * Hv * D, 2.0), ba=inputs.normal(rng, T * 2 * Hv),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32), dt_bias=inputs.normal(rng, Hv),
                norm_w=inputs.normal(rng, D), state=inputs.normal(rng, Hv * D * D, 0.5),
                out=np.zeros(T * Hv * D, np.float32), arrivals=np.zeros(1, np.uint32), t=T, n_k_heads=Hk, eps=eps,
                v_heads=Hv)
    if q8:
        args.update(oq=np.zeros(T * Hv * D // 4, np.uint32), od=np.zeros(T * Hv * D // 16, np.float32))
    s0, ring0 = args["state"].copy(), args["conv_state"].copy()
    args["conv"] = deltanet_conv_rows_ref(args["mix"].reshape(T, C), conv_w.reshape(C, KC), ring0.reshape(KC, C),
                                          pos).astype(np.float32).reshape(-1)

    def expect(p):
        out, state, ring = deltanet_prefill_ref(
            args["mix"].reshape(T, C), conv_w.reshape(C, KC), ring0.reshape(KC, C), pos,
            args["z"].reshape(T, -1), args["ba"].reshape(T, -1), args["ssm_a"], args["dt_bias"], args["norm_w"],
            s0.reshape(Hv, D, D), Hk, eps)
        q8_out = {"od": (inputs.q8_1_scales(out), 1e-4)} if q8 else {}
        return {"out": (out.reshape(-1), 1e-4), **q8_out, "state": (state.reshape(-1), 1e-5),
                "conv_state": (ring.reshape(-1), 0), "arrivals": (np.zeros(1), 0)}
    return zdsl.Example(args, expect, lambda n: {"state": inputs.copies(args["state"], n)})
