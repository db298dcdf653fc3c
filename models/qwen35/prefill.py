"""Batched prefill: a prompt's tokens through the model a chunk at a time, not a step per token.

A chunk of t tokens at positions p0 … p0 + t − 1 is one recorded sequence (one per chunk length,
kept for reuse) over the decode graph's weights, caches and states: the embedding rows, each
layer's norms and projections for all t rows at once (`matmul.mul_mm`: a weight block loaded once
serves a tile of tokens), the delta-net's conv and delta rule for the chunk in one dispatch
(`deltanet.deltanet_prefill`), and what has no batched kernel yet (attention, the MoE block, the
dense FFN) run per token on row slices with the decode kernels. The chunk leaves the caches and
states exactly as t decode steps would, so decoding continues from them; the last prompt token
goes through the ordinary decode step, whose logits give the first generated token.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from zdsl.kernels import attention, deltanet, embedding, ffn, matmul, moe, q8_1, sampling
from zdsl.kernels.quant import FORMATS
from zdsl.models.qwen35.buffers import ATTN_MIN_CHUNK, STEP_WORDS

CHUNK = 512  # tokens a chunk holds at most
ROW_ALIGN = 256  # per-token rows of small buffers start at multiples of this (any device binds them)
ROUTE_ROW = ROW_ALIGN  # bytes between tokens' expert ids (and their weights): K + 1 words, aligned


def aligned(nbytes: int) -> int:
    return -(-nbytes // ROW_ALIGN) * ROW_ALIGN


class Prefill:
    """The prompt path of a DecodeGraph `g` (DecodeGraph.prefill runs it)."""

    def __init__(self, g, b: dict):
        self.g, self.hp, self.chunk = g, g.hp, g.chunk
        self.tokens, self.steps = b["chunk.tokens"], b["chunk.steps"]
        # the host writes each chunk's step values (position, length, token per row), then its tokens
        self.tokens_at = aligned(4 * STEP_WORDS * self.chunk)
        self.host = g.device.host_buffer(self.tokens_at + 4 * self.chunk, name="chunk_host")
        self.host_words = self.host.view(np.uint32)
        self.x = b["chunk.x"]
        self.normed = g.vector_of(b, "chunk.normed")
        self.qg, self.q, self.k, self.v = b["chunk.qg"], b["chunk.q"], b["chunk.k"], b["chunk.v"]
        self.attn_o = g.vector_of(b, "chunk.attn_o")
        self.mix, self.z, self.ba = b["chunk.mix"], b["chunk.z"], b["chunk.ba"]
        self.dn_out = g.vector_of(b, "chunk.deltanet_out")
        self.arrivals = b["chunk.arrivals"]
        self.act = b["chunk.act"]
        if self.hp.moe:
            self.route_ids, self.route_w = b["chunk.route_ids"], b["chunk.route_weights"]
        self._seqs: dict[int, object] = {}

    # -- running ----------------------------------------------------------------------------
    def run(self, tokens: list[int]) -> None:
        """Feed `tokens` at the graph's position, chunk by chunk."""
        g = self.g
        for at in range(0, len(tokens), self.chunk):
            part = tokens[at:at + self.chunk]
            t, p0 = len(part), g.position
            words = self.host_words
            words[self.tokens_at // 4:self.tokens_at // 4 + t] = part
            steps = words[:STEP_WORDS * self.chunk].reshape(self.chunk, STEP_WORDS)
            steps[:t] = 0
            steps[:t, 0] = np.arange(p0, p0 + t)
            steps[:t, 1] = steps[:t, 0] + 1
            steps[:t, 2] = part
            seq = self._seqs.get(t)
            if seq is None:
                seq = self._seqs[t] = self._record(t)
            seq.run()
            g.position += t
        g._synced = False

    def free(self) -> None:
        for seq in self._seqs.values():
            seq.free()
        self._seqs.clear()
        self.host.free()

    # -- recording --------------------------------------------------------------------------
    def _record(self, t: int):
        g, hp = self.g, self.hp
        seq = g.device.sequence()
        seq.copy(self.host.slice(0, 4 * STEP_WORDS * self.chunk), self.steps, 4 * STEP_WORDS * t)
        seq.copy(self.host.slice(self.tokens_at, 4 * self.chunk), self.tokens, 4 * t)
        if g.sampler.penalties:  # the prompt's tokens enter the penalties' window
            for i in range(t):
                sampling.penalty_window.launch(seq, g._pick, step=self._step(i), ring=g.penalty_ring, counts=g.counts,
                                               window=g.sampler.window(g.n_ctx), n_vocab=hp.vocab)
        emb = "token_embd.weight"
        embedding.embed.launch(seq, g._pick, QTYPE=g._qname(emb), table=g.weights[emb], ids=self.tokens, out=self.x,
                               k=hp.hidden, index=0, rows=t)
        self._norm(seq, "blk.0.attn_norm.weight", t)
        for i in range(hp.n_layers):
            (self._attention if hp.attention[i] else self._deltanet)(seq, i, t)
            (self._moe if hp.moe else self._ffn)(seq, i, t)
        return seq

    def _step(self, i: int):
        return self.steps.slice(4 * STEP_WORDS * i, 4 * STEP_WORDS)

    def _norm(self, seq, norm: str, t: int) -> None:
        n = self.normed
        q8_1.norm_q8_1.launch(seq, self.g._pick, label="chunk:" + norm.removesuffix(".weight"), x=self.x,
                              norm_w=self.g.weights[norm], hn=n.f32, xq=n.q, xd=n.d, n=self.hp.hidden, eps=self.hp.eps,
                              rows=t)

    def _project(self, seq, tensor: str, y, t: int, x=None, add: bool = False) -> None:
        """y rows (+)= W · x rows for the chunk's t tokens (x: the normed rows by default)."""
        g = self.g
        x = x or self.normed
        m, k = g.tensors.shape(tensor)[-2:]
        q8 = g._int8(tensor) and x.q is not None
        matmul.mul_mm.launch(seq, g._pick, label="chunk:" + tensor.removesuffix(".weight"), QTYPE=g._qname(tensor),
                             Q8=q8, ADD=add, w=g.weights[tensor], y=y, k=k, m=m, t=t,
                             **(dict(xq=x.q, xd=x.d) if q8 else dict(x=x.f32)))

    def _after_mixer(self, seq, i: int, t: int) -> None:
        if not self.hp.moe:  # the MoE router norms x itself
            self._norm(seq, f"blk.{i}.post_attention_norm.weight", t)

    def _attention(self, seq, i: int, t: int) -> None:
        g, hp, p = self.g, self.hp, f"blk.{i}."
        nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        for name, out in (("attn_q", self.qg), ("attn_k", self.k), ("attn_v", self.v)):
            self._project(seq, p + name + ".weight", out, t)
        k_cache, v_cache = g.kv[i]
        o = self.attn_o
        q8 = g._int8(p + "attn_output.weight")
        for j in range(t):  # per token, with the decode kernels, until attention has a batched kernel
            step = self._step(j)
            qg, q = _row(self.qg, j, 8 * nh * d), _row(self.q, j, 4 * nh * d)
            attention.attn_prep.launch(
                seq, g._pick, label=p + "attn_prep", qg=qg, k=_row(self.k, j, 4 * nkv * d), v=_row(self.v, j, 4 * nkv * d),
                q_norm=g.weights[p + "attn_q_norm.weight"], k_norm=g.weights[p + "attn_k_norm.weight"], step=step, q=q,
                k_cache=k_cache, v_cache=v_cache, n_head=nh, n_kv=nkv, d=d, rope_dims=hp.rope_dims,
                rope_base=hp.rope_base, eps=hp.eps)
            attention.attn_decode.launch(seq, g._pick, label=p + "attn_decode", D=d, G=nh // nkv, q=q, k_cache=k_cache,
                                         v_cache=v_cache, step=step, part=g.attn_part, n_kv=nkv,
                                         min_chunk=ATTN_MIN_CHUNK, nsplit=g.attn_splits, ctx=g.n_ctx)
            attention.attn_combine.launch(seq, g._pick, label=p + "attn_combine", D=d, Q8=q8, part=g.attn_part, qg=qg,
                                          step=step, o=_row(o.f32, j, 4 * nh * d), oq=_row(o.q, j, nh * d),
                                          od=_row(o.d, j, nh * d // 4), nsplit=g.attn_splits,
                                          min_chunk=ATTN_MIN_CHUNK, n_head=nh, ctx=g.n_ctx)
        self._project(seq, p + "attn_output.weight", self.x, t, o, add=True)
        self._after_mixer(seq, i, t)

    def _deltanet(self, seq, i: int, t: int) -> None:
        g, hp, p = self.g, self.hp, f"blk.{i}."
        self._project(seq, p + "attn_qkv.weight", self.mix, t)
        self._project(seq, p + "attn_gate.weight", self.z, t)
        self._project(seq, p + "ssm_beta_alpha.weight", self.ba, t)
        o = self.dn_out
        deltanet.deltanet_prefill.launch(
            seq, g._pick, label=p + "ssm_conv+chunk", D=hp.ssm_head_dim, KC=hp.conv_kernel,
            Q8=g._int8(p + "ssm_out.weight"), v_heads=hp.ssm_v_heads, mix=self.mix,
            conv_w=g.weights[p + "ssm_conv1d.weight"], conv_state=g.conv_state[i], step=self._step(0), z=self.z,
            ba=self.ba, ssm_a=g.weights[p + "ssm_a"], dt_bias=g.weights[p + "ssm_dt.bias"],
            norm_w=g.weights[p + "ssm_norm.weight"], state=g.ssm_state[i], out=o.f32, oq=o.q, od=o.d,
            arrivals=self.arrivals, t=t, n_k_heads=hp.ssm_k_heads, eps=hp.eps)
        self._project(seq, p + "ssm_out.weight", self.x, t, o, add=True)
        self._after_mixer(seq, i, t)

    def _moe(self, seq, i: int, t: int) -> None:
        """Per token, with the decode kernels, until the MoE block has a batched kernel: the router
        (x row normed, the experts picked), every expert's gate·up, the down projections added to
        the row of x."""
        g, hp, p = self.g, self.hp, f"blk.{i}."
        K, E, H = hp.n_experts_used, hp.n_experts, hp.hidden
        router = p + "ffn_gate_inp.weight"
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        gate, up = p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"
        mg, kg = g.tensors.shape(gate)[-2:]
        md, kd = g.tensors.shape(down)[-2:]
        qg, qd = g._qname(gate), g._qname(down)
        qs = g._qname(down_sh) if down_sh in g.tensors else ""
        fd, fs = FORMATS[qd], FORMATS[qs or qd]
        q8 = g._int8(gate)
        n = self.normed
        for j in range(t):
            x, hn = _row(self.x, j, 4 * H), _row(n.f32, j, 4 * H)
            xq, xd = _row(n.q, j, H), _row(n.d, j, H // 4)
            ids, wts = self.route_ids.slice(j * ROUTE_ROW, 4 * (K + 1)), self.route_w.slice(j * ROUTE_ROW, 4 * (K + 1))
            act = _row(self.act, j, 4 * (K + 1) * mg)
            moe.moe_router.launch(
                seq, g._pick, label=p + "ffn_gate_inp+moe_route", QTYPE=g._qname(router), K=K, w=g.weights[router], x=x,
                norm_w=g.weights[p + "post_attention_norm.weight"], hn=hn, xq=xq, xd=xd, logits=g.router,
                arrivals=g.router_arrivals, ids=ids, weights=wts, k=g.tensors.shape(router)[-1], n_expert=E, eps=hp.eps)
            ffn.ffn_gate_up.launch(seq, g._pick, label=gate.removesuffix(".weight") + "+up+shexp", QTYPE=qg, Q8=q8,
                                   EXPERTS=True, wg=g.weights[gate], wu=g.weights[up], ids=ids, act=act, k=kg, m=mg,
                                   slots=K + 1, **(dict(xq=xq, xd=xd) if q8 else dict(x=hn)))
            if (fd.block, fd.parts) != (fs.block, fs.parts):
                ffn.moe_down.launch(seq, g._pick, label=down.removesuffix(".weight"), QTYPE=qd, ADD=True,
                                    w=g.weights[down], ids=ids, weights=wts, act=act, y=x, k=kd, m=md, slots=K)
                ffn.moe_down.launch(seq, g._pick, label=down_sh.removesuffix(".weight"), QTYPE=qs, ADD=True,
                                    w=g.weights[down_sh], ids=g.zero_id, weights=wts.slice(4 * K, 4),
                                    act=act.slice(4 * K * mg, 4 * mg), y=x, k=kd, m=md, slots=1)
            else:
                ffn.moe_down_all.launch(seq, g._pick, label=p + "ffn_down_exps+shexp", QTYPE=qd, QTYPE_SH=qs, K=K,
                                        w=g.weights[down], w_sh=g.weights[down_sh] if qs else g.device.placeholder,
                                        ids=ids, weights=wts, act=act, y=x, k=kd, m=md)
        self._next_norm(seq, i, t)

    def _ffn(self, seq, i: int, t: int) -> None:
        """The dense SwiGLU: gate·up per token (the fused decode kernel on row slices), the down
        projection for the chunk."""
        g, hp, p = self.g, self.hp, f"blk.{i}."
        gate, up = p + "ffn_gate.weight", p + "ffn_up.weight"
        m, k = g.tensors.shape(gate)[-2:]
        q8 = g._int8(gate)
        n, H = self.normed, hp.hidden
        for j in range(t):
            ffn.ffn_gate_up.launch(seq, g._pick, label=gate.removesuffix(".weight") + "+up", QTYPE=g._qname(gate),
                                   Q8=q8, EXPERTS=False, wg=g.weights[gate], wu=g.weights[up], ids=self._step(j),
                                   act=_row(self.act, j, 4 * m), k=k, m=m, slots=1,
                                   **(dict(xq=_row(n.q, j, H), xd=_row(n.d, j, H // 4)) if q8
                                      else dict(x=_row(n.f32, j, 4 * H))))
        self._project(seq, p + "ffn_down.weight", self.x, t, SimpleNamespace(f32=self.act, q=None), add=True)
        self._next_norm(seq, i, t)

    def _next_norm(self, seq, i: int, t: int) -> None:
        if i + 1 < self.hp.n_layers:  # after the last layer nothing reads the chunk's rows
            self._norm(seq, f"blk.{i + 1}.attn_norm.weight", t)



def _row(buf, i: int, nbytes: int):
    """Row i of a chunk buffer whose rows are nbytes long, back to back."""
    return buf.slice(i * nbytes, nbytes)


def chunk_buffers(hp, chunk: int) -> list[tuple[str, int]]:
    """(name, bytes) of the prefill's buffers for chunks of up to `chunk` tokens (buffers.py adds
    them to the plan as scratch)."""
    H, C, vd = hp.hidden, hp.conv_channels, hp.ssm_value_dim
    qd, kvd = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim

    def vector(name, n):
        return [(name, 4 * chunk * n), (name + "_q8_1", chunk * n), (name + "_q8_1_scales", 4 * chunk * n // 16)]

    out = [("chunk.tokens", 4 * chunk), ("chunk.steps", 4 * STEP_WORDS * chunk), ("chunk.x", 4 * chunk * H),
           *vector("chunk.normed", H), ("chunk.qg", 8 * chunk * qd), ("chunk.q", 4 * chunk * qd),
           ("chunk.k", 4 * chunk * kvd), ("chunk.v", 4 * chunk * kvd), *vector("chunk.attn_o", qd),
           ("chunk.mix", 4 * chunk * C), ("chunk.z", 4 * chunk * vd), ("chunk.ba", 8 * chunk * hp.ssm_v_heads),
           *vector("chunk.deltanet_out", vd), ("chunk.arrivals", 4)]
    if hp.moe:
        K, F = hp.n_experts_used, hp.expert_ffn
        out += [("chunk.route_ids", ROUTE_ROW * chunk), ("chunk.route_weights", ROUTE_ROW * chunk),
                ("chunk.act", 4 * chunk * (K + 1) * F)]
    else:
        out.append(("chunk.act", 4 * chunk * hp.ffn))
    return out
