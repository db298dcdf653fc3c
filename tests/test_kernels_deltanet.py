"""The fused delta-net decode step (the gate projections β and α, conv + silu + ring update, then
the gated delta rule and the gated norm) against numpy (float64) in the interpreter (every
subgroup size) and on lavapipe (its own): random shapes, thread layouts, gate weight types (every
type with a GPU decoder, dequantized by gguf-py), states and positions (the conv ring before, at
and after its first wrap, and far out), rings of several slots (conv_slots ≥ KC, state_slots ≥ 1),
the model's shape, several tokens in a row from zero states against the model reference's conv,
`deltanet_recurrent` and gated norm, and a run of steps cut back by position (every state it
passed through in its slot, and a step from any of them as from a sequence that stopped there).
The prompt's kernels (a chunk's conv rows with q and k normalised, the delta rule by state
columns, the gated norm rows) each against its float64 reference and together against as many
decode steps, and a prompt in chunks then decode steps against the model reference. Tolerances:
f32 to ~1e-5 relative; the conv ring only moves values, so it must match exactly."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zdsl.kernels import inputs
from zdsl.kernels import deltanet as dn
from zdsl.kernels import dmmv
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values
from zdsl.kernels.quant import FORMATS
from zdsl.models.qwen35.model import reference as model
from budget import THOROUGH, examples
from kernel_testing import BACKENDS, assert_example_holds, assert_q8_1_of, run, subgroup, tile_sizes

EPS = 1e-6
# before the ring is full (0, 1, 2), its first wrap (3 → slot 3, 5 → slot 1), a long context and
# the last u32 position (the slot arithmetic must not overflow)
POSITIONS = [0, 1, 2, 3, 5, 262_141, 2**32 - 1]


def subgroup_sizes(backend, request):
    return [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]


def step(backend, request, x, state, pos, n_k_heads, wg, sg, rows=1, row=0, tokens=4):
    """x: the step's inputs (mix, conv_w (C, KC), conv_state (conv_slots, C), z, w_ba, x, qtype,
    ssm_a, dt_bias, norm_w; mix, z, x, xq, xd `rows` rows of them, from row `row` of buffers whose
    rows before it are NaN); state: the ring (state_slots, Hv, D, D); tokens: how many a block of
    a launch of several takes at once (on lavapipe the kernel's own, tile_sizes)."""
    slots, Hv, D = state.shape[:3]
    x = dict(x)
    qtype = x.pop("qtype")
    KC, conv_slots = x["conv_w"].shape[1], x["conv_state"].shape[0]
    words = np.zeros(8, np.uint32)
    words[0], words[1] = pos, (pos + 1) % 2**32
    for name in ("mix", "z", "x", "xq", "xd"):  # the rows before `row` NaN (not read)
        given = np.asarray(x[name]).reshape(rows, -1)
        unread = np.full((row, given.shape[1]), np.nan if given.dtype.kind == "f" else 0xFFFFFFFF, given.dtype)
        x[name] = np.concatenate([unread, given])
        x[name] = x[name].reshape(-1)
    args = dict(x, conv_w=x["conv_w"].reshape(-1), conv_state=x["conv_state"].reshape(-1))
    n = (row + rows) * Hv * D
    q8 = D % 32 == 0  # the output also as Q8_1 where it is whole blocks
    q8_out = dict(oq=np.zeros(n // 4, np.uint32), od=np.full(n // 16, np.nan, np.float32)) if q8 else {}
    v = dn.deltanet_step.specialize(D=D, KC=KC, WG=wg, Q8=q8, QTYPE=qtype, MANY=rows > 1, SG=sg,
                                    **tile_sizes(dn.deltanet_step, backend, TOKENS=tokens))
    out = run(v, backend, request, Hv, **args,
              step=words, state=state.reshape(-1), out=np.full(n, np.nan, np.float32), n_k_heads=n_k_heads,
              k=len(x["x"]) // (row + rows), eps=EPS, conv_slots=conv_slots, state_slots=slots, row=row, rows=rows,
              **q8_out)
    if q8:
        at = row * Hv * D
        assert_q8_1_of(out["oq"][at // 4:], out["od"][at // 16:], out["out"][at:])
    out["out"] = out["out"][row * Hv * D:]
    return out


def step_inputs(rng, Hk, Hv, D, KC=4, mix_scale=1.0, qtype="q8_0", blocks=3, conv_slots=None):
    """Random inputs, a conv ring of conv_slots (default KC) slots; the normed input x has
    `blocks` blocks of the gate weights' type."""
    C = (2 * Hk + Hv) * D
    hidden = FORMATS[qtype].block * blocks
    x = (rng.standard_normal(hidden) / np.sqrt(hidden)).astype(np.float32)
    return dict(mix=(rng.standard_normal(C) * mix_scale).astype(np.float32),
                conv_w=(rng.standard_normal((C, KC)) * 0.7).astype(np.float32),
                conv_state=(rng.standard_normal((conv_slots or KC, C)) * mix_scale).astype(np.float32),
                z=(rng.standard_normal(Hv * D) * 2).astype(np.float32),
                w_ba=inputs.rows(rng, qtype, 2 * Hv, hidden), qtype=qtype,
                **normed(x),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
                dt_bias=rng.standard_normal(Hv, dtype=np.float32),
                norm_w=rng.standard_normal(D, dtype=np.float32))


def normed(x):
    """The normed input as the step reads it: f32, and Q8_1 (for int8 gate types)."""
    xq, xd = q8_1_buffers(x)
    return dict(x=x, xq=xq, xd=xd)


def check(got, x, state, pos, Hk):
    """The step's out, state ring (the slot after pos written, the others as they were) and conv
    ring against the reference."""
    want, want_state, want_ring = dn.deltanet_step_ref(**x, pos=pos, state=state, n_k_heads=Hk, eps=EPS)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(state.shape), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["out"], want, rtol=2e-5, atol=2e-5)


# (D, WG) layouts for lavapipe, whose LLVM takes seconds per new pipeline: one and several rows
# per invocation, a row part smaller than a subgroup, a head dim that is no power of two.
LAVAPIPE_LAYOUTS = [(8, 16), (16, 32), (24, 48), (32, 64)]


# gate weight types drawn on lavapipe (a pipeline compile each); the interpreter draws every type
LAVAPIPE_QTYPES = ["q8_0", "q4_k"]


def step_layout(backend, request, d, rp_log, sg_pick, layout, kc, qtype, seed):
    """(d, wg, sg, kc, qtype) of a drawn deltanet_step launch: in the interpreter the drawn head
    dim split over 2^rp_log row parts, any taps and gate type; on a device one of the few
    LAVAPIPE_LAYOUTS, the model's 4 taps and a LAVAPIPE_QTYPES gate (a pipeline compile each)."""
    sizes = subgroup_sizes(backend, request)
    sg = sizes[sg_pick % len(sizes)]
    if backend == "interp":
        rp = 2 ** rp_log
        wg = d // 4 * rp
        assume(d % rp == 0 and wg % sg == 0 and wg <= 1024)
    else:
        (d, wg), kc = layout, 4
        # the gate type goes with the layout (each pair a pipeline compile), unless thorough
        qtype = LAVAPIPE_QTYPES[(seed if THOROUGH else LAVAPIPE_LAYOUTS.index(layout)) % len(LAVAPIPE_QTYPES)]
        assume(wg % sg == 0)  # a device with larger subgroups (the H100's 32) takes the wider layouts
    assume(wg % FORMATS[qtype].parts == 0)
    return d, wg, sg, kc, qtype


@pytest.mark.parametrize("backend", BACKENDS)
@given(hk=st.integers(1, 3), ratio=st.integers(1, 3), d=st.sampled_from([8, 16, 24, 32, 64]),
       rp_log=st.integers(0, 6), sg_pick=st.integers(0, 3), layout=st.sampled_from(LAVAPIPE_LAYOUTS),
       kc=st.integers(1, 5), pos=st.one_of(st.sampled_from(POSITIONS), st.integers(0, 40)),
       qtype=st.sampled_from(list(FORMATS)), blocks=st.integers(1, 3), state_scale=st.sampled_from([0.0, 0.1, 3.0]),
       mix_scale=st.sampled_from([1e-3, 1.0]), conv_extra=st.integers(0, 7), state_slots=st.integers(1, 5),
       seed=st.integers(0, 99))
def test_step(backend, request, hk, ratio, d, rp_log, sg_pick, layout, kc, pos, qtype, blocks, state_scale, mix_scale,
              conv_extra, state_slots, seed):
    """Value head h reads key head h % n_k_heads; any split of the rows over row parts (RP); any
    number of conv taps (lavapipe: the model's 4) at any position, in a conv ring of KC to KC + 7
    slots and a state ring of 1 to 5 (positions past both wraps; the slots the step does not read
    hold NaN, so a read of a wrong one shows); gates of any weight type and any number of its
    blocks."""
    d, wg, sg, kc, qtype = step_layout(backend, request, d, rp_log, sg_pick, layout, kc, qtype, seed)
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    x = step_inputs(rng, hk, hv, d, kc, mix_scale, qtype, blocks, kc + conv_extra)
    x["conv_state"] = unread_nan(x["conv_state"], pos, kc)
    state = ring_of(rng, state_slots, pos, hv, d, state_scale)
    check(step(backend, request, x, state, pos, hk, wg, sg), x, state, pos, hk)


def ring_of(rng, slots, pos, hv, d, scale):
    """A state ring whose slot pos % slots holds a random state, the others NaN (not to be read)."""
    state = np.full((slots, hv, d, d), np.nan, np.float32)
    state[pos % slots] = rng.standard_normal((hv, d, d)) * scale
    return state


def unread_nan(ring, pos, KC):
    """The conv ring with NaN in every slot but the KC − 1 that position pos's taps read."""
    out = np.full_like(ring, np.nan)
    taps = [(pos - KC + 1 + j) % ring.shape[0] for j in range(KC - 1)]
    out[taps] = ring[taps]
    return out


def row_inputs(rng, x, rows):
    """`rows` tokens' mix, z and normed input x (and its Q8_1 form), drawn like step_inputs' one."""
    C, hidden = len(x["mix"]), len(x["x"])
    xn = (rng.standard_normal((rows, hidden)) / np.sqrt(hidden)).astype(np.float32)
    xq, xd = zip(*[q8_1_buffers(r) for r in xn])
    return dict(mix=rng.standard_normal((rows, C)).astype(np.float32),
                z=(rng.standard_normal((rows, len(x["z"]))) * 2).astype(np.float32), x=xn, xq=np.stack(xq),
                xd=np.stack(xd))


# positions for several rows in a launch: before the rings fill, their wraps, far out, the last
# rows of u32 positions (the slot arithmetic must not overflow)
ROW_POSITIONS = [0, 1, 2, 3, 5, 262_141, 2**32 - 6]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(12))
@given(rows=st.integers(1, 5), hk=st.integers(1, 3), ratio=st.integers(1, 2), rp_log=st.integers(0, 3),
       d=st.sampled_from([8, 16, 32]), sg_pick=st.integers(0, 3), layout=st.sampled_from(LAVAPIPE_LAYOUTS),
       kc=st.integers(1, 5), pos=st.one_of(st.sampled_from(ROW_POSITIONS), st.integers(0, 40)),
       qtype=st.sampled_from(["q8_0", "q4_k", "f32", "q5_0"]), conv_extra=st.integers(0, 4),
       state_slots=st.integers(1, 6), row=st.integers(0, 2), tokens=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 99))
def test_rows(backend, request, rows, hk, ratio, rp_log, d, sg_pick, layout, kc, pos, qtype, conv_extra, state_slots,
              row, tokens, seed):
    """One launch of `rows` tokens of a sequence at positions pos … pos + rows − 1 (from row `row`
    of the buffers) against as many steps of the reference, each from the rings the one before
    left: every row's output, the state after every row in its slot (every slot written, the
    others as they were: NaN), the conv ring (exact). Rings of conv_slots = KC + rows − 1 … + 4
    (the fewest a launch of `rows` needs) and state_slots = 1 … 6 (fewer or more than the rows:
    slots written twice, and in place), at positions past their wraps; the conv slots the
    launch must not read (those of positions ≥ pos among them) NaN. The launch takes `tokens`
    tokens at once (their gates and conv; 1 on a CPU device), then runs the delta rule over them
    in order: fewer rows than that, as many, or a last block cut short."""
    d, wg, sg, kc, qtype = step_layout(backend, request, d, rp_log, sg_pick, layout, kc, qtype, seed)
    k = dn.deltanet_step
    assume(k.constraint(SimpleNamespace(**k.complete(dict(D=d, WG=wg, SG=sg, QTYPE=qtype, MANY=rows > 1, TOKENS=tokens)))))
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    x = step_inputs(rng, hk, hv, d, kc, qtype=qtype, blocks=1, conv_slots=kc + rows - 1 + conv_extra)
    x["conv_state"] = unread_nan(x["conv_state"], pos, kc)
    x.update(row_inputs(rng, x, rows))
    state = ring_of(rng, state_slots, pos, hv, d, 0.5)
    got = step(backend, request, x, state, pos, hk, wg, sg, rows, row, tokens)
    want, want_state, want_ring = dn.deltanet_steps_ref(**x, pos=pos, state=state, n_k_heads=hk, eps=EPS)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(state.shape), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["out"].reshape(rows, -1), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,pos,state_slots,row", [(2, 3, 3, 0), (4, 1001, 5, 1), (5, 2**32 - 6, 1, 2),
                                                      (3, 17, 2, 0)])
def test_rows_as_single_launches(backend, request, rows, pos, state_slots, row):
    """A launch of `rows` tokens leaves what `rows` launches of one row each leave (the rings
    carried from one to the next): the same outputs, states and conv ring, bit for bit (the same
    sums in the same order); 3 key heads, 6 value heads, rings of KC − 1 + rows + 1 conv slots."""
    rng = np.random.default_rng(pos % 1000 + rows)
    hk, hv, d, wg, kc = 3, 6, 32, 64, 4
    sg = [s for s in subgroup_sizes(backend, request) if wg % s == 0][-1]
    x = step_inputs(rng, hk, hv, d, kc, qtype="q4_k", blocks=1, conv_slots=kc + rows)
    x.update(row_inputs(rng, x, rows))
    state = ring_of(rng, state_slots, pos, hv, d, 0.5)
    state[np.isnan(state)] = 7.0  # other slots: written by both, or left as they were by both
    got = step(backend, request, x, state, pos, hk, wg, sg, rows, row)
    ring, ring_state, outs = x["conv_state"], state, []
    for r in range(rows):
        one = dict(x, conv_state=ring, **{n: x[n][r] for n in ("mix", "z", "x", "xq", "xd")})
        s = step(backend, request, one, ring_state, pos + r, hk, wg, sg, 1, row + r)
        ring, ring_state = s["conv_state"].reshape(ring.shape), s["state"].reshape(state.shape)
        outs.append(s["out"])
    np.testing.assert_array_equal(got["conv_state"].reshape(ring.shape), ring)
    np.testing.assert_array_equal(got["state"].reshape(state.shape), ring_state)
    np.testing.assert_array_equal(got["out"].reshape(rows, -1), np.stack(outs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positions,state_slots", [((0, 7, 2**32 - 1), 1), ((5, 5), 3), ((262_141, 2, 40, 1), 2)])
def test_sequences_in_one_launch(backend, request, positions, state_slots):
    """Several sequences of one token each (a batch) in one launch, the grid's z: each at its own
    position (its row of the step values), reading and writing its row of mix, z, x and out and
    its own ring and state (seq_bytes apart in the buffers, as a batch binds each sequence's own
    as the pieces of one) leaves what a launch of that sequence alone leaves, bit for bit."""
    rng = np.random.default_rng(len(positions) + state_slots)
    hk, hv, d, wg, kc, n = 2, 4, 32, 64, 4, len(positions)
    sg = [s for s in subgroup_sizes(backend, request) if wg % s == 0][-1]
    x = step_inputs(rng, hk, hv, d, kc, qtype="q4_k", blocks=1, conv_slots=kc + 1)
    x.update(row_inputs(rng, x, n))
    rings = [(rng.standard_normal(x["conv_state"].shape)).astype(np.float32) for _ in positions]
    states = [ring_of(rng, state_slots, pos, hv, d, 0.5) for pos in positions]
    for state in states:
        state[np.isnan(state)] = 7.0
    alone = [step(backend, request, dict(x, conv_state=ring, **{k: x[k][r] for k in ("mix", "z", "x", "xq", "xd")}),
                  state, pos, hk, wg, sg) for r, (pos, ring, state) in enumerate(zip(positions, rings, states))]
    stride = max(states[0].size, rings[0].size) + 12  # floats between two sequences' (a multiple of 4)

    def packed(parts):
        out = np.full(stride * n, np.nan, np.float32)
        for r, part in enumerate(parts):
            out[r * stride:r * stride + part.size] = part.reshape(-1)
        return out

    words = np.zeros((n, 8), np.uint32)
    words[:, 0] = positions
    words[:, 1] = (np.asarray(positions, np.uint64) + 1) % 2**32
    v = dn.deltanet_step.specialize(D=d, KC=kc, WG=wg, Q8=True, QTYPE="q4_k", MANY=False, SG=sg)
    args = {k: np.asarray(val).reshape(-1) for k, val in x.items() if k not in ("qtype", "conv_state")}
    nout = n * hv * d
    got = run(v, backend, request, (hv, 1, n), **args, conv_state=packed(rings), state=packed(states),
              step=words.reshape(-1),
              out=np.full(nout, np.nan, np.float32), oq=np.zeros(nout // 4, np.uint32),
              od=np.full(nout // 16, np.nan, np.float32), n_k_heads=hk, k=x["x"].shape[1], eps=EPS,
              conv_slots=kc + 1, state_slots=state_slots, seq_bytes=4 * stride)
    for r, one in enumerate(alone):
        at = r * stride
        np.testing.assert_array_equal(got["conv_state"][at:at + rings[r].size], one["conv_state"])
        np.testing.assert_array_equal(got["state"][at:at + states[r].size], one["state"])
        np.testing.assert_array_equal(got["out"][r * hv * d:(r + 1) * hv * d], one["out"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_positions_odd_heads(backend, request, pos):
    """Every listed position with odd head counts (3 key heads, 9 value heads: three workgroups
    read each key head's q and k, one stores them); the slot being written holds stale values,
    which no tap may read. The rings: 4 to 8 conv slots, 1 to 4 state slots (by position)."""
    rng = np.random.default_rng(pos % 1000)
    hk, hv, d, wg = 3, 9, 16, 32
    x = step_inputs(rng, hk, hv, d, conv_slots=4 + pos % 5)
    state = ring_of(rng, 1 + pos % 4, pos, hv, d, 0.5)
    sg = [s for s in subgroup_sizes(backend, request) if wg % s == 0][-1]
    check(step(backend, request, x, state, pos, hk, wg, sg), x, state, pos, hk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_shape(backend, request):
    """16 key heads, 32 value heads of 128 (64 KiB of state each), through every built layout."""
    rng = np.random.default_rng(4)
    x = step_inputs(rng, 16, 32, 128, blocks=64)  # gates of q8_0 rows of 2048
    state = (rng.standard_normal((1, 32, 128, 128)) * 0.5).astype(np.float32)  # the model's rings
    for wg, sg in sorted({(v["WG"], v["SG"]) for v in dn.deltanet_step.space(tuple(subgroup_sizes(backend, request)))}):
        if backend == "interp" and sg in (8, 16):
            continue  # the layouts differ only in the subgroup reduction: 32 and 64 cover it
        check(step(backend, request, x, state, 7, 16, wg, sg), x, state, 7, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_tokens(backend, request):
    """The step for T tokens from zero conv and delta states (positions 0 .. T − 1: the rings
    fill, then wrap; 6 conv slots, 3 state slots), both rings carried, against the model
    reference (conv over the last 4 inputs with zeros before the first, l2norm,
    deltanet_recurrent, gated rmsnorm) token by token."""
    rng = np.random.default_rng(9)
    Hk, Hv, D, T, conv_slots, slots = 3, 6, 16, 9, 6, 3
    C = (2 * Hk + Hv) * D
    sg = subgroup_sizes(backend, request)[-1]
    x = step_inputs(rng, Hk, Hv, D, qtype="q5_k", blocks=1)
    taps = x["conv_w"]
    gates = dmmv.dequant_rows(x["w_ba"], "q5_k", 2 * Hv, 256)
    ring, state = np.zeros((conv_slots, C), np.float32), np.zeros((slots, Hv, D, D), np.float32)
    ref_hist, ref_S = np.zeros((3, C), np.float64), np.zeros((Hv, D, D), np.float64)
    for pos in range(T):
        mix = rng.standard_normal(C, dtype=np.float32)
        z, xn = rng.standard_normal(Hv * D, dtype=np.float32), rng.standard_normal(256, dtype=np.float32) / 16
        s = step(backend, request, dict(x, mix=mix, conv_state=ring, z=z, **normed(xn)), state, pos, Hk, 64, sg)
        b, a = np.split(gates @ q8_1_values(*q8_1_buffers(xn)), 2)  # q5_k: int8 products with Q8_1 x
        ring, state = s["conv_state"].reshape(conv_slots, C), s["state"].reshape(slots, Hv, D, D)

        hist = np.concatenate([ref_hist, mix[None]])
        mixed = model.silu((hist * taps.T).sum(axis=0))
        ref_hist = hist[1:]
        q = model.l2norm(mixed[:Hk * D].reshape(Hk, D), EPS)
        k = model.l2norm(mixed[Hk * D:2 * Hk * D].reshape(Hk, D), EPS)
        v = mixed[2 * Hk * D:].reshape(Hv, D)
        g = x["ssm_a"] * model.softplus(a + x["dt_bias"])
        o = model.deltanet_recurrent(np.tile(q, (Hv // Hk, 1))[None], np.tile(k, (Hv // Hk, 1))[None], v[None],
                                     g[None], model.sigmoid(b)[None], ref_S)[0]
        expect = model.rmsnorm(o, x["norm_w"], EPS) * model.silu(z.reshape(Hv, D))
        np.testing.assert_allclose(state[(pos + 1) % slots], ref_S, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s["out"].reshape(Hv, D), expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p0,tmax,T", [(0, 3, 3), (1001, 5, 5), (70_003, 6, 4)])
def test_cut_back(backend, request, p0, tmax, T):
    """T ≤ Tmax steps of one sequence from p0 (one position each, the rings carried: the same
    buffers) on rings of conv_slots = KC − 1 + Tmax and state_slots = Tmax + 1 leave, for every
    j ≤ T, the state after j of them in slot (p0 + j) % state_slots, and a step at p0 + j on the
    rings as they are after all T gives what the sequence stopped after j steps gives: it is cut
    back by its position alone. Against the reference run on rings of one state slot and KC conv
    slots (other indices); the slots that no step may read start NaN."""
    rng = np.random.default_rng(p0 % 997)
    Hk, Hv, D, KC, wg = 2, 4, 32, 4, 64
    C = (2 * Hk + Hv) * D
    conv_slots, slots = KC - 1 + tmax, tmax + 1
    sg = [s for s in subgroup_sizes(backend, request) if wg % s == 0][-1]
    x = step_inputs(rng, Hk, Hv, D, KC, blocks=1, conv_slots=conv_slots)
    ring = unread_nan(x["conv_state"], p0, KC)
    state = ring_of(rng, slots, p0, Hv, D, 0.5)

    def token():
        xn = (rng.standard_normal(32) / 6).astype(np.float32)
        return dict(mix=rng.standard_normal(C, dtype=np.float32), z=rng.standard_normal(Hv * D, dtype=np.float32) * 2,
                    **normed(xn))

    # the reference: the inputs of positions p0 − KC + 1 … in a KC-slot ring, one state slot
    ref_ring = np.zeros((KC, C), np.float32)
    for q in range(p0 - KC + 1, p0):
        ref_ring[q % KC] = ring[q % conv_slots]
    ref_rings, ref_states = [ref_ring], [state[p0 % slots][None]]
    for j in range(T):
        given = dict(x, **token())
        s = step(backend, request, dict(given, conv_state=ring), state, p0 + j, Hk, wg, sg)
        ring, state = s["conv_state"].reshape(ring.shape), s["state"].reshape(state.shape)
        _, S, r = dn.deltanet_step_ref(**dict(given, conv_state=ref_rings[-1]), pos=p0 + j, state=ref_states[-1],
                                       n_k_heads=Hk, eps=EPS)
        ref_rings.append(r)
        ref_states.append(S)
    for j in range(T + 1):
        np.testing.assert_allclose(state[(p0 + j) % slots], ref_states[j][0], rtol=1e-4, atol=1e-5)
        given = dict(x, **token())
        got = step(backend, request, dict(given, conv_state=ring), state, p0 + j, Hk, wg, sg)
        want, S, _ = dn.deltanet_step_ref(**dict(given, conv_state=ref_rings[j]), pos=p0 + j, state=ref_states[j],
                                          n_k_heads=Hk, eps=EPS)
        np.testing.assert_allclose(got["out"], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["state"].reshape(state.shape)[(p0 + j + 1) % slots], S[0], rtol=1e-4,
                                   atol=1e-5)


# ---- a prompt's chunk: deltanet_conv_rows, the delta rule in blocks (deltanet_chunk_wy, --------
# ---- deltanet_chunk_scan), deltanet_gated_norm ---------------------------------------------

def prefill_inputs(rng, Hk, Hv, D, T, KC=4, extra=0, conv_slots=None):
    """Random chunk inputs, a conv ring of conv_slots (default KC) slots; `extra` rows past the
    chunk are NaN (the kernels must not read them)."""
    C = (2 * Hk + Hv) * D

    def rows(n, scale=1.0):
        a = (rng.standard_normal((T + extra, n)) * scale).astype(np.float32)
        a[T:] = np.nan
        return a
    return dict(mix=rows(C), conv_w=(rng.standard_normal((C, KC)) * 0.7).astype(np.float32),
                conv_state=rng.standard_normal((conv_slots or KC, C), dtype=np.float32), z=rows(Hv * D, 2.0),
                ba=rows(2 * Hv),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
                dt_bias=rng.standard_normal(Hv, dtype=np.float32), norm_w=rng.standard_normal(D, dtype=np.float32))


def conv_rows(backend, request, x, pos, Hk, D, sg, t):
    """deltanet_conv_rows over the first t rows of x's mix (rows past t start NaN in conv)."""
    rows, C = x["mix"].shape
    KC, conv_slots = x["conv_w"].shape[1], x["conv_state"].shape[0]
    if D % sg:
        if backend != "interp":
            pytest.skip(f"heads of {D} channels are narrower than the device's subgroup of {sg}")
        sg = 8
    v = dn.deltanet_conv_rows.specialize(D=D, KC=KC, SG=sg)
    return run(v, backend, request, v.groups(channels=C, t=t), mix=x["mix"].reshape(-1),
               conv_w=x["conv_w"].reshape(-1), conv_state=x["conv_state"].reshape(-1),
               step=inputs.step_words(pos, pos + t), conv=np.full(rows * C, np.nan, np.float32), channels=C,
               n_k_heads=Hk, eps=EPS, conv_slots=conv_slots)["conv"]


def gated_norm(backend, request, o, z, norm_w, sg, q8, halves=False):
    """deltanet_gated_norm of the rows of o (rows, d), their Q8_1 form checked where q8, their f16
    rows (exactly the f32 ones rounded) where halves."""
    rows, d = o.shape
    q8_out = dict(oq=np.zeros(rows * d // 4, np.uint32), od=np.full(rows * d // 16, np.nan, np.float32)) if q8 else {}
    h_out = dict(h=np.full(rows * d, np.nan, np.float16)) if halves else {}
    v = dn.deltanet_gated_norm.specialize(Q8=q8, HALVES=halves, WG=max(32, sg), SG=sg)
    got = run(v, backend, request, rows, o=o.reshape(-1), z=z.reshape(-1), norm_w=norm_w,
              out=np.full(rows * d, np.nan, np.float32), d=d, eps=EPS, **q8_out, **h_out)
    if q8:
        assert_q8_1_of(got["oq"], got["od"], got["out"])
    if halves:
        np.testing.assert_array_equal(got["h"], got["out"].astype(np.float16))
    return got


def prefill(backend, request, x, state, pos, Hk, layout, sg, q8, t=None):
    """The chunk as the graph runs it (x: prefill_inputs; layout: the delta rule's (L, NC, WG)):
    deltanet_conv_rows, deltanet_chunk_wy, deltanet_chunk_scan, then deltanet_gated_norm of the
    first t rows (all by default); state: the ring (state_slots, Hv, D, D). Returns the conv rows,
    the wy entries, raw o, out (and oq, od with q8), the state ring and the conv ring."""
    slots, Hv, D = state.shape[:3]
    rows, C = x["mix"].shape
    t = rows if t is None else t
    L, nc, wg = layout
    if backend != "interp" and not dn._scan_fits(SimpleNamespace(D=D, L=L, NC=nc, WG=wg, SG=sg)):
        pytest.skip(f"deltanet_chunk_scan's layout L={L}, NC={nc}, WG={wg} does not fit the device's subgroup of {sg}")
    conv = conv_rows(backend, request, x, pos, Hk, D, sg, t)
    w = dn.deltanet_chunk_wy.specialize(D=D, L=L, SG=sg)
    u = np.full(rows * Hv * D, np.nan, np.float32)
    wy = run(w, backend, request, w.groups(v_heads=Hv, t=t), conv=conv, ba=x["ba"].reshape(-1), ssm_a=x["ssm_a"],
             dt_bias=x["dt_bias"], wy=np.full(dn.wy_size(t, Hv, L), np.nan, np.float32), u=u, t=t, n_k_heads=Hk)
    v = dn.deltanet_chunk_scan.specialize(D=D, L=L, NC=nc, KC=x["conv_w"].shape[1], WG=wg, SG=sg)
    got = run(v, backend, request, v.groups(v_heads=Hv), conv=conv, wy=wy["wy"], o=wy["u"], state=state.reshape(-1),
              mix=x["mix"].reshape(-1), conv_state=x["conv_state"].reshape(-1), step=inputs.step_words(pos, pos + t),
              t=t, n_k_heads=Hk, conv_slots=x["conv_state"].shape[0], state_slots=slots)
    o = got["o"].reshape(rows, Hv, D)
    assert np.isnan(o[t:]).all()  # rows past t untouched
    normed = gated_norm(backend, request, o[:t].reshape(-1, D), x["z"][:t], x["norm_w"], sg, q8)
    return dict(got, conv=conv.reshape(rows, C), wy=wy["wy"], u=wy["u"].reshape(rows, Hv, D), o=o[:t], L=L,
                **{n: normed[n] for n in ("out", "oq", "od") if n in normed})


def check_prefill(got, x, state, pos, Hk, T):
    """Each kernel against its float64 reference, on the inputs it was given."""
    Hv, D = state.shape[1:3]
    conv = dn.deltanet_conv_rows_ref(x["mix"][:T], x["conv_w"], x["conv_state"], pos, Hk, D, EPS)
    np.testing.assert_allclose(got["conv"][:T], conv, rtol=1e-5, atol=1e-6)
    assert np.isnan(got["conv"][T:]).all()
    wy, U = dn.deltanet_chunk_wy_ref(got["conv"][:T], x["ba"][:T], x["ssm_a"], x["dt_bias"], Hk, D, got["L"])
    np.testing.assert_allclose(got["wy"], wy.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["u"][:T], U, rtol=1e-5, atol=1e-5)
    assert np.isnan(got["u"][T:]).all()
    o, want_state, want_ring = dn.deltanet_chunk_scan_ref(got["conv"][:T], x["mix"][:T], x["conv_state"], pos,
                                                          x["ba"][:T], x["ssm_a"], x["dt_bias"], state, Hk)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(state.shape), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["o"], o, rtol=1e-5, atol=1e-5)
    out = dn.deltanet_gated_norm_ref(got["o"], x["z"][:T].reshape(T, Hv, D), x["norm_w"], EPS)
    np.testing.assert_allclose(got["out"].reshape(out.shape), out, rtol=2e-5, atol=2e-5)


def steps(backend, request, x, state, pos, Hk, wg, sg, T):
    """The same chunk as T deltanet_step dispatches (wg invocations each), the rings carried: the
    gates come from f32 rows that pick ba's entries exactly (identity weights, input = the token's
    ba row, zero-padded to one 32-value block)."""
    Hv = state.shape[1]
    w_ba = np.eye(2 * Hv, 32, dtype=np.float32).reshape(-1).view(np.uint8)
    ring, outs = x["conv_state"], []
    for i in range(T):
        xn = np.zeros(32, np.float32)
        xn[:2 * Hv] = x["ba"][i]
        given = dict(mix=x["mix"][i], conv_w=x["conv_w"], conv_state=ring, z=x["z"][i], w_ba=w_ba, qtype="f32",
                     **normed(xn), ssm_a=x["ssm_a"], dt_bias=x["dt_bias"], norm_w=x["norm_w"])
        s = step(backend, request, given, state, pos + i, Hk, wg, sg)
        ring, state = s["conv_state"].reshape(ring.shape), s["state"].reshape(state.shape)
        outs.append(s["out"])
    return np.stack(outs), state, ring


def block_layout(backend, request, d, pick):
    """(D, (L, NC, WG), SG) for the delta rule's kernels: in the interpreter any that fits head
    dim d (blocks of 4 to 16 tokens, every subgroup size that has one), on a device one of
    BLOCK_LAYOUTS that fits its subgroup."""
    if backend == "interp":
        fitting = [(d, L, nc, wg, sg) for sg in subgroup_sizes(backend, request) for L in (4, 8, 12, 16)
                   for nc in (4, 8, 12, 16, 24, 32) for wg in (sg, 2 * sg, 4 * sg)
                   if dn._scan_fits(SimpleNamespace(D=d, L=L, NC=nc, WG=wg, SG=sg))]
    else:
        sg = subgroup(backend, request, 0)
        fitting = [(*x, sg) for x in BLOCK_LAYOUTS if dn._scan_fits(SimpleNamespace(D=x[0], L=x[1], NC=x[2], WG=x[3],
                                                                                     SG=sg))]
    d, L, nc, wg, sg = fitting[pick % len(fitting)]
    return d, (L, nc, wg), sg


PREFILL_POSITIONS = [0, 1, 3, 5, 1001, 2**32 - 32]  # an empty ring, one filling, wrapped, far out, near the u32 end
# (D, L, NC, WG) on a device: blocks of 4 to 32 tokens; 1 to 4 workgroups a head; a head dim that
# is no power of two; 1, 2 or 4 token rows an invocation; the first four for subgroups of 8 (lavapipe),
# the last three for 32 and 64
BLOCK_LAYOUTS = [(16, 8, 4, 8), (32, 16, 8, 16), (24, 8, 12, 24), (16, 4, 16, 16),
                 (16, 8, 16, 32), (32, 16, 32, 64), (64, 32, 64, 128)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(hk=st.integers(1, 2), ratio=st.integers(1, 3), T=st.integers(1, 19), d=st.sampled_from([8, 16, 24, 32]),
       pick=st.integers(0, 999), kc=st.integers(1, 5), pos=st.sampled_from(PREFILL_POSITIONS), q8=st.booleans(),
       extra=st.integers(0, 2), state_scale=st.sampled_from([0.0, 0.5]), conv_extra=st.integers(0, 7),
       state_slots=st.integers(1, 5), seed=st.integers(0, 99))
def test_prefill(backend, request, hk, ratio, T, d, pick, kc, pos, q8, extra, state_scale, conv_extra, state_slots,
                 seed):
    """A chunk of T tokens (1, odd, more than the conv's taps) through the four kernels, each
    against its float64 reference, and the whole against T deltanet_step dispatches (out rows,
    the state after the last token, the conv ring): n_k_heads · ratio value heads, so up to three
    value heads read each key head's q and k; blocks of 4 to 16 tokens, so up to five of them and
    a last one part full (its tokens past t change nothing); any split of a head's columns over
    workgroups and of a block's rows over invocations; rows past t (NaN) neither read nor written;
    rings of KC to KC + 7 conv slots and 1 to 5 state slots, the slots not to be read NaN."""
    d, layout, sg = block_layout(backend, request, d, pick)
    if backend == "lavapipe":
        kc = 4
    q8 = q8 and d % 32 == 0
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    x = prefill_inputs(rng, hk, hv, d, T, kc, extra, kc + conv_extra)
    x["conv_state"] = unread_nan(x["conv_state"], pos, kc)
    state = ring_of(rng, state_slots, pos, hv, d, state_scale)
    got = prefill(backend, request, x, state, pos, hk, layout, sg, q8, T)
    check_prefill(got, x, state, pos, hk, T)
    out, want_state, want_ring = steps(backend, request, x, state, pos, hk, 2 * d, subgroup(backend, request, 0), T)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    last = (pos + T) % state_slots  # the steps leave the states before it in the other slots
    np.testing.assert_allclose(got["state"].reshape(want_state.shape)[last], want_state[last], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["out"].reshape(T, -1), out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_long_chunk(backend, request):
    """301 tokens (19 blocks of 16, the ring written by the grid's later invocations too) with 3
    key heads and 6 value heads, from a far position, against the float64 references; rings of
    11 conv slots and 3 state slots (the state read from one, written to another)."""
    rng = np.random.default_rng(3)
    hk, hv, d, T = 3, 6, 16, 301
    sg = subgroup(backend, request, 0)
    x = prefill_inputs(rng, hk, hv, d, T, extra=1, conv_slots=11)
    x["conv_state"] = unread_nan(x["conv_state"], 70_001, 4)
    state = ring_of(rng, 3, 70_001, hv, d, 0.5)
    got = prefill(backend, request, x, state, 70_001, hk, (16, 8, 16), sg, False, T)
    check_prefill(got, x, state, 70_001, hk, T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_chunks_then_decode(backend, request):
    """A prompt from zero states in chunks of 1 (at p0 = 0), 5 and 2 (starting on rings the earlier
    chunks filled), then decode steps, on the model's rings (KC conv slots, one state slot):
    every output row, the final delta state and ring against the model reference (conv over the
    last 4 inputs with zeros before the first, l2norm, deltanet_recurrent, gated rmsnorm) run
    over the whole sequence."""
    rng = np.random.default_rng(11)
    Hk, Hv, D, KC = 2, 4, 32, 4
    C = (2 * Hk + Hv) * D
    sg = subgroup(backend, request, 2)
    x = prefill_inputs(rng, Hk, Hv, D, 10)
    ring, state = np.zeros((KC, C), np.float32), np.zeros((1, Hv, D, D), np.float32)
    outs, pos = [], 0
    for T in (1, 5, 2):
        chunk = dict(x, mix=x["mix"][pos:pos + T], z=x["z"][pos:pos + T], ba=x["ba"][pos:pos + T], conv_state=ring)
        got = prefill(backend, request, chunk, state, pos, Hk, (4, 32, 32), sg, True)
        ring, state = got["conv_state"].reshape(KC, C), got["state"].reshape(1, Hv, D, D)
        outs.append(got["out"].reshape(T, -1))
        pos += T
    tail = dict(x, mix=x["mix"][pos:], z=x["z"][pos:], ba=x["ba"][pos:], conv_state=ring)
    out, state, ring = steps(backend, request, tail, state, pos, Hk, 64, sg, 10 - pos)
    outs.append(out)

    taps = x["conv_w"].astype(np.float64)
    hist = np.concatenate([np.zeros((KC - 1, C)), x["mix"]])
    mixed = model.silu(sum(hist[j:j + 10] * taps[:, j] for j in range(KC)))
    heads = np.arange(Hv) % Hk
    q = model.l2norm(mixed[:, :Hk * D].reshape(10, Hk, D), EPS)[:, heads]
    k = model.l2norm(mixed[:, Hk * D:2 * Hk * D].reshape(10, Hk, D), EPS)[:, heads]
    v = mixed[:, 2 * Hk * D:].reshape(10, Hv, D)
    b, a = x["ba"][:, :Hv].astype(np.float64), x["ba"][:, Hv:].astype(np.float64)
    ref_S = np.zeros((Hv, D, D))
    o = model.deltanet_recurrent(q, k, v, x["ssm_a"] * model.softplus(a + x["dt_bias"]), model.sigmoid(b), ref_S)
    expect = model.rmsnorm(o, x["norm_w"], EPS) * model.silu(x["z"].reshape(10, Hv, D))
    np.testing.assert_allclose(np.concatenate(outs).reshape(10, Hv, D), expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state[0], ref_S, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ring, x["mix"][[8, 9, 6, 7]])  # slot p % 4 holds position p's input


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 9), d=st.sampled_from([4, 8, 24, 32, 128]), q8=st.booleans(), halves=st.booleans(),
       sg_pick=st.integers(0, 3), scale=st.sampled_from([0.0, 1e-3, 1.0]), seed=st.integers(0, 99))
def test_gated_norm(backend, request, rows, d, q8, halves, sg_pick, scale, seed):
    """Rows of any multiple of 4 values (of 32 with Q8_1), fewer or more than the workgroup's
    invocations hold, with or without their f16 copy; o = 0 gives 0 (eps)."""
    q8 = q8 and d % 32 == 0
    rng = np.random.default_rng(seed)
    o = (rng.standard_normal((rows, d)) * scale).astype(np.float32)
    z, norm_w = (rng.standard_normal((rows, d)) * 2).astype(np.float32), rng.standard_normal(d, dtype=np.float32)
    got = gated_norm(backend, request, o, z, norm_w, subgroup(backend, request, sg_pick), q8, halves)
    np.testing.assert_allclose(got["out"].reshape(rows, d), dn.deltanet_gated_norm_ref(o, z, norm_w, EPS),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernel,args", [
    (dn.deltanet_step, dict(mix=4 * 1024, conv_w=1024 * 4, conv_state=7 * 1024, step=8, z=4 * 512, w_ba=8 * 256,
                            x=4 * 256, xq=4 * 64, xd=4 * 16, ssm_a=4, dt_bias=4, norm_w=128, state=4 * 4 * 128 * 128,
                            out=4 * 512, oq=4 * 128, od=4 * 32, n_k_heads=2, k=256, eps=EPS, conv_slots=7,
                            state_slots=4, rows=4, v_heads=4, D=128, KC=4, Q8=True, QTYPE="q4_k", MANY=True)),
    (dn.deltanet_conv_rows, dict(mix=3 * 1024, conv_w=1024 * 4, conv_state=4 * 1024, step=8, conv=3 * 1024,
                                 channels=1024, n_k_heads=2, eps=EPS, conv_slots=4, t=3, D=128, KC=4)),
    (dn.deltanet_chunk_wy, dict(conv=70 * 1024, ba=70 * 8, ssm_a=4, dt_bias=4, wy=dn.wy_size(70, 4, 64),
                                u=70 * 4 * 128, t=70, n_k_heads=2, v_heads=4, D=128, L=64, SG=16)),
    (dn.deltanet_chunk_scan, dict(conv=70 * 1024, wy=dn.wy_size(70, 4, 64), o=70 * 4 * 128, state=4 * 128 * 128,
                                  mix=70 * 1024, conv_state=4 * 1024, step=8, t=70, n_k_heads=2, conv_slots=4,
                                  state_slots=1, v_heads=4, D=128, L=64, KC=4, SG=16)),
    (dn.deltanet_gated_norm, dict(o=3 * 512, z=3 * 512, norm_w=128, out=3 * 512, oq=3 * 128, od=3 * 32, d=128,
                                  eps=EPS, rows=12, Q8=True))])
def test_examples(kernel, args):
    """The inputs the tuner and the benches build for a recorded launch give what its example expects."""
    assert_example_holds(kernel, args)
