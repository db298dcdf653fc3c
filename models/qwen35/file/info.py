"""What a model costs: bytes per weight type, bytes read per decoded token, KV and recurrent
state per sequence, and how much context fits in a given device memory.

Decode is bandwidth-bound, so `read_per_token` (every non-expert weight, n_used of n_experts
experts, the head, one embedding row) divided by memory bandwidth bounds tokens/s; the
runtime uses the same plan to size its KV cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES

from zdsl.kernels.kvcache import KV_FORMATS, KVTypes, kv_types

from .gguf_file import Hparams, ModelFile, QuantType

# The KV cache formats the plan shows, as --kv-type spells them (K,V where they differ).
SHOWN_KV_TYPES = ("f16", "q8_0", "q4_0,q8_0", "q4_0")
F32 = 4


@dataclass(frozen=True)
class MemoryPlan:
    hparams: Hparams
    weight_bytes: int                  # every tensor of the trunk and head, as stored
    bytes_by_type: dict[str, int]      # type name -> bytes
    read_per_token: int                # weight bytes one decoded token reads
    expert_bytes: int                  # all routed-expert tensors (of which n_used/n_experts are read)
    kv_values: int                     # K (and as many V) values per token of context, all attention layers
    ssm_state_bytes: int               # delta-net S matrices, f32, per sequence
    conv_state_bytes: int              # delta-net conv inputs, a ring of conv_kernel slots, f32, per sequence
    mtp_bytes: int = 0                 # the MTP head's block, as stored (0: the file holds none)
    mtp_read_per_draft: int = 0        # weight bytes one MTP draft reads: its block and the output head

    def kv_bytes(self, kv: str | KVTypes) -> int:
        """KV cache bytes per token of context in the formats `kv` (a --kv-type value, or (K, V))."""
        return sum(KV_FORMATS[t].row_bytes(self.kv_values) for t in (kv_types(kv) if isinstance(kv, str) else kv))

    @property
    def kv_bytes_per_token(self) -> dict[str, int]:
        """Bytes per token of context for each format the plan shows."""
        return {f: self.kv_bytes(f) for f in SHOWN_KV_TYPES}

    @property
    def recurrent_state_bytes(self) -> int:
        return self.ssm_state_bytes + self.conv_state_bytes

    def fixed_bytes(self, sequences: int = 1) -> int:
        """Device memory that does not grow with context: weights and recurrent state."""
        return self.weight_bytes + sequences * self.recurrent_state_bytes

    def max_context(self, memory_bytes: int, kv_format: str = "f16", *, sequences: int = 1,
                    reserve_bytes: int = 0) -> int:
        """Tokens of context (summed over sequences) that fit next to the weights and states,
        capped at the trained context length per sequence; 0 if the weights alone do not fit."""
        free = memory_bytes - reserve_bytes - self.fixed_bytes(sequences)
        if free <= 0:
            return 0
        kv = self.kv_bytes(kv_format)
        return min(free // kv, sequences * self.hparams.context_length) if kv else sequences * self.hparams.context_length


def memory_plan(model: ModelFile) -> MemoryPlan:
    """The plan of an open file."""
    return plan_tensors(model.hparams, [(t.name, t.qtype, t.shape) for t in model.tensors.values()])


def plan_tensors(hp: Hparams, tensors: Iterable[tuple[str, QuantType, tuple[int, ...]]]) -> MemoryPlan:
    """The plan from hyperparameters and (name, type, numpy-order shape) of each tensor, so a
    model can be sized before it is written (see `synth.plan`), and so can a file whose types
    zdsl cannot run yet (`zdsl model info`). The MTP head's block is counted apart (mtp_bytes):
    a run reads it only while it drafts."""
    by_type: Counter[str] = Counter()
    total = read = expert = mtp = mtp_read = 0
    by_name = {}  # the head's candidates: output.weight, or token_embd.weight in a tied file
    names = set()
    for name, qtype, shape in tensors:
        block, size = GGML_QUANT_SIZES[qtype]
        rb = shape[-1] // block * size
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * rb
        if name.startswith("blk.") and int(name.split(".")[1]) >= hp.n_layers:
            mtp += nbytes
            mtp_read += nbytes * hp.n_experts_used // hp.n_experts if name.endswith("_exps.weight") else nbytes
            continue
        names.add(name)
        by_type[qtype.name] += nbytes
        total += nbytes
        if name.endswith("_exps.weight"):
            expert += nbytes
            read += nbytes * hp.n_experts_used // hp.n_experts
        elif name == "token_embd.weight":
            read += rb                                    # one row looked up
            tied = nbytes
        else:
            read += nbytes
        if name in ("output.weight", "token_embd.weight"):
            by_name[name] = nbytes
    if "output.weight" not in names:
        read += tied                                      # the head reads the whole embedding
    n_attn, n_dn = len(hp.attention_layers), len(hp.deltanet_layers)
    head = by_name.get("output.weight", by_name.get("token_embd.weight", 0))
    return MemoryPlan(
        hparams=hp,
        weight_bytes=total,
        bytes_by_type=dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        read_per_token=read,
        expert_bytes=expert,
        kv_values=n_attn * hp.n_kv_heads * hp.head_dim,
        ssm_state_bytes=n_dn * hp.ssm_v_heads * hp.ssm_head_dim * hp.ssm_head_dim * F32,
        # the model needs the last conv_kernel − 1 inputs; the decode kernel keeps conv_kernel slots
        # (kernels/deltanet.py: the slot written is never one being read)
        conv_state_bytes=n_dn * hp.conv_kernel * hp.conv_channels * F32,
        mtp_bytes=mtp,
        mtp_read_per_draft=mtp_read + head if mtp else 0,
    )
