"""The Qwen3.5 forward pass in plain numpy: the ground truth every GPU kernel is checked against.

Written for clarity, not speed: one function per block, the math as in docs/MODEL.md.
`ReferenceModel.forward(tokens, state)` runs any number of tokens and carries the KV cache,
conv and delta-net states in `state`, so a prompt followed by one-token steps gives the same
logits as one forward over everything. float32 by default; pass dtype=np.float64 to check.
With `int8_activations=True` every projection whose weight type has an int8 decoder reads its
input rounded to Q8_1, as the GPU's int8 products do (the SwiGLU outputs that the down
projections read excepted: the GPU keeps them f32, and so are small tensors it joins with one
of another type as F32 values); without it, the exact f32 forward.
On the 35B-A3B shapes it keeps ~8 GB of dequantized non-expert weights and takes ~40 s per
token on 2 cores: fine for spot checks, while tests use the tiny synthetic models.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..file.gguf_file import Hparams, ModelFile, open_model

DELTANET_CHUNK = 64  # tokens a chunk of the delta rule's chunked form solves at once, as in llama.cpp and the fla kernels
CACHE_WHOLE_BYTES = 256 << 20  # expert tensors smaller than this dequantized are kept whole; larger
                               # ones (35B-A3B: 1 GiB each) are dequantized one expert per use


def q8_1_round(x):
    """x with each block of 32 (along the last axis) rounded to Q8_1 as the GPU quantizes it."""
    from zdsl.kernels.q8_1 import q8_1_ref

    q, d = q8_1_ref(x)
    return (q.reshape(-1, 32) * d.reshape(-1, 1)).reshape(np.shape(x)).astype(np.asarray(x).dtype)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def l2norm(x, eps):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope_neox(x, positions, dims, base):
    """Rotate dims [0, dims) of the last axis; pair i with i + dims/2. x: (T, heads, head_dim)."""
    half = dims // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / dims)
    theta = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(theta)[:, None, :].astype(x.dtype), np.sin(theta)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], axis=-1)


def deltanet_recurrent(q, k, v, g, beta, S):
    """Gated delta rule token by token. q, k: (T, H, dk) L2-normalised; v: (T, H, dv);
    g, beta: (T, H); S: (H, dk, dv) updated in place. Returns o: (T, H, dv)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        u = np.einsum("hij,hi->hj", S, k[t])
        S += k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
        out[t] = scale * np.einsum("hij,hi->hj", S, q[t])
    return out


def deltanet_chunked(q, k, v, g, beta, S, chunk=DELTANET_CHUNK):
    """The same recurrence, `chunk` tokens at a time in the WY/UT form: within a chunk,
    w_t = beta_t (v_t - k_t.S_{t-1}) solves a unit lower-triangular system, then the state
    takes one rank-`chunk` update. Same arguments and result as `deltanet_recurrent`."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = np.empty_like(v)
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        Q, K, V = (a[sl].transpose(1, 0, 2) for a in (q, k, v))        # (H, C, d)
        B, G = beta[sl].T, np.cumsum(g[sl], axis=0).T                   # (H, C) log-decay so far
        C = Q.shape[1]
        lower = np.tril(np.ones((C, C), dtype=bool))
        diff = np.where(lower, G[:, :, None] - G[:, None, :], -np.inf)  # G_t - G_j for j <= t
        decay = np.exp(diff)
        A = np.tril(B[:, :, None] * (K @ K.transpose(0, 2, 1)) * decay, -1)
        IA = A + np.eye(C, dtype=A.dtype)
        eG = np.exp(G)[:, :, None]
        U = np.linalg.solve(IA, B[:, :, None] * V)
        Wk = np.linalg.solve(IA, B[:, :, None] * eG * K)
        W = U - Wk @ S                                                  # (H, C, dv)
        O = (eG * Q) @ S + ((Q @ K.transpose(0, 2, 1)) * decay) @ W
        out[sl] = scale * O.transpose(1, 0, 2)
        last = G[:, -1:]
        S *= np.exp(last)[:, :, None]
        S += (K * np.exp(last - G)[:, :, None]).transpose(0, 2, 1) @ W
    return out


@dataclass
class State:
    """Everything carried between forward calls for one sequence."""

    pos: int = 0
    kv: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # layer: K, V (kv_heads, P, hd)
    conv: dict[int, np.ndarray] = field(default_factory=dict)  # layer: last kernel-1 qkv inputs (K-1, C)
    ssm: dict[int, np.ndarray] = field(default_factory=dict)   # layer: (v_heads, dk, dv)

    def copy(self) -> State:
        return State(self.pos, {i: (k.copy(), v.copy()) for i, (k, v) in self.kv.items()},
                     {i: c.copy() for i, c in self.conv.items()}, {i: s.copy() for i, s in self.ssm.items()})


class ReferenceModel:
    """numpy forward over a checked GGUF file. Weights are dequantized on first use and kept."""

    def __init__(self, model: ModelFile | str | os.PathLike, *, dtype=np.float32, int8_activations: bool = False):
        self.file = model if isinstance(model, ModelFile) else open_model(model)
        self.hp: Hparams = self.file.hparams
        self.dtype = np.dtype(dtype)
        self.int8_activations = int8_activations
        self._cache: dict[str, np.ndarray] = {}

    def new_state(self) -> State:
        return State()

    # weights ------------------------------------------------------------------------------
    def w(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self.file.dequant(name).astype(self.dtype, copy=False)
        return self._cache[name]

    def input_of(self, name: str, x):
        """What a projection by weight `name` reads of x (module doc: int8_activations)."""
        from zdsl.kernels.quant import INT8_FORMATS

        if self.int8_activations and name not in self._as_f32 and self.file.qtype(name).name.lower() in INT8_FORMATS:
            return q8_1_round(x)
        return x

    @functools.cached_property
    def _as_f32(self) -> set[str]:
        """Tensors the GPU holds as F32 values, joined with a tensor of another type (weights.py):
        it reads their input in f32."""
        from .weights import graph_weights

        return {p.tensor for t in graph_weights(self.file).tensors.values() if t.dequantized for p in t.parts}

    def proj(self, x, name: str):
        """x @ W(name)ᵀ, with x as that projection reads it."""
        return self.input_of(name, x) @ self.w(name).T

    def expert(self, name: str, e: int) -> np.ndarray:
        if name in self._cache or np.prod(self.file.shape(name)) * self.dtype.itemsize <= CACHE_WHOLE_BYTES:
            return self.w(name)[e]
        return self.file.dequant(name, e).astype(self.dtype, copy=False)

    # forward ------------------------------------------------------------------------------
    def forward(self, tokens, state: State | None = None, *, trace: dict | None = None) -> np.ndarray:
        """Logits (T, vocab) for `tokens` following whatever `state` has seen; updates `state`.
        `trace`, if given, receives the residual stream after the embedding and after each layer."""
        hp = self.hp
        state = self.new_state() if state is None else state
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, hp.vocab), self.dtype)
        if tokens.min() < 0 or tokens.max() >= hp.vocab:
            raise ValueError(f"token ids must be in [0, {hp.vocab})")
        x = self.file.dequant("token_embd.weight", tokens).astype(self.dtype)
        positions = np.arange(state.pos, state.pos + len(tokens))
        if trace is not None:
            trace["embed"] = x.copy()
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            xn = rmsnorm(x, self.w(p + "attn_norm.weight"), hp.eps)
            x = x + (self.attention(i, xn, positions, state) if hp.attention[i] else self.deltanet(i, xn, state))
            hn = rmsnorm(x, self.w(p + "post_attention_norm.weight"), hp.eps)
            x = x + (self.moe(i, hn) if hp.moe else self.ffn(i, hn))
            if trace is not None:
                trace[f"layer{i}"] = x.copy()
        state.pos += len(tokens)
        h = rmsnorm(x, self.w("output_norm.weight"), hp.eps)
        if trace is not None:
            trace["h"] = h.copy()  # what the head reads: the MTP head's input (mtp)
        return self.proj(h, self.file.output_name)

    def mtp(self, tokens, h, position: int, state: State) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head (gguf_file.head_specs) over rows of (token x_q, the trunk's h of position
        q − 1: forward's trace["h"], or the head's own h for a chained draft) at positions
        position, position + 1, …: the logits of x_{q+1}, and the head's h. Its KV rows from
        `position` on are replaced: a draft cut back is overwritten."""
        hp, L = self.hp, self.hp.n_layers
        p = f"blk.{L}."
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        e = self.file.dequant("token_embd.weight", tokens).astype(self.dtype)
        def nextn(t):
            return self.w(f"{p}nextn.{t}.weight")

        cat = np.concatenate([rmsnorm(e, nextn("enorm"), hp.eps),
                              rmsnorm(np.asarray(h, self.dtype).reshape(len(tokens), -1), nextn("hnorm"), hp.eps)], -1)
        x = self.proj(cat, p + "nextn.eh_proj.weight")
        if L in state.kv:
            state.kv[L] = tuple(c[:, :position] for c in state.kv[L])
        positions = np.arange(position, position + len(tokens))
        x = x + self.attention(L, rmsnorm(x, self.w(p + "attn_norm.weight"), hp.eps), positions, state)
        hn = rmsnorm(x, self.w(p + "post_attention_norm.weight"), hp.eps)
        x = x + (self.moe(L, hn) if hp.moe else self.ffn(L, hn))
        norm = p + "nextn.shared_head_norm.weight"
        out = rmsnorm(x, self.w(norm if norm in self.file else "output_norm.weight"), hp.eps)
        return self.proj(out, self.file.output_name), out

    def attention(self, i: int, xn, positions, state: State):
        hp, p = self.hp, f"blk.{i}."
        T, nh, nkv, hd = len(xn), hp.n_heads, hp.n_kv_heads, hp.head_dim
        if p + "attn_qkv.weight" in self.file:
            qkv = self.proj(xn, p + "attn_qkv.weight")
            qg, k, v = np.split(qkv, [2 * nh * hd, 2 * nh * hd + nkv * hd], axis=-1)
        else:
            qg = self.proj(xn, p + "attn_q.weight")
            k, v = self.proj(xn, p + "attn_k.weight"), self.proj(xn, p + "attn_v.weight")
        qg = qg.reshape(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        q = rmsnorm(q, self.w(p + "attn_q_norm.weight"), hp.eps)
        k = rmsnorm(k.reshape(T, nkv, hd), self.w(p + "attn_k_norm.weight"), hp.eps)
        q = rope_neox(q, positions, hp.rope_dims, hp.rope_base)
        k = rope_neox(k, positions, hp.rope_dims, hp.rope_base)
        v = v.reshape(T, nkv, hd)
        K0, V0 = state.kv.get(i, (np.zeros((nkv, 0, hd), self.dtype),) * 2)
        K, V = np.concatenate([K0, k.transpose(1, 0, 2)], 1), np.concatenate([V0, v.transpose(1, 0, 2)], 1)
        state.kv[i] = (K, V)
        group = nh // nkv
        Kh, Vh = np.repeat(K, group, axis=0), np.repeat(V, group, axis=0)       # head h reads KV h // group
        scores = (q.transpose(1, 0, 2) @ Kh.transpose(0, 2, 1)) / math.sqrt(hd)  # (nh, T, P+T)
        past = K.shape[1] - T
        mask = np.arange(K.shape[1])[None, :] > (past + np.arange(T))[:, None]
        scores = np.where(mask, -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = (probs @ Vh).transpose(1, 0, 2) * sigmoid(gate)                  # (T, nh, hd)
        return self.proj(o.reshape(T, nh * hd), p + "attn_output.weight")

    def deltanet(self, i: int, xn, state: State):
        hp, p = self.hp, f"blk.{i}."
        T, Hk, Hv, d, Kc = len(xn), hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.conv_kernel
        mix = self.proj(xn, p + "attn_qkv.weight")                            # (T, C)
        z = self.proj(xn, p + "attn_gate.weight")
        beta = sigmoid(self.proj(xn, p + "ssm_beta.weight"))                  # (T, Hv)
        g = self.w(p + "ssm_a") * softplus(self.proj(xn, p + "ssm_alpha.weight") + self.w(p + "ssm_dt.bias"))
        prev = state.conv.get(i, np.zeros((Kc - 1, mix.shape[1]), self.dtype))
        buf = np.concatenate([prev, mix], 0)
        taps = self.w(p + "ssm_conv1d.weight")                                 # (C, Kc), tap Kc-1 = current
        conv = sum(buf[j:j + T] * taps[:, j] for j in range(Kc))
        state.conv[i] = buf[-(Kc - 1):].copy() if Kc > 1 else buf[:0]
        conv = silu(conv)
        kd = Hk * d
        q = l2norm(conv[:, :kd].reshape(T, Hk, d), hp.eps)
        k = l2norm(conv[:, kd:2 * kd].reshape(T, Hk, d), hp.eps)
        v = conv[:, 2 * kd:].reshape(T, Hv, d)
        q, k = np.tile(q, (1, Hv // Hk, 1)), np.tile(k, (1, Hv // Hk, 1))    # value head h reads key head h % Hk
        S = state.ssm.setdefault(i, np.zeros((Hv, d, d), self.dtype))
        o = (deltanet_recurrent if T == 1 else deltanet_chunked)(q, k, v, g, beta, S)
        o = rmsnorm(o, self.w(p + "ssm_norm.weight"), hp.eps) * silu(z.reshape(T, Hv, d))
        return self.proj(o.reshape(T, Hv * d), p + "ssm_out.weight")

    def moe(self, i: int, hn):
        hp, p = self.hp, f"blk.{i}."
        logits = self.proj(hn, p + "ffn_gate_inp.weight")                     # (T, E)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :hp.n_experts_used]
        weights = np.take_along_axis(probs, top, -1)
        weights /= weights.sum(-1, keepdims=True)
        out = np.zeros_like(hn)
        down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
        fused = p + "ffn_gate_up_exps.weight" in self.file
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            h = hn[rows]
            if fused:
                gu = self.input_of(p + "ffn_gate_up_exps.weight", h) @ self.expert(p + "ffn_gate_up_exps.weight", e).T
                gate, up = gu[:, :hp.expert_ffn], gu[:, hp.expert_ffn:]
            else:
                gate = self.input_of(p + "ffn_gate_exps.weight", h) @ self.expert(p + "ffn_gate_exps.weight", e).T
                up = self.input_of(p + "ffn_up_exps.weight", h) @ self.expert(p + "ffn_up_exps.weight", e).T
            out[rows] += weights[rows, slot][:, None] * ((silu(gate) * up) @ self.expert(down, e).T)
        shared = (silu(self.proj(hn, p + "ffn_gate_shexp.weight")) * self.proj(hn, p + "ffn_up_shexp.weight")
                  ) @ self.w(down_sh).T
        return out + shared * sigmoid(hn @ self.w(p + "ffn_gate_inp_shexp.weight"))[:, None]

    def ffn(self, i: int, hn):
        p = f"blk.{i}."
        return (silu(self.proj(hn, p + "ffn_gate.weight")) * self.proj(hn, p + "ffn_up.weight")
                ) @ self.w(p + "ffn_down.weight").T
