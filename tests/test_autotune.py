"""The tuner: candidate spaces (variants, `tune=` values, `where=`), measured tuning on lavapipe
(every candidate checked against numpy first: a kernel with a planted bug is rejected; the best
is stored and `choose()` returns it), the database's fallbacks, the uses recorded from a decode
step on a DryDevice against the launches the real graph records, every kernel's example against
its reference, and modelled ranking on the gfx1201 null device (wave32 and wave64 compiled and
ranked from their statistics)."""

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.autotune import cost_model, database as db, tuner
from zdsl.errors import KernelError, ZdslError
from zdsl.lang import ir
from zdsl.lang.kernel import Launch
from zdsl.models.qwen35.cli.tune import chunk_uses, several_uses, step_uses
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.synth import PresetModel


# A kernel with a planted bug: WG = 128 (a value only `tune=` offers) adds 1 to every output.
@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64], "SG": [8, 16, 32, 64]},
             tune={"WG": [32, 128, 256], "U": [1, 2]}, where=lambda v: not (v.WG == 256 and v.U == 2),
             name="scale_rows_test", register=False, key=("n",), grid=lambda v, s: -(-s.n // (v.WG * v.U)),
             traffic=lambda v, s: 8 * s.n)
def scale_rows(x: Buffer[f32], out: Buffer[f32], n: u32, a: f32, WG: Const = 64, U: Const = 1, SG: Const = 32):
    base = zdsl.global_id() * U
    for j in range(U):
        i = base + j
        with zdsl.if_(i < n):
            out[i] = x[i] * a + (1.0 if WG == 128 else 0.0)


def scale_rows_ref(x, a):
    return np.asarray(x, np.float64) * a


@scale_rows.example
def _scale_example(use, rng, check):
    n = 1000 if check else use.sizes["n"]
    args = dict(x=rng.standard_normal(n).astype(np.float32), out=np.zeros(n, np.float32), n=n, a=1.5)
    return zdsl.Example(args, lambda p: {"out": (scale_rows_ref(args["x"], 1.5), 1e-6)},
                        lambda k: {"x": [args["x"]] * (k - 1)})


def use_of(kernel, sizes: dict, fixed: dict | None = None) -> tuner.Use:
    """A use as a graph would record it, for a kernel launched with `sizes` and `fixed` Consts."""
    fixed = fixed or {}
    return tuner.Use(Launch(kernel, kernel.specialize(**fixed), fixed, {**fixed, **{n: sizes[n] for n in kernel.key}},
                            sizes, {}, (1, 1, 1), "test"))


@pytest.fixture
def scale_use():
    return use_of(scale_rows, {"n": 5000, "a": 1.5})


def fake_info(name="Test GPU", identity="abcd:0001:test:7", sizes=(8, 64), subgroup=32):
    return SimpleNamespace(name=name, identity=identity, device_type="discrete-gpu", subgroup_size=subgroup, min_subgroup_size=sizes[0],
                           max_subgroup_size=sizes[1], features=frozenset({"subgroup_size_control"}),
                           max_workgroup_invocations=1024)


def test_tuning_space_joins_variants_and_tune_values():
    info = fake_info(sizes=(32, 64))
    use = use_of(scale_rows, {"n": 5000, "a": 1.5})
    got = [(c.params["WG"], c.params["U"], c.params["SG"]) for c in tuner.candidates(use, info)]
    assert got[0] == (64, 1, 32)  # the default (choose() without an entry) comes first
    want = {(wg, u, sg) for wg in (64, 32, 128, 256) for u in (1, 2) for sg in (32, 64) if not (wg == 256 and u == 2)}
    assert set(got) == want and len(got) == len(want)
    pinned = use_of(scale_rows, {"n": 5000, "a": 1.5}, {"U": 2})
    assert {c.params["U"] for c in tuner.candidates(pinned, info)} == {2}
    assert all("U" not in c.tuned for c in tuner.candidates(pinned, info))


def test_tune_values_must_name_parameters():
    def k(A: Const = 1):
        pass

    assert zdsl.kernel(k, register=False).tune == {}  # kernels without tune= are as before
    with pytest.raises(KernelError, match="'NOPE' is not a Const or Spec"):
        zdsl.kernel(k, tune={"NOPE": [1]}, register=False)


def test_measured_tuning_rejects_a_wrong_candidate_and_stores_a_verified_best(device, scale_use):
    measure = tuner.Measure(device, warmup=1, repeats=3, warm_s=0.0, cache_bytes=1 << 16)
    result = measure.tune(scale_use, time.monotonic() + 60)
    assert result.method == "measured"
    rejected = {c.params["WG"] for c in result.rejected}
    assert rejected == {128}
    assert all("wrong out" in c.error for c in result.rejected)
    assert result.ranked and all(c.params["WG"] != 128 and c.us > 0 and c.spread >= 0 for c in result.ranked)
    assert {c.params["WG"] for c in result.ranked} == {32, 64, 256}
    best = result.best
    assert result.default.params == {"WG": 64, "U": 1, "SG": 8}

    # stored in the user's database (the session's private ZDSL_CACHE_DIR) and used by choose()
    path = db.user_path(device.info)
    try:
        store = db.Database([path])
        for e in tuner.entries(result, device.info):
            store.add(e)
        store.save(path)
        db.database.cache_clear()
        chosen = db.choose(scale_rows, device.info, {"n": 5000})
        assert chosen.params == best.params
        x = np.random.default_rng(1).standard_normal(777).astype(np.float32)
        out = chosen.run(device, -(-777 // (best.params["WG"] * best.params["U"])), x=x,
                         out=np.zeros(777, np.float32), n=777, a=1.5)["out"]
        np.testing.assert_allclose(out, scale_rows_ref(x, 1.5), rtol=1e-6)
    finally:
        path.unlink(missing_ok=True)
        db.database.cache_clear()


def test_a_cpu_device_takes_a_kernels_cpu_defaults_where_nothing_is_tuned():
    """lavapipe compiles at a pipeline's first dispatch, for seconds where a tile is big: with no
    entry, a CPU device runs the kernel's `cpu` defaults; a GPU its plain defaults; an entry or a
    value the launch fixes wins over both."""
    from zdsl.kernels import matmul

    cpu, gpu = (SimpleNamespace(**{**vars(fake_info(subgroup=8)), "device_type": kind}) for kind in ("cpu", "discrete-gpu"))
    assert matmul.mul_mm.cpu == {"COLS": 4, "ROWS": 1}
    empty = db.Database([])
    assert {k: db.choose(matmul.mul_mm, cpu, {}, db=empty).params[k] for k in ("COLS", "ROWS")} == {"COLS": 4, "ROWS": 1}
    assert {k: db.choose(matmul.mul_mm, gpu, {}, db=empty).params[k] for k in ("COLS", "ROWS")} == {"COLS": 8, "ROWS": 4}
    assert db.choose(matmul.mul_mm, cpu, {}, db=empty, ROWS=4).params["ROWS"] == 4
    tuned = db.Database.of([db.Entry("abcd:0001:test", cpu.name, "7", "mul_mm", {"k": 64, "m": 8}, {"COLS": 8})])
    assert db.choose(matmul.mul_mm, cpu, {"k": 64, "m": 8}, db=tuned).params["COLS"] == 8


def test_database_entries_change_choose_with_fallbacks(tmp_path, monkeypatch):
    info = fake_info(name="AMD Radeon RX 9070 XT (RADV GFX1201)", identity="1002:7550:radv:100", subgroup=64)
    path = tmp_path / "db.json"
    store = db.Database([path])
    monkeypatch.setattr(db, "database", lambda: db.Database([path]))
    assert db.choose(scale_rows, info, {"n": 10}).params == {"WG": 64, "U": 1, "SG": 64}  # defaults
    # a modelled entry of the null device: another identity, the same RADV family
    store.add(db.Entry("1002:0101:radv", "Null hardware (RADV GFX1201)", "99", "scale_rows_test", {"n": 10},
                       {"WG": 32, "SG": 32, "GONE": 1}, 1.0, "modelled", family="gfx1201"))
    store.save(path)
    assert db.choose(scale_rows, info, {"n": 10}).params == {"WG": 32, "U": 1, "SG": 32}  # unknown GONE ignored
    assert db.choose(scale_rows, info, {"n": 11}).params["WG"] == 64  # other shape: defaults
    # an entry of this very device wins over the family's, and fixed parameters win over entries
    store.add(db.Entry("1002:7550:radv", info.name, "100", "scale_rows_test", {"n": 10, "U": 2}, {"WG": 256, "U": 1}))
    store.add(db.Entry("1002:7550:radv", info.name, "100", "scale_rows_test", {"n": 10}, {"WG": 128}))
    store.save(path)
    assert db.choose(scale_rows, info, {"n": 10}).params["WG"] == 128
    assert db.choose(scale_rows, info, {"n": 10}, U=2).params == {"WG": 256, "U": 2, "SG": 64}
    other = fake_info(name="NVIDIA H100", identity="10de:2330:NVIDIA:580")
    assert db.choose(scale_rows, other, {"n": 10}).params["WG"] == 64
    assert json.loads(path.read_text())["entries"][0]["kernel"] == "scale_rows_test"


def test_several_rows_not_tuned_apart_take_the_one_row_entry():
    """A launch of 4 rows (a 4-token step) with no entry of its own runs the one-row entry's choice
    (the decode step's tuning) rather than the defaults; an entry for 4 rows wins; a shape no entry
    names at one row either keeps the defaults."""
    from zdsl.kernels import moe

    info = fake_info(name="NVIDIA H100", identity="10de:2330:NVIDIA:580", subgroup=32)
    shape = {"QTYPE": "f32", "K": 8, "k": 2048, "n_expert": 256}
    one = db.Entry("10de:2330:NVIDIA", info.name, "580", "moe_router", {**shape, "rows": 1}, {"WG": 256})
    four = db.Entry("10de:2330:NVIDIA", info.name, "580", "moe_router", {**shape, "rows": 4}, {"ROWS": 2, "WG": 128})
    pick = lambda store, rows, **s: db.choose(moe.moe_router, info, {**shape, **s, "rows": rows}, db=store).params  # noqa: E731
    default = pick(db.Database([]), 4)
    assert default["WG"] == 0 and default["ROWS"] == 1
    assert pick(db.Database.of([one]), 4)["WG"] == 256 and pick(db.Database.of([one]), 1)["WG"] == 256
    assert {k: pick(db.Database.of([one, four]), 4)[k] for k in ("ROWS", "WG")} == {"ROWS": 2, "WG": 128}
    assert pick(db.Database.of([one, four]), 2)["WG"] == 256
    assert pick(db.Database.of([one]), 4, k=1024)["WG"] == 0


def test_the_tuners_baseline_at_several_rows_is_the_one_row_entry(monkeypatch):
    """What a T-token step's tuning is measured against is what runs untuned: the one-row entry
    where there is one (not the kernel's defaults), never the use's own entry."""
    from zdsl.autotune import tuner
    from zdsl.kernels import moe

    info = fake_info(name="NVIDIA H100", identity="10de:2330:NVIDIA:580", subgroup=32)
    shape = {"QTYPE": "f32", "K": 8, "k": 2048, "n_expert": 256}
    one = db.Entry("10de:2330:NVIDIA", info.name, "580", "moe_router", {**shape, "rows": 1}, {"WG": 256})
    four = db.Entry("10de:2330:NVIDIA", info.name, "580", "moe_router", {**shape, "rows": 4}, {"ROWS": 2, "WG": 128})
    monkeypatch.setattr(db, "database", lambda: db.Database.of([one, four]))
    baseline = lambda rows: tuner.default_params(  # noqa: E731
        SimpleNamespace(kernel=moe.moe_router, key={**shape, "rows": rows}, fixed={}), info)
    assert baseline(4)["WG"] == 256 and baseline(4)["ROWS"] == 1
    assert baseline(1)["WG"] == 0
    monkeypatch.setattr(db, "database", lambda: db.Database([]))
    assert baseline(4)["WG"] == 0


def test_choose_takes_the_first_declared_choice_the_constraint_accepts_where_it_refuses_the_defaults():
    """deltanet_gated_norm's default workgroup of 32 is no whole number of 64-wide subgroups: on
    such a device choose() (and the tuner's default) takes the first declared WG that is."""
    from zdsl.kernels.deltanet import deltanet_gated_norm

    params = db.choose(deltanet_gated_norm, fake_info(subgroup=64), {"d": 128}, db=db.Database([])).params
    assert params["SG"] == 64 and params["WG"] == 64
    assert db.choose(deltanet_gated_norm, fake_info(subgroup=32), {"d": 128}, db=db.Database([])).params["WG"] == 32


def test_recorded_launches_are_what_the_real_graph_launches(device, tmp_path):
    """A step recorded on a DryDevice (no memory, nothing runs) lists the launches a graph on
    lavapipe records: the same kernels, keys, sizes, grids and variants, in the same order."""
    from zdsl.models.qwen35.file import synth
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.models.qwen35.model.graph import DecodeGraph, record_launches

    for preset in ("tiny", "tiny-dense"):
        path = tmp_path / f"{preset}.gguf"
        synth.write(path, preset, seed=1)
        model = open_model(path)
        g = DecodeGraph(model, device, n_ctx=256, progress=False)
        try:
            real = g.seq.launches
            dry = record_launches(model, device.info, 256)
            seen = [(l.kernel.name, db.shape_key(l.key), l.sizes, l.buffers, l.groups, l.variant.label) for l in dry]
            assert seen == [(l.kernel.name, db.shape_key(l.key), l.sizes, l.buffers, l.groups, l.variant.label)
                            for l in real]
            assert len(real) + 2 == g.dispatches  # and the two step copies
        finally:
            g.close()
        # and the preset stand-in records the same step as the file written from it
        assert [(l.kernel.name, l.key) for l in record_launches(PresetModel(preset), device.info, 256)] == \
            [(l.kernel.name, l.key) for l in dry]


def test_uses_follow_the_kv_cache_format(device):
    """`zdsl tune --kv-type`: the step's attention uses carry the formats the graph would run, so
    a quantized cache's kernels are tuned and looked up apart from the f16 ones."""
    kv = {u.kernel.name: (u.key.get("KT"), u.key.get("VT"))
          for u in step_uses(PresetModel("35b-a3b"), device.info, 4096, (1,), ("q4_0", "q8_0"))}
    assert kv["attn_decode"] == kv["attn_prep"] == ("q4_0", "q8_0")


def test_every_kernel_example_checks_its_default_variant(device):
    """Each kind of use of the 35B step: the default variant on its example's check case agrees
    with the kernel's reference on lavapipe (the examples the tuner and the benches rest on)."""
    uses = step_uses(PresetModel("35b-a3b"), device.info, 4096, (1, 64))
    measure = tuner.Measure(device, warmup=1, repeats=3, warm_s=0.0)
    seen = set()
    for u in uses:
        kind = (u.kernel.name, tuple(sorted((k, v) for k, v in u.fixed.items() if k != "QTYPE")))
        if kind in seen:
            continue
        seen.add(kind)
        check = u.kernel.make_example(u.launch, np.random.default_rng(0), True)
        (default,) = tuner.prepare(u, check, tuner.candidates(u, device.info)[:1], device.info)
        assert measure.check(check, default) is None, u.kernel.name
    assert {k for k, _ in seen} == {"norm_q8_1", "dmmv", "dmmv_q8_pair", "deltanet_step", "attn_prep", "attn_decode",
                                    "attn_combine", "moe_router", "ffn_gate_up", "moe_down_all", "sample_candidates"}


# A strided sum: invocation i adds x[i], x[i + WG], ... — its loop runs ceil((n − i) / WG) times.
@zdsl.kernel(workgroup="WG", variants={"WG": [64, 256]}, name="strided_sum_test", register=False,
             grid=lambda v, s: 1, traffic=lambda v, s: 4 * s.n)
def strided_sum(x: Buffer[f32], out: Buffer[f32], n: u32, WG: Const = 64):
    acc = zdsl.var(0.0)
    for i in zdsl.range(zdsl.local_index(), n, WG):
        acc += x[i] * 2.0
    out[zdsl.local_index()] = acc


@pytest.mark.parametrize("wg", [64, 256])
def test_work_counts_the_loop_trips_of_each_invocation(wg):
    """The interpreter's counts are the trips each invocation makes at the use's size, averaged
    over the first workgroup: with n = 1000 the first n mod WG invocations make one more."""
    from zdsl.autotune.work import work

    n = 1000
    trips = [len(range(i, n, wg)) for i in range(wg)]
    w = work(strided_sum.specialize(WG=wg), {"x": np.ones(n, np.float32), "out": np.zeros(wg, np.float32), "n": n}, (1,))
    assert w.rounds == pytest.approx(np.mean(trips))  # the loop's body loads; the top level does not
    assert w.loads == pytest.approx(np.mean(trips))
    assert w.repeats > 1 and w.static >= 3


@zdsl.kernel(workgroup=32, name="ragged_sum_test", register=False, grid=lambda v, s: s.groups,
             traffic=lambda v, s: 4 * s.n)
def ragged_sum(x: Buffer[f32], out: Buffer[f32], n: u32):
    """Workgroup g sums g elements: the first workgroup's work stands for no other's."""
    acc = zdsl.var(0.0)
    for i in zdsl.range(0, zdsl.workgroup_id(0), 1):
        acc += x[i]
    out[zdsl.global_id()] = acc


def test_work_averages_a_sample_of_workgroups():
    """Workgroups whose loops the data (here their id) decides: the counts are the sampled
    workgroups' mean, and the sample spreads over the grid without falling in step with an axis
    (a SPLIT of two along y: both halves sampled)."""
    from zdsl.autotune.work import SAMPLE, sample, work

    groups = 64
    ids = sample(groups)
    assert len(set(ids)) == SAMPLE and all(0 <= i < groups for i in ids)
    w = work(ragged_sum.specialize(), {"x": np.ones(groups, np.float32), "out": np.zeros(32 * groups, np.float32),
                                       "n": groups}, (groups,))
    assert w.loads == pytest.approx(np.mean(ids)) and w.rounds == pytest.approx(np.mean(ids))
    assert sample(3) == [0, 1, 2]
    split = sample(16 * 512)  # x: 16 row tiles, y: 256 experts × SPLIT = 2
    assert {(i // 16) % 2 for i in split} == {0, 1}


@zdsl.kernel(workgroup=32, name="reread_sum_test", register=False, grid=lambda v, s: s.groups,
             traffic=lambda v, s: 4 * s.n)
def reread_sum(x: Buffer[f32], out: Buffer[f32], n: u32):
    """Every invocation sums all of x: a workgroup reads each element 32 times."""
    acc = zdsl.var(0.0)
    for i in zdsl.range(0, n, 1):
        acc += x[i]
    out[zdsl.global_id()] = acc


def test_work_counts_the_sectors_each_workgroup_reads():
    """What a workgroup pulls through the L2: the distinct 32-byte sectors of the buffers it reads,
    however often its invocations read them (its L1 serves the rest), per workgroup (each one
    reads them again). A partial sector counts whole; the sampled workgroups are averaged."""
    from zdsl.autotune.work import sample, work

    n = 1001  # 4,004 bytes: 125 whole sectors and 4 bytes of another
    args = {"x": np.ones(n, np.float32), "out": np.zeros(32 * 64, np.float32), "n": n}
    assert work(strided_sum.specialize(WG=64), args, (1,)).sectors == 126
    again = work(reread_sum.specialize(), args, (3,))
    assert again.sectors == 126 and again.loads == n
    ragged = work(ragged_sum.specialize(), {**args, "n": 64}, (64,))
    assert ragged.sectors == pytest.approx(np.mean([-(-4 * g // 32) for g in sample(64)]))


# The same sum with each round's load issued a round ahead into a variable (as mma.Staged and
# attention's decode do), and with the sum staged through shared memory.
@zdsl.kernel(workgroup="WG", variants={"WG": [64]}, name="ahead_sum_test", register=False,
             grid=lambda v, s: 1, traffic=lambda v, s: 4 * s.n)
def ahead_sum(x: Buffer[f32], out: Buffer[f32], n: u32, WG: Const = 64):
    acc = zdsl.var(0.0)
    nxt = zdsl.var(x[zdsl.local_index()])
    for i in zdsl.range(zdsl.local_index(), n, WG):
        v = zdsl.var(nxt)
        nxt.set(x[zdsl.min(i + WG, n - 1)])  # the next round's, waited for by the next round only
        acc += v * 2.0
    out[zdsl.local_index()] = acc


@zdsl.kernel(workgroup="WG", variants={"WG": [64]}, name="shared_sum_test", register=False,
             grid=lambda v, s: 1, traffic=lambda v, s: 4 * s.n)
def shared_sum(x: Buffer[f32], out: Buffer[f32], n: u32, WG: Const = 64):
    tile = zdsl.shared(f32, WG)
    acc = zdsl.var(0.0)
    for i in zdsl.range(0, n, WG):
        tile[zdsl.local_index()] = x[zdsl.min(i + zdsl.local_index(), n - 1)]
        zdsl.barrier()
        acc += tile[(zdsl.local_index() + 1) % WG]
        zdsl.barrier()
    out[zdsl.local_index()] = acc


def test_work_tells_loads_issued_a_round_ahead_and_counts_shared_bytes():
    """A round whose loads only go as they are into variables the next round reads is issued
    ahead; a sum that adds its load, stores it or branches on it waits in the same round. Shared
    memory's bytes are the stores and loads each invocation makes."""
    from zdsl.autotune.work import work

    n, wg = 1000, 64
    args = {"x": np.ones(n, np.float32), "out": np.zeros(wg, np.float32), "n": n}
    trips = np.mean([len(range(i, n, wg)) for i in range(wg)])
    ahead = work(ahead_sum.specialize(WG=wg), args, (1,))
    # the first load, before the loop, is a round of its own that waits
    assert ahead.rounds == pytest.approx(trips + 1) and ahead.ahead == pytest.approx(trips)
    plain = work(strided_sum.specialize(WG=wg), args, (1,))
    assert plain.ahead == 0 and plain.shared == 0
    staged = work(shared_sum.specialize(WG=wg), args, (1,))
    rounds = -(-n // wg)
    assert staged.ahead == 0 and staged.rounds == rounds and staged.shared == pytest.approx(2 * 4 * rounds)


@zdsl.kernel(workgroup=64, name="first_wave_loop_test", register=False, grid=lambda v, s: 1,
             traffic=lambda v, s: 4 * s.n)
def first_wave_loop(x: Buffer[f32], out: Buffer[f32], n: u32):
    """Only the first of the workgroup's two subgroups runs the loop."""
    acc = zdsl.var(0.0)
    with zdsl.if_(zdsl.local_index() < 32):
        for i in zdsl.range(0, n, 1):
            acc += x[i]
    out[zdsl.local_index()] = acc


def test_work_counts_a_subgroups_runs_at_each_loop_depth():
    """Machine code runs per subgroup: an operation in a loop runs as often as the subgroup's
    longest-running invocation trips it, and not at all in a subgroup none of whose invocations
    enter it. Per loop depth, the runs are averaged over the subgroups."""
    from zdsl.autotune.work import work

    n, wg = 1000, 64
    w = work(strided_sum.specialize(WG=wg), {"x": np.ones(n, np.float32), "out": np.zeros(wg, np.float32), "n": n},
             (1,))
    # lanes below n mod 64 = 40 make 16 trips, the others 15: both subgroups hold one making 16
    assert w.loop_runs[0] == 1.0 and w.loop_runs[1] == 16.0
    assert np.mean([len(range(i, n, wg)) for i in range(wg)]) < 16 == w.runs_at(1) == w.runs_at(3)
    w = work(first_wave_loop.specialize(), {"x": np.ones(10, np.float32), "out": np.zeros(64, np.float32), "n": 10},
             (1,))
    assert w.loop_runs == (1.0, 5.0)  # 10 trips in one subgroup of two


@zdsl.kernel(workgroup=32, name="routed_sum_test", register=False, grid=lambda v, s: s.groups,
             traffic=lambda v, s: 4 * s.n)
def routed_sum(ids: Buffer[u32], x: Buffer[f32], out: Buffer[f32], n: u32):
    """Workgroup g sums the row ids[g] names, as many elements as ids[g + 1] says, the row's id
    passed on through shared memory: addresses and trips the data decides, arithmetic that decides
    nothing."""
    first = zdsl.shared(u32, 1)
    with zdsl.if_(zdsl.local_index() == 0):
        first[0] = ids[zdsl.workgroup_id(0)] * 32
    zdsl.barrier()
    acc = zdsl.var(0.0)
    for i in zdsl.range(0, ids[zdsl.workgroup_id(0) + 1], 1):
        acc += zdsl.exp(x[first[0] + i] * 2.0) + 1.0
    out[zdsl.global_id()] = acc


def test_work_runs_only_what_decides_the_counts():
    """Counting runs the statements whose values decide addresses, branches and trips (the
    routed row through shared memory, the loop bound loaded), and only counts the data's
    arithmetic: the counts are those of running everything."""
    from zdsl.autotune import work as work_module

    rng = np.random.default_rng(0)
    groups = 20
    args = {"ids": rng.integers(0, 8, groups + 1).astype(np.uint32), "x": rng.normal(size=8 * 32).astype(np.float32),
            "out": np.zeros(32 * groups, np.float32), "n": 8 * 32}
    v = routed_sum.specialize()
    temps, _, arrays = work_module._needed(v.ir.body)
    loop = next(stmt for stmt in v.ir.body if isinstance(stmt, ir.For))
    skipped = {stmt.op for stmt in v.ir.body + loop.body if isinstance(stmt, ir.Let) and stmt.temp.id not in temps}
    assert skipped >= {"exp", "mul", "add"}
    assert any(a[0] == "Shared" for a in arrays) and ("buffer", "x") not in arrays
    sliced = work_module.work(v, args, (groups,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(work_module._Counting, "_runs", lambda self, stmt: True)
        everything = work_module.work(v, args, (groups,))
    assert sliced == everything and sliced.loads > 1


def _listing(tree, depth=0, at=None):
    """nvdisasm-like lines of a tree of instructions (None) and loops (lists), each instruction
    with its loop depth; a loop ends in a predicated branch back to its first instruction."""
    at = at if at is not None else [0]
    lines, depths = [], []
    for item in tree:
        if item is None:
            lines.append(f"        /*{at[0]:04x}*/                   IMAD R1, R2, R3, RZ ;")
            depths.append(depth)
            at[0] += 16
        else:
            start = at[0]
            inner, inner_depths = _listing(item, depth + 1, at)
            lines += inner + [f"        /*{at[0]:04x}*/               @P0 BRA {hex(start)} ;"]
            depths += inner_depths + [depth + 1]
            at[0] += 16
    return lines, depths


_trees = st.recursive(st.lists(st.none(), min_size=1, max_size=4),
                      lambda inner: st.lists(st.one_of(st.none(), inner), min_size=1, max_size=4), max_leaves=30)


@given(tree=_trees, forward=st.integers(0, 3), padding=st.integers(0, 5))
def test_sass_loop_depths_count_each_instruction_in_the_loops_around_it(tree, forward, padding):
    """Backward branches are loops, forward ones (an `if`) are not; the padding after the code
    (a branch to itself and NOPs) is not code."""
    from zdsl.autotune.machine_code import sass_loop_depths

    lines, depths = _listing(tree)
    end = 16 * len(lines)
    for i in [i for i, line in enumerate(lines) if "IMAD" in line][:forward]:  # some jump forward to the end
        address = int(lines[i].split("*/")[0].split("/*")[1], 16)
        lines[i] = f"        /*{address:04x}*/              @!P1 BRA {hex(end)} ;"
    lines.append(f"        /*{end:04x}*/                   EXIT ;")
    depths.append(0)
    lines.append(f"        /*{end + 16:04x}*/                   BRA {hex(end + 16)};")
    lines += [f"        /*{end + 32 + 16 * i:04x}*/                   NOP;" for i in range(padding)]
    text = '\t.headerflags\t@"EF_CUDA_SM90"\n' + "\n".join(lines) + "\n"
    assert sass_loop_depths(text) == [depths.count(d) for d in range(max(depths) + 1)]


def _aco_listing(tree, names):
    """ACO-like blocks of a tree of instructions (None) and loops (lists): a loop starts a block,
    and its last block branches back to that one; block names are `names` in layout order (ACO's
    numbers need not follow the layout). Returns the listing's lines and each instruction's depth."""
    lines, depths, block = [], [], [0]

    def open_block():
        lines.extend([f"BB{names[block[0]]}", "/* logical preds: / linear preds: / kind: uniform, */"])
        block[0] += 1
        return names[block[0] - 1]

    def walk(items, depth):
        for item in items:
            if item is None:
                lines.append("\t v1: %3:v[1] = v_add_f32 %1:v[2], %2:v[3]")
                depths.append(depth)
            else:
                header = open_block()
                walk(item, depth + 1)
                lines.append(f"\ts_cbranch_scc1 block:BB{header}")
                depths.append(depth + 1)
                open_block()

    open_block()
    walk(tree, 0)
    open_block()
    lines += ["\ts_endpgm"]
    depths.append(0)
    return lines, depths


@given(tree=_trees, data=st.data())
def test_aco_loop_depths_count_each_instruction_in_the_loops_around_it(tree, data):
    """RADV's ACO listing: a branch back to an earlier block in the layout closes a loop, a branch
    forward does not, whatever the blocks' numbers."""
    from zdsl.autotune.machine_code import aco_loop_depths

    names = data.draw(st.permutations(range(2 + 2 * str(tree).count("["))))
    lines, depths = _aco_listing(tree, names)
    last = [line for line in lines if line.startswith("BB")][-1]
    at = data.draw(st.sampled_from([i for i, line in enumerate(lines) if "v_add" in line]))
    lines[at] = f"\ts_cbranch_execz block:{last}"  # a branch forward to the last block, at that depth
    assert aco_loop_depths("\n".join(lines)) == [depths.count(d) for d in range(max(depths) + 1)]


@pytest.mark.nulldevice
def test_rdna_loop_depths_are_all_the_code_radv_counts():
    """On the null device, the instructions of ACO's listing by loop depth add up to RADV's own
    count of the code's instructions; a matrix-vector product has its one loop over the row."""
    from zdsl.kernels import dmmv
    from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

    _radeon()
    variants = [dmmv.dmmv.specialize(QTYPE=q, Q8=True, COLS=1, ADD=False, ROWS=rows, NSUB=1, SG=sg)
                for q, rows, sg in (("q4_k", 1, 32), ("q6_k", 2, 64), ("q8_0", 1, 64))]
    specs = [ShaderSpec(v.label, v.spirv, v.bindings, v.push_size, v.spec_constants(), v.ir.subgroup_size)
             for v in variants]
    for stats in map(tuner._with_loop_depths, compile_statistics("gfx1201", specs, isa=True)):
        depths = stats[cost_model.LOOP_DEPTHS]
        assert "isa" not in stats and sum(depths) == stats["Instructions"]
        assert len(depths) == 2 and depths[1] > 0


FIXTURE = Path(__file__).parent / "data" / "nvidia-pipeline-cache-dmmv-q8_0.bin"
FIXTURE_LABEL = "dmmv[ADD=False,QTYPE=q8_0,Q8=True,COLS=1,ROWS=1,NSUB=1,SG=32,WG=0]"


def test_nvidia_machine_code_comes_out_of_a_pipeline_cache():
    """The data of an NVIDIA pipeline cache holding one pipeline (dmmv's Q8_0 variant, from the
    H200's driver 580.159) carries exactly its Binary Size of machine code, which
    nvdisasm reads as whole instructions ending in EXIT; the H100 record of the same variant holds
    the loop depths read from it. Data of another layout is refused in one line."""
    from zdsl import toolchain
    from zdsl.autotune import check, machine_code
    from zdsl.runtime import nvidia_code

    blob = FIXTURE.read_bytes()
    code = nvidia_code.machine_code(blob, 2176)
    assert len(code) == 2176
    for bad, size in ((blob[:200], 2176), (blob.replace(nvidia_code.ZSTD_MAGIC, b"zstd"), 2176), (blob, 2192)):
        with pytest.raises(ZdslError, match="NVIDIA pipeline cache data"):
            nvidia_code.machine_code(bad, size)
    if toolchain._nvdisasm_path() is None:
        pytest.skip("nvdisasm is not installed (pip install 'zdsl[nvidia]')")
    text = toolchain.nvdisasm(code, "SM90")
    ops = [[w for w in line.split("*/")[1].replace(";", " ").split() if not w.startswith("@")][0]
           for line in text.splitlines() if "*/" in line]
    assert len(ops) == 2176 // 16
    last = len(ops) - ops[::-1].index("EXIT")
    assert set(ops[last:]) <= {"BRA", "NOP"}
    depths = machine_code.sass_loop_depths(text)
    assert sum(depths) == last and len(depths) == 2 and depths[1] > 0  # dmmv: one loop over the row
    _, records = check.load(Path(check.__file__).parent / "measured" / "nvidia-h100-step-iq3_xxs_dynamic.json")
    held = [v["stats"] for r in records for c in r["cands"] for v in c["variants"] if v["label"] == FIXTURE_LABEL]
    assert held and held[0]["Binary Size"] == 2176 and held[0][cost_model.LOOP_DEPTHS] == depths


def _nvidia_records(pattern="nvidia-*.json"):
    from zdsl.autotune import check

    return [r for path in sorted((Path(check.__file__).parent / "measured").glob(pattern))
            for r in check.load(path)[1]]


def test_every_nvidia_record_holds_its_machine_codes_loop_depths():
    """Each measured variant's instructions by loop depth, read from its machine code (the H200's
    records by `--record` itself), are all its code but the padding after the last instruction
    (less than 32 instructions)."""
    variants = [v["stats"] for r in _nvidia_records() for c in r["cands"] for v in c["variants"]]
    assert len(variants) > 1300
    for s in variants:
        depths = s[cost_model.LOOP_DEPTHS]
        assert 0 <= s["Binary Size"] // 16 - sum(depths) < 32 and depths[0] > 0


def test_loop_depths_find_the_experts_gate_up_the_static_count_missed():
    """IQ2_XXS experts' gate·up on the H100: NSUB 4 shares a row's loop over four subgroups, and
    the static count × the average operation's runs ranked it first (measured 1.36× the best);
    each loop depth's instructions × a subgroup's runs there rank the measured best (NSUB 1)
    first, at the parameters the fit chooses on all five records (docs/PERF.md)."""
    from zdsl.autotune import check

    records = [r for r in _nvidia_records("nvidia-h100-step-iq2_xxs_dynamic.json")
               if r["kernel"] == "ffn_gate_up" and r["key"].get("EXPERTS")]
    card = replace(cost_model.card("h100"), latency_ns=1200, cpi=4, issue_efficiency=1.0, overlap=3.0)
    use = check.use_of(records[0])
    static = replace(use, dispatches=[[replace(d, stats={k: v for k, v in d.stats.items() if k != cost_model.LOOP_DEPTHS})
                                       for d in parts] for parts in use.dispatches])
    assert check.score(card, use).within and not check.score(card, static).within


def test_the_l2_term_tells_the_routers_workgroups_apart():
    """The router's f32 product in the H100 chunk: NSUB 1, 2 and 4 subgroups of 4 rows a workgroup
    run the same code and measured 42.3, 34.4 and 47.6 µs; a workgroup of 8 rows reads the
    chunk's activations once for them, of 4 rows once for 4, so NSUB 2 pulls 277 MB through the
    L2 where NSUB 1 pulls 409. With the L2 term (at the parameters the folds fit, docs/PERF.md)
    the pick is NSUB 2; without it NSUB 1 and 2 tie and the worst of the tie counts."""
    from zdsl.autotune import check

    record = next(r for r in _nvidia_records("nvidia-h100-chunk.json") if r["kernel"] == "mul_mm")
    use = check.use_of(record)
    card = replace(cost_model.card("h100"), latency_ns=1200, cpi=4, issue_efficiency=1.0, overlap=2.0,
                   l2_bytes_per_clock=24)
    picked = check.score(card, use)
    assert use.labels[picked.pick] == "COLS=8 ROWS=4 SG=32 NSUB=2" and picked.within
    assert not check.score(replace(card, l2_bytes_per_clock=math.inf), use).within


def test_without_nvdisasm_the_error_says_what_to_install(monkeypatch):
    from zdsl import toolchain

    monkeypatch.setattr(toolchain, "_nvdisasm_path", lambda: None)
    with pytest.raises(ZdslError, match=r"nvdisasm is not installed.*zdsl\[nvidia\]"):
        toolchain.nvdisasm(b"\0" * 16, "SM90")


def _nvidia(regs, shared, workgroup):
    return cost_model.Dispatch({"Register Count": regs, "Shared Memory Size": shared}, 1, workgroup, 32, 0.0, None)


@pytest.mark.parametrize("regs, shared, workgroup, groups", [
    (32, 0, 32, 32),        # the 32-block cap
    (64, 0, 128, 8),        # 64 registers × 32 lanes × 4 warps = 8 KiB registers a block: 64 Ki / 8 Ki
    (255, 0, 64, 4),        # 255 rounds up to 256 a lane: 8 Ki a warp, 2 warps, 64 Ki / 16 Ki
    (40, 0, 512, 3),        # 40 × 32 = 1280 → 1280 a warp, 16 warps: 65536 / 20480 = 3 (warps would allow 4)
    (32, 47424, 128, 2),    # shared: the driver's 100 KiB / (47424 + 1 KiB reserved)
    (102, 24192, 128, 4),   # measured: 4 an SM (registers and shared memory both allow 4) ...
    (102, 26240, 128, 3),   # ... and 3 with 2 KiB more shared memory (cost_model.CARDS["h100"])
])
def test_nvidia_occupancy_by_hand(regs, shared, workgroup, groups):
    assert cost_model.groups_per_unit(cost_model.card("h100"), _nvidia(regs, shared, workgroup)) == groups


@given(st.integers(1, 255), st.sampled_from([0, 16, 1024, 8448, 47424, 100000]), st.integers(1, 32))
def test_nvidia_occupancy_is_the_most_blocks_every_limit_allows(regs, shared, warps):
    """The blocks an SM holds fit all four limits (blocks, warps, registers in 256-register units
    per warp, the 100 KiB of shared memory NVIDIA's Vulkan driver gives them with 1 KiB reserved
    per block), and one more would break one."""
    c = cost_model.card("h100")
    n = cost_model.groups_per_unit(c, _nvidia(regs, shared, 32 * warps))
    per_warp = -(-regs * 32 // 256) * 256

    def fits(k):
        return k <= 32 and k * warps <= 64 and k * warps * per_warp <= 65536 and (not shared or k * (shared + 1024) <= 102400)
    assume(fits(1))  # the driver compiles no block that fits nowhere
    assert fits(n) and not fits(n + 1)


@pytest.mark.parametrize("per_simd, lds, workgroup, wave, groups", [
    (16, 0, 64, 32, 16),     # two waves a group, 32 a CU: the 16-group cap
    (10, 0, 256, 32, 2),     # 8 waves a group, 10 × 2 SIMDs = 20 a CU
    (10, 0, 256, 64, 5),     # wave64: 4 waves a group
    (10, 43008, 256, 64, 1),  # 64 KiB of LDS holds one 42 KiB group
])
def test_rdna_occupancy_by_hand(per_simd, lds, workgroup, wave, groups):
    d = cost_model.Dispatch({"Subgroups per SIMD": per_simd, "LDS size": lds}, 1, workgroup, wave, 0.0, None)
    assert cost_model.groups_per_unit(cost_model.card("gfx1201"), d) == groups


def test_cost_model_terms():
    from zdsl.autotune.work import Work

    c = cost_model.card("gfx1201")
    stats = {"Subgroups per SIMD": 16, "VMEM": 8, "VALU": 100, "SALU": 10}
    one = Work(rounds=1, loads=8, ops=110, static=118)
    big = cost_model.Dispatch(stats, 4096, 64, 32, 64e6, one)
    t = cost_model.estimate(c, big)
    assert t["bound"] == "memory" and t["us"] == pytest.approx(64e6 / 640e3 + cost_model.LAUNCH_US)
    # a few groups walking a long loop: each lane's rounds of latency decide, not the bytes
    long = Work(rounds=64, loads=512, ops=7040, static=118)
    few = cost_model.estimate(c, cost_model.Dispatch(stats, 16, 64, 32, 4e6, long))
    assert few["bound"] in ("latency", "chain") and few["latency_us"] == pytest.approx(64 * c.latency_ns * 1e-3)
    # more groups than the card holds come in waves
    held = c.units * 16
    for term in ("latency_us", "chain_us", "issue_us"):
        assert cost_model.estimate(c, cost_model.Dispatch(stats, 2 * held, 64, 32, 0, long))[term] == \
            pytest.approx(2 * cost_model.estimate(c, cost_model.Dispatch(stats, held, 64, 32, 0, long))[term])
    # fewer groups than units: the busiest unit issues one group's waves, whatever the grid
    assert cost_model.estimate(c, cost_model.Dispatch(stats, 16, 64, 32, 0, long))["issue_us"] == \
        pytest.approx(cost_model.estimate(c, cost_model.Dispatch(stats, 8, 64, 32, 0, long))["issue_us"])
    # loads issued a round ahead wait only where the round's work is shorter than the latency
    ahead = replace(long, ahead=64)
    hidden = cost_model.estimate(c, cost_model.Dispatch(stats, 16, 64, 32, 0, ahead))
    assert hidden["ahead"] == 1.0 and hidden["us"] == pytest.approx(
        max(hidden["latency_us"], cost_model.combined(hidden["chain_us"], hidden["issue_us"], c.overlap))
        + cost_model.LAUNCH_US)
    assert hidden["us"] < cost_model.estimate(c, cost_model.Dispatch(stats, 16, 64, 32, 0, long))["us"]
    # the unit's shared-memory traffic is on every lane's path, at the share of its bandwidth it gets
    busy = cost_model.estimate(c, cost_model.Dispatch(stats, 16, 64, 32, 0, replace(long, shared=64 * 1024)))
    assert busy["issue_us"] == few["issue_us"] and busy["chain_us"] == pytest.approx(
        few["chain_us"] + 64 * 64 * 1024 / (c.shared_bandwidth * c.shared_efficiency) / (c.clock_ghz * 1e3))
    # the workgroups' sectors through the L2 at its bandwidth: a floor like the memory term
    reread = cost_model.Dispatch(stats, 4096, 64, 32, 1e6, replace(one, sectors=2048))
    l2 = cost_model.estimate(c, reread)
    assert l2["l2_us"] == pytest.approx(4096 * 2048 * 32 / (c.l2_bytes_per_clock * c.units * c.clock_ghz * 1e3))
    assert l2["bound"] == "l2" and l2["us"] == pytest.approx(l2["l2_us"] + cost_model.LAUNCH_US)
    assert cost_model.estimate(replace(c, l2_bytes_per_clock=math.inf), reread)["us"] < l2["us"]
    # wave64 vector instructions take more than one pass on a SIMD32
    assert cost_model.static_instructions(c, cost_model.Dispatch(stats, 1, 64, 64, 0, one)) > \
        cost_model.static_instructions(c, cost_model.Dispatch(stats, 1, 64, 32, 0, one))
    assert cost_model.estimate(c, cost_model.Dispatch({**stats, "Spilled VGPRs": 20}, 4096, 64, 32, 64e6, one))["us"] > t["us"]
    heavy = cost_model.Dispatch({**stats, "VALU": 20000}, 4096, 64, 32, 64e6, Work(16, 128, 320000, 20118))
    assert cost_model.estimate(c, heavy)["bound"] == "issue"
    assert cost_model.card_of("NVIDIA H100 80GB HBM3") is cost_model.card("h100")
    with pytest.raises(ZdslError, match="no cost-model figures for 'gfx9'"):
        cost_model.card("gfx9")
    with pytest.raises(ZdslError, match="no cost-model figures for llvmpipe"):
        cost_model.card_of("llvmpipe (LLVM 15.0.6, 256 bits)")


def test_overlap_combines_chain_and_issue():
    """The chain and issue limits combine by a p-norm: their sum at p = 1, their max at p = ∞,
    in between otherwise; the rounds' latency adds to them where the loads were not issued a
    round ahead. Where the issue binds, the max ignores how long each lane's instructions take
    one after another: a variant whose chain is twice as long ties with the other. Any finite p
    counts the part of the chain the other lanes' issue did not fill."""
    from zdsl.autotune.work import Work

    assert cost_model.combined(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert cost_model.combined(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert cost_model.combined(3.0, 4.0, math.inf) == 4.0 and cost_model.combined(0.0, 0.0, 2.0) == 0.0
    stats = {"Register Count": 32, "Binary Size": 16 * 1000}
    short = cost_model.Dispatch(stats, 100000, 256, 32, 0.0, Work(8, 100, 9900, 1000))
    for p in (math.inf, 2.0, 1.0):
        c = replace(cost_model.card("h100"), latency_ns=200, cpi=4, issue_efficiency=0.125, overlap=p)
        a = cost_model.estimate(c, short)
        b = cost_model.estimate(replace(c, cpi=2 * c.cpi), short)
        assert a["bound"] == b["bound"] == "issue" and a["issue_us"] == b["issue_us"] and a["chain_us"] < b["chain_us"]
        assert a["us"] == pytest.approx(a["latency_us"] + cost_model.combined(a["chain_us"], a["issue_us"], p)
                                        + cost_model.LAUNCH_US)
        assert (a["us"] == b["us"]) if math.isinf(p) else (a["us"] < b["us"])


def test_modelled_ties_and_the_deciding_term():
    """zdsl tune says why tied candidates tie (the memory or L2 term binds them, or their
    statistics and terms are the same) and which term decided a choice: the one whose change
    alone from the default's value to the chosen's recovers the most of the gain."""
    card = cost_model.card("gfx1201")

    def cand(us, bound, memory, chain, issue, l2=0.0, **params):
        figures = {"VGPRs": 48, "VALU": 100, "rounds": 2.0, "bound": bound, "memory_us": memory, "l2_us": l2,
                   "latency_us": 0.0, "chain_us": chain, "issue_us": issue}
        return tuner.Candidate(params, params, us=us, figures=figures)

    default = cand(10.0, "chain", 5.0, 7.9, 2.0, WG=256)
    best = cand(7.0, "memory", 5.0, 4.0, 2.2, WG=512)
    a, b = cand(7.0, "memory", 5.0, 4.5, 2.0, WG=64), cand(8.0, "chain", 1.0, 5.9, 1.0, NSUB=2)
    c, odd = cand(8.0, "chain", 1.0, 5.9, 1.0, 0.5, NSUB=4), cand(9.0, "chain", 1.0, 6.9, 1.0, ROWS=2)
    odder = cand(9.0, "issue", 1.0, 1.0, 6.9, ROWS=4)
    x, y = cand(9.5, "l2", 1.0, 1.0, 1.0, 7.5, COLS=4), cand(9.5, "l2", 2.0, 1.0, 1.0, 7.5, COLS=8)
    r = tuner.Result(None, "modelled", default, [best, a, b, c, odd, odder, x, y, default], [])
    assert [(why, [x.tuned for x in cs]) for why, cs in tuner.ties(r)] == [
        ("memory", [{"WG": 512}, {"WG": 64}]), ("same code figures", [{"NSUB": 2}, {"NSUB": 4}]),
        ("unexplained", [{"ROWS": 2}, {"ROWS": 4}]), ("l2", [{"COLS": 4}, {"COLS": 8}])]
    assert tuner.decided_by(card, r) == ("chain", 7.9, 4.0)
    # the L2 term decides where the chosen variant's workgroups read less through it
    wide = cand(6.0, "l2", 1.0, 2.0, 1.0, 4.0, NSUB=2)
    assert tuner.decided_by(card, tuner.Result(None, "modelled", cand(9.0, "l2", 1.0, 2.0, 1.0, 7.0, NSUB=1),
                                               [wide], [])) == ("l2", 7.0, 4.0)
    assert tuner.decided_by(card, tuner.Result(None, "modelled", default, [default, best], [])) is None


@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0, 1)), min_size=3, max_size=12, unique_by=lambda t: t[1]))
def test_spearman_is_pearson_of_mean_ranks(pairs):
    """Against ranks computed another way (ties: the mean of the first and last sorted position)."""
    from zdsl.autotune import check

    a = np.asarray([p[0] for p in pairs], float)
    b = np.asarray([p[1] for p in pairs])

    def mean_ranks(x):
        s = np.sort(x)
        return (np.searchsorted(s, x, "left") + np.searchsorted(s, x, "right") - 1) / 2
    assert check.ranks(a) == pytest.approx(mean_ranks(a))
    want = 0.0 if len(set(a)) == 1 else float(np.corrcoef(mean_ranks(a), mean_ranks(b))[0, 1])
    assert check.spearman(a, b) == pytest.approx(want)
    assert check.spearman(b, b) == pytest.approx(1.0) and check.spearman(-b, b) == pytest.approx(-1.0)


def _synthetic_uses(card, seed: int, n: int):
    """Uses whose 'measured' times are the model's own under `card`, candidates differing in
    rounds, instructions, grid and registers, as a kernel's variants do."""
    from zdsl.autotune import check
    from zdsl.autotune.work import Work

    rng = np.random.default_rng(seed)
    uses = []
    for u in range(n):
        nbytes = float(rng.choice([1e5, 1e6, 1e7]))
        parts = []
        for _ in range(8):
            rounds = float(rng.choice([1, 2, 4, 8, 16]))
            parts.append([cost_model.Dispatch({"Register Count": int(rng.integers(24, 200)), "Binary Size":
                                               int(rng.integers(2, 40)) * 1024}, int(rng.integers(16, 20000)),
                                              int(rng.choice([32, 64, 128, 256])), 32, nbytes,
                                              Work(rounds, 4 * rounds, float(rng.integers(50, 2000)), 400))])
        measured = np.asarray([cost_model.estimate_run(card, p)["us"] for p in parts])
        uses.append(check.Use("k", f"use{u}", {}, [f"c{i}" for i in range(8)], measured, parts))
    return uses


def test_the_fit_scores_every_point_of_the_grid_as_score_does():
    """check.fit scores all of GRID's points at once (the card's free parameters as arrays): at
    each point the same ρ and the same verdict on the pick as `score` with that card alone,
    ties (the worst of them counts) included."""
    from zdsl.autotune import check

    h100 = cost_model.card("h100")
    rng = np.random.default_rng(1)
    uses = _synthetic_uses(replace(h100, latency_ns=400, cpi=8), 2, 3)
    uses = [replace(u, dispatches=[[replace(d, work=replace(d.work, sectors=float(rng.integers(0, 4000))))
                                    for d in parts] for parts in u.dispatches]) for u in uses]
    tie = uses[0].dispatches[1]
    uses.append(replace(uses[0], dispatches=[tie, *uses[0].dispatches[1:]]))  # two candidates the model ties
    every, points = check.grid(h100)
    for u in uses:
        rho, within = check.grid_scores(every, u)
        for i in rng.choice(len(points), 60, replace=False):
            s = check.score(replace(h100, **points[i]), u)
            assert rho[i] == pytest.approx(s.rho, abs=1e-12) and within[i] == s.within


def test_fit_recovers_the_parameters_that_made_the_timings(monkeypatch):
    """Timings the model made with known free parameters: the fit finds them up to the one scale
    the ranks cannot see (latency and cpi halved with the issue efficiency doubled halve the
    chain and issue terms alike: here it picks half of each), ranks every use as they do, on
    uses it was not fitted on too, and the nominal figures it started from do not. The p-norm's
    p and the shared-memory efficiency are held at the truth's (the fit of p is tested apart; the
    synthetic uses move nothing through shared memory), which makes the search 10× shorter."""
    from zdsl.autotune import check

    monkeypatch.setitem(check.GRID, "overlap", (cost_model.card("h100").overlap,))
    monkeypatch.setitem(check.GRID, "shared_efficiency", (cost_model.card("h100").shared_efficiency,))

    h100 = cost_model.card("h100")
    truth = replace(h100, latency_ns=800, cpi=4, issue_efficiency=0.25)
    uses = _synthetic_uses(truth, 0, 8)
    fitted = check.fit(h100, uses)
    scale = fitted.latency_ns / 800
    assert fitted.cpi / 4 == scale and 0.25 / fitted.issue_efficiency == scale
    report = check.cross_validate(h100, uses, 4)
    assert report.summary(report.held_out) == (pytest.approx(1.0), 1.0)
    assert report.summary(report.nominal)[0] < 0.95


def test_cli_measured_json(tmp_path, capsys):
    from zdsl.cli import main

    out = tmp_path / "lavapipe.json"
    rc = main(["tune", "--device", "lavapipe", "--preset", "tiny-dense", "--kernels", "norm_q8_1", "--repeats", "3",
               "--warmup", "1", "--warm-ms", "0", "--cache-mb", "0", "--out", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "measured" and report["entries_written"] == 1
    (use,) = report["uses"]
    # before each layer's two halves, and before the head
    assert use["kernel"] == "norm_q8_1" and use["key"] == {"HALVES": False, "n": 256} and use["count"] == 9
    assert use["best"]["us"] > 0 and not use["rejected"]
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["kernel"] == "norm_q8_1" and entry["method"] == "measured" and entry["params"] == use["best"]["params"]


@pytest.mark.slow
def test_cli_check_model_measures_then_replays_the_record(tmp_path, capsys, monkeypatch):
    """`zdsl tune --check-model` on lavapipe measures every candidate, scores the model's ranking
    of each use with parameters fitted on the other fold, and saves what it measured; replaying
    that file reports the same. lavapipe has no figures of its own, so it borrows the H100's."""
    from zdsl.cli import main

    monkeypatch.setitem(cost_model.CARDS, "llvmpipe", cost_model.card("h100"))
    rec = tmp_path / "measured.json"
    args = ["tune", "--check-model", "--preset", "tiny-dense", "--kernels", "dmmv", "--folds", "2", "--json"]
    assert main([*args, "--device", "lavapipe", "--repeats", "3", "--warmup", "1", "--warm-ms", "0", "--cache-mb", "0",
                 "--record", str(rec)]) == 0
    live = json.loads(capsys.readouterr().out)
    assert main([*args, "--measured", str(rec)]) == 0
    assert json.loads(capsys.readouterr().out) == live
    assert main([*args, "--measured", str(rec), "--measured", str(rec)]) == 0  # a use in two records counts once
    assert json.loads(capsys.readouterr().out) == live
    assert len(live["uses"]) >= 2 and len(live["folds"]) == 2
    for u in live["uses"]:
        pick = u["candidates"].index(u["pick"])
        assert u["modelled_us"][pick] == min(u["modelled_us"])
        assert u["pick_over_best"] == pytest.approx(u["measured_us"][pick] / min(u["measured_us"]))
        assert -1 <= u["rho"] <= 1
    assert live["within_5pct"] == pytest.approx(np.mean([u["pick_over_best"] <= 1.05 for u in live["uses"]]))
    assert main(["tune", "--measured", str(rec)]) == 2
    assert "go with --check-model" in capsys.readouterr().err


def test_cli_errors(capsys):
    from zdsl.cli import main

    assert main(["tune", "--device", "lavapipe", "--preset", "tiny", "--kernels", "quantize_q8_1"]) == 2
    assert "dispatches no kernel quantize_q8_1" in capsys.readouterr().err
    assert main(["tune", "--device", "gfx9", "--preset", "tiny"]) == 2
    assert "no cost-model figures for 'gfx9'" in capsys.readouterr().err


def _radeon():
    from zdsl.runtime.nulldevice import radeon_icd
    try:
        radeon_icd()
    except ZdslError as e:
        pytest.skip(str(e))


@pytest.mark.nulldevice
def test_modelled_ranking_on_gfx1201_compares_wave32_and_wave64():
    from zdsl.kernels import dmmv
    from zdsl.runtime.nulldevice import target_info

    _radeon()
    info = target_info("gfx1201")
    use = use_of(dmmv.dmmv, {"k": 2048, "m": 512}, {"QTYPE": "q4_k", "Q8": True, "COLS": 1, "ADD": False})
    result = tuner.Model("gfx1201", info).tune(use, time.monotonic() + 60)
    assert result.method == "modelled" and not result.rejected
    assert {c.params["SG"] for c in result.ranked} == {32, 64}
    for c in result.ranked:
        assert c.us > cost_model.LAUNCH_US and c.figures["VGPRs"] > 0 and c.figures["Subgroups per SIMD"] > 0
        assert c.figures["bound"] in ("memory", "latency", "chain", "issue") and c.figures["rounds"] >= 1
    times = [c.us for c in result.ranked[1:]]
    assert times == sorted(times) and result.default.params["SG"] == 64
    (entry,) = tuner.entries(result, info)
    assert entry.method == "modelled" and entry.family == "gfx1201" and entry.shape == use.key


@pytest.mark.nulldevice
def test_cli_modelled_says_so(tmp_path, capsys):
    from zdsl.cli import main

    _radeon()
    out = tmp_path / "gfx1201.json"
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny-dense", "--kernels", "norm_q8_1,deltanet_step",
                 "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MODELLED" in text and "not measured" in text
    assert "run, chat and bench do not read that file" in text  # --out: the entries are not in use until merged
    entries = json.loads(out.read_text())["entries"]
    assert {e["kernel"] for e in entries} == {"norm_q8_1", "deltanet_step"}
    assert all(e["method"] == "modelled" and e["family"] == "gfx1201" for e in entries)


def test_prompt_chunk_uses_are_the_prefill_launches(device):
    """`zdsl tune --prompt` tunes what one prompt chunk launches (counted per chunk), not the
    decode step; the grouped products' keys leave out the chunk's length (one choice for every
    chunk); a chunk longer than the graph's is one clear error."""
    model = PresetModel("tiny")
    hp = model.hparams
    uses = chunk_uses(model, device.info, 256, 64)
    count = {}
    for u in uses:
        count[u.kernel.name] = count.get(u.kernel.name, 0) + u.count
    n_dn = len(hp.deltanet_layers)
    assert count["deltanet_chunk_wy"] == count["deltanet_chunk_scan"] == n_dn
    assert count["attn_prefill"] == len(hp.attention_layers)
    assert count["moe_route_rows"] == hp.n_layers and count["norm_q8_1"] == 2 * hp.n_layers
    assert not {"deltanet_step", "attn_decode", "dmmv", "sample_candidates"} & set(count)
    grouped = [u for u in uses if u.kernel.name in ("moe_gate_up_grouped", "moe_down_grouped")]
    assert grouped and all(set(u.key) >= {"k", "m", "n_expert"} and "t" not in u.key for u in grouped)
    with pytest.raises(ZdslError, match="a prompt chunk holds 1 to 256 tokens"):
        chunk_uses(model, device.info, 256, 300)


@pytest.mark.nulldevice
def test_cli_modelled_prompt_chunk(tmp_path, capsys):
    from zdsl.cli import main
    from zdsl.runtime.nulldevice import target_info

    _radeon()
    out = tmp_path / "gfx1201.json"
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--prompt", "64", "--kernels",
                 "deltanet_gated_norm", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MODELLED" in text and "64-token chunk" in text
    assert ("offers no cooperative matrices" in text) == ("coopmat" not in target_info("gfx1201").features)
    entries = json.loads(out.read_text())["entries"]
    assert {e["kernel"] for e in entries} == {"deltanet_gated_norm"} and all(e["method"] == "modelled" for e in entries)


@pytest.mark.slow
@pytest.mark.nulldevice
def test_cli_step_tokens_tunes_what_a_step_of_several_adds(tmp_path, capsys):
    """--step-tokens 2,3 ranks the uses steps of 2 and of 3 tokens have and the decode step has not
    (dmmv at two and three columns; the experts' kernels at three rows below); their entries key
    no decode-step use, so the decode step's tuning stays its own. 1 beside others is refused."""
    from zdsl.cli import main
    from zdsl.runtime.nulldevice import target_info

    _radeon()
    out = tmp_path / "gfx1201.json"
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--step-tokens", "2,3", "--kernels", "dmmv",
                 "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "2-token step" in said and "3-token step" in said
    entries = json.loads(out.read_text())["entries"]
    assert {e["kernel"] for e in entries} == {"dmmv"} and {e["shape"]["COLS"] for e in entries} == {2, 3}
    decode = step_uses(PresetModel("tiny"), target_info("gfx1201"), 4096, (1,))
    one = {(u.kernel.name, db.shape_key(u.key)) for u in decode}
    assert not one & {(e["kernel"], db.shape_key(e["shape"])) for e in entries}
    experts = tmp_path / "experts.json"
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--step-tokens", "3", "--kernels",
                 "moe_down_all,moe_router", "--out", str(experts)]) == 0
    entries = json.loads(experts.read_text())["entries"]
    assert entries and all(e["shape"]["rows"] == 3 for e in entries)
    assert not one & {(e["kernel"], db.shape_key(e["shape"])) for e in entries}
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--step-tokens", "3", "--kernels",
                 "embed"]) == 2  # the decode step's use: none a 3-token step adds
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--step-tokens", "3", "--prompt", "8"]) == 2
    assert main(["tune", "--device", "gfx1201", "--preset", "tiny", "--step-tokens", "1,4"]) == 2
    assert "in a run of its own" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from zdsl.models.qwen35.file import synth

    path = tmp_path_factory.mktemp("inplace") / "tiny.gguf"
    synth.write(path, "tiny", seed=5)
    return path


def _measured(device, path, kernel: str):
    from zdsl.models.qwen35.file.gguf_file import open_model

    uses = [u for u in step_uses(open_model(path), device.info, 64, (1,)) if u.kernel.name == kernel]
    measure = tuner.Measure(device, warmup=1, repeats=3, warm_s=0.0, cache_bytes=1 << 16)
    return [measure.tune(u, time.monotonic() + 60) for u in uses]


def test_retuned_step_runs_the_entry_and_decodes_the_same(device, tiny_model):
    """An entry recorded into the step by retune() changes the variant the step dispatches, and
    greedy decoding gives the same tokens (same math, another variant)."""
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.models.qwen35.model.graph import DecodeGraph

    (result,) = _measured(device, tiny_model, "moe_down_all")[:1]
    other = next(c for c in result.ranked + result.rejected if c.error is None and c.params != result.default.params)
    g = DecodeGraph(open_model(tiny_model), device, 24, progress=False)
    try:
        key = (result.use.kernel.name, db.shape_key(result.use.key))
        assert g.chosen[key].params == result.default.params
        first = [g.decode(3)] + g.decode_burst(7)
        g.retune(db.Database.of(tuner.entries(result, device.info, other)))
        assert g.chosen[key].params == other.params
        g.reset()
        assert [g.decode(3)] + g.decode_burst(7) == first
    finally:
        g.close()


def test_in_place_keeps_a_nominee_only_when_the_step_gets_faster(device, tiny_model, monkeypatch):
    """The keep/drop logic with a step clock that depends on what the graph really recorded: a
    step is 1% faster per kept variant of one kind, so exactly those are kept, the final run
    confirms a gain, and the graph is back on the defaults afterwards."""
    from zdsl.models.qwen35.cli import in_place
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.models.qwen35.model.graph import DecodeGraph

    results = _measured(device, tiny_model, "dmmv")
    g = DecodeGraph(open_model(tiny_model), device, 24, progress=False)
    faster = {r.use.ident: _nominees_alone(r)[0].params for r in results[:2] if _nominees_alone(r)}
    assert faster, "no candidate beat the default alone: widen the test's candidate space"
    clock = iter(np.linspace(1.0, 1.0001, 10000))  # a slow drift both sides see alike

    def step_ms(self, database, sampler):
        self.graph.retune(database, sampler)
        hits = sum(self.graph.chosen.get((r.use.kernel.name, db.shape_key(r.use.key))).params == faster.get(r.use.ident)
                   for r in results)
        return next(clock) * (1 - 0.01 * hits)

    monkeypatch.setattr(in_place.InPlace, "step_ms", step_ms)
    try:
        report = in_place.InPlace(g, rounds=3, final_rounds=3, nominees=1).run(results, device.info,
                                                                              time.monotonic() + 120)
        kept = {t.result.use.ident for t in report.trials if t.kept}
        assert kept == set(faster)
        assert report.final.gain == pytest.approx(1 / (1 - 0.01 * len(faster)), rel=1e-3)
        assert {(e.kernel, db.shape_key(e.shape)) for e in report.entries} == {
            (r.use.kernel.name, db.shape_key(r.use.key)) for r in results if r.use.ident in faster}
        assert all(e.figures["step_gain"] > 1 for e in report.entries)
        assert g.tuning is None and all(
            g.chosen[(r.use.kernel.name, db.shape_key(r.use.key))].params == r.default.params for r in results)
    finally:
        g.close()


def _nominees_alone(r):
    from zdsl.models.qwen35.cli.in_place import _nominees

    return _nominees(r, 1)


@pytest.mark.slow
def test_tune_with_a_model_file_tries_nominees_in_the_decode_step(tiny_model, tmp_path, capsys):
    """`zdsl tune --model` on lavapipe end to end: the JSON has the in-place trials and the
    entries written are exactly the kept ones (after a confirming final run)."""
    from zdsl.cli import main

    out = tmp_path / "db.json"
    assert main(["tune", "--device", "lavapipe", "--model", str(tiny_model), "--kernels", "moe_router,dmmv",
                 "--ctx", "64", "--budget", "20", "--repeats", "3", "--warm-ms", "0", "--out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ip = report["in_place"]
    kept = [t for t in ip["trials"] if t["kept"]]
    assert ip["trials"] and report["entries_written"] == ip["entries_kept"]
    if ip["entries_kept"]:
        assert ip["final"]["gain"] > 1 and ip["entries_kept"] == len(kept)
        assert len(json.loads(out.read_text())["entries"]) == len(kept)
    else:
        assert not out.exists()
    for t in ip["trials"]:
        c = t["comparison"]
        assert t["kept"] == (c["gain"] - 1 > max(0.002, 2 * c["noise"]))


def test_the_35b_step_runs_on_int8_inputs(device):
    """In the 35B preset every projection has an int8 decoder: no f32 matrix-vector product but
    the router's, one residual norm dispatch before each layer and before the head (the router
    norms the MoE input itself)."""
    uses = step_uses(PresetModel("35b-a3b"), device.info, 4096, (1,))
    count = {}
    for u in uses:
        count[u.kernel.name] = count.get(u.kernel.name, 0) + u.count
    assert all(u.fixed["Q8"] for u in uses if u.kernel.name in ("dmmv", "ffn_gate_up"))
    assert count["norm_q8_1"] == 41
    assert count["ffn_gate_up"] == count["moe_down_all"] == count["moe_router"] == 40
    residual = [u for u in uses if u.kernel.name == "dmmv" and u.fixed["ADD"]]
    assert sum(u.count for u in residual) == 40  # ssm_out and attn_output


@pytest.mark.parametrize("shipped", ["gfx1201.json", "nvidia-h100-80gb-hbm3.json", "nvidia-h200.json"])
def test_every_shipped_entry_keys_a_use_of_the_35b_step(shipped, device):
    """An entry whose key no dispatch asks for is dead weight that looks like tuning: it happens
    when a kernel's parameters change under it. (sample_draw is keyed on the choice of its
    sampler pass, which the step makes, not on a use of its own.) Entries may come from any of
    the synthetic mixes' decode steps, steps of 2, 4 or 8 tokens (`zdsl tune --step-tokens`) or
    512-token prompt chunks (on matrix units, as the H100 runs them, or without, as gfx1201's
    null device offers none)."""
    from dataclasses import replace
    from pathlib import Path

    import zdsl.autotune

    gpu = replace(device.info, device_type="discrete")  # lavapipe's shapes, a GPU's choices (deltanet_step's TOKENS)
    units = replace(gpu, features=frozenset(device.info.features) | {"coopmat"})
    plain = replace(gpu, features=frozenset(device.info.features) - {"coopmat"})
    keys = {(u.kernel.name, db.shape_key(u.key)) for quant in synth.QUANTS[:4]
            for u in step_uses(PresetModel("35b-a3b", quant), gpu, 4096, (1, 64))
            + chunk_uses(PresetModel("35b-a3b", quant), units, 4096, 512)
            + chunk_uses(PresetModel("35b-a3b", quant), plain, 4096, 512)
            + [u for t in (2, 4, 8) for u in several_uses(PresetModel("35b-a3b", quant), gpu, 4096, t)]}
    entries = json.loads((Path(zdsl.autotune.__file__).parent / shipped).read_text())["entries"]
    dead = [(e["kernel"], e["shape"]) for e in entries
            if e["kernel"] != "sample_draw" and (e["kernel"], db.shape_key(e["shape"])) not in keys]
    assert not dead
    assert len({e["kernel"] for e in entries}) >= 3  # the file was read: each ships entries for several kernels


@pytest.mark.slow
def test_the_model_ranks_the_measured_h100_decode_candidates():
    """Issue 30's bar on the H100 measurement the repo keeps (every candidate of the 35B-A3B decode
    step's uses): fitted on the other folds' uses, the model's ranking of each held-out
    use has a median Spearman ρ ≥ 0.7 with the measured one and its pick is within 5% of the best
    in ≥ 80% of the uses; the kernels' defaults alone are within 5% in far fewer."""
    from zdsl.autotune import check, cost_model

    device, records = check.load(Path(check.__file__).parent / "measured" / "nvidia-h100-step.json")
    uses, stale = check.uses_of([r for r in records if r["where"] == "step"])
    assert set(stale) <= {"attn_combine"}  # redesigned after the measurement
    assert len(uses) >= 10
    report = check.cross_validate(cost_model.card_of(device), uses, 4)
    rho, within = report.summary(report.held_out)
    assert rho >= 0.7 and within >= 0.8, (rho, within)
    assert report.defaults_within() < within


@pytest.mark.slow
@pytest.mark.early
def test_the_model_ranks_the_measured_h100_decode_and_prompt_product_candidates():
    """The issue's bar over what it names on the H100: the decode step's uses and the prompt's
    matrix products (the chunk's mul_mm_coop, mul_mm and the experts' products, 27 uses in all):
    held out, median ρ ≥ 0.7 and picks within 5% in ≥ 80%. (docs/PERF.md: 22 of 27, one use
    above the bar; most of its time is the interpreter counting the products' tiles.)"""
    from zdsl.autotune import check, cost_model

    products = {"mul_mm_coop", "mul_mm", "moe_gate_up_coop", "moe_down_coop"}
    device, step = check.load(Path(check.__file__).parent / "measured" / "nvidia-h100-step.json")
    _, chunk = check.load(Path(check.__file__).parent / "measured" / "nvidia-h100-chunk.json")
    uses, stale = check.uses_of([r for r in step if r["where"] == "step"] + [r for r in chunk if r["kernel"] in products])
    assert set(stale) <= {"attn_combine"} and len(uses) == 27
    report = check.cross_validate(cost_model.card_of(device), uses, 4)
    rho, within = report.summary(report.held_out)
    assert rho >= 0.7 and within >= 0.8, (rho, within)
    assert report.defaults_within() < within


@pytest.mark.slow
def test_the_model_ranks_the_measured_h200_decode_candidates():
    """The same bar on a second card, the H200 (recorded with the machine code's
    loop depths by `--record` itself): held out, median ρ ≥ 0.7 and picks within 5% in ≥ 80%
    of the Q4_K_M decode step's uses, more than the defaults alone."""
    from zdsl.autotune import check, cost_model

    device, records = check.load(Path(check.__file__).parent / "measured" / "nvidia-h200-step.json")
    uses, stale = check.uses_of(records)
    assert device == "NVIDIA H200" and not stale and len(uses) >= 10
    report = check.cross_validate(cost_model.card_of(device), uses, 4)
    rho, within = report.summary(report.held_out)
    assert rho >= 0.7 and within >= 0.8, (rho, within)
    assert report.defaults_within() < within


@pytest.mark.slow
def test_the_model_ranks_the_measured_h100_decode_candidates_of_every_mix():
    """The same on the decode steps of all four type mixes the repo keeps H100 records of
    (a use the mixes share counts once). There the model does not reach the issue's
    80% (docs/PERF.md: 23 of 31): this holds it to median ρ ≥ 0.7, picks within 5% in ≥ 70%, and
    more than the kernels' defaults alone."""
    from zdsl.autotune import check, cost_model

    records, devices = [], set()
    for path in sorted((Path(check.__file__).parent / "measured").glob("nvidia-h100-step*.json")):
        device, more = check.load(path)
        devices.add(device)
        records += more
    uses, stale = check.uses_of(records)
    assert len(devices) == 1 and set(stale) <= {"attn_combine"}  # redesigned after the first record
    assert len(uses) >= 30
    report = check.cross_validate(cost_model.card_of(device), uses, 4)
    rho, within = report.summary(report.held_out)
    assert rho >= 0.7 and within >= 0.7, (rho, within)
    assert report.defaults_within() < within
