"""One tuning problem per kernel use: random inputs, the dispatches, the numpy reference to
check a candidate against, and the bytes a run moves.

`case(use, rng, check=True)` is a small version of the use (fewer rows, experts, context) whose
reference is cheap; the kernel code paths do not depend on those sizes, only the tuned
parameters do. `case(use, rng, check=False)` is the full use, as the decode graph dispatches it;
its `rotate(n)` gives n copies of the big inputs (or other experts to route to) to take turns
between timed dispatches so that caches do not flatter small shapes. References are the
kernels' own (`KernelDef.ref`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from zdsl.bench_kernels import synthetic_rows
from zdsl.kernels import attention, deltanet, dmmv, dmmv_q8, moe, q8_1, sampling
from zdsl.kernels.quant import FORMATS
from zdsl.lang.kernel import Variant
from zdsl.lang.language import cdiv

from .workload import Use

CHECK_ROWS = 45      # output rows of a check case: not a multiple of any ROWS, so tails are covered
CHECK_CTX = 300      # context of an attention check case (a few splits of 64 rows)
CHECK_VOCAB = 5000   # vocabulary of a sampling check case (two or more candidate groups)
STEP_WORDS = 8       # the decode graph's step buffer


@dataclass
class Step:
    """One dispatch: its variant for the tuned parameters, its grid, and (for all but the first
    step, whose traffic is the case's) the bytes it moves for the given parameters."""
    variant: Callable[[dict], Variant]
    groups: Callable[[Variant], object]
    nbytes: Callable[[dict], float] | None = None


@dataclass
class Case:
    steps: list[Step]
    arrays: dict[str, np.ndarray]            # buffers, by kernel parameter name (shared between steps)
    scalars: dict[str, object]               # push constants, by name
    bytes: int                               # memory traffic of one run (what a bandwidth bound divides)
    expect: Callable[[dict], dict] | None = None  # params → {buffer: (reference, tolerance)}; check cases
    rotate: Callable[[int], dict] = lambda n: {}  # n → {buffer: n − 1 more arrays that take turns with it}


def close(got: np.ndarray, want: np.ndarray, tol: float) -> str | None:
    """None when got matches want within tol times want's largest magnitude (tol 0: exactly;
    NaN in want: any value); else what is wrong, in a few words."""
    got = np.asarray(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return f"{got.size} values, expected {want.size}"
    care = ~np.isnan(want) if want.dtype.kind == "f" else np.ones(want.size, bool)
    g, w = got[care].astype(np.float64), want[care].astype(np.float64)
    if tol == 0:
        bad = np.flatnonzero(g != w)
        return None if not bad.size else f"{bad.size} of {w.size} values differ"
    if not np.isfinite(g).all():
        return f"{int((~np.isfinite(g)).sum())} non-finite values"
    err = np.abs(g - w)
    allowed = tol * (float(np.abs(w).max()) if w.size else 0.0)
    if err.size and err.max() > allowed:
        return f"max error {err.max():.3g} (allowed {allowed:.3g})"
    return None


def case(use: Use, rng: np.random.Generator, check: bool) -> Case:
    return BUILDERS[use.kernel.name](use, rng, check)


def companions(use: Use, params: dict) -> list[tuple[str, dict, dict]]:
    """Database entries the choice of `params` implies for kernels dispatched with it:
    (kernel, key, params). The sampler's draw runs with the candidate pass's WG and R."""
    if use.kernel is sampling.sample_candidates:
        key = {**use.shape, "CAP": params["CAP"], "WG": params["WG"], "R": params["R"]}
        return [("sample_draw", key, {"SG": params["SG"]})]
    return []


# -- helpers ---------------------------------------------------------------------------------------

def _normal(rng, n, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


def _rows(rng, qtype, rows, k):
    return synthetic_rows(rng, qtype, rows, k).reshape(-1)


def _normed(rng, k):
    """A normed input as the graph writes it: f32, and its Q8_1 buffers."""
    x = _normal(rng, k)
    return (x, *q8_1.q8_1_buffers(x))


def _row_bytes(qtype, k):
    f = FORMATS[qtype]
    return k // f.block * f.nbytes


def _one(use: Use, groups) -> list[Step]:
    return [Step(lambda p: use.kernel.specialize(**p), groups)]


def _rows_grid(m):
    return lambda v: cdiv(m, dmmv.rows_per_workgroup(v))


def _copies(array, n):
    """The same bytes n − 1 more times (each upload lands at its own address)."""
    return [array] * (n - 1)


def _total(arrays) -> int:
    return sum(a.nbytes for a in arrays.values())


# -- the matrix-vector family -----------------------------------------------------------------------

def _dmmv(use, rng, check):
    q, k, m = use.shape["QTYPE"], use.shape["k"], use.shape["m"]
    m = min(m, CHECK_ROWS) if check else m
    add = use.fixed.get("ADD", False)
    a = dict(w=_rows(rng, q, m, k), x=_normal(rng, k), y=_normal(rng, m) if add else np.zeros(m, np.float32))
    y0 = a["y"].copy()
    expect = (lambda p: {"y": (dmmv.dmmv_ref(a["w"], a["x"], q, m, k, y0 if add else None), 1e-4)}) if check else None
    return Case(_one(use, _rows_grid(m)), a, dict(k=k, m=m), _total(a) + (a["y"].nbytes if add else 0), expect,
                lambda n: {"w": _copies(a["w"], n)})


def _scales(x) -> np.ndarray:
    """The Q8_1 scale pairs a kernel writes for x, to check against: d as the kernels compute it,
    s unchecked (NaN). The quants themselves may differ from numpy's by a step where a value
    sits on a rounding half; the scales may not."""
    d = q8_1.q8_1_ref(x)[1].reshape(-1)
    return np.stack([d, np.full(d.size, np.nan, np.float32)], axis=1).reshape(-1)


def _dmmv_q8(use, rng, check):
    q, k, m = use.shape["QTYPE"], use.shape["k"], use.shape["m"]
    m = min(m, CHECK_ROWS) if check else m
    add = use.fixed.get("ADD", False)
    xq, xd = q8_1.q8_1_buffers(_normal(rng, k))
    a = dict(w=_rows(rng, q, m, k), xq=xq, xd=xd, y=_normal(rng, m) if add else np.zeros(m, np.float32))
    y0 = a["y"].copy()

    def expect(p):
        return {"y": (dmmv_q8.dmmv_q8_ref(a["w"], xq, xd, q, m, k, y0 if add else None), 1e-4)}
    return Case(_one(use, _rows_grid(m)), a, dict(k=k, m=m), _total(a) + (a["y"].nbytes if add else 0),
                expect if check else None, lambda n: {"w": _copies(a["w"], n)})


def _dmmv_q8_pair(use, rng, check):
    q, q2, k, m, m2 = (use.shape[n] for n in ("QTYPE", "QTYPE2", "k", "m", "m2"))
    m, m2 = (min(m, CHECK_ROWS), min(m2, CHECK_ROWS - 2)) if check else (m, m2)  # two counts: the split shows
    xq, xd = q8_1.q8_1_buffers(_normal(rng, k))
    a = dict(w=_rows(rng, q, m, k), w2=_rows(rng, q2, m2, k), xq=xq, xd=xd, y=np.zeros(m, np.float32),
             y2=np.zeros(m2, np.float32))

    def expect(p):
        y, y2 = dmmv_q8.dmmv_q8_pair_ref(a["w"], a["w2"], xq, xd, q, q2, m, m2, k)
        return {"y": (y, 1e-4), "y2": (y2, 1e-4)}
    grid = lambda v: cdiv(m, dmmv.rows_per_workgroup(v)) + cdiv(m2, dmmv.rows_per_workgroup(v))  # noqa: E731
    return Case(_one(use, grid), a, dict(k=k, m=m, m2=m2), _total(a), expect if check else None,
                lambda n: {"w": _copies(a["w"], n), "w2": _copies(a["w2"], n)})


def _norm_q8_1(use, rng, check):
    n, eps = use.shape["n"], use.sizes["eps"]
    a = dict(x=_normal(rng, n, 3.0), norm_w=rng.uniform(0.5, 1.5, n).astype(np.float32), hn=np.zeros(n, np.float32),
             xq=np.zeros(n // 4, np.uint32), xd=np.zeros(n // 16, np.float32))
    def expect(p):  # hn to rounding, and its Q8_1 scales
        hn = q8_1.norm_q8_1_ref(a["x"], a["norm_w"], eps)[0]
        return {"hn": (hn, 1e-4), "xd": (_scales(hn), 1e-4)}
    return Case(_one(use, lambda v: 1), a, dict(n=n, eps=eps), _total(a) + a["x"].nbytes, expect if check else None)


def _ffn_gate_up(use, rng, check):
    """ffn_gate_up and ffn_gate_up_q8: a dense pair (1 slot) or experts picked from the stacks
    (the shared expert is one of them)."""
    q, k, m, slots = use.shape["QTYPE"], use.shape["k"], use.shape["m"], use.shape["slots"]
    m = min(m, CHECK_ROWS) if check else m
    experts = use.fixed["EXPERTS"]
    n_exp = use.sizes["experts"]
    n_exp = min(n_exp, 2 * slots + 1) if check and experts else n_exp
    x = _normal(rng, k)
    a = dict(wg=_rows(rng, q, n_exp * m, k), wu=_rows(rng, q, n_exp * m, k),
             ids=rng.permutation(n_exp)[:slots].astype(np.uint32), act=np.zeros(slots * m, np.float32))
    int8 = use.kernel is dmmv_q8.ffn_gate_up_q8
    if int8:
        a["xq"], a["xd"] = q8_1.q8_1_buffers(x)
    else:
        a["x"] = x

    def expect(p):
        if int8:
            want = dmmv_q8.ffn_gate_up_q8_ref(a["wg"], a["wu"], a["ids"], a["xq"], a["xd"], q, m, k, experts)
        else:
            want = dmmv.ffn_gate_up_ref(a["wg"], a["wu"], a["ids"], x, q, m, k, experts)
        return {"act": (want, 2e-4)}
    read = 2 * slots * m * _row_bytes(q, k)

    def rotate(n):
        if experts:
            return {"ids": [rng.permutation(n_exp)[:slots].astype(np.uint32) for _ in range(n - 1)]}
        return {"wg": _copies(a["wg"], n), "wu": _copies(a["wu"], n)}
    x_bytes = a["xq"].nbytes + a["xd"].nbytes if int8 else 4 * k
    return Case(_one(use, lambda v: (cdiv(m, dmmv.rows_per_workgroup(v)), slots)), a, dict(k=k, m=m),
                read + x_bytes + 4 * slots * m, expect if check else None, rotate)


def _moe_down(use, rng, check):
    q, k, m = use.shape["QTYPE"], use.shape["k"], use.shape["m"]
    m = min(m, CHECK_ROWS) if check else m
    n_exp, slots = use.sizes["experts"], use.sizes["slots"]
    n_exp = min(n_exp, 2 * slots + 1) if check else n_exp
    a = dict(w=_rows(rng, q, n_exp * m, k), ids=rng.permutation(n_exp)[:slots].astype(np.uint32),
             weights=rng.uniform(0.05, 0.5, slots).astype(np.float32), act=_normal(rng, slots * k),
             y=_normal(rng, m))
    y0 = a["y"].copy()

    def expect(p):
        return {"y": (dmmv.moe_down_ref(a["w"], a["ids"], a["weights"], a["act"], q, m, k, y0), 1e-4)}
    def rotate(n):
        return {"ids": [rng.permutation(n_exp)[:slots].astype(np.uint32) for _ in range(n - 1)]}
    return Case(_one(use, _rows_grid(m)), a, dict(k=k, m=m, slots=slots),
                slots * (m * _row_bytes(q, k) + 4 * k) + 8 * m, expect if check else None, rotate)


def _moe_router(use, rng, check):
    q, k, n_exp, K = use.shape["QTYPE"], use.shape["k"], use.shape["n_expert"], use.fixed["K"]
    n_exp = min(n_exp, CHECK_ROWS) if check else n_exp
    eps = use.sizes["eps"]
    a = dict(w=_rows(rng, q, n_exp + 1, k), x=_normal(rng, k, 3.0),  # row n_exp: the shared expert's gate
             norm_w=_normal(rng, k), hn=np.zeros(k, np.float32), xq=np.zeros(k // 4, np.uint32),
             xd=np.zeros(k // 16, np.float32), logits=np.zeros(n_exp + 1, np.float32), arrivals=np.zeros(1, np.uint32),
             ids=np.zeros(K + 1, np.uint32), weights=np.zeros(K + 1, np.float32))

    def reference():
        return moe.moe_router_ref(a["w"], a["x"], a["norm_w"], eps, q, n_exp, k, K)
    while check and not _clear_picks(reference()[1][:n_exp], K):  # the ids are checked exactly: no near ties
        a["x"] = _normal(rng, k, 3.0)

    def expect(p):
        hn, logits, ids, weights = reference()
        return {"hn": (hn, 1e-4), "xd": (_scales(hn), 1e-4), "logits": (logits, 1e-4), "ids": (ids, 0),
                "weights": (weights, 1e-4), "arrivals": (np.zeros(1), 0)}
    return Case(_one(use, _rows_grid(n_exp + 1)), a, dict(k=k, n_expert=n_exp, eps=eps), _total(a) + a["logits"].nbytes,
                expect if check else None, lambda n: {"w": _copies(a["w"], n)})


def _clear_picks(logits, K) -> bool:
    """Whether the K + 1 largest logits are further apart than rounding moves them."""
    top = np.sort(logits)[::-1][:K + 1]
    return bool(np.all(-np.diff(top) > 1e-3 * np.abs(logits).max()))


def _moe_down_all(use, rng, check):
    """The shared expert appended to the experts' stack (QTYPE_SH empty), or apart in its own type."""
    q, k, m, K = use.shape["QTYPE"], use.shape["k"], use.shape["m"], use.fixed["K"]
    apart = use.fixed["QTYPE_SH"] or None
    m = min(m, CHECK_ROWS) if check else m
    n_exp = min(use.sizes["experts"], K + 4) if check else use.sizes["experts"]
    slots = K if apart else K + 1  # the experts the stack serves
    a = dict(w=_rows(rng, q, n_exp * m, k), w_sh=_rows(rng, apart, m, k) if apart else np.zeros(16, np.uint8),
             ids=rng.permutation(n_exp)[:K + 1].astype(np.uint32), weights=rng.uniform(0.05, 0.5, K + 1).astype(np.float32),
             act=_normal(rng, (K + 1) * k), y=_normal(rng, m))
    y0 = a["y"].copy()

    def expect(p):
        want = dmmv.moe_down_all_ref(a["w"], a["w_sh"] if apart else None, a["ids"][:slots], a["weights"], a["act"],
                                     y0, q, m, k, apart)
        return {"y": (want, 1e-4)}
    read = slots * m * _row_bytes(q, k) + (m * _row_bytes(apart, k) if apart else 0) + 4 * (K + 1) * (k + 2)
    return Case(_one(use, _rows_grid(m)), a, dict(k=k, m=m), read + 8 * m, expect if check else None,
                lambda n: {"ids": [rng.permutation(n_exp)[:K + 1].astype(np.uint32) for _ in range(n - 1)]})


# -- norms, attention, delta-net ----------------------------------------------------------------------

def _step_words(pos: int, length: int, counter: int = 0) -> np.ndarray:
    s = np.zeros(STEP_WORDS, np.uint32)
    s[0], s[1], s[3] = pos, length, counter
    return s


def _cache(rng, ctx, n_kv, d):
    return (rng.standard_normal(ctx * n_kv * d)).astype(np.float16)


def _attn_prep(use, rng, check):
    s = use.sizes
    nh, nkv, d = s["n_head"], s["n_kv"], s["d"]
    ctx = min(s["ctx"], CHECK_CTX) if check else s["ctx"]
    pos = ctx - 1
    a = dict(qg=_normal(rng, nh * 2 * d), k=_normal(rng, nkv * d), v=_normal(rng, nkv * d),
             q_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), k_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
             step=_step_words(pos, pos + 1), q=np.zeros(nh * d, np.float32),
             k_cache=_cache(rng, ctx, nkv, d), v_cache=_cache(rng, ctx, nkv, d))
    sc = dict(n_head=nh, n_kv=nkv, d=d, rope_dims=s["rope_dims"], rope_base=s["rope_base"], eps=s["eps"])

    def expect(p):
        q, kc, vc = attention.attn_prep_ref(a["qg"].reshape(nh, 2 * d), a["k"].reshape(nkv, d), a["v"].reshape(nkv, d),
                                            a["q_norm"], a["k_norm"], a["k_cache"].reshape(ctx, nkv, d),
                                            a["v_cache"].reshape(ctx, nkv, d), pos, s["rope_dims"], s["rope_base"],
                                            s["eps"])
        return {"q": (q, 1e-4), "k_cache": (kc.astype(np.float32), 2e-3), "v_cache": (vc.astype(np.float32), 1e-3)}
    moved = 4 * (nh * 3 * d + 2 * nkv * d + 2 * d) + 2 * 2 * nkv * d
    return Case(_one(use, lambda v: nh + nkv), a, sc, moved, expect if check else None)


def _attn_decode(use, rng, check):
    s = use.sizes
    nkv, D, G = s["n_kv"], use.fixed["D"], use.fixed["G"]
    nh = nkv * G
    ctx, nsplit, min_chunk = (CHECK_CTX, cdiv(CHECK_CTX, s["min_chunk"]), s["min_chunk"]) if check else \
        (s["ctx"], s["nsplit"], s["min_chunk"])
    a = dict(q=_normal(rng, nh * D), k_cache=_cache(rng, ctx, nkv, D), v_cache=_cache(rng, ctx, nkv, D),
             step=_step_words(ctx - 1, ctx), part=np.zeros(nh * nsplit * (D + 2), np.float32))

    def expect(p):
        want = attention.attn_decode_ref(a["q"].reshape(nh, D), a["k_cache"].reshape(ctx, nkv, D),
                                         a["v_cache"].reshape(ctx, nkv, D), ctx, nsplit, min_chunk)
        return {"part": (want, 1e-4)}  # NaN where a split is not in use
    moved = a["k_cache"].nbytes + a["v_cache"].nbytes + a["q"].nbytes + a["part"].nbytes
    return Case(_one(use, lambda v: (nsplit, nkv)), a, dict(n_kv=nkv, min_chunk=min_chunk), moved,
                expect if check else None,
                lambda n: {"k_cache": _copies(a["k_cache"], n), "v_cache": _copies(a["v_cache"], n)})


def _attn_combine(use, rng, check):
    s = use.sizes
    nh, D = s["n_head"], use.fixed["D"]
    ctx, nsplit, min_chunk = (CHECK_CTX, cdiv(CHECK_CTX, s["min_chunk"]), s["min_chunk"]) if check else \
        (s["ctx"], s["nsplit"], s["min_chunk"])
    part = np.empty((nh, nsplit, D + 2), np.float32)
    part[:, :, 0] = rng.standard_normal((nh, nsplit)) * 3
    part[:, :, 1] = rng.uniform(1, 20, (nh, nsplit))
    part[:, :, 2:] = rng.standard_normal((nh, nsplit, D))
    q8 = use.fixed["Q8"]
    a = dict(part=part.reshape(-1), qg=_normal(rng, nh * 2 * D), step=_step_words(ctx - 1, ctx),
             o=np.zeros(nh * D, np.float32))
    if q8:
        a.update(oq=np.zeros(nh * D // 4, np.uint32), od=np.zeros(nh * D // 16, np.float32))

    def expect(p):
        o = attention.attn_combine_ref(part, a["qg"].reshape(nh, 2 * D), ctx, nsplit, min_chunk)
        return {"o": (o, 1e-4), **({"od": (_scales(o), 1e-4)} if q8 else {})}
    used = len(attention.split_bounds(ctx, nsplit, min_chunk))
    moved = 4 * nh * (used * (D + 2) + 3 * D)
    return Case(_one(use, lambda v: nh), a, dict(nsplit=nsplit, min_chunk=min_chunk), moved, expect if check else None)


def _deltanet_step(use, rng, check):
    D, KC, Hk, Hv = use.fixed["D"], use.fixed["KC"], use.sizes["k_heads"], use.sizes["v_heads"]
    q, H, eps = use.fixed["QTYPE"], use.sizes["hidden"], use.sizes["eps"]
    C = (2 * Hk + Hv) * D
    pos = 1001  # the taps read a wrapped ring
    x, xq, xd = _normed(rng, H)
    a = dict(mix=_normal(rng, C), conv_w=_normal(rng, C * KC, 0.5), conv_state=_normal(rng, KC * C),
             step=_step_words(pos, pos + 1), z=_normal(rng, Hv * D, 2.0), w_ba=_rows(rng, q, 2 * Hv, H),
             x=x, xq=xq, xd=xd, ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
             dt_bias=_normal(rng, Hv), norm_w=_normal(rng, D), state=_normal(rng, Hv * D * D, 0.5),
             out=np.zeros(Hv * D, np.float32))
    q8 = use.fixed["Q8"]
    if q8:
        a.update(oq=np.zeros(Hv * D // 4, np.uint32), od=np.zeros(Hv * D // 16, np.float32))
    s0, ring0 = a["state"].copy(), a["conv_state"].copy()

    def expect(p):
        inputs = {n: a[n] for n in ("mix", "z", "w_ba", "x", "xq", "xd", "ssm_a", "dt_bias", "norm_w")}
        out, state, ring = deltanet.deltanet_step_ref(**inputs, qtype=q, conv_w=a["conv_w"].reshape(C, KC),
                                                      conv_state=ring0.reshape(KC, C), pos=pos,
                                                      state=s0.reshape(Hv, D, D), n_k_heads=Hk, eps=eps)
        q8_out = {"od": (_scales(out), 1e-4)} if q8 else {}
        return {"out": (out, 1e-4), **q8_out, "state": (state, 1e-5), "conv_state": (ring, 0)}
    # every buffer once (the ring: KC − 1 slots read, one written), and the state written back
    return Case(_one(use, lambda v: Hv), a, dict(n_k_heads=Hk, k=H, eps=eps), _total(a) + s0.nbytes,
                expect if check else None, lambda n: {"state": _copies(a["state"], n)})


# -- sampling: the candidate pass and the draw, tuned together (the draw inherits WG and R) ----------

def _sampling(use, rng, check):
    kernel = use.kernel
    V = min(use.shape["n_vocab"], CHECK_VOCAB) if check else use.shape["n_vocab"]
    cap = use.fixed["CAP"]
    values = {k: kernel.variant_space.get(k, []) + kernel.tune.get(k, []) for k in ("WG", "R")}
    groups = cdiv(V, min(values["WG"]) * min(values["R"]))  # the most candidate groups any variant writes
    a = dict(logits=_normal(rng, V, 3.0), counts=(rng.random(V) < 0.1).astype(np.uint32),
             cand=np.zeros(2 * cap * groups, np.uint32), step=_step_words(3, 4, counter=5), tokens=np.zeros(1, np.uint32))
    counts0 = a["counts"].copy()
    sc = dict(n_vocab=V, repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.05, top_k=min(40, cap),
              min_p=0.05, inv_temp=1.25, top_p=0.95, seed=7, max_tokens=0)

    def expect(p):
        cand = sampling.sample_candidates_ref(a["logits"], counts0, sc["repeat_penalty"], sc["presence_penalty"],
                                              sc["frequency_penalty"], CAP=cap, WG=p["WG"], R=p["R"])
        cand_buf = np.full(a["cand"].size, np.nan)
        cand_buf[:cand.size] = cand
        step = _step_words(3, 4, counter=6)
        step[2] = sampling.sample_ref(a["logits"], counts0, cap=cap, top_k=sc["top_k"], min_p=sc["min_p"],
                                      inv_temp=sc["inv_temp"], top_p=sc["top_p"], seed=sc["seed"], counter=5,
                                      repeat_penalty=sc["repeat_penalty"], presence_penalty=sc["presence_penalty"],
                                      frequency_penalty=sc["frequency_penalty"])
        return {"cand": (cand_buf, 0), "step": (step, 0)}

    def draw(p):
        return sampling.sample_draw.specialize(CAP=p["CAP"], WG=p["WG"], R=p["R"], SG=p["SG"])

    def candidates(p):  # bytes of candidate pairs the pass writes and the draw reads
        return 8 * cap * cdiv(V, p["WG"] * p["R"])
    steps = [Step(lambda p: kernel.specialize(**p), lambda v: cdiv(V, v.params["WG"] * v.params["R"]),
                  lambda p: 8 * V + candidates(p)),
             Step(draw, lambda v: 1, candidates)]
    return Case(steps, a, sc, 8 * V + candidates({"WG": 256, "R": 16}), expect if check else None)


BUILDERS = {
    "dmmv": _dmmv, "dmmv_q8": _dmmv_q8, "dmmv_q8_pair": _dmmv_q8_pair, "norm_q8_1": _norm_q8_1,
    "ffn_gate_up": _ffn_gate_up,
    "ffn_gate_up_q8": _ffn_gate_up, "moe_down": _moe_down, "moe_router": _moe_router, "moe_down_all": _moe_down_all,
    "attn_prep": _attn_prep,
    "attn_decode": _attn_decode, "attn_combine": _attn_combine, "deltanet_step": _deltanet_step,
    "sample_candidates": _sampling,
}
