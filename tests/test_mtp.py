"""The MTP head (multi-token prediction): the layout synth writes (llama.cpp's: the block after
the trunk's, `blk.N.nextn.*` beside its attention and FFN tensors, `nextn_predict_layers` = 1),
what `zdsl model info` says of it, the graph's view of its weights, and its numpy forward
(reference.ReferenceModel.mtp) written out here from the head's math."""

import json

import numpy as np
import pytest

from zdsl.cli import main
from zdsl.errors import ModelError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import GGUFFile, open_model
from zdsl.models.qwen35.file.info import memory_plan
from zdsl.models.qwen35.model.reference import ReferenceModel, rmsnorm
from zdsl.models.qwen35.model.weights import file_ranges, graph_weights
from zdsl.kernels.quant_numpy import dequantize


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"], ids=["moe", "dense"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "mtp.gguf"
    synth.write(path, request.param, seed=11, mtp=True)
    return open_model(path)


def test_synth_writes_the_head_as_llama_cpp_reads_it(model):
    hp, f = model.hparams, GGUFFile(model.path)
    n = hp.n_layers
    assert f.get(f"{hp.arch}.block_count") == n + 1 and f.get(f"{hp.arch}.nextn_predict_layers") == 1
    H = hp.hidden
    assert f.info(f"blk.{n}.nextn.eh_proj.weight").ne == (2 * H, H)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        assert f.info(f"blk.{n}.nextn.{norm}.weight").ne == (H,)
    assert f.info(f"blk.{n}.attn_q.weight").ne == (H, 2 * hp.n_heads * hp.head_dim)
    ffn = "ffn_gate_exps" if hp.moe else "ffn_gate"
    assert f"blk.{n}.{ffn}.weight" in f and f"blk.{n}.ssm_a" not in f
    assert model.has_mtp and len(hp.attention) == n
    plan = memory_plan(model)
    head = sum(t.nbytes for name, t in f.tensors.items() if name.startswith(f"blk.{n}."))
    assert plan.mtp_bytes == head and plan.mtp_read_per_draft > f.info("output.weight").nbytes


def test_info_shows_the_head(model, capsys):
    assert main(["model", "info", str(model.path)]) == 0
    out = capsys.readouterr().out
    assert "+ 1 MTP" in out and "MTP head" in out and f"block {model.hparams.n_layers}: gated attention" in out


def test_the_graph_reads_eh_proj_as_two_halves(model):
    """eh_proj · [e; h] = eh_proj.e · e + eh_proj.h · h: each half's bytes are each row's blocks."""
    n = model.hparams.n_layers
    name = f"blk.{n}.nextn.eh_proj.weight"
    t = graph_weights(model)
    whole = model.dequant(name)
    raw = np.asarray(np.memmap(model.path, np.uint8, "r"))
    for half, cols in (("e", slice(0, whole.shape[1] // 2)), ("h", slice(whole.shape[1] // 2, None))):
        g = t.tensors[f"{name}.{half}"]
        data = np.concatenate([raw[o:o + k] for o, k in file_ranges(model, g)])
        got = dequantize(data.reshape(g.shape[0], -1), g.qtype, g.shape)
        assert np.array_equal(got, whole[:, cols])
    assert name not in t and f"blk.{n}.attn_q.weight" in t


def mtp_by_hand(ref, token, h, position, kv):
    """One row of the head, from the math: [enorm(e); hnorm(h)] through eh_proj, a gated
    attention block over `kv` (the head's K and V rows before `position`, as lists) and the FFN,
    then shared_head_norm and the trunk's output head."""
    hp, w = ref.hp, ref.w
    p = f"blk.{hp.n_layers}."
    e = ref.file.dequant("token_embd.weight", np.array([token]))[0]
    x = w(p + "nextn.eh_proj.weight") @ np.concatenate([rmsnorm(e, w(p + "nextn.enorm.weight"), hp.eps),
                                                         rmsnorm(h, w(p + "nextn.hnorm.weight"), hp.eps)])
    hd, nh, nkv = hp.head_dim, hp.n_heads, hp.n_kv_heads
    xn = rmsnorm(x, w(p + "attn_norm.weight"), hp.eps)
    qg = (w(p + "attn_q.weight") @ xn).reshape(nh, 2 * hd)
    q = rmsnorm(qg[:, :hd], w(p + "attn_q_norm.weight"), hp.eps)
    k = rmsnorm((w(p + "attn_k.weight") @ xn).reshape(nkv, hd), w(p + "attn_k_norm.weight"), hp.eps)
    v = (w(p + "attn_v.weight") @ xn).reshape(nkv, hd)
    half = hp.rope_dims // 2
    angle = position * hp.rope_base ** (-np.arange(half) * 2.0 / hp.rope_dims)
    c, s = np.cos(angle), np.sin(angle)

    def rope(a):
        a = a.copy()
        a1, a2 = a[:, :half].copy(), a[:, half:hp.rope_dims].copy()
        a[:, :half], a[:, half:hp.rope_dims] = a1 * c - a2 * s, a1 * s + a2 * c
        return a
    q, k = rope(q), rope(k)
    kv[0].append(k), kv[1].append(v)
    K, V = np.array(kv[0]), np.array(kv[1])  # (positions, nkv, hd)
    o = np.empty((nh, hd))
    for head in range(nh):
        g = head // (nh // nkv)
        scores = K[:, g] @ q[head] / np.sqrt(hd)
        prob = np.exp(scores - scores.max())
        o[head] = (prob / prob.sum()) @ V[:, g]
    o = o * (1 / (1 + np.exp(-qg[:, hd:])))
    x = x + w(p + "attn_output.weight") @ o.reshape(-1)
    hn = rmsnorm(x, w(p + "post_attention_norm.weight"), hp.eps)
    x = x + (ref.moe(hp.n_layers, hn[None])[0] if hp.moe else ref.ffn(hp.n_layers, hn[None])[0])
    out = rmsnorm(x, w(p + "nextn.shared_head_norm.weight"), hp.eps)
    return w("output.weight") @ out, out


def test_reference_head_is_its_math_row_by_row_and_overwrites_what_it_cuts(model):
    ref = ReferenceModel(model, dtype=np.float64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.hparams.vocab, 5)
    h = rng.standard_normal((5, model.hparams.hidden))
    state = ref.new_state()
    logits, out = ref.mtp(tokens, h, 0, state)  # all rows at once
    kv = ([], [])
    for q in range(5):
        want_logits, want_out = mtp_by_hand(ref, tokens[q], h[q], q, kv)
        assert np.allclose(logits[q], want_logits, rtol=1e-6, atol=1e-6)
        assert np.allclose(out[q], want_out, rtol=1e-6, atol=1e-6)
    # a draft at position 3 again: rows 3 and 4 are replaced, as a cut step's are
    other = rng.integers(0, model.hparams.vocab, 1)
    again, _ = ref.mtp(other, h[3:4], 3, state)
    kv = (kv[0][:3], kv[1][:3])
    assert np.allclose(again[0], mtp_by_hand(ref, other[0], h[3], 3, kv)[0], rtol=1e-6, atol=1e-6)


STEP = 5  # the graph's step rows: drafts of up to 4
BOUND = 0.1  # of the logits' standard deviation: test_decode.py's bounds for the trunk, which the head reads


@pytest.fixture(scope="module")
def graph(model, device):
    from zdsl.models.qwen35.model.graph import DecodeGraph
    from zdsl.models.qwen35.model.mtp import MtpHead
    from zdsl.models.qwen35.model.sampler import SamplerConfig

    g = DecodeGraph(model, device, 64, SamplerConfig(temperature=0), progress=False, chunk=16, step_tokens=STEP,
                    mtp=True)
    head = MtpHead(g)
    yield g, head
    head.close()
    g.close()


def reference_chain(ref, mst, token, h, position, drafts):
    """The reference head chained along the GPU's drafts (so that one near tie taken the other way
    does not part the two): each row's logits."""
    out = []
    for d in [token, *drafts[:-1]]:
        logits, hs = ref.mtp([d], h[None], position, mst)
        out.append(logits[0])
        h, position = hs[0], position + 1
    return out


def assert_drafts_agree(got_drafts, got_last, want):
    """Each draft the argmax of the reference's row where its lead is clear; the last row's
    logits near the reference's."""
    for d, logits in zip(got_drafts, want):
        top = np.sort(logits)[-2:]
        if top[1] - top[0] > 2 * BOUND * logits.std():
            assert d == int(np.argmax(logits))
    assert np.abs(got_last - want[-1]).max() <= BOUND * want[-1].std()


@pytest.mark.device
def test_gpu_head_drafts_as_the_reference_after_a_prompt_and_after_a_cut_step(model, graph):
    """After a prompt of two chunks, each caught up on: three chained drafts. Then a step of four
    tokens cut back to three kept: the head catches up on those three rows and drafts on from the
    model's next token."""
    from zdsl.models.qwen35.model.mtp import MtpDrafts

    g, head = graph
    hp = model.hparams
    ref = ReferenceModel(model, int8_activations=True)
    rng = np.random.default_rng(5)  # (3 puts a router near-tie of the head at the second draft: test_decode.py)
    prompt = rng.integers(0, hp.vocab, 21).tolist()
    g.reset()
    g.prefill(prompt[:16])  # a chunk (16) and a part of one, each caught up on after it ran
    head.prompt(16, 0)
    y = g.prefill(prompt[16:], sample=True)
    head.prompt(5, 16)
    drafter = MtpDrafts(head)
    drafts = drafter.draft(prompt + [y], 3)
    state, trace = ref.new_state(), {}
    ref.forward(prompt, state, trace=trace)
    mst = ref.new_state()
    ref.mtp(prompt, np.concatenate([np.zeros((1, hp.hidden)), trace["h"][:-1]]), 0, mst)  # h before 0: zero
    last_h = trace["h"][-1]
    want = reference_chain(ref, mst, y, last_h, len(prompt), drafts)
    assert_drafts_agree(drafts, g.token_rows.logits_of(1)[0], want)

    fed = [y, *rng.integers(0, hp.vocab, 3).tolist()]
    said = g.decode_tokens(fed)
    g.cut(len(prompt) + 3)  # y and two more kept; said[2] is the next token
    trace = {}
    ref.forward(fed[:3], state, trace=trace)
    h = np.concatenate([last_h[None], trace["h"]])  # h of positions P - 1 … P + 2
    ref.mtp(fed[:3], h[:3], len(prompt), mst)  # the catch-up: positions P … P + 2
    drafts = drafter.draft(prompt + fed[:3] + [said[2]], 3)
    want = reference_chain(ref, mst, said[2], h[3], len(prompt) + 3, drafts)
    assert_drafts_agree(drafts, g.token_rows.logits_of(1)[0], want)


@pytest.mark.device
@pytest.mark.parametrize("temperature", [0, 1.5], ids=["greedy", "sampled"])
def test_generation_with_mtp_drafts_is_plain_decoding(model, device, temperature):
    """`auto` drafts with the file's head; tokens as plain decoding's, greedy and sampled alike."""
    from zdsl.models.qwen35.model.generate import Generator
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.model.speculate import speculation

    sampler = SamplerConfig(temperature=temperature, top_k=0, seed=2)
    prompt = np.random.default_rng(6).integers(0, model.hparams.vocab, 12).tolist()
    plain = Generator(model, device, n_ctx=96, sampler=sampler, progress=False)
    fast = Generator(model, device, n_ctx=96, sampler=sampler, progress=False, weights_of=plain,
                     speculate=speculation("auto", 3, sampler))
    try:
        assert fast.speculate.mtp
        want = list(plain.generate(prompt, 30, stop=False))
        assert list(fast.generate(prompt, 30, stop=False)) == want
        s = fast.timings.spec
        assert s.steps > 0 and s.drafted >= 3 * (s.steps - 1) and s.accepted + s.steps + s.plain == 29
    finally:
        fast.close(), plain.close()


@pytest.mark.device
def test_mtp_drafts_from_a_file_without_a_head_say_so(tmp_path, capsys):
    path = tmp_path / "plain.gguf"
    synth.write(path, "tiny")
    assert main(["run", str(path), "--device", "lavapipe", "--spec", "mtp", "-n", "2"]) != 0
    assert "has no MTP head for --spec mtp" in capsys.readouterr().err
    assert main(["bench", str(path), "--device", "lavapipe", "--spec", "mtp"]) != 0
    assert "has no MTP head for --spec mtp" in capsys.readouterr().err


@pytest.mark.device
def test_the_memory_plan_holds_the_head(model, graph):
    """The head's KV rows and inputs are in the graph's plan (what fits is checked with them) and
    grow with the context as the trunk's KV rows do."""
    from zdsl.models.qwen35.model.buffers import Footprint

    g, _ = graph
    L = model.hparams.n_layers
    names = {s.name for s in g.buffers(64)}
    assert {f"k_cache.{L}", f"v_cache.{L}", "mtp.h", "mtp.prompt_h", "mtp.tokens"} <= names
    kv = Footprint(g.buffers(128)).by_kind["KV cache"] - Footprint(g.buffers(64)).by_kind["KV cache"]
    per_layer = 2 * 64 * model.hparams.n_kv_heads * model.hparams.head_dim * 2  # K and V, f16, 64 more positions
    assert kv == per_layer * (len(model.hparams.attention_layers) + 1)


@pytest.mark.device
def test_a_server_whose_slots_draft_with_the_head_answers_as_plain_decoding_and_counts_per_slot(model, device):
    """`zdsl serve --spec mtp`: a greedy completion is plain decoding's, and /metrics gives each
    slot's drafts checked and kept."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from zdsl.kernels.kvcache import KV_DEFAULT
    from zdsl.models.qwen35.model.generate import Generator
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.model.speculate import speculation
    from zdsl.models.qwen35.serve.server import app, open_engine

    greedy = SamplerConfig(temperature=0)
    engine, model_id = open_engine(str(model.path), "lavapipe", n_ctx=96, kv=KV_DEFAULT, checkpoint_mib=16, parallel=2,
                                   speculate=speculation("mtp", 3, greedy))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app(engine, model_id), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    plain = Generator(model, device, n_ctx=96, sampler=greedy, progress=False)
    try:
        while not srv.started:
            time.sleep(0.05)
        prompt = "the cat sat on the mat"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
        want = list(plain.generate(plain.tokenizer.encode(prompt), 16, stop=False))
        assert r["choices"][0]["text"] == plain.tokenizer.decode(want, skip_special=True)
        lines = httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
        drafted = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("zdsl_drafted")}
        assert set(drafted) == {'zdsl_drafted_tokens_total{slot="0"}', 'zdsl_drafted_tokens_total{slot="1"}'}
        assert sum(drafted.values()) >= 3 and any(line.startswith("zdsl_draft_acceptance{slot=") for line in lines)
    finally:
        plain.close()
        srv.should_exit = True
        thread.join(10)
        engine.close()


@pytest.mark.device
def test_gpu_head_catches_up_on_a_prompts_last_token_fed_by_a_decode_step(model, graph):
    """A prompt fed as chunks then its last token's decode step (as with checkpoints): the head
    caught up on both drafts as the reference does."""
    from zdsl.models.qwen35.model.mtp import MtpDrafts

    g, head = graph
    hp = model.hparams
    ref = ReferenceModel(model, int8_activations=True)
    prompt = np.random.default_rng(7).integers(0, hp.vocab, 13).tolist()
    g.reset()
    g.prefill(prompt[:-1])
    head.prompt(12, 0)
    y = g.decode(prompt[-1])
    head.decoded(prompt[-1], 12)
    drafts = MtpDrafts(head).draft(prompt + [y], 2)
    state, trace = ref.new_state(), {}
    ref.forward(prompt, state, trace=trace)
    mst = ref.new_state()
    ref.mtp(prompt, np.concatenate([np.zeros((1, hp.hidden)), trace["h"][:-1]]), 0, mst)
    want = reference_chain(ref, mst, y, trace["h"][-1], len(prompt), drafts)
    assert_drafts_agree(drafts, g.token_rows.logits_of(1)[0], want)


@pytest.mark.device
def test_a_head_in_a_file_of_its_own_drafts_as_the_head_in_the_file(tmp_path, device, capsys):
    """synth --mtp-file writes the trunk without its head and the head in an mtp-*.gguf (the same
    tensors as --mtp's); --draft-model reads it: drafts and tokens as with the head in the file."""
    from zdsl.models.qwen35.file.gguf_file import WithHead
    from zdsl.models.qwen35.model.generate import Generator
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.model.speculate import speculation

    inside, trunk, head = tmp_path / "in.gguf", tmp_path / "trunk.gguf", tmp_path / "mtp-trunk.gguf"
    synth.write(inside, "tiny", seed=9, mtp=True)
    synth.write(trunk, "tiny", seed=9, mtp_file=head)
    assert not open_model(trunk).has_mtp and GGUFFile(head).get("qwen35moe.nextn_predict_layers") == 1
    assert main(["model", "info", str(head)]) == 0
    assert "an MTP head alone: give it with --draft-model" in capsys.readouterr().out
    greedy = SamplerConfig(temperature=0)
    prompt = np.random.default_rng(8).integers(0, 1024, 10).tolist()
    runs = []
    for model in (open_model(inside), WithHead(open_model(trunk), head)):
        gen = Generator(model, device, n_ctx=64, sampler=greedy, progress=False, speculate=speculation("mtp", 3, greedy))
        try:
            runs.append((list(gen.generate(prompt, 12, stop=False)), gen.timings.spec.drafted,
                         gen.graph.token_rows.logits_of(1)))
        finally:
            gen.close()
    (a, drafted_a, logits_a), (b, drafted_b, logits_b) = runs
    assert a == b and drafted_a == drafted_b and np.array_equal(logits_a, logits_b)
    args = ["--device", "lavapipe", "--ctx", "64", "-n", "12", "--temp", "0", "--ignore-eos", "--json", "-p", "a b c"]
    outputs = []
    for files in ([str(inside)], [str(trunk), "--draft-model", str(head)]):
        assert main(["run", *files, *args]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[0]["timings"]["speculation"] == outputs[1]["timings"]["speculation"]
    other = tmp_path / "dense.gguf"
    synth.write(other, "tiny-dense", mtp=True)
    with pytest.raises(ModelError, match="is not an MTP head of trunk.gguf"):
        WithHead(open_model(trunk), other)


@pytest.mark.device
def test_a_chat_turn_leaves_the_head_caught_up_on_all_it_fed(model, device):
    """After a turn that drafted with the head, its KV rows hold every position the turn fed, as a
    fresh run that feeds the same tokens as a prompt leaves them (up to rounding: steps and chunks
    sum in other orders, test_prefill.py's bound)."""
    from zdsl.models.qwen35.model.generate import Generator
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.model.speculate import speculation

    greedy = SamplerConfig(temperature=0)
    L, hp = model.hparams.n_layers, model.hparams
    chat = Generator(model, device, n_ctx=64, sampler=greedy, progress=False, keep=True,
                     speculate=speculation("mtp", 3, greedy))
    fresh = Generator(model, device, n_ctx=64, sampler=greedy, progress=False, weights_of=chat,
                      speculate=speculation("mtp", 3, greedy))
    try:
        prompt = np.random.default_rng(9).integers(0, hp.vocab, 10).tolist()
        list(chat.generate(prompt, 14, stop=False))  # its last token by a decode step (no room for drafts)
        fed = list(chat.context)
        assert len(fed) == 10 + 13 and chat.graph.position == len(fed)
        list(fresh.generate(fed, 1, stop=False))
        n = len(fed) * hp.n_kv_heads * hp.head_dim
        for got, want in zip(chat.graph.kv[L], fresh.graph.kv[L]):
            got, want = (b.read(np.float16, (n,)).astype(np.float32).reshape(len(fed), -1) for b in (got, want))
            assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
        # and the h it carries to the next turn's first row: the last fed position's
        got, want = (g.mtp.h.read(np.float32, (hp.hidden,)) for g in (chat, fresh))
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    finally:
        fresh.close(), chat.close()
