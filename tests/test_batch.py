"""Batched decode (models/qwen35/model/batch.py) against each sequence's own decode step, on lavapipe:
three sequences at different positions (prompts of 5, 12 and 31 tokens) step together, for the
MoE and the dense tiny models and weight types on the int8 and the f32 paths; the logits of each
row, its KV cache rows and delta-net state, and its sampled tokens against those of the same
sequence stepped alone (the path tests/test_decode.py holds to the numpy reference), and the
first step's logits against the reference too (test_prefill.py's bound: 8% of their spread).
Bursts of steps fed on the GPU give what steps fed from the host give. The first step, of the
first and third sequence, runs in the step of all the batch's rows (the second's launches empty);
the next ones, of all three, in their own step, recorded from the start on another thread.

A batch runs the single step's kernels, a column or a row per sequence, so its results are the
single step's up to the order of a few sums: logits within 10⁻³ of their spread (seen: equal),
states within 10⁻³ of their norm, greedy tokens equal where the lead is clearer than that.
"""

import numpy as np
import pytest

from zdsl.errors import ZdslError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import QuantType, open_model
from zdsl.models.qwen35.model.batch import Batch
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.models.qwen35.model.reference import ReferenceModel
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.runtime.memory import PiecedBuffer

from graph_testing import state_of

PROMPTS = (5, 12, 31)
SAME = 1e-3
REFERENCE = 0.08


MIXED = {"ffn_up_exps": "q5_k", "ffn_up_shexp": "q8_0", "ffn_down_shexp": "q8_0", r"blk\.1\.ffn_gate_exps": "q6_k"}


@pytest.fixture(scope="module", params=[("tiny", "q4_k_m"), ("tiny-dense", "q4_k_m"), ("tiny", "f16"),
                                        ("tiny", "q4_k_m", "qwen35", MIXED)],
                ids=["moe-q4_k_m", "dense-q4_k_m", "moe-f16", "moe-248k-vocab-mixed"])
def model(request, tmp_path_factory):
    """The last: Qwen3.5's 248,320-row output head (more workgroups than lavapipe launches along
    an axis, a batch's logits rows that far apart) and per-tensor types that split the experts'
    gate and up, and the shared expert off the experts' stack (its own down product)."""
    preset, quant, vocab, types = (*request.param, None, None)[:4]
    path = tmp_path_factory.mktemp("models") / "model.gguf"
    synth.write(path, preset, quant=quant, seed=7, vocab=synth.REAL_VOCABS[vocab] if vocab else None,
                tensor_types={p: QuantType[t.upper()] for p, t in (types or {}).items()})
    return open_model(path)


@pytest.fixture
def graphs(model, device):
    gs, prompts = three_sequences(model, device)
    yield gs, prompts
    for g in reversed(gs):
        g.close()


def three_sequences(model, device, step_tokens: int = 1):
    """Three sequences on one copy of the weights, each fed its own prompt."""
    rng = np.random.default_rng(3)
    make = lambda **kw: DecodeGraph(model, device, 64, SamplerConfig(temperature=0), progress=False, chunk=16,
                                    checkpoint=True, step_tokens=step_tokens, **kw)
    first = make()
    gs = [first] + [make(weights_of=first) for _ in PROMPTS[1:]]
    prompts = [rng.integers(0, model.hparams.vocab, n).tolist() for n in PROMPTS]
    for g, prompt in zip(gs, prompts):
        g.reset()
        g.prefill(prompt)
    return gs, prompts


def near(got, want, spread, what, bound=SAME):
    assert np.abs(got - want).max() <= bound * spread, f"{what}: {np.abs(got - want).max() / spread:.3g} of the spread"


def test_a_batched_step_leaves_each_sequence_as_its_own_step(model, graphs):
    batched_steps_leave_each_sequence_as_its_own_step(model, *graphs)


def test_tensors_in_pieces_batch_as_single_steps(pieced_device, tmp_path):
    """On a device that binds 64 KiB at once (tests/conftest.py), where the weights, the batch's
    logits rows and the sequences' caches come in pieces, bound to launches sent indirect."""
    path = tmp_path / "model.gguf"
    synth.write(path, "tiny", quant="q4_k_m", seed=7)
    model = open_model(path)
    gs, prompts = three_sequences(model, pieced_device)
    try:
        assert all(isinstance(gs[0].weights[name], PiecedBuffer) for name in ("output.weight", "token_embd.weight",
                                                                              "blk.0.ffn_up_exps.weight"))
        batched_steps_leave_each_sequence_as_its_own_step(model, gs, prompts)
    finally:
        for g in reversed(gs):
            g.close()


def batched_steps_leave_each_sequence_as_its_own_step(model, gs, prompts):
    batch = Batch(gs)
    ref = ReferenceModel(model, int8_activations=True)
    rng = np.random.default_rng(4)
    try:
        # positions move on: each step reads what earlier ones wrote
        for step, some in enumerate([(0, 2), (0, 1, 2), (0, 1, 2)]):
            fed = rng.integers(0, model.hparams.vocab, len(gs)).tolist()
            for g in gs:
                g.checkpoint()
            if step == 1:
                batch.settle()  # the steps recorded ahead are ready
                assert batch._step(list(some)) is not batch._all_rows.result()
            stepped = [gs[r] for r in some]
            got = dict(zip(some, batch.decode(stepped, 1, tokens=[fed[r] for r in some])))
            rows = batch.logits.read(np.float32, (len(gs), model.hparams.vocab))
            states = [state_of(g) for g in gs]
            for r, (g, token) in enumerate(zip(gs, fed)):
                if r not in some:
                    continue
                g.restore()
                alone = g.decode(token)
                want, spread = g.logits(), g.logits().std()
                near(rows[r], want, spread, f"step {step}, sequence {r}")
                for name, value in state_of(g).items():
                    err = np.linalg.norm(states[r][name] - value) / max(np.linalg.norm(value), 1e-30)
                    assert err <= SAME, f"step {step}, sequence {r}: {name} differs by {err:.3g} of its norm"
                top2 = np.sort(want)[-2:]
                if top2[1] - top2[0] > 2 * SAME * spread:
                    assert got[r] == [alone], f"step {step}, sequence {r}: greedy token"
                if step == 0 and not g.prefill_units:  # a prompt on matrix units rounds otherwise (test_prefill.py)
                    expected = ref.forward(prompts[r] + [token])[-1]
                    near(rows[r], expected, expected.std(), f"sequence {r} against the reference", REFERENCE)
    finally:
        batch.close()


@pytest.mark.parametrize("model", [("tiny-dense", "q4_k_m"), ("tiny", "q4_k_m", "qwen35", MIXED)], indirect=True,
                         ids=["dense-q4_k_m", "moe-248k-vocab-mixed"])
def test_a_mixed_step_leaves_each_sequence_as_its_own_steps(model, device):
    """Mixed steps: some sequences take several tokens (a prompt's next ones, a draft), the others
    one, in one step, in rows in another order than the batch's. Each sequence's logits rows,
    KV rows and states, and sampled tokens are those of its own step of the same tokens
    (decode_tokens; decode for one), which tests/test_token_rows.py holds to single steps; and a
    sequence fed several can be cut back after, as after decode_tokens."""
    gs, _ = three_sequences(model, device, step_tokens=4)
    batch = Batch(gs, rows=8)
    rng = np.random.default_rng(5)
    try:
        for shape in [((0, 3), (1, 1), (2, 2)), ((2, 1), (0, 4), (1, 1))]:
            feeds = [(gs[r], rng.integers(0, model.hparams.vocab, n).tolist()) for r, n in shape]
            for g in gs:
                g.checkpoint()
            got = batch.step(feeds)
            rows = batch.logits.read(np.float32, (sum(n for _, n in shape), model.hparams.vocab))
            states = {r: state_of(gs[r]) for r, _ in shape}
            first = 0
            for (r, n), (g, tokens), tokens_got in zip(shape, feeds, got):
                g.restore()
                alone = g.decode_tokens(tokens) if n > 1 else [g.decode(tokens[0])]
                want = g.token_rows.logits_of(n) if n > 1 else g.logits()[None]
                for j in range(n):
                    spread = want[j].std()
                    near(rows[first + j], want[j], spread, f"{shape}: sequence {r}, row {j}")
                    top2 = np.sort(want[j])[-2:]
                    if top2[1] - top2[0] > 2 * SAME * spread:
                        assert tokens_got[j] == alone[j], f"{shape}: sequence {r}, row {j}: greedy token"
                for name, value in state_of(g).items():
                    err = np.linalg.norm(states[r][name] - value) / max(np.linalg.norm(value), 1e-30)
                    assert err <= SAME, f"{shape}, sequence {r}: {name} differs by {err:.3g} of its norm"
                first += n
        # the last step fed the first sequence 4 tokens: cut back to 1 of them, it steps on as after one
        g, p0 = gs[0], gs[0].position - 4
        g.restore()
        counter = int(g.step_words[3])
        batch.step([(g, feeds[1][1])])
        assert g.last_step == (p0, counter, 4)  # the sampler's counter before the step, which a cut goes back to
        g.cut(p0 + 1)
        g.decode(feeds[1][1][1])
        after_cut = g.logits()
        g.restore()
        g.decode(feeds[1][1][0])
        g.decode(feeds[1][1][1])
        assert g.position == p0 + 2
        near(after_cut, g.logits(), g.logits().std(), "cut back after a mixed step")
        with pytest.raises(ZdslError, match="holds 1 to 8 rows"):
            batch.step([(gs[0], [1] * 4), (gs[1], [1] * 4), (gs[2], [1])])
    finally:
        batch.close()
        for g in reversed(gs):
            g.close()


def test_a_burst_on_the_gpu_is_steps_fed_from_the_host(graphs):
    gs, _ = graphs
    batch = Batch(gs)
    try:
        for g in gs:
            g.checkpoint()
        burst = batch.decode(gs[::-1], 4)[::-1]  # rows in another order than the batch's
        assert all(g.position == n + 4 for g, n in zip(gs, PROMPTS))
        for g in gs:
            g.restore()
        last = [None] * len(gs)
        for i in range(4):
            one = batch.decode(gs, 1, tokens=None if i == 0 else last)
            last = [toks[0] for toks in one]
            assert last == [b[i] for b in burst], f"step {i}"
        # two of the three on: the third sits the steps out, untouched, and steps on alone from there
        position, kept, words = gs[1].position, state_of(gs[1]), gs[1].step.read(np.uint32, (8,))
        batch.decode([gs[2], gs[0]], 2)
        assert gs[1].position == position and gs[0].position == gs[2].position - PROMPTS[2] + PROMPTS[0]
        assert all(np.array_equal(value, kept[name]) for name, value in state_of(gs[1]).items())
        assert np.array_equal(gs[1].step.read(np.uint32, (8,)), words)
        gs[1].decode()
    finally:
        batch.close()


def test_a_batch_refuses_graphs_that_do_not_share_weights(model, device, graphs):
    gs, _ = graphs
    other = DecodeGraph(model, device, 32, SamplerConfig(temperature=0), progress=False, chunk=16)
    try:
        with pytest.raises(ZdslError, match="weights_of"):
            Batch([gs[0], other])
        batch = Batch(gs)
        with pytest.raises(ZdslError, match="distinct graphs"):
            batch.decode([gs[0], gs[0]])
        batch.close()
    finally:
        other.close()


def test_the_memory_plan_holds_every_slot_and_the_batch(model, device, monkeypatch):
    """A graph made for three sequences (a server's --parallel 3) plans, before it allocates
    anything, what the two that will read its weights and the batched step of all three take:
    the device memory they hold once made is what it planned (up to Vulkan's largest offset
    alignment, which the plan takes for the batch's workgroup counts); a
    device with less free than that refuses the first graph in one line that names a context
    that fits, where one sequence alone would have been let in."""
    from zdsl.errors import OutOfMemoryError
    from zdsl.runtime.device import Device

    sampler = SamplerConfig(temperature=0)
    make = lambda **kw: DecodeGraph(model, device, 64, sampler, progress=False, chunk=16, checkpoint=True, **kw)
    held = lambda: device.memory_report().get("device", {"used": 0})["used"]
    before = held()
    first = make(slots=3)
    gs = [first] + [make(weights_of=first) for _ in range(2)]
    batch = Batch(gs)
    try:
        planned = sum(s.nbytes for s in first.plan(64, 3))
        alone = sum(s.nbytes for s in first.plan(64))
        used = held() - before
        assert alone < used <= planned <= used + (64 << 10)  # over by the workgroup counts' alignment at most
    finally:
        batch.close()
        for g in reversed(gs):
            g.close()
    monkeypatch.setattr(Device, "memory_available", lambda self: (alone + planned) // 2)
    with pytest.raises(OutOfMemoryError, match=r"^this model with 3 sequences at --ctx 64 needs .* free; "
                                               r"(--ctx \d+ would fit .*; or )?--parallel [12] would fit$") as e:
        make(slots=3)
    assert "\n" not in str(e.value)
    make().close()
