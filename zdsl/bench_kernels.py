"""`zdsl bench-kernels`: GPU time of the matrix-vector kernels, and how close they come to the
device's memory bandwidth.

Decode is bandwidth-bound: a kernel is as fast as it can be when it moves its bytes (weights
read, activations read, outputs written) at the rate a plain copy does. So the copy rate is
measured first, with a DSL copy kernel (16-byte loads and stores over large buffers, read plus
write bytes), and each kernel's bytes over its median GPU time are reported against it. Each
kernel is timed two ways, because at a few MB a dispatch's launch and drain cost as much as its
bytes:
- alone: GPU timestamps around each dispatch (end of the previous to end of this one), what a
  dispatch costs when the next one depends on it, as in a decode step's chain. Beside it, a copy
  of the same number of bytes timed the same way: the roofline at that size.
- back to back: many independent dispatches with nothing between them (each writes its own
  output), timed by the wall clock over whole submissions: what the kernel sustains when
  launches overlap, the regime the copy bandwidth itself is measured in.
Before timing, the recorded dispatches are replayed for a while: GPUs raise their clocks only
under sustained load, and a short burst would time an idling GPU. Consecutive dispatches read
different weight copies (or, for experts, different experts) so that small weights are not
served from the cache.
"""

from __future__ import annotations

import json
import math
import statistics
from time import perf_counter
from dataclasses import asdict, dataclass

import click
import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.errors import ZdslError

# KERNEL:QTYPE:K:M[:EXPERTS:SLOTS]; the first three are the Qwen3.5-35B-A3B shapes of the target
DEFAULT_SHAPES = (
    "dmmv:q4_k:2048:8192",
    "ffn_gate_up:q4_k:2048:512:256:8",
    "moe_down:q4_k:512:2048:256:8",
    "dmmv:q6_k:2048:248320",
    "dmmv_q8:q4_k:2048:8192",
    "dmmv_q8:q6_k:2048:248320",
    "ffn_gate_up_q8:q4_k:2048:512:256:8",
    "dmmv:q8_0:2048:8192",
    "dmmv:q5_k:2048:8192",
    "dmmv:q4_k:8192:2048",
)
TINY_SHAPES = ("dmmv:q4_k:512:96", "ffn_gate_up:q4_k:256:32:8:2", "moe_down:q4_k:256:64:8:2",
               "dmmv:q6_k:256:96", "dmmv_q8:q4_k:512:96", "ffn_gate_up_q8:q4_k:512:32:8:2")
KERNELS = ("dmmv", "dmmv_q8", "ffn_gate_up", "ffn_gate_up_q8", "moe_down")
INT8_KERNELS = ("dmmv_q8", "ffn_gate_up_q8")  # they read Q8_1 activations


@zdsl.kernel(workgroup=256, register=False)
def copy_vec4(src: Buffer[f32], dst: Buffer[f32], n4: u32, UNROLL: Const = 4):
    """dst = src over n4 16-byte vectors; each invocation moves UNROLL of them, a workgroup
    apart, so every load and store instruction is one contiguous run."""
    first = zdsl.workgroup_id() * (256 * UNROLL) + zdsl.local_index()
    for j in range(UNROLL):
        i = first + 256 * j
        with zdsl.if_(i < n4):
            dst.vec4[i] = src.vec4[i]


@dataclass
class Case:
    kernel: str
    qtype: str
    k: int
    m: int
    experts: int = 1
    slots: int = 1

    @property
    def label(self) -> str:
        if self.kernel == "quantize_q8_1":
            return f"f32 {self.k} → q8_1"
        experts = self.kernel in ("ffn_gate_up", "ffn_gate_up_q8", "moe_down")
        return f"{self.qtype} {self.k}→{self.m}" + (f" ×{self.slots}/{self.experts}" if experts else "")


BACK_TO_BACK = 128  # independent dispatches per submission when timing back to back


@dataclass
class Result:
    kernel: str
    shape: str
    params: dict
    us: float                # alone: one dependent dispatch
    bytes: int
    gbps: float
    pct_copy: float
    copy_alone_pct: float    # a copy of `bytes` timed alone, % of the copy bandwidth: the roofline at this size
    back_to_back_us: float   # per dispatch, back to back
    back_to_back_gbps: float
    back_to_back_pct_copy: float


def parse_case(text: str) -> Case:
    from zdsl.kernels.quant import FORMATS, INT8_FORMATS

    parts = text.strip().split(":")
    try:
        if parts[0] not in KERNELS or len(parts) not in (4, 6):
            raise ValueError
        nums = [int(p) for p in parts[2:]]
    except ValueError:
        raise ZdslError(f"shape '{text}': write KERNEL:QTYPE:K:M or KERNEL:QTYPE:K:M:EXPERTS:SLOTS with KERNEL one "
                        f"of {', '.join(KERNELS)} (e.g. dmmv:q4_k:2048:8192, moe_down:q4_k:512:2048:256:8)") from None
    case = Case(parts[0], parts[1].lower(), *nums)
    have = INT8_FORMATS if case.kernel in INT8_KERNELS else list(FORMATS)
    if case.qtype not in have:
        raise ZdslError(f"shape '{text}': {case.kernel} has no weight type {case.qtype} (have: {', '.join(have)})")
    block = FORMATS[case.qtype].block
    if case.k % block or min(nums) < 1 or case.slots > case.experts:
        raise ZdslError(f"shape '{text}': K must be a positive multiple of {block} for {case.qtype}, M and the "
                        f"expert counts positive, and SLOTS at most EXPERTS")
    return case


def with_quantizers(cases: list[Case]) -> list[Case]:
    """Before the first int8 case of each K, the quantize_q8_1 dispatch that feeds it (once per
    activation vector, however many matrices read it)."""
    out, seen = [], set()
    for c in cases:
        if c.kernel in INT8_KERNELS and c.k not in seen:
            seen.add(c.k)
            out.append(Case("quantize_q8_1", "f32", c.k, 1))
        out.append(c)
    return out


def synthetic_rows(rng, qtype: str, rows: int, k: int) -> np.ndarray:
    """Random rows of a weight type with finite f16 scales (the speed does not depend on the values)."""
    from zdsl.kernels.quant import FORMATS

    f = FORMATS[qtype]
    if qtype in ("f32", "f16", "bf16"):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        return (x if qtype == "f32" else x.astype(np.float16) if qtype == "f16"
                else (x.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8).reshape(rows, -1)
    w = rng.integers(0, 256, (rows, k // f.block, f.nbytes), dtype=np.uint8)
    for at in f.f16_fields:
        w[:, :, at:at + 2] = rng.uniform(-0.01, 0.01, w.shape[:2] + (1,)).astype("<f2").view(np.uint8)
    return w.reshape(rows, -1)


def _rows_per_workgroup(v) -> int:
    from zdsl.kernels.dmmv import rows_per_workgroup

    return rows_per_workgroup(v)


class Bench:
    def __init__(self, device, warmup: int, repeats: int, warm_s: float, cache_bytes: int, sweep: bool):
        self.device, self.warmup, self.repeats, self.warm_s = device, warmup, repeats, warm_s
        self.cache_bytes, self.sweep = cache_bytes, sweep
        self.rng = np.random.default_rng(0)
        self.buffers = []

    def upload(self, array, name: str):
        buf = self.device.upload(np.ascontiguousarray(array), name=name)
        self.buffers.append(buf)
        return buf

    def zeros(self, nbytes: int, name: str):
        return self.upload(np.zeros(nbytes, np.uint8), name)

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers.clear()

    def copies(self, nbytes: int) -> int:
        """Enough copies of `nbytes` to overflow the caches, at most one per timed dispatch."""
        return max(1, min(self.warmup + self.repeats, math.ceil(self.cache_bytes / max(nbytes, 1))))

    def time(self, record) -> float:
        """Median GPU µs of record(seq, i) over the repeats that follow the warm-up dispatches, in
        a replay after warm_s seconds of replays."""
        seq = self.device.sequence(timestamps=True)
        try:
            for i in range(self.warmup + self.repeats):
                record(seq, i)
            end = perf_counter() + self.warm_s
            seq.run()
            while perf_counter() < end:
                seq.run()
            seq.run()
            ms = [t for _, t in seq.timings()][self.warmup:]
        finally:
            seq.free()
        return statistics.median(ms) * 1e3

    def time_back_to_back(self, record) -> float:
        """Wall-clock µs per dispatch of BACK_TO_BACK independent record(seq, i) dispatches
        submitted together, replayed until warm_s has passed (the submit and the wait count)."""
        seq = self.device.sequence()
        try:
            for i in range(BACK_TO_BACK):
                record(seq, i)
            seq.run()
            times, spent = 1, 0.0
            while True:
                start = perf_counter()
                seq.run(times=times)
                spent = perf_counter() - start
                if spent >= max(self.warm_s, 1e-3) or times >= 1 << 12:
                    break
                times *= 2
        finally:
            seq.free()
        return spent / (times * BACK_TO_BACK) * 1e6

    # -- copy bandwidth ---------------------------------------------------------------------------
    def copy_bandwidth(self, nbytes: int) -> float:
        """GB/s (read + written) of the copy kernel over two buffers of nbytes, timed alone."""
        n4 = max(1, nbytes // 16)
        srcs = [self.zeros(16 * n4, f"copy_src{i}") for i in range(self.copies(16 * n4))]
        dst = self.zeros(16 * n4, "copy_dst")
        v = copy_vec4.specialize()
        groups = math.ceil(n4 / (256 * v.params["UNROLL"]))
        us = self.time(lambda seq, i: v.dispatch(seq, groups, src=srcs[i % len(srcs)], dst=dst, n4=n4))
        self.free()
        return 2 * 16 * n4 / us / 1e3

    # -- kernels --------------------------------------------------------------------------------
    def variants(self, case: Case):
        """The variant the tuning database picks for this device, or with --sweep every ROWS and
        workgroup of 1-4 subgroups (sharing the rows, or 2 and 4 with rows of their own)."""
        from zdsl.autotune.database import choose
        from zdsl.kernels import dmmv, dmmv_q8, q8_1

        if case.kernel == "quantize_q8_1":
            return [q8_1.quantize_q8_1.specialize(SG=self.device.info.subgroup_size)]
        kernel = {"dmmv": dmmv.dmmv, "dmmv_q8": dmmv_q8.dmmv_q8, "ffn_gate_up": dmmv.ffn_gate_up,
                  "ffn_gate_up_q8": dmmv_q8.ffn_gate_up_q8, "moe_down": dmmv.moe_down}[case.kernel]
        fixed = {"QTYPE": case.qtype}
        if not self.sweep:
            return [choose(kernel, self.device.info, {"QTYPE": case.qtype, "k": case.k, "m": case.m}, **fixed)]
        sg = self.device.info.subgroup_size
        out = []
        for rows in (1, 2, 4):
            for wg, nsub in ((0, 1), (2 * sg, 1), (4 * sg, 1), (0, 2), (0, 4)):
                try:
                    v = kernel.specialize(**fixed, ROWS=rows, WG=wg, NSUB=nsub, SG=sg)
                    v.ir
                except ZdslError:
                    continue  # a workgroup that is not whole blocks
                out.append(v)
        return out

    def run_case(self, case: Case, copy_gbps: float) -> Result:
        from zdsl.kernels.quant import FORMATS

        f = FORMATS.get(case.qtype, FORMATS["f32"])
        rb = case.k // f.block * f.nbytes
        best = None
        setup = getattr(self, f"_{case.kernel}")
        record, nbytes = setup(case, rb)
        for v in self.variants(case):
            us = self.time(lambda seq, i, v=v: record(v, seq, i))
            if best is None or us < best[0]:
                best = (us, v)
        us, v = best
        b2b_us = self.time_back_to_back(lambda seq, i: record(v, seq, i))
        self.free()
        copy_alone = self.copy_bandwidth(nbytes // 2)
        params = {"ROWS": v.params.get("ROWS", "-"), "NSUB": v.params.get("NSUB", "-"), "WG": v.ir.workgroup[0],
                  "SG": v.params["SG"]}
        gbps, b2b_gbps = nbytes / us / 1e3, nbytes / b2b_us / 1e3
        return Result(case.kernel, case.label, params, us, nbytes, gbps, 100 * gbps / copy_gbps,
                      100 * copy_alone / copy_gbps, b2b_us, b2b_gbps, 100 * b2b_gbps / copy_gbps)

    def outputs(self, nbytes: int, name: str) -> list:
        """One output buffer per back-to-back dispatch, so that no dispatch waits on another."""
        return [self.zeros(nbytes, f"{name}{i}") for i in range(BACK_TO_BACK)]

    def _weights(self, rows: int, case: Case, rb: int, name: str):
        data = synthetic_rows(self.rng, case.qtype, rows, case.k)
        return [self.upload(data, f"{name}{i}") for i in range(self.copies(rows * rb))]

    def _dmmv(self, case, rb):
        w = self._weights(case.m, case, rb, "w")
        x = self.upload(self.rng.standard_normal(case.k, dtype=np.float32), "x")
        y = self.outputs(4 * case.m, "y")

        def record(v, seq, i):
            v.dispatch(seq, -(-case.m // _rows_per_workgroup(v)), w=w[i % len(w)], x=x, y=y[i % len(y)], k=case.k,
                       m=case.m)
        return record, case.m * rb + 4 * case.k + 4 * case.m

    def _dmmv_q8(self, case, rb):
        w = self._weights(case.m, case, rb, "w")
        xq = self.upload(self.rng.integers(-127, 128, case.k, dtype=np.int8).view(np.uint32), "xq")
        xd = self.upload(np.tile(np.float32([0.01, 0.0]), case.k // 32), "xd")
        y = self.outputs(4 * case.m, "y")

        def record(v, seq, i):
            v.dispatch(seq, -(-case.m // _rows_per_workgroup(v)), w=w[i % len(w)], xq=xq, xd=xd, y=y[i % len(y)],
                       k=case.k, m=case.m)
        return record, case.m * rb + case.k + case.k // 4 + 4 * case.m

    def _quantize_q8_1(self, case, rb):
        x = self.upload(self.rng.standard_normal(case.k, dtype=np.float32), "x")
        xq, xd = self.outputs(case.k, "xq"), self.outputs(case.k // 4, "xd")

        def record(v, seq, i):
            v.dispatch(seq, -(-case.k // 256), x=x, xq=xq[i % len(xq)], xd=xd[i % len(xd)], n=case.k)
        return record, 4 * case.k + case.k + case.k // 4

    def _id_sets(self, case):
        """One set of `slots` distinct experts per dispatch; consecutive sets are disjoint until
        the experts run out, then a new random order starts."""
        per_round = case.experts // case.slots
        order, out = None, []
        for i in range(max(self.warmup + self.repeats, BACK_TO_BACK)):
            if i % per_round == 0:
                order = self.rng.permutation(case.experts).astype(np.uint32)
            out.append(self.upload(order[i % per_round * case.slots:][:case.slots], f"ids{i}"))
        return out

    def _ffn_gate_up(self, case, rb):
        data = synthetic_rows(self.rng, case.qtype, case.experts * case.m, case.k)
        wg, wu = self.upload(data, "gate"), self.upload(data, "up")
        ids = self._id_sets(case)
        x = self.upload(self.rng.standard_normal(case.k, dtype=np.float32), "x")
        act = self.outputs(4 * case.slots * case.m, "act")

        def record(v, seq, i):
            v.dispatch(seq, (-(-case.m // _rows_per_workgroup(v)), case.slots), wg=wg, wu=wu, ids=ids[i], x=x,
                       act=act[i % len(act)], k=case.k, m=case.m)
        return record, 2 * case.slots * case.m * rb + 4 * case.k + 4 * case.slots + 4 * case.slots * case.m

    def _ffn_gate_up_q8(self, case, rb):
        data = synthetic_rows(self.rng, case.qtype, case.experts * case.m, case.k)
        wg, wu = self.upload(data, "gate"), self.upload(data, "up")
        ids = self._id_sets(case)
        xq = self.upload(self.rng.integers(-127, 128, case.k, dtype=np.int8).view(np.uint32), "xq")
        xd = self.upload(np.tile(np.float32([0.01, 0.0]), case.k // 32), "xd")
        act = self.outputs(4 * case.slots * case.m, "act")

        def record(v, seq, i):
            v.dispatch(seq, (-(-case.m // _rows_per_workgroup(v)), case.slots), wg=wg, wu=wu, ids=ids[i], xq=xq,
                       xd=xd, act=act[i % len(act)], k=case.k, m=case.m)
        return record, 2 * case.slots * case.m * rb + case.k + case.k // 4 + 4 * case.slots + 4 * case.slots * case.m

    def _moe_down(self, case, rb):
        w = self.upload(synthetic_rows(self.rng, case.qtype, case.experts * case.m, case.k), "down")
        ids = self._id_sets(case)
        weights = self.upload(np.full(case.slots, 1 / case.slots, np.float32), "weights")
        act = self.upload(self.rng.standard_normal(case.slots * case.k, dtype=np.float32), "act")
        y = self.outputs(4 * case.m, "y")

        def record(v, seq, i):
            v.dispatch(seq, -(-case.m // _rows_per_workgroup(v)), w=w, ids=ids[i], weights=weights, act=act,
                       y=y[i % len(y)], k=case.k, m=case.m, slots=case.slots)
        return record, case.slots * (case.m * rb + 4 * case.k + 8) + 8 * case.m  # y read and written (ADD)


def print_table(device_name: str, copy_gbps: float, copy_bytes: int, results: list[Result]) -> None:
    from zdsl.console import Table, make_console
    from zdsl.runtime.memory import fmt_bytes

    table = Table(title=f"{device_name}: copy {copy_gbps:,.0f} GB/s ({fmt_bytes(copy_bytes)} read + written); "
                        "alone = one dispatch between timestamps; same-size copy = a copy of those bytes timed "
                        "alone; b2b = back to back, independent dispatches overlapping")
    for col in ("kernel", "shape", "variant", "bytes", "alone µs", "GB/s", "% copy", "same-size copy",
                "b2b µs", "b2b GB/s", "b2b % copy"):
        table.add_column(col, justify="left" if col in ("kernel", "shape", "variant") else "right")

    def rate(g):
        return f"{g:,.{0 if g >= 10 else 2}f}"
    for r in results:
        table.add_row(r.kernel, r.shape, " ".join(f"{k}{v}" for k, v in r.params.items()), fmt_bytes(r.bytes),
                      f"{r.us:,.1f}", rate(r.gbps), f"{r.pct_copy:.0f}%", f"{r.copy_alone_pct:.0f}%",
                      f"{r.back_to_back_us:,.1f}", rate(r.back_to_back_gbps), f"{r.back_to_back_pct_copy:.0f}%")
    make_console().print(table)


@click.command("bench-kernels")
@click.option("--device", "device_name", default=None, help="Device index or name (default: $ZDSL_DEVICE or the best).")
@click.option("--shapes", default=None, help="Comma-separated KERNEL:QTYPE:K:M[:EXPERTS:SLOTS] "
                                             "(default: the Qwen3.5-35B-A3B set; see zdsl/bench_kernels.py).")
@click.option("--tiny", is_flag=True, help="Small shapes and buffers (a smoke test, e.g. on lavapipe).")
@click.option("--sweep", is_flag=True, help="Time every ROWS and workgroup size and report the fastest.")
@click.option("--warmup", default=5, show_default=True, help="Untimed dispatches first.")
@click.option("--warm-ms", default=300, show_default=True,
              help="Replay each case this long before timing it (lets the GPU raise its clocks).")
@click.option("--repeats", default=30, show_default=True, help="Timed dispatches (the median is reported).")
@click.option("--copy-mb", default=512, show_default=True, help="Copy-kernel buffer size (each of two).")
@click.option("--cache-mb", default=256, show_default=True,
              help="Rotate weight copies until this many MB lie between reuses (defeats the caches).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_kernels(device_name, shapes, tiny, sweep, warmup, warm_ms, repeats, copy_mb, cache_mb, as_json):
    """Time kernels: GPU time and GB/s against measured copy bandwidth."""
    from zdsl.runtime import open_device

    if min(warmup, warm_ms, cache_mb) < 0 or min(repeats, copy_mb) < 1:
        raise ZdslError("--warmup, --warm-ms and --cache-mb must be ≥ 0, --repeats and --copy-mb ≥ 1")
    cases = with_quantizers([parse_case(s) for s in (shapes.split(",") if shapes else TINY_SHAPES if tiny
                                                     else DEFAULT_SHAPES)])
    if tiny:
        copy_mb, cache_mb, warm_ms = min(copy_mb, 8), min(cache_mb, 4), min(warm_ms, 20)
    copy_bytes = copy_mb << 20
    with open_device(device_name) as dev:
        bench = Bench(dev, warmup, repeats, warm_ms / 1e3, cache_mb << 20, sweep)
        copy_gbps = bench.copy_bandwidth(copy_bytes)
        results = [bench.run_case(c, copy_gbps) for c in cases]
        name = dev.info.name
    if as_json:
        click.echo(json.dumps({"device": name, "copy_gbps": copy_gbps, "copy_bytes": 2 * copy_bytes,
                               "results": [asdict(r) for r in results]}, indent=1, ensure_ascii=False))
    else:
        print_table(name, copy_gbps, 2 * copy_bytes, results)
