"""`zdsl tune`: pick the fastest kernel variants for a device, for the launches a model decodes with
(or, with --prompt, those of one prompt chunk; with --step-tokens, those of a step of several
tokens that a one-token step does not share: the few-column products).

On a device that runs code every candidate is checked against its numpy reference and timed;
on a compile-only RADV target (gfx1201, navi31, ...) candidates are compiled by the null device
and ranked by a cost model — modelled, not measured, and the output says so. The choices go to
a tuning database file (the user's own for the device by default, or --out), where `choose()`
finds them at run time. Given a model file on a device that runs code, the kernel-by-kernel
winners are only nominees: each is tried in the model's real decode step and kept only if whole
steps get faster (`in_place.py`), so a tuned decode is never slower than an untuned one.
With --check-model nothing is written: every candidate is measured (or a saved measurement is
replayed, --measured) and the cost model's ranking is scored against it (`autotune/check.py`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from zdsl.console import Table, make_console
from zdsl.errors import ZdslError
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes

from ..file.gguf_file import open_model
from ..file.synth import QUANTS, PresetModel
from ..model.graph import DecodeGraph, record_chunk_launches, record_launches, record_step_launches
from ..model.sampler import SamplerConfig
from .bench import parse_step_sizes
from .run import kv_type_option

from zdsl.autotune import check, cost_model, tuner
from zdsl.autotune.database import Database, database, user_path

SHOWN = 5  # candidates listed per use (plus the default when it is not among them)


def _open(device_name: str | None, warmup: int, repeats: int, warm_ms: int, cache_mb: int):
    """(method object, info, device to close or None) for a runnable device or a RADV family."""
    from zdsl.runtime import open_device
    from zdsl.runtime.device import FAMILY
    from zdsl.runtime.nulldevice import target_info

    if device_name and FAMILY.fullmatch(device_name.strip().lower()):
        family = device_name.strip().lower()
        cost_model.card(family)  # a family without figures fails here, before the null device starts
        info = target_info(family)
        return tuner.Model(family, info), info, None
    dev = open_device(device_name)
    if "timestamps" not in dev.info.features:
        dev.close()
        raise ZdslError(f"{dev.info.name} has no timestamp queries on its compute queue, so zdsl cannot time "
                        "kernels on it; tune another device")
    return tuner.Measure(dev, warmup=warmup, repeats=repeats, warm_s=warm_ms / 1e3, cache_bytes=cache_mb << 20), \
        dev.info, dev


def step_uses(model, info, n_ctx: int, caps: tuple[int, ...], kv: KVTypes = KV_DEFAULT) -> list[tuner.Use]:
    """The tunable uses of one decode step of `model` as a device of `info` records it, once per
    sampler candidate cap in `caps` (1 is greedy decoding; a step records one of them), with KV
    caches in the formats `kv`."""
    launches = []
    for cap in caps:
        sampler = SamplerConfig(temperature=0) if cap == 1 else SamplerConfig(cap=cap)
        launches += record_launches(model, info, n_ctx, sampler, kv=kv)
    found = tuner.uses(launches)
    for use in found:  # the graph's steps around the sampler repeat for each cap: count one step's
        if use.kernel.name != "sample_candidates":
            use.count //= len(caps)
    return found


def chunk_uses(model, info, n_ctx: int, t: int, kv: KVTypes = KV_DEFAULT) -> list[tuner.Use]:
    """The tunable uses of one prompt chunk of t tokens of `model` (batched prefill)."""
    return tuner.uses(record_chunk_launches(model, info, n_ctx, t, kv=kv))


def several_uses(model, info, n_ctx: int, t: int, kv: KVTypes = KV_DEFAULT) -> list[tuner.Use]:
    """The tunable uses of one step of t tokens of one sequence that the decode step does not have
    (dmmv at t columns, the experts' kernels at t rows, the delta-net's step of several tokens): a
    kernel whose tuning key holds no row count shares its entry with the decode step, which
    decides it in place."""
    one = {u.ident for u in step_uses(model, info, n_ctx, (1,), kv)}
    return [u for u in tuner.uses(record_step_launches(model, info, n_ctx, t, kv=kv)) if u.ident not in one]


def uses_of(model, info, n_ctx: int, caps: tuple[int, ...], prompt: int, kv: KVTypes,
            names: str | None, step_tokens: int = 1) -> list[tuner.Use]:
    """The uses `zdsl tune` takes: one prompt chunk's of `prompt` tokens, those a step of
    `step_tokens` adds, or else the decode step's (per sampler cap), with the KV caches in the
    formats `kv`, narrowed to `names`."""
    if prompt:
        return select(chunk_uses(model, info, max(n_ctx, prompt), prompt, kv), names, f"{prompt}-token prompt chunk")
    if step_tokens > 1:
        return select(several_uses(model, info, n_ctx, step_tokens, kv), names, f"{step_tokens}-token step")
    return select(step_uses(model, info, n_ctx, caps, kv), names)


def select(uses, names: str | None, what: str = "decode step"):
    if not names:
        return uses
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    have = sorted({u.kernel.name for u in uses})
    unknown = [n for n in wanted if n not in have]
    if unknown:
        raise ZdslError(f"this model's {what} dispatches no kernel {', '.join(unknown)} "
                        f"(it dispatches {', '.join(have)})")
    return [u for u in uses if u.kernel.name in wanted]


@click.command("tune")
@click.option("--device", "device_name", default=None,
              help="Device index or name, or a RADV family for a modelled ranking (gfx1201, gfx1151, navi31, ...). "
                   "Default: $ZDSL_DEVICE or the best device.")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="GGUF file whose shapes to tune (default: the --preset's).")
@click.option("--preset", default="35b-a3b", show_default=True, help="Synthetic preset used when no --model is given.")
@click.option("--quant", type=click.Choice(QUANTS), default="q4_k_m", show_default=True,
              help="The preset's type mix (zdsl model synth --quant).")
@click.option("--kernels", "names", default=None, help="Comma-separated kernel names (default: every kernel the step uses).")
@click.option("--budget", default=600.0, show_default=True, help="Seconds to spend; uses left when it runs out stay untuned. With --model on a device "
                   "that runs code, half times kernels alone and the rest tries the winners in the decode step.")
@click.option("--ctx", "n_ctx", default=4096, show_default=True, help="Context length the attention kernels are timed at.")
@click.option("--caps", default="1,64", show_default=True, help="Sampler candidate caps to tune (1 is greedy decoding).")
@click.option("--prompt", "prompt", default=0, show_default=True,
              help="Tune the launches of one prompt chunk of this many tokens (batched prefill, up to 512) instead "
                   "of the decode step's; kernels are timed alone.")
@click.option("--step-tokens", default="1", show_default=True,
              help="Tune the launches that a step of this many tokens of one sequence (a speculative step's "
                   "verification) adds to the decode step's: the few-column products and the experts' kernels at "
                   "that many rows; kernels are timed alone. Several (2,4,8) share the budget, one after the other.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Database file to add the choices to (default: the user's file for this device, which run, bench "
                   "and profile read; they do not read a file given here until it is merged into that one or the "
                   "shipped one).")
@click.option("--min-gain", default=1.0, show_default=True,
              help="Write an entry only where the chosen variant beats the default by this factor (kernels alone; "
                   "the shipped modelled files take 1.05); ignored with a model file on a device that runs code, "
                   "where the decode step decides.")
@click.option("--warmup", default=5, show_default=True, help="Untimed dispatches before the timed ones.")
@click.option("--repeats", default=20, show_default=True, help="Timed dispatches per candidate (the median counts).")
@click.option("--warm-ms", default=200, show_default=True, help="Replay each candidate this long before timing it.")
@click.option("--cache-mb", default=256, show_default=True,
              help="Rotate input copies until this many MB lie between reuses (defeats the caches).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--check-model", is_flag=True,
              help="Write no entries: measure every candidate and put the cost model beside the measurement, per "
                   "use (Spearman's rho, whether its pick is within 5% of the best), its free parameters fitted on "
                   "the other uses (--folds).")
@click.option("--measured", "measured_paths", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              multiple=True, help="With --check-model: replay these measurement files (written by --record; the "
                                  "option repeats) instead of measuring: every use they hold, the decode step's and "
                                  "the prompt chunk's, scored together.")
@click.option("--record", "record_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --check-model on a device: save the measurements to this file, for --measured.")
@click.option("--folds", default=4, show_default=True, help="With --check-model: fold f holds out uses f, f + folds, ...")
@kv_type_option
def tune(device_name, model_path, preset, quant, names, budget, n_ctx, caps, prompt, step_tokens, out_path, min_gain,
         warmup, repeats, warm_ms, cache_mb, as_json, check_model, measured_paths, record_path, folds, kv):
    """Pick the fastest kernel variants for a device (measured, or modelled for compile-only targets)."""
    steps = parse_step_sizes(step_tokens)
    if check_model and steps != [1]:
        raise ZdslError("--check-model scores the decode step's or a prompt chunk's uses: drop --step-tokens")
    if check_model:
        _check_model(device_name, model_path, preset, quant, names, budget, n_ctx, caps, prompt, kv, warmup, repeats,
                     warm_ms, cache_mb, as_json, measured_paths, record_path, folds)
        return
    if measured_paths or record_path:
        raise ZdslError("--measured and --record go with --check-model")
    if budget <= 0 or n_ctx < 1 or repeats < 1 or min(warmup, warm_ms, cache_mb, prompt) < 0:
        raise ZdslError("--budget, --ctx and --repeats must be positive; --warmup, --warm-ms, --cache-mb and "
                        "--prompt ≥ 0")
    if prompt and steps != [1]:
        raise ZdslError("--prompt and --step-tokens each name the step to tune: give one")
    if len(steps) > 1 and 1 in steps:
        raise ZdslError(f"--step-tokens {step_tokens}: tune the decode step (1) in a run of its own, without "
                        "--step-tokens; several steps are counts of 2 or more")
    try:
        cap_list = tuple(int(c) for c in caps.split(","))
    except ValueError:
        raise ZdslError(f"--caps '{caps}': write comma-separated integers such as 1,64") from None
    method, info, dev = _open(device_name, warmup, repeats, warm_ms, cache_mb)
    try:
        model = open_model(model_path) if model_path else PresetModel(preset, quant)
        source = str(model_path) if model_path else model.source
        passes = [(f"{t}-token step" if t > 1 else f"{prompt}-token chunk" if prompt else "token",
                   uses_of(model, info, n_ctx, cap_list, prompt, kv, names, t)) for t in steps]
    except BaseException:
        if dev is not None:
            dev.close()
        raise
    console = make_console(stderr=as_json)
    modelled = isinstance(method, tuner.Model)
    in_place = model_path is not None and not modelled and not prompt and steps == [1]  # whole decode steps
    report, ran = None, []  # (per, results) of each step tuned
    try:
        deadline = time.monotonic() + budget
        for per, uses in passes:
            if not as_json:
                _header(console, info, source, len(uses), method, in_place, per)
            ran.append((per, _run(method, uses, budget / 2 if in_place else budget / len(passes), console)))
        results = [r for _, rs in ran for r in rs]
        if in_place:
            report = _in_place(dev, model_path, n_ctx, kv, results, info, deadline, console)
    finally:
        if dev is not None:
            dev.close()
    user = user_path(info)
    path = out_path or user
    db = Database([path])
    kept = [r for r in results if min_gain <= 1.0 or (r.speedup or 0.0) >= min_gain]
    added = report.entries if report is not None else [e for r in kept for e in tuner.entries(r, info)]
    for e in added:
        db.add(e)
    if added:
        path.parent.mkdir(parents=True, exist_ok=True)
        db.save(path)
        database.cache_clear()
    if as_json:
        out = _as_json(info, source, results, modelled, path, len(added), method.card if modelled else None)
        if report is not None:
            out["in_place"] = _in_place_json(report)
        click.echo(json.dumps(out, indent=1))
        return
    for per, rs in ran:
        for r in rs:
            _use_table(console, r, per)
        _summary(console, rs, modelled, alone=in_place, per=per, card=method.card if modelled else None)
    if report is not None:
        _in_place_table(console, report)
    if report is None and len(kept) < len(results):
        console.print(f"{len(results) - len(kept)} uses gain less than {min_gain:g}× (--min-gain): no entry for them")
    if not added:
        console.print("nothing tuned, nothing written")
    elif path == user:
        console.print(f"{len(added)} entries written to {path} (run, chat and bench use them from now on)")
    else:
        console.print(f"{len(added)} entries written to {path}; run, chat and bench do not read that file (they read "
                      f"{user}): merge them there to use them")


def _measured_uses(device_name, model_path, preset, quant, names, budget, n_ctx, caps, prompt, kv, warmup, repeats,
                   warm_ms, cache_mb, record_path, console) -> tuple[str, list[dict]]:
    """(device name, records) of every candidate of the step's (or the chunk's) uses, measured now."""
    method, info, dev = _open(device_name, warmup, repeats, warm_ms, cache_mb)
    try:
        if dev is None:
            raise ZdslError(f"{info.name} is compile-only: it measures nothing; check the model on a device that "
                            "runs code, or replay a measurement with --measured FILE")
        cost_model.card_of(info.name)  # a device without figures fails here, before minutes of measuring
        model = open_model(model_path) if model_path else PresetModel(preset, quant)
        where = "chunk" if prompt else "step"
        uses = uses_of(model, info, n_ctx, tuple(int(c) for c in caps.split(",")), prompt, kv, names)
        results = _run(method, uses, budget, console)
        records = [check.record(r.use, where, r, dev) for r in results if r.ranked]
    finally:
        if dev is not None:
            dev.close()
    if record_path:
        check.save(record_path, info.name, records)
    return info.name, records


def _check_model(device_name, model_path, preset, quant, names, budget, n_ctx, caps, prompt, kv, warmup, repeats,
                 warm_ms, cache_mb, as_json, measured_paths, record_path, folds) -> None:
    """`zdsl tune --check-model`: the cost model's ranking beside the measured one, fitted on other uses."""
    console = make_console(stderr=as_json)
    if measured_paths:
        if record_path:
            raise ZdslError("--record saves a new measurement; --measured replays one: give one of them")
        devices, records = set(), []
        for path in measured_paths:
            device, more = check.load(path)
            devices.add(device)
            records += [r for r in more if not names or r["kernel"] in names.split(",")]
        if len(devices) > 1:
            raise ZdslError(f"the measurement files are of {len(devices)} devices ({', '.join(sorted(devices))}): "
                            "replay one device's at a time")
    else:
        device, records = _measured_uses(device_name, model_path, preset, quant, names, budget, n_ctx, caps, prompt,
                                         kv, warmup, repeats, warm_ms, cache_mb, record_path, console)
    card = cost_model.card_of(device)
    uses, stale = check.uses_of(records)
    if stale:
        console.print(f"skipped {len(stale)} uses measured on parameters their kernels no longer have "
                      f"({', '.join(sorted(set(stale)))}): measure again with --record")
    if len(uses) < 2:
        raise ZdslError(f"{len(uses)} uses with {check.MIN_CANDIDATES} or more measured candidates: too few to fit on "
                        "some and score the others")
    report = check.cross_validate(card, uses, folds)
    if as_json:
        click.echo(json.dumps(_check_json(device, card, report), indent=1))
    else:
        _check_tables(console, device, card, report)


def _check_tables(console, device: str, card, report: check.Report) -> None:
    folds = len(report.fold_cards)
    table = Table(title=f"{device}: the cost model ({card.name}) beside the measurement, each use scored with the "
                        f"free parameters fitted on the other folds ({folds} folds)", title_justify="left")
    for c in ("kernel", "shape", "fold", "n", "ρ", "model's pick", "pick / best", "bound by",
              "measured ranks in the model's order"):
        table.add_column(c, justify="left" if c in ("kernel", "shape", "model's pick", "bound by") else "right")
    for u, s, f in zip(report.uses, report.held_out, report.fold_of):
        ratio = f"{s.ratio:.3f}" + ("" if s.within else " [red]✗[/red]")
        table.add_row(u.kernel, u.label, str(f), str(len(u.labels)), f"{s.rho:.2f}", u.labels[s.pick], ratio, s.bound,
                      " ".join(f"{r:g}" for r in check.order(u, s)))
    console.print(table)
    for f, c in enumerate(report.fold_cards):
        console.print(f"fold {f}: fitted latency {c.latency_ns:g} ns, {c.cpi:g} cycles per dependent instruction, "
                      f"issue efficiency {c.issue_efficiency:g}, overlap p {c.overlap:g}, "
                      f"shared-memory efficiency {c.shared_efficiency:g}, L2 {c.l2_bytes_per_clock:g} bytes a clock an SM "
                      f"({c.l2_bytes_per_clock * c.units * c.clock_ghz:,.0f} GB/s)")
    rho, within = report.summary(report.held_out)
    n = len(report.uses)
    console.print(f"[bold]held out[/bold]: median ρ {rho:.2f}, pick within 5% of the best in "
                  f"{round(within * n)} of {n} uses ({within:.0%})")
    rho, within = report.summary(report.nominal)
    console.print(f"the card's own figures (latency {card.latency_ns:g} ns, cpi {card.cpi:g}, efficiency "
                  f"{card.issue_efficiency:g}, p {card.overlap:g}, shared {card.shared_efficiency:g}, L2 {card.l2_bytes_per_clock:g}), no fit: median ρ {rho:.2f}, picks within 5% {within:.0%}; "
                  f"the defaults alone are within 5% in {report.defaults_within():.0%}")


def _check_json(device: str, card, report: check.Report) -> dict:
    rho, within = report.summary(report.held_out)
    return {
        "device": device, "card": card.name, "median_rho": rho, "within_5pct": within,
        "defaults_within_5pct": report.defaults_within(),
        "folds": [{k: getattr(c, k) for k in check.GRID} for c in report.fold_cards],
        "uses": [{"kernel": u.kernel, "shape": u.label, "fold": f, "candidates": u.labels,
                  "measured_us": u.measured.tolist(), "modelled_us": s.predicted.tolist(), "rho": s.rho,
                  "pick": u.labels[s.pick], "pick_over_best": s.ratio, "bound": s.bound}
                 for u, s, f in zip(report.uses, report.held_out, report.fold_of)],
    }


def _in_place(dev, model_path, n_ctx: int, kv, results, info, deadline: float, console):
    """Build the model's decode step on the device and keep only the choices that speed it up."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .in_place import InPlace

    graph = DecodeGraph(open_model(model_path), dev, n_ctx, progress=console.is_terminal, kv=kv)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True, disable=not console.is_terminal) as bar:
            task = bar.add_task("in place")
            return InPlace(graph).run(results, info, deadline, lambda text: bar.update(task, description=text))
    finally:
        graph.close()


def _run(method, uses, budget: float, console) -> list[tuner.Result]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + budget
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("tuning", total=len(uses))
        for use in uses:
            bar.update(task, description=f"{use.kernel.name} {use.label}")
            if time.monotonic() > deadline:
                results.append(tuner.Result(use, "", tuner.Candidate({}, {}), [], [], skipped="time budget spent"))
            else:
                results.append(method.tune(use, deadline))
            bar.advance(task)
    return results


def _header(console, info, source: str, n: int, method, in_place: bool, per: str = "token") -> None:
    what = f"kernel uses of {source}" + ("" if per == "token" else f" (one {per})")
    if per != "token" and "coopmat" not in info.features:
        what += "; the device offers no cooperative matrices, so the prompt's products are the int8 and f32 kernels"
    if isinstance(method, tuner.Model):
        console.print(f"[bold]{info.name}[/bold]: {n} {what}, [bold yellow]MODELLED[/bold yellow] "
                      f"with the {method.target} cost model ({method.card.name}, {method.card.bandwidth_gbs:.0f} GB/s, "
                      f"{method.card.units} CUs) from RADV machine-code statistics and the work the interpreter counts — not measured, nothing ran")
    else:
        console.print(f"[bold]{info.name}[/bold]: {n} {what}, measured: each candidate checked "
                      f"against its numpy reference, then timed ({method.warmup} warm-up + {method.repeats} timed dispatches, "
                      f"median)" + ("; then the winners are tried in the model's decode step and kept only if whole "
                                    "steps get faster" if in_place else ""))


def _use_table(console, r: tuner.Result, per: str = "token") -> None:
    use = r.use
    title = f"{use.kernel.name} {use.label}  ×{use.count}/{per}  ({use.role})"
    if not r.ranked:
        console.print(f"{title}: [red]not tuned[/red] ({r.skipped or 'no candidate passed'})")
    else:
        modelled = r.method == "modelled"
        table = Table(title=title + ("  [yellow]modelled[/yellow]" if modelled else ""), title_justify="left")
        cols = ["#", "variant", "modelled µs" if modelled else "µs"]
        cols += ["VGPR", "waves/SIMD", "spills", "VALU", "rounds", "groups/CU", "bound by"] if modelled else ["spread", "GB/s"]
        for c in cols:
            table.add_column(c, justify="left" if c == "variant" else "right")
        shown = r.ranked[:SHOWN] + ([r.default] if any(c is r.default for c in r.ranked[SHOWN:]) else [])
        for c in shown:
            f = c.figures
            mark = " (default)" if c is r.default else ""
            row = [str(next(i for i, x in enumerate(r.ranked, 1) if x is c)), c.label + mark, f"{c.us:,.2f}"]
            if modelled:
                row += [str(f.get("VGPRs", "")), str(f.get("Subgroups per SIMD", "")),
                        str(f.get("Spilled VGPRs", 0) + f.get("Spilled SGPRs", 0)), str(f.get("VALU", "")),
                        f"{f.get('rounds', 0):,.1f}", str(f.get("groups_per_unit", "")), f.get("bound", "")]
            else:
                row += [f"{100 * c.spread:.0f}%", f"{f.get('gbps', 0):,.1f}"]
            table.add_row(*row)
        console.print(table)
        if modelled:
            _ties(console, r)
        if r.skipped:
            console.print(f"  [yellow]{r.skipped}[/yellow]")
    for c in r.rejected:
        console.print(f"  [red]rejected[/red] {c.label}: {c.error}", highlight=False)


def _ties(console, r: tuner.Result) -> None:
    """A line for each kind of tie among a modelled use's candidates, with why the model cannot
    tell them apart (`tuner.ties`) and how they are ordered."""
    groups = tuner.ties(r)
    same = [cs for why, cs in groups if why == "same code figures"]
    for why, cs in groups:
        if why in ("memory", "l2"):
            console.print(f"  {len(cs)} candidates tie at the {'memory' if why == 'memory' else 'L2'} term (each moves "
                          "the same bytes, their lanes' limits lie under it): ranked by their lanes' paths, then issue"
                          + ("; the default first among them" if any(c is r.default for c in cs) else ""))
    if same:
        eg = " = ".join(c.label for c in same[0])
        console.print(f"  {len(same)} groups tie with the same statistics, rounds and terms (e.g. {eg}): their code "
                      "differs in constants only (which rows or columns a workgroup's invocations take), with the same "
                      "waves and occupancy; the smaller workgroup ranks first")
    for why, cs in groups:
        if why == "unexplained":
            console.print(f"  [red]unexplained tie[/red] at {cs[0].us:,.2f} µs: {', '.join(c.label for c in cs)}")


def _decided(card, r: tuner.Result) -> str:
    """The summary's "decided by": the term whose change gained most, default → chosen µs."""
    d = tuner.decided_by(card, r) if card is not None else None
    if d is None:
        return "default kept" if r.best is r.default else "-"
    term, before, after = d
    return f"{term} {before:,.2f} → {after:,.2f}"


def _summary(console, results, modelled: bool, alone: bool = False, per: str = "token", card=None) -> None:
    unit = "modelled µs" if modelled else "µs"
    title = "chosen vs default" + (" (MODELLED, not measured)" if modelled else "") + \
        (", each timed alone (nominees for the decode step)" if alone else "")
    table = Table(title=title, title_justify="left")
    cols = ["kernel", "shape", f"×/{per}", "default", "chosen", f"default {unit}", f"chosen {unit}", "speed-up"]
    cols += ["decided by (µs)"] if modelled else []
    for c in cols:
        table.add_column(c, justify="left" if c in ("kernel", "shape", "default", "chosen", "decided by (µs)") else "right")
    before = after = 0.0
    for r in results:
        best = r.best
        if best is None:
            table.add_row(r.use.kernel.name, r.use.label, str(r.use.count), "", "not tuned", "", "", "",
                          *([""] if modelled else []))
            continue
        default_us = r.default.us
        table.add_row(r.use.kernel.name, r.use.label, str(r.use.count), r.default.label, best.label,
                      f"{default_us:,.2f}" if default_us else "-", f"{best.us:,.2f}",
                      f"{r.speedup:.2f}×" if r.speedup else "-", *([_decided(card, r)] if modelled else []))
        if default_us:
            before += r.use.count * default_us
            after += r.use.count * best.us
    console.print(table)
    if after:
        console.print(f"per {per}, over the tuned uses: {before:,.1f} → {after:,.1f} {unit} ({before / after:.2f}×)")


def _candidate(c: tuner.Candidate) -> dict:
    return {"params": c.tuned, "us": c.us, "spread": c.spread, "figures": c.figures, "error": c.error}


def _decided_json(card, r: tuner.Result) -> dict | None:
    d = tuner.decided_by(card, r) if card is not None else None
    return None if d is None else {"term": d[0], "default_us": d[1], "chosen_us": d[2]}


def _as_json(info, source: str, results, modelled: bool, path: Path, written: int, card=None) -> dict:
    return {
        "device": info.name, "method": "modelled" if modelled else "measured", "model": source,
        "database": str(path), "entries_written": written,
        "uses": [{"kernel": r.use.kernel.name, "key": r.use.key, "count": r.use.count, "role": r.use.role,
                  "default": _candidate(r.default), "best": _candidate(r.best) if r.best else None,
                  "speedup": r.speedup, "decided_by": _decided_json(card, r),
                  "ties": [{"why": why, "params": [c.tuned for c in cs]} for why, cs in tuner.ties(r)]
                  if modelled else [],
                  "candidates": [_candidate(c) for c in r.ranked],
                  "rejected": [_candidate(c) for c in r.rejected], "skipped": r.skipped} for r in results],
    }


def _in_place_table(console, report) -> None:
    table = Table(title="in the decode step: each nominee against the current choice, whole steps interleaved",
                  title_justify="left")
    for c in ("kernel", "shape", "nominee", "ms/token before", "ms/token with it", "gain", "noise", "kept"):
        table.add_column(c, justify="left" if c in ("kernel", "shape", "nominee") else "right")
    for t in report.trials:
        c = t.comparison
        table.add_row(t.result.use.kernel.name, t.result.use.label, t.nominee.label, f"{c.a_ms:.4f}", f"{c.b_ms:.4f}",
                      f"{c.gain:.4f}×", f"±{c.noise:.4f}", "yes" if t.kept else "no")
    console.print(table)
    for r in report.untried:
        console.print(f"  [yellow]not tried in place (time budget spent)[/yellow]: {r.use.kernel.name} {r.use.label}")
    f = report.final
    if f is None:
        console.print("no nominee made the decode step faster: the defaults stay")
    else:
        verdict = "kept" if report.entries else "[red]not a gain: nothing kept[/red]"
        console.print(f"decode step, untuned → tuned: {f.a_ms:.4f} → {f.b_ms:.4f} ms/token ({f.gain:.4f}× ± "
                      f"{f.noise:.4f}, {f.rounds} interleaved rounds): {verdict}")


def _in_place_json(report) -> dict:
    def comparison(c):
        return None if c is None else {"a_ms": c.a_ms, "b_ms": c.b_ms, "gain": c.gain, "noise": c.noise,
                                       "rounds": c.rounds}
    return {
        "trials": [{"kernel": t.result.use.kernel.name, "key": t.result.use.key, "nominee": t.nominee.tuned,
                    "comparison": comparison(t.comparison), "kept": t.kept} for t in report.trials],
        "untried": [{"kernel": r.use.kernel.name, "key": r.use.key} for r in report.untried],
        "final": comparison(report.final), "entries_kept": len(report.entries),
    }
