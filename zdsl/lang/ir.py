"""The kernel IR: a small structured statement tree of typed operands.

Tracing a kernel produces a `Body` (a list of statements). Every computed value is a `Let`
bound to a numbered temporary, so both backends (GLSL text and the numpy interpreter) walk
the same tree and see operations in the order the Python source wrote them. Every statement
keeps the Python file and line it came from, for errors and for comments in the GLSL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.lang.types import DType

Loc = tuple[str, int]  # (file, line) of the kernel source


# ---- operands ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Const:
    value: object
    dtype: DType


@dataclass(frozen=True)
class Temp:
    id: int
    dtype: DType


@dataclass(frozen=True)
class VarRef:
    id: int
    name: str
    dtype: DType


@dataclass(frozen=True)
class Scalar:
    """A push-constant parameter."""
    name: str
    dtype: DType


@dataclass(frozen=True)
class SpecParam:
    """A specialization-constant parameter."""
    name: str
    dtype: DType
    id: int


@dataclass(frozen=True)
class Builtin:
    """gl_WorkGroupID.x and friends: name is one of BUILTINS."""
    name: str
    axis: int
    dtype: DType


@dataclass(frozen=True)
class ConstExpr:
    """Arithmetic on constants and specialization constants only: a compile-time expression,
    usable as a shared-array size, emitted inline."""
    op: str
    args: tuple
    dtype: DType


Operand = Const | Temp | VarRef | Scalar | SpecParam | Builtin | ConstExpr

BUILTINS = ("workgroup_id", "local_id", "global_id", "num_workgroups", "local_index",
            "subgroup_id", "lane_id")


# ---- memory -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class View:
    """A buffer parameter seen as an array of `dtype` (storage type, maybe a vector)."""
    buffer: str
    binding: int
    dtype: DType


@dataclass(frozen=True)
class Shared:
    id: int
    dtype: DType
    size: Operand | int
    over: tuple[int, ...] = ()  # the arrays whose storage it takes (zdsl.shared's `over`)


@dataclass(frozen=True)
class Local:
    """A per-invocation array (registers or private memory), indexable at run time."""
    id: int
    dtype: DType
    size: int


@dataclass(frozen=True)
class Table:
    """A constant array baked into the shader (lookup tables such as IQ4's)."""
    id: int
    dtype: DType
    values: tuple


# ---- statements ---------------------------------------------------------------------------------

@dataclass
class Let:
    """temp = op(args). `op` names an entry of the backends' op tables."""
    temp: Temp
    op: str
    args: tuple
    loc: Loc
    attrs: dict = field(default_factory=dict)


@dataclass
class DeclareVar:
    var: VarRef
    init: Operand
    loc: Loc


@dataclass
class Assign:
    var: VarRef
    value: Operand
    loc: Loc


@dataclass
class Store:
    view: View | Shared | Local
    index: Operand
    value: Operand
    loc: Loc


@dataclass
class MatrixStore:
    """A cooperative matrix into `array` (zdsl/lang/matrices.py)."""
    matrix: Operand
    array: View | Shared
    offset: Operand
    stride: Operand
    column_major: bool
    loc: Loc


@dataclass
class If:
    cond: Operand
    then: list
    orelse: list
    loc: Loc


@dataclass
class For:
    var: VarRef
    start: Operand
    stop: Operand
    step: Operand
    body: list
    unroll: bool | int
    loc: Loc


@dataclass
class Barrier:
    loc: Loc


@dataclass
class MemoryBarrier:
    """This invocation's buffer writes before it are visible device-wide before its accesses after it."""
    loc: Loc


@dataclass
class Kernel:
    """A traced kernel variant, ready for a backend."""
    name: str
    body: list
    workgroup: tuple[int, int, int]
    subgroup_size: int | None
    buffers: list  # [(name, storage dtype, access "r"/"w"/"rw")] in binding order
    views: list[View]
    scalars: list[Scalar]
    specs: list[SpecParam]
    shared: list[Shared]
    features: set[str]
    source: Loc
    label: str = ""
    locals: list = field(default_factory=list)
    tables: list = field(default_factory=list)
    coherent: frozenset = frozenset()  # names of the buffers declared Coherent


def scalars_read(body) -> set[str]:
    """Names of the push-constant parameters that the statements of `body` read."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, Scalar):
            found.add(node.name)
        elif isinstance(node, (list, tuple)):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            for item in node.values():
                visit(item)
        elif hasattr(node, "__dataclass_fields__") and not isinstance(node, (Const, Temp, VarRef, SpecParam, Builtin, View)):
            for name in node.__dataclass_fields__:
                visit(getattr(node, name))
    visit(body)
    return found
