"""Steps of several tokens of one sequence: a drafted continuation verified in one step.

T tokens at positions p0 … p0 + T − 1 (T ≤ the graph's `step_tokens`) go through the same layer
schedule as a decode step (DecodeGraph.record_layers), one row of the activations a token: the
projections read each weight once for all T rows (dmmv's columns; mul_mm past them), the
experts of all rows run in one launch, each row's attention reads the cache up to its own
position (the rows' K and V are written first), and the delta-net's rows run in order in one
launch a layer, each from the state the row before left. Every row's logits are kept and every row samples, so
token r + 1 of a draft can be checked against the token sampled after row r.

The delta-net state and conv inputs are rings indexed by position (kernels/deltanet.py): the
step leaves the state after each of its positions in a slot of its own, so the sequence can go
on from any position p0 + j, j ≤ T (`DecodeGraph.cut`), with no replay and no copy. KV rows
past it are overwritten before they are read.

Each row's step values (position, length, token, sampler counter) sit in a slot of their own of
`steps`, 256 bytes apart (any Vulkan device binds a slice there), which that row's kernels read
as the decode step's kernels read the graph's `step`.
"""

from __future__ import annotations


import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels import embedding, steps as step_kernels
from zdsl.kernels.steps import STEP_STRIDE, STEP_WORDS
from zdsl.models.qwen35.model.schedule import step_rows


class TokenRows:
    """The steps of 2 … most tokens of DecodeGraph `g`'s sequence, over its buffers `b`
    (buffers.token_buffers) and its prompt chunk's rows."""

    def __init__(self, g, b: dict, most: int):
        self.g, self.most = g, most
        self.steps = b["rows.steps"]
        self.host = g.device.host_buffer(STEP_STRIDE * most, name="rows.steps_host")
        self.host_words = self.host.view(np.uint32).reshape(most, STEP_STRIDE // 4)
        self.rows = step_rows(g.prompt, b, most, g.hp.moe, "rows.")
        self.logits = self.rows.logits
        self._seqs: dict[int, object] = {}  # recorded steps by token count
        self._timed: dict[int, object] = {}  # the same with a timestamp after every command (profile)

    def clear(self, seq) -> None:
        """Record the zeroing of the counters the router expects at 0 (and leaves at 0)."""
        if self.g.hp.moe:
            seq.fill(self.rows.arrivals), seq.fill(self.rows.zero_id)

    def record(self, t: int, timestamps: bool = False):
        """The sequence of a step of t tokens, recorded and not run. It copies the rows' step values
        from the host, runs the layers and every row's draw, then leaves the graph's own step values
        as a decode step of the last token would (its draw, position and length moved on) and
        copies them back."""
        g = self.g
        refuse_penalties(g)
        seq = g.device.sequence(timestamps=timestamps)
        views = embedded_rows(seq, g, self.host, self.steps, t, self.rows.x)
        g.record_layers(seq, [(g, view) for view in views], self.rows)
        hand_back(seq, g, views[-1])
        return seq

    def run(self, tokens: list[int]) -> list[int]:
        """Feed `tokens` at the graph's position in one step; returns the token sampled after each
        (the one after tokens[r] at index r), as decode(tokens[r]) after tokens[:r] would."""
        return self._run(self._recorded(len(tokens)), tokens)

    def _recorded(self, t: int, timestamps: bool = False):
        """The step of t tokens, recorded on its first use (with timestamps: profile's)."""
        if not 1 <= t <= self.most:
            raise ZdslError(f"a step of this graph holds 1 to {self.most} tokens, not {t} (its step_tokens)")
        seqs = self._timed if timestamps else self._seqs
        if t not in seqs:
            seqs[t] = self.record(t, timestamps)
        return seqs[t]

    def _run(self, seq, tokens: list[int]) -> list[int]:
        """Run `seq`, a recorded step of len(tokens) tokens: their step values written first."""
        fed = feed(self.host_words, 0, self.g, tokens)
        seq.run()
        return stepped(self.g, *fed)

    def profile(self, tokens: list[int]) -> list[tuple[str, float]]:
        """Run one step of `tokens` recorded with a GPU timestamp after every command (recorded
        once a length, so that replays keep the GPU busy); returns (label, GPU ms) of each. The
        step advances the sequence as `run` does."""
        seq = self._recorded(len(tokens), timestamps=True)
        self._run(seq, tokens)
        return seq.timings()

    def logits_of(self, t: int) -> np.ndarray:
        """The t rows of logits of the last step of t tokens."""
        return self.logits.read(np.float32, (t, self.g.hp.vocab))

    def forget(self) -> None:
        """Free the recorded steps (recorded again when next run)."""
        for seq in [*self._seqs.values(), *self._timed.values()]:
            seq.free()
        self._seqs.clear()
        self._timed.clear()

    def free(self) -> None:
        self.forget()
        self.host.free()


def refuse_penalties(g) -> None:
    """Refuse graph g in a step of several rows if it samples with repetition penalties: their
    window counts one token a step, and would count drafts that are cut away."""
    if g.sampler.penalties:
        raise ZdslError("a step of several tokens samples without repetition penalties (their window counts one "
                        "token a step); use --repeat-penalty 1 and no presence/frequency penalty")


def feed(words, r: int, g, tokens: list[int]) -> tuple[int, int, int]:
    """Write the step values of `tokens` fed to graph g at its position into rows r … of `words`
    (the host's, a row a token): position, length, token, and each row's draw its own counter, as
    that many steps count. Returns (position, counter, tokens) before the step (`stepped`)."""
    g.check_feed(tokens)
    p0, counter, t = g.position, int(g.step_words[3]), len(tokens)
    rows = words[r:r + t]
    rows[:] = 0
    rows[:, 0] = np.arange(p0, p0 + t)
    rows[:, 1] = rows[:, 0] + 1
    rows[:, 2] = tokens
    rows[:, 3] = np.arange(counter, counter + t)
    return p0, counter, t


def stepped(g, p0: int, counter: int, t: int) -> list[int]:
    """After a step fed g t tokens from position p0 (`feed`): its position moved on, its step values
    the GPU's, and the step one to cut back in (where its states are rings: step_tokens > 1).
    Returns the token sampled after each."""
    g.position += t
    g.synced = True
    g.last_step = (p0, counter, t) if g.step_tokens > 1 else None
    return g.tokens_out.read(np.uint32, (t,), offset=4 * p0).tolist()


def embedded_rows(seq, g, host, steps, t: int, x) -> list:
    """Record t rows' step values copied from `host` into `steps` (STEP_STRIDE apart) and their
    tokens' embeddings (graph g's weights) into rows of x; returns each row's step values."""
    seq.copy(host, steps, STEP_STRIDE * t)
    emb = "token_embd.weight"
    embedding.embed.launch(seq, g.pick, QTYPE=g.qname(emb), table=g.weights[emb], ids=steps, out=x, k=g.hp.hidden,
                           index=2, stride=STEP_STRIDE // 4, rows=t)
    return [steps.slice(STEP_STRIDE * r, 4 * STEP_WORDS) for r in range(t)]


def hand_back(seq, g, last) -> None:
    """Record graph g's own step values becoming those of its last row `last` after a decode step
    (its draw, position and length moved on), and their copy back to the host."""
    seq.copy(last, g.step, 4 * STEP_WORDS)
    step_kernels.advance.launch(seq, g.pick, step=g.step)
    seq.copy(g.step, g.step_host)
