"""`zdsl build`: trace, emit and compile every kernel variant of the library, on every core.

Each variant builds in a worker process (tracing is Python, so threads would take turns on the
GIL), and its SPIR-V is cached under a digest of the sources it depends on: the language and its
kernel's module with the library modules that one imports. A second build is instant, and one
edited kernel rebuilds its own variants, not the library's. With `--target FAMILY` each variant
is also compiled to real RDNA machine code by RADV's null device (in a child process) and its
register, spill and occupancy statistics join the table.
"""

from __future__ import annotations

import ast
import functools
import importlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click

from zdsl.cache import cache_dir, content_key, read_entry, write_entry
from zdsl.errors import ZdslError
from zdsl.kernels import all_kernels
from zdsl.lang.kernel import Variant

# RADV statistic names → short column headers
STAT_COLUMNS = {"VGPRs": "VGPR", "SGPRs": "SGPR", "Spilled VGPRs": "spill V", "Spilled SGPRs": "spill S",
                "LDS size": "LDS", "Scratch size": "scratch", "Subgroups per SIMD": "waves/SIMD",
                "Instructions": "instr", "Code size": "code B", "VALU": "VALU", "SALU": "SALU", "VMEM": "VMEM",
                "SMEM": "SMEM"}


@functools.cache
def source_digest(module: str) -> str:
    """A hash of every source file a kernel of `module` can depend on: the language's files, the
    module's own and those of the library modules it imports, followed through. Found through the
    import system, so a source checkout and an installed package (where kernels/ lives inside
    zdsl/) hash alike."""
    import zdsl.lang
    lang = os.path.dirname(os.path.abspath(zdsl.lang.__file__))
    parts = []
    for name in sorted(os.listdir(lang)):
        if name.endswith(".py"):
            parts += [f"zdsl/lang/{name}", Path(lang, name).read_bytes()]
    for name in sorted(_library_closure(module)):
        parts += [name, Path(importlib.import_module(name).__file__).read_bytes()]
    return content_key(*parts)


def _library_closure(module: str) -> set[str]:
    """`module` and the zdsl.kernels modules it imports, directly or through one another."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "zdsl.kernels":    # from zdsl.kernels import dmmv
                todo += [f"zdsl.kernels.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zdsl.kernels."):
                todo.append(node.module)
    return seen


@dataclass
class BuildResult:
    """What building one variant gave: its SPIR-V (and, when asked, its GLSL and the interface a
    pipeline needs), or the error."""

    variant: Variant
    spirv: bytes = b""
    ms: float = 0.0
    cached: bool = False
    error: str | None = None
    glsl: str | None = None
    interface: dict | None = None
    stats: dict = field(default_factory=dict)


def variants_for(names: list[str] | None, subgroup_sizes: tuple[int, ...] | None = None) -> list[Variant]:
    kernels = all_kernels()
    if names:
        missing = [n for n in names if n not in kernels]
        if missing:
            raise ZdslError(f"no kernel named {', '.join(missing)} (known: {', '.join(kernels)})")
        kernels = {n: kernels[n] for n in names}
    return [k.specialize(**params) for k in kernels.values() for params in k.space(subgroup_sizes)]


def pairwise(variants: list[Variant]) -> list[Variant]:
    """Variants that together take every pair of values of two parameters of each kernel that
    some registered variant takes (combinatorial testing: a fault that needs two parameters'
    values shows in one of them): greedily, the variant that takes the most pairs not taken yet."""
    def pairs(v):
        items = sorted((k, repr(x)) for k, x in v.params.items())
        return frozenset((a, b) for i, a in enumerate(items) for b in items[i + 1:]) or frozenset({()})

    chosen = []
    for name in dict.fromkeys(v.kernel.name for v in variants):
        left = {v: pairs(v) for v in variants if v.kernel.name == name}
        todo = set().union(*left.values())
        while todo:
            best = max(left, key=lambda v: len(left[v] & todo))
            chosen.append(best)
            todo -= left.pop(best)
    return chosen


def compile_variant(v: Variant, full: bool = False, check: bool = False) -> BuildResult:
    """Build one variant, served without tracing when this variant of these sources was built
    before (unless `full` asks for its GLSL and interface, which need the trace). `check`: only
    trace, compile and validate it, not optimize it (what runs needs is optimized: a quick check
    that every variant builds, cached apart)."""
    from zdsl.toolchain import spirv_problem, versions
    t0 = time.perf_counter()
    if check:
        try:
            compiled = v.compile(optimize=False)
        except ZdslError as e:
            return BuildResult(v, error=str(e))
        return BuildResult(v, compiled.spirv, (time.perf_counter() - t0) * 1e3, compiled.cached)
    key = content_key(source_digest(v.kernel.fn.__module__), v.kernel.name, repr(sorted(v.consts.items())),
                      *sorted(versions().values()))
    path = cache_dir("variants") / f"{key}.spirv"
    cached = read_entry(path, spirv_problem)
    try:
        if cached is not None and not full:
            return BuildResult(v, cached, (time.perf_counter() - t0) * 1e3, True)
        spirv = v.spirv if cached is None else cached
        if cached is None:
            write_entry(path, spirv)
        result = BuildResult(v, spirv, (time.perf_counter() - t0) * 1e3, cached is not None)
    except ZdslError as e:
        return BuildResult(v, error=str(e))
    if full:
        result.glsl = v.glsl
        result.interface = dict(bindings=v.bindings, push_size=v.push_size, spec=v.spec_constants(),
                                subgroup_size=v.ir.subgroup_size)
    return result


def _compile_in_worker(name: str, params: dict, full: bool, check: bool) -> tuple:
    r = compile_variant(all_kernels()[name].specialize(**params), full, check)
    return r.spirv, r.ms, r.cached, r.error, r.glsl, r.interface


def build(variants: list[Variant], jobs: int | None = None, progress: bool = True, full: bool = False,
          check: bool = False) -> list[BuildResult]:
    """Build the variants on `jobs` worker processes (default: every core); one job builds here.
    `check`: compiled and validated, not optimized (compile_variant)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    jobs = jobs or os.cpu_count() or 1
    results: list[BuildResult] = []
    with Progress(TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("build", total=len(variants))
        if jobs == 1:
            for v in variants:
                results.append(compile_variant(v, full, check))
                bar.advance(task)
            return results
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["zdsl.build", "zdsl.kernels"])
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            done = pool.map(_compile_in_worker, [v.kernel.name for v in variants], [v.params for v in variants],
                            [full] * len(variants), [check] * len(variants), chunksize=max(1, min(8, len(variants) // (4 * jobs))))
            for v, fields in zip(variants, done):
                results.append(BuildResult(v, *fields))
                bar.advance(task)
    return results


def add_target_statistics(results: list[BuildResult], family: str, isa_dir: Path | None) -> None:
    from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

    ok = [r for r in results if r.error is None]
    sg_ok = [r for r in ok if r.interface["subgroup_size"] in (None, 32, 64)]
    specs = [ShaderSpec(r.variant.label, r.spirv, **r.interface) for r in sg_ok]
    stats = compile_statistics(family, specs, isa=isa_dir is not None)
    for r, s in zip(sg_ok, stats):
        r.stats = s
        if isa_dir is not None and s.get("isa"):
            isa_dir.mkdir(parents=True, exist_ok=True)
            (isa_dir / f"{_filename(r.variant)}.s").write_text(s["isa"])


def _filename(v: Variant) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_=," else "_" for ch in v.label)


def emit(results: list[BuildResult], kind: str, out: Path) -> None:
    from zdsl.toolchain import disassemble

    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        if r.error:
            continue
        name = _filename(r.variant)
        if kind == "glsl":
            (out / f"{name}.comp").write_text(r.glsl)
        elif kind == "spirv":
            (out / f"{name}.spv").write_bytes(r.spirv)
        else:
            (out / f"{name}.spvasm").write_text(disassemble(r.spirv))


def print_table(results: list[BuildResult], target: str | None) -> None:
    from zdsl.console import Table, make_console

    stat_keys = [k for k in STAT_COLUMNS if any(k in r.stats for r in results)]
    table = Table(title=f"zdsl build{' --target ' + target if target else ''}", show_lines=False)
    for col in ["kernel", "variant", "SPIR-V", "ms", "cached"] + [STAT_COLUMNS[k] for k in stat_keys] + ["status"]:
        table.add_column(col, justify="left" if col in ("kernel", "variant", "status") else "right")
    for r in results:
        params = ",".join(f"{k}={v}" for k, v in r.variant.params.items())
        stats = [str(r.stats.get(k, "")) for k in stat_keys]
        status = "[red]FAILED[/red]" if r.error else ("[yellow]skipped on target[/yellow]" if target and not r.stats else "ok")
        table.add_row(r.variant.kernel.name, params, f"{len(r.spirv):,}", f"{r.ms:.0f}",
                      "yes" if r.cached else "no", *stats, status)
    console = make_console()
    console.print(table)
    for r in results:
        if r.error:
            console.print(f"[red]{r.variant.label}[/red]: {r.error}", markup=True, highlight=False)
    failed = sum(1 for r in results if r.error)
    cached = sum(1 for r in results if r.cached)
    console.print(f"{len(results)} variants, {cached} from cache, {failed} failed")
    if target:
        console.print(spill_summary(results, target), highlight=False)


def spill_summary(results: list[BuildResult], target: str) -> str:
    """One line: how many variants the target compiled, and which of them spill registers."""
    compiled = [r for r in results if r.stats]
    spilling = [r.variant.label for r in compiled
                if r.stats.get("Spilled VGPRs", 0) or r.stats.get("Spilled SGPRs", 0)]
    text = (f"{target}: {len(compiled)} variants compiled to machine code "
            f"({len(results) - len(compiled)} skipped: a subgroup size the target lacks, or failed); ")
    if not spilling:
        return text + "none spills registers"
    return text + f"{len(spilling)} spill registers: {', '.join(spilling)}"


@click.command("build")
@click.option("--kernels", "names", default=None, help="Comma-separated kernel names (default: all).")
@click.option("--emit", "emit_kind", type=click.Choice(["glsl", "spirv", "asm"]), default=None,
              help="Write each variant's GLSL, SPIR-V or SPIR-V assembly.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("build/kernels"),
              show_default=True, help="Where --emit and --isa write.")
@click.option("--target", default=None, help="Also compile for a RADV family (gfx1201, gfx1151, navi31, ...) "
                                             "and report machine-code statistics.")
@click.option("--isa", is_flag=True, help="With --target: write the RDNA disassembly of each variant.")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None, help="Worker processes (default: one per core).")
@click.option("--pairwise", "pairwise_only", is_flag=True, help="Only variants that together take every pair of two parameters' "
                                               "values of each kernel (a fifth of them: build.pairwise).")
@click.option("--check", is_flag=True, help="Only check that each variant compiles to valid SPIR-V: no optimizing "
                                            "(about half the time), nothing for runs to use.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def build_command(names, emit_kind, out_dir, target, isa, jobs, pairwise_only, check, no_progress):
    """Build every registered kernel variant (SPIR-V cached by content)."""
    if check and (target or emit_kind):
        raise ZdslError("--check builds nothing to emit or compile for a target; leave out --emit and --target")
    variants = variants_for(names.split(",") if names else None)
    if pairwise_only:
        variants = pairwise(variants)
    results = build(variants, jobs, progress=not no_progress, full=bool(target or emit_kind), check=check)
    if target:
        add_target_statistics(results, target, out_dir / "isa" if isa else None)
    if emit_kind:
        emit(results, emit_kind, out_dir / emit_kind)
    print_table(results, target)
    failed = [r for r in results if r.error]
    if failed:
        raise ZdslError(f"{len(failed)} of {len(results)} variants failed to build")
