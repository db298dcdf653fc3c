"""Aggregate decode speed of k sequences stepping together (models/qwen35/model/batch.py), against one
sequence's own steps: k DecodeGraphs on one copy of the weights, each fed a --prompt-token
prompt, then --tokens steps of all k in bursts of 8. Prints one JSON line per k. Run on the GPU
machine (docs/PERF.md)."""

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


@click.command()
@click.argument("model")
@click.option("--device", default=None)
@click.option("--ctx", "n_ctx", type=int, default=1024)
@click.option("--prompt", "prompt_len", type=int, default=32)
@click.option("--tokens", type=int, default=64)
@click.option("--streams", "stream_counts", default="1,2,4,8")
@click.option("--repeats", type=int, default=3)
@click.option("--profile", is_flag=True, help="Then time one step of the most streams dispatch by dispatch.")
def main(model, device, n_ctx, prompt_len, tokens, stream_counts, repeats, profile):
    m, dev = open_model(model), open_device(device)
    counts = [int(k) for k in stream_counts.split(",")]
    sampler = SamplerConfig(temperature=0)
    first = DecodeGraph(m, dev, n_ctx, sampler, progress=False)
    graphs = [first] + [DecodeGraph(m, dev, n_ctx, sampler, progress=False, weights_of=first)
                        for _ in range(max(counts) - 1)]
    batch = Batch(graphs)
    rng = np.random.default_rng(0)
    burst = 8
    try:
        for k in counts:
            some = graphs[:k]
            rates = []
            for _ in range(repeats + 1):  # the first records the step and warms up
                for g in some:
                    g.reset()
                    g.prefill(rng.integers(0, m.hparams.vocab, prompt_len).tolist())
                    g.decode(int(rng.integers(0, m.hparams.vocab)))
                dev.wait_idle()
                start = time.perf_counter()
                for _ in range(tokens // burst):
                    batch.decode(some, burst)
                rates.append(k * (tokens // burst) * burst / (time.perf_counter() - start))
            alone = []
            g = graphs[0]
            for _ in range(repeats):
                g.reset()
                g.prefill(rng.integers(0, m.hparams.vocab, prompt_len).tolist())
                g.decode(int(rng.integers(0, m.hparams.vocab)))
                start = time.perf_counter()
                for _ in range(tokens // burst):
                    g.decode_burst(burst)
                alone.append((tokens // burst) * burst / (time.perf_counter() - start))
            print(json.dumps({"streams": k, "aggregate_tok_s": round(float(np.median(rates[1:])), 1),
                              "runs": [round(r, 1) for r in rates[1:]], "one_sequence_alone": round(float(np.median(alone)), 1),
                              "device": dev.info.name}), flush=True)
        if profile:
            by_kernel: dict[str, list[float]] = {}
            for label, ms in batch.profile(graphs[:max(counts)]):
                name = label.split(":")[-1].split("[")[0] if ":" in label else label.split(" ")[0]
                by_kernel.setdefault(name, []).append(ms)
            total = sum(sum(v) for v in by_kernel.values())
            print(json.dumps({"profile_streams": max(counts), "total_ms": round(total, 3),
                              "by_kernel": {k: [round(sum(v), 3), len(v)] for k, v in
                                            sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))}}), flush=True)
    finally:
        batch.close()
        for g in reversed(graphs):
            g.close()
        dev.close()


if __name__ == "__main__":
    main()
