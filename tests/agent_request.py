"""The first request a coding agent sends, in its shape: what the server tests send at the size a
tiny model's slot holds, and scripts/measure/agent_request.py at full size to a live server."""

import json


def coding_agent_request(system_chars: int, schema_chars: int) -> dict:
    """A coding agent's first request, in its shape: 6 tools whose schemas (as JSON) take about
    `schema_chars` characters in all (at least their bare ~90 each), a system prompt of about
    `system_chars`, streamed with usage and max_tokens 32000 (whatever the context)."""
    def padded(what: str, n: int) -> str:
        line = f"{what}: follow the repository's conventions, explain nothing twice, and check the result. "
        return (line * (n // len(line) + 1))[:n]

    tools = []
    for name, arg in {"bash": "command", "read": "path", "write": "path", "edit": "old_string", "glob": "pattern",
                      "grep": "pattern"}.items():
        f = {"name": name, "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}
        room = schema_chars // 6 - len(json.dumps({"type": "function", "function": f})) - len(', "description": ""')
        tools.append({"type": "function", "function": f | ({"description": padded(name, room)} if room > 0 else {})})
    return {"model": "agent", "messages": [{"role": "system", "content": padded("Rule", system_chars)},
                                           {"role": "user", "content": "Add a test for the parser."}],
            "tools": tools, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 32000}
