"""The MoE router and the expert down projection by workgroup size (docs/PERF.md, 2026-11-23).

Usage: python3 moe_workgroups.py [DEVICE (default 0)] [CHAIN (default 40)]

Both at the 35B shapes, in chains of dependent dispatches over cold weights: more invocations
sharing a row's blocks means fewer of them walked one after another."""
import numpy as np
from chains import chain_us, device_and_links
from zdsl.kernels import moe, dmmv
from zdsl.autotune.problems import _rows
from zdsl.lang.language import cdiv

dev, L = device_and_links()
SG = dev.info.subgroup_size
rng = np.random.default_rng(0)
H, E, F, K = 2048, 256, 512, 8
def timeit(record):
    return chain_us(dev, record, L)
# router
rw = [dev.upload(rng.standard_normal((E + 1) * H).astype(np.float32)) for _ in range(L)]  # row E: the shared gate
x = dev.upload(rng.standard_normal(H).astype(np.float32))
norm_w = dev.upload(np.ones(H, np.float32))
hn, xq, xd = dev.alloc(4 * H), dev.alloc(H), dev.alloc(H // 4)
logits, arr, ids, wts = dev.alloc(4 * (E + 1)), dev.alloc(4), dev.alloc(4 * (K + 1) * L), dev.alloc(4 * (K + 1) * L)
s = dev.sequence(); s.fill(arr); s.run(); s.free()
for rows in (1, 2, 4):
    for wg in (0, 64, 128, 256):
        try:
            v = moe.moe_router.specialize(QTYPE="f32", K=K, ROWS=rows, SG=SG, WG=wg)
            t = timeit(lambda seq: [v.dispatch(seq, cdiv(E + 1, dmmv.rows_per_workgroup(v)), w=rw[l], x=x,
                norm_w=norm_w, hn=hn, xq=xq, xd=xd, eps=1e-6, logits=logits, arrivals=arr, ids=ids.slice(0, 4 * (K + 1)), weights=wts.slice(0, 4 * (K + 1)), k=H,
                n_expert=E) for l in range(L)])
            d = dmmv.dmmv.specialize(QTYPE="f32", ROWS=rows, SG=SG, WG=wg)
            t2 = timeit(lambda seq: [d.dispatch(seq, cdiv(E, dmmv.rows_per_workgroup(d)), w=rw[l], x=x, y=logits, k=H, m=E)
                                     for l in range(L)])
            print(f"router ROWS={rows} WG={wg:3d}: {t:6.2f} us   (its logits as a plain f32 dmmv: {t2:6.2f})", flush=True)
        except Exception as e:
            print("router", rows, wg, "failed:", str(e)[:200])
# expert down (Q6_K), routed + shared (the stack's last expert, as ids[K] names it)
ED = E if "llvmpipe" not in dev.info.name else 64
wd = dev.upload(_rows(rng, "q6_k", ED * H, F))
wsh = dev.upload(_rows(rng, "q6_k", H, F))
idv = np.pad(np.stack([rng.choice(ED, K + 1, replace=False) for _ in range(L)]), ((0, 0), (0, 3))).astype(np.uint32)
idb = dev.upload(idv.reshape(-1))
wv = dev.upload(np.pad(np.abs(rng.standard_normal((L, K + 1))), ((0, 0), (0, 3))).astype(np.float32).reshape(-1))
act = dev.upload(rng.standard_normal((K + 1) * F).astype(np.float32))
y = dev.alloc(4 * H)
for rows in (1, 2):
    for wg in (0, 64, 128, 256):
        for nsub in ((1, 2, 4) if wg == 0 else (1,)):
            try:
                v = dmmv.moe_down_all.specialize(QTYPE="q6_k", QTYPE_SH="", K=K, ROWS=rows, NSUB=nsub, SG=SG, WG=wg)
                t = timeit(lambda seq: [v.dispatch(seq, cdiv(H, dmmv.rows_per_workgroup(v)), w=wd, w_sh=wsh,
                    ids=idb.slice(4 * (K + 4) * l, 4 * (K + 1)), weights=wv.slice(4 * (K + 4) * l, 4 * (K + 1)), act=act, y=y, k=F, m=H)
                    for l in range(L)])
                print(f"moe_down_all ROWS={rows} WG={wg:3d} NSUB={nsub}: {t:6.2f} us", flush=True)
            except Exception as e:
                print("down", rows, wg, nsub, "failed:", str(e)[:200])
