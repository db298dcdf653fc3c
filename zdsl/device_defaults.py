"""Command defaults that depend on the device a command runs on.

A default chosen for a big GPU can be more than another device holds (lavapipe binds at most
128 MiB per buffer), or cost it time for nothing (a CPU copies slowly). A default is then
reduced to what the device takes, and the command says so in one line; a value the user gave
is kept, or refused in one line when the device cannot take it.
"""

from __future__ import annotations

from typing import Callable

from zdsl.errors import ZdslError

COPY_MB = 512      # each of the copy kernel's two buffers: far past any GPU's caches
CPU_COPY_MB = 64   # past a CPU's last-level cache: on lavapipe it measures what 128 MiB does, in half the time


def copy_mb(info, given: int | None, say: Callable[[str], None]) -> int:
    """MiB for each of the copy kernel's buffers on device `info`: `given`, or the default
    reduced to what the device binds in one buffer and, on a CPU device, to CPU_COPY_MB."""
    bindable = info.max_storage_buffer_range >> 20
    if given is not None:
        if not 1 <= given <= bindable:
            raise ZdslError(f"--copy-mb {given}: {info.name} binds 1 to {bindable} MiB per buffer; "
                            f"give a size in that range")
        return given
    limits = [(bindable, f"{info.name} binds at most {bindable} MiB per buffer")]
    if info.device_type == "cpu":
        limits.append((CPU_COPY_MB, f"{info.name} is a CPU, where {CPU_COPY_MB} MiB measures its memory in less time"))
    mb, why = min(limits)
    if mb >= COPY_MB:
        return COPY_MB
    say(f"copy buffers {mb} MiB ({why}; default {COPY_MB})")
    return mb
