"""A Recorder records sequences on a thread of its own while the caller's thread runs others.

Why: recording a step is Python work, ~0.15 ms a command (a few hundred ms for a batched step
of the 35B-A3B), and the GPU need not wait for it. A server's set of decoding sequences changes
as requests come and go; the step the new set deserves is recorded meanwhile, and the set runs
a step already recorded until it is ready (models/qwen35/model/batch.py). The thread waits on nothing
the caller holds, and the caller's thread spends its time in vkWaitForFences with the GIL
released, so the two overlap on CPython too.

Vulkan asks that command buffers recorded at the same time come from different command pools,
and that a pool be used from one thread at a time: the Recorder's sequences come from a pool of
its own, and everything that touches that pool (recording, ending, freeing) runs on its thread.
Pipelines a recording needs are made under the device's lock.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class Recorder:
    def __init__(self, device, pool):
        self.device, self._pool = device, pool
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="zdsl-record")
        self._recordings: list[Future] = []

    def record(self, fn, *args, **kwargs) -> Future:
        """fn(sequence, *args, **kwargs) on the Recorder's thread, `sequence` a function making a
        Sequence as Device.sequence does; the future's result is the Sequence fn returns, ended:
        ready to run on any thread."""
        def job():
            seq = fn(self._sequence, *args, **kwargs)
            seq.end()
            return seq
        self._recordings = [f for f in self._recordings if not f.done()]
        self._recordings.append(self._thread.submit(job))
        return self._recordings[-1]

    def _sequence(self, timestamps: bool = False):
        return self.device.sequence(timestamps, pool=self._pool)

    def free(self, recorded: Future) -> None:
        """Free what `recorded` (a future of record()) made, once it is done; it must not run again."""
        def job():
            if not recorded.cancelled() and recorded.exception() is None:
                recorded.result().free()
        self._thread.submit(job)

    def wait(self) -> None:
        """Until everything asked of the Recorder so far is done."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        """Drop the recordings not started, finish the one under way and the frees asked for,
        then stop the thread (the device destroys the pool at close)."""
        for recording in self._recordings:
            recording.cancel()
        self._thread.shutdown(wait=True)
