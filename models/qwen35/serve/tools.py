"""Function calling in Qwen3.5's format: the request's tools checked, the grammar that makes a
reply a call, and the calls parsed out of the reply's text, at once or piece by piece.

A call is written `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n…
</function>\\n</tool_call>`; a value is text, or JSON where the tool's schema gives the argument
another type. The chat template renders the tools and past calls (tokenizer.py); the calls
parsed become OpenAI's `tool_calls`, their arguments a JSON object typed by the tool's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from zdsl.models.qwen35.serve.grammar import json_lark
from zdsl.models.qwen35.serve.reasoning import held

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION_END = re.compile(r"\s*</function>")
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ToolError(ValueError):
    """A request's tools or tool_choice the server cannot use: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """The request's functions (name → JSON schema of the arguments), which must be called
    (tool_choice: "auto", "none", "required", or one function's name) and how many at once."""

    schemas: dict[str, dict] = field(default_factory=dict)
    strict: dict[str, bool] = field(default_factory=dict)
    choice: str = "auto"
    parallel: bool = True
    declared: list[dict] = field(default_factory=list)  # as the template renders them

    @property
    def forced(self) -> bool:
        return bool(self.schemas) and self.choice != "auto" and self.choice != "none"

    @property
    def lazy(self) -> bool:
        """Whether calls the model opens of its own (tool_choice auto) are held to a grammar: some
        tool is strict."""
        return self.choice == "auto" and any(self.strict.values())

    def grammar(self, lazy: bool = False) -> str:
        """The Lark grammar of a reply that is only calls: one (or, with parallel calls, several)
        of the function named, or of any. `lazy`: of one call after the <tool_call> that opened it
        (tool_choice auto), a strict tool's arguments under its schema, another's free."""
        names = [self.choice] if self.choice in self.schemas else list(self.schemas)
        rules = [f"call: {' | '.join(f'f{i}' for i in range(len(names)))}"]
        for i, name in enumerate(names):
            opening = json.dumps(("" if lazy else START) + f"\n<function={name}>\n")
            if lazy and not self.strict[name]:
                rules.append(f"f{i}: {opening} f{i}_free")
                rules.append(f'f{i}_free[lazy]: /(.|\\n)*/ "</function>\\n{END}"')
                continue
            schema = self.schemas[name]
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            parts = []
            for j, (arg, sub) in enumerate(props.items()):
                rule = f"f{i}_{j}"
                parts.append(rule if arg in required else f"{rule}?")
                head = json.dumps(f"<parameter={arg}>\n")
                if _types(sub) == {"string"}:
                    lo, hi = sub.get("minLength", 0), sub.get("maxLength")
                    rules.append(f"{rule}: {head} {rule}_v")
                    rules.append(f'{rule}_v[lazy]: /(.|\\n){{{lo},{"" if hi is None else hi}}}/ "\\n</parameter>\\n"')
                else:
                    rules.append(f"{rule}: {head} {json_lark(sub, self.strict[name])} \"\\n</parameter>\\n\"")
            rules.append(f"f{i}: {opening} {' '.join(parts)} \"</function>\\n{END}\"".replace("\n", "\\n"))
        top = 'start: call ("\\n" call)*' if self.parallel and not lazy else "start: call"
        return "\n".join([top, *rules])


def _types(schema) -> set[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def tools_of(body: dict) -> Tools:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked."""
    tools = Tools()
    given = body.get("tools", [])
    if not isinstance(given, list):
        raise ToolError("tools must be a list of functions", "tools")
    for i, t in enumerate(given):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            "...}}}} with a name of letters, digits, _ . : -", f"tools[{i}]")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        if f["name"] in tools.schemas:
            raise ToolError(f"tools[{i}]: the function {f['name']!r} is given twice", f"tools[{i}]")
        tools.schemas[f["name"]] = params
        tools.strict[f["name"]] = f.get("strict") is True
        tools.declared.append({"type": "function", "function": {k: v for k, v in f.items() if k != "strict"}})
    choice = body.get("tool_choice", "auto" if given else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in tools.schemas:
            raise ToolError("tool_choice must name one of the tools: {'type': 'function', 'function': "
                            "{'name': ...}}", "tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ToolError("tool_choice must be 'auto', 'none', 'required' or a function of tools", "tool_choice")
    if choice == "required" and not given:
        raise ToolError("tool_choice 'required' needs tools", "tool_choice")
    tools.choice = choice
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    tools.parallel = parallel
    return tools


def typed(value: str, schema) -> object:
    """An argument's text as its schema types it: JSON where the schema says it is not (only) a
    string and the text parses, else the text."""
    types = _types(schema)
    if types == {"string"}:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def history_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls` as the template renders them: arguments as an object."""
    out = []
    if not isinstance(calls, list):
        raise ToolError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        args = f.get("arguments", "{}") if isinstance(f, dict) else None
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(args, dict):
            raise ToolError(f"messages[{i}].tool_calls[{j}] must be a function call whose arguments are a JSON "
                            "object", f"messages[{i}].tool_calls[{j}]")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


@dataclass
class Call:
    """A call being parsed: its index, id and name, the arguments released so far."""

    index: int
    id: str
    name: str
    arguments: str = ""
    released: int = 0     # arguments whose fragment went out
    closed: bool = False  # its closing brace went out

    def fragment(self, piece: str) -> dict:
        self.arguments += piece
        return {"index": self.index, "function": {"arguments": piece}}

    def close(self) -> list[dict]:
        if self.closed:
            return []
        self.closed = True
        return [self.fragment("}" if self.released else "{}")]


class CallParser:
    """A reply's answer text in; its text and the deltas of its calls out (OpenAI's streamed
    `tool_calls`: first the call's id and name, then fragments of its arguments' JSON, one per
    argument as it ends). Whitespace around calls is the format's and is dropped."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.calls: list[Call] = []
        self.pending = ""    # text that may start a call, or whitespace that may come before one
        self.block = None    # the text of the call being read, after <tool_call>
        self.current = None  # the call that block names, once it does

    def add(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        out, deltas = [], []
        while True:
            if self.block is None:
                at = self.pending.find(START)
                if at < 0:
                    body = self.pending[:len(self.pending) - held(self.pending, START)]
                    if body.strip():  # released but for its trailing space, which may precede a call
                        body = body.rstrip()
                        out.append(body)
                        self.pending = self.pending[len(body):]
                    break
                before = self.pending[:at]
                out.append(before.rstrip() if before.strip() else "")
                self.pending, self.block, self.current = self.pending[at + len(START):], "", None
            self.block += self.pending
            self.pending = ""
            end = self.block.find(END)
            deltas += self._parse(self.block if end < 0 else self.block[:end])
            if end < 0:
                break
            self.pending = self.block[end + len(END):].lstrip()
            self.block = None
        return "".join(out), deltas

    def _parse(self, block: str) -> list[dict]:
        """The deltas of the current call not released yet, from its text so far."""
        m = _FUNCTION.match(block)
        if not m or m.group(1) not in self.tools.schemas:
            return []
        deltas = []
        if self.current is None:
            self.current = call = Call(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", m.group(1))
            self.calls.append(call)
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        call, schema = self.current, self.tools.schemas[self.current.name].get("properties") or {}
        at, found = m.end(), 0
        while (p := _PARAMETER.match(block, at)) is not None:
            at, found = p.end(), found + 1
            if found > call.released and not call.closed:
                value = json.dumps(typed(p.group(2), schema.get(p.group(1))), ensure_ascii=False)
                deltas.append(call.fragment(("{" if call.released == 0 else ", ") + json.dumps(p.group(1)) + ": "
                                            + value))
                call.released += 1
        if _FUNCTION_END.match(block, at):
            deltas += call.close()
        return deltas

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: a call cut short keeps the arguments it has; a block that never named a
        known function is text after all, as is text held at the end."""
        text = self.pending if self.pending.strip() or not self.calls else ""
        if self.block is not None and self.current is None:
            text = START + self.block
        self.pending, self.block = "", None
        return text, [d for call in self.calls for d in call.close()]
