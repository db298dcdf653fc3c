"""`zdsl bench`: decode speed at several context depths against the bandwidth roofline.

A decoded token reads the weights it needs, every row of the KV cache in each attention layer,
and reads and writes the delta-net state, so it cannot be faster than copy bandwidth / those
bytes. The bandwidth is measured in the same run by the DSL copy kernel (autotune/timing.py)
(read + write bytes), so "% of ceiling" compares like with like. Depths are reached with
`DecodeGraph.seek`: the timed steps read that many cache rows, as real decoding would, without
first computing the tokens before them. Decode runs in the bursts `zdsl run` uses. The prompt is
timed the way `zdsl run` feeds one: batched prefill in chunks, then the last token's decode step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np

from zdsl import device_defaults
from zdsl.errors import ZdslError
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes, kv_types
from zdsl.models.qwen35.cli.run import kv_type_option

DEFAULT_CONTEXTS = "0,4096,16384,32768"  # llama-bench reports pp512 and tg128 at depth 0
# Untimed prompts at each depth for at least this long: an idle GPU's clocks rise over the first
# fraction of a second of load, and one warm-up prompt left the first timed ones up to 2x slow
# (H100: pp512 samples 3,801 7,616 8,024 8,123 8,119 tok/s)
WARM_S = 1.0
PROMPT_NOTE = ("prompt = batched prefill in chunks of up to 512 tokens (each expert's weights read once per chunk, "
               "the delta rule in blocks of 64 tokens), the first new token drawn in the last chunk from its last "
               "token's logits")


def parse_contexts(text: str) -> list[int]:
    try:
        contexts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        contexts = []
    if not contexts or contexts[0] < 0:
        raise ZdslError(f"--contexts '{text}': give comma-separated depths ≥ 0 in tokens, e.g. 512,4096,32768")
    return contexts


def memory_rows(specs_at, contexts: list[int], extra: int, available: int) -> list[dict]:
    """The decode graph's buffers for each context (depth + `extra` timed tokens), by kind."""
    from zdsl.models.qwen35.model.buffers import Footprint

    rows = []
    for c in contexts:
        need = Footprint(specs_at(c + extra))
        rows.append({"context": c, "n_ctx": c + extra, **need.by_kind, "total": need.total,
                     "fits": need.total <= available})
    return rows


def default_rows(rows: list[dict], trained: int, available: int, device_name: str, say) -> list[dict]:
    """The memory rows of the default depths that the model's trained context and the device's
    free memory hold (or the smallest, for the refusal that follows), saying why others went."""
    from zdsl.runtime.memory import fmt_bytes

    kept = [r for r in rows if r["n_ctx"] <= trained and r["fits"]] or rows[:1]
    why = ([f"the model is trained for {trained:,} tokens"] if any(r["n_ctx"] > trained for r in rows) else []) \
        + ([f"{device_name} has {fmt_bytes(available)} free"] if not all(r["fits"] for r in rows) else [])
    if why:
        say(f"contexts {','.join(str(r['context']) for r in kept)} ({'; '.join(why)}; default {DEFAULT_CONTEXTS})")
    return kept


def check_contexts(hp, contexts: list[int], extra: int) -> None:
    for c in contexts:
        if c + extra > hp.context_length:
            raise ZdslError(f"context {c} plus the timed tokens ({c + extra}) exceeds the model's trained context of "
                            f"{hp.context_length} tokens; drop it from --contexts or lower --tokens/--prompt")


def bytes_per_token(plan, depth: int, tokens: int, kv: KVTypes = KV_DEFAULT) -> dict:
    """Bytes one decoded token moves at `depth`: the `tokens` timed steps at positions depth ..
    depth+tokens-1 read depth+1 .. depth+tokens cache rows, (tokens+1)/2 more than `depth` on
    average, in the (K, V) formats `kv`."""
    kv = plan.kv_bytes(kv)
    # the delta rule's state is read and written; of the conv ring, all slots but one are read
    # and that one is written
    b = {"weights": plan.read_per_token, "kv_read": kv * (depth + (tokens + 1) / 2), "kv_written": kv,
         "state": 2 * plan.ssm_state_bytes + plan.conv_state_bytes}
    b["total"] = sum(b.values())
    return b


def summary(samples: list[float]) -> dict:
    return {"samples": samples, "median": statistics.median(samples),
            "stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "min": min(samples), "max": max(samples)}


def time_prompt(graph, depth: int, ids: list[int]) -> float:
    """tok/s of feeding `ids` at `depth` the way `zdsl run` feeds a prompt."""
    graph.seek(depth)
    start = time.perf_counter()
    graph.prefill(ids, sample=True)
    return len(ids) / (time.perf_counter() - start)


def time_decode(graph, depth: int, n: int, burst: int) -> float:
    """tok/s of n steps from `depth`, each feeding its sample to the next, in bursts."""
    graph.seek(depth)
    start = time.perf_counter()
    done = 0
    while done < n:
        done += len(graph.decode_burst(min(burst, n - done)))
    return n / (time.perf_counter() - start)


def time_steps(graph, depth: int, t: int, n: int) -> float:
    """ms of a step of t tokens of one sequence from `depth` (DecodeGraph.decode_tokens: the step
    a speculative decoder verifies t drafted tokens with), each step waited for, as a verifier
    waits to see what it accepts."""
    ids = np.random.default_rng(t).integers(0, graph.hp.vocab, t).tolist()
    graph.seek(depth)
    start = time.perf_counter()
    for _ in range(n):
        graph.decode_tokens(ids)
    return 1e3 * (time.perf_counter() - start) / n


def measure_steps(graph, depth: int, sizes: list[int], n: int, repeats: int, say) -> list[dict]:
    """ms per step of each of `sizes` tokens at `depth` (median of repeats, after an untimed
    pass that records and warms), and its ratio to the step of one token through the same path."""
    say(f"depth {depth:,}: steps of {', '.join(map(str, sizes))} tokens of one sequence, {repeats} × {n} steps each")
    rows = []
    for t in sizes:
        time_steps(graph, depth, t, n)
        rows.append({"tokens": t, "ms": summary([time_steps(graph, depth, t, n) for _ in range(repeats)])})
    one = next((r["ms"]["median"] for r in rows if r["tokens"] == 1), None)
    for r in rows:
        r["vs_one_token"] = r["ms"]["median"] / one if one else None
    return rows


def copy_bandwidth(device, nbytes: int) -> float:
    """GB/s of the DSL copy kernel over two `nbytes` buffers (read + write bytes counted)."""
    from zdsl.autotune import timing, tuner

    return timing.copy_bandwidth(tuner.Measure(device, warmup=5, repeats=30, warm_s=0.3, cache_bytes=0), nbytes)


def git_commit() -> str | None:
    """The checkout's HEAD (with -dirty if tracked files differ), or None outside a git checkout."""
    import zdsl

    root = Path(zdsl.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def measure(gen, plan, depths: list[int], tokens: int, prompt_len: int, repeats: int, copy_gbps: float,
            say) -> list[dict]:
    """One row per depth: prompt and decode tok/s (after untimed passes of each: the prompt's
    chunk sequences are recorded on first use, and the clocks rise: WARM_S), the bytes a decoded
    token moves there, the ceiling they imply and the share of it reached."""
    g = gen.graph
    ids = np.random.default_rng(0).integers(0, g.hp.vocab, prompt_len).tolist()
    rows = []
    for depth in depths:
        say(f"depth {depth:,}: warm-up, then {repeats} × ({prompt_len} prompt + {tokens} decode tokens)")
        time_decode(g, depth, tokens, gen.burst)
        end = time.perf_counter() + WARM_S
        while True:
            time_prompt(g, depth, ids)
            if time.perf_counter() >= end:
                break
        prompt = [time_prompt(g, depth, ids) for _ in range(repeats)]
        decode = summary([time_decode(g, depth, tokens, gen.burst) for _ in range(repeats)])
        b = bytes_per_token(plan, depth, tokens, g.kv_types)
        ceiling = copy_gbps * 1e9 / b["total"]
        rows.append({"context": depth, "prompt": summary(prompt), "decode": decode, "bytes_per_token": b,
                     "ceiling_tok_per_s": ceiling, "pct_of_ceiling": 100 * decode["median"] / ceiling})
    return rows


def markdown(r: dict) -> str:
    """A table for docs/PERF.md, headed by what every figure there needs: date, commit, device, command."""
    s = r["settings"]
    lines = [f"{r['date'][:10]}, commit {r['commit'] or 'unknown'}, {r['device']['name']} "
             f"({r['device']['driver']}), `{r['command']}`", "",
             f"Copy bandwidth {r['copy_gbps']:,.0f} GB/s (DSL copy kernel, read + write, same run). "
             f"Decode: {s['tokens']} tokens after each depth, median of {s['repeats']} "
             f"± standard deviation; bytes per token = weights read + KV rows read and written "
             f"({s['kv_type']}) + "
             f"delta-net state read and written. Prompt: {s['prompt']} tokens; {PROMPT_NOTE}.", "",
             "| context | prompt tok/s | decode tok/s | GB read / token | ceiling tok/s | % of ceiling |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        p, d = row["prompt"], row["decode"]
        lines.append(f"| {row['context']:,} | {p['median']:,.1f} ± {p['stdev']:,.1f} | "
                     f"{d['median']:,.1f} ± {d['stdev']:,.1f} | {row['bytes_per_token']['total'] / 1e9:.3f} | "
                     f"{row['ceiling_tok_per_s']:,.0f} | {row['pct_of_ceiling']:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(r: dict, plan, path: Path) -> bool:
    """tok/s against context with the ceiling curve; False when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    ctx = [row["context"] for row in r["rows"]]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    lo, hi = max(min(ctx), 1), max(max(ctx), 2)
    xs = np.geomspace(lo, hi, 200)
    n = r["settings"]["tokens"]
    kv = kv_types(r["settings"]["kv_type"])
    ax.plot(xs, [r["copy_gbps"] * 1e9 / bytes_per_token(plan, x, n, kv)["total"] for x in xs], "k--",
            label=f"ceiling at {r['copy_gbps']:,.0f} GB/s")
    for key, label, style in (("decode", "decode", "o-"), ("prompt", "prompt (batched prefill)", "s:")):
        med = [row[key]["median"] for row in r["rows"]]
        err = [[m - row[key]["min"] for m, row in zip(med, r["rows"])],
               [row[key]["max"] - m for m, row in zip(med, r["rows"])]]
        ax.errorbar([max(c, 1) for c in ctx], med, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([max(c, 1) for c in ctx], [f"{c:,}" for c in ctx])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{r['model']['name']} on {r['device']['name']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def memory_table(rows: list[dict], available: int, device_name: str):
    from zdsl.console import Table
    from zdsl.models.qwen35.model.buffers import KINDS
    from zdsl.runtime.memory import fmt_bytes

    t = Table(title=f"memory plan ({device_name}: {fmt_bytes(available)} free)")
    for col in ("context", "n_ctx", *KINDS, "total", "fits"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['context']:,}", f"{r['n_ctx']:,}", *(fmt_bytes(r[k]) for k in KINDS), fmt_bytes(r["total"]),
                  "yes" if r["fits"] else "NO")
    return t


def results_table(r: dict):
    from zdsl.console import Table

    t = Table(title=f"{r['model']['name']} on {r['device']['name']}: copy {r['copy_gbps']:,.0f} GB/s")
    for col in ("context", "prompt tok/s", "decode tok/s", "GB/token", "ceiling tok/s", "% ceiling"):
        t.add_column(col, justify="right")
    for row in r["rows"]:
        p, d = row["prompt"], row["decode"]
        t.add_row(f"{row['context']:,}", f"{p['median']:,.1f} ± {p['stdev']:,.1f}",
                  f"{d['median']:,.1f} ± {d['stdev']:,.1f}", f"{row['bytes_per_token']['total'] / 1e9:.3f}",
                  f"{row['ceiling_tok_per_s']:,.0f}", f"{row['pct_of_ceiling']:.1f}%")
    return t


def steps_table(r: dict):
    from zdsl.console import Table

    depth = r["settings"]["contexts"][0]
    t = Table(title=f"steps of several tokens of one sequence at depth {depth:,}, each waited for")
    for col in ("tokens", "ms a step", "× one token", "tok/s fed"):
        t.add_column(col, justify="right")
    for row in r["steps"]:
        ms = row["ms"]["median"]
        t.add_row(str(row["tokens"]), f"{ms:.2f} ± {row['ms']['stdev']:.2f}",
                  f"{row['vs_one_token']:.2f}" if row["vs_one_token"] else "", f"{1e3 * row['tokens'] / ms:,.0f}")
    return t


def parse_step_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or sizes[-1] > 64:
        raise ZdslError(f"--step-tokens '{text}': give comma-separated token counts from 1 to 64, e.g. 1,2,4,8,16")
    return sizes


@click.command("bench")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--contexts", default=None,
              help=f"Comma-separated depths in tokens [default: {DEFAULT_CONTEXTS}, those the model and device hold].")
@click.option("--device", default=None, help="Index, name substring or alias (zdsl devices).")
@click.option("--tokens", type=int, default=128, show_default=True, help="Decode steps timed at each depth.")
@click.option("--prompt", "prompt_len", type=int, default=512, show_default=True,
              help="Prompt tokens timed at each depth (one decode step each).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per measurement (median reported).")
@click.option("--copy-mb", type=int, default=None,
              help=f"Copy-kernel buffer size in MiB, each of two [default: {device_defaults.COPY_MB}, less where the device "
                   f"binds less or is a CPU].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench"),
              show_default=True, help="Where bench.json, bench.md and bench.png go.")
@click.option("--step-tokens", "step_sizes", default=None,
              help="Also time steps of this many tokens of one sequence (comma-separated, e.g. 1,2,4,8,16: what "
                   "verifying drafted tokens costs) at the first depth.")
@click.option("--spec", type=click.Choice(["mtp", "ngram", "none"]), default="none", show_default=True,
              help="Also time speculative decoding (greedy, at depth 0) against plain decoding: the file's MTP head's "
                   "drafts, or ngram drafts on a prompt that repeats itself; with --accept, drafts of a chosen "
                   "acceptance (the MTP head still drafting, for its time).")
@click.option("--accept", "accepts", default=None,
              help="With --spec: drafts right with each of these probabilities (e.g. 0.5,0.7,0.9), taken from a "
                   "first plain run's tokens (for synthetic weights, where real drafts cannot be judged).")
@click.option("--draft-max", "draft_maxes", default="3", show_default=True,
              help="With --spec: the most drafts a step, one count or several (1,2,4 or 1..4).")
@click.option("--draft-model", type=click.Path(dir_okay=False), default=None,
              help="With --spec mtp: the MTP head from a file of its own (an mtp-*.gguf).")
@kv_type_option
def bench(model, contexts, device, tokens, prompt_len, repeats, copy_mb, out_dir, kv, step_sizes, spec, accepts,
          draft_maxes, draft_model):
    """Decode and prompt tok/s at each context depth, against the ceiling that the device's
    measured copy bandwidth and the bytes read per token imply."""
    from zdsl.console import make_console
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.models.qwen35.file.info import memory_plan
    from zdsl.models.qwen35.cli.bench_spec import (measure_speculation, parse_accepts, parse_draft_max,
                                                   speculation_markdown, speculation_table)
    from zdsl.models.qwen35.model.buffers import PROMPT_CHUNK, check_fits
    from zdsl.models.qwen35.model.mtp import head_buffers
    from zdsl.models.qwen35.model.speculate import speculation
    from zdsl.models.qwen35.model.generate import Generator
    from zdsl.models.qwen35.model.graph import plan_buffers
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.runtime import open_device

    depths = parse_contexts(contexts or DEFAULT_CONTEXTS)
    sizes = parse_step_sizes(step_sizes) if step_sizes else []
    if accepts is not None and spec == "none":
        raise ZdslError("--accept chooses how often drafts are right: give it with --spec mtp or --spec ngram")
    accept_list = parse_accepts(accepts) if accepts is not None else []
    drafts = parse_draft_max(draft_maxes) if spec != "none" else []
    step_tokens = max(max(sizes, default=1), max(drafts, default=0) + 1)
    if min(tokens, prompt_len, repeats) < 1:
        raise ZdslError("--tokens, --prompt and --repeats must be at least 1")
    console = make_console()

    def say(msg: str) -> None:
        console.print(msg, markup=False, highlight=False)

    m = open_model(model)
    if draft_model is not None:
        from zdsl.models.qwen35.file.gguf_file import WithHead

        m = WithHead(m, draft_model)
    if spec == "mtp" and not m.has_mtp:
        raise ZdslError(f"{m.path.name} has no MTP head for --spec mtp; use --spec ngram (or zdsl model synth --mtp)")
    dev = open_device(device)
    gen = None
    try:
        info = dev.info
        if info.compile_only:
            raise ZdslError(f"{info.name} is a compile-only target; pick a device that runs code (zdsl devices)")
        copy_mb = device_defaults.copy_mb(info, copy_mb, say)
        plan = memory_plan(m)
        sampler = SamplerConfig(temperature=0)
        extra = max(tokens, prompt_len, 8 * max(sizes, default=0), prompt_len + tokens if drafts else 0)
        available = dev.memory_available()

        def specs_at(n_ctx: int):
            head = head_buffers(m.hparams, n_ctx, step_tokens, PROMPT_CHUNK, kv) if spec == "mtp" else []
            return plan_buffers(m, info, n_ctx, sampler, kv=kv, step_tokens=step_tokens) + head

        rows = memory_rows(specs_at, depths, extra, available)
        console.print(memory_table(rows, available, info.name))
        if contexts is None:
            rows = default_rows(rows, m.hparams.context_length, available, info.name, say)
            depths = [r["context"] for r in rows]
        check_contexts(m.hparams, depths, extra)
        check_fits(specs_at, depths[-1] + extra, available, info)

        copy_gbps = copy_bandwidth(dev, copy_mb << 20)
        say(f"copy bandwidth {copy_gbps:,.0f} GB/s; {PROMPT_NOTE}")
        gen = Generator(m, dev, n_ctx=depths[-1] + extra, sampler=sampler, say=say, kv=kv, warm=True,
                        step_tokens=step_tokens,
                        speculate=speculation("mtp", max(drafts), sampler) if spec == "mtp" else None)
        results = measure(gen, plan, depths, tokens, prompt_len, repeats, copy_gbps, say)
        step_rows = measure_steps(gen.graph, depths[0], sizes, 8, repeats, say) if sizes else []
        speculated = measure_speculation(gen, spec, accept_list, drafts, prompt_len, tokens, repeats, say) \
            if drafts else None
        report = {
            "command": " ".join(["zdsl bench", str(m.path), f"--contexts {','.join(map(str, depths))}"]
                                + ([f"--device {device}"] if device is not None else [])
                                + [f"--tokens {tokens}", f"--prompt {prompt_len}", f"--repeats {repeats}",
                                   f"--copy-mb {copy_mb}", f"--kv-type {','.join(kv)}", f"--out {out_dir}"]
                                + ([f"--step-tokens {','.join(map(str, sizes))}"] if sizes else [])
                                + ([f"--spec {spec}", f"--draft-max {','.join(map(str, drafts))}"] if drafts else [])
                                + ([f"--accept {','.join(f'{a:g}' for a in accept_list)}"] if accept_list else [])
                                + ([f"--draft-model {draft_model}"] if draft_model else [])),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "device": {"name": info.name, "driver": f"{info.driver_name} {info.driver_info}".strip(),
                       "vulkan": info.api_version, "memory_free_bytes": available,
                       "memory_used_bytes": dev.memory_report()["device"]["used"]},
            "model": {"path": str(m.path), "name": m.path.name, "arch": m.hparams.arch, "layers": m.hparams.n_layers,
                      "attention_layers": len(m.hparams.attention_layers), "weight_bytes": plan.weight_bytes,
                      "weight_bytes_read_per_token": plan.read_per_token,
                      "kv_bytes_per_token": plan.kv_bytes(kv),
                      "recurrent_state_bytes": plan.recurrent_state_bytes},
            "settings": {"contexts": depths, "tokens": tokens, "prompt": prompt_len, "repeats": repeats,
                         "kv_type": ",".join(kv),
                         "burst": gen.burst, "copy_bytes": 2 * (copy_mb << 20),
                         "warmup": f"{tokens} decode tokens and {WARM_S:g} s of prompts per depth"},
            "copy_gbps": copy_gbps,
            "dispatches_per_token": gen.graph.dispatches,
            "memory_plan": rows,
            "notes": [PROMPT_NOTE, "bytes_per_token: weights read + KV rows read (mean over the timed steps) and "
                      "the row written + delta-net state read and written; ceiling = copy bandwidth / those bytes"],
            "rows": results,
            "steps": step_rows,
            **({"speculation": speculated} if speculated else {}),
        }
    finally:
        if gen is not None:
            gen.close()
        dev.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    (out_dir / "bench.md").write_text(markdown(report) + (speculation_markdown(report) if speculated else ""))
    console.print(results_table(report))
    if step_rows:
        console.print(steps_table(report))
    if speculated:
        console.print(speculation_table(report))
    wrote = [out_dir / "bench.json", out_dir / "bench.md"]
    if plot(report, plan, out_dir / "bench.png"):
        wrote.append(out_dir / "bench.png")
    else:
        say("bench.png skipped: matplotlib is not installed (pip install 'zdsl[plot]')")
    say("wrote " + ", ".join(map(str, wrote)))
