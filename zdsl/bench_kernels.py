"""`zdsl bench-kernels`: each kernel launch of a model's decode step, timed on its own, against
the device's memory bandwidth.

The launches are the ones the graph records (the variants the tuning database picks for this
device, at the model's sizes), and each kernel's example gives inputs of those sizes. Decode is
bandwidth-bound: a kernel is as fast as it can be when it moves its bytes at the rate a plain
copy does, so each is reported against the copy rate measured in the same run. Each is timed two
ways, because at a few MB a dispatch's launch and drain cost as much as its bytes:
- alone: GPU timestamps around each dispatch, what a dispatch costs when the next one depends
  on it, as in a decode step's chain. Beside it, a copy of the same bytes timed the same way:
  the roofline at that size.
- back to back: many independent dispatches with nothing between them, timed by the wall clock
  over whole submissions: what the kernel sustains when launches overlap.
Consecutive dispatches read different weight copies (or, for experts, different experts) so that
small weights are not served from the cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click
import numpy as np

from zdsl import device_defaults
from zdsl.errors import ZdslError


@dataclass
class Result:
    kernel: str
    use: str                 # the tuning key, short
    role: str                # the first launch's label (a tensor or step)
    count: int               # launches per token
    variant: str
    us: float                # alone: one dependent dispatch
    bytes: int
    gbps: float
    pct_copy: float
    copy_alone_pct: float    # a copy of `bytes` timed alone, % of the copy bandwidth: the roofline at this size
    back_to_back_us: float   # per dispatch, back to back
    back_to_back_gbps: float
    back_to_back_pct_copy: float


def bench_use(measure, use, copy_gbps: float) -> Result:
    """Time the use's recorded variant (and what runs with it) on an example of its sizes."""
    from zdsl.autotune import timing, tuner

    example = use.kernel.make_example(use.launch, np.random.default_rng(0), False)
    launches = tuner.variants(use, example, use.launch.variant.params)
    nbytes = sum(tuner.launch_of(v, example)[1] for v in launches)
    bufs = measure.upload(example, measure.copies(nbytes))
    try:
        us, _ = measure.time(example, bufs, launches)
    finally:
        tuner.free(bufs)
    b2b = timing.back_to_back(measure, example, launches, measure.warm_s)
    copy_alone = timing.copy_bandwidth(measure, max(nbytes // 2, 16))
    gbps, b2b_gbps = nbytes / us / 1e3, nbytes / b2b / 1e3
    tuned = {k: v for k, v in use.launch.variant.params.items() if k not in use.fixed}
    return Result(use.kernel.name, use.label, use.role, use.count, " ".join(f"{k}={v}" for k, v in tuned.items()),
                  us, nbytes, gbps, 100 * gbps / copy_gbps, 100 * copy_alone / copy_gbps, b2b, b2b_gbps,
                  100 * b2b_gbps / copy_gbps)


def print_table(device_name: str, copy_gbps: float, copy_bytes: int, results: list[Result]) -> None:
    from zdsl.console import Table, make_console
    from zdsl.runtime.memory import fmt_bytes

    table = Table(title=f"{device_name}: copy {copy_gbps:,.0f} GB/s ({fmt_bytes(copy_bytes)} read + written); "
                        "alone = one dispatch between timestamps; same-size copy = a copy of those bytes timed "
                        "alone; b2b = back to back, independent dispatches overlapping")
    for col in ("kernel", "use", "×/token", "variant", "bytes", "alone µs", "GB/s", "% copy", "same-size copy",
                "b2b µs", "b2b GB/s", "b2b % copy"):
        table.add_column(col, justify="left" if col in ("kernel", "use", "variant") else "right")

    def rate(g):
        return f"{g:,.{0 if g >= 10 else 2}f}"
    for r in results:
        table.add_row(r.kernel, r.use, str(r.count), r.variant, fmt_bytes(r.bytes), f"{r.us:,.1f}", rate(r.gbps),
                      f"{r.pct_copy:.0f}%", f"{r.copy_alone_pct:.0f}%", f"{r.back_to_back_us:,.1f}",
                      rate(r.back_to_back_gbps), f"{r.back_to_back_pct_copy:.0f}%")
    make_console().print(table)


@click.command("bench-kernels")
@click.argument("model", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--preset", default=None, help="Synthetic preset whose step to time when no MODEL is given "
                                             "[default: 35b-a3b; tiny on a CPU device].")
@click.option("--quant", default="q4_k_m", show_default=True, help="The preset's type mix (zdsl model synth --quant).")
@click.option("--device", "device_name", default=None, help="Device index or name (default: $ZDSL_DEVICE or the best).")
@click.option("--kernels", "names", default=None, help="Comma-separated kernel names (default: every one the step tunes).")
@click.option("--ctx", "n_ctx", default=4096, show_default=True, help="Context the attention kernels see.")
@click.option("--warmup", default=5, show_default=True, help="Untimed dispatches first.")
@click.option("--warm-ms", default=300, show_default=True,
              help="Replay each launch this long before timing it (lets the GPU raise its clocks).")
@click.option("--repeats", default=30, show_default=True, help="Timed dispatches (the median is reported).")
@click.option("--copy-mb", type=int, default=None,
              help=f"Copy-kernel buffer size in MiB, each of two [default: {device_defaults.COPY_MB}, less where the device "
                   f"binds less or is a CPU].")
@click.option("--cache-mb", default=256, show_default=True,
              help="Rotate weight copies until this many MB lie between reuses (defeats the caches).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_kernels(model, preset, quant, device_name, names, n_ctx, warmup, warm_ms, repeats, copy_mb, cache_mb, as_json):
    """Time each kernel launch of a model's decode step: GPU time and GB/s against measured copy bandwidth."""
    from zdsl.autotune import timing, tuner
    from zdsl.models.qwen35.cli.tune import select, step_uses
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.models.qwen35.file.synth import PresetModel
    from zdsl.runtime import open_device

    if min(warmup, warm_ms, cache_mb) < 0 or min(repeats, n_ctx) < 1:
        raise ZdslError("--warmup, --warm-ms and --cache-mb must be ≥ 0, --repeats and --ctx ≥ 1")

    def say(line: str) -> None:
        click.echo(line, err=True)

    with open_device(device_name) as dev:
        if model is None and preset is None and dev.info.device_type == "cpu":
            say(f"preset tiny: {dev.info.name} is a CPU, and the 35b-a3b step is sized for a GPU (--preset times others)")
            preset = "tiny"
        source = open_model(model) if model else PresetModel(preset or "35b-a3b", quant)
        uses = select(step_uses(source, dev.info, n_ctx, (1,)), names)
        copy_bytes = device_defaults.copy_mb(dev.info, copy_mb, say) << 20
        measure = tuner.Measure(dev, warmup=warmup, repeats=repeats, warm_s=warm_ms / 1e3, cache_bytes=cache_mb << 20)
        copy_gbps = timing.copy_bandwidth(measure, copy_bytes)
        results = [bench_use(measure, u, copy_gbps) for u in uses]
        name = dev.info.name
    if as_json:
        click.echo(json.dumps({"device": name, "copy_gbps": copy_gbps, "copy_bytes": 2 * copy_bytes,
                               "results": [asdict(r) for r in results]}, indent=1, ensure_ascii=False))
    else:
        print_table(name, copy_gbps, 2 * copy_bytes, results)
