"""`zdsl profile`: a decode step with a GPU timestamp after every dispatch, grouped by phase
(attention, delta-net, MoE, norms, output head, sampling) and by kernel, with a Chrome trace.

The timed step is replayed for a while first (GPUs raise their clocks only under sustained load,
and loading the weights leaves the GPU idle), then timed several times at the same position;
each dispatch reports its median. A timestamp after every dispatch serializes the step, so the
total is an upper bound on the step's real time (`zdsl bench` measures that)."""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from zdsl.models.qwen35.cli.run import kv_type_option

PHASES = [  # (phase, pattern on the dispatch label "<role>:<kernel variant>")
    ("embedding", r"^embed"),
    ("norms", r":norm_q8_1\b"),
    ("attention", r"\.attn_(q|k|v|output|prep|decode|combine)\b"),
    ("delta-net", r"\.(attn_qkv|attn_gate|ssm_\w+)\b"),
    ("moe router", r"\.(ffn_gate_inp|moe_route)\b"),
    ("moe experts", r"_exps"),
    ("moe shared", r"_shexp"),
    ("ffn", r"\.ffn_(gate|up|down)\b"),
    ("output head", r"^(output|token_embd)[^:]*:dmmv"),
    ("sampling", r"^sample"),
]


CODE_SIZE = ("Binary Size", "Code size")  # the driver statistic giving a shader's machine-code bytes: NVIDIA, RADV


def code_sizes(device, labels) -> dict[str, int]:
    """Machine-code bytes of each variant that `labels` ("<role>:<variant>") name, where the
    driver reports them. Between two uses of a kernel the weights streaming through L2 evict its
    code, so every dispatch fetches its code from memory again: about 0.3 µs per KB on the H100
    (docs/DESIGN.md). Code per step is a cost the timings alone do not show."""
    from zdsl.lang.kernel import REGISTRY

    if "pipeline_stats" not in device.info.features:
        return {}
    wanted, sizes = {variant_of(label) for label in labels}, {}
    for kernel in REGISTRY.values():
        for v in kernel.specialized():
            if v.label in wanted:
                size = code_size(device, v)
                if size is not None:
                    sizes[v.label] = size
    return sizes


def code_size(device, variant) -> int | None:
    """Machine-code bytes of one variant's pipeline on `device`, if its driver reports them."""
    stats = variant.pipeline(device, statistics=True).statistics or {}
    return next((int(stats[name]) for name in CODE_SIZE if name in stats), None)


def phase_of(label: str) -> str:
    for name, pattern in PHASES:
        if re.search(pattern, label):
            return name
    return "other"


def variant_of(label: str) -> str:
    """The variant's label in a dispatch label "<role>:<variant>" (the whole label if it has no role)."""
    return label.split(":", 1)[-1]


def kernel_of(label: str) -> str:
    return variant_of(label).split("[", 1)[0]


def summarize(timings: list[tuple[str, float]], code: dict[str, int] | None = None) -> dict:
    """Phases and kernels with their ms and dispatch counts; with `code` (code_sizes), each
    kernel's machine code run per step (its code bytes summed over its dispatches) and the step's."""
    by_phase, by_kernel = defaultdict(float), defaultdict(lambda: {"ms": 0.0, "count": 0})
    for label, ms in timings:
        by_phase[phase_of(label)] += ms
        k = by_kernel[kernel_of(label)]
        k["ms"] += ms
        k["count"] += 1
        size = (code or {}).get(variant_of(label))
        if size is not None:
            k["code_bytes"] = k.get("code_bytes", 0) + size
    total = sum(ms for _, ms in timings)
    s = {"total_ms": total, "dispatches": len(timings),
         "phases": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
         "kernels": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1]["ms"])),
         "top": sorted(timings, key=lambda t: -t[1])}
    if any("code_bytes" in k for k in by_kernel.values()):
        s["code_bytes"] = sum(k.get("code_bytes", 0) for k in by_kernel.values())
    return s


def chrome_trace(timings: list[tuple[str, float]]) -> dict:
    events, t = [], 0.0
    for label, ms in timings:
        events.append({"name": label, "cat": phase_of(label), "ph": "X", "ts": round(t * 1e3, 3),
                       "dur": round(ms * 1e3, 3), "pid": 0, "tid": 0})
        t += ms
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@click.command("profile")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--device", default=None, help="Index, name substring or alias (zdsl devices).")
@click.option("--ctx", "n_ctx", type=int, default=512, show_default=True, help="Context to allocate.")
@click.option("--position", type=int, default=16, show_default=True,
              help="Tokens before the timed step (a random prompt, fed by batched prefill).")
@click.option("--top", type=int, default=15, show_default=True, help="Rows of the slowest-dispatch table.")
@click.option("--steps", type=int, default=5, show_default=True, help="Timed steps (each dispatch: the median).")
@click.option("--warm-ms", type=int, default=3000, show_default=True,
              help="Replay the step this long before timing (lets the GPU raise its clocks; on the H100 "
                   "half a second left a step of several tokens timed at up to 3x).")
@click.option("--prompt", "prompt_len", type=int, default=0,
              help="Time a batched prefill chunk of this many prompt tokens instead of a decode step.")
@click.option("--step-tokens", type=int, default=0,
              help="Time a step of this many tokens of one sequence (what verifying drafted tokens costs) instead "
                   "of a decode step.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profile"),
              show_default=True, help="Where profile.json and trace.json go.")
@kv_type_option
def profile(model, device, n_ctx, position, top, steps, warm_ms, prompt_len, step_tokens, out_dir, kv):
    """Time a decode step (or a prompt chunk) dispatch by dispatch (GPU timestamps)."""
    from zdsl.console import Table, make_console
    from zdsl.errors import ZdslError
    from zdsl.models.qwen35.model.generate import load
    from zdsl.models.qwen35.model.sampler import SamplerConfig

    extra = prompt_len or step_tokens
    if not 0 <= position < n_ctx - 1 - extra:
        raise ZdslError(f"--position must be in [0, {n_ctx - 1 - extra}) for a context of {n_ctx}"
                        + (f" and {extra} tokens timed" if extra else ""))
    if steps < 1 or warm_ms < 0 or step_tokens < 0:
        raise ZdslError("--steps must be at least 1, --warm-ms and --step-tokens at least 0")
    if prompt_len and step_tokens:
        raise ZdslError("give --prompt or --step-tokens, not both")
    gen = load(model, device, n_ctx=n_ctx, sampler=SamplerConfig(temperature=0), kv=kv,
               step_tokens=max(step_tokens, 2))  # 2: a step of one token on this path too
    if "timestamps" not in gen.device.info.features:
        raise ZdslError(f"{gen.device.info.name} has no timestamp queries; zdsl profile needs them")
    g = gen.graph
    rng = np.random.default_rng(0)
    if position:  # a random prompt of that many tokens, fed as `zdsl run` feeds one
        g.prefill(rng.integers(0, g.hp.vocab, position).tolist())
    at = g.position
    ids = rng.integers(0, g.hp.vocab, prompt_len or step_tokens).tolist()
    timed = (lambda: g.prompt.profile(ids)) if prompt_len else (lambda: g.token_rows.profile(ids)) if step_tokens \
        else g.profile
    g.seek(at)
    timed()  # records the timed step: seconds on a big model, which must not count as warming
    end = time.perf_counter() + warm_ms / 1e3
    while time.perf_counter() < end:  # the same step over and over, until the clocks are up
        g.seek(at)
        timed()
    runs = []
    for _ in range(steps):
        g.seek(at)
        runs.append(timed())
    timings = [(label, statistics.median(run[i][1] for run in runs)) for i, (label, _) in enumerate(runs[0])]
    s = summarize(timings, code_sizes(gen.device, [label for label, _ in timings]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trace.json").write_text(json.dumps(chrome_trace(timings)))
    (out_dir / "profile.json").write_text(json.dumps({"model": str(gen.model.path), "device": gen.device.info.name,
                                                      "position": at, "steps": steps, "kv_type": ",".join(kv), **s},
                                                     indent=1))
    console = make_console()
    code = f", {s['code_bytes'] / 1024:,.0f} KB of machine code run" if "code_bytes" in s else ""
    what = (f"a prefill chunk of {prompt_len} tokens" if prompt_len else
            f"a step of {step_tokens} tokens of one sequence" if step_tokens else "a decode step")
    console.print(f"{gen.model.path.name} on {gen.device.info.name}: {what} at position {at}, "
                  f"{s['dispatches']} dispatches{code}, {s['total_ms']:.3f} ms GPU (median of {steps} timed steps, "
                  "each dispatch timed alone: an upper bound)")
    for title, rows in (("phase", [(k, {"ms": v}) for k, v in s["phases"].items()]), ("kernel", s["kernels"].items())):
        t = Table(title=f"by {title}")
        t.add_column(title)
        t.add_column("ms", justify="right")
        t.add_column("%", justify="right")
        t.add_column("dispatches", justify="right")
        if title == "kernel" and code:
            t.add_column("code KB per step", justify="right")
        for name, k in rows:
            cells = [name, f"{k['ms']:.3f}", f"{100 * k['ms'] / s['total_ms']:.1f}", str(k.get("count", ""))]
            if title == "kernel" and code:
                cells.append(f"{k['code_bytes'] / 1024:,.0f}" if "code_bytes" in k else "")
            t.add_row(*cells)
        console.print(t)
    t = Table(title=f"slowest {top} dispatches")
    t.add_column("dispatch")
    t.add_column("ms", justify="right")
    for label, ms in s["top"][:top]:
        t.add_row(label, f"{ms:.4f}")
    console.print(t)
    console.print(f"wrote {out_dir / 'profile.json'} and {out_dir / 'trace.json'} (chrome://tracing)")
    gen.close()
