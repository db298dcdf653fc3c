"""OpenAI's Responses API (`POST /v1/responses`), its stateless part: a request is read into the
chat completions body it means (input items as messages, instructions as the system turn,
function tools, text.format as response_format, reasoning.effort "none" as no thinking), runs as
a chat, and its reply comes back as output items, whole or as the stream of typed events the
SDKs read (response.created … response.completed).

Nothing is stored: `previous_response_id` and `conversation` are refused, so a client sends the
whole conversation each time (as agents do with store false); the slot's kept prefix makes that
cheap.
"""

from __future__ import annotations

import json
import time
import uuid

from zdsl.models.qwen35.serve.api import ApiError, bad

# Responses field -> the chat completions field it is (the same sampling and zdsl's extensions too)
RENAMED = {"max_output_tokens": "max_tokens"}
PASSED = {"model", "stream", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p",
          "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "stop", "logit_bias",
          "ignore_eos", "chat_template_kwargs", "reasoning_format", "reasoning_budget"}
IGNORED = {"store", "metadata", "user", "include", "prompt_cache_key", "safety_identifier", "service_tier",
           "background"}  # nothing to keep, log or schedule: accepted as OpenAI's defaults
FIELDS = {"input", "instructions", "tools", "tool_choice", "text", "reasoning", "truncation", *RENAMED, *PASSED,
          *IGNORED}
INCLUDABLE = {"reasoning.encrypted_content"}  # asked by stateless clients; there is none to give


def chat_body(body) -> dict:
    """The chat completions body a Responses request means; refuses (ApiError) what has no meaning
    here, naming the Responses field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for name in body:
        if name in ("previous_response_id", "conversation"):
            raise bad(f"{name}: this server stores no responses; send the whole conversation as input", name,
                      "unsupported_parameter")
        if name not in FIELDS:
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    include = body.get("include", [])
    if not isinstance(include, list) or set(include) - INCLUDABLE:
        raise bad(f"include may hold only {', '.join(sorted(INCLUDABLE))}", "include")
    if body.get("truncation", "disabled") != "disabled":
        raise bad("truncation must be 'disabled': a conversation longer than the context is refused", "truncation")
    if body.get("background", False) is not False:
        raise bad("background must be false: replies are not stored", "background")
    chat = {k: v for k, v in body.items() if k in PASSED} | {RENAMED[k]: v for k, v in body.items() if k in RENAMED}
    chat["messages"] = messages(body.get("input"), body.get("instructions"))
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if "text" in body:
        chat["response_format"] = _format(body["text"])
    effort = body.get("reasoning", {})
    if not isinstance(effort, dict):
        raise bad("reasoning must be an object such as {'effort': 'none'}", "reasoning")
    if effort.get("effort") == "none":
        chat["chat_template_kwargs"] = {"enable_thinking": False} | chat.get("chat_template_kwargs", {})
    return chat


def named_as_responses(e: ApiError) -> ApiError:
    """An error of the chat body a request became, naming the Responses field it came from."""
    param = e.param or ""
    names = {"max_tokens": "max_output_tokens", "response_format": "text"}
    e.param = "input" if param.startswith("messages") else names.get(param, e.param)
    return e


def _parts_text(content, param: str, kinds=("input_text", "output_text", "text")) -> str:
    """An item's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"{param} must be a string or a list of text parts ({', '.join(kinds)})", param)


def messages(given, instructions) -> list[dict]:
    """Input items as chat messages: an assistant's turn (its reasoning, text and function calls,
    as consecutive items) one message; a function_call_output a tool message."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})

    def turn() -> dict:
        """The assistant message the current item belongs to."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            text = _parts_text(item.get("content"), f"{param}.content")
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant":
                turn()["content"] += text
            elif role == "system" and out and out[-1]["role"] == "system":
                out[-1]["content"] += "\n\n" + text  # instructions and the input's own system turn: one
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            turn()["reasoning_content"] = _parts_text(parts, f"{param}.content", ("reasoning_text", "summary_text"))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and _is_object_text(arguments)):
                raise bad(f"{param} must be a function_call with call_id, name and arguments (a JSON object as text)",
                          param)
            turn().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{param}.call_id must be a string", f"{param}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item.get("output"), f"{param}.output")})
        else:
            raise bad(f"{param} must be a message (role user, system, developer or assistant), reasoning, "
                      "function_call or function_call_output item", param)
    return out


def _is_object_text(text) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _tools(tools) -> list:
    """Function tools, flat as Responses writes them, in chat's nesting."""
    if not isinstance(tools, list):
        raise bad("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad(f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': ...}}: this server "
                      "runs only function tools", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required", or refused by the chat's check


def _format(text) -> dict:
    """text.format as chat's response_format."""
    fmt = text.get("format", {"type": "text"}) if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    if isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise bad("text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'name': ..., "
              "'schema': {...}}", "text")


class ResponseEvents:
    """A response's object and, as its reply comes, the events of its stream: output items opened
    and closed as the reply moves from thinking to text to calls, their deltas in between."""

    def __init__(self, body: dict, model: str):
        self.object = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                       "status": "in_progress", "error": None, "incomplete_details": None,
                       "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                       "model": model, "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
                       "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False,
                       "temperature": body.get("temperature"), "text": body.get("text", {"format": {"type": "text"}}),
                       "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
                       "top_p": body.get("top_p"), "truncation": "disabled", "usage": None, "metadata": {}}
        self.sequence = 0
        self.open: dict | None = None    # the output item receiving deltas
        self.calls: dict[int, dict] = {}  # the reply's call index -> its function_call item

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=dict(self.object)),
                self.event("response.in_progress", response=dict(self.object))]

    def add(self, delta: dict) -> list[dict]:
        """The events of a reply's delta (reply.Reply's: reasoning_content, content, tool_calls)."""
        events = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if delta.get(key):
                events += self._text(kind, delta[key])
        for d in delta.get("tool_calls", []):
            if "id" in d:
                events += self._close()
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                        "call_id": d["id"], "name": d["function"]["name"], "arguments": ""}
                self.calls[d["index"]] = item
                events += self._add(item)
            else:
                item = self.calls[d["index"]]
                item["arguments"] += d["function"]["arguments"]
                if item is self.open:  # else a call cut short, closed at the end: its item is done
                        events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                             output_index=self._index(item), delta=d["function"]["arguments"]))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}", "type": kind,
                    "status": "in_progress", "content": []} | (
                {"summary": []} if kind == "reasoning" else {"role": "assistant"})
            events += self._add(item)
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(item), content_index=0, part=dict(part)))
        item = self.open
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=item["id"], output_index=self._index(item), content_index=0,
                                 delta=text, **extra))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.object["output"].append(item)
        self.open = item
        shown = item | ({"content": []} if "content" in item else {})
        return [self.event("response.output_item.added", output_index=self._index(item), item=shown)]

    def _index(self, item: dict) -> int:
        return next(i for i, o in enumerate(self.object["output"]) if o is item)

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        at, events = self._index(item), []
        item["status"] = "completed"
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.event(name, item_id=item["id"], output_index=at, content_index=0, text=part["text"],
                                     **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                     content_index=0, part=dict(part)))
        return events + [self.event("response.output_item.done", output_index=at, item=item)]

    def finish(self, piece, called: bool) -> list[dict]:
        """The last events: the open item closed, the response completed, or incomplete where it
        ran out of tokens before any call (`piece`: the engine's last, with the usage)."""
        events = self._close()
        length = piece.finish == "length" and not called
        self.object |= {"status": "incomplete" if length else "completed",
                        "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                        "usage": {"input_tokens": piece.prompt_tokens,
                                  "input_tokens_details": {"cached_tokens": piece.reused_tokens},
                                  "output_tokens": piece.completion_tokens,
                                  "output_tokens_details": {"reasoning_tokens": piece.reasoning_tokens},
                                  "total_tokens": piece.prompt_tokens + piece.completion_tokens}}
        return events + [self.event(f"response.{self.object['status']}", response=self.object)]


def sse(event: dict) -> str:
    """A stream event as server-sent events write it: its type named, then its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
