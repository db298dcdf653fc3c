"""The server's generation: slots that each own a sequence, requests queued for a free one, text
streamed out with stop strings applied, and the counters /metrics shows.

A slot is a Generator that keeps its context and checkpoints (generate.py), so a request whose
prompt starts with what the slot last held (a conversation sent again with one more message)
feeds only what is new; a request takes the free slot that holds the longest start of its
prompt. The slots read one copy of the weights. All GPU work runs on one thread, one call at a
time (a prompt, or a burst of decode steps): the event loop stays free to answer other requests,
the calls of one request run in the order they were made, and the requests of several slots
take turns burst by burst, so their streams advance together (one sequence a step: the
aggregate speed is one sequence's). A request that goes away (a client that disconnects) stops
its generation at the next token and frees its slot.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from zdsl.models.qwen35.api import Job
from zdsl.models.qwen35.generate import Generator


class Slot:
    """One sequence: a Generator, and the thread the GPU work of every slot runs on."""

    def __init__(self, load, thread: ThreadPoolExecutor):
        """`load()` makes the Generator (on that thread, as all its GPU work)."""
        self.thread = thread
        self.gen: Generator = self.thread.submit(load).result()

    def close(self) -> None:
        self.thread.submit(self.gen.close).result()


@dataclass
class Metrics:
    """Totals since the server started (the rates are their ratios)."""

    requests: int = 0
    prompt_tokens: int = 0      # fed
    reused_tokens: int = 0      # already in a slot's caches, or resumed from a checkpoint
    prompt_s: float = 0.0
    predicted_tokens: int = 0
    predicted_s: float = 0.0

    def add(self, timings) -> None:
        self.prompt_tokens += timings.prompt_tokens
        self.reused_tokens += timings.reused_tokens
        self.prompt_s += timings.prompt_s
        self.predicted_tokens += timings.decode_tokens
        self.predicted_s += timings.decode_s


@dataclass
class Piece:
    """Text generated since the last piece; the last piece has `finish` ("stop" or "length") and
    the counts of the request's usage."""

    text: str
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class StopText:
    """The text of the tokens so far, released up to what cannot yet be the start of a stop string
    (or an incomplete UTF-8 character); cut before the first stop string found."""

    stops: list[str]
    data: bytearray = field(default_factory=bytearray)
    sent: int = 0
    stopped: bool = False

    def add(self, piece: bytes) -> str:
        self.data += piece
        text = self.data.decode("utf-8", errors="replace")
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        cut = min((i for i in (text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        end = len(text) - held
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._release(text, end)

    def flush(self) -> str:
        return self._release(self.data.decode("utf-8", errors="replace"), None)

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self.sent)
        out, self.sent = text[self.sent:end], end
        return out


class Engine:
    """Slots and the queue of requests waiting for one."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.idle = list(slots)
        self.waiters: deque[asyncio.Future] = deque()  # requests waiting for a slot, oldest first
        self.waiting = 0
        self.busy = 0
        self.metrics = Metrics()
        self.started = time.time()

    @property
    def tokenizer(self):
        return self.slots[0].gen.tokenizer

    @property
    def n_ctx(self) -> int:
        return self.slots[0].gen.n_ctx

    async def run(self, job: Job) -> AsyncIterator[Piece]:
        """The job's text, piece by piece, once a slot is free. Stopping the iteration (a client
        gone) stops the generation; its slot goes back at once."""
        slot = await self._take(job.prompt_ids)
        self.busy += 1
        self.metrics.requests += 1
        try:
            async for piece in self._generate(slot, job):
                yield piece
        finally:
            self.busy -= 1
            self._give_back(slot)  # the thread runs what this job left queued before the next job's calls

    async def _take(self, prompt_ids: list[int]) -> Slot:
        """A free slot, once there is one: the one whose context shares most with the prompt."""
        while not self.idle:
            woken = asyncio.get_running_loop().create_future()
            self.waiters.append(woken)
            self.waiting += 1
            try:
                await woken
            except asyncio.CancelledError:
                if woken.done() and not woken.cancelled():
                    self._wake()  # woken, then gone: the next in line takes the turn
                raise
            finally:
                self.waiting -= 1
        # an estimate (the GPU thread may still be closing a slot's last request): resume() decides
        slot = max(self.idle, key=lambda s: s.gen.shared_prefix(prompt_ids))
        self.idle.remove(slot)
        return slot

    def _give_back(self, slot: Slot) -> None:
        self.idle.append(slot)
        self._wake()

    def _wake(self) -> None:
        while self.waiters:
            woken = self.waiters.popleft()
            if not woken.done():
                woken.set_result(None)
                return

    async def _generate(self, slot: Slot, job: Job) -> AsyncIterator[Piece]:
        loop, gen = asyncio.get_running_loop(), slot.gen
        tok = gen.tokenizer

        def start():
            gen.use(job.sampler)
            tokens = gen.generate(job.prompt_ids, job.max_tokens)
            return tokens, next(tokens)   # the prompt's ingest and the first token

        tokens, token = await loop.run_in_executor(slot.thread, start)
        text, produced, finish = StopText(job.stop), 0, "length"
        try:
            while token is not None:
                produced += 1
                if token in gen.stop_ids:
                    finish = "stop"
                    break
                piece = text.add(b"" if token in tok.special_ids else tok.piece(token))
                if text.stopped:
                    finish = "stop"
                    yield Piece(piece)
                    break
                if piece:
                    yield Piece(piece)
                token = await loop.run_in_executor(slot.thread, next, tokens, None)
        finally:
            slot.thread.submit(tokens.close)  # ends the generation where it is (no await: it may be cancelled)
            self.metrics.add(gen.timings)
        t = gen.timings
        yield Piece("" if text.stopped else text.flush(), finish, len(job.prompt_ids), produced, t.reused_tokens)

    def prometheus(self) -> str:
        """The metrics in Prometheus's text format."""
        m = self.metrics
        rows = [("requests_total", "counter", "requests that got a slot", m.requests),
                ("requests_processing", "gauge", "requests generating now", self.busy),
                ("requests_waiting", "gauge", "requests queued for a slot", self.waiting),
                ("prompt_tokens_total", "counter", "prompt tokens fed", m.prompt_tokens),
                ("prompt_tokens_reused_total", "counter", "prompt tokens a slot held already", m.reused_tokens),
                ("prompt_seconds_total", "counter", "seconds spent feeding prompts", m.prompt_s),
                ("tokens_predicted_total", "counter", "tokens generated", m.predicted_tokens),
                ("tokens_predicted_seconds_total", "counter", "seconds spent generating", m.predicted_s),
                ("prompt_tokens_per_second", "gauge", "prompt tokens fed per second, overall",
                 m.prompt_tokens / m.prompt_s if m.prompt_s else 0.0),
                ("predicted_tokens_per_second", "gauge", "tokens generated per second, overall",
                 m.predicted_tokens / m.predicted_s if m.predicted_s else 0.0)]
        return "".join(f"# HELP zdsl_{name} {what}\n# TYPE zdsl_{name} {kind}\nzdsl_{name} {value}\n"
                       for name, kind, what, value in rows)

    def close(self) -> None:
        for slot in reversed(self.slots):  # the first holds the weights the others read
            slot.close()
        self.slots[0].thread.shutdown()
