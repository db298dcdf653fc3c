"""The interpreter: runs a traced kernel's IR on numpy, one array row per invocation.

All invocations of a chunk of workgroups execute each statement together under an active
mask, so control flow, shared memory and subgroup operations keep their GPU meaning:
subgroups are consecutive runs of `subgroup_size` invocations of a workgroup. Like a careful
GPU it refuses what real hardware would get wrong silently: out-of-bounds accesses, barriers in
divergent control flow, and shared-memory races between barriers raise a KernelError naming
the kernel line.
"""

from __future__ import annotations

import functools

import numpy as np

from zdsl.errors import KernelError
from zdsl.lang import ir
from zdsl.lang.matrices import MatrixType
from zdsl.lang.ops import BINARY, TERNARY, UNARY, bf16_bits_to_f32, dot4_i8, f16_bits_to_f32
from zdsl.lang.types import DType

MAX_LANES = 1 << 18  # invocations run at once; larger dispatches go in chunks of workgroups
MATRIX_LANES = 1 << 13  # ... fewer for kernels with cooperative matrices (a tile per subgroup per value)


def _err(loc, msg) -> KernelError:
    return KernelError(f"{loc[0]}:{loc[1]}: {msg}")


def _align(a, b):
    """Broadcast a per-invocation scalar against a per-invocation vector (rows × lanes)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim == 2 and b.ndim == 1:
        b = b[:, None]
    elif b.ndim == 2 and a.ndim == 1:
        a = a[:, None]
    return a, b


def _cast(x, dtype: DType):
    return np.asarray(x).astype(dtype.numpy, copy=False)


@functools.lru_cache(maxsize=None)
def _kind(op: str) -> str:
    """How `compute` runs an op: "memory", "subgroup" or "value" (asked at every operation)."""
    memory = op in ("load", "shared_load", "local_load", "table_load") or op.startswith("atomic_")
    return "memory" if memory else "subgroup" if op.startswith("sg_") else "value"


class Run:
    races = True  # check shared memory for races (the kernel tests); a run that only counts work skips it

    def __init__(self, k: ir.Kernel, groups, buffers: dict, scalars: dict, specs: dict, first_group: int,
                 ngroups: int):
        self.k = k
        self.groups = groups
        wg = k.workgroup[0] * k.workgroup[1] * k.workgroup[2]
        self.wg = wg
        self.n = ngroups * wg
        lane = np.arange(self.n, dtype=np.int64)
        gl = first_group + lane // wg  # linear workgroup id
        li = lane % wg
        self.group_local = lane // wg  # workgroup index within the chunk (shared memory row)
        gx, gy, gz = gl % groups[0], (gl // groups[0]) % groups[1], gl // (groups[0] * groups[1])
        lx, ly, lz = li % k.workgroup[0], (li // k.workgroup[0]) % k.workgroup[1], li // (k.workgroup[0] * k.workgroup[1])
        u = np.uint32
        self.builtins = {
            "workgroup_id": [gx.astype(u), gy.astype(u), gz.astype(u)],
            "local_id": [lx.astype(u), ly.astype(u), lz.astype(u)],
            "global_id": [(gx * k.workgroup[0] + lx).astype(u), (gy * k.workgroup[1] + ly).astype(u),
                          (gz * k.workgroup[2] + lz).astype(u)],
            "num_workgroups": [u(g) for g in groups],
            "local_index": li.astype(u),
        }
        self.sg = k.subgroup_size
        if self.sg:
            self.builtins["subgroup_id"] = (li // self.sg).astype(u)
            self.builtins["lane_id"] = (li % self.sg).astype(u)
        self.lane_in_group = li
        self.buffers = buffers
        self.scalars = {s.name: s.dtype.numpy.type(scalars[s.name]) for s in k.scalars}
        self.specs = {s.name: s.dtype.numpy.type(specs[s.name]) for s in k.specs}
        self.temps: dict[int, np.ndarray] = {}
        self.vars: dict[int, np.ndarray] = {}
        self.shared = {}
        self.writer = {}
        self.reader = {}
        for s in k.shared:
            size = int(self.value(s.size)) if not isinstance(s.size, int) else s.size
            lanes = (s.dtype.lanes,) if s.dtype.lanes > 1 else ()
            self.shared[s.id] = np.full((ngroups, size, *lanes), np.nan if s.dtype.is_float else 0,
                                        s.dtype.compute.numpy)
            self.writer[s.id] = np.full((ngroups, size), -1, np.int64)
            self.reader[s.id] = np.full((ngroups, size), -1, np.int64)
        self.locals = {l.id: np.full((self.n, l.size), np.nan if l.dtype.is_float else 0, l.dtype.numpy)
                       for l in k.locals}
        self.tables = {t.id: np.array(t.values, dtype=t.dtype.numpy) for t in k.tables}

    # -- operands
    def value(self, o):
        kind = type(o)
        if kind is ir.Temp:
            return self.temps[o.id]
        if kind is ir.Const:
            return o.dtype.numpy.type(o.value)
        if kind is ir.VarRef:
            return self.vars[o.id]
        if kind is ir.Scalar:
            return self.scalars[o.name]
        if kind is ir.SpecParam:
            return self.specs[o.name]
        if kind is ir.Builtin:
            b = self.builtins[o.name]
            return b[o.axis] if isinstance(b, list) else b
        if kind is ir.ConstExpr:
            return self.compute(o.op, o.args, o.dtype, {}, None, None)
        raise TypeError(o)

    def view(self, v: ir.View) -> np.ndarray:
        raw = self.buffers[v.buffer]
        flat = raw.reshape(-1).view(np.uint8)
        item = v.dtype.scalar.numpy.itemsize * v.dtype.lanes
        usable = flat[: len(flat) - len(flat) % item]
        arr = usable.view(v.dtype.scalar.numpy)
        return arr.reshape(-1, v.dtype.lanes) if v.dtype.lanes > 1 else arr

    # -- ops
    def compute(self, op, args, dtype: DType, attrs, mask, loc):
        """One operation's result (floating-point errors ignored: `run` holds np.errstate)."""
        kind = _kind(op)
        if kind == "memory":
            return self.memory_op(op, args, dtype, mask, loc)
        if kind == "subgroup":
            return self.subgroup_op(op, args, attrs, mask)
        vals = [self.value(a) for a in args]
        if op in BINARY:
            a, b = _align(*vals)
            if op in ("shl", "shr"):
                b = np.asarray(b) & np.asarray(31, dtype=np.asarray(b).dtype)
            return _cast(BINARY[op].numpy(a, b), dtype)
        if op in UNARY:
            return _cast(UNARY[op].numpy(vals[0]), dtype)
        if op in TERNARY:
            if op == "select":
                c, a = _align(vals[0], vals[1])
                c, b = _align(c, vals[2])
                return _cast(np.where(c, a, b), dtype)
            return _cast(TERNARY[op].numpy(*vals), dtype)
        if op == "splat":
            return np.repeat(np.broadcast_to(np.asarray(vals[0]), (self.n,))[:, None], dtype.lanes, axis=1).astype(dtype.numpy)
        if op == "cast":
            x = np.asarray(vals[0])
            if dtype.is_int and x.dtype.kind == "f":
                x = np.trunc(np.nan_to_num(x))
                x = x.astype(np.int64)
            return _cast(x, dtype)
        if op == "bitcast":
            return np.ascontiguousarray(vals[0]).view(dtype.numpy)
        if op == "lane":
            return np.asarray(vals[0])[..., attrs["lane"]]
        if op == "vec":
            return np.stack(np.broadcast_arrays(*[np.broadcast_to(v, (self.n,)) for v in vals]), axis=-1)
        if op == "dot":
            return _cast(np.sum(np.asarray(vals[0]) * np.asarray(vals[1]), axis=-1), dtype)
        if op == "f16_bits":
            return f16_bits_to_f32(np.asarray(vals[0]) & np.uint32(0xFFFF))
        if op == "bf16_bits":
            return bf16_bits_to_f32(np.asarray(vals[0]) & np.uint32(0xFFFF))
        if op == "unpack_bytes":
            u = np.broadcast_to(np.asarray(vals[0], np.uint32), (self.n,))
            return np.ascontiguousarray(u).view(np.uint8).reshape(self.n, 4).astype(np.float32)
        if op == "dot4_i8":
            a, b = (np.broadcast_to(np.asarray(v).astype(np.uint32), (self.n,)) for v in vals)
            return dot4_i8(a, b)
        raise NotImplementedError(op)

    def _index(self, o, size: int, active, loc, what: str):
        idx = np.broadcast_to(np.asarray(self.value(o)).astype(np.int64), (self.n,))
        bad = active & ((idx < 0) | (idx >= size))
        if bad.any():
            lane = int(np.argmax(bad))
            raise _err(loc, f"out-of-bounds {what}: index {int(idx[lane])} not in [0, {size}) "
                            f"(workgroup {int(self.builtins['workgroup_id'][0][lane])}, "
                            f"invocation {int(self.lane_in_group[lane])})")
        return np.where(active, idx, 0)

    def memory_op(self, op, args, dtype, mask, loc):
        if op == "local_load":
            arr = self.locals[args[0].id]
            idx = self._index(args[1], arr.shape[1], mask, loc, "local array read")
            return arr[np.arange(self.n), idx]
        if op == "table_load":
            arr = self.tables[args[0].id]
            return arr[self._index(args[1], len(arr), mask, loc, "table read")]
        if op == "shared_load":
            decl = args[0]
            arr = self.shared[decl.id]
            idx = self._index(args[1], arr.shape[1], mask, loc, "shared read")
            if self.races:
                hit = self._other_lane(self.writer, decl.id, idx, mask)
                if hit:
                    lane, writer = hit
                    raise _err(loc, f"shared-memory race: invocation {int(self.lane_in_group[lane])} reads "
                                    f"element {int(idx[lane])} that invocation {writer} wrote "
                                    f"with no zdsl.barrier() between")
                self.reader[decl.id][self.group_local[mask], idx[mask]] = self.lane_in_group[mask]
            return arr[self.group_local, idx]
        view = args[0]
        arr = self.view(view)
        active = mask.copy()
        if op == "load" and len(args) == 4:
            active &= np.broadcast_to(self.value(args[2]), (self.n,))
        idx = self._index(args[1], len(arr), active, loc, f"read of {view.buffer}")
        if op.startswith("atomic_"):
            vals = np.broadcast_to(self.value(args[2]), (self.n,))
            old = np.zeros(self.n, dtype=arr.dtype)
            for lane in np.nonzero(active)[0]:  # in lane order, as one possible GPU ordering
                old[lane] = arr[idx[lane]]
                new = {"atomic_add": lambda a, b: a + b, "atomic_max": max, "atomic_min": min}[op](arr[idx[lane]], vals[lane])
                arr[idx[lane]] = new
            return old
        loaded = arr[idx]
        if view.dtype.name == "bf16":
            loaded = bf16_bits_to_f32(loaded.astype(np.uint32))
        loaded = _cast(loaded, view.dtype.compute)
        if len(args) == 4:
            other = np.asarray(self.value(args[3]))
            if loaded.ndim == 2 and other.ndim == 1:
                other = other[:, None]
            cond = active if loaded.ndim == 1 else active[:, None]
            loaded = np.where(cond, loaded, other).astype(loaded.dtype)
        return loaded

    def subgroup_op(self, op, args, attrs, mask):
        x = np.broadcast_to(self.value(args[0]), (self.n,) + np.shape(self.value(args[0]))[1:]).copy()
        sg = self.sg
        if op in ("sg_sum", "sg_max", "sg_min"):
            size = attrs.get("cluster") or sg
            rows = x.reshape(self.n // size, size, *x.shape[1:])
            act = mask.reshape(self.n // size, size)
            act = act.reshape(act.shape + (1,) * (rows.ndim - 2))
            if op == "sg_sum":
                red = np.where(act, rows, 0).sum(axis=1, dtype=rows.dtype)
            else:
                info = np.finfo(rows.dtype) if rows.dtype.kind == "f" else np.iinfo(rows.dtype)
                fill = info.min if op == "sg_max" else info.max
                red = (np.max if op == "sg_max" else np.min)(np.where(act, rows, fill), axis=1)
            return np.repeat(red, size, axis=0).astype(x.dtype)
        if op == "sg_prefix":
            rows = np.where(mask, x, 0).reshape(self.n // sg, sg)
            out = np.cumsum(rows, axis=1, dtype=rows.dtype)
            if not attrs["inclusive"]:
                out = out - rows
            return out.reshape(-1).astype(x.dtype)
        if op == "sg_count":
            rows = (x.astype(bool) & mask).reshape(self.n // sg, sg)
            return np.repeat(rows.sum(axis=1), sg).astype(np.uint32)
        rows = x.reshape(self.n // sg, sg, *x.shape[1:])
        lane = np.arange(self.n) % sg
        if op == "sg_broadcast":
            src = np.full(self.n, attrs["lane"])
        elif op == "sg_shuffle":
            src = np.broadcast_to(self.value(args[1]), (self.n,)).astype(np.int64) % sg
        else:  # sg_shuffle_xor
            src = (lane ^ np.broadcast_to(self.value(args[1]), (self.n,)).astype(np.int64)) % sg
        return rows[np.arange(self.n) // sg, src]

    # -- statements
    def run(self, body) -> None:
        """The kernel's body for every invocation of the chunk, floating-point errors ignored as
        a GPU ignores them (inf and NaN are values)."""
        with np.errstate(all="ignore"):
            self.block(body, np.ones(self.n, dtype=bool))

    def block(self, stmts, mask) -> None:
        if mask.any():  # the statements share the mask and none changes it
            for s in stmts:
                self.stmt(s, mask)

    def assign(self, var: ir.VarRef, value, mask) -> None:
        if isinstance(var.dtype, MatrixType):
            old = self.vars.get(var.id)
            self.vars[var.id] = value.copy() if old is None else np.where(self.by_subgroup(mask)[:, None, None], value, old)
            return
        value = np.broadcast_to(_cast(value, var.dtype), (self.n,) + ((var.dtype.lanes,) if var.dtype.lanes > 1 else ()))
        old = self.vars.get(var.id)
        if old is None:
            self.vars[var.id] = value.copy()
        else:
            m = mask if value.ndim == 1 else mask[:, None]
            self.vars[var.id] = np.where(m, value, old)

    def stmt(self, s, mask) -> None:
        kind = type(s)
        if kind is ir.Let:
            if s.op.startswith("mat_"):
                self.temps[s.temp.id] = self.matrix_op(s, mask)
            else:
                self.temps[s.temp.id] = self.compute(s.op, s.args, s.temp.dtype, s.attrs, mask, s.loc)
        elif kind is ir.MatrixStore:
            self.matrix_store(s, mask)
        elif isinstance(s, ir.DeclareVar):
            self.vars.pop(s.var.id, None)
            self.assign(s.var, self.value(s.init), mask)
        elif isinstance(s, ir.Assign):
            self.assign(s.var, self.value(s.value), mask)
        elif isinstance(s, ir.Store):
            self.store(s, mask)
        elif isinstance(s, ir.If):
            cond = np.broadcast_to(self.value(s.cond), (self.n,))
            self.block(s.then, mask & cond)
            if s.orelse:
                self.block(s.orelse, mask & ~cond)
        elif isinstance(s, ir.For):
            self.vars.pop(s.var.id, None)
            self.assign(s.var, self.value(s.start), mask)
            while True:
                i = self.vars[s.var.id]
                active = mask & (i < np.broadcast_to(self.value(s.stop), (self.n,)))
                if not active.any():
                    break
                self.block(s.body, active)
                self.assign(s.var, self.vars[s.var.id] + self.value(s.step), active)
        elif isinstance(s, ir.Barrier):
            per_group = mask.reshape(-1, self.wg)
            if not (per_group.all(axis=1) | ~per_group.any(axis=1)).all():
                raise _err(s.loc, "zdsl.barrier() reached by only some invocations of a workgroup "
                                  "(a barrier must be in uniform control flow)")
            if self.races:
                for w in list(self.writer.values()) + list(self.reader.values()):
                    w.fill(-1)
        elif isinstance(s, ir.MemoryBarrier):
            pass  # numpy memory is always coherent; workgroups run in order (see `interpret`)
        else:
            raise NotImplementedError(type(s))

    def _other_lane(self, seen: dict, array: int, idx, mask):
        """(lane, other) for the first active lane whose element of shared array `array` another
        invocation `other` wrote or read (`seen`: self.writer or self.reader) since the last
        barrier; None if none did."""
        other = seen[array][self.group_local, idx]
        race = mask & (other >= 0) & (other != self.lane_in_group)
        if not race.any():
            return None
        lane = int(np.argmax(race))
        return lane, int(other[lane])

    def _shared_write(self, s: ir.Store, idx, mask) -> None:
        """A shared write's race check against the writes and reads since the last barrier; notes
        its writers."""
        hit = self._other_lane(self.writer, s.view.id, idx, mask)
        if hit:
            lane, writer = hit
            raise _err(s.loc, f"shared-memory race: invocations {writer} and {int(self.lane_in_group[lane])} "
                              f"both write element {int(idx[lane])} with no zdsl.barrier() between")
        hit = self._other_lane(self.reader, s.view.id, idx, mask)
        if hit:
            lane, reader = hit
            raise _err(s.loc, f"shared-memory race: invocation {int(self.lane_in_group[lane])} overwrites "
                              f"element {int(idx[lane])} that invocation {reader} read "
                              f"with no zdsl.barrier() between")
        self.writer[s.view.id][self.group_local[mask], idx[mask]] = self.lane_in_group[mask]

    def store(self, s: ir.Store, mask) -> None:
        value = np.broadcast_to(self.value(s.value), (self.n,) + np.shape(self.value(s.value))[1:])
        if isinstance(s.view, ir.Local):
            arr = self.locals[s.view.id]
            idx = self._index(s.index, arr.shape[1], mask, s.loc, "local array write")
            arr[np.nonzero(mask)[0], idx[mask]] = value[mask]
            return
        if isinstance(s.view, ir.Shared):
            arr = self.shared[s.view.id]
            idx = self._index(s.index, arr.shape[1], mask, s.loc, "shared write")
            if self.races:
                self._shared_write(s, idx, mask)
            arr[self.group_local[mask], idx[mask]] = value[mask]
            return
        arr = self.view(s.view)
        idx = self._index(s.index, len(arr), mask, s.loc, f"write of {s.view.buffer}")
        if s.view.dtype.name == "bf16":
            value = (np.asarray(value, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        elif s.view.dtype.is_int:
            value = np.asarray(value).astype(np.int64).astype(s.view.dtype.numpy)
        arr[idx[mask]] = np.asarray(value)[mask].astype(arr.dtype)


    # -- cooperative matrices: one tile per subgroup, (subgroups, rows, cols)
    def by_subgroup(self, mask, loc=("<matrix variable>", 0)):
        """The subgroups taking part: a matrix operation is all of a subgroup or none of it."""
        rows = mask.reshape(-1, self.sg)
        if not (rows.all(axis=1) | ~rows.any(axis=1)).all():
            raise _err(loc, "a cooperative-matrix operation reached by only some invocations of a subgroup")
        return rows[:, 0]

    def uniform(self, o, active, loc, what: str):
        """A per-subgroup value that every invocation of the subgroup must agree on."""
        v = np.broadcast_to(np.asarray(self.value(o)).astype(np.int64), (self.n,)).reshape(-1, self.sg)
        if ((v != v[:, :1]).any(axis=1) & active).any():
            raise _err(loc, f"a cooperative matrix's {what} differs between invocations of a subgroup")
        return v[:, 0]

    def tile_index(self, m: MatrixType, array, offset, stride, column_major: bool, active, loc):
        """The tile's elements as scalar indices of `array` (offset and stride count its elements,
        vectors for a shared array of vectors, whose lanes then hold consecutive tile elements)."""
        off, st = (self.uniform(o, active, loc, w) for o, w in ((offset, "offset"), (stride, "stride")))
        lanes = array.dtype.lanes if isinstance(array, ir.Shared) else 1
        off, st = off[:, None, None] * lanes, st[:, None, None] * lanes
        r, c = np.arange(m.rows)[:, None], np.arange(m.cols)[None, :]
        return off + (c * st + r if column_major else r * st + c)

    def tile_memory(self, array, idx, active, loc, what: str):
        """(array as scalars, its row per subgroup or None, lanes) after checking `idx` is in
        bounds where active; a shared array's races are tracked per element, idx // lanes."""
        lanes = 1
        if isinstance(array, ir.Shared):
            arr, rows = self.shared[array.id], self.group_local[::self.sg]
            lanes = arr.shape[2] if arr.ndim == 3 else 1
            arr = arr.reshape(arr.shape[0], -1)
            size = arr.shape[1]
        else:
            arr, rows = self.view(array), None
            size = len(arr)
        bad = active[:, None, None] & ((idx < 0) | (idx >= size))
        if bad.any():
            raise _err(loc, f"out-of-bounds {what}: element {int(idx[bad][0]) // lanes} not in [0, {size // lanes})")
        return arr, rows, lanes

    def matrix_op(self, s: ir.Let, mask):
        active, m = self.by_subgroup(mask, s.loc), s.temp.dtype
        nsub = len(active)
        if s.op == "mat_fill":
            v = np.broadcast_to(np.asarray(self.value(s.args[0])), (self.n,))[::self.sg]
            return np.broadcast_to(v[:, None, None], (nsub, m.rows, m.cols)).astype(m.element.numpy)
        if s.op == "mat_mul_add":
            a, b, c = (self.value(x) for x in s.args)
            return (c.astype(np.float32) + np.matmul(a.astype(np.float32), b.astype(np.float32))).astype(m.element.numpy)
        src, offset, stride = s.args
        idx = self.tile_index(m, src, offset, stride, s.attrs["column_major"], active, s.loc)
        arr, rows, lanes = self.tile_memory(src, idx, active, s.loc, "matrix load")
        idx = np.where(active[:, None, None], idx, 0)
        if rows is None:
            return arr[idx].astype(m.element.numpy)
        g, el = np.broadcast_to(rows[:, None, None], idx.shape), idx // lanes
        if self.races:
            writer = self.writer[src.id][g, el]
            race = active[:, None, None] & (writer >= 0)
            if race.any():
                raise _err(s.loc, f"shared-memory race: a matrix load reads element {int(el[race][0])} that "
                                  f"invocation {int(writer[race][0])} wrote with no zdsl.barrier() between")
            first = self.lane_in_group[::self.sg]
            self.reader[src.id][g[active], el[active]] = np.broadcast_to(first[:, None, None], idx.shape)[active]
        return arr[g, idx].astype(m.element.numpy)

    def matrix_store(self, s: ir.MatrixStore, mask) -> None:
        active = self.by_subgroup(mask, s.loc)
        m = s.matrix.dtype
        idx = self.tile_index(m, s.array, s.offset, s.stride, s.column_major, active, s.loc)
        arr, rows, lanes = self.tile_memory(s.array, idx, active, s.loc, "matrix store")
        value = self.value(s.matrix)
        if rows is None:
            arr[idx[active]] = value[active].astype(arr.dtype)
            return
        g, el = np.broadcast_to(rows[:, None, None], idx.shape), idx // lanes
        if self.races:
            first = np.broadcast_to(self.lane_in_group[::self.sg][:, None, None], idx.shape)
            for seen, what in ((self.writer, "wrote"), (self.reader, "read")):
                other = seen[s.array.id][g, np.where(active[:, None, None], el, 0)]
                race = active[:, None, None] & (other >= 0) & (other != first)
                if race.any():
                    raise _err(s.loc, f"shared-memory race: a matrix store overwrites element {int(el[race][0])} "
                                      f"that invocation {int(other[race][0])} {what} with no zdsl.barrier() between")
            self.writer[s.array.id][g[active], el[active]] = first[active]
        arr[g[active], idx[active]] = value[active].astype(arr.dtype)


def interpret(k: ir.Kernel, groups: tuple[int, int, int], buffers: dict[str, np.ndarray], scalars: dict,
              specs: dict) -> None:
    """Run kernel `k` over `groups` workgroups, updating the numpy `buffers` in place. Chunks of
    workgroups run one after the other, and atomics in workgroup order within a statement: one
    legal GPU schedule, in which the workgroup that counts last (`last_workgroup`) comes after
    every other workgroup's earlier writes."""
    wg = k.workgroup[0] * k.workgroup[1] * k.workgroup[2]
    total = groups[0] * groups[1] * groups[2]
    per_chunk = max(1, (MATRIX_LANES if "coopmat" in k.features else MAX_LANES) // wg)
    for first in range(0, total, per_chunk):
        count = min(per_chunk, total - first)
        Run(k, groups, buffers, scalars, specs, first, count).run(k.body)
