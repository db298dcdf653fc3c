"""The tuning database: which variant of a kernel to run for a shape on a device.

Entries are typed JSON records — never pickles or Python hashes — keyed by the device's
identity (vendor:device id:driver name), its driver version, the kernel, and the shape:
    {"device": "10de:2330:NVIDIA", "device_name": "NVIDIA H100 80GB HBM3", "driver": "580.95.5",
     "kernel": "dmmv", "shape": {"QTYPE": "q4_k", "k": 2048, "m": 8192},
     "params": {"ROWS": 2, "WG": 64}, "us": 41.2, "method": "measured"}
Shipped entries live beside this file (`*.json`), the user's own under the zdsl cache
(`zdsl tune` writes there). A lookup falls back from the exact driver to any driver of the same
device, then to an entry for the device's RADV family (modelled on a compile-only target: the
null device's identity is no real card's), then to the kernel's defaults for the device's
subgroup size.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from zdsl.cache import cache_dir, warn, write_atomic

SHIPPED = Path(__file__).parent


@dataclass(frozen=True)
class Entry:
    device: str
    device_name: str
    driver: str
    kernel: str
    shape: dict
    params: dict
    us: float | None = None
    method: str = "measured"  # or "modelled" (compile-only targets)
    figures: dict = field(default_factory=dict)
    family: str = ""  # RADV family (gfx1201, navi31, ...) of the device, where it has one

    def key(self) -> tuple:
        return (self.device, self.driver, self.kernel, shape_key(self.shape))


def shape_key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True, separators=(",", ":"))


def device_key(info) -> tuple[str, str]:
    """(identity without driver version, driver version) of a runtime DeviceInfo."""
    parts = info.identity.split(":")
    return ":".join(parts[:3]), ":".join(parts[3:])


def family(info) -> str:
    """The RADV family in a device's name ("AMD Radeon RX 9070 XT (RADV GFX1201)" → "gfx1201"),
    or "" for other drivers."""
    found = re.search(r"\(RADV (\w+)\)", info.name)
    return found.group(1).lower() if found else ""


def _load(path: Path) -> list[Entry]:
    """The file's entries; a file that does not parse, or entries that are malformed, are named
    in a warning and left out (the file stays: `zdsl tune` rewrites it whole when it next saves)."""
    try:
        records = json.loads(path.read_text())["entries"]
        if not isinstance(records, list):
            raise TypeError
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not a JSON object with a list of entries"
        warn(f"tuning file {path} cannot be read ({why}); it is ignored")
        return []
    entries = [e for e in map(_entry, records) if e is not None]
    if len(entries) < len(records):
        warn(f"tuning file {path} has {len(records) - len(entries)} malformed entries; they are ignored")
    return entries


def _entry(record) -> Entry | None:
    """The Entry a record holds, or None when it is not one (fields missing, of the wrong kinds)."""
    try:
        e = Entry(**record)
    except TypeError:
        return None
    strings = (e.device, e.device_name, e.driver, e.kernel, e.method, e.family)
    ok = (all(isinstance(v, str) for v in strings) and isinstance(e.shape, dict) and isinstance(e.params, dict)
          and isinstance(e.figures, dict) and (e.us is None or isinstance(e.us, (int, float))))
    return e if ok else None


class Database:
    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.entries: dict[tuple, Entry] = {}
        for p in paths:
            for e in _load(p):
                self.entries[e.key()] = e

    @classmethod
    def of(cls, entries) -> "Database":
        """An in-memory database holding `entries` (later ones win), backed by no file."""
        db = cls([])
        for e in entries:
            db.add(e)
        return db

    def lookup(self, info, kernel: str, shape: dict) -> Entry | None:
        device, driver = device_key(info)
        skey = shape_key(shape)
        exact = self.entries.get((device, driver, kernel, skey))
        if exact:
            return exact
        same_device = [e for k, e in self.entries.items() if k[0] == device and k[2] == kernel and k[3] == skey]
        if same_device:
            return same_device[-1]
        fam = family(info)
        same_family = [e for k, e in self.entries.items() if fam and e.family == fam and k[2] == kernel and k[3] == skey]
        return same_family[-1] if same_family else None

    def add(self, entry: Entry) -> None:
        self.entries[entry.key()] = entry

    def save(self, path: Path) -> None:
        """Write every entry of this database to `path` (one file per device: open it alone)."""
        entries = sorted((asdict(e) for e in self.entries.values()),
                         key=lambda e: (e["device"], e["driver"], e["kernel"], shape_key(e["shape"])))
        write_atomic(path, (json.dumps({"entries": entries}, indent=1, sort_keys=True) + "\n").encode())


def _file_name(name: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return f"{slug}.json"


def user_path(info) -> Path:
    return cache_dir("tuning") / _file_name(info.name)


@cache
def database() -> Database:
    return Database(sorted(SHIPPED.glob("*.json")) + sorted(cache_dir("tuning").glob("*.json")))


def choose(kernel, info, shape: dict, db: Database | None = None, **fixed):
    """The variant of `kernel` to run on device `info` for `shape`: the tuned entry if the
    database (`db`, or the shipped and user files) has one; for a launch of several rows (a step
    of several tokens or streams) not tuned apart, the one-row entry (the decode step's choice,
    which runs any row count); else the kernel's defaults at the device's subgroup size (on a CPU
    device, its `cpu` defaults: the variants that compile soonest)."""
    return kernel.specialize(**chosen_params(kernel, info, shape, db, **fixed))


def chosen_params(kernel, info, shape: dict, db: Database | None = None, own_entry: bool = True, **fixed) -> dict:
    """The parameters `choose()` gives; with `own_entry=False`, those it would give if `shape` had
    no entry of its own (the tuner's baseline: what runs untuned)."""
    params = dict(fixed)
    if kernel.subgroup and kernel.subgroup not in params:
        params[kernel.subgroup] = info.subgroup_size
    db = db if db is not None else database()
    entry = db.lookup(info, kernel.name, {**shape, **fixed}) if own_entry else None
    if entry is None and shape.get("rows", 1) > 1:
        entry = db.lookup(info, kernel.name, {**shape, **fixed, "rows": 1})
    if entry is not None:
        known = {p.name for p in kernel.params if p.kind in ("const", "spec")}
        # a parameter the kernel no longer has (an entry older than the kernel) is ignored
        params.update({k: v for k, v in entry.params.items() if k not in fixed and k in known})
    elif info.device_type == "cpu":
        params.update({k: v for k, v in kernel.cpu.items() if k not in fixed})
    return accepted_params(kernel, params)


def accepted_params(kernel, params: dict) -> dict:
    """params, or where the kernel's constraint refuses its defaults under them, the first of its
    declared choices for the other parameters that it accepts (deltanet_gated_norm's default
    32-invocation workgroup on a device of 64-wide subgroups)."""
    accepts = kernel.constraint or (lambda v: True)
    if accepts(SimpleNamespace(**kernel.complete(params))):
        return params
    free = [k for k in kernel.variant_space if k not in params]
    for values in itertools.product(*(kernel.variant_space[k] for k in free)):
        choice = {**params, **dict(zip(free, values))}
        if accepts(SimpleNamespace(**kernel.complete(choice))):
            return choice
    return params
