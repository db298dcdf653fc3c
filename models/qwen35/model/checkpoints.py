"""Snapshots of a sequence's recurrent state at positions of its prompts, so that a prompt that
shares only part of what the caches hold restarts from the nearest snapshot, not from zero.

The KV cache needs no copy: its rows below a position are what that position's tokens wrote, and
rows past it are written before they are read. The delta-net's state and conv ring and the
penalties' window (DecodeGraph.sequence_state) are overwritten by every step and cannot be
rebuilt from the KV cache, so they are copied, on the device, into a buffer of their own. The
snapshots are an LRU under a byte budget; one is valid while the caches hold the tokens it was
taken after, so the owner drops those past the point where its history changes (`keep_upto`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

ALIGN = 256  # each state buffer's copy starts at a multiple of this in a snapshot's buffer


@dataclass
class Snapshot:
    """A copy of a sequence's state: recorded copies of the live buffers into their saved twins
    and back, the position it was taken at and the step values then (the sampler's counter).
    Checkpoints keeps many; DecodeGraph.checkpoint one, in buffers of its memory plan."""

    save: object    # recorded copies: live state -> saved twins
    load: object    # and back
    buffer: object = None   # the one buffer holding the twins, where the snapshot owns it
    position: int = 0
    words: np.ndarray | None = None

    @classmethod
    def between(cls, device, pairs, buffer=None) -> Snapshot:
        """A snapshot of the (live, saved) buffer pairs (`buffer`: what the saved ones lie in,
        freed with the snapshot)."""
        save, load = device.sequence(), device.sequence()
        for live, saved in pairs:
            save.copy(live, saved)
            load.copy(saved, live)
        return cls(save, load, buffer)

    def take(self, position: int, words: np.ndarray) -> None:
        """Copy the state at `position` (the copies run before the graph's next step)."""
        self.save.run(wait=False)
        self.position, self.words = position, words.copy()

    def restore(self, g) -> None:
        """Put graph `g`'s state back as it was taken, at its position and step values."""
        self.load.run()
        g.rewind(self.position, self.words)

    def free(self) -> None:
        self.save.free()
        self.load.free()
        if self.buffer is not None:
            self.buffer.free()


class Checkpoints:
    """Snapshots of graph `g`'s sequence state by position, at most `budget` bytes of them."""

    def __init__(self, g, budget: int):
        self.g = g
        self.live = list(g.sequence_state.values())
        self.offsets, at = [], 0
        for buf in self.live:
            self.offsets.append(at)
            at += -(-buf.nbytes // ALIGN) * ALIGN
        self.nbytes = at
        self.capacity = budget // self.nbytes
        self._by_position: OrderedDict[int, Snapshot] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._by_position)

    @property
    def positions(self) -> list[int]:
        return sorted(self._by_position)

    def save(self) -> None:
        """Snapshot the state at the graph's position (the copies run before its next step); the
        least recently used snapshot makes room when the budget is full."""
        p = self.g.position
        if not self.capacity or p == 0:
            return
        if p in self._by_position:  # the same tokens up to p (keep_upto drops the others)
            self._by_position.move_to_end(p)
            return
        snap = self._by_position.popitem(last=False)[1] if len(self) >= self.capacity else self._new()
        snap.take(p, self.g.step_words)
        self._by_position[p] = snap

    def resume(self, limit: int) -> int:
        """Put the graph back at the latest snapshot at or before `limit` and return its position
        (0, after a reset, when there is none)."""
        g = self.g
        p = max((q for q in self._by_position if q <= limit), default=0)
        if not p:
            g.reset()
            return 0
        self._by_position.move_to_end(p)
        self._by_position[p].restore(g)
        return p

    def keep_upto(self, position: int) -> None:
        """Drop the snapshots past `position`: the tokens before them are about to change."""
        for p in [q for q in self._by_position if q > position]:
            self._by_position.pop(p).free()

    def _new(self) -> Snapshot:
        buffer = self.g.device.alloc(self.nbytes, name="checkpoint")
        pairs = [(live, buffer.slice(at, live.nbytes)) for live, at in zip(self.live, self.offsets)]
        return Snapshot.between(self.g.device, pairs, buffer)

    def close(self) -> None:
        self.keep_upto(-1)
