"""Pick the fastest variant of each kernel use: measured on a device that runs code, modelled on
a compile-only RADV target.

Uses are what a graph records (`Launch`es merged by kernel and tuning key: `uses()`); each
kernel's `example` gives inputs of the use's sizes and its reference's verdict. Candidates are
the kernel's variant space and its `tune=` values, with what the launch fixes pinned, filtered
by `where=`, the device's subgroup sizes and the workgroups that trace; candidates that generate
the same code as an earlier one are dropped. The default (what `choose()` runs without an entry)
always competes, so every result says what tuning gained.

Measured: each candidate first runs a small check example against the reference (a wrong or
unbuildable candidate is rejected, with the reason), then the full use is timed with GPU
timestamps: warm-up dispatches, then repeats (median and spread), rotating copies of the big
inputs between dispatches, after replaying for a while so that the clocks are up. The first
candidate timed (the default) is timed again after the others and keeps the lower median: it
follows the CPU's making of the use's inputs, and on the H100 it read up to 4× slow there
(the prompt chunk's uses: the routed gate·up's default 2,224 µs against 557 for a
neighbour, attention's 1,788 against 951 timed alone), which favoured every other candidate.
Modelled: each candidate is compiled for the target by RADV's null device and ranked by
`cost_model` from its machine-code statistics, the bytes its launch moves and the work the
interpreter counts for one invocation of a sample of its workgroups (`work.py`).
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
from zdsl.lang.kernel import Example, Launch, Variant

from . import cost_model, machine_code
from .database import Entry, chosen_params, device_key, family, shape_key
from .work import work

SUBGROUP_SIZES = (8, 16, 32, 64, 128)
STAT_FIGURES = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Subgroups per SIMD", "VALU", "SALU", "VMEM",
                "LDS size", "Scratch size")
MARGIN = 0.02  # the default stays first unless a candidate beats it by this much: smaller
               # differences are within a measurement's noise and the model's slack


@dataclass
class Use:
    """A kernel and tuning key of a recorded step: its first launch stands for all `count`."""

    launch: Launch
    count: int = 1

    @property
    def kernel(self):
        return self.launch.kernel

    @property
    def key(self) -> dict:
        return self.launch.key

    @property
    def fixed(self) -> dict:
        return self.launch.fixed

    @property
    def role(self) -> str:
        return self.launch.label

    @property
    def ident(self) -> tuple:
        return (self.kernel.name, shape_key(self.key))

    @property
    def label(self) -> str:
        """The key, short: weight types bare, the rest as name=value."""
        return " ".join(v if isinstance(v, str) else f"{k}={v}" for k, v in self.key.items() if v != "")


def uses(launches: list[Launch]) -> list[Use]:
    """The tunable uses among `launches` (kernels with an example), merged by kernel and key."""
    out: dict[tuple, Use] = {}
    for launch in launches:
        if launch.kernel.make_example is None:
            continue  # nothing to choose (embed, advance), or tuned with another (sample_draw)
        use = Use(launch)
        if use.ident in out:
            out[use.ident].count += 1
        else:
            out[use.ident] = use
    return list(out.values())


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
    then: list = field(default_factory=list)  # launches tuned with this one (Example.then)

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def speedup(self) -> float | None:
        if self.best is None or self.default.us is None or not self.best.us:
            return None
        return self.default.us / self.best.us


TERMS = ("memory_us", "l2_us", "latency_us", "chain_us", "issue_us")
TIED_TERMS = tuple(t for t in TERMS if t != "l2_us")  # what the same code shares (`ties`)


def decided_by(card: cost_model.Card, r: Result) -> tuple[str, float, float] | None:
    """Of a modelled result: the term whose change from the default to the chosen variant, alone,
    recovers the most of the modelled gain, with its default and chosen µs (of the costliest
    dispatch); None when the default stays or nothing was modelled."""
    best, default = r.best, r.default
    if best is None or best is default or r.method != "modelled" or not default.figures:
        return None
    d, b = default.figures, best.figures
    if any(t not in d or t not in b for t in TERMS):
        return None

    def t(terms):
        return cost_model.total(card, terms, d.get("ahead", 0.0))
    base = t(d)
    gains = {k: base - t({j: b[j] if j == k else d[j] for j in TERMS}) for k in TERMS}
    term = max(TERMS, key=gains.get) if max(gains.values()) > 0 else d.get("bound", "chain") + "_us"
    return term.removesuffix("_us"), d[term], b[term]


def ties(r: Result) -> list[tuple[str, list[Candidate]]]:
    """The modelled candidates that tie (the same µs), each group with why the model cannot tell
    them apart: the memory or L2 term binds them all (they move the same bytes; the lanes' limits
    lie under it), or their statistics, rounds and the terms of their path are the same (their
    code differs in constants only, such as the rows a workgroup's NSUB subgroups start at: the
    same instructions, waves and occupancy; the bigger workgroup reads its shared rows through
    the L2 fewer times, under the path); anything else is an unexplained tie."""
    groups: dict[float, list[Candidate]] = {}
    for c in r.ranked:
        groups.setdefault(round(c.us, 6), []).append(c)
    out = []
    for cs in groups.values():
        if len(cs) < 2:
            continue
        bounds = {c.figures.get("bound") for c in cs}
        if len(bounds) == 1 and bounds <= {"memory", "l2"}:
            why = bounds.pop()
        elif len({tuple(c.figures.get(k) for k in (*STAT_FIGURES, *TIED_TERMS, "rounds")) for c in cs}) == 1:
            why = "same code figures"
        else:
            why = "unexplained"
        out.append((why, cs))
    return out


def subgroup_sizes(info) -> tuple[int, ...]:
    if "subgroup_size_control" in info.features:
        return tuple(s for s in SUBGROUP_SIZES if info.min_subgroup_size <= s <= info.max_subgroup_size)
    return (info.subgroup_size,)


def default_params(use: Use, info) -> dict:
    """What `choose()` runs for this use without an entry of its own: at several rows the one-row
    entry where the database has one, else the kernel's defaults (where the kernel refuses them at
    the device's subgroup size, the first declared choice it accepts, as `choose()` takes)."""
    return use.kernel.complete(chosen_params(use.kernel, info, use.key, own_entry=False, **use.fixed))


def candidates(use: Use, info) -> list[Candidate]:
    """The default first, then every other combination of the tunable values."""
    k = use.kernel
    sizes = subgroup_sizes(info)
    keys = list(dict.fromkeys([*k.variant_space, *k.tune, *([k.subgroup] if k.subgroup else [])]))
    free = [key for key in keys if key not in use.fixed]
    values = []
    for key in free:
        vals = list(dict.fromkeys(k.variant_space.get(key, []) + k.tune.get(key, [])))
        if key == k.subgroup:
            vals = [s for s in (vals or sizes) if s in sizes]
        values.append(vals)
    default = default_params(use, info)
    out, seen = [], set()
    for combo in itertools.chain([tuple(default[key] for key in free)], itertools.product(*values)):
        params = k.complete({**use.fixed, **dict(zip(free, combo))})
        ident = tuple(sorted((n, repr(v)) for n, v in params.items()))
        if ident in seen or (k.constraint is not None and not k.constraint(SimpleNamespace(**params))):
            continue
        seen.add(ident)
        out.append(Candidate(params, {key: params[key] for key in free}))
    return out


def variants(use: Use, example: Example, params: dict) -> list[Variant]:
    """The launches of one candidate: the use's kernel, then those the example tunes with it."""
    return [use.kernel.specialize(**params)] + [k.specialize(**fixed(params), **tuned(params))
                                                for k, fixed, tuned in example.then]


def prepare(use: Use, example: Example, cands: list[Candidate], info) -> list[Candidate]:
    """Trace each candidate's launches; drop those whose workgroup does not trace or does not
    fit the device, and those whose code equals an earlier candidate's."""
    out, seen = [], set()
    for c in cands:
        try:
            c.variants = variants(use, example, c.params)
            code = tuple((v.glsl, tuple(sorted(v.spec_constants().items()))) for v in c.variants)
        except ZdslError:
            continue  # a combination the kernel does not build (e.g. a workgroup that is not whole blocks)
        if any(math.prod(v.ir.workgroup) > info.max_workgroup_invocations for v in c.variants) or code in seen:
            continue
        seen.add(code)
        out.append(c)
    return out


def sizes_of(example: Example) -> dict:
    """The scalars and launch sizes of an example (its arguments that are not arrays)."""
    return {n: v for n, v in example.args.items() if not isinstance(v, np.ndarray)}


def launch_of(v: Variant, example: Example) -> tuple[tuple, int]:
    """(groups, bytes moved) of variant v run on the example."""
    sizes = sizes_of(example)
    return v.kernel.groups(v.params, sizes), v.kernel.bytes_moved(v.params, sizes)


def _finish(use: Use, method: str, default_ident: dict, accepted: list[Candidate], rejected: list[Candidate],
            skipped: str | None = None, then=()) -> Result:
    # modelled ties (candidates that one term decides alike) rank by the lane's path, then issue,
    # then the smaller workgroup (equal in all the model counts: the finer grain to schedule)
    accepted.sort(key=lambda c: (c.us, c.figures.get("chain_us", 0.0), c.figures.get("issue_us", 0.0),
                                 math.prod(c.variants[0].ir.workgroup) if c.variants else 0))
    default = next((c for c in accepted + rejected if c.params == default_ident), None)
    if default is None:
        default = Candidate(default_ident, {}, error="not built on this device")
    elif default.error is None and accepted[0].us * (1 + MARGIN) > default.us:
        accepted.remove(default)
        accepted.insert(0, default)
    return Result(use, method, default, accepted, rejected, skipped, list(then))


def entries(result: Result, info, chosen: Candidate | None = None, **extra) -> list[Entry]:
    """Database entries for the best candidate, or for `chosen` (and for the launches tuned with
    it); `extra` figures are added to the entry."""
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
    for kernel, fixed, tuned in result.then:
        key = {**fixed(best.params), **{n: result.use.launch.sizes[n] for n in kernel.key}}
        out.append(Entry(kernel=kernel.name, shape=key, params=tuned(best.params), us=None, figures={}, **base))
    return out


# -- measured ------------------------------------------------------------------------------------------

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


class Measure:
    """Checks and times candidates on an open device."""

    def __init__(self, device, *, warmup: int = 5, repeats: int = 20, warm_s: float = 0.2,
                 cache_bytes: int = 256 << 20, seed: int = 0):
        self.device, self.warmup, self.repeats, self.warm_s = device, warmup, repeats, warm_s
        self.cache_bytes, self.seed = cache_bytes, seed

    def copies(self, nbytes: int) -> int:
        """Copies of the big inputs to rotate so that this many bytes lie between reuses."""
        return max(1, min(self.warmup + self.repeats, math.ceil(self.cache_bytes / max(nbytes, 1))))

    def tune(self, use: Use, deadline: float) -> Result:
        info = self.device.info
        rng = np.random.default_rng(self.seed)
        check = use.kernel.make_example(use.launch, rng, True)
        cands = prepare(use, check, candidates(use, info), info)
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
                        full = use.kernel.make_example(use.launch, rng, False)
                        bufs = self.upload(full, self.copies(launch_of(c.variants[0], full)[1]))
                    try:
                        c.us, c.spread = self.time(full, bufs, c.variants)
                    except ZdslError as e:
                        c.error = f"does not run at full size: {e}"
                (accepted if c.error is None else rejected).append(c)
            if len(accepted) > 1:  # the first is timed again after the rest (see the module's docstring)
                first = accepted[0]
                first.us, first.spread = min((first.us, first.spread), self.time(full, bufs, first.variants))
            for c in accepted:
                c.figures = {"gbps": sum(launch_of(v, full)[1] for v in c.variants) / c.us / 1e3,
                             "repeats": self.repeats}
        finally:
            free(bufs or {})
        return _finish(use, "measured", default_params(use, info), accepted, rejected, skipped, check.then)

    def check(self, example: Example, c: Candidate) -> str | None:
        """None when the candidate's outputs on the check example match the reference; else why not."""
        bufs = {}
        try:
            bufs = self.upload(example, 1)
            seq = self.device.sequence()
            try:
                record(seq, example, c.variants, {n: b[0] for n, b in bufs.items()})
                seq.run()
            finally:
                seq.free()
            for name, (want, tol) in example.expect(c.params).items():
                a = example.args[name]
                wrong = close(bufs[name][0].read(a.dtype, a.shape), want, tol)
                if wrong:
                    return f"wrong {name}: {wrong}"
        except ZdslError as e:
            return f"does not run: {e}"
        finally:
            free(bufs)
        return None

    def upload(self, example: Example, copies: int) -> dict:
        """Every array on the device: name → [the array, then its rotation copies]."""
        more = example.rotate(copies) if copies > 1 else {}
        bufs = {}
        try:
            for name, a in example.args.items():
                if isinstance(a, np.ndarray):
                    bufs[name] = [self.device.upload(np.ascontiguousarray(x), name=f"{name}{i}")
                                  for i, x in enumerate([a] + more.get(name, []))]
        except BaseException:
            free(bufs)
            raise
        return bufs

    def time(self, example: Example, bufs: dict, launches: list[Variant]) -> tuple[float, float]:
        """Median µs of one run of the launches over the repeats that follow the warm-up, and the
        spread (p90 − p10) / median; run i takes copy i of each rotated input."""
        n = self.warmup + self.repeats
        seq = self.device.sequence(timestamps=True)
        try:
            for i in range(n):
                record(seq, example, launches, {name: b[i % len(b)] for name, b in bufs.items()})
            end = time.monotonic() + self.warm_s
            seq.run()
            while time.monotonic() < end:
                seq.run()
            seq.run()
            ms = np.asarray([t for _, t in seq.timings()])
        finally:
            seq.free()
        per_run = np.add.reduceat(ms, np.arange(0, len(ms), len(launches)))[self.warmup:] * 1e3
        median = float(statistics.median(per_run))
        p10, p90 = np.percentile(per_run, [10, 90])
        return median, float((p90 - p10) / median) if median else 0.0


def record(seq, example: Example, launches: list[Variant], bufs: dict) -> None:
    """Dispatch the launches on the example's buffers (`bufs`, by name) and scalars."""
    for v in launches:
        groups, _ = launch_of(v, example)
        v.dispatch(seq, groups, **_args(v, bufs, example.args))


def free(bufs: dict) -> None:
    for copies in bufs.values():
        for b in copies:
            b.free()


def _args(v: Variant, bufs: dict, args: dict) -> dict:
    """The arguments of v's dispatch: the buffers and scalars that v declares (one a variant never
    touches may be absent from the example; the dispatch fills it in)."""
    names = [b[0] for b in v.ir.buffers]
    return {**{n: bufs[n] for n in names if n in bufs}, **{s.name: args[s.name] for s in v.ir.scalars
                                                           if s.name in args}}


# -- modelled ------------------------------------------------------------------------------------------

class Model:
    """Compiles candidates for a RADV family on the null device and ranks them with the cost model."""

    def __init__(self, target: str, info, seed: int = 0):
        self.target, self.info, self.seed = target, info, seed
        self.card = cost_model.card(target)

    def tune(self, use: Use, deadline: float) -> Result:
        """Rank every candidate (compiling takes seconds, so the deadline is not consulted)."""
        info = self.info
        example = use.kernel.make_example(use.launch, np.random.default_rng(self.seed), False)
        cands = prepare(use, example, candidates(use, info), info)
        accepted, rejected = [], []
        for c, stats in zip(cands, self._statistics(cands)):
            if isinstance(stats, str):
                c.error = stats
                rejected.append(c)
                continue
            parts = []
            for v, s in zip(c.variants, stats):
                groups, nbytes = launch_of(v, example)
                parts.append(cost_model.Dispatch(s, math.prod(groups), math.prod(v.ir.workgroup),
                                                 v.ir.subgroup_size or info.subgroup_size, nbytes,
                                                 work(v, example.args, groups)))
            est = cost_model.estimate_run(self.card, parts)
            c.us = est["us"]
            c.figures = {k: stats[0][k] for k in STAT_FIGURES if k in stats[0]}
            c.figures.update({k: round(v, 4) if isinstance(v, float) else v for k, v in est.items() if k != "us"})
            accepted.append(c)
        return _finish(use, "modelled", default_params(use, info), accepted, rejected, then=example.then)

    def _statistics(self, cands: list[Candidate]) -> list[list[dict] | str]:
        """Per candidate, the statistics of each dispatch, or why it does not compile: all in one
        null-device process, or one by one when that fails (to find the culprit)."""
        from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

        def specs(c):
            return [ShaderSpec(v.label, v.spirv, v.bindings, v.push_size, v.spec_constants(), v.ir.subgroup_size)
                    for v in c.variants]
        def compiled(shaders):
            return [_with_loop_depths(s) for s in compile_statistics(self.target, shaders, isa=True)]
        try:
            flat = iter(compiled([s for c in cands for s in specs(c)]))
            return [[next(flat) for _ in c.variants] for c in cands]
        except ZdslError:
            out = []
            for c in cands:
                try:
                    out.append(compiled(specs(c)))
                except ZdslError as e:
                    out.append(f"does not compile for {self.target}: {e}")
            return out


def _with_loop_depths(stats: dict) -> dict:
    """The driver's statistics with the code's instructions by loop depth in place of its listing."""
    stats = dict(stats)
    listing = stats.pop("isa", None)
    if listing:
        stats[cost_model.LOOP_DEPTHS] = machine_code.aco_loop_depths(listing)
    return stats
