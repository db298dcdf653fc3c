"""IR → GLSL compute shader text.

The output is deterministic (stable names and order, paths relative to the source root) so the
SPIR-V cache keyed on it never goes stale, and readable: each statement is preceded, when the
Python line changes, by a comment quoting the kernel line that produced it.
"""

from __future__ import annotations

import functools
import linecache
import os

import numpy as np

from zdsl.errors import ZdslError
from zdsl.lang import ir
from zdsl.lang.ops import BINARY, HELPER_TYPES, TERNARY, UNARY
from zdsl.lang.types import DType, f32, u32

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BUILTIN = {"workgroup_id": "zdsl_wg", "local_id": "gl_LocalInvocationID",
            "num_workgroups": "zdsl_nwg", "local_index": "gl_LocalInvocationIndex", "subgroup_id": "gl_SubgroupID",
            "lane_id": "gl_SubgroupInvocationID"}
_SUBGROUP = {"sg_sum": "Add", "sg_max": "Max", "sg_min": "Min"}
_BITCAST = {("u", "f"): "uintBitsToFloat", ("i", "f"): "intBitsToFloat",
            ("f", "u"): "floatBitsToUint", ("f", "i"): "floatBitsToInt", ("u", "i"): "int", ("i", "u"): "uint"}

# The runtime folds a grid past the device's per-axis workgroup limits into the other axes
# (runtime/sequence.py); a folded pipeline is specialized with its logical grid here, and every
# kernel reads its workgroup ids through these, so no kernel works around the limit itself.
# Unfolded (GRID_X = 0, the default) the driver's constant folding leaves the plain builtins.
GRID_SPEC_IDS = (1000, 1001, 1002)
_GRID_PROLOGUE = """\
    uvec3 zdsl_wg = gl_WorkGroupID, zdsl_nwg = gl_NumWorkGroups;
    if (zdsl_grid_x != 0u) {  // a folded grid: this workgroup's place in the logical one
        uint zdsl_flat = gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
        if (zdsl_flat >= zdsl_grid_x * zdsl_grid_y * zdsl_grid_z) return;
        zdsl_wg = uvec3(zdsl_flat % zdsl_grid_x, zdsl_flat / zdsl_grid_x % zdsl_grid_y, zdsl_flat / (zdsl_grid_x * zdsl_grid_y));
        zdsl_nwg = uvec3(zdsl_grid_x, zdsl_grid_y, zdsl_grid_z);
    }"""

DOT4_DECL = ('spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], '
             'id = 4450) int zdot4_i8(int a, int b, spirv_literal int fmt);')


@functools.lru_cache(maxsize=None)
def relpath(file: str) -> str:
    try:
        rel = os.path.relpath(file, _ROOT)
    except ValueError:
        return os.path.basename(file)
    return os.path.basename(file) if rel.startswith("..") else rel


def literal(value, dtype: DType) -> str:
    if dtype.kind == "b":
        return "true" if value else "false"
    if dtype.kind == "u":
        return f"{int(value)}u"
    if dtype.kind == "i":
        return f"{int(value)}" if value >= 0 else f"({int(value)})"
    v = float(np.float32(value))
    if np.isnan(v):
        text = "uintBitsToFloat(0x7fc00000u)"
    elif np.isinf(v):
        text = "uintBitsToFloat(0x7f800000u)" if v > 0 else "uintBitsToFloat(0xff800000u)"
    else:
        text = repr(v)
        if "e" not in text and "." not in text:
            text += ".0"
    return text if dtype.name == "f32" else f"{dtype.glsl}({text})"


# GLSL words a Python parameter name may collide with; such names get a trailing underscore.
_RESERVED = set("""in out inout uniform buffer shared input output sample patch filter common partition
active attribute const varying layout centroid flat smooth noperspective invariant precise coherent
volatile restrict readonly writeonly resource subroutine struct void bool int uint float double
true false discard return break continue do for while switch case default if else lowp mediump
highp precision image texture sampler asm class union enum typedef template this goto inline
noinline public static extern external interface long short half fixed unsigned superp cast
namespace using main mix dot min max abs exp log sign step""".split())


def safe(name: str) -> str:
    return f"{name}_" if name in _RESERVED or name.startswith("gl_") else name


def view_name(v: ir.View, declared: dict) -> str:
    return safe(v.buffer) if declared[v.buffer] == v.dtype else f"{v.buffer}_{v.dtype!r}"


def _log2(n: int) -> int:
    return n.bit_length() - 1


def start_field(buffer: str) -> str:
    """The push constant after the kernel's own that says where a pieced buffer starts."""
    return f"zdsl_start_{buffer}"


def piece_field(buffer: str) -> str:
    """The push constant beside start_field: log2 of a piece's bytes."""
    return f"zdsl_piece_{buffer}"


class Emitter:
    """`pieces`: buffer name → descriptors, for the buffers bound in pieces (runtime/memory.py's
    PiecedBuffer): each view of one is an array of blocks, and an element `at` = index + start (in
    elements) lives in piece `at >> s` at `at & (2^s − 1)`, where a piece holds 2^s elements (a
    power of two, so no naturally aligned element straddles a seam). The piece's size comes as a
    push constant, not in the code: buffers in pieces of any size share a pipeline (on lavapipe,
    one compilation)."""

    def __init__(self, k: ir.Kernel, pieces: dict[str, int] | None = None):
        self.k = k
        self.pieces = pieces or {}
        self.declared = {name: dtype for name, dtype, _ in k.buffers}
        self.lines: list[str] = []
        self.locs: list[tuple[int, str, int]] = []  # (GLSL line, file, python line)
        self.last_loc = None
        self.helpers: set[str] = set()
        self.uses_f16 = "f16" in k.features
        self.uses_grid = False  # whether the body reads workgroup ids (then it declares the grid)

    # -- operands
    def op(self, o) -> str:
        if isinstance(o, ir.Const):
            return literal(o.value, o.dtype)
        if isinstance(o, ir.Temp):
            return f"t{o.id}"
        if isinstance(o, ir.VarRef):
            return o.name
        if isinstance(o, ir.Scalar):
            return f"pc.{safe(o.name)}"
        if isinstance(o, ir.SpecParam):
            return f"sc_{o.name}"
        if isinstance(o, ir.Builtin):
            axis = "xyz"[o.axis]
            if o.name in ("workgroup_id", "global_id", "num_workgroups"):
                self.uses_grid = True
            if o.name == "global_id":
                return f"(zdsl_wg.{axis} * {self.k.workgroup[o.axis]}u + gl_LocalInvocationID.{axis})"
            base = _BUILTIN[o.name]
            if o.name in ("workgroup_id", "local_id", "num_workgroups"):
                return f"{base}.{axis}"
            return base
        if isinstance(o, ir.ConstExpr):
            return self.expr(o.op, o.args, o.dtype, {})
        raise TypeError(o)

    def expr(self, op: str, args: tuple, dtype: DType, attrs: dict) -> str:
        a = [self.op(x) if not isinstance(x, (ir.View, ir.Shared, ir.Local, ir.Table)) else None for x in args]
        if op == "mod":
            return f"mod({a[0]}, {a[1]})" if dtype.is_float else f"({a[0]} % {a[1]})"
        if op in BINARY:
            return BINARY[op].glsl.format(*a)
        if op in UNARY:
            if UNARY[op].helper:
                self.helpers.add(op)
            return UNARY[op].glsl.format(*a)
        if op in TERNARY:
            return TERNARY[op].glsl.format(*a)
        if op in ("cast", "splat"):
            return f"{dtype.glsl}({a[0]})"
        if op == "bitcast":
            src = args[0].dtype.kind
            return f"{_BITCAST[(src, dtype.kind)]}({a[0]})" if src != dtype.kind else a[0]
        if op == "lane":
            return f"{a[0]}[{attrs['lane']}]"
        if op == "vec":
            return f"{dtype.glsl}({', '.join(a)})"
        if op == "dot":
            return f"dot({a[0]}, {a[1]})"
        if op == "f16_bits":
            return f"unpackHalf2x16({a[0]}).x"
        if op == "bf16_bits":
            return f"uintBitsToFloat(({a[0]}) << 16)"
        if op == "unpack_bytes":
            return f"vec4(unpack8({a[0]}))"
        if op == "dot4_i8":
            return f"zdot4_i8(int({a[0]}), int({a[1]}), 0)"
        if op == "load":
            view = args[0]
            value = self.widen(self.element(view, a[1]), view.dtype)
            if len(args) == 2:
                return value
            other = a[3] if args[3].dtype.lanes == dtype.lanes else f"{dtype.glsl}({a[3]})"
            return f"({a[2]} ? {value} : {other})"
        if op == "shared_load":
            return f"sh{args[0].id}[{a[1]}]"
        if op == "local_load":
            return f"lo{args[0].id}[{a[1]}]"
        if op == "table_load":
            return f"tb{args[0].id}[{a[1]}]"
        if op == "sg_prefix":
            return f"subgroup{'Inclusive' if attrs['inclusive'] else 'Exclusive'}Add({a[0]})"
        if op == "sg_count":
            return f"subgroupBallotBitCount(subgroupBallot({a[0]}))"
        if op in _SUBGROUP:
            cluster = attrs.get("cluster")
            if cluster:
                return f"subgroupClustered{_SUBGROUP[op]}({a[0]}, {cluster})"
            return f"subgroup{_SUBGROUP[op]}({a[0]})"
        if op == "sg_broadcast":
            return f"subgroupBroadcast({a[0]}, {attrs['lane']}u)"
        if op == "sg_shuffle":
            return f"subgroupShuffle({a[0]}, {a[1]})"
        if op == "sg_shuffle_xor":
            return f"subgroupShuffleXor({a[0]}, {a[1]})"
        if op == "mat_fill":
            return f"{dtype.glsl}({a[0]})"
        if op == "mat_mul_add":
            return f"coopMatMulAdd({a[0]}, {a[1]}, {a[2]})"
        if op.startswith("atomic_"):
            fn = {"atomic_add": "atomicAdd", "atomic_max": "atomicMax", "atomic_min": "atomicMin"}[op]
            return f"{fn}({self.element(args[0], a[1])}, {a[2]})"
        raise NotImplementedError(op)

    def element(self, view: ir.View, index: str) -> str:
        """The GLSL of `view[index]`: in a pieced buffer, the element's piece and place in it."""
        name = view_name(view, self.declared)
        if view.buffer not in self.pieces:
            return f"{name}[{index}]"
        size = _log2(view.dtype.nbytes)
        at = f"(uint({index}) + (pc.{start_field(view.buffer)} >> {size}u))"
        shift = f"(pc.{piece_field(view.buffer)} - {size}u)"
        return f"{name}_pieces[nonuniformEXT({at} >> {shift})].{name}_p[{at} & ((1u << {shift}) - 1u)]"

    @staticmethod
    def widen(text: str, storage: DType) -> str:
        if storage.name == "bf16":
            return f"uintBitsToFloat(uint({text}) << 16)"
        compute = storage.compute
        return text if compute == storage else f"{compute.glsl}({text})"

    @staticmethod
    def narrow(text: str, storage: DType) -> str:
        if storage.name == "bf16":
            return f"{storage.glsl}(floatBitsToUint({text}) >> 16)"
        return text if storage.compute == storage else f"{storage.glsl}({text})"

    # -- statements
    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def mark(self, depth: int, loc) -> None:
        if loc != self.last_loc and loc[1] > 0:
            src = linecache.getline(loc[0], loc[1]).strip().rstrip("\\")  # a trailing \ would continue the comment
            self.line(depth, f"// {relpath(loc[0])}:{loc[1]}: {src}")
            self.last_loc = loc
        self.locs.append((len(self.lines) + 1, loc[0], loc[1]))

    def block(self, stmts: list, depth: int) -> None:
        for s in stmts:
            self.stmt(s, depth)

    def array(self, a) -> str:
        if isinstance(a, ir.Shared):
            return f"sh{a.id}"
        if a.buffer in self.pieces:
            raise ZdslError(f"{self.k.label or self.k.name}: a cooperative-matrix tile of buffer {a.buffer}, which is "
                            "bound in pieces (larger than the device binds at once); no device with matrix units "
                            "binds so little")
        return view_name(a, self.declared)

    @staticmethod
    def layout(column_major: bool) -> str:
        return f"gl_CooperativeMatrixLayout{'ColumnMajor' if column_major else 'RowMajor'}"

    def stmt(self, s, depth: int) -> None:
        self.mark(depth, s.loc)
        if isinstance(s, ir.Let) and s.op == "mat_load":  # a statement in GLSL, not an expression
            src, offset, stride = s.args
            self.line(depth, f"{s.temp.dtype.glsl} t{s.temp.id};")
            self.line(depth, f"coopMatLoad(t{s.temp.id}, {self.array(src)}, {self.op(offset)}, {self.op(stride)}, "
                             f"{self.layout(s.attrs['column_major'])});")
        elif isinstance(s, ir.MatrixStore):
            self.line(depth, f"coopMatStore({self.op(s.matrix)}, {self.array(s.array)}, {self.op(s.offset)}, "
                             f"{self.op(s.stride)}, {self.layout(s.column_major)});")
        elif isinstance(s, ir.Let):
            self.line(depth, f"{s.temp.dtype.glsl} t{s.temp.id} = {self.expr(s.op, s.args, s.temp.dtype, s.attrs)};")
        elif isinstance(s, ir.DeclareVar):
            self.line(depth, f"{s.var.dtype.glsl} {self.op(s.var)} = {self.op(s.init)};")
        elif isinstance(s, ir.Assign):
            self.line(depth, f"{self.op(s.var)} = {self.op(s.value)};")
        elif isinstance(s, ir.Store):
            if isinstance(s.view, ir.Shared):
                self.line(depth, f"sh{s.view.id}[{self.op(s.index)}] = {self.op(s.value)};")
            elif isinstance(s.view, ir.Local):
                self.line(depth, f"lo{s.view.id}[{self.op(s.index)}] = {self.op(s.value)};")
            else:
                target = self.element(s.view, self.op(s.index))
                value = self.op(s.value)
                if s.value.dtype.scalar != s.view.dtype.compute.scalar:
                    value = f"{s.view.dtype.compute.glsl}({value})"
                self.line(depth, f"{target} = {self.narrow(value, s.view.dtype)};")
        elif isinstance(s, ir.If):
            self.line(depth, f"if ({self.op(s.cond)}) {{")
            self.block(s.then, depth + 1)
            if s.orelse:
                self.line(depth, "} else {")
                self.block(s.orelse, depth + 1)
            self.line(depth, "}")
        elif isinstance(s, ir.For):
            v = self.op(s.var)
            attr = "[[unroll]] " if s.unroll else ""
            self.line(depth, f"{attr}for ({s.var.dtype.glsl} {v} = {self.op(s.start)}; {v} < {self.op(s.stop)}; "
                             f"{v} += {self.op(s.step)}) {{")
            self.block(s.body, depth + 1)
            self.line(depth, "}")
        elif isinstance(s, ir.Barrier):
            self.line(depth, "barrier();")
        elif isinstance(s, ir.MemoryBarrier):
            self.line(depth, "memoryBarrierBuffer();")
        else:
            raise NotImplementedError(type(s))

    # -- whole shader
    def header(self) -> list[str]:
        k = self.k
        out = ["#version 460"]
        storage = {v.dtype.name for v in k.views} | {s.dtype.name for s in k.shared}
        if storage & {"f16", "u8", "i8", "u16", "i16", "bf16"} or self.uses_f16 or "int8_arith" in k.features:
            out.append("#extension GL_EXT_shader_explicit_arithmetic_types : require")
        if storage & {"u8", "i8"}:
            out.append("#extension GL_EXT_shader_8bit_storage : require")
        if storage & {"f16", "u16", "i16", "bf16"}:
            out.append("#extension GL_EXT_shader_16bit_storage : require")
        if "subgroup" in k.features:
            for ext in ("basic", "arithmetic", "ballot", "shuffle", "clustered"):
                out.append(f"#extension GL_KHR_shader_subgroup_{ext} : require")
        if "int8_dot" in k.features:
            out.append("#extension GL_EXT_spirv_intrinsics : require")
        if "shared_alias" in k.features:
            out.append("#extension GL_EXT_shared_memory_block : require")
        if "coopmat" in k.features:
            out.append("#extension GL_KHR_cooperative_matrix : require")
            out.append("#extension GL_KHR_memory_scope_semantics : require")
        if self.pieces:
            out.append("#extension GL_EXT_nonuniform_qualifier : require")
        out.append("#extension GL_EXT_control_flow_attributes : enable")
        file, line = k.source
        out.append(f"// {k.label or k.name} — generated by zdsl from {relpath(file)}:{line}")
        out.append("layout(local_size_x = {}, local_size_y = {}, local_size_z = {}) in;".format(*k.workgroup))
        for s in k.specs:
            default = 0 if s.dtype.kind != "b" else False
            out.append(f"layout(constant_id = {s.id}) const {s.dtype.glsl} sc_{s.name} = {literal(default, s.dtype)};")
        if self.uses_grid:
            for axis, cid in zip("xyz", GRID_SPEC_IDS):
                out.append(f"layout(constant_id = {cid}) const uint zdsl_grid_{axis} = {0 if axis == 'x' else 1}u;")
        if k.scalars or self.pieces:
            fields = " ".join([f"{s.dtype.glsl} {safe(s.name)};" for s in k.scalars]
                              + [f"uint {field(name)};" for name, _, _ in k.buffers if name in self.pieces
                                 for field in (start_field, piece_field)])
            out.append(f"layout(push_constant) uniform Push {{ {fields} }} pc;")
        access = {name: acc for name, _, acc in k.buffers}
        for name, dtype, acc in k.buffers:
            # a buffer the variant never touches is declared as words (its own type may need an
            # extension the variant does not enable)
            views = [v for v in k.views if v.buffer == name] or [ir.View(name, len(out), u32)]
            binding = [i for i, b in enumerate(k.buffers) if b[0] == name][0]
            qual = {"r": "readonly ", "w": "writeonly ", "rw": "", "-": "readonly "}[access[name]]
            restrict = "restrict " if len(views) == 1 else ""
            if name in k.coherent:
                qual = "coherent " + qual
            for v in views:
                vn = view_name(v, self.declared)
                decl = f"layout(set = 0, binding = {binding}, std430) {restrict}{qual}buffer B_{vn} "
                if name in self.pieces:
                    out.append(decl + f"{{ {v.dtype.glsl} {vn}_p[]; }} {vn}_pieces[{self.pieces[name]}];")
                else:
                    out.append(decl + f"{{ {v.dtype.glsl} {vn}[]; }};")
        out += self.shared_arrays()
        for t in k.tables:
            values = ", ".join(literal(v, t.dtype) for v in t.values)
            out.append(f"const {t.dtype.glsl} tb{t.id}[{len(t.values)}] = {t.dtype.glsl}[{len(t.values)}]({values});")
        if "int8_dot" in k.features:
            out.append(DOT4_DECL)
        return out

    def shared_arrays(self) -> list[str]:
        """The shared arrays' declarations. Where one takes others' storage (zdsl.shared's
        `over`), every array is a member of a shared block, and such blocks all start at the same
        address (GL_EXT_shared_memory_block): the others in one block, the arrays taken first,
        and each taker in a block of its own."""
        def decl(s):
            size = s.size if isinstance(s.size, int) else self.op(s.size)
            return f"{s.dtype.compute.glsl} sh{s.id}[{size}];"
        shared = self.k.shared
        if not any(s.over for s in shared):
            return [f"shared {decl(s)}" for s in shared]
        rest = [s for s in shared if not s.over]
        out = ["shared ZdslShared { " + " ".join(decl(s) for s in rest) + " };"]
        out += [f"shared ZdslShared{s.id} {{ {decl(s)} }};" for s in shared if s.over]
        return out

    def emit(self) -> tuple[str, list]:
        for loc in self.k.locals:
            self.line(1, f"{loc.dtype.glsl} lo{loc.id}[{loc.size}];")
        self.block(self.k.body, 1)
        body = self.lines
        head = self.header()
        helpers = []
        float_types = list(HELPER_TYPES) + (["float16_t", "f16vec2", "f16vec4"] if self.uses_f16 else [])
        for name in sorted(self.helpers):
            for t in float_types:
                helpers.append(UNARY[name].helper.replace("T", t))
        prologue = _GRID_PROLOGUE.splitlines() if self.uses_grid else []
        text_lines = head + helpers + ["void main() {"] + prologue + body + ["}", ""]
        offset = len(head) + len(helpers) + 1 + len(prologue)
        locs = [(n + offset, f, l) for n, f, l in self.locs]
        return "\n".join(text_lines), locs


def emit(k: ir.Kernel, pieces: dict[str, int] | None = None) -> tuple[str, list]:
    """GLSL text and a map of (GLSL line, Python file, Python line) for error reports; `pieces`:
    the buffers bound in pieces (Emitter)."""
    return Emitter(k, pieces).emit()


__all__ = ["emit", "literal", "f32"]
