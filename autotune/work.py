"""What one invocation of a dispatch does at run time: a sample of its kernel's workgroups run in
the interpreter, counting the statements they execute. Only the values that decide addresses,
branches and loop trips are computed; the data's arithmetic is counted without being run
(`_needed`): nine statements in ten of the H100 records' uses.

Machine-code statistics are static: a loop's body counts once however often it runs, so the
variants of a kernel that split the same loop over more invocations (a bigger workgroup, rows
shared by subgroups) look alike to them. The interpreter knows the trip counts at the use's
sizes. Each execution of a statement list that loads from a buffer directly (the kernel's top
level, a loop's body; the branches of an `if` belong to the list they sit in) is one *round*:
a lane issues the round's loads, then waits for them before the arithmetic that uses them, so
rounds are the memory latencies on a lane's path, except where a loop's body issues the next
round's loads into variables (`_ahead`). Loops whose bounds come from the buffers (positions,
routed experts) run as the example's data makes them. Besides the mean invocation's counts, the
interpreter counts the busiest invocation of each workgroup (its barriers wait for it), the
bytes each invocation moves through shared memory, and the distinct 32-byte sectors of the
buffers each workgroup reads: what it pulls through the L2 (its own re-reads stay in its L1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zdsl.errors import ZdslError
from zdsl.lang import ir
from zdsl.lang.interp import Run


@dataclass(frozen=True)
class Work:
    """Per invocation, averaged over the invocations of the sampled workgroups (`sample`)."""
    rounds: float   # executions of statement lists that load (see the module's docstring)
    loads: float    # buffer loads executed
    ops: float      # other operations executed
    static: int     # operations in the code (each counted once): ops + loads over this is how
                    # often the average operation runs, the factor that turns static
                    # machine-code counts into executed ones
    ahead: float = 0.0   # of the rounds, those whose loads were issued a round ahead (`_ahead`)
    shared: float = 0.0  # bytes read from and written to shared memory
    longest: float = 0.0  # loads and operations of a workgroup's busiest invocation, which the
                          # others wait for at its barriers (where the work is uneven: a decode
                          # split over some of the invocations)
    loop_runs: tuple[float, ...] = ()  # per depth of the GPU's loops (`zdsl.range` not unrolled;
                          # 0: outside them), how often a subgroup runs an operation at that depth
                          # (it runs one where any of its invocations does), to weigh the machine
                          # code's instructions at each loop depth (`machine_code`)
    sectors: float = 0.0  # per workgroup: the distinct 32-byte sectors of the buffers it reads
                          # (a tile's activations that every row tile reads again come through
                          # L2 once per workgroup)

    @property
    def path_repeats(self) -> float:
        """repeats along the busiest invocation's path."""
        return max(self.longest, self.loads + self.ops) / max(1, self.static)

    @property
    def repeats(self) -> float:
        return (self.loads + self.ops) / max(1, self.static)

    def runs_at(self, depth: int) -> float:
        """How often a subgroup runs an instruction at this loop depth of the machine code: the
        interpreter's figure at that depth, or at the deepest it has (loops the compiler added)."""
        return self.loop_runs[min(depth, len(self.loop_runs) - 1)] if self.loop_runs else self.repeats


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


def _operands(s):
    """The operands a statement reads (not the lists nested in it)."""
    if isinstance(s, ir.If):
        return (s.cond,)
    if isinstance(s, ir.For):
        return (s.start, s.stop, s.step)
    if isinstance(s, ir.Let):
        return s.args
    if isinstance(s, ir.Assign):
        return (s.value,)
    if isinstance(s, ir.DeclareVar):
        return (s.init,)
    if isinstance(s, ir.Store):
        return (s.index, s.value)
    if isinstance(s, ir.MatrixStore):
        return (s.matrix, s.offset, s.stride)
    return ()


def _reads(x, tainted) -> bool:
    """Whether an operand (or a tuple of them) reads a tainted temporary or variable."""
    if isinstance(x, (ir.Temp, ir.VarRef)):
        return ("t" if isinstance(x, ir.Temp) else "v", x.id) in tainted
    if isinstance(x, (tuple, list)):
        return any(_reads(y, tainted) for y in x)
    return False


def _ahead(body) -> bool:
    """Whether a loop body's loads are issued a round ahead: each loaded value goes as it is into
    a variable (mma.Staged's registers, attention's next round of the cache) that the body does
    not read after setting it, and into nothing else but dead arithmetic (mma.Staged's fetch runs
    the decode's code for its loads only). The next round reads them, so a round's latency hides
    behind the arithmetic of the one before. Arithmetic on a load that reaches a variable (an
    accumulation), a store, a branch or a loop bound waits for it."""
    tainted, loaded = set(), set()

    def walk(stmts, direct: bool) -> bool:
        for s in stmts:
            hit = _reads(_operands(s), tainted)
            if isinstance(s, ir.Let):
                if s.op == "load" and direct:  # a nested loop's loads are rounds of their own
                    tainted.add(("t", s.temp.id))
                    loaded.add(s.temp.id)
                elif hit:
                    if s.op.startswith("atomic_"):
                        return False
                    tainted.add(("t", s.temp.id))
            elif isinstance(s, (ir.Assign, ir.DeclareVar)):
                value = s.value if isinstance(s, ir.Assign) else s.init
                if hit and not (isinstance(value, ir.Temp) and value.id in loaded):
                    return False  # arithmetic on the load (an accumulation) waits for it
                if hit:
                    tainted.add(("v", s.var.id))
                elif ("v", s.var.id) in tainted:
                    tainted.discard(("v", s.var.id))
            elif hit:
                return False  # a store, a branch or a loop bound waits for the load
            if isinstance(s, ir.If) and not (walk(s.then, direct) and walk(s.orelse, direct)):
                return False
            if isinstance(s, ir.For) and not walk(s.body, False):
                return False
        return True

    return walk(body, True) and bool(loaded)


def _static(body) -> int:
    return sum(_static_by_depth(body))


def _static_by_depth(body, depth: int = 0, out: list[int] | None = None) -> list[int]:
    """Operations in the code per depth of the GPU's loops (a loop unrolled at compile time
    adds no depth)."""
    out = [] if out is None else out
    for s in body:
        if isinstance(s, ir.Let):
            out.extend([0] * (depth + 1 - len(out)))
            out[depth] += 1
        elif isinstance(s, ir.If):
            _static_by_depth(s.then, depth, out)
            _static_by_depth(s.orelse, depth, out)
        elif isinstance(s, ir.For):
            _static_by_depth(s.body, depth + (not s.unroll), out)
    return out


def _loop_runs(ran: list[int], static: list[int], waves: int) -> tuple[float, ...]:
    """Per loop depth, a subgroup's runs of each operation there; a depth that holds no operation
    of its own (a loop around a loop) takes the depth above it."""
    runs: list[float] = []
    for depth, n in enumerate(static):
        runs.append(ran[depth] / (waves * n) if n else runs[-1] if runs else 1.0)
    return tuple(runs)


_READS = {"load", "shared_load", "local_load", "table_load", "mat_load"}  # ops reading their first argument


def _array(x):
    """The key of a memory operand: a buffer by name, shared and local arrays by id."""
    return ("buffer", x.buffer) if isinstance(x, ir.View) else (type(x).__name__, x.id)


def _needed(body) -> tuple[set, set, set]:
    """(temporaries, variables, arrays) whose values decide what a run does: where it reads and
    writes, which branches and how many loop trips it takes (the loads of a routed expert's id, a
    position). Counting computes only those; the rest, the data's arithmetic, is counted
    without being run. A value is needed where a needed one, an index, a condition, a loop
    bound or an atomic reads it, a buffer load's index and mask (its sectors are counted); a
    load's value where it is needed, and then its array's: every store to it."""
    reads: dict = {}      # ("t", id) or ("v", id): the operands its value is computed from
    stored: dict = {}     # array: the operands of every store to it
    loaded_from = {}      # temporary: the array it loads from
    roots: list = []

    def walk(stmts):
        for s in stmts:
            if isinstance(s, ir.Let):
                reads[("t", s.temp.id)] = s.args
                if s.op in _READS:
                    loaded_from[s.temp.id] = _array(s.args[0])
                if s.op == "load":  # its sectors are counted whether its value is needed or not
                    roots.extend(s.args[1:3])
                elif s.op.startswith("atomic_"):  # writes memory: always runs
                    roots.append(s.temp)
            elif isinstance(s, (ir.Assign, ir.DeclareVar)):
                reads.setdefault(("v", s.var.id), []).extend(_operands(s))
            elif isinstance(s, ir.Store):
                stored.setdefault(_array(s.view), []).extend((s.index, s.value))
            elif isinstance(s, ir.MatrixStore):
                stored.setdefault(_array(s.array), []).extend(_operands(s))
            elif isinstance(s, ir.If):
                roots.append(s.cond)
                walk(s.then)
                walk(s.orelse)
            elif isinstance(s, ir.For):
                roots.extend(_operands(s))
                walk(s.body)
    walk(body)
    temps, vars_, arrays = set(), set(), set()
    todo = list(roots)
    while todo:
        x = todo.pop()
        if isinstance(x, ir.Temp):
            if x.id in temps:
                continue
            temps.add(x.id)
            todo.extend(reads.get(("t", x.id), ()))
            array = loaded_from.get(x.id)
            if array is not None and array not in arrays:
                arrays.add(array)
                todo.extend(stored.get(array, ()))
        elif isinstance(x, ir.VarRef) and x.id not in vars_:
            vars_.add(x.id)
            todo.extend(reads.get(("v", x.id), ()))
    return temps, vars_, arrays


class _Counted:
    """Consecutive operations counted without being run: how many, and the shared-memory bytes
    an invocation moves in them."""

    def __init__(self):
        self.n, self.shared = 0, 0.0

    def add(self, s, sg) -> None:
        self.n += 1
        if s.op == "shared_load":
            self.shared += s.temp.dtype.nbytes
        elif s.op == "mat_load" and isinstance(s.args[0], ir.Shared):
            self.shared += _tile_bytes(s.temp.dtype) / sg


class _Counting(Run):
    """The interpreter counting rounds, loads and operations per invocation. A round counts for
    an invocation where one of the list's loads ran for it: a branch not taken (the `if` of a
    specialization constant that is false, such as mul_mm_coop's ADD) waits for nothing. Races
    are the kernel tests' to find: counting leaves them unchecked."""

    races = False

    def __init__(self, k, groups, buffers, scalars, specs, ids):
        super().__init__(k, groups, buffers, scalars, specs, 0, len(ids))
        # the chunk's workgroups are the sampled ones, not the first len(ids)
        gl = np.asarray(ids, np.int64)[np.arange(self.n) // self.wg]
        g, wgs, u = groups, k.workgroup, np.uint32
        gid = [gl % g[0], (gl // g[0]) % g[1], gl // (g[0] * g[1])]
        self.builtins["workgroup_id"] = [a.astype(u) for a in gid]
        self.builtins["global_id"] = [(a * w + l).astype(u) for a, w, l in zip(gid, wgs, self.builtins["local_id"])]
        self.rounds = self.loads = self.ops = self.ahead = self.shared_bytes = 0
        lists = [b for b in _lists(self.k.body) if _loads_directly(b)]
        self.round_lists = {id(b) for b in lists}
        self.ahead_lists = {id(b) for b in lists if b is not self.k.body and _ahead(b)}
        self.waiting: list[np.ndarray] = []  # per open round list: the invocations whose load ran
        self.each = np.zeros(self.n, np.int64)  # loads and operations per invocation (but the pending ones)
        self._mask, self._tally, self._pending = None, (0, 0), 0  # the last mask seen: its tallies, its count
        self.static_by_depth = _static_by_depth(k.body)
        self.depth = 0  # the GPU loops around the statement
        self.ran = [0] * len(self.static_by_depth)  # subgroups' runs of operations, per depth
        # subgroups as NVIDIA runs them where the variant leaves the size to the driver (its machine
        # code is the one read for loop depths), a workgroup's last one partly filled
        self.wave = self.sg or 32
        self.waves = -(-self.wg // self.wave)
        self.sectors: list[np.ndarray] = []  # keys of the sectors read: (workgroup, buffer, sector)
        self.sector_keys = 0  # keys in the list, repeats included
        self.buffer_ids: dict[str, int] = {}
        self.needed_temps, self.needed_vars, self.needed_arrays = _needed(k.body)
        self.plans: dict[int, list] = {}  # per statement list (by id): what `block` walks

    def block(self, stmts, mask) -> None:
        if not mask.any():
            return
        plan = self.plans.get(id(stmts))
        if plan is None:
            plan = self.plans[id(stmts)] = self._plan(stmts)
        if id(stmts) not in self.round_lists:
            return self._run(plan, mask)
        self.waiting.append(np.zeros(self.n, dtype=bool))
        try:
            self._run(plan, mask)
        finally:
            n = int(self.waiting.pop().sum())
            self.rounds += n
            if id(stmts) in self.ahead_lists:
                self.ahead += n

    def _plan(self, stmts) -> list:
        """The list's statements, each run of operations that are only counted (no loads:
        their sectors are counted one by one) as one `_Counted`."""
        plan = []
        for s in stmts:
            if type(s) is ir.Let and s.op != "load" and not self._runs(s):
                if not plan or type(plan[-1]) is not _Counted:
                    plan.append(_Counted())
                plan[-1].add(s, self.sg)
            else:
                plan.append(s)
        return plan

    def _run(self, plan, mask) -> None:
        for item in plan:
            if type(item) is _Counted:
                waves, running = self._count(mask)
                self._pending += item.n
                self.ran[self.depth] += item.n * waves
                self.ops += item.n * running
                self.shared_bytes += running * item.shared
            else:
                self.stmt(item, mask)

    def stmt(self, s, mask) -> None:
        if type(s) is ir.For and not s.unroll:
            self.depth += 1
            try:
                return self._stmt(s, mask)
            finally:
                self.depth -= 1
        self._stmt(s, mask)

    def _count(self, mask) -> tuple[int, int]:
        """(subgroups running, invocations running) under `mask`, worked out once per mask: a
        block's statements share their mask object, and most statements are in long blocks. Each
        statement counted adds the mask to `each` in one go when the mask changes (`settle`)."""
        if mask is not self._mask:
            self.settle()
            self._mask, self._tally = mask, (self._waves_running(mask), int(np.count_nonzero(mask)))
        return self._tally

    def settle(self) -> None:
        """The statements counted under the last mask, into `each`."""
        if self._pending:
            self.each += self._pending * self._mask
            self._pending = 0

    def _stmt(self, s, mask) -> None:
        if isinstance(s, ir.Let):
            waves, running = self._count(mask)
            self._pending += 1
            self.ran[self.depth] += waves
            if s.op == "load":
                self.loads += running
                if self.waiting:
                    self.waiting[-1] |= mask
                active = mask & np.broadcast_to(self.value(s.args[2]), (self.n,)) if len(s.args) == 4 else mask
                self._read_sectors(s, active)
                if not self._runs(s):  # counted, not read: its index still checked
                    view = s.args[0]
                    self._index(s.args[1], len(self.view(view)), active, s.loc, f"read of {view.buffer}")
                    return
            else:
                self.ops += running
                if s.op == "shared_load":
                    self.shared_bytes += running * s.temp.dtype.nbytes
                elif s.op == "mat_load" and isinstance(s.args[0], ir.Shared):
                    self.shared_bytes += running * _tile_bytes(s.temp.dtype) / self.sg
        elif isinstance(s, ir.Store) and isinstance(s.view, ir.Shared):
            self.shared_bytes += self._count(mask)[1] * s.view.dtype.nbytes
        elif isinstance(s, ir.MatrixStore) and isinstance(s.array, ir.Shared):
            self.shared_bytes += self._count(mask)[1] * _tile_bytes(s.matrix.dtype) / self.sg
        if self._runs(s):
            super().stmt(s, mask)

    def _runs(self, s) -> bool:
        """Whether the statement is run, or only counted (`_needed`)."""
        kind = type(s)
        if kind is ir.Let:
            return s.temp.id in self.needed_temps
        if kind is ir.Assign or kind is ir.DeclareVar:
            return s.var.id in self.needed_vars
        if kind is ir.Store:
            return _array(s.view) in self.needed_arrays
        if kind is ir.MatrixStore:
            return _array(s.array) in self.needed_arrays
        return True

    def _read_sectors(self, s, active) -> None:
        """Keeps the keys of the sectors a load reads where it runs (`active`: the invocations
        running it that its mask lets read; a vector's first and last byte's sectors, which differ
        where it straddles two), packed as (workgroup, buffer, sector)."""
        view = s.args[0]
        if not active.any():
            return
        size = view.dtype.scalar.numpy.itemsize * view.dtype.lanes
        first = np.broadcast_to(np.asarray(self.value(s.args[1])).astype(np.int64), (self.n,))[active] * size
        buffer = self.buffer_ids.setdefault(view.buffer, len(self.buffer_ids))
        # a key: workgroup · 256 + buffer above 40 bits of sector (a kernel binds < 256 buffers)
        base = (self.group_local[active].astype(np.int64) * 256 + buffer) << 40
        start, end = base + first // SECTOR, base + (first + size - 1) // SECTOR
        keys = np.concatenate([start, end[end != start]])
        keys = keys[np.r_[True, keys[1:] != keys[:-1]]]  # neighbouring lanes mostly share a sector
        self.sectors.append(keys)
        self.sector_keys += len(keys)
        if self.sector_keys > 1 << 20:  # duplicates dropped now and then, not at every load
            self.sectors = [np.unique(np.concatenate(self.sectors))]
            self.sector_keys = len(self.sectors[0])

    def sectors_per_group(self) -> float:
        """The distinct sectors read, per sampled workgroup."""
        read = np.unique(np.concatenate(self.sectors)) if self.sectors else ()
        return len(read) / (self.n // self.wg)

    def _waves_running(self, mask) -> int:
        if self.wg % self.wave == 0:
            return int(np.count_nonzero(mask.reshape(-1, self.wave).any(axis=1)))
        per_group = mask.reshape(-1, self.wg)
        padded = np.zeros((per_group.shape[0], self.waves * self.wave), bool)
        padded[:, :self.wg] = per_group
        return int(np.count_nonzero(padded.reshape(-1, self.waves, self.wave).any(axis=2)))


def _tile_bytes(m) -> int:
    """A cooperative matrix's bytes (the whole subgroup's)."""
    return m.rows * m.cols * m.element.nbytes


SAMPLE = 8  # workgroups the interpreter runs, spread over the grid
SECTOR = 32  # bytes: the unit in which a cache line moves between the L2 and a unit's L1


def sample(total: int, n: int = SAMPLE) -> list[int]:
    """n workgroups spread over the grid's linear ids, all of them where there are no more:
    workgroups differ where the data decides their loops (a routed expert's pairs, a token tile
    past the last token, a causal block's keys). The golden ratio's multiples spread them without
    falling into step with the grid's axes (evenly spaced ids would all take the first of SPLIT
    workgroups of an expert)."""
    if total <= n:
        return list(range(total))
    ids = []
    for i in range(4 * n):
        g = int(total * ((0.5 + i * 0.6180339887498949) % 1.0))
        if g not in ids:
            ids.append(g)
        if len(ids) == n:
            break
    return sorted(ids)


def work(variant, args: dict, groups) -> Work | None:
    """The work of one invocation of `variant` dispatched over `groups` on the example `args`
    (arrays and scalars by name), averaged over a sample of its workgroups, or None where the
    interpreter cannot run them."""
    k = variant.ir
    buffers = {n: np.asarray(args[n]) if n in args else np.zeros(4, np.uint8) for n, _, _ in k.buffers}
    scalars = {s.name: args.get(s.name, 0) for s in k.scalars}
    g = tuple(int(x) for x in groups) + (1,) * (3 - len(tuple(groups)))
    try:
        run = _Counting(k, g, buffers, scalars, variant.spec_values, sample(g[0] * g[1] * g[2]))
        run.run(k.body)
        run.settle()
    except (ZdslError, IndexError, ValueError):
        return None
    return Work(run.rounds / run.n, run.loads / run.n, run.ops / run.n, _static(k.body), run.ahead / run.n,
                run.shared_bytes / run.n, float(run.each.reshape(-1, run.wg).max(axis=1).mean()),
                _loop_runs(run.ran, run.static_by_depth, run.n // run.wg * run.waves), run.sectors_per_group())
