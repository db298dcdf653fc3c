"""The OpenAI protocol's requests, checked field by field into a `Job` the server can run, and its
error bodies.

Everything a client can get wrong becomes an `ApiError`: a 4xx status and OpenAI's error body
naming the field, never a traceback. A field the protocol has and zdsl does not (logit_bias,
tools, n > 1, ...) is refused by name rather than ignored: a client that relies on it learns at
once that it does not apply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from zdsl.errors import ZdslError
from zdsl.models.qwen35.model.sampler import SamplerConfig

# request field -> SamplerConfig field
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repeat_penalty": "repeat_penalty", "repeat_last_n": "last_n"}
COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "n", "user", "ignore_eos", *SAMPLING}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
    for name, field in SAMPLING.items():
        if name not in body:
            continue
        value = body[name]
        want = int if field in ("top_k", "seed", "last_n") else float
        if not (_is_int(value) if want is int else _is_number(value)):
            raise bad(f"{name} must be {'an integer' if want is int else 'a number'}, got {value!r}", name)
        try:
            SamplerConfig(**{field: value})
        except ZdslError as e:
            raise bad(f"{name}: {e}", name) from None
        values[field] = value
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


def chat_messages(messages) -> list[dict]:
    """The conversation as the chat template takes it."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}", f"messages[{i}]")
        extra = set(_given(m)) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{i}].{sorted(extra)[0]} is not supported by this server",
                      f"messages[{i}].{sorted(extra)[0]}", "unsupported_parameter")
        content = m.get("content")
        if content is None and m["role"] != "assistant":
            raise bad(f"messages[{i}].content is required", f"messages[{i}].content")
        out.append({"role": ROLES[m["role"]], "content": "" if content is None else _text(content, i)})
    return out


def _max_tokens(body: dict, name: str, prompt: int, n_ctx: int) -> int:
    if prompt >= n_ctx:
        raise bad(f"the prompt has {prompt} tokens; the context holds {n_ctx} (start the server with a larger --ctx)",
                  "messages" if "messages" in body else "prompt", "context_length_exceeded")
    if name not in body:
        return n_ctx - prompt
    n = body[name]
    if not _is_int(n) or n < 1:
        raise bad(f"{name} must be an integer ≥ 1, got {n!r}", name)
    if prompt + n > n_ctx:
        raise bad(f"the prompt ({prompt} tokens) and {name} {n} exceed the context of {n_ctx} tokens",
                  name, "context_length_exceeded")
    return n


def _job(body: dict, prompt_ids: list[int], limit: str, n_ctx: int) -> Job:
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos must be true or false", "ignore_eos")
    return Job(prompt_ids, _max_tokens(body, limit, len(prompt_ids), n_ctx), sampler_of(body), _stop(body),
               body.get("stream", False), _include_usage(body), ignore_eos)


def chat_job(body, tokenizer, n_ctx: int) -> Job:
    """A /v1/chat/completions request, its messages rendered by the model's chat template."""
    body = _request(body, CHAT_FIELDS)
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"} or not isinstance(
            kwargs.get("enable_thinking", True), bool):
        raise bad("chat_template_kwargs may hold only enable_thinking (true or false)", "chat_template_kwargs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    ids = tokenizer.chat_ids(chat_messages(body.get("messages")), enable_thinking=kwargs.get("enable_thinking", True))
    return _job(body, ids, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", n_ctx)


def completion_job(body, tokenizer, n_ctx: int) -> Job:
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
    return _job(body, ids, "max_tokens", n_ctx)


def _request(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    body = _given(body)
    _check_fields(body, allowed)
    return body
