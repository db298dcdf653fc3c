"""Compile-only targets: RADV's null device compiles for an RDNA family without the hardware.

RADV reads RADV_FORCE_FAMILY once per process, so each family gets a child process
(`python -m zdsl.runtime.nulldevice`) whose environment names that family and only the radeon
ICD. The parent pickles the shaders to the child's stdin; the child builds each pipeline with
statistics capture (and the disassembly when asked) and pickles the results back.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zdsl import errors
from zdsl.errors import ZdslError
from zdsl.runtime.physical import DeviceInfo

KNOWN = "gfx1200, gfx1201, gfx1150, gfx1151, navi31, navi32, navi33, navi21"
MIN_MESA = 25
TIMEOUT_S = 600


@dataclass(frozen=True)
class ShaderSpec:
    name: str
    spirv: bytes
    bindings: tuple[str, ...]
    push_size: int = 0
    spec: dict = field(default_factory=dict)
    subgroup_size: int | None = None


def radeon_icd() -> Path:
    """Mesa's RADV manifest, from the directories the Vulkan loader searches."""
    data_dirs = os.environ.get("XDG_DATA_DIRS", "/usr/local/share:/usr/share").split(":")
    dirs = [os.environ.get("XDG_CONFIG_HOME", ""), "/etc/xdg", "/etc", *data_dirs, "/usr/local/share", "/usr/share"]
    for d in filter(None, dirs):
        found = sorted(Path(d, "vulkan", "icd.d").glob("radeon_icd*.json"))
        if found:
            return found[0]
    raise ZdslError("Mesa's RADV driver (radeon_icd.json) is not installed, so there are no compile-only "
                    "AMD targets: run scripts/setup.sh (mesa-vulkan-drivers)")


def _child(family: str, request: dict) -> dict:
    icd = str(radeon_icd())
    env = {k: v for k, v in os.environ.items() if k not in ("ZDSL_DEVICE", "VK_DRIVER_FILES", "VK_ADD_DRIVER_FILES")}
    env.update(RADV_FORCE_FAMILY=family, VK_ICD_FILENAMES=icd, VK_DRIVER_FILES=icd)
    try:
        proc = subprocess.run([sys.executable, "-m", "zdsl.runtime.nulldevice"], input=pickle.dumps(request),
                              capture_output=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ZdslError(f"compiling for {family} took over {TIMEOUT_S} s; "
                        "the null-device process was stopped") from None
    try:
        reply = pickle.loads(proc.stdout)
    except Exception:
        lines = [ln for ln in proc.stderr.decode(errors="replace").splitlines() if ln.strip()]
        if any("Unknown family" in ln for ln in lines):
            raise ZdslError(f"RADV does not know the family '{family}'; known: {KNOWN}") from None
        raise ZdslError(f"the {family} null-device process failed (exit {proc.returncode}): "
                        f"{lines[-1] if lines else 'no output'}") from None
    if "error" in reply:
        raise getattr(errors, reply["kind"], ZdslError)(reply["error"])
    return reply


def compile_statistics(family: str, shaders: list[ShaderSpec], isa: bool = False) -> list[dict]:
    """The driver's statistics for each shader compiled for `family` (keys are RADV's names:
    "VGPRs", "SGPRs", "Spilled VGPRs", "Subgroups per SIMD", ...), plus "isa": the "Assembly" text when isa=True."""
    shaders = [asdict(s) if isinstance(s, ShaderSpec) else dict(s) for s in shaders]
    return _child(family, {"family": family, "shaders": shaders, "isa": isa})["results"]


def target_info(family: str) -> DeviceInfo:
    """The DeviceInfo of a compile-only target (index -1: it cannot be opened for running)."""
    info = _child(family, {"family": family, "shaders": [], "isa": False})["info"]
    info.update(index=-1, heaps=tuple(map(tuple, info["heaps"])), features=frozenset(info["features"]),
                compile_only=True)
    return DeviceInfo(**info)


def _serve(request: dict) -> dict:
    from zdsl.runtime.device import open_device

    family = request["family"]
    try:
        dev = open_device(family)
    except errors.NoDeviceError:
        raise ZdslError(f"RADV does not know the family '{family}' (RADV_FORCE_FAMILY); known: {KNOWN}") from None
    with dev:
        mesa = re.search(r"Mesa (\d+)", dev.info.driver_info)
        if not mesa or int(mesa.group(1)) < MIN_MESA:
            raise ZdslError(f"compile-only targets need Mesa {MIN_MESA}+ (found '{dev.info.driver_info}'): "
                            "run scripts/setup.sh (bookworm-backports mesa-vulkan-drivers)")
        results = []
        for s in request["shaders"]:
            pipe = dev.pipeline(s["spirv"], bindings=s["bindings"], push_size=s["push_size"], spec=s["spec"],
                                subgroup_size=s["subgroup_size"], name=s["name"], statistics=True,
                                isa=request["isa"])
            if pipe.statistics is None:
                raise errors.MissingFeatureError(f"{dev.info.name} returned no pipeline statistics")
            stats = dict(pipe.statistics)
            if request["isa"]:
                stats["isa"] = pipe.isa
            results.append(stats)
            pipe.free()
        info = asdict(dev.info)
    info.update(heaps=list(info["heaps"]), features=sorted(info["features"]))
    return {"info": info, "results": results}


def main() -> None:
    """Child side: keep the real stdout for the reply, send anything else printed to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    request = pickle.load(sys.stdin.buffer)
    try:
        reply = _serve(request)
    except ZdslError as e:
        reply = {"error": str(e), "kind": type(e).__name__}
    out.write(pickle.dumps(reply))
    out.flush()


if __name__ == "__main__":
    main()
