"""A static cost model: rank kernel variants from the driver's statistics of their machine code
and the work the interpreter counts for one invocation (`work.Work`).

A compile-only target (RADV's null device) compiles each candidate to real code but cannot run
it, so its time is modelled; on a device that runs code `zdsl tune --check-model` puts the same
model beside the measurement. Decode kernels move their bytes once, and most of them are too
short to reach the card's bandwidth, so the model asks whether the bytes or the lanes' path
bind. A lane's path is rounds (`Work.rounds`: the loop trips at the use's sizes, each a batch
of loads and the work on them); a round waits its loads' latency, then works:

    t = max(t_memory, t_l2, (1 − a) · (t_latency + t_work) + a · max(t_latency, t_work)) + LAUNCH_US
    t_work = (t_chain^p + t_issue^p)^(1/p)

- **Memory.** The bytes the launch moves at the card's bandwidth.
- **L2.** The bytes the workgroups pull through the L2 (`Work.sectors`: each one's distinct
  32-byte sectors) at its bandwidth: tiles that each read the same activations again move more
  through the L2 than from memory (on the H100 the router's f32 product at 8 rows a workgroup
  reads 277 MB through it, at 4 rows 409 MB, and takes 34.4 µs against 42.3).
- **Latency (Little's law).** rounds × the memory latency a lane sees. The groups a unit holds
  at once run their paths together and more come in waves of that many, so a variant with few
  lanes or many rounds keeps too few bytes in flight to reach the bandwidth. A round whose
  loads were issued a round ahead (a, `Work.ahead`: mma.Staged's registers, attention's next
  block of the cache) waits only for what its work does not cover.
- **Chain.** The instructions on the busiest lane's path, one after another, at `cpi` cycles
  each: the machine code's static count × how often its operations run on the invocation that
  does the most (`Work.path_repeats`; its workgroup waits for it at every barrier), or, where
  the code's instructions at each loop depth are known (`executed_instructions`), each depth's
  count × how often a wave runs that depth. Then the
  unit's shared-memory traffic (`Work.shared`: a matrix-unit product's tiles, of all the groups
  it holds) at `shared_efficiency` of its bandwidth: a round's tiles are written, then read
  after a barrier, so every lane's path waits for the whole unit's traffic, and the lane's own
  instructions wait on the shared loads they use.
- **Issue.** The busiest unit's waves' instructions (all its resident groups', or the few a
  small grid gives it) through its issue slots (wave64 on a SIMD32 takes more than one pass) at
  `issue_efficiency` of the nominal rate.

Chain and issue are not separate resources: a lane's path is its stalls and its own issue, and
the other lanes' issue fills its stalls only in part (lanes stall together at a barrier, and a
lane that has work ready waits behind the others'). So they combine by a p-norm, from their sum
(p = 1: no overlap) towards their max (p → ∞: each hides the other wholly); p is fitted with the
other free parameters, 2 where nothing was measured. Where it misses: docs/DESIGN.md.

Occupancy follows each vendor's rules: NVIDIA's from the driver's register count (allocated per
warp in units of 256) and shared memory (the share the driver gives workgroups, 100 KiB of an
H100's 228, plus 1 KiB it reserves per block), under 64 warps and 32 blocks per SM; RDNA's from
the compiler's waves per SIMD (its VGPR budget) and LDS per workgroup, under the workgroups a CU
holds. Card figures are public specifications; `latency_ns`, `cpi`, `issue_efficiency`,
`overlap` (p), `shared_efficiency` and `l2_bytes_per_clock` are the free parameters, fitted on
measurement where a card of that kind ran (`check.py`), nominal guesses elsewhere. Its
microseconds are for ranking the variants of one kernel at one shape, not predictions of a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zdsl.errors import ZdslError

from .work import SECTOR, Work

LAUNCH_US = 2.0  # fixed cost of a dependent dispatch
SASS_BYTES = 16  # bytes per NVIDIA machine instruction (Volta and later)
LOOP_DEPTHS = "Instructions by loop depth"  # a statistic read from the machine code (machine_code.py)


@dataclass(frozen=True)
class Card:
    """Figures of one GPU: nominal where public, fitted where it ran (latency, cpi, efficiency)."""
    name: str
    isa: str                # "nvidia" or "rdna": which occupancy rules and statistics apply
    units: int              # SMs or CUs
    bandwidth_gbs: float
    clock_ghz: float
    latency_ns: float       # free: a round of loads' latency as a lane sees it
    cpi: float = 16.0       # free: cycles per dependent instruction on a lane's path
    issue_efficiency: float = 0.5  # free: share of the nominal issue rate reached
    overlap: float = 2.0    # free: p of the p-norm that combines the chain and issue limits (inf: their max)
    issue: int = 4          # wave instructions issued per clock per unit (SM schedulers, CU SIMDs)
    wave: int = 32          # the native wave (NVIDIA warp, RDNA SIMD32)
    max_waves: int = 64     # resident waves per unit (NVIDIA)
    max_groups: int = 32    # resident workgroups per unit
    registers: int = 65536  # 32-bit registers per unit (NVIDIA)
    register_granule: int = 256  # registers a warp's allocation is rounded up to (NVIDIA)
    shared: int = 233472    # shared memory (LDS) bytes per unit for workgroups (the driver's carveout)
    shared_reserve: int = 1024   # bytes the driver keeps per resident workgroup (NVIDIA)
    wave64_passes: float = 1.5   # SIMD32 passes per wave64 vector instruction (RDNA; 2 without dual issue)
    shared_bandwidth: int = 128  # shared memory (LDS) bytes per clock per unit
    shared_efficiency: float = 0.5  # free: share of that bandwidth a round's tiles get (bank
                                    # conflicts, the matrix loads' layout); 0.5 on the H100
    l2_bytes_per_clock: float = 32.0  # free: the L2's read bytes per clock per unit (32 is a
                                      # guess; the H100's folds fit 24-32: 6.3-8.4 TB/s)
    sm: str = ""                 # the architecture nvdisasm reads the machine code as (NVIDIA)

    @property
    def bytes_per_us(self) -> float:
        return self.bandwidth_gbs * 1e3


def _rdna(name, cus, bandwidth, clock, latency=600.0, **more) -> Card:
    """An RDNA card: 2 SIMD32 per CU, 16 waves per SIMD; LDS 64 KiB per CU (128 KiB per WGP of
    two CUs, the mode RADV compiles compute for); a WGP holds 32 workgroups, 16 per CU."""
    return Card(name, "rdna", cus, bandwidth, clock, latency, issue=2, max_waves=32, max_groups=16,
                registers=0, register_granule=0, shared=65536, shared_reserve=0, **more)


# Families by RADV's names (RADV_FORCE_FAMILY) and NVIDIA cards by a word of their device name.
# RDNA latency, cpi and efficiency are not measured: they stay at the nominal guesses.
CARDS = {
    # Hopper's SM has 228 KiB for shared memory, but NVIDIA's Vulkan driver gives workgroups 100
    # KiB of it: the 35B-A3B's experts' gate·up (102 registers: 4 workgroups an SM by
    # registers) with its shared array grown from 22,144 to 24,192 bytes took 24.0 → 24.1 ms a
    # 511-token chunk, to 26,240 (4 × 27,264 > 102,400: 3 an SM) 37.7 ms; its down (6 → 5 → 4
    # an SM by 100 KiB) 16.3 → 18.0 → 23.8.
    "h100": Card("NVIDIA H100 SXM (Hopper)", "nvidia", 132, 3350, 1.98, 200.0, shared=102400, sm="SM90"),
    "h200": Card("NVIDIA H200 SXM (Hopper)", "nvidia", 132, 4800, 1.98, 200.0, shared=102400, sm="SM90"),
    "gfx1201": _rdna("Radeon AI PRO R9700 / RX 9070 XT (RDNA4)", 64, 640, 2.9),
    "gfx1200": _rdna("Radeon RX 9060 XT (RDNA4)", 32, 320, 3.1),
    "gfx1151": _rdna("Radeon 8060S, Strix Halo (RDNA3.5)", 40, 256, 2.9, 800.0),
    "gfx1150": _rdna("Radeon 890M, Strix Point (RDNA3.5)", 16, 120, 2.9, 800.0),
    "navi31": _rdna("Radeon RX 7900 XTX (RDNA3)", 96, 960, 2.5),
    "navi32": _rdna("Radeon RX 7800 XT (RDNA3)", 60, 624, 2.4),
    "navi33": _rdna("Radeon RX 7600 (RDNA3)", 32, 288, 2.6),
    "navi21": _rdna("Radeon RX 6900 XT (RDNA2)", 80, 512, 2.25, wave64_passes=2.0),
}


def card(name: str) -> Card:
    try:
        return CARDS[name.lower()]
    except KeyError:
        raise ZdslError(f"no cost-model figures for '{name}'; known: {', '.join(CARDS)} "
                        "(add the card to CARDS in autotune/cost_model.py)") from None


def card_of(device_name: str) -> Card:
    """The figures of a device that runs code, by a word of its name ("NVIDIA H100 80GB HBM3")."""
    words = device_name.lower().replace("(", " ").replace(")", " ").split()
    found = [CARDS[w] for w in words if w in CARDS]
    if not found:
        raise ZdslError(f"no cost-model figures for {device_name}; known: {', '.join(CARDS)} "
                        "(add the card to CARDS in autotune/cost_model.py)")
    return found[0]


def combined(chain, issue, p):
    """The p-norm of the chain and issue limits: their sum at p = 1, their max as p → ∞ (numbers
    or arrays alike)."""
    top = np.maximum(chain, issue)
    scale = np.where(top > 0, top, 1.0)
    q = np.where(np.isinf(p), 1.0, p)
    norm = np.where(top > 0, scale * ((chain / scale) ** q + (issue / scale) ** q) ** (1 / q), 0.0)
    out = np.where(np.isinf(p), top, norm)
    return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class Dispatch:
    """What the model needs of one compiled dispatch."""
    stats: dict        # the driver's statistics of the pipeline
    groups: int        # workgroups in the grid
    workgroup: int     # invocations per workgroup
    wave: int          # subgroup size it runs at
    nbytes: float      # bytes the launch moves
    work: Work | None  # one invocation's executed work; None: each statement once


def groups_per_unit(c: Card, d: Dispatch) -> int:
    """Workgroups one SM or CU holds at once (at least 1: a dispatch that fits nowhere is refused
    before it gets here)."""
    s = d.stats
    waves = math.ceil(d.workgroup / d.wave) if c.isa == "rdna" else math.ceil(d.workgroup / c.wave)
    limits = [c.max_groups, c.max_waves // waves]
    if c.isa == "nvidia":
        per_warp = math.ceil(max(1, int(s.get("Register Count", 32))) * c.wave / c.register_granule) \
            * c.register_granule
        limits.append(c.registers // (per_warp * waves))
        shared = int(s.get("Shared Memory Size", 0))
    else:
        per_simd = int(s.get("Subgroups per SIMD", 16))
        limits.append(per_simd * c.issue // waves)
        shared = int(s.get("LDS size", 0))
    if shared:
        limits.append(c.shared // (shared + c.shared_reserve))
    return max(1, min(limits))


def static_instructions(c: Card, d: Dispatch) -> float:
    """Machine instructions in the code, counted once, in SIMD passes: NVIDIA's those its loop
    depths count, or the binary's size, RDNA's from the compiler's counts (wave64 vector
    instructions take more than one pass)."""
    s = d.stats
    if c.isa == "nvidia":
        return max(1.0, sum(s.get(LOOP_DEPTHS, ())) or s.get("Binary Size", 0) / SASS_BYTES)
    passes = c.wave64_passes if d.wave == 64 else 1.0
    return max(1.0, s.get("VALU", 0) * passes + s.get("SALU", 0) + s.get("VMEM", 0) + s.get("SMEM", 0)
               + 2 * s.get("Spilled SGPRs", 0))


def executed_instructions(c: Card, d: Dispatch) -> tuple[float, float]:
    """A wave's machine instructions as they run, on average and on the busiest invocation's path.
    Where the statistics count the code's instructions at each loop depth (read from the machine
    code: `machine_code`), the static count is spread over the depths as the code's instructions
    are, and each depth's share runs as often as a subgroup ran that depth's operations in the
    interpreter: the decode a bigger workgroup shares out shrinks, a matrix product each wave
    does whole does not. Elsewhere the static count runs as often as the average operation."""
    w = d.work
    static = static_instructions(c, d)
    if w is None:
        return static, static
    depths = d.stats.get(LOOP_DEPTHS)
    if depths and sum(depths) and w.loop_runs:
        runs = sum(n * w.runs_at(depth) for depth, n in enumerate(depths)) / sum(depths)
        return static * runs, static * runs * w.path_repeats / max(w.repeats, 1e-9)
    return static * w.repeats, static * w.path_repeats


def terms(c: Card, d: Dispatch) -> dict:
    """The terms of one dispatch (µs), the share of its rounds issued ahead, its groups a unit and
    rounds. The card's free parameters may be arrays (a grid of them, as `check.fit` tries): the
    terms are then arrays too."""
    w = d.work
    rounds = max(1.0, w.rounds) if w else 1.0
    executed, longest = executed_instructions(c, d)
    waves_per_group = math.ceil(d.workgroup / d.wave)
    # the busiest unit's workgroups at once: as many as it holds, fewer where the grid is small
    busiest = min(groups_per_unit(c, d), math.ceil(d.groups / c.units))
    waves = max(1.0, d.groups / (c.units * busiest))
    spill = 8.0 * d.stats.get("Spilled VGPRs", 0) * rounds * d.groups * d.workgroup
    clock = c.clock_ghz * 1e3  # cycles per µs
    # cycles of the unit's shared-memory traffic (its groups' tiles)
    shared = busiest * d.workgroup * (w.shared if w else 0.0) / (c.shared_bandwidth * c.shared_efficiency)
    return {
        "memory_us": (d.nbytes + spill) / c.bytes_per_us,
        "l2_us": d.groups * (w.sectors if w else 0.0) * SECTOR / (c.l2_bytes_per_clock * c.units * clock),
        "latency_us": waves * rounds * c.latency_ns * 1e-3,
        "chain_us": waves * (longest * c.cpi + shared) / clock,
        "issue_us": waves * busiest * waves_per_group * executed / (c.issue * c.issue_efficiency) / clock,
        "ahead": min(w.ahead, rounds) / rounds if w else 0.0, "groups_per_unit": busiest, "rounds": rounds,
    }


def estimate(c: Card, d: Dispatch) -> dict:
    """Modelled µs of one dispatch, with the terms it came from and the one that decided it."""
    t = terms(c, d)
    lanes = {k: t[k] for k in ("latency_us", "chain_us", "issue_us")}
    floor = max(FLOORS, key=t.get)
    bound = floor if t[floor] >= path(c, t, t["ahead"]) else max(lanes, key=lanes.get)
    return {"us": total(c, t, t["ahead"]), **t, "bound": bound.removesuffix("_us")}


def path(c: Card, terms: dict, ahead: float):
    """The lanes' path: a round's work is its chain and issue limits by the p-norm; a round waits
    its latency before that work, or, where its loads were issued a round ahead (`ahead` of the
    rounds), the longer of the two."""
    work = combined(terms["chain_us"], terms["issue_us"], c.overlap)
    wait = terms["latency_us"]
    return (1 - ahead) * (wait + work) + ahead * np.maximum(wait, work)


FLOORS = ("memory_us", "l2_us")  # the terms a launch's bytes set, under which no path goes


def total(c: Card, terms: dict, ahead: float):
    """µs from the terms: the bytes' floors or the lanes' path, whichever is longest, and the launch."""
    out = np.maximum(np.maximum(terms["memory_us"], terms["l2_us"]), path(c, terms, ahead)) + LAUNCH_US
    return float(out) if np.ndim(out) == 0 else out


def estimate_run(c: Card, parts: list[Dispatch]) -> dict:
    """A run of dispatches (the sampler's two passes): the sum of their times, with the terms of
    the costliest."""
    est = [estimate(c, d) for d in parts]
    main = max(est, key=lambda e: e["us"])
    return {**main, "us": sum(e["us"] for e in est)}
