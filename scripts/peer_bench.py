#!/usr/bin/env python3
"""zdsl beside llama.cpp on one GGUF file: prompt (pp512), decode (tg128) and decode at each depth.

Runs `llama-bench -m MODEL -ngl 99 -fa 1 -p 512 -n 128 -d DEPTHS -o json` and prints its tok/s
next to those of a `zdsl bench` run (its bench.json) in one table. The depths are 0 and those of
the zdsl run, so every zdsl row has a llama.cpp row to compare with.

llama-bench is found as --llama-bench PATH, else $LLAMA_BENCH, else on PATH; it is not built
here (`--help` says how to build one). --llama-json FILE reads a saved `llama-bench -o json`
output instead of running it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from zdsl.errors import ZdslError

PROMPT, GEN = 512, 128
BUILD = """\b
Building llama-bench from the llama.cpp tree that llama-cpp-python vendors (its Vulkan build needs
a current glslc: check the configure log for features it drops, see ../shared/docs/peers.md):
  pip download --no-deps --no-binary :all: llama-cpp-python && tar xf llama_cpp_python-*.tar.gz
  cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DGGML_VULKAN=ON -DLLAMA_BUILD_TOOLS=ON
  cmake --build build --target llama-bench -j    # then --llama-bench build/bin/llama-bench
"""


def find_llama_bench(given: str | None) -> str:
    path = given or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not path or not (Path(path).is_file() and os.access(path, os.X_OK)):
        where = f"'{path}' is not an executable file" if path else "no llama-bench found"
        raise ZdslError(f"{where}: pass --llama-bench PATH, set LLAMA_BENCH, or put llama-bench on PATH "
                        "(how to build it: scripts/peer_bench.py --help)")
    return path


def parse_llama(text: str) -> list[dict]:
    """The records of `llama-bench -o json` (anything it printed before the JSON array is skipped)."""
    start = text.find("[")
    try:
        records = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "avg_ts" in r for r in records):
        raise ZdslError("llama-bench printed no JSON list of results; run it by hand with -o json to see why")
    return records


def run_llama_bench(binary: str, model: str, depths: list[int]) -> list[dict]:
    cmd = [binary, "-m", model, "-ngl", "99", "-fa", "1", "-p", str(PROMPT), "-n", str(GEN),
           "-d", ",".join(map(str, depths)), "-o", "json"]
    click.echo("running " + " ".join(cmd), err=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ZdslError(f"llama-bench failed with exit code {done.returncode}: {last}")
    return parse_llama(done.stdout)


def merge(zdsl: dict | None, llama: list[dict]) -> list[dict]:
    """One row per (test, depth) that either side measured: pp rows then tg rows at each depth.
    zdsl's prompt and decode are `zdsl bench`'s at that depth (its notes say how it runs them)."""
    cells: dict[tuple[str, int], dict] = {}
    for r in llama:
        kind = "pp" if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0 else \
               "tg" if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0 else None
        if kind:
            n = r["n_prompt"] if kind == "pp" else r["n_gen"]
            cells.setdefault((kind, r.get("n_depth", 0)), {"n": n})["llama"] = (r["avg_ts"], r.get("stddev_ts", 0.0))
    if zdsl:
        s = zdsl["settings"]
        for row in zdsl["rows"]:
            for kind, key, n in (("pp", "prompt", s["prompt"]), ("tg", "decode", s["tokens"])):
                cell = cells.setdefault((kind, row["context"]), {"n": n})
                cell["zdsl"] = (row[key]["median"], row[key]["stdev"])
    rows = []
    for (kind, depth), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        z, lc = cell.get("zdsl"), cell.get("llama")
        rows.append({"test": f"{kind}{cell['n']}" + (f" @ d{depth}" if depth else ""), "kind": kind, "depth": depth,
                     "zdsl": z, "llama": lc, "ratio": z[0] / lc[0] if z and lc and lc[0] else None})
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from zdsl.console import Table, make_console

    def cell(v):
        return "—" if v is None else f"{v[0]:,.1f} ± {v[1]:,.1f}"

    t = Table(title=title)
    for col in ("test", "zdsl tok/s", "llama.cpp tok/s", "zdsl ÷ llama.cpp"):
        t.add_column(col, justify="left" if col == "test" else "right")
    for r in rows:
        t.add_row(r["test"], cell(r["zdsl"]), cell(r["llama"]), "—" if r["ratio"] is None else f"{r['ratio']:.2f}×")
    make_console().print(t)


@click.command(epilog=BUILD)
@click.option("--model", required=True, type=click.Path(dir_okay=False), help="The GGUF file both run.")
@click.option("--llama-bench", "binary", default=None, help="The llama-bench binary (default: $LLAMA_BENCH, PATH).")
@click.option("--zdsl-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="bench.json of `zdsl bench` on the same model and machine.")
@click.option("--llama-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A saved `llama-bench -o json` output, read instead of running llama-bench.")
@click.option("--depths", default=None, help="Comma-separated depths (default: 0 and those of --zdsl-json).")
def cli(model, binary, zdsl_json, llama_json, depths):
    """Prompt and decode tok/s of zdsl and llama.cpp side by side."""
    zdsl = None
    if zdsl_json is not None:
        try:
            zdsl = json.loads(zdsl_json.read_text())
            zdsl["rows"], zdsl["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ZdslError(f"{zdsl_json} is not a bench.json written by `zdsl bench`") from None
        if Path(zdsl["model"]["path"]).name != Path(model).name:
            click.echo(f"note: zdsl ran {zdsl['model']['path']}, llama.cpp runs {model}", err=True)
    if llama_json is not None:
        try:
            llama = parse_llama(llama_json.read_text())
        except OSError as e:
            raise ZdslError(f"cannot read {llama_json}: {e.strerror}") from None
    else:
        try:
            want = ({int(d) for d in depths.split(",")} if depths
                    else {0, *(zdsl["settings"]["contexts"] if zdsl else ())})
        except ValueError:
            raise ZdslError(f"--depths '{depths}': give comma-separated integers, e.g. 0,4096,32768") from None
        llama = run_llama_bench(find_llama_bench(binary), model, sorted(want))
    backend = llama[0].get("backends", "?") if llama else "?"
    gpu = llama[0].get("gpu_info", "") if llama else ""
    print_table(merge(zdsl, llama), f"{Path(model).name}: zdsl ({zdsl['device']['name'] if zdsl else 'not run'}) "
                                    f"vs llama.cpp {backend} ({gpu})")
    for note in (zdsl or {}).get("notes", [])[:1]:  # how zdsl ran the prompt (bench.py's PROMPT_NOTE)
        click.echo(f"zdsl: {note}")


def main(argv: list[str] | None = None) -> int:
    from zdsl.cli import run

    return run(cli, argv, "peer_bench.py")


if __name__ == "__main__":
    sys.exit(main())
