"""What one invocation of a dispatch does at run time: its kernel's first workgroup run in the
interpreter, counting the statements it executes.

Machine-code statistics are static: a loop's body counts once however often it runs, so the
variants of a kernel that split the same loop over more invocations (a bigger workgroup, rows
shared by subgroups) look alike to them. The interpreter knows the trip counts at the use's
sizes. Each execution of a statement list that loads from a buffer directly (the kernel's top
level, a loop's body; the branches of an `if` belong to the list they sit in) is one *round*:
a lane issues the round's loads, then waits for them before the arithmetic that uses them, so
rounds are the memory latencies on a lane's path. Loops whose bounds come from the buffers
(positions, routed experts) run as the example's data makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zdsl.errors import ZdslError
from zdsl.lang import ir
from zdsl.lang.interp import Run


@dataclass(frozen=True)
class Work:
    """Per invocation of the first workgroup, averaged over its invocations."""
    rounds: float   # executions of statement lists that load (see the module's docstring)
    loads: float    # buffer loads executed
    ops: float      # other operations executed
    static: int     # operations in the code (each counted once): ops + loads over this is how
                    # often the average operation runs, the factor that turns static
                    # machine-code counts into executed ones

    @property
    def repeats(self) -> float:
        return (self.loads + self.ops) / max(1, self.static)


def _loads_directly(body) -> bool:
    """Whether the list loads from a buffer outside any loop nested in it."""
    for s in body:
        if isinstance(s, ir.Let) and s.op == "load":
            return True
        if isinstance(s, ir.If) and (_loads_directly(s.then) or _loads_directly(s.orelse)):
            return True
    return False


def _lists(body):
    """The statement lists a kernel's rounds are counted on: its top level, every loop's body."""
    yield body
    for s in body:
        if isinstance(s, ir.For):
            yield from _lists(s.body)
        elif isinstance(s, ir.If):
            for branch in (s.then, s.orelse):
                for inner in _lists(branch):
                    if inner is not branch:
                        yield inner


def _static(body) -> int:
    n = 0
    for s in body:
        if isinstance(s, ir.Let):
            n += 1
        elif isinstance(s, ir.If):
            n += _static(s.then) + _static(s.orelse)
        elif isinstance(s, ir.For):
            n += _static(s.body)
    return n


class _Counting(Run):
    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = self.loads = self.ops = 0
        self.round_lists = {id(b) for b in _lists(self.k.body) if _loads_directly(b)}

    def block(self, stmts, mask) -> None:
        if id(stmts) in self.round_lists:
            self.rounds += int(mask.sum())
        super().block(stmts, mask)

    def stmt(self, s, mask) -> None:
        if isinstance(s, ir.Let):
            if s.op == "load":
                self.loads += int(mask.sum())
            else:
                self.ops += int(mask.sum())
        super().stmt(s, mask)


def work(variant, args: dict, groups) -> Work | None:
    """The work of one invocation of `variant` dispatched over `groups` on the example `args`
    (arrays and scalars by name), or None where the interpreter cannot run its first workgroup."""
    k = variant.ir
    buffers = {n: np.asarray(args[n]) if n in args else np.zeros(4, np.uint8) for n, _, _ in k.buffers}
    scalars = {s.name: args.get(s.name, 0) for s in k.scalars}
    g = tuple(int(x) for x in groups) + (1,) * (3 - len(tuple(groups)))
    try:
        run = _Counting(k, g, buffers, scalars, variant.spec_values, 0, 1)
        run.block(k.body, np.ones(run.n, dtype=bool))
    except (ZdslError, IndexError, ValueError):
        return None
    return Work(run.rounds / run.n, run.loads / run.n, run.ops / run.n, _static(k.body))
