"""Matrix products on matrix units: C[BM × BN] = W[BM rows, K] · X[BN tokens, K]ᵀ, per workgroup.

The prompt's products have T tokens, so each weight element serves many of them: decoding it
once per tile into f16 and letting the matrix units (zdsl.mat_mul_add: tensor cores, WMMA) do
the multiply-adds makes the work the decode, not the arithmetic. Per step of BK along K:

    A[BM][BK] ← the weight rows, dequantized (quant.py's Groups: w = scale·q + bias)
    B[BN][BK] ← the tokens' activation rows (f16, or f32 rounded to f16)
    the next step's loads issued (Staged)
    barrier
    C += A · Bᵀ, 16 × 16 tiles, subgroup s owning tiles (TM × TN of them) of C

A and B hold f16 × 4 (8-byte stores). Then C goes through shared memory to the caller's `store`,
which knows where each (row, token) belongs: a plain output row, an expert pair's row, a SwiGLU
of two row sets. The weights are read once per token tile (from L2 after the first), the
activations once per row tile.

W's rows may come from S stacks (the gate and up rows of a SwiGLU): rows i·BM/S … of tile row
set i, so their C rows land side by side for `store`.

Error: each product rounds w and x to f16 (11-bit significands) and sums in f32, so
|y − W·x| ≤ 2⁻¹⁰ · Σ |w||x| (+ the f32 sum's rounding); tests hold the kernels to that.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import zdsl
from zdsl import f16, f32
from zdsl.kernels import quant
from zdsl.kernels.quant import fmt

TILE = 16  # the matrix units' tile edge (zdsl/lang/matrices.py)
BK = 256   # K per step by default, and the K a product must be a multiple of: whole blocks of every format
PAD = 8    # f16 elements after each shared row: rows start 16 bytes apart from bank to bank


SHARED_BYTES = 48 * 1024  # the shared memory a workgroup may have on the H100 (and most Vulkan devices)


STEPS = [0, 128, 64]  # the K steps the tuner may try (0: BK, whole blocks; 64 where a type's int8 parts allow)


def step_k(bk: int) -> int:
    """K per step: bk, by default BK (whole blocks of every format). A format whose int8 parts
    cover K in runs (the K-quants: 64 or 128; IQ3_XXS: 32) may step through part of a block,
    which leaves shared memory for larger tiles (by_steps). In the same tiles it is slower on
    the H100 (pp512 of the 35B-A3B: 4,190 tok/s in steps of 128, 4,827–4,867 with
    Q4_K in steps of 64, 4,886–4,910 in steps of 256): more steps, each a chain of loads,
    decode, barrier and products. With the tiles tuned for them, steps of 64 win most of the
    H100's Q4_K uses (`zdsl tune --device 0 --prompt 512`: the experts' down 348 →
    260 µs, a 4,096-row projection 123 → 110; pp512 6,411 → 6,829): half the registers stage a
    step, and more workgroups share an SM."""
    return bk or BK


def steps_by(f, bk: int) -> bool:
    """Whether format f steps through K by bk: whole blocks, or whole runs of int8 parts within
    a block (the K-quants, IQ3_XXS)."""
    return bk % f.block == 0 or (0 < f.ispan and bk % f.ispan == 0 and f.block % bk == 0)


def short_steps(QTYPE: str) -> bool:
    """Whether the type steps through K by 128."""
    return steps_by(fmt(QTYPE), 128)


def by_steps(short, whole) -> zdsl.Derived:
    """A tile default: `short` where the type steps by 128 (which leaves shared memory for larger
    tiles), `whole` where it takes whole blocks of 256."""
    return zdsl.Derived(lambda v: short if short_steps(v.QTYPE) else whole)


def fits(v) -> bool:
    """Whole tiles per subgroup, K steps of whole blocks or of whole runs of int8 parts, and the
    tiles in shared memory."""
    return (v.BM % (TILE * v.TM) == 0 and v.BN % (TILE * v.TN) == 0 and steps_by(fmt(v.QTYPE), step_k(v.BK))
            and shared_bytes(v) <= SHARED_BYTES)


def operand_bytes(BM: int, BN: int, bk: int) -> int:
    """A and B in f16 with their padding."""
    return 2 * (BM + BN) * (bk + PAD)


def c_in_operands(BM: int, BN: int, bk: int) -> bool:
    """Whether C (f32) fits in A and B's storage, which it takes once the K loop is done."""
    return 4 * BM * BN <= operand_bytes(BM, BN, bk)


def shared_bytes(v) -> int:
    """A and B, C unless it takes their storage, the grouped kernels' list of BN pairs, the
    weight type's table."""
    bk = step_k(v.BK)
    c = 0 if c_in_operands(v.BM, v.BN, bk) else 4 * v.BM * v.BN
    return operand_bytes(v.BM, v.BN, bk) + c + 4 * v.BN + fmt(v.QTYPE).table_bytes()


def workgroup(v) -> int:
    """One subgroup per TM × TN tiles of C."""
    return invocations(v.BM, v.BN, v.TM, v.TN, v.SG)


def invocations(BM: int, BN: int, TM: int, TN: int, SG: int) -> int:
    return (BM // (TILE * TM)) * (BN // (TILE * TN)) * SG


class Tiles:
    """The shared arrays of one workgroup's product, and where its subgroup computes."""

    def __init__(self, BM: int, BN: int, BK: int, TM: int, TN: int, SG: int, QTYPE: str):
        BK = step_k(BK)
        need = shared_bytes(SimpleNamespace(BM=BM, BN=BN, BK=BK, QTYPE=QTYPE))
        if need > SHARED_BYTES:  # a device may lose itself over a pipeline that asks for more
            raise zdsl.ZdslError(f"tiles of {BM} × {BN} × {BK} of {QTYPE} need {need:,} bytes of shared memory, "
                                 f"more than {SHARED_BYTES:,}")
        self.BM, self.BN, self.BK, self.TM, self.TN = BM, BN, BK, TM, TN
        self.WG = invocations(BM, BN, TM, TN, SG)
        self.SA = BK + PAD
        # f16 × 4 elements: decoded values and activations go in 8-byte stores (offsets count fours)
        self.a = zdsl.shared(f16.vec(4), BM * self.SA // 4)
        self.b = zdsl.shared(f16.vec(4), BN * self.SA // 4)
        # C[m][n] at c[n·BM + m], in A and B's storage where it fits there (past the K loop they
        # are dead): the shared memory a workgroup needs sets how many share an SM (NVIDIA's
        # driver gives them 100 KiB of an H100's)
        self.c = zdsl.shared(f32, BM * BN, over=(self.a, self.b) if c_in_operands(BM, BN, BK) else ())
        self.tid = zdsl.local_index()
        across = BM // (TILE * TM)  # subgroups along M
        sub = zdsl.subgroup_id()
        self.row0, self.col0 = (sub % across) * (TILE * TM), (sub // across) * (TILE * TN)

    def spread(self, count: int, body) -> None:
        """body(u) for u in 0 … count − 1, spread over the workgroup. A loop the GPU runs, not
        unrolled: a tile step unrolled whole is more machine code than the instruction cache
        holds (seen on the H100: 144 KB per pipeline, 10× slower)."""
        if count <= self.WG:
            with zdsl.if_(self.tid < count):
                body(self.tid)
            return
        for u in zdsl.range(self.tid, count, self.WG):
            body(u)


def weight_rows(QTYPE: str, k, m, per_stack: int):
    """(format, its set-up, r0, rows): this workgroup's tile starts at row r0 = workgroup_id(0) ·
    per_stack of each stack, and rows(e)(i) is the byte offset of its row i in matrix e of a stack
    of m-row matrices of k values (clamped to the last row: past it, only C's unstored rows read)."""
    f = fmt(QTYPE)
    r0 = zdsl.workgroup_id(0) * per_stack
    row_bytes = (k // f.block) * f.nbytes
    return f, f.setup(), r0, lambda e: lambda i: (e * m + zdsl.min(r0 + i, m - 1)) * row_bytes


class Staged:
    """A buffer whose loads land in registers one tile step ahead. The code that decodes a step
    runs twice on it: `fetch` issues every load that code makes (its arithmetic on them is dead
    and compiled away) into variables, `replay` hands the same code those variables in the same
    order. So each invocation has all its loads of a step in flight at once, and the next step's
    are in flight while the matrix units work on this one: shared memory leaves room for only a
    few workgroups per SM, too few to hide memory latency one load at a time."""

    def __init__(self, buf):
        self.buf, self.regs, self.mode, self.n = buf, [], "fetch", 0

    @staticmethod
    def run(buffers: list, mode: str, code) -> None:
        """code() with every buffer's loads fetched ("fetch") or replayed ("replay")."""
        for b in buffers:
            b.mode, b.n = mode, 0
        code()

    def view(self, dtype):
        return _StagedView(self, dtype)

    @property
    def vec4(self):
        return self.view(self.buf.dtype.vec(4))

    def load(self, dtype, index):
        i, self.n = self.n, self.n + 1
        if self.mode == "replay":
            return self.regs[i]
        v = self.buf.view(dtype)[index]
        if i == len(self.regs):  # the first fetch declares the registers, before the K loop
            self.regs.append(zdsl.var(v))
        else:
            self.regs[i].set(v)
        return v


class _StagedView:
    def __init__(self, staged: Staged, dtype):
        self.staged, self.dtype = staged, dtype

    def __getitem__(self, index):
        return self.staged.load(self.dtype, index)


def split(f, shares: int, invocations: int) -> int:
    """Pieces per int8 part (a power of two, at most the format's ipieces) so that a stack's
    shares of a step reach the invocations: where they do not, the decode, a step's longest
    chain, runs on some of them while the rest wait at the barrier."""
    pieces = 1
    while pieces < f.ipieces and shares * pieces < invocations:
        pieces *= 2
    return pieces


def _shares(t: Tiles, count: int, body) -> None:
    """body(u, live) for this invocation's shares u of 0 … count − 1, unrolled (each share's loads
    are staged apart). In a last, partial round u is clamped to count − 1 (its loads stay in
    bounds) and live says whether to store; otherwise live is None."""
    for r in range(-(-count // t.WG)):
        u = t.tid + r * t.WG
        if (r + 1) * t.WG <= count:
            body(u, None)
        else:
            body(zdsl.min(u, count - 1), u < count)


def _stores(live):
    """The stores of a share: all, or those of a live one."""
    return contextlib.nullcontext() if live is None else zdsl.if_(live)


def product(t: Tiles, f, ctx, stacks, x, token_base, k):
    """C of this workgroup into t.c (read it after the barrier this leaves): stacks is a list of
    (weight buffer, byte base of tile row i of that stack) whose rows fill A in turn; x the f32
    activations, token_base(n) the element offset of tile token n's row. Accumulators in f32."""
    BM, BN, BK, TM, TN = t.BM, t.BN, t.BK, t.TM, t.TN
    per_stack = BM // len(stacks)
    # a row's shares of a step: the int8 parts of its BK elements where the format has them (a
    # part's runs share a scale: Q4_K's part is two runs of 32 under one scale each, where its
    # f32 part takes 4 values of each of 8 runs, 8 scales and mins made per 32 values), split
    # into pieces until every invocation has one; else every f32 part of its whole blocks
    ints = f.iparts > 0
    pieces = split(f, per_stack * BK * f.iparts // f.block, t.WG) if ints else 1
    per_row = BK * (f.iparts * pieces if ints else f.parts) // f.block
    staged = [Staged(w) for w, _ in stacks] + [Staged(x)]

    def share(w, row, k0, r):
        """(groups, element offset in the step of element 0 of the block) of a row's share r."""
        if not ints:
            b, part = r // f.parts, r % f.parts
            return f.groups(w, row + (k0 // f.block + b) * f.nbytes, part, ctx), b * f.block
        if BK % f.block == 0:  # whole blocks
            b, part, within = r // (f.iparts * pieces), r % (f.iparts * pieces), 0
        else:
            within = k0 % f.block
            b, part = 0, within // (f.block // f.iparts) * pieces + r
        groups = f.int_groups(w, row + (k0 // f.block + b) * f.nbytes, part, ctx, pieces)
        return [quant.unit_group_of(g) for g in groups], b * f.block - within

    def step(k0, store: bool):
        """The loads of the K step at k0 and, with store, A and B decoded from them."""
        for s, (_, row_base) in enumerate(stacks):
            def decode(u, live, s=s, row_base=row_base):
                i = u // per_row
                groups, shift = share(staged[s], row_base(i), k0, u % per_row)
                at = (s * per_stack + i) * t.SA + shift
                if store:
                    with _stores(live):
                        for g in groups:
                            v = [q if g.scale is None else (q * g.scale if g.bias is None else zdsl.fma(q, g.scale, g.bias))
                                 for q in g.q]
                            for j in range(0, len(v), 4):  # groups are fours (or eights) at multiples of four
                                t.a[(at + g.offset + j) // 4] = zdsl.vec(*(e.to(f16) for e in v[j:j + 4]))
            _shares(t, per_stack * per_row, decode)

        def activations(u, live):
            n, c = u // (BK // 4), u % (BK // 4)
            v = staged[-1].vec4[(token_base(n) + k0) // 4 + c]
            if store:
                with _stores(live):
                    t.b[(n * t.SA) // 4 + c] = v.to(f16.vec(4))
        _shares(t, BN * BK // 4, activations)

    acc = [[zdsl.var(zdsl.mat_fill(0.0)) for _ in range(TN)] for _ in range(TM)]
    zdsl.barrier()  # what the caller wrote to shared memory (the tile's pairs) is visible
    Staged.run(staged, "fetch", lambda: step(0, False))
    for k0 in zdsl.range(0, k, BK):
        zdsl.barrier()  # the last step's tiles are read
        Staged.run(staged, "replay", lambda: step(k0, True))
        with zdsl.if_(k0 + BK < k):
            Staged.run(staged, "fetch", lambda: step(k0 + BK, False))
        zdsl.barrier()
        for kk in zdsl.range(0, BK, TILE):
            a = [zdsl.mat_load(t.a, ((t.row0 + TILE * i) * t.SA + kk) // 4, t.SA // 4, use="a") for i in range(TM)]
            b = [zdsl.mat_load(t.b, ((t.col0 + TILE * j) * t.SA + kk) // 4, t.SA // 4, use="b", column_major=True)
                 for j in range(TN)]
            for i in range(TM):
                for j in range(TN):
                    acc[i][j].set(zdsl.mat_mul_add(a[i], b[j], acc[i][j]))
    zdsl.barrier()  # every subgroup's last products have read A and B, whose storage C may take
    for i in range(TM):
        for j in range(TN):
            zdsl.mat_store(acc[i][j], t.c, (t.col0 + TILE * j) * BM + t.row0 + TILE * i, BM, column_major=True)
    zdsl.barrier()
