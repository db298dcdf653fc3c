"""`zdsl eval kv`: what a quantized KV cache costs in quality, against the f16 cache.

The same token sequence goes through the decode graph once per KV format, one step a token (so
attention reads the cache as decode does); at every position the next-token distribution is
compared with f16's: the KL divergence KL(p_f16 ‖ p_format) in nats, and whether the most likely
token is the same (top-1 agreement). The tokens are drawn at random from the vocabulary (seeded):
the synthetic models have no language to follow, and a fixed draw makes runs comparable.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click
import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels.kvcache import KV_DEFAULT, KVTypes, kv_types

DEFAULT_TYPES = "q8_0;q4_0,q8_0;q4_0;q3_rot"  # the formats compared with f16 unless --kv-types names others


@dataclass
class Quality:
    kv_type: str
    mean_kl: float     # nats, over positions
    max_kl: float
    top1_agreement: float  # share of positions whose most likely next token is f16's


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(reference: np.ndarray, other: np.ndarray, kv_type: str) -> Quality:
    """Quality of logits `other` (positions, vocab) against `reference`."""
    lp, lq = log_softmax(reference), log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return Quality(kv_type, float(kl.mean()), float(kl.max()),
                   float((reference.argmax(axis=-1) == other.argmax(axis=-1)).mean()))


def next_token_logits(model, device, tokens: list[int], kv: KVTypes) -> np.ndarray:
    """(len(tokens), vocab): the logits after each token, fed one decode step at a time."""
    from zdsl.models.qwen35.model.graph import DecodeGraph
    from zdsl.models.qwen35.model.sampler import SamplerConfig

    graph = DecodeGraph(model, device, len(tokens), SamplerConfig(temperature=0), progress=False, chunk=1, kv=kv)
    try:
        out = []
        for t in tokens:
            graph.decode(t)
            out.append(graph.logits())
        return np.stack(out)
    finally:
        graph.close()


def kv_quality(model, device, tokens: list[int], formats: list[KVTypes]) -> list[Quality]:
    """Each KV format's quality against f16 on `tokens`."""
    reference = next_token_logits(model, device, tokens, KV_DEFAULT)
    return [compare(reference, next_token_logits(model, device, tokens, kv), ",".join(dict.fromkeys(kv)))
            for kv in formats]


@click.group("eval")
def eval_group():
    """Measure quality."""


@eval_group.command("kv")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--tokens", type=int, default=256, show_default=True, help="Length of the token sequence.")
@click.option("--kv-types", "types", default=DEFAULT_TYPES, show_default=True,
              help="The formats to compare with f16, separated by ';' (each as --kv-type spells it).")
@click.option("--seed", type=int, default=0, show_default=True, help="Of the random token sequence.")
@click.option("--device", default=None, help="Index, name substring or alias (zdsl devices).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def eval_kv(model, tokens, types, seed, device, as_json):
    """Mean KL divergence of the next-token distributions and top-1 agreement of each KV cache
    format against f16, over the same token sequence."""
    from zdsl.console import Table, make_console
    from zdsl.models.qwen35.file.gguf_file import open_model
    from zdsl.runtime import open_device

    if tokens < 1:
        raise ZdslError(f"--tokens must be at least 1, got {tokens}")
    formats = [kv_types(t) for t in types.split(";") if t.strip()]
    m = open_model(model)
    if tokens > m.hparams.context_length:
        raise ZdslError(f"--tokens {tokens} exceeds the model's trained context of {m.hparams.context_length}")
    ids = np.random.default_rng(seed).integers(0, m.hparams.vocab, tokens).tolist()
    dev = open_device(device)
    try:
        results = kv_quality(m, dev, ids, formats)
    finally:
        dev.close()
    if as_json:
        click.echo(json.dumps({"model": str(m.path), "tokens": tokens, "seed": seed,
                               "results": [asdict(r) for r in results]}, indent=1))
        return
    t = Table(title=f"{m.path.name}: {tokens} tokens against the f16 KV cache")
    for col in ("KV type", "mean KL (nats)", "max KL", "top-1 agreement"):
        t.add_column(col, justify="left" if col == "KV type" else "right")
    for r in results:
        t.add_row(r.kv_type, f"{r.mean_kl:.2e}", f"{r.max_kl:.2e}", f"{100 * r.top1_agreement:.1f}%")
    make_console().print(t)
