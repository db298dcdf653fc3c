"""`@zdsl.kernel`: a Python function becomes a family of specialized kernel variants.

Parameters are classified by annotation: `Buffer[T]` (or `Coherent[T]`) → storage buffers
(bindings in order), a scalar type (`u32`, `f32`, ...) → push constants, `Spec[T]` →
specialization constants, `Const` → trace-time Python values. A `Variant` is one choice of
Const and Spec values: it traces once, emits GLSL, compiles (cached) and runs on a device or in
the interpreter.

A kernel also owns its launch: its grid (a function of the variant and the launch's sizes), the
sizes that key its tuning, and the bytes one launch moves. `KernelDef.launch` picks the variant
for a key, computes the groups and records a `Launch` into the sequence, so a graph says what to
compute and the tuner, the benches and the static ranking read what the graph really runs. Its
`example` makes inputs of any recorded size and says what its numpy reference gives for them,
so that any launch can be checked and timed.
"""

from __future__ import annotations

import inspect
import itertools
import struct
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np

from zdsl.errors import CompileError, KernelError, ZdslError
from zdsl.lang import ir
from zdsl.lang.glsl import GRID_SPEC_IDS
from zdsl.lang.language import BufferAnnotation, Const, Derived, SpecAnnotation
from zdsl.lang.trace import BufferParam, Tracer, Value, fail, tracing
from zdsl.lang.types import DType

UNUSED = "-"  # the access of a buffer parameter a variant never touches: bound, never read or written

REGISTRY: dict[str, "KernelDef"] = {}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "buffer", "scalar", "spec", "const"
    dtype: DType | None
    default: object
    coherent: bool = False  # a buffer declared Coherent[T]


class KernelDef:
    """A kernel and its variant space. Registered by name in REGISTRY."""

    def __init__(self, fn: Callable, *, workgroup, subgroup: str | None, variants: dict | None,
                 where: Callable | None, name: str | None, register: bool, tune: dict | None = None,
                 grid=1, key: tuple[str, ...] = (), sizes: tuple[str, ...] = (), traffic: Callable | None = None,
                 cpu: dict | None = None):
        self.fn = fn
        self.grid, self.key, self.sizes, self.traffic = grid, tuple(key), tuple(sizes), traffic
        self.name = name or fn.__name__
        self.workgroup = workgroup
        self.subgroup = subgroup
        self.variant_space = {k: list(v) for k, v in (variants or {}).items()}
        self.tune = {k: list(v) for k, v in (tune or {}).items()}
        self.cpu = dict(cpu or {})
        self.constraint = where
        self.source = (inspect.getsourcefile(fn), fn.__code__.co_firstlineno)
        self.params = self._parse_params(fn)
        self.scalar_defaults = {p.name: p.default for p in self.params if p.kind == "scalar" and p.default is not None}
        self._variants: dict[tuple, Variant] = {}
        self._traces: dict[tuple, ir.Kernel] = {}
        known = {p.name for p in self.params if p.kind in ("const", "spec")}
        for key in list(self.variant_space) + list(self.tune) + list(self.cpu) + ([subgroup] if subgroup else []):
            if key not in known:
                raise self._error(f"variant parameter '{key}' is not a Const or Spec parameter of {self.name}")
        if register:
            if self.name in REGISTRY and REGISTRY[self.name].source != self.source:
                raise self._error(f"a kernel named '{self.name}' is already registered at "
                                  f"{REGISTRY[self.name].source[0]}:{REGISTRY[self.name].source[1]}")
            REGISTRY[self.name] = self

    def _error(self, msg: str) -> KernelError:
        return KernelError(f"{self.source[0]}:{self.source[1]}: {msg}")

    def _parse_params(self, fn) -> list[Param]:
        hints = inspect.get_annotations(fn, eval_str=True)
        params = []
        for p in inspect.signature(fn).parameters.values():
            ann = hints.get(p.name)
            default = None if p.default is inspect.Parameter.empty else p.default
            if isinstance(ann, BufferAnnotation):
                params.append(Param(p.name, "buffer", ann.dtype, None, ann.coherent))
            elif isinstance(ann, SpecAnnotation):
                params.append(Param(p.name, "spec", ann.dtype, default))
            elif isinstance(ann, DType):
                params.append(Param(p.name, "scalar", ann, default))
            elif ann is Const:
                params.append(Param(p.name, "const", None, default))
            else:
                raise self._error(f"parameter '{p.name}' needs an annotation: Buffer[T] (or Coherent[T]), a "
                                  f"scalar type (u32, i32, f32), Spec[T] or Const")
        return params

    def example(self, fn: Callable) -> Callable:
        """Decorator: `fn(launch, rng, check) -> Example`, inputs for a recorded launch's sizes
        and what the reference says they give (check: a small version whose reference is cheap)."""
        self.make_example = fn
        return fn

    make_example: Callable | None = None

    # -- launches
    def groups(self, params: dict, sizes: dict) -> tuple[int, int, int]:
        """The grid of a launch of the variant `params` with these sizes (scalars included)."""
        g = self.grid(SimpleNamespace(**params), SimpleNamespace(**sizes)) if callable(self.grid) else self.grid
        return _groups(g)

    def bytes_moved(self, params: dict, sizes: dict) -> int:
        """Bytes one launch reads and writes: what a bandwidth bound divides."""
        if self.traffic is None:
            raise ZdslError(f"{self.name} states no traffic (the bytes a launch moves)")
        return int(self.traffic(SimpleNamespace(**params), SimpleNamespace(**sizes)))

    def launch(self, seq, pick: Callable, *, label: str | None = None, **args) -> "Launch":
        """Record a launch into the sequence `seq`. Consts and Specs given are fixed; `pick(kernel,
        key, fixed)` chooses the variant for the tuning key (the fixed values and the sizes named
        in `key`). Buffers and scalars go to the dispatch; names in `sizes` only to the grid."""
        names = {p.name: p.kind for p in self.params}
        unknown = sorted(set(args) - set(names) - set(self.sizes))
        if unknown:
            raise ZdslError(f"{self.name} has no parameter {', '.join(unknown)}")
        fixed = {n: v for n, v in args.items() if names.get(n) in ("const", "spec")}
        sizes = {n: v for n, v in args.items() if names.get(n) == "scalar" or n in self.sizes}
        key = {**fixed, **{n: sizes[n] for n in self.key}}
        variant = pick(self, key, fixed)
        groups = self.groups(variant.params, sizes)
        buffers = {n: v for n, v in args.items() if names.get(n) == "buffer"}
        record = Launch(self, variant, fixed, key, sizes, {n: b.nbytes for n, b in buffers.items()}, groups,
                        label or self.name)
        launches = getattr(seq, "launches", None)
        if launches is not None:
            launches.append(record)
        if not getattr(seq, "dry", False):
            variant.dispatch(seq, groups, label=label, **buffers,
                             **{n: v for n, v in sizes.items() if names.get(n) == "scalar"})
        return record

    def __call__(self, *args, **kwargs):
        raise ZdslError(f"kernel {self.name} is not called directly: use "
                        f"{self.name}.specialize(...).run(device, groups, ...) or .interpret(groups, ...)")

    # -- variants
    def space(self, subgroup_sizes: tuple[int, ...] | None = None) -> list[dict]:
        """Every variant the kernel declares (filtered by its constraint and, when given, by the
        subgroup sizes a device supports)."""
        keys = list(self.variant_space)
        out = []
        for values in itertools.product(*(self.variant_space[k] for k in keys)):
            v = self.complete(dict(zip(keys, values)))
            if subgroup_sizes is not None and self.subgroup and v[self.subgroup] not in subgroup_sizes:
                continue
            if self.constraint is None or self.constraint(SimpleNamespace(**v)):
                out.append(v)
        return out

    def allows(self, **given) -> bool:
        """Whether the variant of `given` values (the rest at their defaults) meets the kernel's
        constraint: a graph asks before it picks the kernel for a shape."""
        return self.constraint is None or bool(self.constraint(SimpleNamespace(**self.complete(given))))

    def complete(self, given: dict) -> dict:
        names = {p.name: p for p in self.params if p.kind in ("const", "spec")}
        unknown = set(given) - set(names)
        if unknown:
            raise ZdslError(f"{self.name} has no compile-time parameter {', '.join(sorted(unknown))} "
                            f"(it has {', '.join(names) or 'none'})")
        out = {}
        for name, p in names.items():
            value = given.get(name, p.default)
            if isinstance(value, Derived):
                value = value.fn(SimpleNamespace(**out))
            if value is None:
                raise ZdslError(f"{self.name} needs a value for {name}")
            out[name] = value
        return out

    def specialize(self, **params) -> Variant:
        params = self.complete(params)
        key = tuple(sorted((k, repr(v)) for k, v in params.items()))
        if key not in self._variants:
            self._variants[key] = Variant(self, params)
        return self._variants[key]

    def specialized(self) -> list[Variant]:
        """The variants made so far, e.g. to ask the driver about the pipelines a run used."""
        return list(self._variants.values())

    def trace(self, consts: dict) -> ir.Kernel:
        key = tuple(sorted((k, repr(v)) for k, v in consts.items()))
        if key not in self._traces:
            self._traces[key] = self._trace(consts)
        return self._traces[key]

    def _resolve_workgroup(self, consts: dict) -> tuple[int, int, int]:
        wg = self.workgroup
        if isinstance(wg, str):
            wg = consts[wg]
        elif callable(wg):
            wg = wg(SimpleNamespace(**consts))
        wg = (wg,) if isinstance(wg, int) else tuple(wg)
        if not all(isinstance(w, int) and w > 0 for w in wg) or len(wg) > 3:
            raise self._error(f"workgroup size must be 1..3 positive ints, got {wg}")
        return (wg + (1, 1))[:3]

    def _trace(self, consts: dict) -> ir.Kernel:
        workgroup = self._resolve_workgroup(consts)
        sg = consts[self.subgroup] if self.subgroup else None
        if sg is not None and (workgroup[0] * workgroup[1] * workgroup[2]) % sg:
            raise self._error(f"workgroup {workgroup} is not a whole number of subgroups of {sg}")
        tracer = Tracer(sg, workgroup)
        args, buffers, scalars, specs = {}, [], [], []
        for p in self.params:
            if p.kind == "buffer":
                args[p.name] = BufferParam(p.name, len(buffers), p.dtype)
                buffers.append(args[p.name])
            elif p.kind == "scalar":
                scalars.append(ir.Scalar(p.name, p.dtype))
                args[p.name] = Value(scalars[-1])
            elif p.kind == "spec":
                specs.append(ir.SpecParam(p.name, p.dtype, len(specs)))
                args[p.name] = Value(specs[-1])
            else:
                args[p.name] = consts[p.name]
        try:
            with tracing(tracer):
                self.fn(**args)
        except KernelError:
            raise
        except ZdslError:
            raise
        except Exception as e:  # a plain Python error in the kernel body: point at its line
            raise self._locate(e) from e
        access = [(b.name, b.dtype, "rw" if b.reads and b.writes else "w" if b.writes else "r" if b.reads else UNUSED)
                  for b in buffers]
        views = [v for b in buffers for v in b.views.values()]
        label = f"{self.name}[{','.join(f'{k}={v}' for k, v in consts.items())}]" if consts else self.name
        coherent = frozenset(p.name for p in self.params if p.coherent)
        return ir.Kernel(self.name, tracer.blocks[0], workgroup, sg, access, views, scalars, specs,
                         tracer.shared, tracer.features, self.source, label, tracer.locals, tracer.tables, coherent)

    def _locate(self, e: Exception) -> KernelError:
        file = self.source[0]
        frames = [f for f in traceback.extract_tb(sys.exc_info()[2]) if f.filename == file]
        line = frames[-1].lineno if frames else self.source[1]
        return KernelError(f"{file}:{line}: {type(e).__name__}: {e}")


def kernel(fn=None, *, workgroup=64, subgroup: str | None = None, variants: dict | None = None,
           where: Callable | None = None, name: str | None = None, register: bool = True, tune: dict | None = None,
           grid=1, key: tuple[str, ...] = (), sizes: tuple[str, ...] = (), traffic: Callable | None = None,
           cpu: dict | None = None):
    """Declare a kernel.

    workgroup: an int or tuple, the name of a Const parameter, or a function of the Const values.
    subgroup:  the name of the Const parameter holding the subgroup size the variant requires.
    variants:  {param: values} — the space `zdsl build` and the tuner enumerate.
    where:     a predicate on a variant's values (a namespace) that rules combinations out.
    tune:      {param: values} the tuner tries beyond `variants` (not built ahead of time), e.g.
               workgroup sizes; `where` rules their combinations out too.
    grid:      the workgroups of a launch: an int, or a function of (variant values, sizes), both
               namespaces; sizes are the launch's scalars and the names in `sizes`.
    key:       the sizes that, with the Consts a launch fixes, key its tuning.
    sizes:     launch-only arguments the grid, key or traffic need (slots, heads, ...).
    traffic:   bytes one launch moves, a function of (variant values, sizes).
    cpu:       {param: value} a CPU device (lavapipe) runs where nothing is tuned for it: there a
               pipeline's first dispatch compiles it for seconds (big tiles unrolled: 7-24 s a
               variant on 2 cores) while a small model's dispatches take microseconds, so the
               variant that compiles soonest is the fast one.
    """
    def wrap(f):
        return KernelDef(f, workgroup=workgroup, subgroup=subgroup, variants=variants, where=where,
                         name=name, register=register, tune=tune, grid=grid, key=key, sizes=sizes, traffic=traffic,
                         cpu=cpu)
    return wrap(fn) if fn is not None else wrap


@dataclass(frozen=True)
class Launch:
    """One launch as a graph records it: what the tuner, the benches and the static ranking work
    from (`kernel.make_example(launch, ...)` rebuilds inputs of its sizes)."""

    kernel: KernelDef
    variant: "Variant"
    fixed: dict      # the Consts and Specs the caller chose
    key: dict        # the tuning key: fixed, and the sizes the kernel names in `key`
    sizes: dict      # scalars and launch-only sizes, by name
    buffers: dict    # bytes of each buffer bound, by name
    groups: tuple
    label: str


@dataclass
class Example:
    """Inputs for one launch (`args`: arrays and scalars by parameter name), and for check cases
    `expect(params) -> {buffer: (reference, tolerance)}`. `rotate(n)` gives n − 1 more copies of
    the big inputs (or other experts to route to) to take turns with, so that caches do not
    flatter small shapes; `then` lists launches that run after and are tuned with this one,
    as (kernel, fixed(params), tuned(params))."""

    args: dict
    expect: Callable[[dict], dict] | None = None
    rotate: Callable[[int], dict] = lambda n: {}
    then: list = field(default_factory=list)


class lazy:
    """A value computed on first use and kept in the instance, like functools.cached_property but
    without the lock Python 3.11 shares across every instance (one variant's compile would wait
    for every other's)."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.fn.__name__] = self.fn(obj)
        return value


class Variant:
    """One specialization of a kernel: Const values fixed in the code, Spec values in the pipeline."""

    arrays = None  # descriptors a binding holds: one each (a Pieced twin binds arrays)

    def __init__(self, kdef: KernelDef, params: dict):
        self.kernel = kdef
        self.params = params
        spec_names = {p.name for p in kdef.params if p.kind == "spec"}
        self.consts = {k: v for k, v in params.items() if k not in spec_names}
        self.spec_values = {k: v for k, v in params.items() if k in spec_names}
        self._pipelines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._twins: dict[tuple, Pieced] = {}

    @property
    def label(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.kernel.name}[{inner}]" if inner else self.kernel.name

    @lazy
    def ir(self) -> ir.Kernel:
        return self.kernel.trace(self.consts)

    @lazy
    def _glsl(self):
        from zdsl.lang.glsl import emit
        return emit(self.ir)

    @property
    def glsl(self) -> str:
        return self._glsl[0]

    @lazy
    def compiled(self):
        return self.compile()

    def compile(self, optimize: bool = True):
        """The variant's GLSL → validated SPIR-V (optimized, as runs use it, unless not
        `optimize`: a quicker check that it compiles), a compile error pointing at the kernel's
        source line where the GLSL's line came from one."""
        from zdsl.toolchain import compile_cached
        text, line_locs = self._glsl
        try:
            return compile_cached(text, name=self.kernel.name, optimize=optimize)
        except CompileError as e:
            line = getattr(e, "glsl_line", None)
            loc = max((l for l in line_locs if l[0] <= line), default=None) if line else None
            if loc is None:
                raise
            raise KernelError(f"{loc[1]}:{loc[2]}: the generated GLSL does not compile: {e}") from e

    @property
    def spirv(self) -> bytes:
        return self.compiled.spirv

    def groups(self, **sizes) -> tuple[int, int, int]:
        """The grid of a launch of this variant with these sizes (the kernel's `grid`)."""
        return self.kernel.groups(self.params, sizes)

    # -- device side
    @property
    def bindings(self) -> tuple[str, ...]:
        return tuple(access for _, _, access in self.ir.buffers)

    @property
    def push_size(self) -> int:
        return 4 * len(self.ir.scalars)

    def spec_constants(self) -> dict[int, int | float | bool]:
        out = {}
        for s in self.ir.specs:
            v = self.spec_values[s.name]
            out[s.id] = float(v) if s.dtype.is_float else bool(v) if s.dtype.kind == "b" else int(v)
        return out

    @lazy
    def _scalars_read(self) -> set[str]:
        return ir.scalars_read(self.ir.body)

    def _with_unread(self, values: dict) -> dict:
        """Every scalar's value; one this variant never reads (a Const turned its use off) may be
        left out: 0; one with a default in the kernel's signature: that."""
        values = {**{s.name: 0 for s in self.ir.scalars if s.name not in self._scalars_read},
                  **self.kernel.scalar_defaults, **values}
        missing = [s.name for s in self.ir.scalars if s.name not in values]
        if missing:
            raise ZdslError(f"{self.label}: missing scalar argument(s) {', '.join(missing)}")
        return values

    def pack_push(self, values: dict) -> bytes:
        values = self._with_unread(values)
        fmt = {"f": "f", "i": "i", "u": "I", "b": "I"}
        return b"".join(struct.pack("<" + fmt[s.dtype.kind], values[s.name]) for s in self.ir.scalars)

    def pipeline(self, device, *, statistics: bool = False, isa: bool = False):
        """`isa`: with the machine code (`Pipeline.isa`, or NVIDIA's `Pipeline.code`) too."""
        def lacking(pipe) -> bool:
            return pipe is None or (statistics and pipe.statistics is None) or (isa and pipe.isa is None
                                                                                and pipe.code is None)
        pipe = self._pipelines.get(device)
        if lacking(pipe):
            spirv = self.spirv  # compiled outside the lock: another thread may make its pipelines meanwhile
            with device.lock:  # made once, also when a Recorder's thread asks at the same time
                pipe = self._pipelines.get(device)
                if lacking(pipe):
                    pipe = device.pipeline(spirv, bindings=self.bindings, push_size=self.push_size,
                                           spec=self.spec_constants(), subgroup_size=self.ir.subgroup_size,
                                           name=self.label, statistics=statistics, isa=isa, grid_ids=GRID_SPEC_IDS,
                                           arrays=self.arrays)
                    self._pipelines[device] = pipe
        return pipe

    def _check_arrays(self, arrays) -> None:
        """numpy arguments must have the buffer's element type (raw byte buffers take any)."""
        for a, (name, dtype, _) in zip(arrays, self.ir.buffers):
            a = np.asarray(a)
            if dtype.name != "u8" and a.dtype != dtype.numpy:
                raise ZdslError(f"{self.label}: argument {name} is {a.dtype} but the kernel declares "
                                f"Buffer[{dtype.name}] ({dtype.numpy}); convert it with .astype(np.{dtype.numpy})")

    def _split_args(self, args: dict, placeholder):
        """(buffers in binding order, scalars). A buffer this variant never touches (a Const
        turned its use off) may be left out: `placeholder(dtype)` stands in for it."""
        names = [b[0] for b in self.ir.buffers]
        unknown = set(args) - set(names) - {s.name for s in self.ir.scalars}
        if unknown:
            raise ZdslError(f"{self.label} has no parameter {', '.join(sorted(unknown))}")
        missing = [n for n, _, acc in self.ir.buffers if n not in args and acc != UNUSED]
        if missing:
            raise ZdslError(f"{self.label}: missing buffer argument(s) {', '.join(missing)}")
        buffers = [args[n] if n in args else placeholder(dtype) for n, dtype, _ in self.ir.buffers]
        return buffers, {s.name: args[s.name] for s in self.ir.scalars if s.name in args}

    def dispatch(self, seq, groups, *, label: str | None = None, **args) -> None:
        """Record this variant into a runtime Sequence; buffers are runtime Buffers. `label`
        names the dispatch in timings (default: the variant's label). Where a buffer comes in
        pieces (larger than the device binds at once), the variant's Pieced twin runs."""
        buffers, scalars = self._split_args(args, lambda dtype: seq.device.placeholder)
        buffers = [seq.device.placeholder if acc == UNUSED and _pieced(b) else b
                   for b, (_, _, acc) in zip(buffers, self.ir.buffers)]
        variant, push = self, self.pack_push(scalars)
        if any(_pieced(b) for b in buffers):
            layout = _array_sizes(buffers, seq.device.storage_buffers)
            variant = self.pieced(layout)
            push += variant.starts(buffers)
            buffers = [p for b, n in zip(buffers, layout) for p in (_padded(b.bindings(), n) if n else [b])]
        seq.dispatch(variant.pipeline(seq.device), _groups(groups), buffers, push,
                     label=f"{label}:{self.label}" if label else self.label)

    def pieced(self, layout: tuple) -> "Pieced":
        """The twin that binds buffers in pieces as `layout` says: for each buffer, None or its
        pieces' count. Made once a layout."""
        twin = self._twins.get(layout)
        if twin is None:
            twin = self._twins[layout] = Pieced(self, layout)
        return twin

    def run(self, device, groups, **args) -> dict[str, np.ndarray]:
        """One-shot: upload numpy arrays, dispatch once, return the buffers the kernel writes."""
        arrays, scalars = self._split_args(args, _placeholder_array)
        self._check_arrays(arrays)
        names = [n for n, _, _ in self.ir.buffers]
        bufs = [device.upload(np.ascontiguousarray(a), name=n) for a, n in zip(arrays, names)]
        try:
            seq = device.sequence()
            self.dispatch(seq, groups, **dict(zip(names, bufs)), **scalars)
            seq.run()
            return {n: b.read(np.asarray(a).dtype, np.shape(a))
                    for a, b, (n, _, acc) in zip(arrays, bufs, self.ir.buffers) if "w" in acc}
        finally:
            for b in bufs:
                b.free()

    def interpret(self, groups, **args) -> dict[str, np.ndarray]:
        """Run on the CPU with numpy (subgroup semantics at this variant's subgroup size);
        returns copies of the buffers the kernel writes."""
        from zdsl.lang.interp import interpret
        arrays, scalars = self._split_args(args, _placeholder_array)
        self._check_arrays(arrays)
        work = {n: np.array(a, copy=True) for a, (n, _, _) in zip(arrays, self.ir.buffers)}
        interpret(self.ir, _groups(groups), work, self._with_unread(scalars), self.spec_values)
        return {n: work[n] for n, _, acc in self.ir.buffers if "w" in acc}


class Pieced(Variant):
    """A variant with some buffers bound in pieces, each piece a descriptor of an array the
    shader indexes per element (zdsl/lang/glsl.py): the same IR and code otherwise, so the
    variant without pieces keeps its exact GLSL. Where each such buffer starts in its first
    piece and the size of its pieces follow the kernel's scalars as push constants, so slices of
    one buffer, and buffers in pieces of another size, share a pipeline."""

    def __init__(self, base: Variant, layout: tuple):
        super().__init__(base.kernel, base.params)
        self.layout = layout
        self.pieces = {name: p for (name, _, _), p in zip(base.ir.buffers, layout) if p}

    @lazy
    def _glsl(self):
        from zdsl.lang.glsl import emit
        return emit(self.ir, self.pieces)

    @property
    def label(self) -> str:
        return f"{super().label}(pieced {','.join(self.pieces)})"

    @property
    def bindings(self) -> tuple[str, ...]:
        return tuple(acc for (_, _, acc), p in zip(self.ir.buffers, self.layout) for _ in range(p or 1))

    @property
    def arrays(self) -> tuple[int, ...]:
        return tuple(p or 1 for p in self.layout)

    @property
    def push_size(self) -> int:
        return super().push_size + 8 * len(self.pieces)

    def starts(self, buffers: list) -> bytes:
        """The push constants after the kernel's, for each pieced buffer: the byte where it starts
        in its first piece (a whole number of the elements of every view the kernel reads it
        through) and log2 of its pieces' bytes."""
        starts = []
        for (name, _, _), buf in zip(self.ir.buffers, buffers):
            if name not in self.pieces:
                continue
            for view in self.ir.views:
                if view.buffer == name and buf.start % view.dtype.nbytes:
                    raise ZdslError(f"{self.kernel.name}: {name} ({buf.name}) starts {buf.start} bytes into a piece, "
                                    f"not a whole number of its {view.dtype!r} elements; slice it at a multiple of "
                                    f"{view.dtype.nbytes} bytes")
            starts += [buf.start, buf.piece.bit_length() - 1]
        return struct.pack(f"<{len(starts)}I", *starts)


def _array_sizes(buffers: list, limit: int) -> tuple:
    """For each buffer, None or the descriptors its pieces take: their count rounded up to a power
    of two, so that buffers of 5, 6 or 7 pieces share one pipeline (a batch's caches joined a
    sequence a piece, a cache growing a piece at a time; lavapipe compiles each twin anew), unless
    that passes the `limit` of descriptors a shader binds, where the exact counts still fit."""
    exact = tuple(len(b.pieces) if _pieced(b) else None for b in buffers)
    rounded = tuple(n and 1 << (n - 1).bit_length() for n in exact)
    return rounded if sum(n or 1 for n in rounded) <= limit else exact


def _padded(pieces: list, n: int) -> list:
    """A buffer's pieces filling n descriptors: the last one again in those past them (the shader
    never indexes them)."""
    return pieces + pieces[-1:] * (n - len(pieces))


def _pieced(buf) -> bool:
    """Whether a runtime buffer comes in pieces (runtime/memory.py's PiecedBuffer, known here by
    what binding one needs: `bindings()`, `pieces`, `piece` and `start`)."""
    return hasattr(buf, "bindings")


def compile_variants(variants, progress: Callable[[int], None] | None = None) -> int:
    """Compile the variants' SPIR-V on every core (threads: glslang, spirv-val and spirv-opt run
    outside the GIL); returns how many were compiled, not found in the cache. `progress(n)`
    hears each one done."""
    from concurrent.futures import ThreadPoolExecutor
    import os

    def build(v: Variant) -> bool:
        compiled = v.compiled
        if progress:
            progress(1)
        return not compiled.cached

    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="zdsl-compile") as pool:
        return sum(pool.map(build, list(dict.fromkeys(variants))))


def _placeholder_array(dtype) -> np.ndarray:
    return np.zeros(4, dtype.numpy)


def _groups(groups) -> tuple[int, int, int]:
    g = (groups,) if isinstance(groups, (int, np.integer)) else tuple(groups)
    g = tuple(int(x) for x in g) + (1,) * (3 - len(g))
    if any(x < 1 for x in g):
        raise ZdslError(f"dispatch needs at least one workgroup per axis, got {g}")
    return g


__all__ = ["kernel", "KernelDef", "Variant", "REGISTRY", "fail"]
