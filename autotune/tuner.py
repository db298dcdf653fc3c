"""Pick the fastest variant of each kernel use: measured on a device that runs code, modelled on
a compile-only RADV target.

Candidates are the kernel's variant space and its `tune=` values, with what the decode graph
fixes pinned, filtered by `where=`, the device's subgroup sizes and the workgroups that trace;
candidates that generate the same code as an earlier one are dropped. The default (what
`choose()` runs without an entry) always competes, so every result says what tuning gained.

Measured: each candidate first runs a small check case against the kernel's numpy reference
(a wrong or unbuildable candidate is rejected, with the reason), then the full use is timed with
GPU timestamps: warm-up dispatches, then repeats (median and spread), rotating copies of the big
inputs between dispatches, after replaying for a while so that the clocks are up.
Modelled: each candidate is compiled for the target by RADV's null device and ranked by
`cost_model` from its machine-code statistics.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from zdsl.errors import ZdslError
from zdsl.lang.kernel import Variant

from . import cost_model, problems
from .database import Entry, device_key, family
from .workload import Use

SUBGROUP_SIZES = (8, 16, 32, 64, 128)
STAT_FIGURES = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Subgroups per SIMD", "VALU", "SALU", "VMEM",
                "LDS size", "Scratch size")
MARGIN = 0.02  # the default stays first unless a candidate beats it by this much: smaller
               # differences are within a measurement's noise and the model's slack


@dataclass
class Candidate:
    params: dict                 # every compile-time parameter of the first dispatch
    tuned: dict                  # the ones the tuner chose (what an entry stores)
    variants: list[Variant] = field(default_factory=list)
    us: float | None = None      # measured median or modelled time of one run
    spread: float | None = None  # measured: (p90 − p10) / median
    figures: dict = field(default_factory=dict)
    error: str | None = None     # why it was rejected

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.tuned.items()) or "(no choice)"


@dataclass
class Result:
    use: Use
    method: str                  # "measured" or "modelled"
    default: Candidate
    ranked: list[Candidate]      # accepted candidates, fastest first
    rejected: list[Candidate]
    skipped: str | None = None   # why the use was not (fully) tuned

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def speedup(self) -> float | None:
        if self.best is None or self.default.us is None or not self.best.us:
            return None
        return self.default.us / self.best.us


def subgroup_sizes(info) -> tuple[int, ...]:
    if "subgroup_size_control" in info.features:
        return tuple(s for s in SUBGROUP_SIZES if info.min_subgroup_size <= s <= info.max_subgroup_size)
    return (info.subgroup_size,)


def default_params(use: Use, info) -> dict:
    """What `choose()` runs for this use without an entry."""
    k = use.kernel
    given = {k.subgroup: info.subgroup_size} if k.subgroup else {}
    return k.complete({**given, **use.fixed, **use.pins})


def candidates(use: Use, info) -> list[Candidate]:
    """The default first, then every other combination of the tunable values."""
    k = use.kernel
    pinned = {**use.fixed, **use.pins}
    sizes = subgroup_sizes(info)
    keys = list(dict.fromkeys([*k.variant_space, *k.tune, *([k.subgroup] if k.subgroup else [])]))
    free = [key for key in keys if key not in pinned]
    values = []
    for key in free:
        vals = list(dict.fromkeys(k.variant_space.get(key, []) + k.tune.get(key, [])))
        if key == k.subgroup:
            vals = [s for s in (vals or sizes) if s in sizes]
        values.append(vals)
    default = default_params(use, info)
    out, seen = [], set()
    for combo in itertools.chain([tuple(default[key] for key in free)], itertools.product(*values)):
        params = k.complete({**pinned, **dict(zip(free, combo))})
        ident = tuple(sorted((n, repr(v)) for n, v in params.items()))
        if ident in seen or (k.constraint is not None and not k.constraint(SimpleNamespace(**params))):
            continue
        seen.add(ident)
        out.append(Candidate(params, {key: params[key] for key in free}))
    return out


def prepare(case: problems.Case, cands: list[Candidate], info) -> list[Candidate]:
    """Trace each candidate's dispatches; drop those whose workgroup does not trace or does not
    fit the device, and those whose code equals an earlier candidate's."""
    out, seen = [], set()
    for c in cands:
        try:
            c.variants = [s.variant(c.params) for s in case.steps]
            code = tuple((v.glsl, tuple(sorted(v.spec_constants().items()))) for v in c.variants)
        except ZdslError:
            continue  # a combination the kernel does not build (e.g. a workgroup that is not whole blocks)
        if any(math.prod(v.ir.workgroup) > info.max_workgroup_invocations for v in c.variants) or code in seen:
            continue
        seen.add(code)
        out.append(c)
    return out


def _finish(use: Use, method: str, default_ident: dict, accepted: list[Candidate], rejected: list[Candidate],
            skipped: str | None = None) -> Result:
    # modelled ties (memory-bound candidates moving the same bytes) rank by issue time
    accepted.sort(key=lambda c: (c.us, c.figures.get("issue_us", 0.0)))
    default = next((c for c in accepted + rejected if c.params == default_ident), None)
    if default is None:
        default = Candidate(default_ident, {}, error="not built on this device")
    elif default.error is None and accepted[0].us * (1 + MARGIN) > default.us:
        accepted.remove(default)
        accepted.insert(0, default)
    return Result(use, method, default, accepted, rejected, skipped)


def entries(result: Result, info, chosen: Candidate | None = None, **extra) -> list[Entry]:
    """Database entries for the best candidate, or for `chosen` (and what it implies for
    companion kernels); `extra` figures are added to the entry."""
    best = chosen or result.best
    if best is None:
        return []
    device, driver = device_key(info)
    base = dict(device=device, device_name=info.name, driver=driver, method=result.method, family=family(info))
    figures = {k: v for k, v in best.figures.items() if isinstance(v, (int, float))}
    if result.default.us and best.us:
        figures["speedup"] = round(result.default.us / best.us, 3)
    if best.spread is not None:
        figures["spread"] = round(best.spread, 3)
    figures.update(extra)
    out = [Entry(kernel=result.use.kernel.name, shape=result.use.key, params=best.tuned, us=round(best.us, 3),
                 figures=figures, **base)]
    for kernel, key, params in problems.companions(result.use, best.params):
        out.append(Entry(kernel=kernel, shape=key, params=params, us=None, figures={}, **base))
    return out


# -- measured ------------------------------------------------------------------------------------------

class Measure:
    """Checks and times candidates on an open device."""

    def __init__(self, device, *, warmup: int = 5, repeats: int = 20, warm_s: float = 0.2,
                 cache_bytes: int = 256 << 20, seed: int = 0):
        self.device, self.warmup, self.repeats, self.warm_s = device, warmup, repeats, warm_s
        self.cache_bytes, self.seed = cache_bytes, seed

    def copies(self, case_bytes: int) -> int:
        """Copies of the big inputs to rotate so that this many bytes lie between reuses."""
        return max(1, min(self.warmup + self.repeats, math.ceil(self.cache_bytes / max(case_bytes, 1))))

    def tune(self, use: Use, deadline: float) -> Result:
        info = self.device.info
        rng = np.random.default_rng(self.seed)
        check = problems.case(use, rng, check=True)
        cands = prepare(check, candidates(use, info), info)
        accepted, rejected, skipped = [], [], None
        full, bufs = None, None
        try:
            for c in cands:
                if time.monotonic() > deadline and accepted:
                    skipped = f"time budget spent after {len(accepted) + len(rejected)} of {len(cands)} candidates"
                    break
                c.error = self.check(check, c)
                if c.error is None:
                    if full is None:
                        full = problems.case(use, rng, check=False)
                        bufs = self._upload(full, self.copies(full.bytes))
                    try:
                        c.us, c.spread = self.time(full, bufs, c)
                        c.figures = {"gbps": full.bytes / c.us / 1e3, "repeats": self.repeats}
                    except ZdslError as e:
                        c.error = f"does not run at full size: {e}"
                (accepted if c.error is None else rejected).append(c)
        finally:
            _free(bufs or {})
        return _finish(use, "measured", default_params(use, info), accepted, rejected, skipped)

    def check(self, case: problems.Case, c: Candidate) -> str | None:
        """None when the candidate's outputs on the check case match the reference; else why not."""
        bufs = {}
        try:
            bufs = self._upload(case, 1)
            seq = self.device.sequence()
            try:
                self._record(seq, case, c, {n: b[0] for n, b in bufs.items()})
                seq.run()
            finally:
                seq.free()
            for name, (want, tol) in case.expect(c.params).items():
                a = case.arrays[name]
                wrong = problems.close(bufs[name][0].read(a.dtype, a.shape), want, tol)
                if wrong:
                    return f"wrong {name}: {wrong}"
        except ZdslError as e:
            return f"does not run: {e}"
        finally:
            _free(bufs)
        return None

    def _upload(self, case: problems.Case, copies: int) -> dict:
        """Every array on the device: name → [the array, then its rotation copies]."""
        more = case.rotate(copies) if copies > 1 else {}
        bufs = {}
        try:
            for name, a in case.arrays.items():
                bufs[name] = []
                for i, x in enumerate([a] + more.get(name, [])):
                    bufs[name].append(self.device.upload(np.ascontiguousarray(x), name=f"{name}{i}"))
        except BaseException:
            _free(bufs)
            raise
        return bufs

    @staticmethod
    def _record(seq, case: problems.Case, c: Candidate, bufs: dict) -> None:
        for step, v in zip(case.steps, c.variants):
            v.dispatch(seq, step.groups(v), **_args(v, bufs, case.scalars))

    def time(self, case: problems.Case, bufs: dict, c: Candidate) -> tuple[float, float]:
        """Median µs of one run over the repeats that follow the warm-up, and the spread
        (p90 − p10) / median; run i takes copy i of each rotated input."""
        n = self.warmup + self.repeats
        seq = self.device.sequence(timestamps=True)
        try:
            for i in range(n):
                self._record(seq, case, c, {name: b[i % len(b)] for name, b in bufs.items()})
            end = time.monotonic() + self.warm_s
            seq.run()
            while time.monotonic() < end:
                seq.run()
            seq.run()
            ms = np.asarray([t for _, t in seq.timings()])
        finally:
            seq.free()
        per_run = np.add.reduceat(ms, np.arange(0, len(ms), len(case.steps)))[self.warmup:] * 1e3
        median = float(statistics.median(per_run))
        p10, p90 = np.percentile(per_run, [10, 90])
        return median, float((p90 - p10) / median) if median else 0.0


def _free(bufs: dict) -> None:
    for copies in bufs.values():
        for b in copies:
            b.free()


def _args(v: Variant, bufs: dict, scalars: dict) -> dict:
    """The arguments of v's dispatch: the case's buffers and scalars that v declares (a buffer or
    scalar a variant never touches may be absent from the case; the dispatch fills it in)."""
    names = [b[0] for b in v.ir.buffers]
    return {**{n: bufs[n] for n in names if n in bufs}, **{s.name: scalars[s.name] for s in v.ir.scalars
                                                           if s.name in scalars}}


# -- modelled ------------------------------------------------------------------------------------------

class Model:
    """Compiles candidates for a RADV family on the null device and ranks them with the cost model."""

    def __init__(self, target: str, info, seed: int = 0):
        self.target, self.info, self.seed = target, info, seed
        self.card = cost_model.card(target)

    def tune(self, use: Use, deadline: float) -> Result:
        """Rank every candidate (compiling takes seconds, so the deadline is not consulted)."""
        info = self.info
        case = problems.case(use, np.random.default_rng(self.seed), check=False)
        cands = prepare(case, candidates(use, info), info)
        accepted, rejected = [], []
        for c, stats in zip(cands, self._statistics(cands)):
            if isinstance(stats, str):
                c.error = stats
                rejected.append(c)
                continue
            parts = []
            for i, (step, v, s) in enumerate(zip(case.steps, c.variants, stats)):
                groups = step.groups(v)
                nbytes = step.nbytes(c.params) if step.nbytes else (case.bytes if i == 0 else 0)
                parts.append((cost_model.Dispatch(s, math.prod(groups) if isinstance(groups, tuple) else groups,
                                                  math.prod(v.ir.workgroup), v.ir.subgroup_size or info.subgroup_size),
                              nbytes))
            est = cost_model.estimate_run(self.card, parts)
            c.us = est["us"]
            c.figures = {k: stats[0][k] for k in STAT_FIGURES if k in stats[0]}
            c.figures.update({k: round(v, 4) for k, v in est.items() if k != "us"})
            accepted.append(c)
        return _finish(use, "modelled", default_params(use, info), accepted, rejected)

    def _statistics(self, cands: list[Candidate]) -> list[list[dict] | str]:
        """Per candidate, the statistics of each dispatch, or why it does not compile: all in one
        null-device process, or one by one when that fails (to find the culprit)."""
        from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

        def specs(c):
            return [ShaderSpec(v.label, v.spirv, v.bindings, v.push_size, v.spec_constants(), v.ir.subgroup_size)
                    for v in c.variants]
        try:
            flat = iter(compile_statistics(self.target, [s for c in cands for s in specs(c)]))
            return [[next(flat) for _ in c.variants] for c in cands]
        except ZdslError:
            out = []
            for c in cands:
                try:
                    out.append(compile_statistics(self.target, specs(c)))
                except ZdslError as e:
                    out.append(f"does not compile for {self.target}: {e}")
            return out
