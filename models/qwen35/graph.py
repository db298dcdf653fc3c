"""The decode graph: one token through the whole model as one recorded command sequence.

Built once from the GGUF: weights are uploaded as stored (quantized blocks), every activation,
cache and recurrent state gets its buffer, and the step is recorded into a `Sequence` that is
replayed for every token. Per-token values (position, length, the input token id, the sampler's
counter) live in the small host-visible `step` buffer; the sampler writes the next token id there
on the GPU, so the host only reads one integer back per token. Independent dispatches (q/k/v,
the delta-net projections) carry no barrier between them; the runtime inserts barriers only
where one dispatch reads what another wrote.

Every projection reads its input once quantized to Q8_1 (int8 products; f32 for weight types
without an int8 decoder, and for the router): the normed residual stream is written, in f32 and
Q8_1, by a small dispatch after each addition to the residual (before a MoE block, by the router,
which norms x itself), and the attention and delta-net outputs by the kernels that finish them
(kernels/q8_1.py).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from zdsl.autotune.database import Database, choose, shape_key
from zdsl.errors import ZdslError
from zdsl.kernels import attention, deltanet, dmmv, embedding, ffn, moe, q8_1, sampling, steps
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes
from zdsl.kernels.quant import FORMATS, INT8_FORMATS
from zdsl.kernels.steps import STEP_WORDS
from zdsl.runtime.memory import fmt_bytes
from zdsl.models.qwen35.batch import MOST as BATCH_MOST
from zdsl.models.qwen35.buffers import (ATTN_MIN_CHUNK, PROMPT_CHUNK, SAVED, BufferSpec, Footprint, attn_splits,
                                        batch_buffers, check_fits, checkpointed, decode_buffers, largest)
from zdsl.models.qwen35.checkpoints import Snapshot
from zdsl.models.qwen35.gguf_file import ModelFile
from zdsl.models.qwen35.prefill import Prefill
from zdsl.models.qwen35.sampler import SamplerConfig, check_vocab
from zdsl.models.qwen35.weights import file_ranges, graph_weights


@dataclass
class Vector:
    """One activation vector as the projections read it: f32, and Q8_1 (q, d: q8_1.py); for a
    chunk's rows on a device with matrix units, f16 (h) too."""

    f32: object
    q: object
    d: object
    h: object = None


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
                 kv: KVTypes = KV_DEFAULT):
    """The buffers (buffers.BufferSpec) a DecodeGraph of `model` holds on device `info`, sized before
    one is made: to show and check the memory plan up front."""
    groups = sampler_kernels(lambda kernel, key, fixed: choose(kernel, info, key, db=tuning, **fixed),
                             model.hparams.vocab, sampler)[2]
    return decode_buffers(model.hparams, graph_weights(model), n_ctx, candidate_bytes(sampler, groups), chunk=PROMPT_CHUNK,
                          halves="coopmat" in info.features, kv=kv)


def record_launches(model, info, n_ctx: int, sampler: SamplerConfig | None = None, tuning: Database | None = None,
                    kv: KVTypes = KV_DEFAULT):
    """The launches of one decode step of `model` (a ModelFile or synth.PresetModel) as a device
    of `info` would run it (KernelDef.launch records them; a DryDevice allocates and runs nothing)."""
    from zdsl.runtime.dry import DryDevice

    graph = DecodeGraph(model, DryDevice(info), n_ctx, sampler, progress=False, tuning=tuning, kv=kv)
    return graph.seq.launches


def record_chunk_launches(model, info, n_ctx: int, t: int, tuning: Database | None = None,
                          kv: KVTypes = KV_DEFAULT):
    """The launches of one prompt chunk of t tokens (prefill.py) of `model` as a device of `info`
    would run it, recorded as record_launches records a step."""
    from zdsl.runtime.dry import DryDevice

    graph = DecodeGraph(model, DryDevice(info), n_ctx, progress=False, tuning=tuning, kv=kv)
    if not 0 < t <= graph.chunk:
        raise ZdslError(f"a prompt chunk holds 1 to {graph.chunk} tokens, not {t}: pick a --prompt in that range")
    return graph.prompt.record(t).launches


class DecodeGraph:
    def __init__(self, model: ModelFile, device, n_ctx: int, sampler: SamplerConfig | None = None,
                 progress: bool = True, tuning: Database | None = None, say=None, checkpoint: bool = False,
                 chunk: int = PROMPT_CHUNK, kv: KVTypes = KV_DEFAULT, weights_of: DecodeGraph | None = None,
                 slots: int = 1, warm: bool = False):
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
        compile time."""
        self.weights_of = weights_of
        self.can_checkpoint = checkpoint
        self.kv_types = KVTypes(*kv)
        self.chunk = max(1, min(chunk, n_ctx))
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
            self._upload_weights(progress, say)
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
                               "coopmat" in self.device.info.features, self.kv_types)
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
        from zdsl.runtime.dry import DryDevice
        from zdsl.runtime.warm import warm

        start, cores = time.perf_counter(), os.cpu_count() or 1
        dry = DecodeGraph(self.model, DryDevice(self.info), self.n_ctx, self.sampler, progress=False,
                          tuning=self.tuning, kv=self.kv_types, chunk=self.chunk)  # records, compiles nothing
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

    def retune(self, tuning: Database | None, sampler: SamplerConfig | None = None) -> None:
        """Record the step again with the variants `tuning` picks (and another sampler, if given);
        weights, caches and states stay. The tuner times candidates in place this way. Prompt
        chunks are recorded again on their next use: their variants and penalty window change too."""
        self._free_steps()
        self.prompt.forget()
        self.tuning = tuning
        if sampler is not None:
            self.sampler = sampler
        self.chosen.clear()
        self._picked.clear()
        self._pick_sampler()
        self.sampler_settings.write(self.sampler.settings())
        self._record_steps()
        self._synced = False

    def _pick(self, kernel, key: dict, fixed: dict):
        """The variant a launch runs: the tuning database's choice for its key (KernelDef.launch),
        looked up once a key (a batched step records ~1,700 launches of a few dozen keys)."""
        memo = (kernel.name, tuple(sorted(key.items())), tuple(sorted(fixed.items())))
        v = self._picked.get(memo)
        if v is None:
            v = self._picked[memo] = choose(kernel, self.info, key, db=self.tuning, **fixed)
            self.chosen[(kernel.name, shape_key(key))] = v
        return v

    # -- set-up ----------------------------------------------------------------------------
    def _upload_weights(self, progress: bool, say=None) -> None:
        """Every weight from the file into its buffer: file ranges read by several threads while
        the GPU copies what was read before (Device.upload_file)."""
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        jobs = []
        for name, t in self.tensors.tensors.items():
            if t.dequantized:  # parts of two types joined: their values (weights.py)
                values = [self.model.dequant(part.tensor).reshape(-1) for part in t.parts]
                self.weights[name].write(np.concatenate(values).astype(np.float32))
                continue
            at = 0
            for file_offset, n in file_ranges(self.model, t):
                jobs.append((self.weights[name], at, file_offset, n))
                at += n
        console = Console(stderr=True)
        with Progress(TextColumn("uploading weights"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      transient=True, console=console, disable=not (progress and console.is_terminal)) as bar:
            task = bar.add_task("upload", total=sum(job[3] for job in jobs))
            start = time.perf_counter()
            self.device.upload_file(self.model.path, jobs, lambda n: bar.advance(task, n))
            self.device.wait_idle()
            seconds = time.perf_counter() - start
        if say:
            total = sum(job[3] for job in jobs)
            say(f"weights: {fmt_bytes(total)} loaded in {seconds:.2f} s ({total / seconds / 1e9:.1f} GB/s)")

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
        self.prompt = Prefill(self, b)
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
        self.sample_pass, self.sample_draw, self.sample_groups = sampler_kernels(self._pick, self.hp.vocab,
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
        if self.hp.moe:
            seq.fill(self.zero_id)
        seq.run()
        seq.free()
        self.step_words[:] = 0  # the sampler's counter too: a sequence samples alike from its start
        self.position = 0
        self._synced = False

    # -- recording --------------------------------------------------------------------------
    def _qname(self, tensor: str) -> str:
        q = self.tensors.qtype(tensor).name.lower()
        if q not in FORMATS:
            raise ZdslError(f"tensor {tensor} is {q.upper()}, which has no GPU kernel yet")
        return q

    def _int8(self, tensor: str) -> bool:
        return self._qname(tensor) in INT8_FORMATS

    def _project(self, seq, tensor: str, y, x: Vector, t: int = 1, add: bool = False) -> None:
        """y rows (+)= W · x rows for t rows (one weight read for all: dmmv's COLS): int8 products
        where the weight type has an int8 decoder and x comes in Q8_1, else f32."""
        m, k = self.tensors.shape(tensor)[-2:]
        q8 = self._int8(tensor) and x.q is not None
        dmmv.dmmv.launch(seq, self._pick, label=tensor.removesuffix(".weight"), QTYPE=self._qname(tensor), Q8=q8,
                         COLS=t, ADD=add, w=self.weights[tensor], y=y, k=k, m=m,
                         **(dict(xq=x.q, xd=x.d) if q8 else dict(x=x.f32)))

    def _project_two(self, seq, tensor: str, y, tensor2: str, y2, a, t: int) -> None:
        """y = W · normed and y2 = W2 · normed: one dispatch for one row where both types have
        int8 decoders (dmmv_q8_pair), else one each."""
        if t > 1 or not (self._int8(tensor) and self._int8(tensor2)):
            self._project(seq, tensor, y, a.normed, t)
            self._project(seq, tensor2, y2, a.normed, t)
            return
        (m, k), (m2, _) = self.tensors.shape(tensor)[-2:], self.tensors.shape(tensor2)[-2:]
        label = tensor.removesuffix(".weight") + "+" + tensor2.split(".")[-2]
        dmmv.dmmv_q8_pair.launch(seq, self._pick, label=label, QTYPE=self._qname(tensor), QTYPE2=self._qname(tensor2),
                                 w=self.weights[tensor], w2=self.weights[tensor2], xq=a.normed.q, xd=a.normed.d,
                                 y=y, y2=y2, k=k, m=m, m2=m2)

    def _residual(self, seq, tensor: str, x: Vector, next_norm: str | None, a, t: int) -> None:
        """x += W · input, then the next projections' normed input from x (rmsnorm(x) · next_norm),
        unless the next consumer norms x itself (None: the MoE router)."""
        self._project(seq, tensor, a.x, x, t, add=True)
        if next_norm is not None:
            self._norm(seq, next_norm, a, t)

    def _post_attention_norm(self, i: int) -> str | None:
        """The norm after layer i's mixer, where it needs a dispatch of its own (the MoE router
        norms its input itself)."""
        return None if self.hp.moe else f"blk.{i}.post_attention_norm.weight"

    def _norm(self, seq, norm: str, a, t: int, x=None) -> None:
        """normed = rmsnorm(x) · norm, in f32 and Q8_1, for t rows: a workgroup a row (x: a.x
        unless given)."""
        n = a.normed
        q8_1.norm_q8_1.launch(seq, self._pick, label=norm.removesuffix(".weight"), x=a.x if x is None else x,
                              norm_w=self.weights[norm],
                              hn=n.f32, xq=n.q, xd=n.d, HALVES=False, n=self.hp.hidden, eps=self.hp.eps, rows=t)

    def _next_norm(self, i: int) -> str:
        """The norm that the layer after layer i starts with (the output norm after the last)."""
        return f"blk.{i + 1}.attn_norm.weight" if i + 1 < self.hp.n_layers else "output_norm.weight"

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
        embedding.embed.launch(seq, self._pick, QTYPE=self._qname(emb), table=self.weights[emb], ids=self.step,
                               out=self.x, k=self.hp.hidden, index=2, rows=1)
        self.record_layers(seq, [self], self.own_rows)
        self.finish_step(seq)
        return seq

    def record_layers(self, seq, graphs: list, a, row_seq=None) -> None:
        """The step after the embedding, for the sequences of `graphs` (this graph's weights; row r
        of a's activations is graphs[r]'s token; x holds the embeddings): every projection once
        for all rows, each sequence's attention, delta-net step, experts and sampling on its row,
        a stage's launches of all sequences with no barrier between them. `row_seq(r)`, where
        given, is what row r's launches record into (batch.py: indirect dispatches)."""
        hp, t = self.hp, len(graphs)
        each = functools.partial(_each, row_seq=row_seq or (lambda r: seq))
        # the experts of every row in one launch each (the grid's z), where each row's need not be its own
        by_row = (lambda launches_of: each(seq, [launches_of(r, 1) for r in range(t)])) if row_seq else \
            (lambda launches_of: [launch(seq) for launch in launches_of(0, t)])
        self._norm(seq, "blk.0.attn_norm.weight", a, t)
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            if hp.attention[i]:
                for name, out in (("attn_q", a.qg), ("attn_k", a.k), ("attn_v", a.v)):
                    self._project(seq, p + name + ".weight", out, a.normed, t)
                each(seq, [g.attend(i, a, r) for r, g in enumerate(graphs)])
                self._residual(seq, p + "attn_output.weight", a.attn_o, self._post_attention_norm(i), a, t)
            else:
                self._project_two(seq, p + "attn_qkv.weight", a.mix, p + "attn_gate.weight", a.z, a, t)
                each(seq, [[g.delta_step(i, a, r)] for r, g in enumerate(graphs)])
                self._residual(seq, p + "ssm_out.weight", a.dn_out, self._post_attention_norm(i), a, t)
            if hp.moe:
                by_row(lambda r, rows: self.experts(i, a, r, rows))
                self._norm(seq, self._next_norm(i), a, t)
            else:
                by_row(lambda r, rows: [self._gate_up(p + "ffn_gate.weight", p + "ffn_up.weight", 1, False, a, r,
                                                      hp.ffn, rows=rows)])
                self._residual(seq, p + "ffn_down.weight", Vector(a.act, None, None), self._next_norm(i), a, t)
        self._project(seq, self.tensors.output_name, a.logits, a.normed, t)
        each(seq, [g.sample(a.logits, r, a.cands[r]) for r, g in enumerate(graphs)])

    def attend(self, i: int, a, row: int) -> list:
        """Layer i's attention for this graph's sequence, as three launches to record in order
        (each a function of the sequence): q, k and v normed and rotated, k and v into the cache;
        the splits of the cache; their merge, gated, into o. They read q·gate, k and v at row
        `row` of a's qg, k and v and write that row of a's q and attn_o (a Vector), with a's
        parts[row] for the splits: the graph's own rows, or a batch's (record_layers)."""
        hp, p = self.hp, f"blk.{i}."
        nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        k_cache, v_cache = self.kv[i]
        kt, vt = self.kv_types
        o, part = a.attn_o, a.parts[row]
        return [
            lambda seq: attention.attn_prep.launch(
                seq, self._pick, label=p + "attn_prep", KT=kt, VT=vt, qg=a.qg, k=a.k, v=a.v,
                q_norm=self.weights[p + "attn_q_norm.weight"], k_norm=self.weights[p + "attn_k_norm.weight"],
                step=self.step, q=a.q, k_cache=k_cache, v_cache=v_cache, n_head=nh, n_kv=nkv, d=d,
                rope_dims=hp.rope_dims, rope_base=hp.rope_base, eps=hp.eps, row=row),
            lambda seq: attention.attn_decode.launch(
                seq, self._pick, label=p + "attn_decode", D=d, G=nh // nkv, KT=kt, VT=vt, q=a.q, k_cache=k_cache,
                v_cache=v_cache, step=self.step, part=part, n_kv=nkv, min_chunk=ATTN_MIN_CHUNK,
                nsplit=self.attn_splits, ctx=self.n_ctx, row=row),
            lambda seq: attention.attn_combine.launch(
                seq, self._pick, label=p + "attn_combine", D=d, Q8=self._int8(p + "attn_output.weight"), VT=vt,
                part=part, qg=a.qg, step=self.step, o=o.f32, oq=o.q, od=o.d, nsplit=self.attn_splits,
                min_chunk=ATTN_MIN_CHUNK, n_head=nh, ctx=self.n_ctx, row=row)]

    def delta_step(self, i: int, a, row: int):
        """Layer i's delta-net step for this graph's sequence, as a launch to record (a function of
        the sequence): each head's gates β and α, the conv of the channels it reads and the delta
        rule, in one dispatch, reading row `row` of a's mix, z and normed (a Vector) and writing
        that row of a's dn_out (attend() says why a)."""
        hp, p = self.hp, f"blk.{i}."
        gates = p + "ssm_beta_alpha.weight"
        x, o = a.normed, a.dn_out
        return lambda seq: deltanet.deltanet_step.launch(
            seq, self._pick, label=p + "ssm_conv+step", D=hp.ssm_head_dim, KC=hp.conv_kernel,
            Q8=self._int8(p + "ssm_out.weight"), QTYPE=self._qname(gates), v_heads=hp.ssm_v_heads, mix=a.mix,
            conv_w=self.weights[p + "ssm_conv1d.weight"], conv_state=self.conv_state[i], step=self.step, z=a.z,
            w_ba=self.weights[gates], x=x.f32, xq=x.q, xd=x.d, ssm_a=self.weights[p + "ssm_a"],
            dt_bias=self.weights[p + "ssm_dt.bias"], norm_w=self.weights[p + "ssm_norm.weight"],
            state=self.ssm_state[i], out=o.f32, oq=o.q, od=o.d, n_k_heads=hp.ssm_k_heads, k=hp.hidden, eps=hp.eps,
            conv_slots=hp.conv_kernel, state_slots=1, row=row)

    def _gate_up(self, gate: str, up: str, slots: int, experts: bool, a, row: int, act_stride: int, act=None,
                 label: str | None = None, rows: int = 1):
        """A launch (a function of the sequence): act = silu(gate · normed) · (up · normed) per slot
        for row `row` of a: the experts in a.route_ids (MoE; the shared expert is the stacks'
        last, slot K, unless it has a type of its own) or the one pair (a dense FFN, a shared
        expert of its own type); into `act` (a's act by default), act_stride values a row; `rows`
        rows from `row` on."""
        m, k = self.tensors.shape(gate)[-2:]
        q, q_up = self._qname(gate), self._qname(up)
        if self.tensors.shape(up)[-2:] != (m, k):
            raise ZdslError(f"{up} {list(reversed(self.tensors.shape(up)[-2:]))} differs in shape from {gate} "
                            f"{[k, m]}; a SwiGLU's gate and up have one shape")
        q8 = self._int8(gate) and self._int8(up)
        two = dict(QTYPE_UP=q_up) if q_up != q else {}  # named only where it differs: one type keeps its tuning key
        x = a.normed
        return lambda seq: ffn.ffn_gate_up.launch(
            seq, self._pick, label=label or gate.removesuffix(".weight") + "+up", QTYPE=q, Q8=q8, EXPERTS=experts,
            **two, wg=self.weights[gate], wu=self.weights[up], ids=a.route_ids if experts else self.step,
            act=a.act if act is None else act, k=k, m=m, slots=slots, row=row,
            ids_stride=self.hp.n_experts_used + 1 if experts else 0, act_stride=act_stride, rows=rows,
            **(dict(xq=x.q, xd=x.d) if q8 else dict(x=x.f32)))

    def experts(self, i: int, a, row: int, rows: int = 1) -> list:
        """Layer i's MoE block for row `row` of a, as launches to record in order: the router (x
        normed, its logits, then the experts picked by the workgroup that finishes last), one
        dispatch for every expert's gate·up (the shared expert as one more slot: the stacks' last
        expert, weights.py), one for every down projection added to x. A shared expert of another
        type or width than the experts' takes a dispatch of its own for its gate·up, and its down
        one where it has another width or block layout. Rows of a hold K + 1 routes and K·F + S
        activations; `rows` rows from `row` on, a layer of each launch's grid each."""
        hp, p = self.hp, f"blk.{i}."
        K, E, F, S = hp.n_experts_used, hp.n_experts, hp.expert_ffn, hp.shared_ffn
        stride = K * F + S
        act_shared = a.act.slice(4 * K * F, a.act.nbytes - 4 * K * F)  # slot K, where the stacks hold it
        router = p + "ffn_gate_inp.weight"
        launches = [lambda seq: moe.moe_router.launch(
            seq, self._pick, label=p + "ffn_gate_inp+moe_route", QTYPE=self._qname(router), K=K,
            w=self.weights[router], x=a.x, norm_w=self.weights[p + "post_attention_norm.weight"], hn=a.normed.f32,
            xq=a.normed.q, xd=a.normed.d, logits=a.router, arrivals=a.arrivals, ids=a.route_ids, weights=a.route_w,
            k=self.tensors.shape(router)[-1], n_expert=E, eps=hp.eps, row=row, rows=rows)]
        apart = p + "ffn_gate_shexp.weight" in self.tensors  # a type of its own (weights.py): one more dispatch
        gate, up = p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"
        launches.append(self._gate_up(gate, up, K if apart else K + 1, True, a, row, stride,
                                      label=p + "ffn_gate_exps+up" + ("" if apart else "+shexp"), rows=rows))
        if apart:
            launches.append(self._gate_up(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", 1, False, a, row,
                                          stride, act=act_shared, rows=rows))
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        md, kd = self.tensors.shape(down)[-2:]
        qd = self._qname(down)
        qs = self._qname(down_sh) if down_sh in self.tensors else ""  # "": the stack's last expert
        fd, fs = FORMATS[qd], FORMATS[qs or qd]
        if (fd.block, fd.parts) != (fs.block, fs.parts) or (qs and self.tensors.shape(down_sh)[-1] != kd):
            def down_of(tensor, ids, weights, act, slots):
                m, k = self.tensors.shape(tensor)[-2:]
                return lambda seq: ffn.moe_down.launch(
                    seq, self._pick, label=tensor.removesuffix(".weight"), QTYPE=self._qname(tensor), ADD=True,
                    w=self.weights[tensor], ids=ids, weights=weights, act=act, y=a.x, k=k, m=m, slots=slots, row=row,
                    rows=rows, ids_stride=K + 1, act_stride=stride)

            weights_shared = a.route_w.slice(4 * K, a.route_w.nbytes - 4 * K)
            launches += [down_of(down, a.route_ids, a.route_w, a.act, K),
                         down_of(down_sh, a.zero_id, weights_shared, act_shared, 1)]
        else:
            launches.append(lambda seq: ffn.moe_down_all.launch(
                seq, self._pick, label=p + "ffn_down_exps+shexp", QTYPE=qd, QTYPE_SH=qs, K=K, w=self.weights[down],
                w_sh=self.weights[down_sh] if qs else self.device.placeholder, ids=a.route_ids, weights=a.route_w,
                act=a.act, y=a.x, k=kd, m=md, row=row, rows=rows))
        return launches


    def window(self, seq) -> None:
        """The step's input token into the penalties' window (where the sampler has penalties)."""
        if self.sampler.penalties:
            sampling.penalty_window.launch(seq, self._pick, step=self.step, ring=self.penalty_ring, counts=self.counts,
                                           window=self.sampler.window(self.n_ctx), n_vocab=self.hp.vocab, t=1)

    def finish_step(self, seq) -> None:
        """Position and length on to the next token, and the step values back to the host."""
        steps.advance.launch(seq, self._pick, step=self.step)
        seq.copy(self.step, self.step_host)

    def sample_row(self, seq, x) -> None:
        """The end of a step for a residual row made elsewhere (x: a prompt chunk's last row,
        prefill.py): the output norm, the head, the draw into the step values (which the
        sequence copied from the host), those on to the next token and back to the host."""
        a = self.own_rows
        self._norm(seq, "output_norm.weight", a, 1, x=x)
        self._project(seq, self.tensors.output_name, a.logits, a.normed)
        for launch in self.sample(a.logits, 0, a.cands[0]):
            launch(seq)
        self.finish_step(seq)

    def sample(self, logits, row: int, cand) -> list:
        """The next token of this graph's sequence from row `row` of `logits`, with this graph's
        sampler, as two launches to record in order: the candidates into `cand`, then the draw
        into the step values and tokens_out."""
        cap, vocab, settings = self.sampler.kernel_cap, self.hp.vocab, self.sampler_settings
        return [lambda seq: sampling.sample_candidates.launch(seq, self._pick, CAP=cap, logits=logits, counts=self.counts,
                                                              cand=cand, settings=settings, n_vocab=vocab, row=row),
                lambda seq: sampling.sample_draw.launch(seq, self._pick, CAP=cap, WG=self.sample_pass.params["WG"],
                                                        R=self.sample_pass.params["R"], cand=cand, step=self.step,
                                                        tokens=self.tokens_out, settings=settings, n_vocab=vocab,
                                                        max_tokens=self.n_ctx)]

    # -- running ----------------------------------------------------------------------------
    def decode(self, token: int | None = None) -> int:
        """Run one step at the current position. `token` is the input (a prompt token); None
        feeds the token the GPU sampled last step. Returns the sampled next token id."""
        (self.seq if self.from_host(token) else self.seq_next).run()
        self._synced = True
        self.position += 1
        return int(self.step_words[2])

    def from_host(self, token: int | None = None, n: int = 1) -> bool:
        """Before n steps: refuse them if they overrun the context; where the first must start
        from the host's step values (an input `token` given, or the GPU's values no longer the
        sequence's), write its position, length and token there. Returns whether it did."""
        if self.position + n > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        if token is None and self._synced:
            return False
        w = self.step_words
        w[0], w[1] = self.position, self.position + 1
        if token is not None:
            if not 0 <= token < self.hp.vocab:
                raise ZdslError(f"token id {token} is outside the vocabulary [0, {self.hp.vocab})")
            w[2] = token
        return True

    def prefill(self, tokens: list[int], sample: bool = False) -> int | None:
        """Feed prompt tokens at the current position a chunk at a time (prefill.py), leaving the
        caches and states as decode steps of each would, up to rounding (other kernels sum in
        other orders); nothing is sampled, unless `sample`: then the last chunk makes the last
        token's logits and draws from them the token that decode(tokens[-1]) after prefill(
        tokens[:-1]) would return (returned), as one submission."""
        if self.position + len(tokens) > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        bad = next((t for t in tokens if not 0 <= t < self.hp.vocab), None)
        if bad is not None:
            raise ZdslError(f"token id {bad} is outside the vocabulary [0, {self.hp.vocab})")
        if sample and not tokens:
            raise ZdslError("a prompt to sample after holds at least one token")
        # the sampler's counter: each position one draw, as if stepped (the GPU counts a sampled one's)
        self.step_words[3] += len(tokens) - (1 if sample else 0)
        return self.prompt.run(tokens, sample)

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
        self._synced = False

    def decode_burst(self, n: int) -> list[int]:
        """Run n steps back to back on the GPU, each feeding its sampled token to the next (one
        submission, one wait), and return the n sampled tokens."""
        first, rest = self.position, n
        if self.from_host(n=n):
            self.seq.run()
            rest -= 1
        if rest:
            self.seq_next.run(times=rest)
        self._synced = True
        self.position += n
        return self.tokens_out.read(np.uint32, (n,), offset=4 * first).tolist()

    def seek(self, position: int) -> None:
        """Continue at `position` without computing the tokens before it. For benchmarks only:
        the next steps read `position` rows of (unwritten) KV cache, so they cost what real
        decoding at that depth costs, but their outputs mean nothing."""
        if not 0 <= position < self.n_ctx:
            raise ZdslError(f"position {position} is outside the context of {self.n_ctx} tokens")
        self.position = position
        self._synced = False

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
                                      and lent is not None and lent.nbytes >= spec.nbytes)


def _each(seq, launches: list[list], row_seq) -> None:
    """The rows' launches (a list per row, in its order), stage by stage: a stage's launches of
    all rows with no barrier between them (they touch disjoint rows and their own caches and
    states: Sequence.together); row r's recorded into row_seq(r)."""
    for stage in zip(*launches):
        with seq.together():
            for r, launch in enumerate(stage):
                launch(row_seq(r))
