"""Batched prefill (models/qwen35/model/prefill.py) against the token-by-token decode path and the numpy
reference, on lavapipe: prompts of 1, 7, 64 and 300 tokens in chunks of 64 (the last crossing
chunk boundaries and ending on a partial chunk), for the MoE and the dense tiny models, weight
types on the int8 and on the f32 path, and a real vocabulary (whose 248,320-row output head
makes a lavapipe decode step ~0.25 s: its longest prompt is 70 tokens, across one boundary).

The two paths compute the same products in other tile shapes (summation orders), so a Q8_1
activation that sits within rounding of a half step can land a step apart, and random layers carry
that on (tests/test_decode.py's bounds explain the sizes). So: the last position's logits within
8% of their standard deviation of the decode path's and of the reference's (seen: under 3%);
KV cache rows and delta-net states within 5% of their norm of the decode path's; the conv rings
(the projections' raw outputs) likewise; greedy continuations equal where the reference's lead is
clear.

A device with matrix units (the H100: ZDSL_TEST_DEVICE=0) runs the prompt's products on them
(all but the router's), W and x rounded to f16 (kernels/mma.py); the decode path reads Q8_1
throughout, and on these random models the two roundings alone move the logits by up to 44% of
their spread. So there the logits are held to a reference that rounds as the prompt path does
(`reference_with_ties`: f16 products, Q8_1 for the last token's decode step), the KV caches and
delta-net states to its state (5% of their norm; everywhere, the prompt path's state is also held
to the reference's), and the greedy token to it. Even that reference sums in another order, and where the router's 8th and 9th experts
for a token lie within rounding of each other the two may pick differently; one such pick moves
these random models' logits by half their spread (the 248k-vocabulary model at 64 tokens:
layer 1, token 29, logits 7·10⁻⁴ of the row's largest apart). So where the logits miss the
reference, they must meet it with one of its near ties of the routing taken the other way. The
same holds on lavapipe, where both paths read Q8_1 as the reference does: the IQ3_XXS model's
decode path at 300 tokens (on a prompt drawn alone, before the prompts were prefixes of one
sequence) took layer 1's tie at token 88 (a gap of 2⁻⁹ of the row's largest logit) the other
way, which moved the last logits by 37% of their spread. The kernels themselves are held to
tight bounds in tests/test_kernels_mma.py and the other kernel tests.
"""

import numpy as np
import pytest

from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import QuantType, open_model
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.models.qwen35.model.reference import ReferenceModel
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.runtime.memory import PiecedBuffer

from graph_testing import router_ties, state_of

PROMPTS = (1, 7, 64, 300)
REAL_VOCAB_PROMPTS = (1, 7, 64, 70)  # the path to the last prompt is as many decode steps
PROMPT_CHUNK = 64  # prompts of 300 tokens run in several chunks
LOGITS, STATE = 0.08, 0.05
TIE = 2 ** -9  # router logits this close (relative to the row's largest) may swap under f16 rounding


MODEL_PARAMS = [("tiny", "q4_k_m", None, None, None, 5), ("tiny-dense", "q4_k_m", None), ("tiny", "q8_0", None),
                ("tiny", "f16", None), ("tiny", "mxfp4_moe", None), ("tiny", "iq3_xxs_dynamic", None),
                ("tiny", "iq3_xxs_dynamic", None, 416), ("tiny", "q4_k_m", "qwen35"),
                ("tiny", "q4_k_m", None, None, {"ffn_up_exps": "q5_k", "ffn_up_shexp": "q8_0"}),
                ("tiny", "q4_k_m", None, None, {"ssm_alpha": "f16", r"blk\.1\.ffn_gate_inp\.": "q8_0"})]
MODEL_IDS = ["moe-q4_k_m", "dense-q4_k_m", "moe-q8_0", "moe-f16", "moe-mxfp4", "moe-iq3_xxs_dynamic",
             "moe-wide-shared", "moe-248k-vocab", "moe-gate-up-two-types", "moe-gates-two-types"]


@pytest.fixture(scope="module", params=MODEL_PARAMS, ids=MODEL_IDS)
def model(request, tmp_path_factory):
    """Q4_K_M mixes four int8 types, Q8_0 is one, F16 has no int8 decoder (the f32 path), nor has
    MXFP4 (the experts, beside a Q8_0 shared expert); IQ3_XXS experts have one, beside IQ4_XS
    down on the f32 path, and beside a Q8_0 shared expert as wide as them or wider (416: products
    of its own); one has Qwen3.5's 248,320-row output head, the last two pairs of two types: gate
    and up (Q4_K and Q5_K experts, Q4_K and Q8_0 shared), β and α (Q8_0, F16) and a Q8_0 router
    beside the shared expert's F32 gate. The first has a fifth layer, a delta-net after the
    attention layer, whose state shows the attention's output (in four layers only the logits
    do)."""
    preset, quant, vocab, shared_ffn, types, layers = (*request.param, None, None, None)[:6]
    path = tmp_path_factory.mktemp("models") / "model.gguf"
    synth.write(path, preset, layers=layers, quant=quant, seed=5, vocab=synth.REAL_VOCABS[vocab] if vocab else None,
                shared_ffn=shared_ffn, tensor_types={p: QuantType[t.upper()] for p, t in (types or {}).items()})
    return open_model(path)


def reference_with_ties(model, prompt, flip=None, units=True):
    """The last position's logits with the prompt's products rounded as on matrix units (not
    with units=False: Q8_1 throughout, as the decode path), the near ties of the routing:
    (layer, position) where the router's K-th and (K+1)-th logits lie within TIE of the row's
    largest |logit|, so that a rounding elsewhere can swap them, and the state it leaves. `flip`
    names one of those ties whose two experts are swapped."""
    ref = ReferenceModel(model, int8_activations=True)
    q8, plain_w, plain_proj = ref.input_of, ref.w, ref.proj
    K, state, ties = model.hparams.n_experts_used, ref.new_state(), []

    def on_units(name):
        """Whether the prompt's product by weight `name` runs on matrix units: all but the router's."""
        return units and "gate_inp" not in name

    def w16(name):
        w = plain_w(name)
        return w.astype(np.float16).astype(np.float32) if name.endswith(".weight") and "norm" not in name \
            and "token_embd" not in name and "conv1d" not in name and on_units(name) else w

    def prompt_input(name, x):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32) if on_units(name) else q8(name, x)

    def proj(x, name):
        return router_ties(plain_proj(x, name), name, K, TIE, state.pos, ties, flip)

    ref.proj = proj
    ref.w, ref.expert, ref.input_of = w16, (lambda name, e: w16(name)[e]), prompt_input
    ref.forward(prompt[:-1], state)
    ref.w, ref.expert, ref.input_of = plain_w, ReferenceModel.expert.__get__(ref), q8
    return ref.forward(prompt[-1:], state)[-1], ties, state


def assert_states_near(got, state, what: str) -> None:
    """The graph's KV caches and delta-net states (state_of) within STATE of their norm of the
    reference's: K and V as (position, kv head, dim), each value head's state as (key, value)."""
    want = {f"ssm{i}": s for i, s in state.ssm.items()}
    for i, (k, v) in state.kv.items():
        want[f"k{i}"], want[f"v{i}"] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    for name, value in want.items():
        value = np.asarray(value, np.float64).reshape(-1)
        err = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-30)
        assert err <= STATE, f"{what}: {name} differs from the reference's by {err:.3g} of its norm"


def test_prefill_leaves_what_decode_steps_leave(model, device):
    prefill_leaves_what_decode_steps_leave(model, device)


def test_tensors_in_pieces_prefill_as_decode_steps(pieced_device, tmp_path):
    """On a device that binds 64 KiB at once (tests/conftest.py), where the output head, the token
    embedding, the experts' stacks (each expert's matrix a slice of them, some across a seam) and
    the chunk's rows come in pieces: the same bounds, for prompts of up to 70 tokens (two chunks)."""
    path = tmp_path / "model.gguf"
    synth.write(path, "tiny", quant="q4_k_m", seed=5)
    prefill_leaves_what_decode_steps_leave(open_model(path), pieced_device, REAL_VOCAB_PROMPTS, pieced=(
        "output.weight", "token_embd.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"))


def prefill_leaves_what_decode_steps_leave(model, device, prompts=None, pieced=()):
    """`prompts`: their lengths (by default, as the model's vocabulary says); `pieced`: weights
    that must come in pieces on `device`."""
    prompts = prompts or (REAL_VOCAB_PROMPTS if model.hparams.vocab in synth.REAL_VOCABS.values() else PROMPTS)
    g = DecodeGraph(model, device, max(prompts) + 8, SamplerConfig(temperature=0), progress=False, chunk=PROMPT_CHUNK)
    assert all(isinstance(g.weights[name], PiecedBuffer) for name in pieced)
    ref = ReferenceModel(model, int8_activations=True)
    rng = np.random.default_rng(1)
    units = g.prefill_units
    try:
        # the prompts are prefixes of one sequence, so one pass of decode steps gives the decode
        # path's token, logits and state after each of them (a step's state does not depend on the
        # steps after it)
        tokens = rng.integers(0, model.hparams.vocab, max(prompts)).tolist()
        g.reset()
        stepped_after = {}
        for i, tok in enumerate(tokens):
            stepped = g.decode(tok)
            if i + 1 in prompts:
                stepped_after[i + 1] = stepped, g.logits(), state_of(g)
        for n in prompts:
            prompt = tokens[:n]
            stepped, want_logits, want = stepped_after[n]
            g.reset()
            g.prefill(prompt[:-1])
            assert g.position == n - 1
            first = g.decode(prompt[-1])
            logits, got = g.logits(), state_of(g)
            ref_state = ref.new_state()
            expected = ref.forward(prompt, ref_state)[-1]
            spread = expected.std()
            if units:
                expected, ties, ref_state = reference_with_ties(model, prompt)
                if np.abs(logits - expected).max() <= LOGITS * spread:
                    assert_states_near(got, ref_state, f"{n} tokens")
                else:  # a near tie of the routing taken the other way?
                    near = [reference_with_ties(model, prompt, flip=tie)[0] for tie in ties]
                    assert min(np.abs(logits - e).max() for e in near + [expected]) <= LOGITS * spread, \
                        f"{n} tokens: against the reference ({len(ties)} near ties of the routing tried)"
                top2 = np.sort(expected)[-2:]
                if top2[1] - top2[0] > 2 * LOGITS * spread:
                    assert first == int(np.argmax(expected)), f"{n} tokens: greedy token"
                assert g.decode_burst(4) is not None and g.position == n + 4
                continue
            tol = LOGITS * spread
            if max(np.abs(logits - want_logits).max(), np.abs(logits - expected).max()) <= tol:
                for name, value in want.items():
                    err = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-30)
                    assert err <= STATE, f"{n} tokens: {name} differs by {err:.3g} of its norm"
                assert_states_near(got, ref_state, f"{n} tokens")
                top2 = np.sort(expected)[-2:]
                if top2[1] - top2[0] > 2 * tol:
                    assert first == stepped == int(np.argmax(expected)), f"{n} tokens: greedy token"
            else:  # a near tie of the routing taken one way by a path and the other by the reference?
                ties = reference_with_ties(model, prompt, units=False)[1]
                refs = [expected] + [reference_with_ties(model, prompt, flip=tie, units=False)[0] for tie in ties]
                for path, out in (("prompt", logits), ("decode", want_logits)):
                    assert min(np.abs(out - e).max() for e in refs) <= tol, \
                        f"{n} tokens: the {path} path against the reference ({len(ties)} near ties tried)"
            # decoding continues from the prefilled state as from the stepped one
            assert g.decode_burst(4) is not None and g.position == n + 4
    finally:
        g.close()


def test_prefill_refuses_what_does_not_fit(model, device):
    from zdsl.errors import ZdslError

    g = DecodeGraph(model, device, 16, SamplerConfig(temperature=0), progress=False, chunk=8)
    try:
        with pytest.raises(ZdslError, match="context of 16 tokens is full"):
            g.prefill(list(range(17)))
        with pytest.raises(ZdslError, match="outside the vocabulary"):
            g.prefill([model.hparams.vocab])
        assert g.position == 0
    finally:
        g.close()


@pytest.mark.parametrize("model", [MODEL_PARAMS[0]], ids=[MODEL_IDS[0]], indirect=True)
def test_recorded_chunks_stay_few(model, device):
    """Prompts of many lengths keep the full chunk's recording and the last few others' (not one
    per length), and a length whose recording was dropped records again and feeds alike. (What
    is kept does not depend on the model: one model, and chunks just long enough to leave more
    lengths than are kept, each length being a product variant to compile.)"""
    from zdsl.models.qwen35.model.prefill import KEPT_LENGTHS

    chunk = KEPT_LENGTHS + 2
    g = DecodeGraph(model, device, 64, SamplerConfig(temperature=0), progress=False, chunk=chunk)
    try:
        rng = np.random.default_rng(2)
        prompt = rng.integers(0, model.hparams.vocab, chunk + 2).tolist()
        g.reset()
        g.prefill(prompt[:-1])   # a full chunk and 1
        first = g.decode(prompt[-1])
        logits = g.logits()
        for n in range(2, chunk):  # KEPT_LENGTHS more: the least recently used, 1, goes
            g.reset()
            g.prefill(prompt[:n])
        assert (chunk, False) in g.prompt._seqs and len(g.prompt._seqs) <= 1 + KEPT_LENGTHS
        assert (1, False) not in g.prompt._seqs
        g.reset()
        g.prefill(prompt[:-1])
        assert g.decode(prompt[-1]) == first and np.array_equal(g.logits(), logits)
    finally:
        g.close()


def test_prefill_samples_as_the_last_tokens_decode_step_would(model, device):
    """prefill(sample=True) draws the first new token in the last chunk (of 8 and 4 here), from
    the last token's logits, which it leaves as a decode step does: the step values and position
    those of decode(prompt[-1]) after prefill(prompt[:-1]), the greedy token their argmax, and
    decoding goes on from there. Where both paths read Q8_1 (lavapipe), the logits are those of
    that decode step within the bounds of the module's tests, and so is the token where its lead
    is clear; on matrix units the chunk's products round otherwise (f16: the module docstring)."""
    g = DecodeGraph(model, device, 64, SamplerConfig(temperature=0), progress=False, chunk=8)
    try:
        prompt = np.random.default_rng(4).integers(0, model.hparams.vocab, 12).tolist()
        g.reset()
        g.prefill(prompt[:-1])
        first, logits, words = g.decode(prompt[-1]), g.logits(), g.step_words.copy()
        g.reset()
        token = g.prefill(prompt, sample=True)
        got = g.logits()
        assert g.position == 12 and np.array_equal(g.step_words[[0, 1, 3]], words[[0, 1, 3]])
        assert token == g.step_words[2] == int(np.argmax(got))
        if not g.prefill_units:
            spread = float(np.std(logits))
            assert np.abs(got - logits).max() <= LOGITS * spread
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] > 2 * LOGITS * spread:
                assert token == first
        assert g.decode() == int(np.argmax(g.logits())) and g.position == 13
    finally:
        g.close()
