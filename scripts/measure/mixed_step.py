"""A mixed step against the steps it replaces: one sequence's T tokens (a draft to verify, a
prompt's next few) beside k − 1 other sequences' one token each, in one step (Batch.step), or as
that sequence's own step of T tokens (decode_tokens) and the others' batched step, one after the
other. Prints one JSON line per (k, T) with the median ms of each. Run on the GPU machine
(docs/PERF.md)."""

from __future__ import annotations

import json
import time

import click
import numpy as np

from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.batch import Batch
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.runtime import open_device


def ms_a_step(dev, fresh, steps: int, step) -> float:
    """The ms of `steps` runs of step(), each run of them after fresh() (new prompts): the median
    of two, after one that records and warms up."""
    times = []
    for _ in range(3):
        fresh()
        dev.wait_idle()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append(1e3 * (time.perf_counter() - start) / steps)
    return round(float(np.median(times[1:])), 3)


@click.command()
@click.argument("model")
@click.option("--device", default=None)
@click.option("--ctx", "n_ctx", type=int, default=1024)
@click.option("--prompt", "prompt_len", type=int, default=32)
@click.option("--streams", "stream_counts", default="2,4,8")
@click.option("--tokens", "token_counts", default="2,4")
@click.option("--steps", type=int, default=32)
def main(model, device, n_ctx, prompt_len, stream_counts, token_counts, steps):
    m, dev = open_model(model), open_device(device)
    ks, ts = [int(k) for k in stream_counts.split(",")], [int(t) for t in token_counts.split(",")]
    sampler, most = SamplerConfig(temperature=0), max(ts)
    make = lambda **kw: DecodeGraph(m, dev, n_ctx, sampler, progress=False, step_tokens=most, **kw)
    first = make()
    graphs = [first] + [make(weights_of=first) for _ in range(max(ks) - 1)]
    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(0, m.hparams.vocab, n).tolist()
    try:
        for k in ks:
            batch = Batch(graphs[:k], rows=k - 1 + most)
            for t in ts:
                fresh = lambda: [g.reset() or g.prefill(tokens(prompt_len)) for g in graphs[:k]]
                mixed = ms_a_step(dev, fresh, steps,
                                  lambda: batch.step([(graphs[0], tokens(t))] + [(g, tokens(1)) for g in graphs[1:k]]))
                apart = ms_a_step(dev, fresh, steps, lambda: (graphs[0].decode_tokens(tokens(t)),
                                                              batch.decode(graphs[1:k], 1, tokens=tokens(k - 1))))
                print(json.dumps({"streams": k, "tokens": t, "mixed_ms": mixed, "apart_ms": apart,
                                  "device": dev.info.name}), flush=True)
            batch.close()
    finally:
        for g in reversed(graphs):
            g.close()
        dev.close()


if __name__ == "__main__":
    main()
