"""Steps of several tokens of one sequence (models/qwen35/token_rows.py) against the same tokens
fed one decode step at a time, on lavapipe: for T = 1, 2, 3, 5 and 16 tokens at a position past
a prompt, every row's logits and sampled token, and afterwards the KV rows and the live
recurrent state; then a step cut back to each of its positions j (DecodeGraph.cut) goes on as a
sequence fed only its first j tokens does. Tiny MoE and dense models, and one with Qwen3.5's
248,320-token vocabulary (its head's rows far apart).

The step runs the decode step's kernels, a column or a row per token (mul_mm past dmmv's 8
columns; on lavapipe past one, and one test forces a GPU's choice), so its results are the single
steps' up to the order of a few sums: logits within 10⁻³ of their spread (seen: equal), states
within 10⁻³ of their norm, tokens equal.
"""

import numpy as np
import pytest

from zdsl.errors import ZdslError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.model.schedule import DMMV_COLS, LayerSchedule

from graph_testing import state_of

SAME = 1e-3
PROMPT, MOST, CTX = 9, 16, 64


@pytest.fixture(scope="module", params=[("tiny", None), ("tiny-dense", None), ("tiny", "qwen35")],
                ids=["moe", "dense", "moe-248k-vocab"])
def model(request, tmp_path_factory):
    preset, vocab = request.param
    path = tmp_path_factory.mktemp("models") / "model.gguf"
    synth.write(path, preset, quant="q4_k_m", seed=5, vocab=synth.REAL_VOCABS[vocab] if vocab else None)
    return open_model(path)


@pytest.fixture(scope="module")
def pair(model, device):
    """A graph that steps up to MOST tokens at once, and one on its weights that steps one."""
    rows = DecodeGraph(model, device, CTX, SamplerConfig(temperature=0), progress=False, chunk=MOST, step_tokens=MOST)
    single = DecodeGraph(model, device, CTX, SamplerConfig(temperature=0), progress=False, chunk=MOST, weights_of=rows)
    yield rows, single
    single.close()
    rows.close()


def live_state(g) -> dict:
    """What the sequence goes on from at its position: the KV rows before it, the delta-net state
    in the slot of the position, the conv inputs of the KC − 1 positions before it."""
    hp, p = g.hp, g.position
    out = {name: rows for name, rows in state_of(g).items() if name[0] in "kv"}  # the KV rows
    per_state, C = hp.ssm_v_heads * hp.ssm_head_dim ** 2, hp.conv_channels
    for i in hp.deltanet_layers:
        states = g.ssm_state[i].read(np.float32, (g.state_slots, per_state))
        ring = g.conv_state[i].read(np.float32, (g.conv_slots, C))
        out[f"ssm{i}"] = states[p % g.state_slots]
        out[f"conv{i}"] = np.stack([ring[q % g.conv_slots] if q >= 0 else np.zeros(C, np.float32)
                                    for q in range(p - hp.conv_kernel + 1, p)])
    return out


def assert_near(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        g, w = np.asarray(got[name], np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= SAME * max(np.abs(w).max(), 1e-6), f"{what}: {name}"


def fed(g, prompt: list[int]) -> None:
    g.reset()
    g.prefill(prompt)


@pytest.mark.parametrize("t", [1, 2, 3, 5, 16])
def test_a_step_of_t_tokens_is_t_single_steps(model, pair, t):
    rows, single = pair
    check_t_tokens(model, rows, single, t)


def check_t_tokens(model, rows, single, t: int) -> None:
    rng = np.random.default_rng(t)
    prompt, tokens = (rng.integers(0, model.hparams.vocab, n).tolist() for n in (PROMPT, t))
    fed(rows, prompt), fed(single, prompt)
    got = rows.decode_tokens(tokens)
    logits = rows.token_rows.logits_of(t)
    want, want_logits = [], []
    for x in tokens:
        want.append(single.decode(x))
        want_logits.append(single.logits())
    want_logits = np.array(want_logits)
    spread = want_logits.max() - want_logits.min()
    assert np.abs(logits - want_logits).max() <= SAME * spread
    assert got == want
    assert rows.position == single.position == PROMPT + t
    assert_near(live_state(rows), live_state(single), f"after {t} tokens")
    # and on from there: the graph's own step values are the last row's, moved on
    assert rows.decode() == single.decode()


def test_a_step_on_dmmv_columns_as_a_gpu_runs_it_is_single_steps(tmp_path, device, monkeypatch):
    """Lavapipe runs products of several rows on mul_mm (LayerSchedule.dmmv_takes); a GPU on dmmv's
    columns, here forced: 3 tokens of the tiny MoE model, every Q4_K_M type's 3-column product."""
    path = tmp_path / "model.gguf"
    synth.write(path, "tiny", quant="q4_k_m", seed=5)
    model = open_model(path)
    monkeypatch.setattr(LayerSchedule, "dmmv_takes", lambda self, t: t <= DMMV_COLS)
    rows = DecodeGraph(model, device, CTX, SamplerConfig(temperature=0), progress=False, chunk=MOST, step_tokens=3)
    single = DecodeGraph(model, device, CTX, SamplerConfig(temperature=0), progress=False, chunk=MOST, weights_of=rows)
    try:
        seq = rows.token_rows.record(3)
        columns = {(u.variant.params["QTYPE"], u.variant.params["COLS"]) for u in seq.launches
                   if u.kernel.name == "dmmv"}
        seq.free()
        assert {q for q, c in columns if c == 3} >= {"q4_k", "q5_k", "q6_k"}, columns
        check_t_tokens(model, rows, single, 3)
    finally:
        single.close()
        rows.close()


@pytest.mark.parametrize("t", [5, MOST])
def test_a_step_cut_back_to_j_is_a_step_of_j_tokens(model, pair, t):
    rows, single = pair
    rng = np.random.default_rng(100 + t)
    prompt, tokens = (rng.integers(0, model.hparams.vocab, n).tolist() for n in (PROMPT, t))
    nxt = rng.integers(0, model.hparams.vocab, 2).tolist()
    for j in sorted({0, 1, t // 2, t - 1, t}):
        fed(rows, prompt), fed(single, prompt)
        rows.decode_tokens(tokens)
        rows.cut(PROMPT + j)
        for x in tokens[:j]:
            single.decode(x)
        assert_near(live_state(rows), live_state(single), f"cut back to {j} of {t}")
        for x in nxt:  # the sequence goes on as if only j tokens had been fed
            assert rows.decode(x) == single.decode(x), f"cut back to {j} of {t}"
            spread = np.ptp(single.logits())
            assert np.abs(rows.logits() - single.logits()).max() <= SAME * spread


def test_steps_of_several_tokens_say_what_is_wrong(model, pair, device):
    rows, single = pair
    fed(rows, [1, 2, 3])
    with pytest.raises(ZdslError, match="1 to 16 tokens, not 17"):
        rows.decode_tokens([1] * (MOST + 1))
    with pytest.raises(ZdslError, match="step_tokens > 1"):
        single.decode_tokens([1, 2])
    with pytest.raises(ZdslError, match="follows a decode_tokens"):
        rows.cut(3)
    rows.decode_tokens([4, 5])
    with pytest.raises(ZdslError, match="passed positions 3 to 5, not 6"):
        rows.cut(6)
    with pytest.raises(ZdslError, match="outside the vocabulary"):
        rows.decode_tokens([1, model.hparams.vocab])
    rows.seek(CTX - 2)
    with pytest.raises(ZdslError, match="context of 64 tokens is full"):
        rows.decode_tokens([1, 2, 3])
