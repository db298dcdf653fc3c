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
import jsonschema
import openai
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st


from budget import THOROUGH, examples
from agent_request import coding_agent_request
from zdsl.kernels.kvcache import KV_DEFAULT
from zdsl.models.qwen35.cli.run import run
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.generate import Generator
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.serve.api import chat_job
from zdsl.models.qwen35.serve.server import app, loopback, open_engine, serve


CTX = 1024
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
    # replies as raw text (no reasoning_content), as `zdsl run` prints them; tests of the split ask for it
    srv = uvicorn.Server(uvicorn.Config(app(engine, model_id, reasoning_format="none"), host="127.0.0.1", port=port,
                                        log_level="warning"))
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
    # at least the first prompt up to the <think> its generation prompt opened (a checkpoint: the
    # next turn renders the reply without it); all of it and the reply where the reply's text
    # encodes to the tokens sampled and the template keeps the turn as it was
    assert usage.prompt_tokens_details.cached_tokens >= think_at(tok, HELLO)
    assert metric(server[0], "prompt_tokens_reused_total") - before == usage.prompt_tokens_details.cached_tokens
    cold.use(SamplerConfig(temperature=0))
    want = list(cold.generate(ids, 8))
    assert text == tok.decode([t for t in want if t not in cold.stop_ids], skip_special=True)
    assert usage.completion_tokens == len(want)


def think_at(tok, messages) -> int:
    """Where the <think> that the generation prompt of `messages` opens begins."""
    ids = tok.chat_ids(messages)
    return len(ids) - 1 - ids[::-1].index(tok.token_id("<think>"))


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
       ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
       ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}', 400, "temperature"),
       ('{"messages": [{"role": "user", "content": "hi"}], "top_k": 1000}', 400, "top_k"),
       ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}', 400, "logit_bias"),
       ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}', 400, "logit_bias"),
       ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}', 400,
        "top_logprobs"),
       ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400, "top_logprobs"),
       ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools[0]"),
       ('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}', 400, "tool_choice"),
       ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}', 400,
        "response_format"),
       ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": '
        '{"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wizard"}}}}}}', 400,
        "response_format"),
       ('{"messages": [{"role": "user", "content": "hi"}], "reasoning_format": "xml"}', 400, "reasoning_format"),
       ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}',
        400, "messages[0].tool_calls[0]"),
       ('{"messages": [{"role": "user", "content": "\\ud800 lone"}]}', 400, None),
       ('{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 50000 + "]" * 50000 + '}', 400, None),
       ('{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0]"),
       ('{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
       ('{"messages": [{"role": "user", "content": "hi"}], "ignore_eos": 1}', 400, "ignore_eos"),
       ('{"messages": [{"role": "user", "content": "' + "word " * 2000 + '"}]}', 400, "messages")]


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
        assert usage.prompt_tokens_details.cached_tokens >= think_at(tok, messages)
    assert httpx.get(url + "/health").json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0,
                                                 "requests_waiting": 0}


# -- agents and apps: tools, reasoning, logprobs, structured output ---------------------------


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 10}}, "required": ["text"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "note", "parameters": NOTE}}]
SCHEMAS = {"get_weather": WEATHER, "note": NOTE}


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "tag": {"type": "string", "maxLength": 4},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "tag", "ok"], "additionalProperties": False}


RESPONSE_TOOLS = [{"type": "function", **t["function"], "strict": True} for t in TOOLS]


def streamed_response(client, **kw):
    """The events of a streamed response, and the response they end with."""
    events = list(client.responses.create(stream=True, **kw))
    return events, events[-1].response


def test_a_forced_call_comes_whole_and_typed_streamed_or_not(client):
    """tool_choice "required" (and a named function): the reply is calls, their arguments valid
    under the tool's schema (jsonschema); the streamed deltas put together give the same calls."""
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        kw = dict(model="anything", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                  tool_choice=choice, temperature=1.0, seed=3, max_tokens=120, parallel_tool_calls=False,
                  extra_body={"reasoning_budget": 4})
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1
        call = m.tool_calls[0]
        assert choice == "required" or call.function.name == "note"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    got = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    got["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        assert list(calls.values()) == [{"id": calls[0]["id"], "name": call.function.name,
                                         "arguments": call.function.arguments}]


def test_a_response_calls_a_tool_and_takes_its_output_back(client):
    """tool_choice "required": a function_call item whose arguments validate (jsonschema); streamed,
    its argument deltas make them. Sent back with its output, the conversation is the prompt the
    chat endpoint renders for the same messages."""
    kw = dict(model="tiny.gguf", input=[{"role": "user", "content": "Weather in Paris?"}], tools=RESPONSE_TOOLS,
              tool_choice="required", parallel_tool_calls=False, temperature=1.0, max_output_tokens=120,
              extra_body={"reasoning_budget": 2, "seed": 3})
    r = client.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events, final = streamed_response(client, **kw)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == final.output[-1].arguments == call.arguments
    back = kw["input"] + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments}, {"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "sunny"}]
    again = client.responses.create(**(kw | {"input": back, "tool_choice": "auto", "max_output_tokens": 1}))
    sent = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = kw["input"] + [{"role": "assistant", "tool_calls": [sent]},
                              {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = client.chat.completions.create(model="tiny.gguf", messages=messages, tools=TOOLS, max_tokens=1)
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_a_conversation_with_calls_and_results_renders_through_the_template(server, client):
    tok = server[1].tokenizer
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny.gguf", messages=messages, tools=TOOLS, max_tokens=1)
    shown = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                               "days": 2}}}]},
        {"role": "tool", "content": "sunny, 21 C"}]
    text = tok.apply_chat_template(shown, tools=TOOLS)
    assert "<parameter=days>\n2\n</parameter>" in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, parse_special=True))


def test_random_weights_under_a_schema_or_a_forced_call_always_comply(client):
    """Sampled replies of the random model under tool_choice "required" and under a bounded
    json_schema all parse and validate (jsonschema), with and without thinking, split from it.
    Each token is a lavapipe step (~35 ms), a call ~70 of them, so 2 replies of each kind and
    setting here and 200 in the thorough profile (minutes of lavapipe);
    tests/test_serve_parts.py walks the same grammars 50 times each without the model. The
    requests of one prompt come together: the slot resumes it, rather than feeding it again."""
    def kw(thinking: bool, seed: int) -> dict:
        return dict(model="tiny.gguf", temperature=1.0, max_tokens=160, seed=seed,
                    extra_body={"chat_template_kwargs": {"enable_thinking": thinking}, "reasoning_budget": 3,
                                "reasoning_format": "auto"})

    runs = [(thinking, seed) for thinking in (True, False) for seed in range(200 if THOROUGH else 2)]
    for thinking, seed in runs:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, **kw(thinking, seed))
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    for thinking, seed in runs:
        m = client.chat.completions.create(messages=HELLO, response_format=fmt, **kw(thinking, seed)).choices[0].message
        jsonschema.validate(json.loads(m.content), POINT)
        assert thinking or not getattr(m, "reasoning_content", None)


def test_a_constrained_reply_is_drawn_on_the_gpu_as_its_reference_draws_it(client, server):
    """A schema and a thinking budget steer the GPU's sampler (its mask written each step), a
    logit bias shifts its logits; with logprobs the same request picks on the host, by the
    sampler's numpy reference under the same mask and bias: both give the same reply, greedy or
    seeded."""
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    seven = str(server[1].tokenizer.encode("7")[0])
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        kw |= dict(model="tiny.gguf", messages=HELLO, max_tokens=60, response_format=fmt, logit_bias={seven: 3},
                   extra_body={"reasoning_budget": 3, "reasoning_format": "none"})
        gpu = client.chat.completions.create(**kw).choices[0].message.content
        host = client.chat.completions.create(logprobs=True, **kw).choices[0].message.content
        assert gpu == host
        jsonschema.validate(json.loads(gpu.partition("</think>")[2]), POINT)


def test_the_sdk_parses_into_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        tag: str = Field(max_length=4)

    for seed in range(3):
        r = client.beta.chat.completions.parse(model="tiny.gguf", messages=HELLO, response_format=Point, seed=seed,
                                               max_tokens=80, extra_body={"reasoning_budget": 2,
                                                                          "reasoning_format": "auto"})
        point = r.choices[0].message.parsed
        assert isinstance(point, Point) and 0 <= point.x <= 9 and len(point.tag) <= 4


def test_a_response_is_the_chat_reply_as_items_streamed_or_not(client):
    """The same greedy reply through /v1/responses and /v1/chat/completions: the thinking a
    reasoning item, the answer an output_text; streamed, the events come in order (numbered from
    0, each item added, its deltas, done) and their deltas make the items of the final response."""
    extra = {"reasoning_budget": 3, "reasoning_format": "auto"}
    chat = client.chat.completions.create(model="tiny.gguf", messages=[{"role": "system", "content": "Be brief."}]
                                          + HELLO, temperature=0, max_tokens=12, extra_body=extra)
    kw = dict(model="any", instructions="Be brief.", input=HELLO[0]["content"], temperature=0, max_output_tokens=12,
              extra_body=extra)
    r = client.responses.create(**kw)
    reasoning, message = r.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert r.output_text == message.content[0].text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.output_tokens_details.reasoning_tokens == 4  # three thinking tokens and the forced </think>
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events, final = streamed_response(client, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    deltas = {}
    for e in events:
        if e.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    assert deltas == {0: reasoning.content[0].text, 1: message.content[0].text}
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in r.output]


def test_the_thinking_is_split_from_the_answer_plain_and_streamed(client):
    """A thinking budget of 3 ends the thinking (a forced </think>) three tokens in: the raw text
    is 3 tokens, </think>, the answer; split, the thinking is reasoning_content, exactly."""
    for budget in (3, 0):
        kw = dict(model="tiny.gguf", messages=HELLO, temperature=0, max_tokens=12)
        raw = client.chat.completions.create(extra_body={"reasoning_budget": budget}, **kw).choices[0].message.content
        head, mark, tail = raw.partition("</think>")
        assert mark
        message = client.chat.completions.create(extra_body={"reasoning_budget": budget, "reasoning_format": "auto"},
                                                 **kw).choices[0].message
        assert (getattr(message, "reasoning_content", None) or "", message.content) == (head.strip(), tail.lstrip())
        reasoning, content = [], []
        for chunk in client.chat.completions.create(
                extra_body={"reasoning_budget": budget, "reasoning_format": "auto"}, stream=True, **kw):
            for c in chunk.choices:
                reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
                content.append(c.delta.content or "")
        assert ("".join(reasoning), "".join(content)) == (head.strip(), tail.lstrip())


def test_logprobs_are_the_models_and_leave_the_reply_alone(client, cold):
    """Greedy with logprobs (tokens picked on the host) is the GPU's greedy reply; each token's
    log-probability is the log-softmax of a cold run's logits there, and the best of its top 5."""
    import numpy as np

    kw = dict(model="tiny.gguf", messages=HELLO, temperature=0, max_tokens=6, extra_body={"reasoning_format": "none"})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(logprobs=True, top_logprobs=5, **kw)
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == plain == "".join(e.token for e in entries)
    cold.use(SamplerConfig(temperature=0))
    seen = []
    list(cold.generate(cold.tokenizer.chat_ids(HELLO), 1, pick=lambda logits: seen.append(logits) or 0))
    logits = seen[0].astype(np.float64)
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert abs(entries[0].logprob - want.max()) < 1e-4
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and e.logprob == tops[0]
    c = client.completions.create(model="tiny.gguf", prompt="Once upon a time", max_tokens=4, temperature=0,
                                  logprobs=3)
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
    assert all(len(t) <= 3 for t in c.choices[0].logprobs.top_logprobs)


def test_logit_bias_and_max_tokens_past_the_context(client, server):
    tok = server[1].tokenizer
    word = tok.encode(" hello")[0]
    r = client.chat.completions.create(model="tiny.gguf", messages=HELLO, temperature=0, max_tokens=5,
                                       logit_bias={str(word): 100}, extra_body={"reasoning_format": "none"})
    assert r.choices[0].message.content == tok.decode([word] * 5)
    # beyond the room left: as many as fit (the reply then ends with "length"), not a 400
    job = chat_job({"messages": HELLO, "max_tokens": 32000}, tok, CTX)
    assert job.max_tokens == CTX - len(job.prompt_ids)
    end = str(tok.token_id("<|im_end|>"))
    r = client.chat.completions.create(model="any-name", messages=HELLO, max_tokens=32000, logit_bias={end: 100})
    assert r.model == "tiny.gguf" and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.chat.completions.create(model="tiny.gguf", messages=HELLO, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_tokenize_detokenize_and_props(server):
    url, tok = server[0], server[1].tokenizer
    text = "Hello <think> world"
    ids = httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tok.encode(text, parse_special=True)
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert httpx.post(url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    props = httpx.get(url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 1


def test_a_body_too_large_is_refused_while_others_flow(server):
    url = server[0]
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (10 << 20) + b'"}]}'
    r = httpx.post(url + "/v1/chat/completions", content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"]


def weather_agent(model, calls: list, **settings):
    """An openai-agents Agent with two tools whose calls land in `calls`, a call forced in its first
    turn (the SDK then resets tool_choice to auto); the arguments are bounded, so that the random
    model's sampled ones end within max_tokens."""
    from typing import Annotated

    from agents import Agent, ModelSettings, function_tool
    from pydantic import Field

    @function_tool
    def lookup(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=9)]) -> str:
        """Look up the weather of a city for some days."""
        calls.append((city, days))
        return f"{city}: sunny for {days} days"

    @function_tool
    def convert(celsius: Annotated[float, Field(ge=-50, le=50)]) -> str:
        """Convert a temperature to Fahrenheit."""
        calls.append((celsius,))
        return f"{celsius * 9 / 5 + 32} F"

    return Agent(name="weather", instructions="Answer with the tools.", tools=[lookup, convert], model=model,
                 model_settings=ModelSettings(tool_choice="required", temperature=1.0, max_tokens=100,
                                              parallel_tool_calls=False,
                                              extra_body={"reasoning_budget": 2, **settings}))


def test_an_agent_loop_with_two_tools_runs_to_its_end(server):
    """openai-agents through chat completions, with its own loop: the forced call, its result sent
    back, then the random model answers in text and the run ends; the call's arguments reach the
    tool typed."""
    import asyncio

    from agents import OpenAIChatCompletionsModel, ReasoningItem, Runner, ToolCallItem, ToolCallOutputItem, \
        set_tracing_disabled

    set_tracing_disabled(True)
    calls = []
    model = OpenAIChatCompletionsModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=server[0] + "/v1", api_key="unused", max_retries=0))
    agent = weather_agent(model, calls, seed=4, reasoning_format="auto")
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4))
    kinds = [type(item) for item in result.new_items]
    assert ReasoningItem in kinds   # the thinking came apart as reasoning_content, and the SDK took it so
    kinds = [k for k in kinds if k is not ReasoningItem]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and len(result.raw_responses) == 2
    assert len(calls) == 1 and all(isinstance(v, (str, int, float)) for v in calls[0])
    assert isinstance(calls[0][0], float if len(calls[0]) == 1 else str)
    assert isinstance(result.final_output, str)


def test_an_agent_loop_runs_through_the_default_responses_model(server):
    """The same agent with the SDK's default model (OpenAIResponsesModel, /v1/responses). The SDK
    takes a reply cut by max_output_tokens (status incomplete) for a failure: a bias towards the
    end of turn lets the random model's text end."""
    import asyncio

    from agents import Runner, ToolCallItem, ToolCallOutputItem, set_default_openai_api, set_default_openai_client, \
        set_tracing_disabled

    set_tracing_disabled(True)
    set_default_openai_client(openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    set_default_openai_api("responses")
    calls, end = [], str(server[1].tokenizer.token_id("<|im_end|>"))
    agent = weather_agent("tiny", calls, seed=4, logit_bias={end: 8})
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4))
    kinds = [type(item) for item in result.new_items if type(item) in (ToolCallItem, ToolCallOutputItem)]
    assert kinds == [ToolCallItem, ToolCallOutputItem] and len(result.raw_responses) == 2
    assert len(calls) == 1 and isinstance(result.final_output, str)


BAD_RESPONSES = [('{"input": "hi", "previous_response_id": "resp_1"}', "previous_response_id"),
                 ('{"input": []}', "input"), ('{"input": [{"type": "item_reference", "id": "x"}]}', "input[0]"),
                 ('{"input": "hi", "tools": [{"type": "web_search"}]}', "tools[0]"),
                 ('{"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}',
                  "input[0]"),
                 ('{"input": "hi", "text": {"format": {"type": "xml"}}}', "text"),
                 ('{"input": "hi", "include": ["file_search_call.results"]}', "include"),
                 ('{"input": "hi", "max_output_tokens": 0}', "max_output_tokens"),
                 ('{"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": '
                  '{"type": "object", "properties": {"a": {"type": "wizard"}}}}}}', "text"),
                 ('{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}',
                  "input[0].content")]


@pytest.mark.parametrize("body,param", BAD_RESPONSES, ids=range(len(BAD_RESPONSES)))
def test_bad_responses_requests_get_an_openai_error(server, body, param):
    r = httpx.post(server[0] + "/v1/responses", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_coding_agents_first_request_streams_to_its_end(server, client):
    """A coding agent's first request (6 tools, a system prompt, streamed with usage, max_tokens
    32000) against a slot of 1024 tokens streams to its end, with its usage. Its full size (22 KB
    of system prompt, 15 KB of tool schemas) is 24,576 tokens of the synthetic vocabulary, beyond
    the tiny model's 4,096: here the shape at the size the slot holds (996 tokens: minutes of
    lavapipe prefill saved), the full size in test_serve_parts."""
    body = coding_agent_request(40, 0)
    prompt = len(chat_job(body, server[1].tokenizer, CTX).prompt_ids)
    chunks = list(client.chat.completions.create(**body))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish in (["length"], ["stop"], ["tool_calls"]) and not chunks[-1].choices
    assert usage.prompt_tokens == prompt and 1 <= usage.completion_tokens <= CTX - prompt
    assert (finish == ["length"]) == (usage.prompt_tokens + usage.completion_tokens == CTX)
    assert any(c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls) for c in chunks)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40)
                    | st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["messages", "tools", "tool_choice", "response_format", "logit_bias", "logprobs", "top_logprobs", "stop",
          "temperature", "top_k", "seed", "stream", "stream_options", "chat_template_kwargs", "parallel_tool_calls",
          "reasoning_format", "reasoning_budget", "n", "model", "max_completion_tokens"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "x"])},
                                optional={"content": JSON, "tool_calls": JSON, "name": JSON})


@settings(max_examples=examples(60), deadline=None)
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4), messages=st.lists(MESSAGE, max_size=3))
def test_fuzzed_requests_get_no_server_error(server, fields, messages):
    body = {"messages": messages, **fields, "max_tokens": 2}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code < 500, r.text


def test_the_greedy_answer_is_the_same_after_the_fuzz(client, model_path):
    """After everything above (the fuzz included), the server's greedy answer is still `zdsl run`'s."""
    want = zdsl_run(model_path, HELLO[0]["content"], "--temp", "0", "-n", "12")
    assert chat(client, temperature=0, max_tokens=12)[0] == want["text"]


# -- /v1/responses ----------------------------------------------------------------------------
