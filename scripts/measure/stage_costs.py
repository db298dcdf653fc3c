"""What each kind of dispatch costs inside the real decode step (docs/DESIGN.md).

Usage: python3 stage_costs.py MODEL.gguf [DEVICE (default 0)] [POSITION (default 512)] [NAME=PATTERN ...]

A timestamp after every dispatch (`zdsl profile`) serializes the step and adds ~2 µs to each
dispatch, so it says little about what a dispatch costs in the untimed chain. Here the step is
recorded again without one kind of dispatch (by label) and both steps are timed whole, in
interleaved rounds at the same position: the difference is that kind's marginal cost, launch,
barrier drain and bytes together. The step without it computes garbage, which does not change its
timing (the experts it picks are whatever the stale ids say).

Then three more edits of some kinds: an empty stage added after each of their dispatches (a
one-invocation dispatch per buffer the dispatch wrote, loading and storing back one word of it, so
the next reader waits for it), what a dependent stage costs there with no work in it; that empty
stage instead of the dispatch; and the dispatch recorded twice in a row (the second finds its code
and data hot)."""
import re
import statistics
import sys

import zdsl
from zdsl import Buffer, u32
from zdsl.models.qwen35.cli import in_place
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.runtime import open_device
from zdsl.runtime.sequence import Sequence

KINDS = [  # (name, pattern on the dispatch label "<role>:<kernel variant>")
    ("residual norm", r":norm_q8_1"),
    ("router", r"moe_route"),
    ("experts gate·up", r"ffn_gate_exps"),
    ("experts down", r"ffn_down_exps"),
    ("delta-net projections", r"\.attn_qkv[:+]"),
    ("delta-net step", r"ssm_conv\+step"),
    ("delta-net out", r"\.ssm_out:"),
    ("attention q/k/v", r"\.attn_[qkv]:"),
    ("attention prep", r"attn_prep"),
    ("attention decode", r"attn_decode"),
    ("attention combine", r"attn_combine"),
    ("attention out", r"attn_output"),
    ("head", r"^output"),
    ("residual norm + router", r":norm_q8_1|moe_route"),
    ("router + experts", r"moe_route|_exps"),
]
ADDED = [kind for kind in KINDS if kind[0] in (  # an empty stage after these, and so on
    "residual norm", "router", "experts gate·up", "experts down", "delta-net qkv only", "delta-net step",
    "delta-net out", "attention decode")]

model, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0"
position = int(sys.argv[3]) if len(sys.argv) > 3 else 512
if len(sys.argv) > 4:  # kinds of one's own, NAME=PATTERN: only left out
    KINDS, ADDED = [tuple(arg.split("=", 1)) for arg in sys.argv[4:]], []
TOKENS, ROUNDS = 32, 5

dev = open_device(device)
g = DecodeGraph(open_model(model), dev, n_ctx=position + 256, progress=False)
record = Sequence.dispatch
edit = {"pattern": None, "mode": "drop", "count": 0}


@zdsl.kernel(workgroup=1)
def touch(buf: Buffer[u32]):
    buf[0] = buf[0]


def dispatch(self, pipe, groups, buffers, push=b"", label=""):
    """Record a dispatch of the step, edited where its label matches: left out ("drop"), with an
    empty stage after it ("add"), replaced by that empty stage ("hollow"), or twice ("double")."""
    mode = edit["mode"] if edit["pattern"] and re.search(edit["pattern"], label) else None
    edit["count"] += mode is not None
    if mode in (None, "add", "double"):
        record(self, pipe, groups, buffers, push, label)
    if mode == "double":
        record(self, pipe, groups, buffers, push, label)
    if mode in ("add", "hollow"):  # one empty stage: each buffer the dispatch writes touched once
        for b, (r, w) in zip(buffers, pipe.access):
            if w:
                touch.specialize().dispatch(self, 1, label="touch", buf=b)


Sequence.dispatch = dispatch
g._free_steps()


def recorded(pattern, mode="drop"):
    """The graph's two steps (from the host, continuing on the GPU), edited (`dispatch`)."""
    edit.update(pattern=pattern, mode=mode, count=0)
    g._record_steps()
    return (g.seq, g.seq_next), edit["count"] // 2


def use(steps):
    g.seq, g.seq_next = steps


def step_ms():
    return in_place.step_ms(g, position, 4, TOKENS)


full_steps, _ = recorded(None)
full = [step_ms() for _ in range(3)]
print(f"full step: {statistics.median(full) * 1e3:.0f} µs at position {position}, {g.dispatches} commands", flush=True)


def compare(name, pattern, mode):
    steps, n = recorded(pattern, mode)
    if n == 0:
        use(full_steps)
        for s in steps:
            s.free()
        return
    diffs = []
    for r in range(ROUNDS):
        use(steps)
        b = step_ms()
        use(full_steps)
        a = step_ms()
        diffs.append((a - b) * 1e3)
    for s in steps:
        s.free()
    d = statistics.median(diffs)
    mad = statistics.median(abs(x - d) for x in diffs)
    d = -d if mode in ("add", "double") else d
    print(f"{name:26s} {n:10d} {d:9.1f} {mad:8.1f} {d / n:8.2f}", flush=True)


HEADS = {"drop": ("without", "saved"), "add": ("an empty stage after", "added"),
         "hollow": ("an empty stage instead of", "saved"), "double": ("twice", "added")}
for mode, kinds in (("drop", KINDS), ("add", ADDED), ("hollow", ADDED), ("double", ADDED)):
    what, sign = HEADS[mode]
    print(f"{what:26s} {'dispatches':>10s} {'µs ' + sign:>9s} {'± (MAD)':>8s} {'µs each':>8s}")
    for name, pattern in kinds:
        compare(name, pattern, mode)
g.close()
dev.close()
