"""The server's reply parts without a device: the thinking split from the answer, tool calls parsed
from Qwen3.5's format (the synthetic model's chat template renders the reference), and the
grammars that force a call or a JSON schema (walked by llguidance itself, checked with
`jsonschema`)."""

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent_request import coding_agent_request
from budget import examples
from zdsl.models.qwen35.file.synth import CHAT_TEMPLATE, _vocab
from zdsl.models.qwen35.model.tokenizer import Tokenizer
from zdsl.models.qwen35.serve.grammar import Constraint, json_lark
from zdsl.models.qwen35.serve.reasoning import ReasoningSplit
from zdsl.models.qwen35.serve.tools import CallParser, tools_of

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "metric": {"type": "boolean"}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


@pytest.fixture(scope="module")
def tok():
    tokens, types, merges = _vocab(1024)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.chat_template": CHAT_TEMPLATE, "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>")}
    return Tokenizer(lambda key, default: meta.get(key, default))


def pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)])]


def split(text: str, thinking: bool, cuts: list[int]) -> tuple[str, str]:
    s, reasoning, content = ReasoningSplit(thinking), [], []
    for piece in pieces(text, cuts) + [None]:
        r, c = s.flush() if piece is None else s.add(piece)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


words = st.text(st.sampled_from("ab <>/\nthink"), max_size=30)


@settings(max_examples=examples(200), deadline=None)
@given(thought=words, answer=words, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_the_thinking_splits_off_exactly_however_the_text_comes(thought, answer, cuts):
    """The reference: the text before the first </think> (stripped) and after it (its leading
    whitespace dropped); with no </think> the reply is all thinking."""
    text = f"{thought}</think>{answer}"
    head, _, tail = text.partition("</think>")
    assert split(text, True, cuts) == (head.strip(), tail.lstrip())
    if "</think>" not in thought:
        assert split(thought, True, cuts) == (thought.strip(), "")
    plain = answer.replace("<think>", "")
    assert split(plain, False, cuts) == ("", plain) or plain.lstrip().startswith("<think")


def rendered_calls(tok, calls: list[dict], content: str = "") -> str:
    """What the template writes for an assistant turn with these calls: the model's own format."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": content, "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS)
    return text.split("</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")


@settings(max_examples=examples(50), deadline=None)
@given(thought=words, args=st.fixed_dictionaries({"city": st.text("Paris ", max_size=8)},
                                                 optional={"days": st.integers(1, 14)}),
       cuts=st.lists(st.integers(0, 300), max_size=8))
def test_a_call_written_inside_the_thinking_is_a_call(tok, thought, args, cuts):
    """As llama-server parses Qwen3.5's replies: <tool_call> ends the thinking (no </think>
    needed), and the call it opens is a call, whole and streamed alike."""
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.serve.api import Job
    from zdsl.models.qwen35.serve.reply import Reply

    assume("</think>" not in thought)
    job = Job([0], 1, SamplerConfig(), [], False, False, tools=tools_of({"tools": TOOLS}), thinking=True)
    reply, streamed = Reply(job), {}
    for piece in pieces(thought + rendered_calls(tok, [("get_weather", args)]), cuts) + [None]:
        delta = reply.flush() if piece is None else reply.add(piece)
        for d in delta.get("tool_calls", []):
            streamed[d["index"]] = streamed.get(d["index"], "") + d["function"]["arguments"]
    message = reply.message()
    assert (message.get("reasoning_content", ""), message["content"]) == (thought.strip(), None)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [args]
    assert [json.loads(streamed[i]) for i in sorted(streamed)] == [args]


arguments = st.fixed_dictionaries({"city": st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)},
                                  optional={"days": st.integers(1, 14), "metric": st.booleans()})


@settings(max_examples=examples(100), deadline=None)
@given(args=st.lists(arguments, min_size=1, max_size=3), content=st.sampled_from(["", "Let me see."]),
       cuts=st.lists(st.integers(0, 400), max_size=10))
def test_calls_parse_back_to_what_the_template_rendered(tok, args, content, cuts):
    tools = tools_of({"tools": TOOLS})
    text = rendered_calls(tok, [("get_weather", a) for a in args], content)
    parser, out, deltas = CallParser(tools), [], []
    for piece in pieces(text, cuts):
        t, d = parser.add(piece)
        out.append(t)
        deltas += d
    t, d = parser.flush()
    out.append(t)
    deltas += d
    assert "".join(out) == content
    got = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    assert got == [("get_weather", a) for a in args]
    streamed = {}
    for d in deltas:   # the stream's deltas, put together as a client does
        streamed.setdefault(d["index"], "")
        streamed[d["index"]] += d["function"]["arguments"]
    assert [json.loads(streamed[i]) for i in sorted(streamed)] == [a for a in args]


def walk(tok, lark: str, rng, stop_ids) -> str:
    """A random text the grammar allows: each token drawn among those its mask lets through (the
    end of turn, where allowed, half the time)."""
    c, out = Constraint(lark, tok, stop_ids), []
    for _ in range(2000):
        allowed = c.allowed()
        ends = [t for t in stop_ids if allowed[t]]
        token = ends[0] if ends and rng.random() < 0.5 else int(rng.choice(np.flatnonzero(allowed)))
        if token in stop_ids:
            return tok.decode(out)
        c.take(token)
        out.append(token)
    raise AssertionError(f"no end after 2000 tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("choice", ["required", "get_time"])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_follow_the_tools_schemas(tok, choice, parallel):
    body = {"tools": TOOLS, "tool_choice": choice if choice == "required" else
            {"type": "function", "function": {"name": choice}}, "parallel_tool_calls": parallel}
    tools = tools_of(body)
    stop = {tok.eos_id}
    rng = np.random.default_rng(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = set()
    for _ in range(100):  # 200 forced calls of each choice, parallel or not, without the model's steps
        parser = CallParser(tools)
        text, _ = parser.add(walk(tok, tools.grammar(), rng, stop))
        assert text == "" and parser.flush()[0] == ""
        counts.add(len(parser.calls))
        for call in parser.calls:
            assert choice == "required" or call.name == choice
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert counts == ({1} if not parallel else counts) and (not parallel or max(counts) > 1)


def test_json_schema_walks_validate(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "number", "minimum": -5, "maximum": 5},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "n", "tags"], "additionalProperties": False}
    rng = np.random.default_rng(1)
    for _ in range(200):  # the acceptance's count, without the model's steps
        jsonschema.validate(json.loads(walk(tok, "start: " + json_lark(schema), rng, {tok.eos_id})), schema)


def test_a_coding_agents_first_request_is_taken_where_its_prompt_fits(tok):
    """Full size (a 22 KB system prompt, 15 KB of tool schemas): beyond a context that cannot hold
    the prompt, one clear 400; where it fits, max_tokens 32000 is the room the context leaves."""
    from zdsl.models.qwen35.serve.api import ApiError, chat_job

    body = coding_agent_request(22_000, 15_000)
    assert abs(sum(len(json.dumps(t)) for t in body["tools"]) - 15_000) < 12
    with pytest.raises(ApiError, match="context holds 4096") as refused:
        chat_job(body, tok, 4096)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    job = chat_job(body, tok, 48_000)
    assert job.stream and job.include_usage and job.max_tokens == 48_000 - len(job.prompt_ids) < 32000
    assert len(job.tools.schemas) == 6 and not job.tools.forced


def test_a_call_the_model_opens_follows_a_strict_tools_schema(tok):
    """tool_choice auto with a strict tool: free text until the model writes <tool_call> (in its
    thinking or after), then the call's grammar: walked at random, every call validates
    (jsonschema); a tool that is not strict keeps free arguments; after the call, free again."""
    from zdsl.models.qwen35.serve.picker import Steer

    strict = [{"type": "function", "function": t["function"] | {"strict": name == "get_weather"}}
              for t, name in zip(TOOLS, ("get_weather", "get_time"))]
    tools = tools_of({"tools": strict})
    assert tools.lazy and not tools.forced
    stop = {tok.eos_id}
    rng = np.random.default_rng(2)

    def steer(thinking: bool) -> Steer:
        return Steer(tok.vocab_size, thinking=thinking, think_end=tok.token_id("</think>"), stop_ids=stop,
                     calls=lambda: Constraint(tools.grammar(lazy=True), tok, stop), piece=tok.piece)

    for n in range(20):
        s, text = steer(n % 2 == 1), "Let me look. <tool_call>\n<function=get_weather>\n"
        for token in tok.encode(text):
            assert s.words() is None or s.call is not None
            s.take(token)
        walked = []
        while s.call is not None:
            allowed = np.flatnonzero(np.unpackbits(s.words().view(np.uint8), bitorder="little")[:tok.vocab_size])
            walked.append(int(rng.choice(allowed)))
            s.take(walked[-1])
        assert s.words() is None and not s.thinking
        parser = CallParser(tools)
        parser.add(text + tok.decode(walked))
        parser.flush()
        (call,) = parser.calls
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    s = steer(False)
    for token in tok.encode("<tool_call>\n<function=get_time>\n"):
        s.take(token)
    free = np.unpackbits(s.words().view(np.uint8), bitorder="little")[:tok.vocab_size]
    assert free[tok.encode("<parameter=hour>")[0]] and free[tok.encode("anything")[0]]
