"""Token embedding lookup: dequantize one row of the embedding table, chosen on the GPU."""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u8, u32
from zdsl.kernels.dmmv import dequant_rows
from zdsl.kernels.quant import FORMATS, fmt


@zdsl.kernel(workgroup=64, variants={"QTYPE": list(FORMATS)}, key=("k",), sizes=("rows",),
             grid=lambda v, s: (-(-(s.k // FORMATS[v.QTYPE].block) // (64 // FORMATS[v.QTYPE].parts)), s.rows))
def embed(table: Buffer[u8], ids: Buffer[u32], out: Buffer[f32], k: u32, index: u32, stride: u32 = 1,
          QTYPE: Const = "q4_k"):
    """out[r·k : (r+1)·k] = table[ids[index + r·stride], 0:k] for the launch's `rows` r =
    workgroup_id(1): one token at decode, where the id stays on the GPU (the sampler wrote it), a
    prompt's chunk at prefill, a batch's tokens in its rows' step values (batch.py)."""
    f = fmt(QTYPE)
    ctx = f.setup()  # the IQ grids and levels in shared memory: one read of the constant table
    nblocks = k // f.block
    per_group = 64 // f.parts
    r = zdsl.workgroup_id(1)
    b = zdsl.workgroup_id() * per_group + zdsl.local_index() // f.parts
    with zdsl.if_(b < nblocks):
        base = (ids[index + r * stride] * nblocks + b) * f.nbytes
        for g in f.groups(table, base, zdsl.local_index() % f.parts, ctx):
            for i, q in enumerate(g.q):
                w = q * g.scale if g.scale is not None else q
                out[r * k + b * f.block + g.offset + i] = w + g.bias if g.bias is not None else w


def embed_ref(table_bytes, token, qtype, vocab, k):
    rows = np.asarray(table_bytes, np.uint8).reshape(vocab, -1)[token:token + 1]
    return dequant_rows(rows, qtype, 1, k)[0]
