"""The decode graph: one sequence of the model on a device, and the steps that advance it.

Built once from the GGUF: the memory plan checked (buffers.py), every buffer allocated at once,
the weights uploaded as stored (upload.py), and the step recorded (its layers: schedule.py)
into a `Sequence` that is replayed for every token. Per-token values (position, length, the
input token id, the sampler's counter) live in the small host-visible `step` buffer; the sampler
writes the next token id there on the GPU, so the host only reads one integer back per token.
Prompts go in by chunks (prefill.py), drafted tokens by steps of several (token_rows.py),
several sequences step together in a batch (batch.py); checkpoints of the sequence state undo
steps (checkpoints.py).
"""

from __future__ import annotations

import functools
import os
import time
from types import SimpleNamespace

import numpy as np

from zdsl.autotune.database import Database, choose
from zdsl.errors import ZdslError
from zdsl.kernels import embedding, sampling
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes
from zdsl.kernels.steps import STEP_WORDS
from zdsl.models.qwen35.file.gguf_file import ModelFile
from zdsl.models.qwen35.model.batch import MOST as BATCH_MOST
from zdsl.models.qwen35.model.buffers import (PROMPT_CHUNK, SAVED, BufferSpec, Footprint, attn_splits, batch_buffers,
                                              check_fits, checkpointed, decode_buffers, largest, ring_slots)
from zdsl.models.qwen35.model.checkpoints import Snapshot
from zdsl.models.qwen35.model.mtp import MTP, head_buffers
from zdsl.models.qwen35.model.prefill import Prefill
from zdsl.models.qwen35.model.sampler import SamplerConfig, check_vocab
from zdsl.models.qwen35.model.schedule import LayerSchedule, Vector
from zdsl.models.qwen35.model.token_rows import TokenRows
from zdsl.models.qwen35.model.upload import upload_weights
from zdsl.models.qwen35.model.weights import graph_weights


def sampler_kernels(pick, vocab: int, sampler: SamplerConfig):
    """(first pass, draw, first-pass workgroups) of the sampler; `pick(kernel, key, fixed)`
    chooses a variant (autotune.database.choose for a device)."""
    check_vocab(vocab)
    cap, sizes = sampler.kernel_cap, {"n_vocab": vocab}
    first = pick(sampling.sample_candidates, {**sizes, "CAP": cap}, {"CAP": cap})
    fixed = {"CAP": cap, "WG": first.params["WG"], "R": first.params["R"]}
    draw = pick(sampling.sample_draw, {**sizes, **fixed}, fixed)
    return first, draw, first.kernel.groups(first.params, sizes)[0]


def candidate_bytes(sampler: SamplerConfig, groups: int) -> int:
    """Room for the first pass's per-workgroup candidates (logit bits, id)."""
    return 8 * sampler.kernel_cap * groups


def plan_buffers(model: ModelFile, info, n_ctx: int, sampler: SamplerConfig, tuning: Database | None = None,
                 kv: KVTypes = KV_DEFAULT, step_tokens: int = 1):
    """The buffers (buffers.BufferSpec) a DecodeGraph of `model` holds on device `info`, sized before
    one is made: to show and check the memory plan up front."""
    groups = sampler_kernels(lambda kernel, key, fixed: choose(kernel, info, key, db=tuning, **fixed),
                             model.hparams.vocab, sampler)[2]
    return decode_buffers(model.hparams, graph_weights(model), n_ctx, candidate_bytes(sampler, groups), chunk=PROMPT_CHUNK,
                          halves="coopmat" in info.features, kv=kv, step_tokens=step_tokens)


def dry_graph(model, info, n_ctx: int, **options) -> DecodeGraph:
    """A DecodeGraph of `model` (a ModelFile or synth.PresetModel) on a DryDevice of `info`, which
    allocates and runs nothing: its recorded sequences list the launches a device of `info` would
    run (KernelDef.launch records them). `options` as DecodeGraph takes them."""
    from zdsl.runtime.dry import DryDevice

    return DecodeGraph(model, DryDevice(info), n_ctx, progress=False, **options)


def record_launches(model, info, n_ctx: int, sampler: SamplerConfig | None = None, tuning: Database | None = None,
                    kv: KVTypes = KV_DEFAULT):
    """The launches of one decode step of `model` as a device of `info` would run it."""
    return dry_graph(model, info, n_ctx, sampler=sampler, tuning=tuning, kv=kv).seq.launches


def record_chunk_launches(model, info, n_ctx: int, t: int, tuning: Database | None = None,
                          kv: KVTypes = KV_DEFAULT):
    """The launches of one prompt chunk of t tokens (prefill.py)."""
    graph = dry_graph(model, info, n_ctx, tuning=tuning, kv=kv)
    if not 0 < t <= graph.chunk:
        raise ZdslError(f"a prompt chunk holds 1 to {graph.chunk} tokens, not {t}: pick a --prompt in that range")
    return graph.prompt.record(t).launches


def record_step_launches(model, info, n_ctx: int, t: int, tuning: Database | None = None, kv: KVTypes = KV_DEFAULT):
    """The launches of one step of t tokens of one sequence (token_rows.py: a speculative step's
    verification)."""
    if t < 2:
        raise ZdslError(f"a step of several tokens holds 2 or more, not {t} (one token is the decode step)")
    graph = dry_graph(model, info, n_ctx, sampler=SamplerConfig(temperature=0), tuning=tuning, kv=kv, step_tokens=t)
    return graph.token_rows.record(t).launches


class DecodeGraph(LayerSchedule):
    """One sequence of `model` on `device`: its weights (or another graph's), caches, recurrent
    states and step values, the recorded steps that advance it (their layers: schedule.py), and
    the calls that run them."""

    def __init__(self, model: ModelFile, device, n_ctx: int, sampler: SamplerConfig | None = None,
                 progress: bool = True, tuning: Database | None = None, say=None, checkpoint: bool = False,
                 chunk: int = PROMPT_CHUNK, kv: KVTypes = KV_DEFAULT, weights_of: DecodeGraph | None = None,
                 slots: int = 1, warm: bool = False, step_tokens: int = 1, mtp: bool = False):
        """`say(line)` hears the memory plan before anything is allocated; `progress` shows the
        weights' upload; `checkpoint` keeps room to save the sequence state (`checkpoint()`);
        `chunk`: the most prompt tokens `prefill` runs at once (prefill.py); `kv`: the formats of
        the K and V caches (kernels/kvcache.py); `weights_of`: a graph of this model on this device
        whose weights and activations this one uses (one more sequence, run only while that graph
        runs nothing: only what the sequence keeps is allocated; that graph must stay open while
        this one is); `slots`: the sequences that will use this graph's weights, this one
        included, whose buffers and batched step (batch.py) the memory plan holds before anything
        is allocated (a server's --parallel); `warm`: compile every kernel a run needs, and the
        driver's pipelines, before returning (on every core), so that a first prompt's time is not
        compile time; `step_tokens`: the most tokens of the sequence one step may hold
        (`decode_tokens`, token_rows.py; a speculative step's drafts and one), whose recurrent
        states are kept by position so that it can be cut back (`cut`); `mtp`: room for the file's
        MTP head to draft (mtp.py: its KV rows and inputs), in the plan and allocated with the rest."""
        self.weights_of = weights_of
        self.with_mtp = mtp
        self.can_checkpoint = checkpoint
        self.kv_types = KVTypes(*kv)
        self.chunk = max(1, min(chunk, n_ctx))
        self.step_tokens = step_tokens
        self.conv_slots, self.state_slots = ring_slots(model.hparams, step_tokens)
        self.last_step = None  # (position, sampler counter, tokens) of the last step of several tokens
        self.model, self.device, self.hp = model, device, model.hparams
        self.tensors = graph_weights(model)  # what the graph reads, by its names (weights.py)
        self.info = device.info
        if n_ctx < 1:
            raise ZdslError(f"context length must be at least 1, got {n_ctx}")
        self.n_ctx = n_ctx
        self.sampler = sampler or SamplerConfig(temperature=0)
        self.tuning = tuning  # None: the shipped and the user's tuning databases
        self.chosen: dict[tuple[str, str], object] = {}  # (kernel, key) → the variant the step runs
        self._picked: dict[tuple, object] = {}  # the same, by the launch's key and fixed values
        self.cand = None
        self._pick_sampler()
        if not getattr(device, "dry", False):
            available = device.memory_available()
            need = check_fits(lambda n: self.plan(n, slots), n_ctx, available, self.info,
                              f"this model with {slots} sequences" if slots > 1 else "this model",
                              lambda: self._fewer(n_ctx, slots, available))
        if say:
            say(f"memory: {need.line()} on {self.info.name}" + (f" for {slots} sequences" if slots > 1 else ""))
        self._allocate()
        if weights_of is None:
            upload_weights(self.device, self.model, self.tensors, self.weights, progress, say)
        self.seq = self.seq_next = self._timed = None
        self.recorded = 0  # times the step was recorded
        if warm:
            self._prepare_kernels(progress, say)
        else:
            self._record_steps()
        self.reset()

    def buffers(self, n_ctx: int) -> list:
        """Every device buffer the graph holds at a context of n_ctx tokens (buffers.py): without
        the weights and activations where it uses another graph's."""
        specs = decode_buffers(self.hp, self.tensors, n_ctx, self._candidate_bytes(), self.can_checkpoint, self.chunk,
                               "coopmat" in self.device.info.features, self.kv_types, self.step_tokens)
        if self.with_mtp:
            specs += head_buffers(self.hp, n_ctx, self.step_tokens, self.chunk, self.kv_types)
        return specs if self.weights_of is None else [s for s in specs if not self._borrowed(s)]

    def plan(self, n_ctx: int, slots: int = 1) -> list:
        """The buffers at a context of n_ctx tokens of this graph and of slots − 1 more sequences
        that use its weights (weights_of), with the batched step of all of them."""
        mine = self.buffers(n_ctx)
        if slots == 1:
            return mine
        by_name = {s.name: s for s in mine}
        theirs = [s for s in mine if not borrows(s, self.hp, s)]  # what each sequence holds of its own
        more = [BufferSpec(f"{s.name}.{i}", s.nbytes, s.kind) for i in range(1, slots) for s in theirs]
        return mine + more + batch_buffers(self.hp, min(slots, BATCH_MOST), by_name["attn_partials"].nbytes,
                                           by_name["candidates"].nbytes, 256)  # Vulkan's largest offset alignment

    def _fewer(self, n_ctx: int, slots: int, available: int) -> str | None:
        """The --parallel below `slots` whose plan at n_ctx fits `available` bytes, said, or None."""
        k = largest(lambda s: Footprint(self.plan(n_ctx, s)).total <= available, slots - 1) if slots > 1 else 0
        return f"--parallel {k} would fit" if k else None

    def _borrowed(self, spec) -> bool:
        """Whether this graph uses its weights_of graph's buffer for `spec` (borrows)."""
        return borrows(spec, self.hp, self.weights_of.by_name.get(spec.name))

    def _prepare_kernels(self, progress: bool, say=None) -> None:
        """Record the step. Before, compile every kernel variant a run needs (the step's and a
        prompt chunk's, found by recording them on a DryDevice) on every core; after, have the
        driver compile their pipelines (runtime/warm.py), so that a first prompt does not count
        compilation as prompt time."""
        from zdsl.console import Stages
        from zdsl.lang.kernel import compile_variants
        from zdsl.runtime.warm import warm

        start, cores = time.perf_counter(), os.cpu_count() or 1
        dry = dry_graph(self.model, self.info, self.n_ctx, sampler=self.sampler, tuning=self.tuning, kv=self.kv_types,
                        chunk=self.chunk)  # records, compiles nothing
        launches = dry.seq.launches + dry.seq_next.launches + dry.prompt.record(min(2, self.chunk)).launches
        variants = list(dict.fromkeys(l.variant for l in launches))
        with Stages(progress, say) as stage:
            compiled = stage(f"compiling {len(variants)} kernels on {cores} cores", len(variants),
                             lambda advance: compile_variants(variants, advance), lambda n: f"{n} compiled")
            self._record_steps()
            chunk = self.prompt.record(min(2, self.chunk))
            pipes = list(dict.fromkeys([*self.seq.pipelines, *self.seq_next.pipelines, *chunk.pipelines]))
            chunk.free()
            warmed = stage(f"{self.info.name} compiling {len(pipes)} pipelines", len(pipes),
                           lambda advance: warm(self.device, pipes, advance), lambda n: f"{n} compiled")
        if say and (compiled or warmed):
            say(f"kernels ready in {time.perf_counter() - start:.1f} s (compiled on this first run, then cached)")

    def _record_steps(self) -> None:
        self.recorded += 1  # a batch that holds this graph records again too
        self.seq = self._record(from_host=True)   # a step that starts from values the host wrote
        self.seq_next = self._record(from_host=False)  # a step that continues on the GPU

    def use_sampler(self, sampler: SamplerConfig) -> None:
        """Sample with `sampler` from the next step on: its settings written where the recorded
        kernels read them, or the step recorded again where its kernels or penalties' window differ.
        Greedy decoding runs on sampling kernels already recorded (a server's requests mix both)."""
        if self.sampler.kernel_cap > 1:
            sampler = sampler.as_sampling(self.sampler.kernel_cap)
        if sampler.recorded_alike(self.sampler, self.n_ctx):
            self.sampler = sampler
            self.sampler_settings.write(sampler.settings())
        else:
            self.retune(self.tuning, sampler)

    def allow(self, words: np.ndarray | None) -> None:
        """Let the sampler draw only the tokens whose bits `words` set (sampling.mask_of; a
        grammar's mask), from the next step on; None: any token."""
        self.allowed.write(sampling.all_allowed(self.hp.vocab) if words is None else np.asarray(words, np.uint32))

    def bias_logits(self, bias: dict[int, float] | None) -> None:
        """Add `bias` (token id → value; None: nothing) to the logits the sampler draws from, from
        the next step on (a request's logit_bias)."""
        dense = np.zeros(self.hp.vocab, np.float32)
        if bias:
            dense[list(bias)] = list(bias.values())
        self.logit_bias.write(dense)

    def retune(self, tuning: Database | None, sampler: SamplerConfig | None = None) -> None:
        """Record the step again with the variants `tuning` picks (and another sampler, if given);
        weights, caches and states stay. The tuner times candidates in place this way. Prompt
        chunks are recorded again on their next use: their variants and penalty window change too."""
        self._free_steps()
        self.prompt.forget()
        if self.token_rows is not None:
            self.token_rows.forget()
        self.tuning = tuning
        if sampler is not None:
            self.sampler = sampler
        self.chosen.clear()
        self._picked.clear()
        self._pick_sampler()
        self.sampler_settings.write(self.sampler.settings())
        self._record_steps()
        self.synced = False

    # -- set-up ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        """Every buffer of the plan, allocated at once; the weights by their names, the rest as
        attributes."""
        hp, dev = self.hp, self.device
        specs = self.buffers(self.n_ctx)
        b = {spec.name: buf for spec, buf in zip(specs, dev.alloc_many([(s.name, s.nbytes) for s in specs]))}
        self._owned = list(b.values())
        if self.weights_of is not None:
            b.update((name, buf) for name, buf in self.weights_of.by_name.items() if name not in b)
        self.by_name = b
        self.weights = {name: b[name] for name in self.tensors.tensors}
        vector = functools.partial(self.vector_of, b)

        # The host writes position and input token into `step_host`; each step copies it to the
        # device-local `step` that kernels read (host memory is slow to read from a GPU), and
        # copies it back at the end so the host sees the sampled token.
        self.step_host = dev.host_buffer(4 * STEP_WORDS, name="step_host")
        self.step_words = self.step_host.view(np.uint32)
        self.step, self.x, self.logits_out = b["step"], b["x"], b["logits"]  # x: the residual stream
        self.normed = vector("normed")  # rmsnorm(x) · the next consumer's norm weight
        # Each dispatch that counts its workgroups (last_workgroup) leaves its counter at 0.
        self.router_arrivals = b["router_arrivals"]
        self.qg, self.q, self.k, self.v = b["qg"], b["q"], b["k"], b["v"]
        self.attn_o = vector("attn_o")
        self.attn_splits = attn_splits(self.n_ctx, hp.n_kv_heads)
        self.attn_part = b["attn_partials"]
        self.mix, self.z, self.dn_out = b["mix"], b["z"], vector("deltanet_out")
        self.kv = {i: (b[f"k_cache.{i}"], b[f"v_cache.{i}"]) for i in hp.attention_layers}
        self.conv_state = {i: b[f"conv_state.{i}"] for i in hp.deltanet_layers}
        self.ssm_state = {i: b[f"ssm_state.{i}"] for i in hp.deltanet_layers}
        if hp.moe:
            self.router, self.route_ids, self.route_w = b["router_logits"], b["route_ids"], b["route_weights"]
            self.act, self.zero_id = b["expert_act"], b["zero_id"]
        else:
            self.act = b["ffn_act"]
        # the penalties' window: how often each token occurs in it, and its tokens by position
        self.counts, self.penalty_ring = b["token_counts"], b["penalty_ring"]
        self.tokens_out, self.cand = b["tokens_out"], b["candidates"]
        self.sampler_settings = b["sampler_settings"]
        self.sampler_settings.write(self.sampler.settings())
        self.allowed = b["allowed_tokens"]  # the tokens the sampler may draw: a bit each
        self.allow(None)
        self.logit_bias = b["logit_bias"]  # added to the logits the sampler draws from
        self.bias_logits(None)
        self.prompt = Prefill(self, b)
        self.token_rows = TokenRows(self, b, self.step_tokens) if self.step_tokens > 1 else None
        # what a step overwrites that the sequence needs to be undone or resumed (buffers.checkpointed)
        self.sequence_state = {name: b[name] for name in sorted(checkpointed(hp))}
        self._snapshot = self._taken = None
        if self.can_checkpoint:
            pairs = [(live, b[SAVED + name]) for name, live in self.sequence_state.items()]
            self._snapshot = Snapshot.between(dev, pairs)

    @staticmethod
    def vector_of(b: dict, name: str) -> Vector:
        """The activation `name` as projections read it, from the allocated buffers `b`."""
        return Vector(b[name], b[name + "_q8_1"], b[name + "_q8_1_scales"], b.get(name + "_f16"))

    def _candidate_bytes(self) -> int:
        return candidate_bytes(self.sampler, self.sample_groups)

    def _pick_sampler(self) -> None:
        """The sampler's two kernels, and room for the first pass's per-workgroup candidates."""
        self.sample_pass, self.sample_draw, self.sample_groups = sampler_kernels(self.pick, self.hp.vocab,
                                                                                 self.sampler)
        if self.cand is not None and self.cand.nbytes < self._candidate_bytes():  # retuned to more room
            self.cand = self.device.alloc(self._candidate_bytes(), name="candidates")
            self._owned.append(self.cand)

    def reset(self) -> None:
        """Forget the sequence: zero the caches, recurrent states and penalty counts (and the
        arrival counters, which every dispatch leaves at 0 anyway)."""
        seq = self.device.sequence()
        for k, v in self.kv.values():
            seq.fill(k), seq.fill(v)
        for b in list(self.conv_state.values()) + list(self.ssm_state.values()):
            seq.fill(b)
        seq.fill(self.counts)
        seq.fill(self.router_arrivals)
        self.prompt.clear(seq)
        if self.token_rows is not None:
            self.token_rows.clear(seq)
        if self.hp.moe:
            seq.fill(self.zero_id)
        seq.run()
        seq.free()
        self.step_words[:] = 0  # the sampler's counter too: a sequence samples alike from its start
        self.position = 0
        self.synced = False

    # -- recording --------------------------------------------------------------------------
    @property
    def own_rows(self) -> SimpleNamespace:
        """The activations of this graph's own step: one row of each (batch.py has rows of many)."""
        ns = SimpleNamespace(x=self.x, normed=self.normed, qg=self.qg, q=self.q, k=self.k, v=self.v,
                             attn_o=self.attn_o, mix=self.mix, z=self.z, dn_out=self.dn_out, logits=self.logits_out,
                             parts=[self.attn_part], cands=[self.cand], act=self.act)
        if self.hp.moe:
            ns.__dict__.update(router=self.router, arrivals=self.router_arrivals, route_ids=self.route_ids,
                               route_w=self.route_w, zero_id=self.zero_id)
        return ns

    def _record(self, from_host: bool, timestamps: bool = False):
        seq = self.device.sequence(timestamps=timestamps)
        if from_host:
            seq.copy(self.step_host, self.step)
        self.window(seq)
        emb = "token_embd.weight"
        embedding.embed.launch(seq, self.pick, QTYPE=self.qname(emb), table=self.weights[emb], ids=self.step,
                               out=self.x, k=self.hp.hidden, index=2, rows=1)
        self.record_layers(seq, [(self, self.step)], self.own_rows)
        self.finish_step(seq)
        return seq

    # -- running ----------------------------------------------------------------------------
    def decode(self, token: int | None = None) -> int:
        """Run one step at the current position. `token` is the input (a prompt token); None
        feeds the token the GPU sampled last step. Returns the sampled next token id."""
        (self.seq if self.from_host(token) else self.seq_next).run()
        self.synced = True
        self.position += 1
        return int(self.step_words[2])

    def from_host(self, token: int | None = None, n: int = 1) -> bool:
        """Before n steps: refuse them if they overrun the context; where the first must start
        from the host's step values (an input `token` given, or the GPU's values no longer the
        sequence's), write its position, length and token there. Returns whether it did."""
        if self.position + n > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        self.last_step = None
        if token is None and self.synced:
            return False
        w = self.step_words
        w[0], w[1] = self.position, self.position + 1
        if token is not None:
            if not 0 <= token < self.hp.vocab:
                raise ZdslError(f"token id {token} is outside the vocabulary [0, {self.hp.vocab})")
            w[2] = token
        return True

    def check_feed(self, tokens: list[int]) -> None:
        """Before `tokens` go in at the position (a prompt, a step of several tokens): refuse them if
        they overrun the context or leave the vocabulary; what they overwrite can no longer be cut."""
        if self.position + len(tokens) > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        bad = next((t for t in tokens if not 0 <= t < self.hp.vocab), None)
        if bad is not None:
            raise ZdslError(f"token id {bad} is outside the vocabulary [0, {self.hp.vocab})")
        self.last_step = None

    def prefill(self, tokens: list[int], sample: bool = False) -> int | None:
        """Feed prompt tokens at the current position a chunk at a time (prefill.py), leaving the
        caches and states as decode steps of each would, up to rounding (other kernels sum in
        other orders); nothing is sampled, unless `sample`: then the last chunk makes the last
        token's logits and draws from them the token that decode(tokens[-1]) after prefill(
        tokens[:-1]) would return (returned), as one submission."""
        self.check_feed(tokens)
        if sample and not tokens:
            raise ZdslError("a prompt to sample after holds at least one token")
        # the sampler's counter: each position one draw, as if stepped (the GPU counts a sampled one's)
        self.step_words[3] += len(tokens) - (1 if sample else 0)
        return self.prompt.run(tokens, sample)

    def decode_tokens(self, tokens: list[int]) -> list[int]:
        """Run one step of `tokens` (1 to step_tokens of them) at the current position, and return
        the token sampled after each: what decode(tokens[0]), decode(tokens[1]), … would return,
        up to rounding (token_rows.py). Afterwards the sequence may go on from any position the
        step passed through (`cut`)."""
        if self.token_rows is None:
            raise ZdslError("this decode graph steps one token at a time: make it with step_tokens > 1")
        return self.token_rows.run(tokens)

    def cut(self, position: int) -> None:
        """Go on from `position`, one of those the last step of several tokens passed through
        (p0 … p0 + T), as if only the step's first position − p0 tokens had been fed (the rest of
        a draft rejected): the recurrent states are read from the slots that step left there, the
        KV rows past it are overwritten before they are read, the sampler's counter goes back.
        The next step starts from the host (its token given)."""
        if self.last_step is None:
            raise ZdslError("cut() follows a decode_tokens() step, before any other")
        p0, counter, t = self.last_step
        if not p0 <= position <= p0 + t:
            raise ZdslError(f"the last step passed positions {p0} to {p0 + t}, not {position}")
        self.position = position
        self.step_words[3] = counter + position - p0
        self.synced = False

    @property
    def prefill_units(self) -> bool:
        """Whether the prompt's products run on matrix units, reading f16 activations (mma.py)."""
        return self.prompt.coop

    def checkpoint(self) -> None:
        """Save the sequence's state at this position, so that `restore()` undoes the steps run
        after (a burst that ran past an end-of-turn token). The copies run before the next step."""
        if self._snapshot is None:
            raise ZdslError("this decode graph keeps no checkpoint: make it with checkpoint=True")
        self._snapshot.take(self.position, self.step_words)
        self._taken = True

    def restore(self) -> None:
        """Back to the last checkpoint: position, step values (the sampler's counter too) and state."""
        if not self._taken:
            raise ZdslError("restore() without a checkpoint()")
        self._snapshot.restore(self)

    def rewind(self, position: int, words: np.ndarray) -> None:
        """Continue at `position` with the step values `words` (the sampler's counter too), once
        the sequence state of that position is back in place (restore(), checkpoints.py)."""
        self.position = position
        self.step_words[:] = words
        self.synced = False

    def decode_burst(self, n: int) -> list[int]:
        """Run n steps back to back on the GPU, each feeding its sampled token to the next (one
        submission, one wait), and return the n sampled tokens."""
        first, rest = self.position, n
        if self.from_host(n=n):
            self.seq.run()
            rest -= 1
        if rest:
            self.seq_next.run(times=rest)
        self.synced = True
        self.position += n
        return self.tokens_out.read(np.uint32, (n,), offset=4 * first).tolist()

    def seek(self, position: int) -> None:
        """Continue at `position` without computing the tokens before it. For benchmarks only:
        the next steps read `position` rows of (unwritten) KV cache, so they cost what real
        decoding at that depth costs, but their outputs mean nothing."""
        if not 0 <= position < self.n_ctx:
            raise ZdslError(f"position {position} is outside the context of {self.n_ctx} tokens")
        self.position = position
        self.synced = False

    @property
    def dispatches(self) -> int:
        """Commands recorded into one decode step."""
        return self.seq.commands

    def profile(self) -> list[tuple[str, float]]:
        """Run one step of a copy of the graph that records a GPU timestamp after every dispatch,
        at the current position, and return (dispatch label, GPU ms) for each. The step advances
        the state like `decode()` does."""
        if self._timed is None:
            self._timed = self._record(from_host=True, timestamps=True)
        w = self.step_words
        w[0], w[1] = self.position, self.position + 1
        self._timed.run()
        self.position += 1
        return self._timed.timings()

    def logits(self) -> np.ndarray:
        return self.logits_out.read(np.float32, (self.hp.vocab,))

    def _free_steps(self) -> None:
        for seq in (self.seq, self.seq_next, self._timed):
            if seq is not None:
                seq.free()
        self.seq = self.seq_next = self._timed = None

    def close(self) -> None:
        self._free_steps()
        self.prompt.free()
        if self.token_rows is not None:
            self.token_rows.free()
        if self._snapshot is not None:
            self._snapshot.free()   # its twins are the graph's buffers, freed below
        for buf in self._owned:
            buf.free()
        self._owned.clear()
        self.step_host.free()


def borrows(spec, hp, lent) -> bool:
    """Whether a sequence that uses another graph's weights (DecodeGraph weights_of) uses that
    graph's buffer `lent` (of spec's name; None: it has none) for `spec`: the weights, and scratch
    that no step leaves for the next where that graph's is large enough (a longer context or chunk
    needs more); its sequence's step values, sampled tokens and penalty window, and their saved
    twins, are its own."""
    own = {"step", "tokens_out"} | checkpointed(hp)
    return spec.kind == "weights" or (spec.kind == "scratch" and spec.name not in own and not spec.name.startswith(SAVED)
                                      and not spec.name.startswith(MTP) and lent is not None
                                      and lent.nbytes >= spec.nbytes)
