"""The layer schedule: what a step does to its rows, layer by layer, written once.

A step's rows are tokens: of one sequence at consecutive positions (a decode step is one row, a
speculative step several: token_rows.py), or of several sequences, one token each or some
several (batch.py: a mixed step). For every layer:
the norm, the mixer (gated attention or the gated delta-net) with its projections and the
residual addition, then the FFN (the MoE with its shared expert, or a dense SwiGLU) and its
residual addition, and the next layer's norm; after the last, the output norm, the head and each
row's draw. Each launch picks its kernel by the step's shape: dmmv for up to 8 rows, mul_mm
past them (on a CPU device past one: `dmmv_takes`); attention and the experts of all rows in one
launch a stage, the delta-net one launch (a sequence's several tokens run in order in it), the
draw a launch a row.
(A prompt's chunk runs the same order on kernels made for hundreds of rows: prefill.py.)

Every projection reads its input once quantized to Q8_1 (int8 products; f32 for weight types
without an int8 decoder, and for the router): the normed residual stream is written, in f32 and
Q8_1, by a small dispatch after each addition to the residual (before a MoE block, by the router,
which norms x itself), and the attention and delta-net outputs by the kernels that finish them
(kernels/q8_1.py). Independent dispatches (q/k/v, the delta-net projections) carry no barrier
between them; the runtime inserts barriers only where one dispatch reads what another wrote.

`LayerSchedule` is the recording half of DecodeGraph (graph.py), which holds the weights, the
sequence's caches and states and the step values it reads; `pick`, `qname` and `int8` are what
the prompt path (prefill.py) and the tuner share with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace

from zdsl.autotune.database import choose, shape_key
from zdsl.errors import ZdslError
from zdsl.kernels import attention, deltanet, dmmv, ffn, matmul, mma, moe, q8_1, sampling, steps
from zdsl.kernels.quant import FORMATS, INT8_FORMATS
from zdsl.models.qwen35.model.buffers import ATTN_MIN_CHUNK

DMMV_COLS = max(dmmv.dmmv.variant_space["COLS"])  # rows a matrix-vector product takes at most


@dataclass
class Vector:
    """One activation vector as the projections read it: f32, and Q8_1 (q, d: q8_1.py); for a
    chunk's rows on a device with matrix units, f16 (h) too."""

    f32: object
    q: object
    d: object
    h: object = None


class LayerSchedule:
    """The recording of a step's layers over a DecodeGraph's weights (its base class)."""

    def pick(self, kernel, key: dict, fixed: dict):
        """The variant a launch runs: the tuning database's choice for its key (KernelDef.launch),
        looked up once a key (a batched step records ~1,700 launches of a few dozen keys)."""
        memo = (kernel.name, tuple(sorted(key.items())), tuple(sorted(fixed.items())))
        v = self._picked.get(memo)
        if v is None:
            v = self._picked[memo] = choose(kernel, self.info, key, db=self.tuning, **fixed)
            self.chosen[(kernel.name, shape_key(key))] = v
        return v

    def qname(self, tensor: str) -> str:
        q = self.tensors.qtype(tensor).name.lower()
        if q not in FORMATS:
            raise ZdslError(f"tensor {tensor} is {q.upper()}, which has no GPU kernel yet")
        return q

    def int8(self, tensor: str) -> bool:
        return self.qname(tensor) in INT8_FORMATS

    def project(self, seq, tensor: str, y, x: Vector, t: int = 1, add: bool = False, exact: bool = False,
                label: str = "") -> None:
        """y rows (+)= W · x rows for t rows, each weight read once for all of them, on the kernel
        made for that many: dmmv's columns up to 8, past them mul_mm's tiles, or matrix units
        (mul_mm_coop) where the device has them and x comes in f16 too. int8 products where the
        weight type has an int8 decoder and x comes in Q8_1, else f32; `exact` keeps x in f32 (the
        router: an expert chosen by a rounding would change the whole block)."""
        m, k = self.tensors.shape(tensor)[-2:]
        label = label + tensor.removesuffix(".weight")
        q8 = self.int8(tensor) and x.q is not None and not exact
        xs = dict(xq=x.q, xd=x.d) if q8 else dict(x=x.f32)
        if self.dmmv_takes(t):
            dmmv.dmmv.launch(seq, self.pick, label=label, QTYPE=self.qname(tensor), Q8=q8, COLS=t, ADD=add,
                             w=self.weights[tensor], y=y, k=k, m=m, **xs)
        elif self.coop(k) and x.h is not None and not exact:
            matmul.mul_mm_coop.launch(seq, self.pick, label=label, QTYPE=self.qname(tensor), ADD=add,
                                      w=self.weights[tensor], x=x.h, y=y, k=k, m=m, t=t)
        else:
            matmul.mul_mm.launch(seq, self.pick, label=label, QTYPE=self.qname(tensor), Q8=q8, ADD=add,
                                 w=self.weights[tensor], y=y, k=k, m=m, t=t, **xs)

    def dmmv_takes(self, t: int) -> bool:
        """Whether a product of t rows runs on dmmv's columns: up to 8 of them, and on a CPU device
        (lavapipe) one only. dmmv's column count is a Const, so each row count a run meets is a
        compile of its own (seconds there), where mul_mm's tile takes any count at run time; and
        a CPU reads the weights at one pace either way."""
        return t == 1 or (t <= DMMV_COLS and not self.on_cpu)

    @property
    def on_cpu(self) -> bool:
        """Whether the device is a CPU (lavapipe), where a kernel's compile outweighs its runs."""
        return self.info.device_type == "cpu"

    def coop(self, k: int) -> bool:
        """Whether products over k inputs run on matrix units here (whole K steps: mma.py)."""
        return "coopmat" in self.info.features and k % mma.BK == 0

    def project_two(self, seq, tensor: str, y, tensor2: str, y2, a, t: int) -> None:
        """y = W · normed and y2 = W2 · normed: one dispatch for one row where both types have
        int8 decoders (dmmv_q8_pair), else one each."""
        if t > 1 or not (self.int8(tensor) and self.int8(tensor2)):
            self.project(seq, tensor, y, a.normed, t)
            self.project(seq, tensor2, y2, a.normed, t)
            return
        (m, k), (m2, _) = self.tensors.shape(tensor)[-2:], self.tensors.shape(tensor2)[-2:]
        label = tensor.removesuffix(".weight") + "+" + tensor2.split(".")[-2]
        dmmv.dmmv_q8_pair.launch(seq, self.pick, label=label, QTYPE=self.qname(tensor), QTYPE2=self.qname(tensor2),
                                 w=self.weights[tensor], w2=self.weights[tensor2], xq=a.normed.q, xd=a.normed.d,
                                 y=y, y2=y2, k=k, m=m, m2=m2)

    def residual(self, seq, tensor: str, x: Vector, next_norm: str | None, a, t: int) -> None:
        """x += W · input, then the next projections' normed input from x (rmsnorm(x) · next_norm),
        unless the next consumer norms x itself (None: the MoE router)."""
        self.project(seq, tensor, a.x, x, t, add=True)
        if next_norm is not None:
            self.norm(seq, next_norm, a, t)

    def post_attention_norm(self, i: int) -> str | None:
        """The norm after layer i's mixer, where it needs a dispatch of its own (the MoE router
        norms its input itself)."""
        return None if self.hp.moe else f"blk.{i}.post_attention_norm.weight"

    def norm(self, seq, norm: str, a, t: int, x=None) -> None:
        """normed = rmsnorm(x) · norm, in f32 and Q8_1, for t rows: a workgroup a row (x: a.x
        unless given)."""
        n = a.normed
        q8_1.norm_q8_1.launch(seq, self.pick, label=norm.removesuffix(".weight"), x=a.x if x is None else x,
                              norm_w=self.weights[norm],
                              hn=n.f32, xq=n.q, xd=n.d, HALVES=False, n=self.hp.hidden, eps=self.hp.eps, rows=t)

    def next_norm(self, i: int) -> str:
        """The norm that the layer after layer i starts with (the output norm after the last; after
        the MTP head's block, the block after the last, its own where the file has it: mtp.py)."""
        if i + 1 < self.hp.n_layers:
            return f"blk.{i + 1}.attn_norm.weight"
        head_norm = f"blk.{i}.nextn.shared_head_norm.weight"
        return head_norm if i == self.hp.n_layers and head_norm in self.tensors else "output_norm.weight"

    def record_layers(self, seq, rows: list, a, row_seq=None) -> None:
        """The step after the embedding, one token a row of a's activations (x holds their
        embeddings), with this graph's weights: the layer order (`layer_order`) on `RowBlocks`,
        then the head and each row's draw. rows[r] = (graph, step): the sequence whose caches and
        states row r's token reads and writes, and the step values its kernels read (its
        position, length, token). `row_seq(r)`, where given, is what row r's launches record into
        (batch.py: indirect dispatches)."""
        blocks = RowBlocks(self, seq, rows, a, row_seq)
        layer_order(seq, self.hp, blocks, len(rows))
        self.project(seq, self.tensors.output_name, a.logits, a.normed, len(rows))
        blocks.each(seq, [g.sample(a.logits, r, a.cands[r], step) for r, (g, step) in enumerate(rows)])

    def attend_together(self, i: int, a, rows: list, steps):
        """Layer i's attention of a step's rows (graph, step values) as one launch a stage
        (attend()): row r's cache (its graph's: a batch's sequences' own, or one sequence's for
        all its tokens) and a's partials row r bound as the pieces of one buffer each, `steps`
        the rows' step values so joined (joined_steps). None where one is in pieces already."""
        joined = joined_per_sequence(self.device, {f"k_cache.{i}": [g.kv[i][0] for g, _ in rows],
                                      f"v_cache.{i}": [g.kv[i][1] for g, _ in rows],
                                      f"attn_partials.{i}": a.parts[:len(rows)]})
        return joined and self.attend(i, a, 0, steps, sequences=(*joined, len(rows)))

    def attend(self, i: int, a, row: int, step, sequences=None) -> list:
        """Layer i's attention for this graph's sequence, as three launches to record in order
        (each a function of the sequence): q, k and v normed and rotated, k and v into the cache;
        the splits of the cache; their merge, gated, into o. They read q·gate, k and v at row
        `row` of a's qg, k and v and write that row of a's q and attn_o (a Vector), with a's
        parts[row] for the splits: the graph's own rows, or a batch's (record_layers); the token's
        position and length in `step`. `sequences` (attend_together): (K caches, V caches,
        partials, the bytes between two rows' in them, how many) of that many rows from `row` on
        in each launch instead, `step` their step values."""
        hp, p = self.hp, f"blk.{i}."
        nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        k_cache, v_cache, part, stride, n = sequences or (*self.kv[i], a.parts[row], 0, 1)
        together = dict(seq_bytes=stride, sequences=n)
        kt, vt = self.kv_types
        o = a.attn_o
        return [
            lambda seq: attention.attn_prep.launch(
                seq, self.pick, label=p + "attn_prep", KT=kt, VT=vt, qg=a.qg, k=a.k, v=a.v,
                q_norm=self.weights[p + "attn_q_norm.weight"], k_norm=self.weights[p + "attn_k_norm.weight"],
                step=step, q=a.q, k_cache=k_cache, v_cache=v_cache, n_head=nh, n_kv=nkv, d=d,
                rope_dims=hp.rope_dims, rope_base=hp.rope_base, eps=hp.eps, row=row, **together),
            lambda seq: attention.attn_decode.launch(
                seq, self.pick, label=p + "attn_decode", D=d, G=nh // nkv, KT=kt, VT=vt, q=a.q, k_cache=k_cache,
                v_cache=v_cache, step=step, part=part, n_kv=nkv, min_chunk=ATTN_MIN_CHUNK,
                nsplit=self.attn_splits, ctx=self.n_ctx, row=row, **together),
            lambda seq: attention.attn_combine.launch(
                seq, self.pick, label=p + "attn_combine", D=d, Q8=self.int8(p + "attn_output.weight"), VT=vt,
                part=part, qg=a.qg, step=step, o=o.f32, oq=o.q, od=o.d, nsplit=self.attn_splits,
                min_chunk=ATTN_MIN_CHUNK, n_head=nh, ctx=self.n_ctx, row=row, **together)]

    def delta_steps(self, i: int, a, rows: list, steps):
        """Layer i's delta-net step of a batch's sequences (rows: graph, step values; one token
        each) as one launch: their rings and states, each sequence's own buffers, bound as the
        pieces of one each, `steps` their step values so joined. None where one is in pieces."""
        joined = joined_per_sequence(self.device, {f"conv_state.{i}": [g.conv_state[i] for g, _ in rows],
                                      f"ssm_state.{i}": [g.ssm_state[i] for g, _ in rows]})
        return joined and self.delta_step(i, a, 0, steps, sequences=(*joined, len(rows)))

    def delta_step(self, i: int, a, row: int, step, rows: int = 1, sequences=None):
        """Layer i's delta-net step for this graph's sequence, as a launch to record (a function of
        the sequence): each head's gates β and α, the conv of the channels it reads and the delta
        rule, in one dispatch, for `rows` tokens at positions step[0] … step[0] + rows − 1 in
        order (the state carried from one to the next in the workgroup), reading rows row …
        row + rows − 1 of a's mix, z and normed (a Vector) and writing those of a's dn_out
        (attend() says why a). `sequences` (delta_steps): (rings, states, the bytes between two
        sequences' in them, how many) of several sequences stepping together instead."""
        hp, p = self.hp, f"blk.{i}."
        gates = p + "ssm_beta_alpha.weight"
        x, o = a.normed, a.dn_out
        conv, state, stride, n = sequences or (self.conv_state[i], self.ssm_state[i], 0, 1)
        return lambda seq: deltanet.deltanet_step.launch(
            seq, self.pick, label=p + "ssm_conv+step", D=hp.ssm_head_dim, KC=hp.conv_kernel,
            Q8=self.int8(p + "ssm_out.weight"), QTYPE=self.qname(gates), v_heads=hp.ssm_v_heads, mix=a.mix,
            conv_w=self.weights[p + "ssm_conv1d.weight"], conv_state=conv, step=step, z=a.z,
            w_ba=self.weights[gates], x=x.f32, xq=x.q, xd=x.d, ssm_a=self.weights[p + "ssm_a"],
            dt_bias=self.weights[p + "ssm_dt.bias"], norm_w=self.weights[p + "ssm_norm.weight"],
            state=state, out=o.f32, oq=o.q, od=o.d, n_k_heads=hp.ssm_k_heads, k=hp.hidden, eps=hp.eps,
            conv_slots=self.conv_slots, state_slots=self.state_slots, row=row, rows=rows, MANY=rows > 1,
            seq_bytes=stride, sequences=n,
            **({"TOKENS": deltanet.tokens_at_once(rows, self.on_cpu)} if rows > 1 else {}))

    def gate_up(self, gate: str, up: str, slots: int, experts: bool, a, row: int, act_stride: int, act=None,
                 label: str | None = None, rows: int = 1):
        """A launch (a function of the sequence): act = silu(gate · normed) · (up · normed) per slot
        for row `row` of a: the experts in a.route_ids (MoE; the shared expert is the stacks'
        last, slot K, unless it has a type of its own) or the one pair (a dense FFN, a shared
        expert of its own type); into `act` (a's act by default), act_stride values a row; `rows`
        rows from `row` on."""
        m, k = self.tensors.shape(gate)[-2:]
        q, q_up = self.qname(gate), self.qname(up)
        if self.tensors.shape(up)[-2:] != (m, k):
            raise ZdslError(f"{up} {list(reversed(self.tensors.shape(up)[-2:]))} differs in shape from {gate} "
                            f"{[k, m]}; a SwiGLU's gate and up have one shape")
        q8 = self.int8(gate) and self.int8(up)
        two = dict(QTYPE_UP=q_up) if q_up != q else {}  # named only where it differs: one type keeps its tuning key
        x = a.normed
        return lambda seq: ffn.ffn_gate_up.launch(
            seq, self.pick, label=label or gate.removesuffix(".weight") + "+up", QTYPE=q, Q8=q8, EXPERTS=experts,
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
            seq, self.pick, label=p + "ffn_gate_inp+moe_route", QTYPE=self.qname(router), K=K,
            w=self.weights[router], x=a.x, norm_w=self.weights[p + "post_attention_norm.weight"], hn=a.normed.f32,
            xq=a.normed.q, xd=a.normed.d, logits=a.router, arrivals=a.arrivals, ids=a.route_ids, weights=a.route_w,
            k=self.tensors.shape(router)[-1], n_expert=E, eps=hp.eps, row=row, rows=rows)]
        apart = p + "ffn_gate_shexp.weight" in self.tensors  # a type of its own (weights.py): one more dispatch
        gate, up = p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"
        launches.append(self.gate_up(gate, up, K if apart else K + 1, True, a, row, stride,
                                      label=p + "ffn_gate_exps+up" + ("" if apart else "+shexp"), rows=rows))
        if apart:
            launches.append(self.gate_up(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", 1, False, a, row,
                                          stride, act=act_shared, rows=rows))
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        md, kd = self.tensors.shape(down)[-2:]
        qd = self.qname(down)
        qs = self.qname(down_sh) if down_sh in self.tensors else ""  # "": the stack's last expert
        fd, fs = FORMATS[qd], FORMATS[qs or qd]
        if (fd.block, fd.parts) != (fs.block, fs.parts) or (qs and self.tensors.shape(down_sh)[-1] != kd):
            def down_of(tensor, ids, weights, act, slots):
                m, k = self.tensors.shape(tensor)[-2:]
                return lambda seq: ffn.moe_down.launch(
                    seq, self.pick, label=tensor.removesuffix(".weight"), QTYPE=self.qname(tensor), ADD=True,
                    w=self.weights[tensor], ids=ids, weights=weights, act=act, y=a.x, k=k, m=m, slots=slots, row=row,
                    rows=rows, ids_stride=K + 1, act_stride=stride)

            weights_shared = a.route_w.slice(4 * K, a.route_w.nbytes - 4 * K)
            launches += [down_of(down, a.route_ids, a.route_w, a.act, K),
                         down_of(down_sh, a.zero_id, weights_shared, act_shared, 1)]
        else:
            launches.append(lambda seq: ffn.moe_down_all.launch(
                seq, self.pick, label=p + "ffn_down_exps+shexp", QTYPE=qd, QTYPE_SH=qs, K=K, w=self.weights[down],
                w_sh=self.weights[down_sh] if qs else self.device.placeholder, ids=a.route_ids, weights=a.route_w,
                act=a.act, y=a.x, k=kd, m=md, row=row, rows=rows))
        return launches


    def window(self, seq) -> None:
        """The step's input token into the penalties' window (where the sampler has penalties)."""
        if self.sampler.penalties:
            sampling.penalty_window.launch(seq, self.pick, step=self.step, ring=self.penalty_ring, counts=self.counts,
                                           window=self.sampler.window(self.n_ctx), n_vocab=self.hp.vocab, t=1)

    def finish_step(self, seq) -> None:
        """Position and length on to the next token, and the step values back to the host."""
        steps.advance.launch(seq, self.pick, step=self.step)
        seq.copy(self.step, self.step_host)

    def sample_row(self, seq, x) -> None:
        """The end of a step for a residual row made elsewhere (x: a prompt chunk's last row,
        prefill.py): the output norm, the head, the draw into the step values (which the
        sequence copied from the host), those on to the next token and back to the host."""
        a = self.own_rows
        self.norm(seq, "output_norm.weight", a, 1, x=x)
        self.project(seq, self.tensors.output_name, a.logits, a.normed)
        for launch in self.sample(a.logits, 0, a.cands[0], self.step):
            launch(seq)
        self.finish_step(seq)

    def sample(self, logits, row: int, cand, step) -> list:
        """The next token of this graph's sequence from row `row` of `logits`, with this graph's
        sampler, as two launches to record in order: the candidates into `cand`, then the draw
        into the step values `step` (its token and counter) and tokens_out (at its position)."""
        cap, vocab, settings = self.sampler.kernel_cap, self.hp.vocab, self.sampler_settings
        return [lambda seq: sampling.sample_candidates.launch(seq, self.pick, CAP=cap, logits=logits,
                                                              bias=self.logit_bias, counts=self.counts,
                                                              allowed=self.allowed, cand=cand, settings=settings,
                                                              n_vocab=vocab, row=row),
                lambda seq: sampling.sample_draw.launch(seq, self.pick, CAP=cap, WG=self.sample_pass.params["WG"],
                                                        R=self.sample_pass.params["R"], cand=cand, step=step,
                                                        tokens=self.tokens_out, settings=settings, n_vocab=vocab,
                                                        max_tokens=self.n_ctx)]


def joined_per_sequence(device, buffers: dict[str, list]) -> tuple | None:
    """Each name's buffers (a sequence's each) as the pieces of one, all at one piece size, so that
    one stride (the last value) finds a sequence's own in every one of them; None where a buffer is
    in pieces already (bound a launch a sequence then)."""
    every = [b for bufs in buffers.values() for b in bufs]
    if any(hasattr(b, "pieces") for b in every):
        return None
    piece = 1 << (max(b.nbytes for b in every) - 1).bit_length()
    return (*[device.joined(bufs, piece, f"{name} of {len(bufs)}") for name, bufs in buffers.items()], piece)


def joined_steps(device, rows: list):
    """The rows' step values (each its own buffer or slice) as the pieces of one, a row's
    STEP_WORDS apart, as a launch of several sequences reads them (steps.sequences_of); None where
    one is longer."""
    if any(hasattr(step, "pieces") or step.nbytes > 4 * steps.STEP_WORDS for _, step in rows):
        return None
    return device.joined([step for _, step in rows], 4 * steps.STEP_WORDS, f"step values of {len(rows)} rows")


def step_rows(chunk, b: dict, n: int, experts: bool, prefix: str = "") -> SimpleNamespace:
    """The activations of a step of n rows (RowBlocks' `a`): the prompt chunk's rows of the
    residual stream, norms and projections' outputs (prefill.Prefill `chunk`), and the buffers one
    row's launches write that no other may, `b`'s of buffers.row_buffers named with `prefix`
    (`experts`: the MoE's routing rows too). The vectors come without the chunk's f16 rows: a
    step's kernels write f32 and Q8_1 only, so its products past dmmv's columns run on mul_mm,
    never on matrix units reading f16 rows left by an earlier chunk."""
    rows = SimpleNamespace(x=chunk.x, normed=replace(chunk.normed, h=None), qg=chunk.qg,
                           q=chunk.q, k=chunk.k, v=chunk.v, attn_o=replace(chunk.attn_o, h=None), mix=chunk.mix,
                           z=chunk.z, dn_out=replace(chunk.dn_out, h=None),
                           logits=b[prefix + "logits"], parts=[b[f"{prefix}attn_partials.{r}"] for r in range(n)],
                           cands=[b[f"{prefix}candidates.{r}"] for r in range(n)],
                           act=b[prefix + ("expert_act" if experts else "ffn_act")])
    if experts:
        rows.__dict__.update({name: b[prefix + buffer] for name, buffer in (
            ("router", "router_logits"), ("arrivals", "router_arrivals"), ("route_ids", "route_ids"),
            ("route_w", "route_weights"), ("zero_id", "zero_id"))})
    return rows


def layer_order(seq, hp, blocks, t: int) -> None:
    """The model's layers in order, the one place the order is written: the first layer's norm,
    then for each layer its mixer (gated attention or the gated delta-net: projections, the mixer,
    the output projection added to the residual) and its FFN (the MoE block or a dense SwiGLU,
    added to the residual), each leaving the norm the next block reads. `blocks` records each
    block for t rows on the kernels made for the step's shape: RowBlocks for a step of a few rows
    (one token, a speculative step, a batch), prefill.Prefill for a prompt's chunk."""
    blocks.norm(seq, "blk.0.attn_norm.weight", t)
    for i in range(hp.n_layers):
        (blocks.attention if hp.attention[i] else blocks.deltanet)(seq, i, t)
        (blocks.moe if hp.moe else blocks.ffn)(seq, i, t)


class RowBlocks:
    """The blocks of a step of a few rows (layer_order): every projection once for all rows
    (dmmv's columns, mul_mm past them); the experts of all rows in one launch each, and
    attention one launch a stage, the grid's z a row: each row's cache (its sequence's), partials
    and step values bound as the pieces of one buffer each. The delta-net of a batch's sequences
    in one launch the same way; of several tokens of a sequence, one launch that runs its rows
    in order (each from the state the one before left, in registers), the sequences' launches
    with no barrier between them (a mixed step: some sequences one token, some several). Where
    rows dispatch indirect, or a cache is in pieces already, a launch a row, a stage's launches
    with no barrier between them. The draw a launch a row."""

    def __init__(self, g, seq, rows: list, a, row_seq=None):
        self.g, self.rows, self.a, self.row_seq = g, rows, a, row_seq
        self.at_row = row_seq or (lambda r: seq)
        self.each = functools.partial(_each, row_seq=self.at_row)
        self.runs: list[list] = []  # [graph, first row, rows] of each sequence: its rows consecutive
        for r, (graph, _) in enumerate(rows):
            if self.runs and self.runs[-1][0] is graph:
                self.runs[-1][2] += 1
            else:
                self.runs.append([graph, r, 1])
        if len(self.runs) != len({id(graph) for graph, _ in rows}):
            raise ZdslError("a step's rows of one sequence are consecutive")
        # rows whose launches go out direct join their step values once, for attention a launch a
        # stage and, a batch's sequences one token each, the delta-net one launch
        self.steps = joined_steps(g.device, rows) if len(rows) > 1 and not row_seq else None

    def _by_row(self, seq, launches_of) -> None:
        t = len(self.rows)
        if self.row_seq:
            self.each(seq, [launches_of(r, 1) for r in range(t)])
        else:
            for launch in launches_of(0, t):
                launch(seq)

    def norm(self, seq, norm: str, t: int) -> None:
        self.g.norm(seq, norm, self.a, t)

    def attention(self, seq, i: int, t: int) -> None:
        g, a, p = self.g, self.a, f"blk.{i}."
        for name, out in (("attn_q", a.qg), ("attn_k", a.k), ("attn_v", a.v)):
            g.project(seq, p + name + ".weight", out, a.normed, t)
        together = self.steps and g.attend_together(i, a, self.rows, self.steps)
        if together:  # the rows attend in one launch a stage
            for launch in together:
                launch(seq)
        else:
            self.each(seq, [graph.attend(i, a, r, step) for r, (graph, step) in enumerate(self.rows)])
        g.residual(seq, p + "attn_output.weight", a.attn_o, g.post_attention_norm(i), a, t)

    def deltanet(self, seq, i: int, t: int) -> None:
        g, a, p = self.g, self.a, f"blk.{i}."
        g.project_two(seq, p + "attn_qkv.weight", a.mix, p + "attn_gate.weight", a.z, a, t)
        together = self.steps and len(self.runs) == t and g.delta_steps(i, a, self.rows, self.steps)
        if together:  # a batch whose rows step in one launch
            together(seq)
        else:  # a launch a sequence running its rows in order, from its first row's step values (p0)
            with seq.together():
                for graph, r, n in self.runs:
                    graph.delta_step(i, a, r, self.rows[r][1], rows=n)(self.at_row(r))
        g.residual(seq, p + "ssm_out.weight", a.dn_out, g.post_attention_norm(i), a, t)

    def moe(self, seq, i: int, t: int) -> None:
        g, a = self.g, self.a
        self._by_row(seq, lambda r, rows: g.experts(i, a, r, rows))
        g.norm(seq, g.next_norm(i), a, t)

    def ffn(self, seq, i: int, t: int) -> None:
        g, a, p = self.g, self.a, f"blk.{i}."
        self._by_row(seq, lambda r, rows: [g.gate_up(p + "ffn_gate.weight", p + "ffn_up.weight", 1, False, a, r,
                                                     g.hp.ffn, rows=rows)])
        g.residual(seq, p + "ffn_down.weight", Vector(a.act, None, None), g.next_norm(i), a, t)


def _each(seq, launches: list[list], row_seq) -> None:
    """The rows' launches (a list per row, in its order), stage by stage: a stage's launches of
    all rows with no barrier between them (they touch disjoint rows and their own caches and
    states: Sequence.together); row r's recorded into row_seq(r)."""
    for stage in zip(*launches):
        with seq.together():
            for r, launch in enumerate(stage):
                launch(row_seq(r))
