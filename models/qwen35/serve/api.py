"""The OpenAI protocol's requests, checked field by field into a `Job` the server can run, and its
error bodies.

Everything a client can get wrong becomes an `ApiError`: a 4xx status and OpenAI's error body
naming the field, never a traceback. A field the protocol has and zdsl does not (n > 1, ...) is
refused by name rather than ignored: a client that relies on it learns at once that it does not
apply. Where the protocol is silent, fields behave as llama-server's do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from zdsl.errors import ZdslError
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.serve.grammar import GrammarError, check, json_lark
from zdsl.models.qwen35.serve.tools import ToolError, Tools, history_calls, tools_of

# request field -> SamplerConfig field
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repeat_penalty": "repeat_penalty", "repeat_last_n": "last_n"}
COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "n", "user", "ignore_eos", "logit_bias",
          "logprobs", *SAMPLING}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "tools", "tool_choice",
                        "parallel_tool_calls", "top_logprobs", "response_format", "reasoning_format",
                        "reasoning_budget"}
COMPLETION_FIELDS = COMMON | {"prompt"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MOST_LOGPROBS = 20
REASONING_FORMATS = ("auto", "deepseek", "none")


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One generation: the prompt's token ids and how to continue it."""

    prompt_ids: list[int]
    max_tokens: int
    sampler: SamplerConfig
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # llama-server's extension: generate past stop tokens (benchmarks)
    top_logprobs: int | None = None  # each token's log-probability and this many likeliest (None: none)
    bias: dict[int, float] = field(default_factory=dict)  # added to the logits
    grammar: str | None = None       # the Lark grammar the answer (after any thinking) follows
    calls: str | None = None         # the Lark grammar of a call the model opens (auto, strict tools)
    thinking: bool = False           # the prompt opens a <think> the reply starts in
    budget: int | None = None        # thinking tokens before </think> is forced
    tools: Tools = field(default_factory=Tools)
    split_reasoning: bool = True     # the thinking as reasoning_content, apart from the content
    marks: tuple[int, ...] = ()      # prompt positions to checkpoint at: where the next turn's prompt parts

    @property
    def on_host(self) -> bool:
        """Whether its tokens are picked on the host from read-back logits (picker.py): for their
        log-probabilities."""
        return self.top_logprobs is not None

    @property
    def steered(self) -> bool:
        """Whether the tokens allowed change step by step: a grammar, a thinking budget (picker.Steer)."""
        return self.grammar is not None or self.calls is not None or (self.thinking and self.budget is not None)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _given(body: dict) -> dict:
    """The fields a client set (null counts as not set, as OpenAI's clients send it)."""
    return {k: v for k, v in body.items() if v is not None}


def sampler_of(body: dict) -> SamplerConfig:
    """The request's sampling fields on SamplerConfig's defaults (`zdsl run`'s); with no seed, a
    random one, as a sampled API reply is expected to differ between calls."""
    values = {"seed": random.randrange(2 ** 32)}
    for name, key in SAMPLING.items():
        if name not in body:
            continue
        value = body[name]
        want = int if key in ("top_k", "seed", "last_n") else float
        if not (_is_int(value) if want is int else _is_number(value)):
            raise bad(f"{name} must be {'an integer' if want is int else 'a number'}, got {value!r}", name)
        try:
            SamplerConfig(**{key: value})
        except ZdslError as e:
            raise bad(f"{name}: {e}", name) from None
        values[key] = value
    return SamplerConfig(**values)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    if body.get("n", 1) != 1:
        raise bad("n must be 1: this server returns one choice", "n", "unsupported_parameter")
    if "model" in body and not isinstance(body["model"], str):
        raise bad("model must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad("stream must be true or false", "stream")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    return stop


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise bad("stream_options may hold only include_usage (true or false)", "stream_options")
    return options.get("include_usage", False)


def _text(content, i: int) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


MESSAGE_FIELDS = {"system": {"content", "name"}, "user": {"content", "name"}, "tool": {"content", "tool_call_id", "name"},
                  "assistant": {"content", "name", "tool_calls", "reasoning_content", "refusal"}}


def chat_messages(messages) -> list[dict]:
    """The conversation as the chat template takes it: text contents, past calls' arguments as
    objects."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}", f"messages[{i}]")
        role = ROLES[m["role"]]
        extra = set(_given(m)) - {"role"} - MESSAGE_FIELDS[role]
        if extra:
            raise bad(f"messages[{i}].{sorted(extra)[0]} is not supported by this server",
                      f"messages[{i}].{sorted(extra)[0]}", "unsupported_parameter")
        content = m.get("content")
        if content is None and role != "assistant":
            raise bad(f"messages[{i}].content is required", f"messages[{i}].content")
        message = {"role": role, "content": "" if content is None else _text(content, i)}
        if m.get("tool_calls") is not None:
            try:
                message["tool_calls"] = history_calls(m["tool_calls"], i)
            except ToolError as e:
                raise bad(str(e), e.param) from None
        if isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]
        out.append(message)
    return out


def _max_tokens(body: dict, name: str, prompt: int, n_ctx: int) -> int:
    """The tokens to generate: as many as asked, or as fit in the context after the prompt where
    fewer do (llama-server's way: such a reply ends with finish_reason "length")."""
    if prompt >= n_ctx:
        raise bad(f"the prompt has {prompt} tokens; the context holds {n_ctx} (start the server with a larger --ctx)",
                  "messages" if "messages" in body else "prompt", "context_length_exceeded")
    if name not in body:
        return n_ctx - prompt
    n = body[name]
    if not _is_int(n) or n < 1:
        raise bad(f"{name} must be an integer ≥ 1, got {n!r}", name)
    return min(n, n_ctx - prompt)


def _bias(body: dict, vocab: int) -> dict[int, float]:
    """logit_bias: token id (a string, as JSON keys are) → a number in [-100, 100]."""
    given = body.get("logit_bias", {})
    if not isinstance(given, dict):
        raise bad("logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in given.items():
        if not (key.isdigit() and int(key) < vocab) or not _is_number(value) or not -100 <= value <= 100:
            raise bad(f"logit_bias must map token ids in [0, {vocab}) to numbers in [-100, 100], got {key!r}: "
                      f"{value!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _job(body: dict, prompt_ids: list[int], limit: str, n_ctx: int, vocab: int, top_logprobs: int | None) -> Job:
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos must be true or false", "ignore_eos")
    return Job(prompt_ids, _max_tokens(body, limit, len(prompt_ids), n_ctx), sampler_of(body), _stop(body),
               body.get("stream", False), _include_usage(body), ignore_eos, top_logprobs, _bias(body, vocab))


def _chat_logprobs(body: dict) -> int | None:
    """logprobs (true or false) and top_logprobs (0 to 20, with logprobs)."""
    on, top = body.get("logprobs", False), body.get("top_logprobs")
    if not isinstance(on, bool):
        raise bad("logprobs must be true or false", "logprobs")
    if top is not None and not (_is_int(top) and 0 <= top <= MOST_LOGPROBS and on):
        raise bad(f"top_logprobs must be an integer in [0, {MOST_LOGPROBS}], with logprobs true", "top_logprobs")
    return (top or 0) if on else None


def _response_grammar(body: dict) -> str | None:
    """response_format: text, a JSON object, or JSON under a schema (strict: every keyword kept)."""
    fmt = body.get("response_format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "start: " + json_lark({"type": "object"})
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad("response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                  "'json_schema': {'name': ..., 'schema': {...}}}", "response_format")
    return "start: " + json_lark(schema, spec.get("strict") is True)


def opened_think(tokenizer, ids: list[int]) -> int | None:
    """Where the <think> the rendered prompt ends inside begins (the template opened it), or None.
    The next turn's prompt renders this reply without it: a checkpoint there lets it resume."""
    if "<think>" not in tokenizer.tokens or not tokenizer.decode(ids[-3:]).rstrip().endswith("<think>"):
        return None
    return len(ids) - 1 - ids[::-1].index(tokenizer.token_id("<think>"))


def chat_job(body, tokenizer, n_ctx: int, stop_ids=frozenset(), reasoning_format: str = "auto",
             budget: int | None = None) -> Job:
    """A /v1/chat/completions request, its messages (and tools) rendered by the model's chat
    template; `reasoning_format` and `budget`: the server's defaults."""
    body = _request(body, CHAT_FIELDS)
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"} or not isinstance(
            kwargs.get("enable_thinking", True), bool):
        raise bad("chat_template_kwargs may hold only enable_thinking (true or false)", "chat_template_kwargs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    reasoning_format = body.get("reasoning_format", reasoning_format)
    if reasoning_format not in REASONING_FORMATS:
        raise bad(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    budget = body.get("reasoning_budget", budget)
    if budget is not None and not (_is_int(budget) and budget >= -1):
        raise bad("reasoning_budget must be an integer ≥ 0 (or -1: no limit)", "reasoning_budget")
    try:
        tools = tools_of(body)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    shown = {"tools": tools.declared} if tools.schemas and tools.choice != "none" else {}
    ids = tokenizer.chat_ids(chat_messages(body.get("messages")), enable_thinking=kwargs.get("enable_thinking", True),
                             **shown)
    job = _job(body, ids, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", n_ctx,
               tokenizer.vocab_size, _chat_logprobs(body))
    think = opened_think(tokenizer, ids)
    job.tools, job.thinking, job.marks = tools, think is not None, () if think is None else (think,)
    job.budget = None if budget == -1 else budget
    job.split_reasoning = reasoning_format != "none"
    job.grammar = tools.grammar() if tools.forced else _response_grammar(body)
    job.calls = tools.grammar(lazy=True) if tools.lazy and job.grammar is None else None
    for lark, param in ((job.grammar, "tools" if tools.forced else "response_format"), (job.calls, "tools")):
        try:
            if lark is not None:
                check(lark, tokenizer, stop_ids)
        except GrammarError as e:
            raise bad(f"the JSON schema cannot be enforced: {e}", param) from None
    return job


def completion_job(body, tokenizer, n_ctx: int, **defaults) -> Job:
    """A /v1/completions request: the prompt as text (control tokens written in it parsed, as a
    raw prompt to llama-server is) or as token ids."""
    body = _request(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, parse_special=True)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise bad(f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise bad("prompt must be a string, or a list of token ids", "prompt")
    if not ids:
        raise bad("prompt is empty", "prompt")
    top = body.get("logprobs")
    if top is not None and not (_is_int(top) and 0 <= top <= MOST_LOGPROBS):
        raise bad(f"logprobs must be an integer in [0, {MOST_LOGPROBS}]", "logprobs")
    return _job(body, ids, "max_tokens", n_ctx, tokenizer.vocab_size, top)


def _request(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    body = _given(body)
    _check_fields(body, allowed)
    return body
