"""Time to first token and aggregate decode speed of `zdsl serve`'s engine, without HTTP.

Cold: a prompt of --prompt random token ids into an empty slot. Cached: the same prompt's first
--shared tokens, then new ones: the slot resumes from its last checkpoint at or before --shared.
Streams: k jobs of --tokens each (past stop tokens, as llama-server's ignore_eos) submitted at
once to --parallel slots, greedy or (--temperature) sampled with a seed of their own each, as API
requests without one; aggregate tok/s = the tokens of all / wall time, with each stream's time to
its first token. Prints one JSON line per measurement. Run on the GPU machine (see docs/PERF.md).
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
from zdsl.models.qwen35.serve.server import open_engine


def job(ids: list[int], tokens: int, temperature: float) -> Job:
    """Greedy, or sampled with a seed of its own as an API request without one (sampler_of)."""
    sampler = SamplerConfig(temperature=0) if not temperature else SamplerConfig(
        temperature=temperature, seed=int(np.random.default_rng().integers(2 ** 32)))
    return Job(ids, tokens, sampler, [], True, True, ignore_eos=True)  # each stream its --tokens


async def first_token(engine, ids: list[int], tokens: int, temperature: float) -> tuple[float, float, int]:
    """(seconds to the first piece, seconds to the last, the last piece: its usage counts)."""
    start = time.perf_counter()
    first = None
    async for p in engine.run(job(ids, tokens, temperature)):
        first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, p


async def streams(engine, k: int, length: int, tokens: int, rng, temperature: float) -> tuple[float, list[float]]:
    """(aggregate tok/s, each stream's seconds to its first piece)."""
    start = time.perf_counter()
    prompts = [rng.integers(0, engine.tokenizer.vocab_size, length).tolist() for _ in range(k)]

    async def one(ids) -> tuple[int, float]:
        first = None
        async for p in engine.run(job(ids, tokens, temperature)):
            first = first or time.perf_counter() - start
        return p.completion_tokens, first

    done = await asyncio.gather(*(one(ids) for ids in prompts))
    return sum(n for n, _ in done) / (time.perf_counter() - start), [t for _, t in done]


@click.command()
@click.argument("model")
@click.option("--device", default=None)
@click.option("--ctx", "n_ctx", type=int, default=8192)
@click.option("--prompt", "prompt_len", type=int, default=4096)
@click.option("--shared", type=int, default=3900)
@click.option("--tokens", type=int, default=64)
@click.option("--streams", "stream_counts", default="1,2,4,8")
@click.option("--kv-type", "kv", default="f16")
@click.option("--parallel", type=int, default=1, help="Slots (zdsl serve --parallel).")
@click.option("--temperature", type=float, default=0.0, help="Sample, each request with a seed of its own.")
def main(model, device, n_ctx, prompt_len, shared, tokens, stream_counts, kv, parallel, temperature):
    engine, _ = open_engine(model, device, n_ctx=n_ctx, kv=kv_types(kv), checkpoint_mib=1024, parallel=parallel)
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    base = rng.integers(0, vocab, prompt_len).tolist()
    other = base[:shared] + rng.integers(0, vocab, prompt_len - shared).tolist()

    async def measure():
        for name, ids in (("warm-up", rng.integers(0, vocab, min(600, n_ctx // 2)).tolist()), ("cold", base),
                          ("cached", other)):
            ttft, total, last = await first_token(engine, ids, tokens, temperature)
            print(json.dumps({"what": name, "prompt": len(ids), "cached": last.reused_tokens, "kv": kv,
                              "ttft_s": round(ttft, 4), "tokens": last.completion_tokens,
                              "decode_tok_s": round((last.completion_tokens - 1) / (total - ttft), 1)}), flush=True)
        await streams(engine, parallel, 32, 8, rng, temperature)  # every slot once: its first prompt records its steps
        for k in [int(s) for s in stream_counts.split(",") if s]:
            tps, firsts = await streams(engine, k, 32, tokens, rng, temperature)
            print(json.dumps({"what": "streams", "k": k, "slots": parallel, "tokens": tokens,
                              "aggregate_tok_s": round(tps, 1), "ttft_mean_s": round(sum(firsts) / k, 3),
                              "ttft_max_s": round(max(firsts), 3)}), flush=True)

    try:
        asyncio.run(measure())
    finally:
        engine.close()


if __name__ == "__main__":
    main()
