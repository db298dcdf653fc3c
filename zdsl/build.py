"""`zdsl build`: trace, emit and compile every registered kernel variant, in parallel.

SPIR-V comes from the toolchain's content-hash cache when the generated GLSL is unchanged, so
a second build is instant. With `--target FAMILY` each variant is also compiled to real RDNA
machine code by RADV's null device (in a child process) and its register, spill and occupancy
statistics join the table.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click

from zdsl.errors import ZdslError
from zdsl.lang.kernel import Variant, all_kernels

# RADV statistic names → short column headers
STAT_COLUMNS = {"VGPRs": "VGPR", "SGPRs": "SGPR", "Spilled VGPRs": "spill V", "Spilled SGPRs": "spill S",
                "LDS size": "LDS", "Scratch size": "scratch", "Subgroups per SIMD": "waves/SIMD",
                "Instructions": "instr", "Code size": "code B", "VALU": "VALU", "SALU": "SALU", "VMEM": "VMEM",
                "SMEM": "SMEM"}


@dataclass
class BuildResult:
    variant: Variant
    spirv_bytes: int = 0
    ms: float = 0.0
    cached: bool = False
    error: str | None = None
    stats: dict = field(default_factory=dict)


def variants_for(names: list[str] | None, subgroup_sizes: tuple[int, ...] | None = None) -> list[Variant]:
    kernels = all_kernels()
    if names:
        missing = [n for n in names if n not in kernels]
        if missing:
            raise ZdslError(f"no kernel named {', '.join(missing)} (known: {', '.join(kernels)})")
        kernels = {n: kernels[n] for n in names}
    return [k.specialize(**params) for k in kernels.values() for params in k.space(subgroup_sizes)]


def compile_variant(v: Variant) -> BuildResult:
    t0 = time.perf_counter()
    try:
        c = v.build()
        return BuildResult(v, len(c.spirv), c.ms if not c.cached else (time.perf_counter() - t0) * 1e3, c.cached)
    except ZdslError as e:
        return BuildResult(v, error=str(e))


def build(variants: list[Variant], jobs: int, progress: bool = True) -> list[BuildResult]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: list[BuildResult] = []
    with Progress(TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("build", total=len(variants))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for r in pool.map(compile_variant, variants):
                results.append(r)
                bar.advance(task)
    return results


def add_target_statistics(results: list[BuildResult], family: str, isa_dir: Path | None) -> None:
    from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

    ok = [r for r in results if r.error is None]
    sg_ok = [r for r in ok if r.variant.ir.subgroup_size in (None, 32, 64)]
    specs = [ShaderSpec(r.variant.label, r.variant.spirv, r.variant.bindings, r.variant.push_size,
                        r.variant.spec_constants(), r.variant.ir.subgroup_size) for r in sg_ok]
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
            (out / f"{name}.comp").write_text(r.variant.glsl)
        elif kind == "spirv":
            (out / f"{name}.spv").write_bytes(r.variant.spirv)
        else:
            (out / f"{name}.spvasm").write_text(disassemble(r.variant.spirv))


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
        table.add_row(r.variant.kernel.name, params, f"{r.spirv_bytes:,}", f"{r.ms:.0f}",
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
@click.option("-j", "--jobs", default=4, show_default=True, help="Parallel compiles.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def build_command(names, emit_kind, out_dir, target, isa, jobs, no_progress):
    """Build every registered kernel variant (SPIR-V cached by content)."""
    variants = variants_for(names.split(",") if names else None)
    results = build(variants, jobs, progress=not no_progress)
    if target:
        add_target_statistics(results, target, out_dir / "isa" if isa else None)
    if emit_kind:
        emit(results, emit_kind, out_dir / emit_kind)
    print_table(results, target)
    failed = [r for r in results if r.error]
    if failed:
        raise ZdslError(f"{len(failed)} of {len(results)} variants failed to build")
