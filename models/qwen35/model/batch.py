"""Batched decode: one step for several sequences at once, each in a row of the step's activations.

A decode step of one sequence reads every weight for one token and is bound by latency, not by
bandwidth (a quarter of the copy roofline on the H100). Sequences that share weights (DecodeGraphs
made with `weights_of`, a server's slots) can step together: their tokens are the rows of one
step's activations, so each dense projection reads its weight once for all of them (dmmv with a
column a sequence), and what belongs to one sequence runs on its row: attention over its KV cache,
its delta-net state, its experts, its sampler (DecodeGraph.record_layers). Those launches of the
sequences touch disjoint rows and their own caches, so they carry no barrier between them; in a
step of their own (below) the sequences' attention and delta-net go out as one launch a stage,
each sequence's caches, states and step values bound as the pieces of one (schedule.RowBlocks).

A step of all the batch's sequences is recorded once and runs any subset of them: each
sequence's launches are dispatched indirect, their workgroup counts in a buffer the host writes
before each run, 0 for a sequence that sits the step out. So sequences that start and stop
decoding at any time (a server's requests) wait for no recording (a few hundred ms of host time
for the 35B-A3B, more than a burst). The empty launches are not free (on the H100 two of eight
sequences step at 310 tok/s this way, at 547 in a step of their own), so a set of sequences
that steps together a second time gets a step of its own, with direct dispatches, recorded on
another thread (runtime/recorder.py) while the set runs in the step of all rows; the set runs
its own from the first burst after it is ready (the last KEPT of them are kept). From the start,
that thread records the step of all rows, then steps of their own for the first 2, 3, … rows
(the sets a server's slots fill in order), so a server's first requests find them.

A step leaves each sequence as its own decode step would (up to the order of a few sums), and
its sampled token in its step values and tokens_out, so each graph decodes on alone
afterwards, or in another batch.

A mixed step (`step`) feeds some sequences several tokens beside the others' one: a prompt's
next tokens, or a draft to verify, go in with the others' decoding rather than in a step of
their own that stalls them. Each sequence's rows are consecutive and read their step values
from slots the host writes (as token_rows.py does for one sequence); a sequence's tokens run
its delta-net in order in one launch, the sequences' launches side by side. It is recorded once
a shape (which sequences, how many tokens each), with direct dispatches.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from itertools import accumulate

import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels import embedding
from zdsl.kernels.dmmv import dmmv
from zdsl.kernels.steps import STEP_STRIDE, STEP_WORDS
from zdsl.models.qwen35.model.buffers import batch_buffers
from zdsl.models.qwen35.model.schedule import step_rows
from zdsl.models.qwen35.model.token_rows import embedded_rows, feed, hand_back, refuse_penalties, stepped

MOST = max(dmmv.variant_space["COLS"])  # sequences a batch holds: dmmv's columns
OWN_AFTER, KEPT = 2, 8  # the burst of a set of sequences that records its own step; steps kept


class Batch:
    """Decode steps for any subset of `graphs` (at most MOST): DecodeGraphs of one model on one
    device, the first holding the weights and prompt rows the others use (DecodeGraph weights_of).
    Row r of the step's activations (and of `logits`) is graphs[r]'s."""

    def __init__(self, graphs: list, rows: int = 0):
        """`rows`: the most rows a step holds (a mixed step's, `step`); one a sequence unless said."""
        lender = graphs[0]
        if any(g.weights_of is not lender for g in graphs[1:]):
            raise ZdslError("a batch's graphs read the first one's weights: make them with weights_of=graphs[0]")
        n = len(graphs)
        if n > min(MOST, lender.chunk):
            raise ZdslError(f"a batch holds at most {min(MOST, lender.chunk)} sequences, not {n}")
        self.graphs, self.lender = list(graphs), lender
        hp, dev = lender.hp, lender.device
        chunk = lender.prompt  # its rows of the residual stream, norms, projections' outputs
        self.most_rows = rows = rows or n
        if not n <= rows <= lender.chunk:
            raise ZdslError(f"a step of this batch holds {n} to {lender.chunk} rows (its prompt chunk), not {rows}")
        parts, self.cand_bytes = max(g.attn_part.nbytes for g in graphs), max(g.cand.nbytes for g in graphs)
        # the workgroup counts of each sequence's launches, one slot of `stride` bytes a launch
        self.stride = dev.offset_alignment
        specs = batch_buffers(hp, n, parts, self.cand_bytes, self.stride, rows)
        self._owned = dev.alloc_many([("batch." + s.name, s.nbytes) for s in specs])
        b = dict(zip((s.name for s in specs), self._owned))
        self.rows = step_rows(chunk, b, rows, hp.moe)
        self.row_steps = b["steps"]  # a mixed step's rows' step values, from the host's
        self.row_steps_host = dev.host_buffer(self.row_steps.nbytes, name="batch.steps_host")
        self._mixed: OrderedDict[tuple, object] = OrderedDict()  # mixed steps recorded, by shape
        self.logits = self.rows.logits
        if hp.moe:
            seq = dev.sequence()  # the router's counters start at 0 (and every step leaves them there)
            seq.fill(b["router_arrivals"]), seq.fill(b["zero_id"])
            seq.run()
            seq.free()
        self.steps = chunk.steps
        self.counts_gpu = b["counts_gpu"]  # the GPU reads its own memory faster
        self.counts = dev.host_buffer(self.counts_gpu.nbytes, name="batch.counts")  # written by the host, copied there
        self.nbytes = sum(b.nbytes for b in self._owned)  # device memory of its own
        self.launches: list[tuple[int, int, tuple]] = []  # (row, byte offset, workgroups) of each
        self._recorder = dev.recorder()
        self._all_rows: Future | None = None  # the step of all rows (being recorded)
        self._own: OrderedDict[tuple, Future] = OrderedDict()  # a set's step of its own (being recorded)
        self._bursts: dict[tuple, int] = {}  # bursts each set has run
        self._record_ahead()

    def _record_ahead(self) -> None:
        """Ask the recorder for the step of all rows, then for steps of their own of the first
        2, 3, … rows; remember which recordings of the graphs they follow."""
        self._recorded = [g.recorded for g in self.graphs]
        self._all_rows = self._recorder.record(self._record, self.graphs, indirect=True)
        for t in range(2, len(self.graphs) + 1):
            self._own[tuple(range(t))] = self._recorder.record(self._record, self.graphs[:t], indirect=False)

    def decode(self, graphs: list, n: int = 1, tokens: list[int] | None = None) -> list[list[int]]:
        """Run n steps of each of `graphs` (distinct graphs of the batch, in any order) together,
        each step feeding a sequence its own sampled token, the first its token in `tokens` where
        given (as DecodeGraph.decode(token)) or the one it sampled last; returns each one's n
        sampled tokens."""
        rows = self._ready(graphs)
        for r, g in enumerate(graphs):  # every step copies the host's step values in (_record)
            g.from_host(None if tokens is None else tokens[r], n)
        first = [g.position for g in graphs]
        self._step(sorted(rows)).run(times=n)
        for g in graphs:
            g.position += n
            g.synced = True
        return [g.tokens_out.read(np.uint32, (n,), offset=4 * p).tolist() for g, p in zip(graphs, first)]

    def step(self, feeds: list[tuple[object, list[int]]]) -> list[list[int]]:
        """One mixed step: each (graph, tokens) of `feeds` (distinct graphs of the batch) takes its
        tokens at its position, in rows after the previous one's. Returns for each the token
        sampled after each of its tokens: what decode(token) gives for one, decode_tokens(tokens)
        for several (so a graph fed several was made with step_tokens ≥ that many, samples
        without penalties, and may be cut back after, as after decode_tokens)."""
        graphs = [g for g, _ in feeds]
        rows = self._ready(graphs)
        counts = [len(tokens) for _, tokens in feeds]
        if sum(counts) > self.most_rows or min(counts) < 1:
            raise ZdslError(f"a step of this batch holds 1 to {self.most_rows} rows, each sequence's tokens "
                            f"at least one, not {counts} (make the batch with more rows)")
        for g, n in zip(graphs, counts):
            if n > max(1, g.step_tokens):
                raise ZdslError(f"this decode graph steps at most {g.step_tokens} tokens at once, not {n}: make it "
                                "with step_tokens ≥ that")
            refuse_penalties(g)
        words = self.row_steps_host.view(np.uint32).reshape(self.most_rows, STEP_STRIDE // 4)
        fed = [feed(words, r, g, tokens) for r, (g, tokens) in zip(accumulate(counts[:-1], initial=0), feeds)]
        shape = tuple(zip(rows, counts))
        seq = self._mixed.get(shape)
        if seq is None:
            seq = self._mixed[shape] = self._record_mixed(shape)
            while len(self._mixed) > KEPT:
                self._mixed.popitem(last=False)[1].free()
        self._mixed.move_to_end(shape)
        seq.run()
        return [stepped(g, *before) for g, before in zip(graphs, fed)]

    def _record_mixed(self, shape: tuple):
        """The mixed step of `shape` ((batch row of a graph, its tokens), …): the rows' step values
        from the host, the layers, every row's draw; then each graph's own step values as its
        last row's after a decode step (its draw, position and length moved on), back to the host."""
        lender = self.lender
        seq = lender.device.sequence()
        views = embedded_rows(seq, lender, self.row_steps_host, self.row_steps, sum(n for _, n in shape), self.rows.x)
        lender.record_layers(seq, list(zip([self.graphs[row] for row, n in shape for _ in range(n)], views)), self.rows)
        last = -1
        for row, n in shape:
            last += n
            hand_back(seq, self.graphs[row], views[last])
        return seq

    def _rows_of(self, graphs: list) -> list[int]:
        """The batch's rows of `graphs`, in their order; refused unless distinct graphs of it."""
        index = {id(g): i for i, g in enumerate(self.graphs)}
        rows = [index.get(id(g)) for g in graphs]
        if not graphs or None in rows or len(set(rows)) < len(graphs):
            raise ZdslError("a batched step runs distinct graphs of its batch")
        return rows

    def _ready(self, graphs: list) -> list[int]:
        """The batch's rows of `graphs` (_rows_of), refused where a graph's sampler wants more room
        than the batch's; its steps recorded again where a graph's were (its sampler changed)."""
        rows = self._rows_of(graphs)
        if any(g.cand.nbytes > self.cand_bytes for g in graphs):
            raise ZdslError("a graph's sampler was retuned to more candidates than its batch holds: make the "
                            "batch again")
        if self._recorded != [g.recorded for g in self.graphs]:
            self._forget()
            self._record_ahead()
        return rows

    def _step(self, rows: list[int]):
        """The step that runs the sequences of `rows`: their own once recorded, else all rows'
        with the others idle."""
        key = tuple(rows)
        self._bursts[key] = self._bursts.get(key, 0) + 1
        own = self._own.get(key)
        if own is None and self._bursts[key] >= OWN_AFTER:
            own = self._own[key] = self._recorder.record(self._record, [self.graphs[r] for r in rows], indirect=False)
            while len(self._own) > KEPT:
                self._recorder.free(self._own.popitem(last=False)[1])
        if own is not None and own.done():
            self._own.move_to_end(key)
            return own.result()
        all_rows = self._all_rows.result()  # its launches (self.launches) are known once it is recorded
        self._take_part(set(rows))
        return all_rows

    def settle(self) -> None:
        """Until the steps being recorded are ready (what a step runs then no longer depends on timing)."""
        self._recorder.wait()

    def _forget(self) -> None:
        for recorded in [self._all_rows, *self._own.values()]:  # some may be recording still
            if recorded is not None:
                self._recorder.free(recorded)
        for seq in self._mixed.values():
            seq.free()
        self._all_rows = None
        self._own.clear()
        self._mixed.clear()
        self._bursts.clear()

    def _take_part(self, rows: set[int]) -> None:
        """The workgroup counts of the launches of the sequences in `rows`; 0 for the others'."""
        words = self.counts.view(np.uint32)
        for row, at, groups in self.launches:
            words[at // 4:at // 4 + 3] = groups if row in rows else (0, 0, 0)

    def _record(self, sequence, graphs: list, indirect: bool, timestamps: bool = False):
        """One step of `graphs`, row r being graphs[r]'s token, from the step values in their host
        buffers: what the host wrote, or what the last step left (each step copies its values
        back), so one recording serves a first step and the ones after. `indirect`: each
        sequence's launches dispatched indirect (the step of all rows; it rewrites `launches`).
        `sequence(timestamps=)` makes the Sequence: the device's, or a Recorder's on its thread."""
        lender, hp, t = self.lender, self.lender.hp, len(graphs)
        seq = sequence(timestamps=timestamps)
        at_row = (lambda r: _Row(self, seq, r)) if indirect else (lambda r: seq)  # where row r's launches go
        if indirect:
            self.launches = []
            seq.copy(self.counts, self.counts_gpu)
        for r, g in enumerate(graphs):
            seq.copy(g.step_host, g.step)
            seq.copy(g.step, self.steps, 4 * STEP_WORDS, dst_offset=4 * STEP_WORDS * r)
        for r, g in enumerate(graphs):
            g.window(at_row(r))
        emb = "token_embd.weight"
        embedding.embed.launch(seq, lender.pick, QTYPE=lender.qname(emb), table=lender.weights[emb], ids=self.steps,
                               out=self.rows.x, k=hp.hidden, index=2, stride=STEP_WORDS, rows=t)
        lender.record_layers(seq, [(g, g.step) for g in graphs], self.rows, at_row if indirect else None)
        for r, g in enumerate(graphs):
            g.finish_step(at_row(r))  # its copy of the step values back runs for every row: as they were, if idle
        return seq

    def _slot(self, row: int, groups: tuple) -> int:
        at = self.stride * len(self.launches)
        if at + 12 > self.counts.nbytes:
            raise ZdslError("a batched step has more launches than its counts buffer holds")  # a bug, not input
        self.launches.append((row, at, groups))
        return at

    def profile(self, graphs: list) -> list[tuple[str, float]]:
        """Run one step of `graphs` recorded with a GPU timestamp after every command; returns
        (label, GPU ms) of each. The step advances the sequences as decode() does."""
        for g in graphs:
            g.from_host()
        rows = sorted(self._rows_of(graphs))
        seq = self._record(self.lender.device.sequence, [self.graphs[r] for r in rows], indirect=False, timestamps=True)
        try:
            seq.run()
            for g in graphs:
                g.position += 1
                g.synced = True
            return seq.timings()
        finally:
            seq.free()

    def close(self) -> None:
        self._forget()
        self._recorder.close()
        for buf in self._owned:
            buf.free()
        self._owned = []
        self.counts.free()
        self.row_steps_host.free()


class _Row:
    """One sequence's view of the step being recorded: its dispatches go out indirect, their
    workgroup counts in the batch's counts buffer (0 while it sits a step out); everything
    else is the sequence's."""

    def __init__(self, batch: Batch, seq, row: int):
        self._batch, self._seq, self._row = batch, seq, row

    def __getattr__(self, name):
        return getattr(self._seq, name)

    def dispatch(self, pipe, groups, buffers, push: bytes = b"", label: str = "") -> None:
        at = self._batch._slot(self._row, tuple(groups))
        self._seq.dispatch_indirect(pipe, self._batch.counts_gpu.slice(at, 12), buffers, push, label)
