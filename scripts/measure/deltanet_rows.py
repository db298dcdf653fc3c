"""deltanet_step alone at the 35B-A3B shapes (16 key heads, 32 value heads of 128, hidden 2048, Q8
output, q8_0 gates): one token on the decode rings (4 conv slots, 1 state slot) and on a 4-token
step's (7, 5), four one-row launches against one launch of rows = 4. A/B two trees (stage each
with scripts/stage-package.sh): `PYTHONPATH=OUT python3 -P scripts/measure/deltanet_rows.py TAG
[DEVICE]` per tree, interleaved in one call; a tree without `rows` times the one-row cases only."""
import sys
import numpy as np
from zdsl.autotune import tuner
from zdsl.kernels import deltanet as dn
from zdsl.runtime import open_device
from zdsl.runtime.dry import DryDevice, DryBuffer  # noqa

tag = sys.argv[1]
multi = "rows" in {p.name for p in dn.deltanet_step.params}
Hk, Hv, H, D = 16, 32, 2048, 128
with open_device(sys.argv[2] if len(sys.argv) > 2 else "0") as dev:
    measure = tuner.Measure(dev, warmup=10, repeats=50, warm_s=0.3)
    seq = DryDevice(None).sequence()
    for conv_slots, state_slots, rows, launches_n in [(4, 1, 1, 1), (7, 5, 1, 1), (7, 5, 1, 4), (7, 5, 4, 1),
                                                       (7, 1, 4, 1)]:
        if rows > 1 and not multi:
            continue
        C = (2 * Hk + Hv) * D
        R = rows
        bufs = dict(mix=R * C, conv_w=C * 4, conv_state=conv_slots * C, step=8, z=R * Hv * D, w_ba=2 * Hv * H,
                    x=R * H, xq=R * H // 4, xd=R * H // 16, ssm_a=Hv, dt_bias=Hv, norm_w=D,
                    state=state_slots * Hv * D * D, out=R * Hv * D, oq=R * Hv * D // 4, od=R * Hv * D // 16)
        args = {n: DryBuffer(n, 4 * v) for n, v in bufs.items()}
        extra = dict(rows=R) if multi else {}
        launch = dn.deltanet_step.launch(seq, lambda k, key, fixed: k.specialize(**{"SG": dev.info.subgroup_size, **fixed}), **args,
                                         n_k_heads=Hk, k=H, eps=1e-6, conv_slots=conv_slots, state_slots=state_slots,
                                         v_heads=Hv, D=D, KC=4, Q8=True, QTYPE="q8_0", **extra)
        ex = dn.deltanet_step.make_example(launch, np.random.default_rng(0), False)
        v = launch.variant
        vs = [v] * launches_n
        nbytes = sum(tuner.launch_of(x, ex)[1] for x in vs)
        ub = measure.upload(ex, measure.copies(nbytes))
        try:
            us, spread = measure.time(ex, ub, vs)
        finally:
            tuner.free(ub)
        print(f"{tag}: conv_slots={conv_slots} state_slots={state_slots} rows={rows} x{launches_n} launches: "
              f"{us:.2f} us (spread {spread:.2f}) params={ {k: x for k, x in v.params.items() if k in ('WG', 'SG')} }",
              flush=True)
