"""A run's pipelines compiled by the driver before the run, on every core, each once.

Most drivers compile a pipeline when it is made. Lavapipe compiles it at its first dispatch, on
the queue's one thread, and keeps the machine code in Mesa's shader cache on disk: the tiny
model's first run spent over a minute there, one kernel after the other, on a 2-core machine. A
dispatch of no workgroups compiles a pipeline without running anything, so `warm` makes such
dispatches on one device per core, side by side, and the run's own device then finds every
pipeline in that cache. Each pipeline compiled is noted in zdsl's cache, so a later run skips it.

Every sequence's first run comes through here too (sequence.py). Processes that share the
caches (a test run's workers, a server beside a bench) take a pipeline's lock while one of them
compiles it: another one wanting it compiles others meanwhile, then finds it noted, where it
would have compiled it a second time side by side.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Callable

from zdsl.cache import cache_dir, content_key, write_atomic

NO_GROUPS = (0, 0, 0)


def compiles_at_first_dispatch(info) -> bool:
    """Whether the device's driver compiles a pipeline when it first runs it (lavapipe)."""
    return info.device_type == "cpu"


def _mesa_cache_kept() -> bool:
    return os.environ.get("MESA_SHADER_CACHE_DISABLE", "").lower() not in ("1", "true", "yes")


def _mark(device, pipe) -> Path:
    """The file whose presence says the driver compiled `pipe` before (on this device's driver)."""
    s = pipe.source
    key = content_key(s["spirv"], repr(sorted(s["spec"].items())), repr(s["subgroup_size"]), repr(s["arrays"]))
    return cache_dir("compiled", content_key(device.info.identity)) / key


class _Claim:
    """The lock on one pipeline's compile among processes (flock on a file beside its mark). The
    mark, looked at again once the lock is held, decides; the lock file goes once the mark is
    written (a process that opened it before waits on it, then finds the mark)."""

    def __init__(self, mark: Path, wait: bool):
        self.path = mark.with_name(mark.name + ".lock")
        self.file = open(self.path, "ab")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self.file.close()
            self.file = None

    def release(self, noted: bool) -> None:
        if noted:
            self.path.unlink(missing_ok=True)
        self.file.close()  # closing drops the lock


def warm(device, pipelines, progress: Callable[[int], None] | None = None) -> int:
    """Have the driver compile `pipelines` (made on `device`) now, where it would at their first
    dispatch; returns how many it compiled (0: all were compiled before, here or by a process
    sharing the caches, or the driver compiles at creation). `progress(n)` hears each one done."""
    if not compiles_at_first_dispatch(device.info):
        return 0
    marks = {}  # the pipelines to compile, each with its mark
    for p in dict.fromkeys(pipelines):
        if not p.compiled:
            mark = _mark(device, p)
            if mark.exists():
                p.compiled = True
            else:
                marks[p] = mark
    todo = list(marks)
    if not todo:
        return 0
    kept = _mesa_cache_kept()  # without it, only a dispatch on the run's own device counts
    workers = min(os.cpu_count() or 1, len(todo)) if kept else 1
    queue = sorted(todo, key=lambda p: -len(p.source["spirv"]))  # the largest first: no long one left for last
    waited: set = set()  # pipelines another process held: waited for at the second go
    lock = threading.Lock()
    errors: list[BaseException] = []
    compiled = [0]

    def next_pipe():
        with lock:
            return queue.pop(0) if queue and not errors else None

    def compile_one(dev, pipe, own: bool) -> None:
        claim = None
        if kept:
            with lock:
                wait = pipe in waited
            claim = _Claim(marks[pipe], wait)
            if claim.file is None:  # another process compiles it: others first, then wait for it
                with lock:
                    waited.add(pipe)
                    queue.append(pipe)
                return
        noted = False
        try:
            if kept and marks[pipe].exists():  # the process that held the lock compiled it
                noted = True
            else:
                twin = pipe if own else pipe.on(dev)
                seq = dev.sequence()
                seq.warmed = True
                try:
                    seq.dispatch(twin, NO_GROUPS, [dev.placeholder] * len(twin.bindings), bytes(twin.push_size))
                    seq.run()
                finally:
                    seq.free()
                if kept:
                    write_atomic(marks[pipe], b"")
                    noted = True
                with lock:
                    compiled[0] += 1
            pipe.compiled = True
        finally:
            if claim is not None:
                claim.release(noted)
        if progress:
            progress(1)

    def compile_share(own: bool) -> None:
        from zdsl.runtime.device import open_device

        dev = device if own else open_device(device.info.index)
        try:
            while (pipe := next_pipe()) is not None:
                compile_one(dev, pipe, own)
        except BaseException as e:  # raised again on the caller's thread
            errors.append(e)
        finally:
            if not own:
                dev.close()

    threads = [threading.Thread(target=compile_share, args=(i == 0,), name="zdsl-warm") for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return compiled[0]
