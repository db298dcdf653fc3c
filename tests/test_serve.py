"""`zdsl serve` as a client sees it: a real uvicorn server on a loopback port (lavapipe, the tiny
synthetic model), talked to with the official `openai` client and with httpx.

The references are independent of the server: `zdsl run --json` (the CLI's own generation, on a
device of its own) for a chat's greedy and seeded output, and a cold Generator (no kept context,
no checkpoints) over the tokenizer's ids for what a reused prefix must not change."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from click.testing import CliRunner

from zdsl.kernels.kvcache import KV_DEFAULT
from zdsl.models.qwen35.cli.run import run
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.generate import Generator
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.serve.server import app, loopback, open_engine, serve

CTX = 256
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]

pytestmark = pytest.mark.slow  # a server on lavapipe, in processes of its own


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.write(path, "tiny", seed=8)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    """(base URL, engine) of a server running in a thread of this process."""
    yield from serving(model_path, parallel=1)


@pytest.fixture(scope="module")
def server2(model_path):
    """The same with two slots."""
    yield from serving(model_path, parallel=2)


def serving(model_path, parallel: int):
    import uvicorn

    engine, model_id = open_engine(str(model_path), os.environ.get("ZDSL_TEST_DEVICE", "lavapipe"), n_ctx=CTX,
                                   kv=KV_DEFAULT, checkpoint_mib=16, parallel=parallel)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app(engine, model_id), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(10)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def cold(model_path, device):
    """The existing generation path with nothing kept between prompts."""
    gen = Generator(open_model(model_path), device, n_ctx=CTX, sampler=SamplerConfig(temperature=0), progress=False)
    yield gen
    gen.close()


def zdsl_run(model_path, prompt: str, *args) -> dict:
    result = CliRunner().invoke(run, [str(model_path), "--chat", "-p", prompt, "--json", "--ctx", str(CTX), *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def chat(client, messages=HELLO, **kw):
    r = client.chat.completions.create(model="tiny.gguf", messages=messages, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def streamed(client, messages=HELLO, **kw):
    """The text, finish reason and usage of a streamed chat."""
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="tiny.gguf", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


def test_greedy_chat_is_zdsl_runs_streamed_or_not(model_path, client):
    want = zdsl_run(model_path, HELLO[0]["content"], "--temp", "0", "-n", "12")
    text, finish, usage = chat(client, temperature=0, max_tokens=12)
    assert text == want["text"]
    assert usage.completion_tokens == len(want["token_ids"]) and usage.prompt_tokens == len(want["prompt_ids"])
    assert finish == ("length" if len(want["token_ids"]) == 12 else "stop")
    assert streamed(client, temperature=0, max_tokens=12)[:2] == (text, finish)


def test_seeded_sampling_is_reproducible_and_zdsl_runs(model_path, client):
    want = zdsl_run(model_path, HELLO[0]["content"], "--temp", "0.9", "--seed", "5", "-n", "10")
    first = chat(client, temperature=0.9, seed=5, max_tokens=10)
    assert first[0] == want["text"] and first[2].completion_tokens == len(want["token_ids"])
    again = chat(client, temperature=0.9, seed=5, max_tokens=10)   # resumed from the prompt's checkpoint
    assert again[2].prompt_tokens_details.cached_tokens > 0
    assert again[:2] == first[:2]
    assert chat(client, temperature=0.9, seed=6, max_tokens=10)[0] != first[0]


def test_a_stop_string_cuts_the_text(client):
    full = chat(client, temperature=0, max_tokens=12)[0]
    stop = full[6:9]
    cut = full[:full.index(stop)]
    assert chat(client, temperature=0, max_tokens=12, stop=[stop, "\u2603\u2603"]) [:2] == (cut, "stop")
    assert streamed(client, temperature=0, max_tokens=12, stop=stop)[:2] == (cut, "stop")


def test_a_longer_conversation_feeds_only_its_new_tokens(server, client, cold):
    tok = cold.tokenizer
    reply, _, usage1 = chat(client, temperature=0, max_tokens=6)
    messages = HELLO + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And what can you do?"}]
    before = metric(server[0], "prompt_tokens_reused_total")
    text, _, usage = chat(client, messages, temperature=0, max_tokens=8)
    ids = tok.chat_ids(messages)
    assert usage.prompt_tokens == len(ids)
    # at least the first prompt (its end is a checkpoint); all of it and the reply where the
    # reply's text encodes to the tokens sampled
    assert usage.prompt_tokens_details.cached_tokens >= usage1.prompt_tokens - 1
    assert metric(server[0], "prompt_tokens_reused_total") - before == usage.prompt_tokens_details.cached_tokens
    cold.use(SamplerConfig(temperature=0))
    want = list(cold.generate(ids, 8))
    assert text == tok.decode([t for t in want if t not in cold.stop_ids], skip_special=True)
    assert usage.completion_tokens == len(want)


def test_text_completion_is_the_generate_path(client, cold):
    r = client.completions.create(model="tiny.gguf", prompt="Once upon a time", max_tokens=8, temperature=0)
    cold.use(SamplerConfig(temperature=0))
    want = list(cold.generate(cold.tokenizer.encode("Once upon a time", parse_special=True), 8))
    assert r.choices[0].text == cold.tokenizer.decode([t for t in want if t not in cold.stop_ids], skip_special=True)
    assert r.usage.completion_tokens == len(want)
    assert [m.id for m in client.models.list().data] == ["tiny.gguf"]


def test_ignore_eos_generates_past_stop_tokens(client, cold):
    """llama-server's ignore_eos: max_tokens tokens whatever they are (the streams of a benchmark).
    The prompt is one whose greedy continuation stops early where one is found among a few."""
    cold.use(SamplerConfig(temperature=0))
    prompts = [f"Once upon a time {i}" for i in range(12)]
    ids = {p: cold.tokenizer.encode(p, parse_special=True) for p in prompts}
    stops = ((len(list(cold.generate(ids[p], 24))), p) for p in prompts)
    stopped, prompt = next(((n, p) for n, p in stops if n < 24), (24, prompts[0]))
    want = list(cold.generate(ids[prompt], 24, stop=False))
    r = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    # the same tokens through the stop token and past it; further on, the server's prompt (its
    # state restored from an earlier request's checkpoint, the rest prefilled in blocks of its
    # own) and a cold start may round apart at one of the random model's near-ties
    past = [t for t in want[:stopped + 2] if t not in cold.stop_ids]
    assert r.choices[0].text.startswith(cold.tokenizer.decode(past[:-1], skip_special=True))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"zdsl_{name} ")))


BAD = [("{not json", 400, None), ('[1, 2]', 400, None),
       ('{"messages": "hi"}', 400, "messages"),
       ('{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
       ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
       ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', 400, "max_tokens"),
       ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}', 400, "temperature"),
       ('{"messages": [{"role": "user", "content": "hi"}], "top_k": 1000}', 400, "top_k"),
       ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}', 400, "logit_bias"),
       ('{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0]"),
       ('{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
       ('{"messages": [{"role": "user", "content": "hi"}], "ignore_eos": 1}', 400, "ignore_eos"),
       ('{"messages": [{"role": "user", "content": "' + "word " * 400 + '"}]}', 400, "messages")]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_requests_get_an_openai_error(server, body, status, param):
    r = httpx.post(server[0] + "/v1/chat/completions", content=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


def test_bad_requests_through_the_client_and_other_routes(server, client):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="tiny.gguf", prompt=[10 ** 9], max_tokens=2)
    r = httpx.get(server[0] + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server[0] + "/v1/chat/completions").status_code == 405


def test_a_client_gone_mid_stream_frees_the_slot_and_health_answers(server, client):
    url = server[0]
    before = metric(url, "tokens_predicted_total")
    body = {"messages": HELLO, "max_tokens": 200, "temperature": 0.9, "seed": 1, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        health = httpx.get(url + "/health", timeout=5).json()   # answered while the slot generates
        assert health["status"] == "ok" and health["slots_processing"] == 1
    deadline = time.time() + 10
    while httpx.get(url + "/health").json()["slots_processing"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").json()["slots_processing"] == 0
    assert metric(url, "tokens_predicted_total") - before < 150   # stopped, not run to the end
    assert chat(client, temperature=0, max_tokens=2)[2].completion_tokens >= 1


def test_api_key_and_loopback(server, model_path):
    from starlette.testclient import TestClient

    engine = server[1]
    with TestClient(app(engine, "tiny.gguf", api_key="sesame")) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert c.get("/health").status_code == 200
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and not loopback("0.0.0.0")
    result = CliRunner().invoke(serve, [str(model_path), "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "--api-key" in str(result.exception)


PROMPTS = [f"Tell me about the number {n}." for n in range(8)]


def test_eight_clients_at_once_some_leaving_midway(server, client, cold):
    """A bounded load test: 8 streaming clients at once (one slot: they queue), three of them
    leaving after their first piece. Every one that stays gets what a cold run gives; afterwards
    no slot is held, nothing waits, and the server still answers."""
    url, tok = server[0], cold.tokenizer
    cold.use(SamplerConfig(temperature=0))
    want = {}
    for p in PROMPTS:
        ids = list(cold.generate(tok.chat_ids([{"role": "user", "content": p}]), 10))
        want[p] = tok.decode([t for t in ids if t not in cold.stop_ids], skip_special=True)
    requests_before = metric(url, "requests_total")
    got, errors = {}, []

    def one(i: int, prompt: str) -> None:
        try:
            stream = client.chat.completions.create(model="tiny.gguf", messages=[{"role": "user", "content": prompt}],
                                                    stream=True, temperature=0, max_tokens=10, timeout=120)
            text = []
            for n, chunk in enumerate(stream):
                text += [c.delta.content or "" for c in chunk.choices]
                if i % 3 == 1 and n == 1:
                    stream.close()     # this client leaves after its first piece
                    return
            got[prompt] = "".join(text)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{prompt}: {e!r}")

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads) and not errors
    stayed = [p for i, p in enumerate(PROMPTS) if i % 3 != 1]
    assert got == {p: want[p] for p in stayed}
    deadline = time.time() + 10
    while httpx.get(url + "/health").json()["slots_processing"] and time.time() < deadline:
        time.sleep(0.05)
    health = httpx.get(url + "/health").json()
    assert health == {"status": "ok", "slots_idle": 1, "slots_processing": 0, "requests_waiting": 0}
    assert metric(url, "requests_total") - requests_before == len(PROMPTS)


def test_a_client_gone_before_a_plain_reply_frees_the_slot(server, client):
    url = server[0]
    before = metric(url, "tokens_predicted_total")
    body = {"messages": HELLO, "max_tokens": 220, "temperature": 0.9, "seed": 2}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.time() + 10
    while httpx.get(url + "/health").json()["slots_processing"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").json()["slots_processing"] == 0
    assert metric(url, "tokens_predicted_total") - before < 150   # stopped, not run to the end


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_stream_under_way_then_exits(model_path, sig):
    """`zdsl serve` as a process (two slots: their batch's steps are recorded on a thread of its
    own meanwhile): a signal while a reply streams lets it finish, then the server exits 0 with one
    line saying why, and no traceback. Its start says the batch's memory too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "zdsl.cli", "serve", str(model_path), "--port", str(port),
                             "--ctx", str(CTX), "--parallel", "2",
                             "--device", os.environ.get("ZDSL_TEST_DEVICE", "lavapipe")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        body = {"messages": HELLO, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(sig)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] in ("stop", "length")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"stopped by {sig.name} after 1 request" in err and "Traceback" not in err
        assert "memory: batched steps of 2 slots" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_two_slots_stream_together_and_keep_their_own_prefixes(server2, cold):
    """With --parallel 2 a short request sent while a long one streams finishes first; both say
    what cold runs say; each conversation, sent again longer, resumes from the slot that holds it."""
    url, tok = server2[0], cold.tokenizer
    first, second = (slot.gen.graph for slot in server2[1].slots)
    assert all(second.weights[n] is w for n, w in first.weights.items()) and second.x is first.x  # one copy of each
    own = {s.name for s in second.buffers(CTX)}
    assert {"step", "tokens_out", "token_counts"} <= own and not any(s.kind == "weights" for s in second.buffers(CTX))
    assert second.step is not first.step and all(second.kv[i][0] is not first.kv[i][0] for i in first.kv)
    client2 = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    long_chat = [{"role": "user", "content": "Tell me a long story about a cat."}]
    short_chat = [{"role": "user", "content": "Say hi."}]
    cold.use(SamplerConfig(temperature=0))
    want = {}
    for name, messages, n in (("long", long_chat, 40), ("short", short_chat, 6)):
        ids = list(cold.generate(tok.chat_ids(messages), n))
        want[name] = tok.decode([t for t in ids if t not in cold.stop_ids], skip_special=True)
    got, done, started = {}, {}, threading.Event()

    def long_request():
        text = []
        for chunk in client2.chat.completions.create(model="tiny.gguf", messages=long_chat, stream=True,
                                                     temperature=0, max_tokens=40, timeout=120):
            text += [c.delta.content or "" for c in chunk.choices]
            started.set()
        got["long"], done["long"] = "".join(text), time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(60)
    got["short"] = chat(client2, short_chat, temperature=0, max_tokens=6)[0]
    done["short"] = time.monotonic()
    thread.join(120)
    assert got == want
    assert done["short"] < done["long"]   # it did not wait for the long one's slot
    for messages, reply in ((long_chat, want["long"]), (short_chat, want["short"])):
        longer = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
        usage = chat(client2, longer, temperature=0, max_tokens=2)[2]
        assert usage.prompt_tokens_details.cached_tokens >= len(tok.chat_ids(messages)) - 1
    assert httpx.get(url + "/health").json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0,
                                                 "requests_waiting": 0}
