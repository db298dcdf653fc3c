"""A cost model for compile-only targets: rank kernel variants from RADV's machine-code statistics.

The null device compiles each candidate to real RDNA code but cannot run it, so a candidate's
time is modelled, not measured. Decode kernels stream weights once, so the model starts from
the bytes a dispatch moves and asks what keeps the card from moving them at full bandwidth:

    t = max(t_memory, t_issue) + t_launch

- **Memory, with latency hiding.** By Little's law the card reaches its bandwidth B only with
  B · latency bytes in flight. The waves resident at once are min(grid waves, SIMDs ·
  "Subgroups per SIMD") — the occupancy the compiler reports after register and LDS allocation —
  and each keeps about VMEM × LANE_BYTES bytes per lane in flight (its vector-memory
  instructions issue together, one loop trip apart), and never more than the dispatch moves.
  The occupancy factor is min(1, in-flight bytes / (B · latency)), and t_memory = (bytes + spill
  traffic) / (B · factor): a dispatch too small to fill the pipe costs at least one latency.
- **Spills.** Every spilled VGPR is stored and reloaded through scratch memory once per loop trip
  of every lane: 8 bytes × spilled VGPRs × trips × lanes of extra traffic. Spilled SGPRs go to
  VGPR lanes: two instructions each per trip.
- **Issue.** The static instruction counts stand for one loop trip: a wave issues VALU cycles
  (× the card's wave64 passes for wave64: a SIMD32 takes a wave64 vector instruction in two
  passes, RDNA3 and later dual-issue part of them in one; wave32 gains from VOPD dual issue,
  which already shrinks its VALU count) plus SALU and VMEM, every trip. Trips per lane are the
  lane's share of the bytes over what one trip loads (VMEM × LANE_BYTES), at least one.
  t_issue = waves per SIMD × trips × cycles per trip / clock.
- **Launch.** A fixed LAUNCH_US per dispatch (dependent dispatches in a decode step pay it).

The figures are nominal (public specifications) and the model is coarse: it knows nothing of
caches, so reused activations count as fresh loads in the trip estimate. It is for ranking the
variants of one kernel at one shape, where those errors are shared; its microseconds are
estimates, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zdsl.errors import ZdslError

LANE_BYTES = 16   # bytes a lane moves per vector-memory instruction in a streaming loop (16-byte loads)
LAUNCH_US = 2.0   # fixed cost of a dependent dispatch


@dataclass(frozen=True)
class Card:
    """Nominal figures of the fastest card of a RADV family."""
    name: str
    cus: int
    bandwidth_gbs: float
    clock_ghz: float
    latency_ns: float      # DRAM load latency seen by a wave
    wave64_passes: float = 1.5  # SIMD passes per wave64 VALU instruction (2 without dual issue)
    simds_per_cu: int = 2  # SIMD32 units per compute unit (RDNA)

    @property
    def simds(self) -> int:
        return self.cus * self.simds_per_cu


# RADV family names (RADV_FORCE_FAMILY) → figures. Latencies: ~600 ns for GDDR6 cards, more on
# LPDDR5X APUs. Wave64 passes: 1.5 where about half the vector instructions dual-issue (RDNA3+).
CARDS = {
    "gfx1201": Card("Radeon AI PRO R9700 / RX 9070 XT (RDNA4)", 64, 640, 2.9, 600),
    "gfx1200": Card("Radeon RX 9060 XT (RDNA4)", 32, 320, 3.1, 600),
    "gfx1151": Card("Radeon 8060S, Strix Halo (RDNA3.5)", 40, 256, 2.9, 800),
    "gfx1150": Card("Radeon 890M, Strix Point (RDNA3.5)", 16, 120, 2.9, 800),
    "navi31": Card("Radeon RX 7900 XTX (RDNA3)", 96, 960, 2.5, 600),
    "navi32": Card("Radeon RX 7800 XT (RDNA3)", 60, 624, 2.4, 600),
    "navi33": Card("Radeon RX 7600 (RDNA3)", 32, 288, 2.6, 600),
    "navi21": Card("Radeon RX 6900 XT (RDNA2)", 80, 512, 2.25, 600, wave64_passes=2.0),
}


def card(family: str) -> Card:
    try:
        return CARDS[family.lower()]
    except KeyError:
        raise ZdslError(f"no cost-model figures for '{family}'; known: {', '.join(CARDS)} "
                        "(add the card to CARDS in autotune/cost_model.py)") from None


@dataclass(frozen=True)
class Dispatch:
    """What the model needs of one compiled dispatch."""
    stats: dict      # RADV statistics of the pipeline
    groups: int      # workgroups in the grid
    workgroup: int   # invocations per workgroup
    wave: int        # subgroup size (32 or 64)


def estimate(c: Card, d: Dispatch, nbytes: float) -> dict:
    """Modelled µs of one dispatch moving `nbytes`, with the terms it came from."""
    s = d.stats
    waves_per_group = math.ceil(d.workgroup / d.wave)
    waves = d.groups * waves_per_group
    lanes = d.groups * d.workgroup
    occupancy = max(1, int(s.get("Subgroups per SIMD", 1)))
    vmem = max(1, int(s.get("VMEM", 1)))
    trips = max(1.0, nbytes / lanes / (vmem * LANE_BYTES))
    resident = min(waves, c.simds * occupancy)
    in_flight = min(resident * d.wave * vmem * LANE_BYTES, nbytes) if nbytes else 1.0
    bandwidth = c.bandwidth_gbs * 1e3  # bytes per µs
    factor = min(1.0, in_flight / (bandwidth * c.latency_ns * 1e-3))
    spill = 8.0 * s.get("Spilled VGPRs", 0) * trips * lanes
    t_memory = (nbytes + spill) / (bandwidth * factor)
    passes = c.wave64_passes if d.wave == 64 else 1.0
    cycles = s.get("VALU", 0) * passes + s.get("SALU", 0) + vmem + 2 * s.get("Spilled SGPRs", 0)
    t_issue = max(1.0, waves / c.simds) * trips * cycles / (c.clock_ghz * 1e3)
    return {"us": max(t_memory, t_issue) + LAUNCH_US, "memory_us": t_memory, "issue_us": t_issue,
            "occupancy_factor": factor, "trips": trips}


def estimate_run(c: Card, parts: list[tuple[Dispatch, float]]) -> dict:
    """A run of dispatches, each with the bytes it moves (the sampler's two passes): the sum of
    their times, with the terms of the costliest."""
    est = [estimate(c, d, nbytes) for d, nbytes in parts]
    main = max(est, key=lambda e: e["us"])
    return {**main, "us": sum(e["us"] for e in est)}
