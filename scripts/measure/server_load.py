"""Aggregate decode speed of an OpenAI-compatible server under k concurrent requests: `zdsl serve`
and llama-server measured by the same client, over HTTP. Each request is --prompt random token
ids to /v1/completions, greedy, --tokens tokens past stop tokens (ignore_eos, which both servers
take); aggregate tok/s = the tokens of all / the wall time from sending to the last reply (the
prompts' time included). One request warms up first. Prints one JSON line per k. With
--first-token N:S: the time to a reply of one token for an N-token prompt, cold, then for one
that shares its first S tokens (the server's prefix reuse), each against a fresh prompt. Run on
the GPU machine with the servers started (docs/PERF.md)."""

from __future__ import annotations

import asyncio
import json
import time

import click
import httpx
import numpy as np


async def first_token(url: str, n: int, shared: int, vocab: int) -> None:
    rng = np.random.default_rng(1)
    async with httpx.AsyncClient() as client:
        await one(client, url, rng.integers(0, vocab, 32).tolist(), 1)
        for _ in range(2):
            cold = rng.integers(0, vocab, n).tolist()
            warm = cold[:shared] + rng.integers(0, vocab, n - shared).tolist()
            times = {}
            for name, ids in (("cold", cold), ("cached", warm)):
                start = time.perf_counter()
                await one(client, url, ids, 1)
                times[name] = round(time.perf_counter() - start, 3)
            print(json.dumps({"server": url, "prompt": n, "shared": shared, "first_token_s": times}), flush=True)


async def one(client: httpx.AsyncClient, url: str, ids: list[int], tokens: int) -> int:
    r = await client.post(url + "/v1/completions", timeout=600,
                          json={"prompt": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def measure(url: str, counts: list[int], prompt: int, tokens: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    async with httpx.AsyncClient() as client:
        await one(client, url, rng.integers(0, vocab, prompt).tolist(), tokens)
        for k in counts:
            start = time.perf_counter()
            done = await asyncio.gather(*(one(client, url, rng.integers(0, vocab, prompt).tolist(), tokens)
                                          for _ in range(k)))
            wall = time.perf_counter() - start
            print(json.dumps({"server": url, "k": k, "aggregate_tok_s": round(sum(done) / wall, 1),
                              "tokens": sum(done), "wall_s": round(wall, 3)}), flush=True)


@click.command()
@click.argument("url")
@click.option("--streams", "stream_counts", default="1,2,4,8")
@click.option("--prompt", type=int, default=32, help="Prompt tokens of each request.")
@click.option("--tokens", type=int, default=256, help="Tokens each request generates.")
@click.option("--vocab", type=int, default=248320, help="Prompt ids are drawn below this.")
@click.option("--first-token", "first", default="", help="N:S — time to first token of an N-token prompt, "
              "cold and sharing S tokens (instead of the streams).")
def main(url, stream_counts, prompt, tokens, vocab, first):
    if first:
        n, shared = (int(v) for v in first.split(":"))
        asyncio.run(first_token(url.rstrip("/"), n, shared, vocab))
        return
    asyncio.run(measure(url.rstrip("/"), [int(k) for k in stream_counts.split(",")], prompt, tokens, vocab))


if __name__ == "__main__":
    main()
