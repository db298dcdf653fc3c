"""Every device buffer the decode graph holds, sized before anything is allocated.

One list serves three ends: the memory plan shown before loading (weights, KV cache, recurrent
state and scratch against what the device has), refusing up front a context that cannot fit (in
one line, naming the largest that can), and allocating everything at once, packed so that only
alignment is wasted (`Device.alloc_many`). A 32 GB card holds the 35B-A3B's 19.7 GiB only if
nothing beside weights and caches takes more than a little.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zdsl.errors import OutOfMemoryError, ZdslError
from zdsl.kernels import deltanet
from zdsl.kernels.attention import cache_rows, split_count
from zdsl.kernels.kvcache import KV_DEFAULT, KV_FORMATS, KVTypes
from zdsl.kernels.quant_numpy import row_bytes
from zdsl.kernels.sampling import SETTINGS, mask_words
from zdsl.kernels.steps import STEP_STRIDE, STEP_WORDS
from zdsl.runtime.memory import fmt_bytes

KINDS = ("weights", "KV cache", "recurrent state", "scratch")
# Attention over the KV cache is cut into chunks (attention.split_rows: up to 32 chunks of at
# least 16 rows at short contexts, then chunks of ATTN_MIN_CHUNK rows) up to ATTN_WORKGROUPS
# over the KV heads, attn_decode's grid being chunks × KV heads; the chunk length is computed on
# the GPU from the current length, so one recorded step serves every length. 256 workgroups are
# one wave of attn_decode on the H100 (132 SMs, two of its workgroups each at 255 registers a
# lane): over 32,768 rows of the 35B-A3B's 2 KV heads, 128 chunks took 40 µs, 144 or 160 (a
# second wave begun) 52–64, 256 (two waves) 45, 64 (half the SMs) 46–52 (q8_0 and f16).
ATTN_MIN_CHUNK = 64
ATTN_WORKGROUPS = 256
PROMPT_CHUNK = 512  # prompt tokens a prefill chunk holds at most (prefill.py)


@dataclass(frozen=True)
class BufferSpec:
    """One device buffer of the plan: its name, its size and its kind (one of KINDS)."""

    name: str
    nbytes: int
    kind: str


def tensor_bytes(t) -> int:
    """Bytes of a graph tensor (weights.GraphTensor) as stored."""
    return int(np.prod(t.shape[:-1], dtype=np.int64)) * row_bytes(t.qtype, t.shape[-1])


def scratch(name: str, nbytes: int) -> BufferSpec:
    return BufferSpec(name, nbytes, "scratch")


def f32(name: str, n: int) -> BufferSpec:
    """An f32 activation of n values (room for one where n is 0)."""
    return scratch(name, 4 * max(n, 1))


def vector(name: str, n: int, halves: bool = False) -> list[BufferSpec]:
    """An activation as projections read it: f32, and its Q8_1 quants and block scales (q8_1.py);
    with halves, in f16 too (what products on matrix units read)."""
    if n % 32:
        raise ZdslError(f"{name} has {n} values; zdsl's Q8_1 activations need a multiple of 32")
    return [scratch(name, 4 * n), scratch(name + "_q8_1", n),
            scratch(name + "_q8_1_scales", 4 * (n // 16))] + ([scratch(name + "_f16", 2 * n)] if halves else [])


SAVED = "saved."  # the prefix of the checkpoint twins of a sequence's state


def row_buffers(hp, n: int, parts: int, candidates: int, prefix: str = "") -> list[BufferSpec]:
    """The buffers of a step of n rows (tokens of several sequences, batch.py, or of one,
    token_rows.py) that the prompt's rows lack, and those one row's launches write that no other
    may: `parts` and `candidates` bytes of attention partials and sampler room a row."""
    K, F, S = hp.n_experts_used, hp.expert_ffn, hp.shared_ffn
    specs = [scratch("logits", 4 * n * hp.vocab)]
    specs += [scratch(f"attn_partials.{r}", parts) for r in range(n)]
    specs += [scratch(f"candidates.{r}", candidates) for r in range(n)]
    if hp.moe:
        specs += [scratch(name, nbytes) for name, nbytes in (
            ("router_logits", 4 * n * (hp.n_experts + 1)), ("router_arrivals", 4 * n), ("route_ids", 4 * n * (K + 1)),
            ("route_weights", 4 * n * (K + 1)), ("expert_act", 4 * n * (K * F + S)), ("zero_id", 4 * n * (K + 1)))]
    else:
        specs.append(scratch("ffn_act", 4 * n * hp.ffn))
    return [BufferSpec(prefix + s.name, s.nbytes, s.kind) for s in specs]


def batch_buffers(hp, n: int, parts: int, candidates: int, stride: int, rows: int = 0) -> list[BufferSpec]:
    """The buffers of a batched step of n sequences (batch.py) in `rows` rows (n unless a mixed
    step feeds some sequences several tokens): its rows', each row's step values in a slot of
    its own (a mixed step's), and `stride` bytes a launch's workgroup counts."""
    rows = rows or n
    return row_buffers(hp, rows, parts, candidates) + [scratch("steps", STEP_STRIDE * rows),
                                                       scratch("counts_gpu", stride * n * (8 * hp.n_layers + 16))]


def token_buffers(hp, most: int, parts: int, candidates: int) -> list[BufferSpec]:
    """The buffers of steps of up to `most` tokens of one sequence (token_rows.py): its rows', and
    each row's step values in a slot of its own."""
    return row_buffers(hp, most, parts, candidates, "rows.") + [scratch("rows.steps", STEP_STRIDE * most)]


def ring_slots(hp, step_tokens: int) -> tuple[int, int]:
    """(conv slots, state slots): the delta-net's conv inputs and states kept by position
    (kernels/deltanet.py), so that a step of up to `step_tokens` tokens can be cut back to any of
    its positions: KC − 1 inputs before the earliest, and a state after each position (and
    before the first). One token a step: the state updated in place, KC conv slots."""
    return hp.conv_kernel - 1 + step_tokens, step_tokens + 1 if step_tokens > 1 else 1


def attn_splits(n_ctx: int, n_kv: int) -> int:
    """The chunks attn_decode's grid cuts a context of n_ctx rows into (its x; KV heads its y)."""
    return split_count(n_ctx, ATTN_MIN_CHUNK, max(1, ATTN_WORKGROUPS // n_kv))


def decode_buffers(hp, tensors, n_ctx: int, candidates: int, checkpoint: bool = False, chunk: int = 0,
                   halves: bool = False, kv: KVTypes = KV_DEFAULT, step_tokens: int = 1) -> list[BufferSpec]:
    """The decode graph's buffers for hyperparameters `hp`, the graph's weights `tensors`
    (weights.GraphWeights), a context of n_ctx tokens and `candidates` bytes of sampler room;
    with `checkpoint`, a twin of the sequence state that steps overwrite (DecodeGraph.checkpoint);
    with `chunk`, the prompt path's buffers for chunks of that many tokens (at most n_ctx), with
    `halves` their f16 activations for matrix units; the KV caches in the (K, V) formats `kv`
    (kernels/kvcache.py); with step_tokens > 1, steps of that many tokens of the sequence
    (token_rows.py: within the prompt's rows, so chunk ≥ step_tokens), the recurrent states in
    rings that such a step can be cut back in (ring_slots)."""
    H, C, vd = hp.hidden, hp.conv_channels, hp.ssm_value_dim
    qd, kvd = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    splits = attn_splits(n_ctx, hp.n_kv_heads)
    if not 1 <= step_tokens <= max(1, min(chunk, n_ctx)):
        raise ZdslError(f"a step holds 1 to {max(1, min(chunk, n_ctx))} tokens (the prompt chunk), not {step_tokens}")

    specs = [BufferSpec(name, tensor_bytes(t), "weights") for name, t in tensors.tensors.items()]
    specs += [scratch("step", 4 * STEP_WORDS), f32("x", H), f32("logits", hp.vocab), *vector("normed", H),
              scratch("router_arrivals", 4), f32("qg", 2 * qd), f32("q", qd), f32("k", kvd), f32("v", kvd),
              *vector("attn_o", qd), f32("attn_partials", hp.n_heads * splits * (hp.head_dim + 2)),
              f32("mix", C), f32("z", vd), *vector("deltanet_out", vd)]
    rows = cache_rows(n_ctx) * hp.n_kv_heads  # whole blocks of positions, which the prompt's attention reads
    k_fmt, v_fmt = (KV_FORMATS[name] for name in kv)
    for fmt in (k_fmt, v_fmt):
        fmt.check(hp.head_dim)
    for i in hp.attention_layers:
        specs += [BufferSpec(f"k_cache.{i}", rows * k_fmt.row_bytes(hp.head_dim), "KV cache"),
                  BufferSpec(f"v_cache.{i}", rows * v_fmt.row_bytes(hp.head_dim), "KV cache")]
    conv_slots, state_slots = ring_slots(hp, step_tokens)
    for i in hp.deltanet_layers:
        # the conv inputs and the states as rings indexed by position (kernels/deltanet.py)
        specs += [BufferSpec(f"conv_state.{i}", 4 * conv_slots * C, "recurrent state"),
                  BufferSpec(f"ssm_state.{i}", 4 * state_slots * hp.ssm_v_heads * hp.ssm_head_dim ** 2,
                             "recurrent state")]
    if hp.moe:
        E, K, F, S = hp.n_experts, hp.n_experts_used, hp.expert_ffn, hp.shared_ffn
        specs += [f32("router_logits", E + 1),    # [E]: the shared expert's gate
                  scratch("route_ids", 4 * (K + 1)),  # [K]: the shared expert, E
                  f32("route_weights", K + 1),    # [K]: the shared expert's gate
                  f32("expert_act", K * F + S),   # after the K slots of F: the shared expert's S
                  scratch("zero_id", 4)]
    else:
        specs.append(f32("ffn_act", hp.ffn))
    specs += [scratch("token_counts", 4 * hp.vocab), scratch("penalty_ring", 4 * n_ctx),
              scratch("allowed_tokens", 4 * mask_words(hp.vocab)), f32("logit_bias", hp.vocab),
              scratch("tokens_out", 4 * n_ctx),
              scratch("candidates", candidates), scratch("sampler_settings", 4 * len(SETTINGS))]
    if checkpoint:
        specs += [BufferSpec(SAVED + s.name, s.nbytes, s.kind) for s in specs if s.name in checkpointed(hp)]
    if chunk:
        specs += chunk_buffers(hp, min(chunk, n_ctx), halves)
    if step_tokens > 1:
        specs += token_buffers(hp, step_tokens, 4 * hp.n_heads * splits * (hp.head_dim + 2), candidates)
    return specs


def chunk_buffers(hp, chunk: int, halves: bool = False) -> list[BufferSpec]:
    """The prompt path's buffers (prefill.py): rows of every activation for chunks of up to
    `chunk` tokens, their steps and tokens, the MoE's routing and grouping. chunk.qg (attention's
    q and gate rows) also holds the delta-net's raw o, and chunk.q (attention's roped q) the delta
    rule's WY terms: a layer is one or the other. With halves,
    the rows that products on matrix units read also in f16 (the dense FFN's act included)."""
    H, C, vd = hp.hidden, hp.conv_channels, hp.ssm_value_dim
    qd, kvd = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    specs = [scratch("chunk.tokens", 4 * chunk), scratch("chunk.steps", 4 * STEP_WORDS * chunk),
             f32("chunk.x", chunk * H), *vector("chunk.normed", chunk * H, halves), f32("chunk.qg", chunk * max(2 * qd, vd)),
             f32("chunk.q", max(chunk * qd, deltanet.wy_size(chunk, hp.ssm_v_heads, deltanet.BLOCK))),
             f32("chunk.k", chunk * kvd), f32("chunk.v", chunk * kvd),
             *vector("chunk.attn_o", chunk * qd, halves), f32("chunk.mix", chunk * C), f32("chunk.conv", chunk * C),
             f32("chunk.z", chunk * vd), f32("chunk.ba", 2 * chunk * hp.ssm_v_heads),
             *vector("chunk.deltanet_out", chunk * vd, halves),
             scratch("chunk.one_offsets", 8), scratch("chunk.one_pairs", 4 * chunk)]
    if hp.moe:
        E, K, F, S = hp.n_experts, hp.n_experts_used, hp.expert_ffn, hp.shared_ffn
        specs += [f32("chunk.router_logits", chunk * (E + 1)), scratch("chunk.expert_counts", 4 * E),
                  scratch("chunk.route_ids", 4 * chunk * K), f32("chunk.route_weights", chunk * K),
                  scratch("chunk.expert_offsets", 4 * (E + 1)), scratch("chunk.pairs", 4 * chunk * K),
                  f32("chunk.act", chunk * K * F), f32("chunk.pair_out", chunk * K * H),
                  f32("chunk.act_shared", chunk * S), f32("chunk.shared_out", chunk * H)]
    else:
        specs += [f32("chunk.act", chunk * hp.ffn)] + ([scratch("chunk.act_f16", 2 * chunk * hp.ffn)] if halves else [])
    return specs


def checkpointed(hp) -> set[str]:
    """The buffers a step overwrites that a sequence needs back to undo steps: the delta-net's
    state and conv ring, and the penalties' window. (KV rows past the position are written
    before they are read, so the cache needs no copy.)"""
    return ({f"ssm_state.{i}" for i in hp.deltanet_layers} | {f"conv_state.{i}" for i in hp.deltanet_layers}
            | {"token_counts", "penalty_ring"})


class Footprint:
    """What a list of buffers takes, by kind."""

    def __init__(self, specs: list[BufferSpec]):
        self.by_kind = {kind: sum(s.nbytes for s in specs if s.kind == kind) for kind in KINDS}
        self.total = sum(self.by_kind.values())

    def line(self) -> str:
        return " + ".join(f"{kind} {fmt_bytes(n)}" for kind, n in self.by_kind.items()) + f" = {fmt_bytes(self.total)}"


def check_fits(specs_at, n_ctx: int, available: int, info, what: str = "this model", fewer=None) -> Footprint:
    """The footprint of `specs_at(n_ctx)` (the buffers for a context length), or one line saying
    why device `info`, with `available` bytes free, cannot hold `what`, and which context it can;
    `fewer()`: another way that fits, or None (e.g. fewer sequences)."""

    def problem(n: int) -> str | None:
        need = Footprint(specs_at(n))
        if need.total > available:
            return f"{what} at --ctx {n} needs {need.line()} but {info.name} has {fmt_bytes(available)} free"
        return None

    why = problem(n_ctx)
    if why is None:
        return Footprint(specs_at(n_ctx))
    lo = largest(lambda n: problem(n) is None, n_ctx - 1)
    fixes = [f"--ctx {lo} would fit (a quantized --kv-type holds more)" if lo else None, fewer() if fewer else None]
    fix = "; or ".join(f for f in fixes if f) or "this model cannot run on it (a smaller model or quantization could)"
    raise OutOfMemoryError(f"{why}; {fix}")


def largest(fits, limit: int) -> int:
    """The largest context n ≤ limit for which fits(n) (which holds for all smaller n), or 0."""
    if fits(limit):
        return limit
    lo, hi = 0, limit  # lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_context(hp, tensors, memory: int, kv: KVTypes) -> int:
    """The longest context (at most the trained one) whose buffers, with the KV caches in the
    formats `kv`, fit `memory` bytes: the decode graph's and the prompt path's, as on a device
    with matrix units (their f16 rows: the larger plan), less the sampler's few KiB of candidates,
    which depend on the device."""
    def fits(n: int) -> bool:
        return Footprint(decode_buffers(hp, tensors, n, 0, chunk=PROMPT_CHUNK, halves=True, kv=kv)).total <= memory
    return largest(fits, hp.context_length)
