"""`zdsl devices`: what this machine can run on, and which compile-only targets it can build for."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import click
from zdsl.console import Table, make_console
from zdsl.errors import ZdslError
from zdsl.runtime import nulldevice
from zdsl.runtime.device import list_devices
from zdsl.runtime.memory import fmt_bytes
from zdsl.runtime.physical import FEATURES


def _subgroups(info) -> str:
    if info.min_subgroup_size == info.max_subgroup_size:
        return str(info.subgroup_size)
    return f"{info.min_subgroup_size}-{info.max_subgroup_size} ({info.subgroup_size})"


def _driver(info) -> str:
    """"radv Mesa 25.0.7" from driver name and info, without packaging suffixes."""
    version = re.split(r" \(|-|~", info.driver_info)[0]
    return f"{info.driver_name} {version}".strip()


def _heaps(info) -> str:
    return ", ".join(f"{fmt_bytes(size)}{' local' if local else ''}" for size, local in info.heaps) or "-"


@click.command()
@click.option("--targets", default="gfx1201", show_default=True,
              help="Comma-separated RADV families to list as compile-only targets ('' for none).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def devices(targets: str, as_json: bool) -> None:
    """List Vulkan devices and compile-only targets."""
    infos, missing = list_devices(targets=()), []
    for family in filter(None, (t.strip() for t in targets.split(","))):
        try:
            infos.append(nulldevice.target_info(family))
        except ZdslError as e:
            missing.append(f"{family}: {e}")
    if as_json:
        rows = [dict(asdict(i), features=sorted(i.features)) for i in infos]
        click.echo(json.dumps({"devices": rows, "unavailable_targets": missing}, indent=2))
        return
    table = Table(title="Vulkan devices")
    for col in ("#", "name", "vendor", "driver", "type", "subgroup", "shared", "heaps"):
        table.add_column(col)
    table.add_column("features", ratio=1)
    for i in infos:
        kind = "compile-only" if i.compile_only else i.device_type
        features = ", ".join(f for f in FEATURES if f in i.features)
        table.add_row("-" if i.compile_only else str(i.index), i.name, i.vendor, _driver(i),
                      kind, _subgroups(i), fmt_bytes(i.shared_memory), _heaps(i), features)
    console = make_console()
    console.print(table)
    if not any(not i.compile_only for i in infos):
        console.print("no runnable Vulkan device: run scripts/setup.sh (mesa-vulkan-drivers brings lavapipe)")
    for line in missing:
        console.print(f"unavailable target {line}", markup=False)
