"""What limits the experts' down projection (docs/PERF.md, 2026-11-24): `moe_down_all` rebuilt
with one thing taken away at a time, beside plain matrix-vector products of the same bytes and
the experts' gate·up, each in a chain of dependent dispatches over cold weights (35B shapes: 8
routed q4_k experts and a q6_k shared one, 512 -> 2048).

Usage: python3 moe_down_probe.py [DEVICE (default 0)] [CHAIN (default 40)]"""
import numpy as np
from chains import chain_us, device_and_links
import zdsl
from zdsl import Buffer, Const, f32, u8, u32
from zdsl.kernels import dmmv
from zdsl.kernels.quant import fmt
from zdsl.autotune.problems import _rows
from zdsl.lang.language import cdiv


@zdsl.kernel(workgroup=dmmv.workgroup, subgroup="SG", variants={"QTYPE": ["q4_k"], "SG": [32]})
def probe(w: Buffer[u8], w_sh: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32],
          y: Buffer[f32], k: u32, m: u32, QTYPE: Const = "q4_k", QTYPE_SH: Const = "q6_k", K: Const = 8,
          ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0, ADD: Const = True, SHARED: Const = True,
          IDS: Const = True, WEIGHTS: Const = True, ONE_ACT: Const = False, Y_FIRST: Const = True):
    """moe_down_all with switches: ADD (y += rather than y =), SHARED (the shared expert's slot),
    IDS (expert ids loaded, or fixed), WEIGHTS (slot weights loaded, or 0.5), ONE_ACT (every slot
    reads the first slot's activations), Y_FIRST (y loaded before the block loop, or after it)."""
    f = fmt(QTYPE)
    f_sh = fmt(QTYPE_SH or QTYPE)
    ctx, ctx_sh = f.setup(), (f_sh.setup() if f_sh is not f else None)
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    group = dmmv.Rows(ROWS, NSUB, SG)
    offsets = [r * row_bytes for r in group.clamped(m)]
    part = group.index % f.parts
    total = [zdsl.var(0.0) for _ in range(ROWS)]
    old = dmmv.old_rows(y, group, m, 1, ADD) if Y_FIRST else None
    slots = K + 1 if SHARED else K
    for item in zdsl.range(group.index // f.parts, slots * nblocks, group.size // f.parts):
        s = item // nblocks
        b = item - s * nblocks
        weight = weights[s] if WEIGHTS else 0.5
        xb = 0 if ONE_ACT else s * k
        with zdsl.if_(s < K):
            e = ids[zdsl.min(s, K - 1)] if IDS else s * 29
            base = e * (m * row_bytes)
            step = dmmv.block_step(f, ctx, [(w, base + o) for o in offsets], act, [xb], b, part)
            for r in range(ROWS):
                total[r] += weight * step[r][0]
        with zdsl.else_():
            sh_bytes = nblocks * f_sh.nbytes
            rows_sh = [(w_sh, r * sh_bytes) for r in group.clamped(m)]
            step = dmmv.block_step(f_sh, ctx_sh if ctx_sh is not None else ctx, rows_sh, act, [xb], b, part)
            for r in range(ROWS):
                total[r] += weight * step[r][0]
    sums = group.sums(total)
    if not Y_FIRST and ADD:
        old = [y[zdsl.min(group.first + r, m - 1)] for r in range(ROWS)]
    dmmv.store_rows(y, sums, group, m, 1, old)

dev, L = device_and_links()
SG = dev.info.subgroup_size
rng = np.random.default_rng(0)
H, E, F, K = 2048, 256, 512, 8


def timeit(record):
    """µs per dispatch, after chain_us has kept the GPU busy for a second (a pipeline's
    compilation idles the GPU, and its clocks take that long to come back)."""
    return chain_us(dev, record, L)


E = E if "llvmpipe" not in dev.info.name else 64
wd = dev.upload(_rows(rng, "q4_k", E * H, F))
wsh = [dev.upload(_rows(rng, "q6_k", H, F)) for _ in range(L)]
idv = np.stack([rng.choice(E, K, replace=False) for _ in range(L)]).astype(np.uint32)
idb = dev.upload(idv.reshape(-1))
wv = dev.upload(np.pad(np.abs(rng.standard_normal((L, K + 1))), ((0, 0), (0, 3))).astype(np.float32).reshape(-1))
act = dev.upload(rng.standard_normal((K + 1) * F).astype(np.float32))
y = dev.alloc(4 * H)


def down(name, **kw):
    """One chain of the probe with the given switches (the shipped shape otherwise)."""
    p = dict(QTYPE="q4_k", QTYPE_SH="q6_k", K=K, ROWS=1, NSUB=1, SG=SG, WG=128)
    p.update(kw)
    v = probe.specialize(**p)
    t = timeit(lambda seq: [v.dispatch(seq, cdiv(H, dmmv.rows_per_workgroup(v)), w=wd, w_sh=wsh[l],
                                       ids=idb.slice(4 * K * l, 4 * K), weights=wv.slice(4 * (K + 4) * l, 4 * (K + 1)),
                                       act=act, y=y, k=F, m=H) for l in range(L)])
    print(f"{name:50s} {t:6.2f} us", flush=True)


down("WG 128, y loaded after the blocks (before 89cc419)", Y_FIRST=False)
down("WG 128 (y loaded first)")
down("y stored, not added", ADD=False)
down("no shared expert (8 slots: one pass)", SHARED=False)
down("expert ids fixed, not loaded", IDS=False)
down("slot weights fixed, not loaded", WEIGHTS=False)
down("one act block for every slot", ONE_ACT=True)
down("ids and weights fixed, no shared expert, y stored", IDS=False, WEIGHTS=False, SHARED=False, ADD=False)
for wg in (160, 192):  # 20 or 24 blocks per pass: a row's 18 in one
    for rows in (1, 2):
        down(f"WG {wg} ROWS {rows}, y loaded after the blocks", WG=wg, ROWS=rows, Y_FIRST=False)
        down(f"WG {wg} ROWS {rows}", WG=wg, ROWS=rows)
down("WG 128 ROWS 2", ROWS=2)

# plain dmmv of the same bytes (q4_k, 5.3 MB): 2048 rows of 4608, and 4608 rows of 2048
for m, k in ((2048, 4608), (4608, 2048), (2048, 2048)):
    ws = [dev.upload(_rows(rng, "q4_k", m, k)) for _ in range(L)]
    x = dev.upload(rng.standard_normal(k).astype(np.float32))
    yy = dev.alloc(4 * m)
    for rows, wg in ((1, 128), (2, 128), (1, 32)):
        d = dmmv.dmmv.specialize(QTYPE="q4_k", ROWS=rows, SG=SG, WG=wg)
        t = timeit(lambda seq: [d.dispatch(seq, cdiv(m, dmmv.rows_per_workgroup(d)), w=ws[l], x=x, y=yy, k=k, m=m)
                                for l in range(L)])
        print(f"plain dmmv q4_k {k}->{m} ({m * k // 256 * 144 / 1e6:.1f} MB) ROWS={rows} WG={wg}: {t:6.2f} us", flush=True)
    for w_ in ws:
        w_.free()

# the experts' gate·up as shipped (q4_k 2048 -> 512, 8 routed + shared, NSUB 2): 10.6 MB; the
# shared expert is one more expert of the stacks
from zdsl.kernels import dmmv_q8
wg_all, wu_all = dev.upload(_rows(rng, "q4_k", E * F, H)), dev.upload(_rows(rng, "q4_k", E * F, H))
ids_up = dev.upload(np.pad(np.stack([rng.choice(E, K + 1, replace=False) for _ in range(L)]),  # 48-byte strides:
                           ((0, 0), (0, 3))).astype(np.uint32).reshape(-1))         # aligned slices
xq = dev.upload(rng.integers(0, 2**32, H // 4, dtype=np.uint64).astype(np.uint32))
xd = dev.upload(np.abs(rng.standard_normal(H // 16)).astype(np.float32) * 0.01)
out = dev.alloc(4 * (K + 1) * F)
for rows, nsub in ((1, 2), (1, 1)):
    g = dmmv_q8.ffn_gate_up_q8.specialize(QTYPE="q4_k", ROWS=rows, NSUB=nsub, SG=SG)
    t = timeit(lambda seq: [g.dispatch(seq, (cdiv(F, dmmv.rows_per_workgroup(g)), K + 1), wg=wg_all, wu=wu_all,
                                       ids=ids_up.slice(4 * (K + 4) * l, 4 * (K + 1)), xq=xq, xd=xd,
                                       act=out, k=H, m=F) for l in range(L)])
    print(f"ffn_gate_up_q8 (10.6 MB) ROWS={rows} NSUB={nsub}: {t:6.2f} us", flush=True)
