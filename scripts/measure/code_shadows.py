"""Does warming a kernel's code ahead of its dispatch pay? (docs/PERF.md, 2026-11-24: no.)

Records the decode step again with one-workgroup "shadows" of its dispatches: recorded with no
barrier and writing only scratch (every buffer a kernel writes is swapped for a slice of one
scratch buffer), so that a kernel's code is in L2 when the real dispatch needs it. Two places:
- before: each dispatch's shadow right before it, so it runs in the stage before;
- ahead: after each dispatch of a long stage (a "host": the delta-net step, the router, the
  experts, attention decode), shadows of the distinct pipelines of the stages after it, up to
  and including the next host's, so they run beside a stage that takes 10 µs or more.
The sampler, the position advance and the embedding get no shadow (their writes steer the next
step). Prints whole-step times, plain and shadowed, alternating.

Usage: python3 code_shadows.py MODEL.gguf [before|ahead (default before)] [ROUNDS (default 4)]"""
import statistics
import sys

from zdsl.autotune import in_place
from zdsl.models.qwen35.gguf_file import open_model
from zdsl.models.qwen35.graph import DecodeGraph
from zdsl.runtime import open_device
from zdsl.runtime.sequence import Sequence

SKIP = ("sample", "advance", "embed")
HOSTS = ("ssm_conv+step", "moe_route", "gate_exps", "down_exps", "attn_decode")
plain = Sequence.dispatch
state = {"scratch": None, "shadows": 0, "made": [], "recorded": {}, "plans": [], "done": {}}


def untracked(self, reads, writes, stage):
    """Sequence._order without the barrier bookkeeping: a shadow neither waits nor is waited for."""
    self._check_recording()


def shadow(seq, pipe, buffers, push, label) -> None:
    scratch = state["scratch"]
    if any(s in label for s in SKIP) or not all(b.nbytes <= scratch.nbytes for b in buffers):
        return
    twins = [scratch.slice(0, b.nbytes) if w else b for b, (r, w) in zip(buffers, pipe.access)]
    seq._order = untracked.__get__(seq)
    try:
        plain(seq, pipe, (1, 1, 1), twins, push, label + " (shadow)")
    finally:
        del seq._order
    state["shadows"] += 1


def recording(self, pipe, groups, buffers, push=b"", label=""):
    """Sequence.dispatch, noting each dispatch and the stage (barrier count) it landed in."""
    plain(self, pipe, groups, buffers, push, label)
    state["recorded"].setdefault(self, []).append((pipe, buffers, push, label, self.barriers))


def before(self, pipe, groups, buffers, push=b"", label=""):
    shadow(self, pipe, buffers, push, label)
    plain(self, pipe, groups, buffers, push, label)


def ahead(self, pipe, groups, buffers, push=b"", label=""):
    plain(self, pipe, groups, buffers, push, label)
    plan = state["plans"][state["made"].index(self)]
    i = state["done"][self] = state["done"].get(self, -1) + 1
    if not any(h in label for h in HOSTS):
        return
    seen = set()
    for pipe2, buffers2, push2, label2, stage2 in plan[i + 1:]:
        if stage2 == plan[i][4]:
            continue
        if pipe2 not in seen:
            seen.add(pipe2)
            shadow(self, pipe2, buffers2, push2, label2)
        if any(h in label2 for h in HOSTS):
            break


def record(g, mode: str) -> None:
    """g's steps recorded again, shadowed as `mode` says ("plain": none). Sequences are told
    apart by the order they are made in, which each recording of the graph repeats."""
    real_init = Sequence.__init__

    def numbered(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        state["made"].append(self)
    Sequence.__init__ = numbered
    try:
        if mode == "ahead":  # record plainly once to learn each sequence's dispatches and stages
            state["made"], state["recorded"] = [], {}
            Sequence.dispatch = recording
            g.retune(None)
            state["plans"] = [state["recorded"].get(seq, []) for seq in state["made"]]
        state["made"], state["done"] = [], {}
        Sequence.dispatch = {"plain": plain, "before": before, "ahead": ahead}[mode]
        g.retune(None)
    finally:
        Sequence.dispatch, Sequence.__init__ = plain, real_init


def main():
    model = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "before"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    dev = open_device("0")
    g = DecodeGraph(open_model(model), dev, n_ctx=1024, progress=False)
    state["scratch"] = dev.alloc(64 << 20, name="shadow scratch")
    times = {"plain": [], mode: []}
    for r in range(rounds):
        for side in (("plain", mode) if r % 2 == 0 else (mode, "plain")):
            state["shadows"] = 0
            record(g, side)
            ms = [1e3 * in_place.step_ms(g, 512, 8, 64) for _ in range(5)]
            times[side].append(statistics.median(ms))
            print(f"{side}: {times[side][-1]:.1f} µs/token ({state['shadows']} shadows recorded)", flush=True)
    for side, t in times.items():
        print(f"{side}: median {statistics.median(t):.1f} µs/token over {len(t)} rounds")
    g.close()
    dev.close()


if __name__ == "__main__":
    main()
