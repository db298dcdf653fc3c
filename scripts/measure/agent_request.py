"""A coding agent's first request at full size (6 tools with 15 KB of schemas, a 22 KB system
prompt, streamed with usage, max_tokens 32000) sent to a live OpenAI-compatible server: the time
to its first streamed delta, the whole reply's, how it ended and its usage. Against a slot with
less context than the request's max_tokens the reply runs until the context is full
(finish_reason "length"), as llama-server's does. Prints one JSON line. Run on the GPU machine
with the server started (docs/PERF.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from agent_request import coding_agent_request  # noqa: E402  (the tests' request, at full size)


@click.command()
@click.argument("url")
@click.option("--system-chars", default=22_000, show_default=True, help="Size of the system prompt.")
@click.option("--schema-chars", default=15_000, show_default=True, help="Size of the six tools' schemas.")
def main(url: str, system_chars: int, schema_chars: int) -> None:
    body = coding_agent_request(system_chars, schema_chars)
    start, first, deltas, calls, finish, usage = time.perf_counter(), None, 0, 0, [], None
    with httpx.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    first = first if first is not None else time.perf_counter() - start
                    deltas += 1
                    calls += bool(delta.get("tool_calls"))
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
    took = time.perf_counter() - start
    after = usage["completion_tokens"] / (took - first) if usage and first is not None and took > first else None
    print(json.dumps({"first_delta_s": round(first, 3) if first is not None else None, "seconds": round(took, 2),
                      "deltas": deltas, "tool_call_deltas": calls, "finish": finish, "usage": usage,
                      "tok_s_after_first": round(after, 1) if after else None}))


if __name__ == "__main__":
    main()
