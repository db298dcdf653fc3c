"""The server's generation: slots that each own a sequence, requests queued for a free one, text
streamed out with stop strings applied, and the counters /metrics shows.

A slot is a Generator that keeps its context and checkpoints (generate.py), so a request whose
prompt starts with what the slot last held (a conversation sent again with one more message)
feeds only what is new; a request takes the free slot that holds the longest start of its
prompt. The slots read one copy of the weights. Each slot's generation runs on a thread of its
own, its GPU work one call at a time under one lock for all (a prompt, or a burst of decode
steps), handing each token to the event loop as it comes: the event loop stays free to answer
other requests, and a slot is back for its next burst as soon as its last one is done, not when
the event loop has asked for each of that burst's tokens. The slots that are decoding meet for
each burst (Together): one batched step for all of them (batch.py), so the aggregate speed
grows with the streams. A request that goes away (a client that disconnects) stops its
generation at the next token and frees its slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from zdsl.models.qwen35.model.generate import Generator
from zdsl.models.qwen35.serve.api import Job
from zdsl.models.qwen35.serve.grammar import Constraint
from zdsl.models.qwen35.serve.picker import Choice, Picker, Steer

GATHER_S = 0.02  # how long a burst waits for the other decoding slots' before it runs without them


class Slot:
    """One sequence: a Generator, the thread its GPU work runs on, and the lock all slots' take."""

    def __init__(self, load, gpu: threading.RLock):
        """`load()` makes the Generator (on the slot's thread, as all its GPU work)."""
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="zdsl-slot")
        self.gpu = gpu
        self.gen: Generator = self.submit(load).result()
        self.drafted = self.accepted = 0  # speculative decoding's drafts, since the server started

    def submit(self, fn, *args):
        """fn(*args) on the slot's thread, holding the GPU lock (a future)."""
        def locked():
            with self.gpu:
                return fn(*args)
        return self.thread.submit(locked)

    def stream(self, job: Job, stop: threading.Event, picker: Picker | None = None,
               steer: Steer | None = None) -> asyncio.Queue:
        """The job's generation on the slot's thread: a queue that gets each token id as it comes,
        then None at the end (or the exception that ended it). It ends early once `stop` is set.
        With a `picker`, the host picks each token; with a `steer`, the GPU among those it allows
        (picker.py)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

        def generate() -> None:
            gen, tokens = self.gen, None
            try:
                with self.gpu:
                    gen.use(job.sampler)
                    tokens = gen.generate(job.prompt_ids, job.max_tokens, stop=not job.ignore_eos, pick=picker,
                                          steer=steer, bias=None if picker else job.bias, marks=job.marks)
                while not stop.is_set():
                    with self.gpu:  # a burst's tokens after the first come from the host: no wait
                        token = next(tokens, None)
                    put(token)
                    if token is None:
                        return
            except BaseException as e:
                put(e)
            finally:
                if tokens is not None:
                    with self.gpu:
                        tokens.close()  # ends the generation where it is
        self.thread.submit(generate)
        return out

    def close(self) -> None:
        self.submit(self.gen.close).result()
        self.thread.shutdown()


class Together:
    """The decode bursts of several slots' generations, run as one batched burst (batch.py): a
    slot's burst waits until every slot that is decoding asks for one too, or GATHER_S has
    passed, and whichever comes last runs them all, the shortest asked for. Waiting releases the
    GPU lock, so a slot may feed a prompt meanwhile. Slots beyond the batch's (it holds 8) run
    their bursts alone."""

    def __init__(self, batch, gpu: threading.RLock):
        self.batch = batch
        self.members = {id(g) for g in batch.graphs}
        self.turn = threading.Condition(gpu)
        self.decoding: set = set()  # graphs between their first burst and their generation's end
        self.asked: dict = {}       # graph → steps asked for, not run yet
        self.served: dict = {}      # graph → its tokens, or the error its burst raised

    def run(self, graph, n: int) -> list[int]:
        if id(graph) not in self.members:
            return graph.decode_burst(n)
        with self.turn:
            self.decoding.add(graph)
            self.asked[graph] = n
            deadline = time.monotonic() + GATHER_S
            while graph not in self.served:
                left = deadline - time.monotonic()
                if graph in self.asked and (self.asked.keys() >= self.decoding or left <= 0):
                    self._lead()
                else:
                    self.turn.wait(max(left, 0.0005))
            got = self.served.pop(graph)
        if isinstance(got, BaseException):
            raise got
        return got

    def _lead(self) -> None:
        """Run the bursts asked for (as many as a step holds), the shortest of them long."""
        graphs = list(self.asked)
        n = min(self.asked.pop(g) for g in graphs)
        try:
            tokens = [graphs[0].decode_burst(n)] if len(graphs) == 1 else self.batch.decode(graphs, n)
        except BaseException as e:
            tokens = [e] * len(graphs)
        self.served.update(zip(graphs, tokens))
        self.turn.notify_all()

    def done(self, graph) -> None:
        with self.turn:
            self.decoding.discard(graph)
            self.asked.pop(graph, None)
            self.turn.notify_all()  # the others may all be waiting now


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
    reasoning_tokens: int = 0   # of the completion's: those up to its </think>
    choices: list[Choice] = field(default_factory=list)  # its tokens' log-probabilities, where asked


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

    def __init__(self, slots: list[Slot], together: Together | None = None):
        self.slots, self.together = slots, together
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
    def stop_ids(self) -> frozenset[int]:
        return self.slots[0].gen.stop_ids

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

    def steering(self, job: Job, gen: Generator) -> tuple[Picker | None, Steer | None]:
        """What chooses the job's tokens where the GPU sampler cannot alone: (a host picker, or
        the steer of the GPU's draws, or neither)."""
        if not (job.on_host or job.steered):
            return None, None
        tok = gen.tokenizer
        grammar = None if job.grammar is None else Constraint(job.grammar, tok, gen.stop_ids)
        think_end = tok.tokens.index("</think>") if "</think>" in tok.tokens else None
        budget = job.budget
        if grammar is not None:  # the constrained answer keeps at least half the tokens
            budget = min(job.max_tokens // 2, job.max_tokens if budget is None else budget)
        calls = None if job.calls is None else lambda: Constraint(job.calls, tok, gen.stop_ids)
        steer = Steer(tok.vocab_size, grammar=grammar, thinking=job.thinking, think_end=think_end, budget=budget,
                      stop_ids=gen.stop_ids, calls=calls, piece=tok.piece)
        if not job.on_host:
            return None, steer
        return Picker(job.sampler, job.prompt_ids, gen.n_ctx, steer, top_logprobs=job.top_logprobs,
                      bias=job.bias), None

    async def _generate(self, slot: Slot, job: Job) -> AsyncIterator[Piece]:
        gen = slot.gen
        tok = gen.tokenizer
        stop = threading.Event()
        picker, steer = self.steering(job, gen)
        tokens = slot.stream(job, stop, picker, steer)
        given = 0  # the picker's choices handed out with a piece

        def choices(upto: int) -> list[Choice]:
            nonlocal given
            if picker is None or job.top_logprobs is None:
                return []
            out, given = picker.choices[given:upto], max(given, upto)
            return out

        async def take():
            item = await tokens.get()
            if isinstance(item, BaseException):
                raise item
            return item

        try:
            token = await take()  # after the prompt's ingest
        except BaseException:  # a refused prompt, or a client gone meanwhile
            stop.set()
            raise
        text, produced, finish = StopText(job.stop), 0, "length"
        think_end = tok.tokens.index("</think>") if "</think>" in tok.tokens else None
        thought = None  # tokens up to the </think>, once it came
        try:
            while token is not None:
                produced += 1
                if token == think_end and thought is None:
                    thought = produced
                if token in gen.stop_ids and not job.ignore_eos:
                    finish = "stop"
                    break
                piece = text.add(b"" if token in tok.special_ids else tok.piece(token))
                if text.stopped:
                    finish = "stop"
                    yield Piece(piece, choices=choices(produced))
                    break
                if piece:
                    yield Piece(piece, choices=choices(produced))
                token = await take()
        finally:
            stop.set()  # no await: this may be a cancellation
            self.metrics.add(gen.timings)
            if gen.timings.spec is not None:
                slot.drafted += gen.timings.spec.drafted
                slot.accepted += gen.timings.spec.accepted
        t = gen.timings
        reasoning = thought if thought is not None else produced if job.thinking else 0
        yield Piece("" if text.stopped else text.flush(), finish, len(job.prompt_ids), produced, t.reused_tokens,
                    reasoning, choices(produced - (finish == "stop" and not text.stopped)))

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
        out = "".join(f"# HELP zdsl_{name} {what}\n# TYPE zdsl_{name} {kind}\nzdsl_{name} {value}\n"
                      for name, kind, what, value in rows)
        if any(slot.gen.speculate is not None for slot in self.slots):
            per_slot = [("drafted_tokens_total", "counter", "draft tokens checked", lambda s: s.drafted),
                        ("draft_tokens_accepted_total", "counter", "draft tokens kept", lambda s: s.accepted),
                        ("draft_acceptance", "gauge", "draft tokens kept of those checked",
                         lambda s: s.accepted / s.drafted if s.drafted else 0.0)]
            out += "".join(f"# HELP zdsl_{name} {what}, per slot\n# TYPE zdsl_{name} {kind}\n"
                           + "".join(f'zdsl_{name}{{slot="{i}"}} {value(slot)}\n' for i, slot in enumerate(self.slots))
                           for name, kind, what, value in per_slot)
        return out

    def close(self) -> None:
        if self.together is not None:
            with self.together.turn:
                self.together.batch.close()
        for slot in reversed(self.slots):  # the first holds the weights the others read
            slot.close()
