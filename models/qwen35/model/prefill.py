"""Batched prefill: a prompt's tokens through the model a chunk at a time, not a step per token.

A chunk of t tokens at positions p0 … p0 + t − 1 is one recorded sequence (one per chunk length,
kept for reuse) over the decode graph's weights, caches and states: the embedding rows, then
the layers in the schedule's order (schedule.layer_order), this module giving each block on the
kernels made for a chunk's rows: the norms and projections for all t rows at once (the
schedule's `project`: `matmul.mul_mm`, a weight block loaded once serving a tile of tokens, or
`mul_mm_coop` on matrix units; dmmv's columns for a chunk of 8 tokens or fewer), the
delta-net's conv and gated norm for all t rows and its delta rule in blocks of 64 tokens (the WY
form: `deltanet.deltanet_chunk_wy`, `deltanet_chunk_scan`), the MoE block with each picked
expert's weights read once for all the tokens routed to it (moe_route_rows, moe_group, the grouped
products, moe_combine_rows; a dense FFN is the grouped gate·up with every token routed to its one
pair of matrices), and causal attention of the chunk's queries over the cache (attn_prep_rows,
attn_prefill). The chunk leaves the caches and states as t decode steps would, up to rounding, so
decoding continues from them; the last prompt token goes through the ordinary decode step, whose
logits give the first generated token. Its buffers are planned with the decode graph's (buffers.chunk_buffers).
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels import attention, deltanet, embedding, ffn, matmul, moe, q8_1, sampling
from zdsl.kernels.quant_numpy import row_bytes
from zdsl.kernels.steps import STEP_WORDS
from zdsl.models.qwen35.model.schedule import layer_order

ROW_ALIGN = 256  # regions of the host buffer start at multiples of this (any device binds them)
KEPT_LENGTHS = 4  # recorded chunks kept of lengths other than the full chunk


def aligned(nbytes: int) -> int:
    return -(-nbytes // ROW_ALIGN) * ROW_ALIGN


class Prefill:
    """The prompt path of a DecodeGraph `g` (DecodeGraph.prefill runs it)."""

    def __init__(self, g, b: dict):
        self.g, self.hp, self.chunk = g, g.hp, g.chunk
        self.tokens, self.steps = b["chunk.tokens"], b["chunk.steps"]
        # the host writes each chunk's step values (position, length, token per row), then its tokens
        # and the grouping of every token to one expert (one_offsets, one_pairs)
        self.tokens_at = aligned(4 * STEP_WORDS * self.chunk)
        self.one_at = self.tokens_at + aligned(4 * self.chunk)
        self.host = g.device.host_buffer(self.one_at + ROW_ALIGN + 4 * self.chunk, name="chunk_host")
        self.host_words = self.host.view(np.uint32)
        self.host_words[(self.one_at + ROW_ALIGN) // 4:] = np.arange(self.chunk)  # token i's one pair is i
        self.x = b["chunk.x"]
        self.normed = g.vector_of(b, "chunk.normed")
        self.qg, self.q, self.k, self.v = b["chunk.qg"], b["chunk.q"], b["chunk.k"], b["chunk.v"]
        self.attn_o = g.vector_of(b, "chunk.attn_o")
        self.mix, self.conv, self.z, self.ba = b["chunk.mix"], b["chunk.conv"], b["chunk.z"], b["chunk.ba"]
        self.dn_out = g.vector_of(b, "chunk.deltanet_out")
        self.dn_raw = self.qg  # the delta rule's raw o: attention's rows are free in a delta-net layer
        self.wy = self.q  # the delta rule's WY terms: attention's roped q rows are free too
        self.act = b["chunk.act"]
        self.act_h = b.get("chunk.act_f16")  # the dense FFN's act in f16 (matrix units)
        # every token of the chunk routed once to one expert: the shared expert's grouping, and
        # the dense FFN's (the host writes offsets [0, t] and pairs 0 … t − 1)
        self.one_offsets, self.one_pairs = b["chunk.one_offsets"], b["chunk.one_pairs"]
        if self.hp.moe:
            self.logits, self.counts = b["chunk.router_logits"], b["chunk.expert_counts"]
            self.route_ids, self.route_w = b["chunk.route_ids"], b["chunk.route_weights"]
            self.offsets, self.pairs = b["chunk.expert_offsets"], b["chunk.pairs"]
            self.y, self.act_shared, self.y_shared = b["chunk.pair_out"], b["chunk.act_shared"], b["chunk.shared_out"]
        # products on matrix units where the device has them (mma.py); K steps of whole blocks
        self.coop = "coopmat" in g.device.info.features
        # by (chunk length, whether it samples), most recently run last
        self._seqs: OrderedDict[tuple[int, bool], object] = OrderedDict()

    # -- running ----------------------------------------------------------------------------
    def run(self, tokens: list[int], sample: bool = False) -> int | None:
        """Feed `tokens` at the graph's position, chunk by chunk; with `sample`, the last chunk
        also makes the last token's logits and draws the next token from them, as a decode step
        of that token would, and returns it (DecodeGraph.sample_row): a prompt then costs no
        decode step of its own, whose weights alone take about as long to read as 20 prompt
        tokens take (the 35B-A3B on the H100: 2.8 ms). A chunk length's recording is kept for
        the next prompt that ends on it; the full chunk's and the last few others', not one per
        length ever seen (a chat or a server sees hundreds)."""
        token = None
        for at in range(0, len(tokens), self.chunk):
            part = tokens[at:at + self.chunk]
            key = (len(part), sample and at + self.chunk >= len(tokens))
            seq = self._seqs.pop(key, None)
            self._seqs[key] = seq = seq if seq is not None else self.record(*key)
            token = self._run(seq, part, key[1])
            partial = [k for k in self._seqs if k[0] != self.chunk]
            for k in partial[:max(0, len(partial) - KEPT_LENGTHS)]:
                self._seqs.pop(k).free()
        return token

    def profile(self, tokens: list[int]) -> list[tuple[str, float]]:
        """Run one chunk of `tokens` recorded with a GPU timestamp after every command; returns
        (label, GPU ms) of each. The chunk advances the state as `run` does."""
        if not 0 < len(tokens) <= self.chunk:
            raise ZdslError(f"a profiled prompt chunk holds 1 to {self.chunk} tokens, not {len(tokens)}")
        seq = self.record(len(tokens), timestamps=True)
        try:
            self._run(seq, tokens)
            return seq.timings()
        finally:
            seq.free()

    def _run(self, seq, part: list[int], sample: bool = False) -> int | None:
        g, t, p0 = self.g, len(part), self.g.position
        words = self.host_words
        words[self.tokens_at // 4:self.tokens_at // 4 + t] = part
        words[self.one_at // 4:self.one_at // 4 + 2] = (0, t)
        steps = words[:STEP_WORDS * self.chunk].reshape(self.chunk, STEP_WORDS)
        steps[:t] = 0
        steps[:t, 0] = np.arange(p0, p0 + t)
        steps[:t, 1] = steps[:t, 0] + 1
        steps[:t, 2] = part
        if sample:  # the step values of the last token's draw, as decode(part[-1]) writes them
            w = g.step_words
            w[0], w[1], w[2] = p0 + t - 1, p0 + t, part[-1]
        seq.run()
        g.position += t
        g.synced = sample  # after a draw, as after a decode step, the GPU holds the sequence's step values
        return int(g.step_words[2]) if sample else None

    def clear(self, seq) -> None:
        """Record the zeroing of the counters the chunk's kernels expect at 0 (and leave at 0)."""
        if self.hp.moe:
            seq.fill(self.counts)

    def forget(self) -> None:
        """Free the recorded chunks (recorded again when next run)."""
        for seq in self._seqs.values():
            seq.free()
        self._seqs.clear()

    def free(self) -> None:
        self.forget()
        self.host.free()

    # -- recording --------------------------------------------------------------------------
    def record(self, t: int, sample: bool = False, timestamps: bool = False):
        """The sequence of one chunk of t tokens, recorded and not run (on a DryDevice: the
        launches `zdsl tune --prompt` tunes); with `sample`, the draw from the last token's logits
        after it (run)."""
        g, hp = self.g, self.hp
        seq = g.device.sequence(timestamps=timestamps)
        if sample:
            seq.copy(g.step_host, g.step)
        seq.copy(self.host.slice(0, 4 * STEP_WORDS * self.chunk), self.steps, 4 * STEP_WORDS * t)
        seq.copy(self.host.slice(self.tokens_at, 4 * self.chunk), self.tokens, 4 * t)
        seq.copy(self.host.slice(self.one_at, ROW_ALIGN), self.one_offsets, 8)
        seq.copy(self.host.slice(self.one_at + ROW_ALIGN, 4 * self.chunk), self.one_pairs, 4 * t)
        if g.sampler.penalties:  # the prompt's tokens enter the penalties' window
            sampling.penalty_window.launch(seq, g.pick, step=self.steps, ring=g.penalty_ring, counts=g.counts,
                                           window=g.sampler.window(g.n_ctx), n_vocab=hp.vocab, t=t)
        emb = "token_embd.weight"
        embedding.embed.launch(seq, g.pick, QTYPE=g.qname(emb), table=g.weights[emb], ids=self.tokens, out=self.x,
                               k=hp.hidden, index=0, rows=t)
        layer_order(seq, hp, self, t)  # the blocks on kernels made for a chunk's rows (below)
        if sample:
            g.sample_row(seq, self.x.slice(4 * hp.hidden * (t - 1), 4 * hp.hidden))
        return seq

    def norm(self, seq, norm: str, t: int, x=None) -> None:
        """normed = rmsnorm(x) · norm for the chunk's t rows (x: the residual rows unless given)."""
        n = self.normed
        q8_1.norm_q8_1.launch(seq, self.g.pick, label="chunk." + norm.removesuffix(".weight"),
                              x=self.x if x is None else x,
                              norm_w=self.g.weights[norm], hn=n.f32, xq=n.q, xd=n.d, **self._halved(n),
                              n=self.hp.hidden, eps=self.hp.eps, rows=t)

    @staticmethod
    def _halved(v) -> dict:
        """A norm's arguments that make v's f16 rows too, where products on matrix units read them."""
        return dict(HALVES=True, h=v.h) if v.h is not None else dict(HALVES=False)

    def _halves(self, seq, v, n: int) -> None:
        """v's f16 rows from its f32 ones, where products on matrix units read them (n values)."""
        if v.h is not None:
            matmul.half_rows.launch(seq, self.g.pick, x=v.f32, h=v.h, n=n)

    def project(self, seq, tensor: str, y, t: int, x=None, add: bool = False, exact: bool = False) -> None:
        """y rows (+)= W · x rows for the chunk's t tokens (x: the normed rows by default), on the
        kernel the schedule picks for t rows (LayerSchedule.project)."""
        self.g.project(seq, tensor, y, x or self.normed, t, add, exact, label="chunk.")

    def _gate_up(self, seq, label: str, names: tuple[str, str], wg, wu, offsets, pairs, act, topk: int, t: int,
                 n_expert: int) -> None:
        """act = silu(Wg·x) · (Wu·x) for each pair (offsets, pairs: grouped by expert) of the
        normed rows x; `names` are the gate and up tensors whose types and shape the weights
        have. On matrix units where the device has them, even for routed experts' few tokens each
        (16 on average in a 512-token chunk of the 35B-A3B): with staged loads (mma.Staged) the
        chunk is 2% faster than on the int8 kernel (pp512 4,909 against 4,813 tok/s on the H100).
        Gate and up of two types take the grouped kernel, a decoder each."""
        g, n = self.g, self.normed
        gate, up = names
        m, k = g.tensors.shape(gate)[-2:]
        q, q_up = g.qname(gate), g.qname(up)
        sizes = dict(label=label, QTYPE=q, wg=wg, wu=wu, offsets=offsets, pairs=pairs, act=act, k=k, m=m, topk=topk,
                     t=t, n_expert=n_expert)
        if q_up != q:  # gate and up of two types: the grouped kernel, a decoder each
            sizes["QTYPE_UP"] = q_up
        if self.g.coop(k) and q_up == q:
            ffn.moe_gate_up_coop.launch(seq, g.pick, x=n.f32, **self._spread(n_expert), **sizes)
        elif g.int8(gate) and g.int8(up):
            ffn.moe_gate_up_grouped.launch(seq, g.pick, Q8=True, xq=n.q, xd=n.d, **sizes)
        else:
            ffn.moe_gate_up_grouped.launch(seq, g.pick, Q8=False, x=n.f32, **sizes)

    def _down(self, seq, label: str, qtype: str, w, offsets, pairs, act, y, k: int, m: int, topk: int, t: int,
              n_expert: int) -> None:
        """y = W_e · act for each pair of expert e (grouped as for _gate_up)."""
        sizes = dict(label=label, QTYPE=qtype, w=w, offsets=offsets, pairs=pairs, act=act, y=y, k=k, m=m, t=t,
                     n_expert=n_expert, topk=topk)
        if self.g.coop(k):
            ffn.moe_down_coop.launch(seq, self.g.pick, **self._spread(n_expert), **sizes)
        else:
            ffn.moe_down_grouped.launch(seq, self.g.pick, **sizes)

    def _spread(self, n_expert: int) -> dict:
        """One expert that every token routes to (the shared expert, a dense FFN) gets a workgroup
        per tile of 16 tokens (the smaller tile; with larger ones the spare workgroups find no
        tile), as a plain product would; routed experts keep the tuner's choice."""
        return dict(SPLIT=-(-self.chunk // 16)) if n_expert == 1 else {}

    def _after_mixer(self, seq, i: int, t: int) -> None:
        if not self.hp.moe:  # the MoE block norms x as its first step
            self.norm(seq, f"blk.{i}.post_attention_norm.weight", t)

    def attention(self, seq, i: int, t: int) -> None:
        """q, k and v for the chunk, normed and rotated, k and v into the cache rows p0 … p0 + t − 1
        (attn_prep_rows), then causal attention of the t queries over the cache (attn_prefill, on
        matrix units where the device has them: attn_prefill_coop), both reading the cache in
        its formats (kernels/kvcache.py)."""
        g, hp, p = self.g, self.hp, f"blk.{i}."
        nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        for name, out in (("attn_q", self.qg), ("attn_k", self.k), ("attn_v", self.v)):
            self.project(seq, p + name + ".weight", out, t)
        k_cache, v_cache = g.kv[i]
        step, (kt, vt) = self.steps, g.kv_types
        attention.attn_prep_rows.launch(
            seq, g.pick, label=p + "attn_prep_rows", KT=kt, VT=vt, qg=self.qg, k=self.k, v=self.v,
            q_norm=g.weights[p + "attn_q_norm.weight"], k_norm=g.weights[p + "attn_k_norm.weight"], step=step,
            q=self.q, k_cache=k_cache, v_cache=v_cache, n_head=nh, n_kv=nkv, d=d, rope_dims=hp.rope_dims,
            rope_base=hp.rope_base, eps=hp.eps, t=t)
        o = self.attn_o
        fixed = dict(D=d, G=nh // nkv, Q8=g.int8(p + "attn_output.weight"), KT=kt, VT=vt)
        coop = self.coop and attention.attn_prefill_coop.allows(D=d, G=nh // nkv)
        kernel = attention.attn_prefill_coop if coop else attention.attn_prefill
        kernel.launch(seq, g.pick, label=p + "attn_prefill", **fixed, q=self.q, qg=self.qg, k_cache=k_cache,
                      v_cache=v_cache, step=step, o=o.f32, oq=o.q, od=o.d, n_kv=nkv, t=t, ctx=g.n_ctx)
        self._halves(seq, o, t * nh * d)
        self.project(seq, p + "attn_output.weight", self.x, t, o, add=True)
        self._after_mixer(seq, i, t)

    def deltanet(self, seq, i: int, t: int) -> None:
        """The projections for the chunk; the conv with q and k normalised (deltanet_conv_rows),
        the delta rule in blocks of tokens (deltanet_chunk_wy for every block at once, then
        deltanet_chunk_scan carrying the state over them) into raw o, then o's gated norm
        (deltanet_gated_norm)."""
        g, hp, p = self.g, self.hp, f"blk.{i}."
        self.project(seq, p + "attn_qkv.weight", self.mix, t)
        self.project(seq, p + "attn_gate.weight", self.z, t)
        self.project(seq, p + "ssm_beta_alpha.weight", self.ba, t)
        D = hp.ssm_head_dim
        deltanet.deltanet_conv_rows.launch(seq, g.pick, label=p + "ssm_conv", D=D, KC=hp.conv_kernel, mix=self.mix,
                                           conv_w=g.weights[p + "ssm_conv1d.weight"], conv_state=g.conv_state[i],
                                           step=self.steps, conv=self.conv, channels=hp.conv_channels,
                                           n_k_heads=hp.ssm_k_heads, eps=hp.eps, conv_slots=g.conv_slots, t=t)
        deltanet.deltanet_chunk_wy.launch(seq, g.pick, label=p + "ssm_wy", D=D, L=deltanet.BLOCK, conv=self.conv,
                                          ba=self.ba, ssm_a=g.weights[p + "ssm_a"],
                                          dt_bias=g.weights[p + "ssm_dt.bias"], wy=self.wy, u=self.dn_raw, t=t,
                                          n_k_heads=hp.ssm_k_heads, v_heads=hp.ssm_v_heads)
        deltanet.deltanet_chunk_scan.launch(seq, g.pick, label=p + "ssm_chunk", D=D, L=deltanet.BLOCK,
                                            KC=hp.conv_kernel, conv=self.conv, wy=self.wy, o=self.dn_raw,
                                            state=g.ssm_state[i], mix=self.mix, conv_state=g.conv_state[i],
                                            step=self.steps, t=t, n_k_heads=hp.ssm_k_heads, v_heads=hp.ssm_v_heads,
                                            conv_slots=g.conv_slots, state_slots=g.state_slots)
        o = self.dn_out
        deltanet.deltanet_gated_norm.launch(seq, g.pick, label=p + "ssm_norm", Q8=g.int8(p + "ssm_out.weight"),
                                            o=self.dn_raw, z=self.z, norm_w=g.weights[p + "ssm_norm.weight"],
                                            out=o.f32, oq=o.q, od=o.d, **self._halved(o), d=D, eps=hp.eps,
                                            rows=t * hp.ssm_v_heads)
        self.project(seq, p + "ssm_out.weight", self.x, t, o, add=True)
        self._after_mixer(seq, i, t)

    def moe(self, seq, i: int, t: int) -> None:
        """The MoE block for the chunk, each expert's weights read once for every token routed to
        it: the router's logits for all rows (its last row is the shared expert's gate), each
        token's K experts, the (token, slot) pairs grouped by expert, the grouped gate·up and down
        products, the shared expert as one expert that every token routes to, then each row of x
        += its pairs' outputs weighted, plus the shared expert's gated."""
        g, hp, p = self.g, self.hp, f"blk.{i}."
        K, E, H = hp.n_experts_used, hp.n_experts, hp.hidden
        router = p + "ffn_gate_inp.weight"
        gate, up = p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        F, _ = g.tensors.shape(gate)[-2:]
        qd = g.qname(down)
        # the shared expert: the stacks' last expert (or tensors of its own type), every token routed to it
        # once. Its gate·up is recorded beside the router and its down beside the experts' gate·up (no
        # barrier between: neither reads what the other writes), so these small dispatches fill SMs the
        # others leave idle (H100: pp512 +0.5%)
        one = (self.one_offsets, self.one_pairs)
        gate_sh, up_sh = p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"
        named, wg, wu = (((gate_sh, up_sh), g.weights[gate_sh], g.weights[up_sh]) if gate_sh in g.tensors
                         else ((gate, up), _expert(g, gate, E), _expert(g, up, E)))
        w_sh, q_sh = (g.weights[down_sh], g.qname(down_sh)) if down_sh in g.tensors else (_expert(g, down, E), qd)
        self.norm(seq, p + "post_attention_norm.weight", t)
        self.project(seq, router, self.logits, t, exact=True)
        self._gate_up(seq, p + "ffn_gate_up_shexp", named, wg, wu, *one, self.act_shared, 1, t, 1)
        moe.moe_route_rows.launch(seq, g.pick, label=p + "moe_route_rows", K=K, logits=self.logits, ids=self.route_ids,
                                  weights=self.route_w, counts=self.counts, n_expert=E, stride=E + 1, t=t)
        moe.moe_group.launch(seq, g.pick, label=p + "moe_group", K=K, ids=self.route_ids, counts=self.counts,
                             offsets=self.offsets, pairs=self.pairs, t=t, n_expert=E)
        self._gate_up(seq, p + "ffn_gate_up_exps", (gate, up), g.weights[gate], g.weights[up], self.offsets,
                      self.pairs, self.act, K, t, E)
        self._down(seq, p + "ffn_down_shexp", q_sh, w_sh, *one, self.act_shared, self.y_shared, hp.shared_ffn, H, 1,
                   t, 1)
        self._down(seq, p + "ffn_down_exps", qd, g.weights[down], self.offsets, self.pairs, self.act, self.y, F, H,
                   K, t, E)
        moe.moe_combine_rows.launch(seq, g.pick, label=p + "moe_combine", SHARED=True, x=self.x, weights=self.route_w,
                                    y=self.y, shared=self.y_shared, logits=self.logits, k=H, topk=K, n_expert=E,
                                    stride=E + 1, t=t)
        self._next_norm(seq, i, t)

    def ffn(self, seq, i: int, t: int) -> None:
        """The dense SwiGLU for the chunk: gate·up as the grouped expert product with every token
        routed to the one pair of matrices, then the down projection."""
        g, p = self.g, f"blk.{i}."
        gate, up = p + "ffn_gate.weight", p + "ffn_up.weight"
        self._gate_up(seq, p + "ffn_gate_up", (gate, up), g.weights[gate], g.weights[up], self.one_offsets,
                      self.one_pairs, self.act, 1, t, 1)
        act = SimpleNamespace(f32=self.act, q=None, h=self.act_h)
        self._halves(seq, act, t * g.tensors.shape(gate)[-2])
        self.project(seq, p + "ffn_down.weight", self.x, t, act, add=True)
        self._next_norm(seq, i, t)

    def _next_norm(self, seq, i: int, t: int) -> None:
        if i + 1 < self.hp.n_layers:  # after the last layer nothing reads the chunk's rows
            self.norm(seq, f"blk.{i + 1}.attn_norm.weight", t)


def _expert(g, stack: str, e: int):
    """Expert e's matrix of a stack of experts' weights (a slice of its buffer)."""
    m, k = g.tensors.shape(stack)[-2:]
    n = m * row_bytes(g.tensors.qtype(stack), k)
    return g.weights[stack].slice(e * n, n)
