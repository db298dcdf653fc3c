"""Decode speed and first token with a JSON schema active against plain decode, through `zdsl
serve`'s engine without HTTP (one slot, greedy, random prompt ids of --prompt tokens).

Plain: --tokens tokens past stop tokens, in the engine's bursts. Constrained: the same count
under a schema whose one string is longer than that (so every step has a choice among many
tokens, as a long structured answer): each step's mask is computed by llguidance on the host
and written before the step, and the GPU sampler draws under it (picker.Steer). Alternates
the two --repeats times and prints one JSON line per run. Run on the GPU machine (see
docs/PERF.md).
"""

from __future__ import annotations

import asyncio
import json
import time

import click
import numpy as np

from zdsl.kernels.kvcache import kv_types
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.serve.api import Job
from zdsl.models.qwen35.serve.grammar import check, json_lark
from zdsl.models.qwen35.serve.server import open_engine


async def run(engine, job: Job) -> tuple[float, float, int]:
    """(seconds to the first piece, seconds from it to the last, completion tokens)."""
    start = time.perf_counter()
    first = None
    async for p in engine.run(job):
        first = first or time.perf_counter()
    return first - start, time.perf_counter() - first, p.completion_tokens


@click.command()
@click.argument("model")
@click.option("--device", default=None)
@click.option("--ctx", "n_ctx", type=int, default=4096)
@click.option("--prompt", "prompt_len", type=int, default=512)
@click.option("--tokens", type=int, default=256)
@click.option("--repeats", type=int, default=3)
@click.option("--kv-type", "kv", default="f16")
def main(model, device, n_ctx, prompt_len, tokens, repeats, kv):
    engine, _ = open_engine(model, device, n_ctx=n_ctx, kv=kv_types(kv), checkpoint_mib=0)
    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 8 * tokens,
                                                        "maxLength": 8 * tokens}}, "required": ["text"]}
    lark = "start: " + json_lark(schema)
    check(lark, tok, engine.stop_ids)  # the engine's tokenizer view, made once (~0.7 s at 248k tokens)
    rng = np.random.default_rng(0)

    def job(grammar: str | None) -> Job:
        ids = rng.integers(0, tok.vocab_size, prompt_len).tolist()
        return Job(ids, tokens, SamplerConfig(temperature=0), [], True, True, ignore_eos=grammar is None,
                   grammar=grammar)

    async def measure():
        await run(engine, job(None))  # first uses: steps recorded, pipelines made
        await run(engine, job(lark))
        for r in range(repeats):
            for name, grammar in (("plain", None), ("json_schema", lark)):
                ttft, decode_s, n = await run(engine, job(grammar))
                print(json.dumps({"what": name, "repeat": r, "prompt": prompt_len, "tokens": n,
                                  "ttft_s": round(ttft, 4), "decode_tok_s": round((n - 1) / decode_s, 1)}),
                      flush=True)

    try:
        asyncio.run(measure())
    finally:
        engine.close()


if __name__ == "__main__":
    main()
