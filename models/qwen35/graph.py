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
import time
from dataclasses import dataclass

import numpy as np

from zdsl.autotune.database import Database, choose, shape_key
from zdsl.errors import ZdslError
from zdsl.kernels import attention, deltanet, dmmv, embedding, ffn, moe, q8_1, sampling, steps
from zdsl.kernels.kvcache import DEFAULT as KV_DEFAULT
from zdsl.kernels.quant import FORMATS, INT8_FORMATS
from zdsl.runtime.memory import fmt_bytes
from zdsl.models.qwen35.buffers import (ATTN_MAX_SPLITS, ATTN_MIN_CHUNK, CHUNK, SAVED, STEP_WORDS, check_fits,
                                        checkpointed, decode_buffers)
from zdsl.models.qwen35.checkpoints import Snapshot
from zdsl.models.qwen35.gguf_file import ModelFile
from zdsl.models.qwen35.prefill import Prefill
from zdsl.models.qwen35.sampler import SamplerConfig
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
    cap, sizes = sampler.kernel_cap, {"n_vocab": vocab}
    first = pick(sampling.sample_candidates, {**sizes, "CAP": cap}, {"CAP": cap})
    fixed = {"CAP": cap, "WG": first.params["WG"], "R": first.params["R"]}
    draw = pick(sampling.sample_draw, {**sizes, **fixed}, fixed)
    return first, draw, first.kernel.groups(first.params, sizes)[0]


def candidate_bytes(sampler: SamplerConfig, groups: int) -> int:
    """Room for the first pass's per-workgroup candidates (logit bits, id)."""
    return 8 * sampler.kernel_cap * groups


def plan_buffers(model: ModelFile, info, n_ctx: int, sampler: SamplerConfig, tuning: Database | None = None,
                 kv: tuple[str, str] = KV_DEFAULT):
    """The buffers (buffers.Spec) a DecodeGraph of `model` holds on device `info`, sized before
    one is made: to show and check the memory plan up front."""
    groups = sampler_kernels(lambda kernel, key, fixed: choose(kernel, info, key, db=tuning, **fixed),
                             model.hparams.vocab, sampler)[2]
    return decode_buffers(model.hparams, graph_weights(model), n_ctx, candidate_bytes(sampler, groups), chunk=CHUNK,
                          halves="coopmat" in info.features, kv=kv)


def record_launches(model, info, n_ctx: int, sampler: SamplerConfig | None = None, tuning: Database | None = None,
                    kv: tuple[str, str] = KV_DEFAULT):
    """The launches of one decode step of `model` (a ModelFile or synth.PresetModel) as a device
    of `info` would run it (KernelDef.launch records them; a DryDevice allocates and runs nothing)."""
    from zdsl.runtime.dry import DryDevice

    graph = DecodeGraph(model, DryDevice(info), n_ctx, sampler, progress=False, tuning=tuning, kv=kv)
    return graph.seq.launches


def record_chunk_launches(model, info, n_ctx: int, t: int, tuning: Database | None = None,
                          kv: tuple[str, str] = KV_DEFAULT):
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
                 chunk: int = CHUNK, kv: tuple[str, str] = KV_DEFAULT, weights_of: DecodeGraph | None = None):
        """`say(line)` hears the memory plan before anything is allocated; `progress` shows the
        weights' upload; `checkpoint` keeps room to save the sequence state (`checkpoint()`);
        `chunk`: the most prompt tokens `prefill` runs at once (prefill.py); `kv`: the formats of
        the K and V caches (kernels/kvcache.py); `weights_of`: a graph of this model on this device
        whose weights and activations this one uses (one more sequence, run only while that graph
        runs nothing: only what the sequence keeps is allocated; that graph must stay open while
        this one is)."""
        self.weights_of = weights_of
        self.can_checkpoint = checkpoint
        self.kv_types = tuple(kv)
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
        self.cand = None
        self._pick_sampler()
        if not getattr(device, "dry", False):
            need = check_fits(self.buffers, n_ctx, device.memory_available(), self.info)
        if say:
            say(f"memory: {need.line()} on {self.info.name}")
        self._allocate()
        if weights_of is None:
            self._upload_weights(progress, say)
        self.seq = self.seq_next = self._timed = None
        seconds = self._prepare_kernels(progress)
        if say and seconds >= 1:
            say(f"kernels ready in {seconds:.1f} s (compiled on this first run, then cached)")

    def buffers(self, n_ctx: int) -> list:
        """Every device buffer the graph holds at a context of n_ctx tokens (buffers.py): without
        the weights and activations where it uses another graph's."""
        specs = decode_buffers(self.hp, self.tensors, n_ctx, self._candidate_bytes(), self.can_checkpoint, self.chunk,
                               "coopmat" in self.device.info.features, self.kv_types)
        return specs if self.weights_of is None else [s for s in specs if not self._borrowed(s)]

    def _borrowed(self, spec) -> bool:
        """Whether a graph with `weights_of` uses that graph's buffer for `spec`: the weights, and
        scratch that no step leaves for the next where that graph's is large enough (a longer
        context or chunk needs more); its sequence's step values, sampled tokens and penalty
        window, and their saved twins, are its own."""
        own = {"step", "tokens_out"} | checkpointed(self.hp)
        lent = self.weights_of.by_name.get(spec.name)
        return spec.kind == "weights" or (spec.kind == "scratch" and spec.name not in own
                                          and not spec.name.startswith(SAVED)
                                          and lent is not None and lent.nbytes >= spec.nbytes)

    def _prepare_kernels(self, progress: bool) -> float:
        """Record the step (building the kernels not built before) and run it once, and a short
        prompt chunk, since some drivers compile a pipeline only when it first runs (lavapipe): a
        first run's prompt then does not count compilation as prompt time. Returns the seconds it
        took."""
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        start = time.perf_counter()
        console = Console(stderr=True)
        with Progress(SpinnerColumn(), TextColumn("compiling kernels"), TimeElapsedColumn(), transient=True,
                      console=console, disable=not (progress and console.is_terminal)):
            self._record_steps()
            self.reset()
            self.decode(0)
            self.reset()
            if self.chunk > 1 and not getattr(self.device, "dry", False):
                self.prefill([0, 0])  # the prompt path's kernels too
                self.reset()
        return time.perf_counter() - start

    def _record_steps(self) -> None:
        self.seq = self._record(from_host=True)   # a step that starts from values the host wrote
        self.seq_next = self._record(from_host=False)  # a step that continues on the GPU

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
        self._pick_sampler()
        self._record_steps()
        self._synced = False

    def _pick(self, kernel, key: dict, fixed: dict):
        """The variant a launch runs: the tuning database's choice for its key (KernelDef.launch)."""
        v = choose(kernel, self.info, key, db=self.tuning, **fixed)
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
        self.attn_splits = attention.split_count(self.n_ctx, ATTN_MIN_CHUNK, ATTN_MAX_SPLITS)
        self.attn_part = b["attn_partials"]
        self.mix, self.z, self.dn_out = b["mix"], b["z"], vector("deltanet_out")
        self.kv = {i: (b[f"k_cache.{i}"], b[f"v_cache.{i}"]) for i in hp.attention_layers}
        self.conv_state = {i: b[f"conv_state.{i}"] for i in hp.deltanet_layers}
        self.ssm_state = {i: b[f"ssm_state.{i}"] for i in hp.deltanet_layers}
        if hp.moe:
            K, F = hp.n_experts_used, hp.expert_ffn
            self.router, self.route_ids, self.route_w = b["router_logits"], b["route_ids"], b["route_weights"]
            self.act = b["expert_act"]
            self.act_shared = self.act.slice(4 * K * F, 4 * hp.shared_ffn)  # slot K where the stacks hold it
            self.route_w_shared = self.route_w.slice(4 * K, 4)
            self.zero_id = b["zero_id"]
        else:
            self.act = b["ffn_act"]
        # the penalties' window: how often each token occurs in it, and its tokens by position
        self.counts, self.penalty_ring = b["token_counts"], b["penalty_ring"]
        self.tokens_out, self.cand = b["tokens_out"], b["candidates"]
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

    def _project(self, seq, tensor: str, y, x: Vector | None = None, add: bool = False) -> None:
        """y (+)= W · x, x the normed input by default: int8 products where the weight type has
        an int8 decoder and x comes in Q8_1, else f32."""
        x = x or self.normed
        m, k = self.tensors.shape(tensor)[-2:]
        q8 = self._int8(tensor) and x.q is not None
        dmmv.dmmv.launch(seq, self._pick, label=tensor.removesuffix(".weight"), QTYPE=self._qname(tensor), Q8=q8,
                         COLS=1, ADD=add, w=self.weights[tensor], y=y, k=k, m=m,
                         **(dict(xq=x.q, xd=x.d) if q8 else dict(x=x.f32)))

    def _project_two(self, seq, tensor: str, y, tensor2: str, y2) -> None:
        """y = W · normed and y2 = W2 · normed: one dispatch where both types have int8 decoders
        (dmmv_q8_pair), else one each."""
        if not (self._int8(tensor) and self._int8(tensor2)):
            self._project(seq, tensor, y)
            self._project(seq, tensor2, y2)
            return
        (m, k), (m2, _) = self.tensors.shape(tensor)[-2:], self.tensors.shape(tensor2)[-2:]
        label = tensor.removesuffix(".weight") + "+" + tensor2.split(".")[-2]
        dmmv.dmmv_q8_pair.launch(seq, self._pick, label=label, QTYPE=self._qname(tensor), QTYPE2=self._qname(tensor2),
                                 w=self.weights[tensor], w2=self.weights[tensor2], xq=self.normed.q, xd=self.normed.d,
                                 y=y, y2=y2, k=k, m=m, m2=m2)

    def _residual(self, seq, tensor: str, x: Vector, next_norm: str | None) -> None:
        """x += W · input, then the next projections' normed input from x (rmsnorm(x) · next_norm),
        unless the next consumer norms x itself (None: the MoE router)."""
        self._project(seq, tensor, self.x, x, add=True)
        if next_norm is not None:
            self._norm(seq, next_norm)

    def _post_attention_norm(self, i: int) -> str | None:
        """The norm after layer i's mixer, where it needs a dispatch of its own (the MoE router
        norms its input itself)."""
        return None if self.hp.moe else f"blk.{i}.post_attention_norm.weight"

    def _norm(self, seq, norm: str) -> None:
        """normed = rmsnorm(x) · norm, in f32 and Q8_1: one dispatch of one workgroup."""
        n = self.normed
        q8_1.norm_q8_1.launch(seq, self._pick, label=norm.removesuffix(".weight"), x=self.x, norm_w=self.weights[norm],
                              hn=n.f32, xq=n.q, xd=n.d, n=self.hp.hidden, eps=self.hp.eps, rows=1)

    def _next_norm(self, i: int) -> str:
        """The norm that the layer after layer i starts with (the output norm after the last)."""
        return f"blk.{i + 1}.attn_norm.weight" if i + 1 < self.hp.n_layers else "output_norm.weight"

    def _record(self, from_host: bool, timestamps: bool = False):
        hp = self.hp
        seq = self.device.sequence(timestamps=timestamps)
        if from_host:
            seq.copy(self.step_host, self.step)
        if self.sampler.penalties:
            sampling.penalty_window.launch(seq, self._pick, step=self.step, ring=self.penalty_ring, counts=self.counts,
                                           window=self.sampler.window(self.n_ctx), n_vocab=self.hp.vocab, t=1)
        emb = "token_embd.weight"
        embedding.embed.launch(seq, self._pick, QTYPE=self._qname(emb), table=self.weights[emb], ids=self.step,
                               out=self.x, k=hp.hidden, index=2, rows=1)
        self._norm(seq, "blk.0.attn_norm.weight")
        for i in range(hp.n_layers):
            if hp.attention[i]:
                self._attention(seq, i)
            else:
                self._deltanet(seq, i)
            if hp.moe:
                self._moe(seq, i)
            else:
                self._ffn(seq, i)
        self._project(seq, self.tensors.output_name, self.logits_out)
        self._sample(seq)
        steps.advance.launch(seq, self._pick, step=self.step)
        seq.copy(self.step, self.step_host)
        return seq

    def _attention(self, seq, i: int) -> None:
        hp, p = self.hp, f"blk.{i}."
        nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        for name, out in (("attn_q", self.qg), ("attn_k", self.k), ("attn_v", self.v)):
            self._project(seq, p + name + ".weight", out)
        k_cache, v_cache = self.kv[i]
        kt, vt = self.kv_types
        attention.attn_prep.launch(
            seq, self._pick, label=p + "attn_prep", KT=kt, VT=vt, qg=self.qg, k=self.k, v=self.v, q_norm=self.weights[p + "attn_q_norm.weight"],
            k_norm=self.weights[p + "attn_k_norm.weight"], step=self.step, q=self.q, k_cache=k_cache, v_cache=v_cache,
            n_head=nh, n_kv=nkv, d=d, rope_dims=hp.rope_dims, rope_base=hp.rope_base, eps=hp.eps)
        attention.attn_decode.launch(seq, self._pick, label=p + "attn_decode", D=d, G=nh // nkv, KT=kt, VT=vt, q=self.q,
                                     k_cache=k_cache, v_cache=v_cache, step=self.step, part=self.attn_part, n_kv=nkv,
                                     min_chunk=ATTN_MIN_CHUNK, nsplit=self.attn_splits, ctx=self.n_ctx)
        o = self.attn_o
        attention.attn_combine.launch(seq, self._pick, label=p + "attn_combine", D=d,
                                      Q8=self._int8(p + "attn_output.weight"), part=self.attn_part, qg=self.qg,
                                      step=self.step, o=o.f32, oq=o.q, od=o.d, nsplit=self.attn_splits,
                                      min_chunk=ATTN_MIN_CHUNK, n_head=nh, ctx=self.n_ctx)
        self._residual(seq, p + "attn_output.weight", o, self._post_attention_norm(i))

    def _deltanet(self, seq, i: int) -> None:
        hp, p = self.hp, f"blk.{i}."
        self._project_two(seq, p + "attn_qkv.weight", self.mix, p + "attn_gate.weight", self.z)
        # one dispatch: each head's gates β and α, the conv of the channels it reads, the delta rule
        gates = p + "ssm_beta_alpha.weight"
        o = self.dn_out
        deltanet.deltanet_step.launch(
            seq, self._pick, label=p + "ssm_conv+step", D=hp.ssm_head_dim, KC=hp.conv_kernel,
            Q8=self._int8(p + "ssm_out.weight"), QTYPE=self._qname(gates), v_heads=hp.ssm_v_heads, mix=self.mix,
            conv_w=self.weights[p + "ssm_conv1d.weight"], conv_state=self.conv_state[i], step=self.step, z=self.z,
            w_ba=self.weights[gates], x=self.normed.f32, xq=self.normed.q, xd=self.normed.d,
            ssm_a=self.weights[p + "ssm_a"], dt_bias=self.weights[p + "ssm_dt.bias"],
            norm_w=self.weights[p + "ssm_norm.weight"], state=self.ssm_state[i], out=o.f32, oq=o.q, od=o.d,
            n_k_heads=hp.ssm_k_heads, k=hp.hidden, eps=hp.eps)
        self._residual(seq, p + "ssm_out.weight", o, self._post_attention_norm(i))

    def _gate_up(self, seq, gate: str, up: str, slots: int, experts: bool, act=None) -> None:
        """act = silu(gate · normed) · (up · normed) per slot: the experts in route_ids (MoE; the
        shared expert is the stacks' last, slot K, unless it has a type of its own) or the one
        pair (a dense FFN, a shared expert of its own type); `act` the graph's act by default."""
        m, k = self.tensors.shape(gate)[-2:]
        q, q_up = self._qname(gate), self._qname(up)
        if self.tensors.shape(up)[-2:] != (m, k):
            raise ZdslError(f"{up} {list(reversed(self.tensors.shape(up)[-2:]))} differs in shape from {gate} "
                            f"{[k, m]}; a SwiGLU's gate and up have one shape")
        q8 = self._int8(gate) and self._int8(up)
        label = gate.removesuffix(".weight") + "+up" + ("+shexp" if experts and slots > self.hp.n_experts_used else "")
        two = dict(QTYPE_UP=q_up) if q_up != q else {}  # named only where it differs: one type keeps its tuning key
        ffn.ffn_gate_up.launch(seq, self._pick, label=label, QTYPE=q, Q8=q8, EXPERTS=experts, **two,
                               wg=self.weights[gate],
                               wu=self.weights[up], ids=self.route_ids if experts else self.step,
                               act=self.act if act is None else act, k=k, m=m,
                               slots=slots, **(dict(xq=self.normed.q, xd=self.normed.d) if q8 else dict(x=self.normed.f32)))

    def _moe(self, seq, i: int) -> None:
        """The router (x normed, its logits, then the experts picked by the workgroup that
        finishes last), one dispatch for every expert's gate·up (the shared expert as one more
        slot: the stacks' last expert, weights.py), one for every down projection added to x,
        then x normed for the next layer. A shared expert of another type or width than the
        experts' takes a dispatch of its own for its gate·up, and its down one where it has
        another width or block layout."""
        hp, p = self.hp, f"blk.{i}."
        K, E = hp.n_experts_used, hp.n_experts
        router = p + "ffn_gate_inp.weight"
        moe.moe_router.launch(
            seq, self._pick, label=p + "ffn_gate_inp+moe_route", QTYPE=self._qname(router), K=K,
            w=self.weights[router], x=self.x, norm_w=self.weights[p + "post_attention_norm.weight"], hn=self.normed.f32,
            xq=self.normed.q, xd=self.normed.d, logits=self.router, arrivals=self.router_arrivals, ids=self.route_ids,
            weights=self.route_w, k=self.tensors.shape(router)[-1], n_expert=E, eps=self.hp.eps)
        apart = p + "ffn_gate_shexp.weight" in self.tensors  # a type of its own (weights.py): one more dispatch
        self._gate_up(seq, p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", K if apart else K + 1, experts=True)
        if apart:
            self._gate_up(seq, p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", 1, experts=False,
                          act=self.act_shared)
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        md, kd = self.tensors.shape(down)[-2:]
        qd = self._qname(down)
        qs = self._qname(down_sh) if down_sh in self.tensors else ""  # "": the stack's last expert
        fd, fs = FORMATS[qd], FORMATS[qs or qd]
        if (fd.block, fd.parts) != (fs.block, fs.parts) or (qs and self.tensors.shape(down_sh)[-1] != kd):
            self._down(seq, down, self.route_ids, self.route_w, self.act, K)
            self._down(seq, down_sh, self.zero_id, self.route_w_shared, self.act_shared, 1)
        else:
            ffn.moe_down_all.launch(seq, self._pick, label=p + "ffn_down_exps+shexp", QTYPE=qd, QTYPE_SH=qs, K=K,
                                    w=self.weights[down], w_sh=self.weights[down_sh] if qs else self.device.placeholder,
                                    ids=self.route_ids, weights=self.route_w, act=self.act, y=self.x, k=kd, m=md)
        self._norm(seq, self._next_norm(i))

    def _down(self, seq, tensor: str, ids, weights, act, slots: int) -> None:
        m, k = self.tensors.shape(tensor)[-2:]
        q = self._qname(tensor)
        ffn.moe_down.launch(seq, self._pick, label=tensor.removesuffix(".weight"), QTYPE=q, ADD=True,
                            w=self.weights[tensor], ids=ids, weights=weights, act=act, y=self.x, k=k, m=m, slots=slots)

    def _ffn(self, seq, i: int) -> None:
        p = f"blk.{i}."
        self._gate_up(seq, p + "ffn_gate.weight", p + "ffn_up.weight", 1, experts=False)
        self._residual(seq, p + "ffn_down.weight", Vector(self.act, None, None), self._next_norm(i))

    def _sample(self, seq) -> None:
        first, draw = self.sampler.push_constants(self.hp.vocab, self.n_ctx)
        cap = self.sampler.kernel_cap
        sampling.sample_candidates.launch(seq, self._pick, CAP=cap, logits=self.logits_out, counts=self.counts,
                                          cand=self.cand, **first)
        sampling.sample_draw.launch(seq, self._pick, CAP=cap, WG=self.sample_pass.params["WG"],
                                    R=self.sample_pass.params["R"], cand=self.cand, step=self.step,
                                    tokens=self.tokens_out, **draw)

    # -- running ----------------------------------------------------------------------------
    def decode(self, token: int | None = None) -> int:
        """Run one step at the current position. `token` is the input (a prompt token); None
        feeds the token the GPU sampled last step. Returns the sampled next token id."""
        if self.position >= self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        if token is not None or not self._synced:
            w = self.step_words
            w[0], w[1] = self.position, self.position + 1
            if token is not None:
                if not 0 <= token < self.hp.vocab:
                    raise ZdslError(f"token id {token} is outside the vocabulary [0, {self.hp.vocab})")
                w[2] = token
            self.seq.run()
        else:
            self.seq_next.run()
        self._synced = True
        self.position += 1
        return int(self.step_words[2])

    def prefill(self, tokens: list[int]) -> None:
        """Feed prompt tokens at the current position a chunk at a time (prefill.py), leaving the
        caches and states as decode steps of each would, up to rounding (other kernels sum in
        other orders); nothing is sampled."""
        if self.position + len(tokens) > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        bad = next((t for t in tokens if not 0 <= t < self.hp.vocab), None)
        if bad is not None:
            raise ZdslError(f"token id {bad} is outside the vocabulary [0, {self.hp.vocab})")
        self.prompt.run(tokens)
        self.step_words[3] += len(tokens)  # the sampler's counter: each position one draw, as if stepped

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
        if self.position + n > self.n_ctx:
            raise ZdslError(f"the context of {self.n_ctx} tokens is full; start again with a larger --ctx")
        if not self._synced:
            return [self.decode()] + (self.decode_burst(n - 1) if n > 1 else [])
        first = self.position
        self.seq_next.run(times=n)
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
