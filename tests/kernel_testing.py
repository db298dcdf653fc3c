"""What the kernel tests share: the two backends, running a variant on either, subgroup sizes to
try, and the check that a kernel's Q8_1 output is its f32 output quantized."""

import numpy as np

from zdsl.autotune.tuner import close, sizes_of
from zdsl.kernels.q8_1 import q8_1_ref
from zdsl.runtime.dry import DryBuffer, DryDevice

from budget import THOROUGH

BACKENDS = ["interp", "lavapipe"]


def pick(backend, case: int, draw: int, n: int, salt: int = 0) -> int:
    """An option index of a variant parameter: hypothesis' draw in the interpreter (and on a
    device in the thorough profile); on a device otherwise fixed by the test case (`case`, e.g.
    the weight type's index; `salt` 1, 2, … reads its next digits in base n, so that cases spread
    over the combinations of several parameters), so that the device compiles one variant per
    case: lavapipe compiles each at its first dispatch, for seconds where a tile is big."""
    return draw % n if backend == "interp" or THOROUGH else (case // n ** salt) % n


def tile_sizes(kernel, backend, **sizes):
    """A tile's sizes (the rows and columns its code unrolls): as given in the interpreter, and on
    a device in the thorough profile; on a device otherwise the kernel's own for lavapipe (its
    `cpu` defaults, what the models run there). LLVM's compile time grows with the unrolled code
    (moe_gate_up_grouped in Q6_K: 2 s at 4 columns, 6 at 8), while the structure (subgroups,
    splits, workgroup) costs nothing and stays as the test draws it."""
    if backend == "interp" or THOROUGH:
        return sizes
    cpu = kernel.complete(kernel.cpu)
    return {name: cpu[name] for name in sizes}


def run(variant, backend, request, groups, **args):
    if backend == "interp":
        return variant.interpret(groups, **args)
    return variant.run(request.getfixturevalue("device"), groups, **args)


def subgroup(backend, request, pick):
    """A subgroup size the backend runs: any of 8..64 in the interpreter, the device's own on lavapipe."""
    sizes = [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


def assert_q8_1_of(xq, xd, x):
    """(xq, xd) are the Q8_1 blocks of x as the kernels quantize (q8_1.q8_1_ref): scales d to f32
    rounding, s = d·Σq, and each quant exact except where the GPU's 1/d and numpy's differ in the
    last bit for a value on a rounding half (one step, rarely)."""
    q, d = q8_1_ref(np.asarray(x, np.float32).reshape(-1))
    got_q = np.asarray(xq, np.uint32).view(np.int8).astype(np.int32)
    got = np.asarray(xd, np.float32).reshape(-1, 2)
    np.testing.assert_allclose(got[:, 0], d, rtol=1e-6)
    assert np.abs(got_q - q).max(initial=0) <= 1
    assert (got_q != q).sum() <= max(1, got_q.size // 100)
    np.testing.assert_allclose(got[:, 1], got[:, 0] * got_q.reshape(-1, 32).sum(axis=1), rtol=1e-5, atol=1e-30)



def assert_example_holds(kernel, args):
    """The inputs the tuner and the benches build for a launch of `kernel` with `args` (buffers
    given by their size in words; the check version) give what the example's reference expects,
    on the variant the launch recorded, in the interpreter at subgroup size 8 (a kernel with a
    subgroup Const) unless args name one."""
    seq = DryDevice(None).sequence()
    args = {n: DryBuffer(n, 4 * v) if n in {p.name for p in kernel.params if p.kind == "buffer"} else v
            for n, v in args.items()}
    sg = {kernel.subgroup: 8} if kernel.subgroup else {}
    launch = kernel.launch(seq, lambda k, key, fixed: k.specialize(**{**sg, **fixed}), **args)
    example = kernel.make_example(launch, np.random.default_rng(0), True)
    v, params = launch.variant, launch.variant.params
    declared = {b[0] for b in v.ir.buffers} | {s.name for s in v.ir.scalars}
    out = v.interpret(kernel.groups(params, sizes_of(example)), **{n: a for n, a in example.args.items() if n in declared})
    for name, (want, tol) in example.expect(params).items():
        assert close(out[name], want, tol) is None, name
