"""Text generation on the GPU decode graph: prompt in, tokens streamed out, honest timings.

The prompt goes in by chunks (prefill.py), the last of which samples the first new token from
its last token's logits; each sampled token is fed back on the GPU, in bursts of steps, and the
host reads only the ids to stream text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from zdsl.cache import cache_dir, discard
from zdsl.errors import ModelError, ZdslError
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes
from zdsl.models.qwen35.file.gguf_file import ModelFile, open_model
from zdsl.models.qwen35.model.buffers import PROMPT_CHUNK
from zdsl.models.qwen35.model.checkpoints import Checkpoints
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.model.speculate import Speculation, SpecStats, Verifier
from zdsl.models.qwen35.model.tokenizer import Tokenizer

DEFAULT_PRESET = "tiny"


def default_model(progress: Callable[[str], None] | None = None) -> ModelFile:
    """The embedded default: a tiny synthetic qwen35moe model, generated on first use, and again
    when the cached file no longer opens."""
    from zdsl.models.qwen35.file import synth

    path = cache_dir("models") / f"synthetic-{DEFAULT_PRESET}.gguf"
    if path.exists():
        try:
            return open_model(path)
        except ModelError as e:
            discard(path, f"does not open ({e})")
    if progress:
        progress(f"generating the default synthetic model at {path}")
    tmp = path.with_suffix(".tmp")
    synth.write(tmp, DEFAULT_PRESET)
    tmp.replace(path)
    return open_model(path)


@dataclass
class Timings:
    prompt_tokens: int = 0        # fed this time
    reused_tokens: int = 0        # already in the caches from before
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    gpu_ms: list[float] = field(default_factory=list)
    spec: SpecStats | None = None  # what speculative decoding did, when on

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def gpu_ms_per_token(self) -> float | None:
        return sum(self.gpu_ms) / len(self.gpu_ms) if self.gpu_ms else None

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
                "prompt_tok_per_s": round(self.prompt_tps, 2),
                "decode_tokens": self.decode_tokens, "decode_tok_per_s": round(self.decode_tps, 2),
                "gpu_ms_per_token": None if self.gpu_ms_per_token is None else round(self.gpu_ms_per_token, 3),
                **({"speculation": self.spec.as_dict()} if self.spec else {})}

    def summary(self) -> str:
        gpu = f", GPU {self.gpu_ms_per_token:.2f} ms/token" if self.gpu_ms_per_token is not None else ""
        reused = f" ({self.reused_tokens} reused)" if self.reused_tokens else ""
        spec = f"; {self.spec.summary()}" if self.spec else ""
        return (f"prompt {self.prompt_tokens} tok{reused} at {self.prompt_tps:.1f} tok/s, "
                f"decode {self.decode_tokens} tok at {self.decode_tps:.1f} tok/s{gpu}{spec}")


class Generator:
    """A model on a device, ready to generate. `context` is what the caches hold: the tokens fed so
    far, which a later `generate(..., keep=True)` whose prompt extends them does not feed again."""

    def __init__(self, model: ModelFile, device, *, n_ctx: int, sampler: SamplerConfig, progress: bool = True,
                 burst: int = 8, say: Callable[[str], None] | None = None, keep: bool = False,
                 kv: KVTypes = KV_DEFAULT, checkpoints: int = 0, chunk: int = PROMPT_CHUNK,
                 weights_of: Generator | None = None, slots: int = 1, warm: bool = False, step_tokens: int = 1,
                 speculate: Speculation | None = None):
        """`keep`: prompts that extend the context continue it (a chat); bursts that run past an
        end-of-turn token are then undone from a checkpoint of the sequence state; `kv`: the
        KV caches' formats (kernels/kvcache.py); `checkpoints` (with keep): bytes of device memory
        for snapshots of the sequence state at each prompt chunk's boundary and at the prompt's
        end (checkpoints.py), from which a prompt that leaves the context part-way resumes;
        `chunk`: the most prompt tokens fed at once (prefill.py); `weights_of`: a Generator of this
        model on this device whose weights this one reads (another sequence, e.g. a server slot);
        `slots`: the sequences that will read this one's weights, itself included; `warm`: compile
        what a run needs before returning; `step_tokens`: the most tokens a step of the sequence
        holds (DecodeGraph); `speculate`: draft tokens and check them in steps of several
        (speculate.py), the graph's steps made large enough for them (the attribute may change
        between generations, within the draft maximum made for)."""
        self.model, self.device = model, device
        self.speculate = speculate.resolved(model.has_mtp) if speculate is not None else None
        self.mtp = None  # the MTP head, made on first use (mtp.py)
        if self.speculate is not None and self.speculate.mtp and not model.has_mtp:
            raise ZdslError(f"{model.path.name} has no MTP head for --spec mtp; use --spec ngram, or a file with "
                            "its head (or --draft-model)")
        if self.speculate is not None:
            step_tokens = max(step_tokens, self.speculate.draft_max + 1)
        self.burst = burst  # decode steps per submission: the host waits once per burst
        self.bursts = Alone()  # what runs them: this graph alone, or with others (engine.Together)
        self.tokenizer = Tokenizer.from_model(model)
        hp = model.hparams
        if n_ctx > hp.context_length and say:
            say(f"context {hp.context_length:,} tokens: {model.path.name} was trained for no more (asked {n_ctx:,})")
        self.n_ctx = min(n_ctx, hp.context_length)
        self.keep = keep
        self.graph = DecodeGraph(model, device, self.n_ctx, sampler, progress=progress, say=say, checkpoint=keep, kv=kv,
                                 chunk=chunk, weights_of=weights_of.graph if weights_of else None, slots=slots,
                                 warm=warm, step_tokens=step_tokens,
                                 mtp=self.speculate is not None and self.speculate.mtp)
        self.context: list[int] = []
        self.checkpoints = Checkpoints(self.graph, checkpoints) if keep and checkpoints else None
        tok = self.tokenizer
        self.stop_ids = frozenset(i for i in [tok.eos_id] + [tok.tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>")
                                                          if t in tok.tokens] if i is not None)

    def shared_prefix(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of `prompt_ids` the context holds (what a resume could reuse,
        from the caches or a checkpoint)."""
        return next((i for i, (a, b) in enumerate(zip(self.context, prompt_ids)) if a != b),
                    min(len(self.context), len(prompt_ids)))

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many of `prompt_ids` the caches already hold (0 unless the context is a proper prefix)."""
        n = len(self.context)
        return n if self.keep and 0 < n < len(prompt_ids) and prompt_ids[:n] == self.context else 0

    def resume(self, prompt_ids: list[int]) -> int:
        """Put the caches at the longest start of `prompt_ids` they hold, or hold a checkpoint of,
        and return its length (0: they start over)."""
        n = self.reusable(prompt_ids)
        if n:
            return n
        if self.checkpoints is None:
            n = 0
            self.graph.reset()
        else:
            shared = self.shared_prefix(prompt_ids)
            self.checkpoints.keep_upto(shared)
            n = self.checkpoints.resume(min(shared, len(prompt_ids) - 1))  # the last token is fed: its logits
        self.context = self.context[:n]
        return n

    def forget(self) -> None:
        """Start the next prompt from nothing (the context and its checkpoints no longer match the
        sequence state)."""
        self.context = []
        if self.checkpoints is not None:
            self.checkpoints.keep_upto(0)

    def use(self, sampler: SamplerConfig) -> None:
        """Sample with `sampler` from the next generate() on (its settings written, or the step
        recorded again where its kernels differ: DecodeGraph.use_sampler). A
        context fed under another penalty window is forgotten: the window is sequence state."""
        g = self.graph
        if sampler == g.sampler:
            return
        if sampler.kept_window(self.n_ctx) != g.sampler.kept_window(self.n_ctx):
            self.forget()
        g.use_sampler(sampler)

    def _prefill(self, tokens: list[int], marks=()) -> int:
        """Feed the prompt's new tokens and return the first generated one: drawn in the last
        chunk from the last token's logits (DecodeGraph.prefill's `sample`). With checkpoints,
        the tokens but the last in pieces that end at multiples of the prompt chunk (where a
        prompt fed whole is cut too), each followed by a snapshot, then the last token's decode
        step: a prompt resumes at most one token short of its end (its last token's logits are
        wanted), so the snapshot one short lets the same prompt again (a retry) feed one token,
        where one at its end would leave it a chunk to feed. `marks`: positions of the context
        to snapshot at too (where the next prompt may part from this one). When the MTP head
        drafts, it catches up on each piece after it ran (mtp.py): the same pieces, so the same
        sums and tokens as plain decoding."""
        g = self.graph
        head = self.mtp if self.speculate is not None and self.speculate.mtp else None  # catches up on each piece
        if self.checkpoints is None:
            if head is None:
                return g.prefill(tokens, sample=True)
            for at in range(0, len(tokens), g.chunk):  # DecodeGraph.prefill's chunks, one at a time
                p0, piece = g.position, tokens[at:at + g.chunk]
                token = g.prefill(piece, sample=at + g.chunk >= len(tokens))
                head.prompt(len(piece), p0)
            return token
        at, last, base = 0, len(tokens) - 1, g.position
        cuts = [m - base for m in marks if 0 < m - base < last]
        while at < last:
            n = min(last - at, g.chunk - g.position % g.chunk, *(c - at for c in cuts if c > at))
            p0 = g.position
            g.prefill(tokens[at:at + n])
            if head is not None:
                head.prompt(n, p0)
            self.checkpoints.save()
            at += n
        token = g.decode(tokens[-1])
        if head is not None:
            head.decoded(tokens[-1], g.position - 1)
        return token

    def generate(self, prompt_ids: list[int], n: int, *, stop: bool = True,
                 pick: Callable[[np.ndarray], int] | None = None, steer=None, bias: dict[int, float] | None = None,
                 marks=()) -> Iterator[int]:
        """Yield up to n generated token ids after `prompt_ids`, ending after a stop token when
        `stop`. The caches start over unless they hold a prefix of the prompt (`keep`). With
        `pick`, each token is pick(its step's logits) rather than the GPU sampler's; with `steer`
        (serve/picker.Steer: `words()` the bitmask of the tokens allowed next, or None for any;
        `take(token)`), the GPU sampler draws among those it allows, a step at a time; `bias` (token
        id → value) is added to the logits the GPU sampler draws from; `marks`:
        positions in the prompt to keep a checkpoint at. Timings of the last call are in
        `self.timings`."""
        if not prompt_ids:
            raise ZdslError("the prompt is empty; give some text with -p")
        if len(prompt_ids) + n > self.n_ctx:
            raise ZdslError(f"the prompt ({len(prompt_ids)} tokens) plus {n} new tokens exceeds the context of "
                            f"{self.n_ctx} tokens; shorten the prompt, lower -n, or raise --ctx")
        g, t = self.graph, Timings()
        self.timings = t
        start = time.perf_counter()
        g.allow(None if steer is None else steer.words())  # the prompt's last step draws the first token
        g.bias_logits(bias)
        if self.speculate is not None and self.speculate.mtp and self.mtp is None:
            from zdsl.models.qwen35.model.mtp import MtpHead

            self.mtp = MtpHead(self.graph)
        reused = self.resume(prompt_ids)
        new = prompt_ids[reused:]
        try:
            token = self._prefill(new, marks)  # in chunks, the last of which samples the first new token
        except BaseException:
            self.forget()  # fed part-way: what the caches hold is known no more
            raise
        self.context = list(prompt_ids)
        t.prompt_tokens, t.reused_tokens, t.prompt_s = len(prompt_ids) - reused, reused, time.perf_counter() - start
        start = time.perf_counter()
        try:
            if pick is not None:
                yield from self._pick(pick, n, stop, t, start)
            elif steer is not None:
                yield from self._steer(steer, token, n, stop, t, start)
            elif self.speculate is None or g.sampler.penalties:  # a window of penalties would count drafts cut away
                yield from self._decode(token, n, stop, t, start)
            else:
                yield from self._speculate(token, n, stop, t, start)
        finally:
            self.bursts.done(g)
        if "timestamps" in self.device.info.features and g.position < self.n_ctx and not self.keep:
            t.gpu_ms.append(sum(ms for _, ms in g.profile()))  # one more timed step; generation is over

    def _decode(self, token: int, n: int, stop: bool, t: Timings, start: float) -> Iterator[int]:
        """The generation's tokens from the first (`token`, the prompt's last step's) on, in bursts."""
        g = self.graph
        produced, last = 0, None
        while produced < n:
            # the first token comes from the last prompt step; the rest in bursts that run on the
            # GPU back to back (each step feeds its own sample to the next)
            if last is None:
                burst = [token]
            else:
                if self.keep:
                    g.checkpoint()
                burst = self.bursts.run(g, min(self.burst, n - produced))
            end = next((i + 1 for i, tok in enumerate(burst) if stop and tok in self.stop_ids), len(burst))
            if last is not None:
                fed = [last] + burst[:-1]  # what the burst's steps fed
                if end < len(burst) and self.keep:
                    g.restore()  # it ran on past the stop token: run only the steps up to it again
                    fed = fed[:end]
                    for tok in fed:
                        g.decode(tok)
                self.context += fed
            burst = burst[:end]
            t.decode_tokens, t.decode_s = produced + len(burst) - 1, time.perf_counter() - start
            for tok in burst:
                produced += 1
                yield tok
            last = burst[-1]
            if stop and last in self.stop_ids:
                break

    def _pick(self, pick, n: int, stop: bool, t: Timings, start: float) -> Iterator[int]:
        """The generation's tokens one step at a time, each picked on the host from the logits the
        step left (the prompt's last step's for the first)."""
        g = self.graph
        for produced in range(n):
            token = pick(g.logits())
            t.decode_tokens, t.decode_s = produced, time.perf_counter() - start
            yield token
            if stop and token in self.stop_ids:
                break
            if produced + 1 < n:  # its step leaves the next token's logits
                g.decode(token)
                self.context.append(token)

    def _steer(self, steer, token: int, n: int, stop: bool, t: Timings, start: float) -> Iterator[int]:
        """The generation's tokens one step at a time, each drawn by the GPU sampler among those
        `steer` allows (its mask written before the step); only the token comes back."""
        g = self.graph
        for produced in range(n):
            if produced:
                g.allow(steer.words())
                self.context.append(token)
                token = g.decode(token)
            steer.take(token)
            t.decode_tokens, t.decode_s = produced, time.perf_counter() - start
            yield token
            if stop and token in self.stop_ids:
                break

    def _speculate(self, token: int, n: int, stop: bool, t: Timings, start: float) -> Iterator[int]:
        """The generation's tokens from the first on, each step feeding the last one with drafts
        after it (speculate.py); what a step rejects or runs past a stop token is cut away, so
        nothing is undone from a checkpoint."""
        t.spec = SpecStats()
        history = self.context + [token]
        drafts = self.speculate.drafts(list(self.context), self.mtp)
        verify = Verifier(self.graph, drafts, self.speculate.draft_max, t.spec)
        stop_ids = self.stop_ids if stop else frozenset()
        produced, said = 0, [token]
        while True:
            t.decode_tokens, t.decode_s = produced + len(said) - 1, time.perf_counter() - start
            for tok in said:
                produced += 1
                yield tok
            if produced == n or said[-1] in stop_ids:
                break
            said = verify.step(history, n - produced, stop_ids)
            self.context.append(history[-1])
            self.context += said[:-1]
            history += said
        if self.keep and self.speculate.mtp:
            drafts.draft(history, 0)  # the head catches up on the last step too: the next turn goes on from it

    def close(self) -> None:
        if self.mtp is not None:
            self.mtp.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.graph.close()


class Alone:
    """A generation's bursts run on its own graph (DecodeGraph.decode_burst)."""

    def run(self, graph, n: int) -> list[int]:
        return graph.decode_burst(n)

    def done(self, graph) -> None:
        pass


def load(path: str | None, device_selector: str | None, *, n_ctx: int, sampler: SamplerConfig,
         progress: bool = True, say: Callable[[str], None] | None = None, keep: bool = False,
         kv: KVTypes = KV_DEFAULT, checkpoints: int = 0, slots: int = 1, step_tokens: int = 1,
         speculate: Speculation | None = None, draft_model: str | None = None) -> Generator:
    """A Generator of the file at `path` (None: the synthetic default) on a device; `draft_model`:
    its MTP head from a file of its own (gguf_file.WithHead)."""
    from zdsl.models.qwen35.file.gguf_file import WithHead
    from zdsl.runtime import open_device

    model = open_model(path) if path is not None else default_model(say)
    if draft_model is not None:
        model = WithHead(model, draft_model)
    device = open_device(device_selector)
    if device.info.compile_only:
        raise ZdslError(f"{device.info.name} is a compile-only target; pick a device that runs code (zdsl devices)")
    try:
        return Generator(model, device, n_ctx=n_ctx, sampler=sampler, progress=progress, say=say, keep=keep, kv=kv,
                         checkpoints=checkpoints, slots=slots, warm=True, step_tokens=step_tokens, speculate=speculate)
    except BaseException:
        device.close()
        raise
