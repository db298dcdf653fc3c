"""The weights as the decode graph reads them, assembled from the file's tensors.

The graph projects with the unfused tensors (`attn_q`, `attn_k`, `attn_v`; `ffn_gate_exps`,
`ffn_up_exps`), so a file that fuses them has them split here, row ranges of the fused tensor.
A MoE layer's shared expert is appended to the experts' stacks as expert `n_experts`: the
router names it in slot K, and routed and shared experts run as one dispatch with one code
path. That takes its gate and up in the experts' type; a file that gives them another (published
files often keep the shared expert at Q8_0 beside low-bit experts) keeps them as tensors of their
own, which the graphs run in one more dispatch into slot K. Its down projection joins the stack
only when it has the experts' type; otherwise it stays a tensor of its own. A delta-net layer's two gate
projections, `ssm_beta` and `ssm_alpha` (one row per head each), become one tensor
`ssm_beta_alpha`, which the delta-net step reads itself. The shared expert's gate vector
(`ffn_gate_inp_shexp`) becomes the router's last row, so the router computes it as one more
logit, with the same code as the others. Either pair, where its two tensors have two types, is
joined as F32 values (dequantized on upload: a few rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gguf import GGMLQuantizationType as QuantType

from zdsl.errors import ModelError
from zdsl.kernels.quant_numpy import row_bytes
from zdsl.models.qwen35.file.gguf_file import mtp_name

FUSED = {  # fused tensor → its parts, in row order
    "attn_qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "ffn_gate_up_exps.weight": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
}


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of a file tensor (along its second-innermost axis; every row if None),
    or of each row the bytes [start, stop) (`columns`: whole blocks of its values)."""

    tensor: str
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None


@dataclass(frozen=True)
class GraphTensor:
    qtype: object                 # the GGUF quantization type
    shape: tuple[int, ...]        # numpy order, as the graph sees it (a stack: experts + 1)
    parts: tuple[Part, ...]       # whose bytes, one after another, make it up
    dequantized: bool = False     # F32: the parts' values, not their bytes (parts of two types joined)


class GraphWeights:
    """`shape`, `qtype` and `parts` of every tensor the graph reads, by the graph's names.
    `files` maps a file tensor name to (numpy shape, quant type)."""

    def __init__(self, hp, files: dict[str, tuple[tuple[int, ...], object]]):
        self.hp = hp
        self.tensors: dict[str, GraphTensor] = {}
        for name, (shape, qtype) in files.items():
            self.tensors[name] = GraphTensor(qtype, tuple(shape), (Part(name),))
        head = mtp_name(hp, "eh_proj") in files
        for i in range(hp.n_layers + head):  # the MTP head, where the file has it: one more attention block
            attention = i == hp.n_layers or hp.attention[i]
            self._split_fused(f"blk.{i}.", attention)
            if not attention:
                self._join_gates(f"blk.{i}.")
            if hp.moe:
                self._stack_shared_expert(f"blk.{i}.")
                self._join_router_gate(f"blk.{i}.")
        if head:
            self._split_halves(mtp_name(hp, "eh_proj"))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def qtype(self, name: str):
        return self.tensors[name].qtype

    @property
    def output_name(self) -> str:
        """The head: `output.weight`, or the embedding when the file ties them."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def _split_fused(self, p: str, attention: bool) -> None:
        for fused, names in FUSED.items():
            if fused == "attn_qkv.weight" and not attention:
                continue  # a delta-net layer's attn_qkv is one projection, not a fusion
            t = self.tensors.pop(p + fused, None)
            if t is None:
                continue
            sizes = self._part_rows(names)
            start = 0
            for name, rows in zip(names, sizes):
                self.tensors[p + name] = GraphTensor(t.qtype, (*t.shape[:-2], rows, t.shape[-1]),
                                                     (Part(p + fused, (start, start + rows)),))
                start += rows

    def _part_rows(self, names) -> list[int]:
        hp = self.hp
        q, kv = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
        rows = {"attn_q.weight": 2 * q, "attn_k.weight": kv, "attn_v.weight": kv,
                "ffn_gate_exps.weight": hp.expert_ffn, "ffn_up_exps.weight": hp.expert_ffn}
        return [rows[n] for n in names]

    def _join_gates(self, p: str) -> None:
        """β's rows, then α's, one tensor; as F32 values where their types differ (a few rows)."""
        beta, alpha = p + "ssm_beta.weight", p + "ssm_alpha.weight"
        b, a = self.tensors[beta], self.tensors[alpha]
        if b.shape != a.shape:
            raise ModelError(f"{alpha} ({a.qtype.name} {list(reversed(a.shape))}) differs in shape from {beta} "
                             f"({b.qtype.name} {list(reversed(b.shape))}); the delta-net's gates have a row per "
                             "value head each, over the hidden size")
        joined = _joined(b, a, (2 * b.shape[0], b.shape[1]))
        self.tensors[p + "ssm_beta_alpha.weight"] = joined
        del self.tensors[beta], self.tensors[alpha]

    def _stack_shared_expert(self, p: str) -> None:
        """The shared expert's gate and up become the stacks' last expert where both have the
        experts' type and shape, its down likewise; otherwise they stay tensors of their own
        (another type, or another width: published files may widen the shared expert), which
        the graphs run in dispatches of their own."""
        pairs = [(p + f"ffn_{kind}_exps.weight", p + f"ffn_{kind}_shexp.weight") for kind in ("gate", "up", "down")]
        same = [(self.tensors[sh].qtype, self.tensors[sh].shape) == (self.tensors[s].qtype, self.tensors[s].shape[1:])
                for s, sh in pairs]
        joins = [same[0] and same[1]] * 2 + [same[2]]  # gate and up join together or not at all
        for (stack, shared), join in zip(pairs, joins):
            if join:
                self._append_slab(stack, shared)

    def _join_router_gate(self, p: str) -> None:
        """The shared expert's gate as the router's last row; as F32 values where their types
        differ."""
        router, gate = p + "ffn_gate_inp.weight", p + "ffn_gate_inp_shexp.weight"
        r, g = self.tensors[router], self.tensors[gate]
        if g.shape != r.shape[1:]:
            raise ModelError(f"{gate} ({g.qtype.name} {list(reversed(g.shape))}) differs in length from a row of "
                             f"{router} ({r.qtype.name} {list(reversed(r.shape[1:]))}); both weigh the hidden state")
        self.tensors[router] = _joined(r, self.tensors.pop(gate), (r.shape[0] + 1, *r.shape[1:]))

    def _split_halves(self, name: str) -> None:
        """The MTP head's eh_proj, which reads [enorm(e), hnorm(h)], as two projections `.e` and
        `.h` of each half (each row's first and second half of blocks), whose sum it is: the two
        normed halves are two vectors of the hidden size, as every other projection reads."""
        t = self.tensors.pop(name)
        m, k2 = t.shape
        rb = row_bytes(t.qtype, k2)
        if k2 % 2 or rb % 2 or row_bytes(t.qtype, k2 // 2) * 2 != rb:
            raise ModelError(f"{name} ({t.qtype.name}, rows of {k2}) does not split into halves of whole blocks")
        for half, columns in (("e", (0, rb // 2)), ("h", (rb // 2, rb))):
            self.tensors[f"{name}.{half}"] = GraphTensor(t.qtype, (m, k2 // 2), (Part(name, columns=columns),))

    def _append_slab(self, base: str, extra: str) -> None:
        """Tensor `extra`, of base's type and the shape of one slab of it (an expert's matrix, a
        row), becomes base's last slab: one more expert, one more row."""
        b, e = self.tensors[base], self.tensors.pop(extra)
        self.tensors[base] = GraphTensor(b.qtype, (b.shape[0] + 1, *b.shape[1:]), b.parts + e.parts)


def _joined(first: GraphTensor, second: GraphTensor, shape: tuple[int, ...]) -> GraphTensor:
    """Two tensors' rows one after the other: their bytes where they have one type, else their
    values as F32 (dequantized on upload: small tensors, which files rarely mix)."""
    if first.qtype == second.qtype:
        return GraphTensor(first.qtype, shape, first.parts + second.parts)
    return GraphTensor(QuantType.F32, shape, first.parts + second.parts, dequantized=True)


def graph_weights(model) -> GraphWeights:
    """The graph's view of an open model file (gguf_file.ModelFile)."""
    return GraphWeights(model.hparams, {t.name: (t.shape, t.qtype) for t in model.tensors.values()})


def file_ranges(model, t: GraphTensor) -> list[tuple[int, int]]:
    """The bytes of `t` as (file offset, bytes) ranges to copy one after another, neighbours
    merged: a whole tensor is one range, a row range of a fused stack one per expert."""
    out: list[list[int]] = []
    for part in t.parts:
        info = model.info(part.tensor)
        if part.columns is not None:
            (start, stop), n = part.columns, int(np.prod(info.shape[:-1], dtype=np.int64))
            row = info.nbytes // n
            pieces = [(info.offset + r * row + start, stop - start) for r in range(n)]
        elif part.rows is None:
            pieces = [(info.offset, info.nbytes)]
        else:
            rows, (start, stop) = info.shape[-2], part.rows
            row = info.nbytes // int(np.prod(info.shape[:-1], dtype=np.int64))
            outer = info.nbytes // (rows * row)
            pieces = [(info.offset + (o * rows + start) * row, (stop - start) * row) for o in range(outer)]
        for offset, n in pieces:
            if out and out[-1][0] + out[-1][1] == offset:
                out[-1][1] += n
            else:
                out.append([offset, n])
    return [(offset, n) for offset, n in out]
