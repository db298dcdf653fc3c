"""Does warming a kernel's code ahead of its dispatch pay? (docs/PERF.md, 2026-11-24: no.)

Records the decode step again with a one-workgroup "shadow" before each dispatch: recorded with
no barrier, so it runs in the stage before, beside the dispatch before it, and writing only
scratch (every buffer the kernel writes is swapped for a slice of one scratch buffer). If each
kernel's code comes from memory at each use, the shadow brings it into L2 before the real
dispatch needs it. The sampler, the position advance and the embedding get no shadow (their
writes steer the next step). Prints whole-step times, plain and shadowed, alternating.

Usage: python3 code_shadows.py MODEL.gguf [ROUNDS (default 4)]"""
import statistics
import sys

from zdsl.autotune import in_place
from zdsl.models.qwen35.gguf_file import open_model
from zdsl.models.qwen35.graph import DecodeGraph
from zdsl.runtime import open_device
from zdsl.runtime.sequence import Sequence

SKIP = ("sample", "advance", "embed")
plain = Sequence.dispatch
state = {"scratch": None, "shadows": 0}


def untracked(self, reads, writes, stage):
    """Sequence._order without the barrier bookkeeping: a shadow neither waits nor is waited for."""
    self._check_recording()


def shadowed(self, pipe, groups, buffers, push=b"", label=""):
    """Sequence.dispatch, after a one-workgroup shadow of the same dispatch."""
    scratch = state["scratch"]
    if not any(s in label for s in SKIP) and all(b.nbytes <= scratch.nbytes for b in buffers):
        twins = [scratch.slice(0, b.nbytes) if w else b for b, (r, w) in zip(buffers, pipe.access)]
        self._order = untracked.__get__(self)
        try:
            plain(self, pipe, (1, 1, 1), twins, push, label + " (shadow)")
        finally:
            del self._order
        state["shadows"] += 1
    plain(self, pipe, groups, buffers, push, label)


model = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
dev = open_device("0")
g = DecodeGraph(open_model(model), dev, n_ctx=1024, progress=False)
pos = 512
state["scratch"] = dev.alloc(64 << 20, name="shadow scratch")
times = {"plain": [], "shadowed": []}
for r in range(rounds):
    for side in (("plain", "shadowed") if r % 2 == 0 else ("shadowed", "plain")):
        Sequence.dispatch = shadowed if side == "shadowed" else plain
        state["shadows"] = 0
        g.retune(None)
        Sequence.dispatch = plain
        ms = [1e3 * in_place.step_ms(g, pos, 8, 64) for _ in range(5)]
        times[side].append(statistics.median(ms))
        print(f"{side}: {times[side][-1]:.1f} µs/token ({state['shadows'] // 2} shadows per step)", flush=True)
for side, t in times.items():
    print(f"{side}: median {statistics.median(t):.1f} µs/token over {len(t)} rounds")
g.close()
dev.close()
