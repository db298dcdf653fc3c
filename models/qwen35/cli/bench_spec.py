"""`zdsl bench --spec`: speculative decoding's speed, end to end, against plain decoding of the
same prompt in the same run.

Each measurement is a greedy generation (model/generate.py) of --tokens tokens after a prompt of
--prompt tokens, timed from the first new token on, so that its tok/s is what a user sees. With
--accept, drafts of a chosen acceptance (drafts.ChosenDrafts): the reference continuation is the
plain run's own output, each draft of it replaced by a wrong token with probability 1 − a, which
measures what a drafter right that often would give where real drafts cannot be judged
(synthetic weights); with --spec mtp the head drafts all the same (its time counts) and its
drafts are replaced. Without --accept, the drafter of --spec (ngram: on a prompt that repeats a
stretch of tokens, what prompt lookup is for). Every run's tokens are compared with plain
decoding's.
"""

from __future__ import annotations

import numpy as np

from zdsl.errors import ZdslError

REPEATED = 64  # the stretch of tokens the n-gram prompt repeats


def parse_accepts(text: str) -> list[float]:
    try:
        accepts = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        accepts = []
    if not accepts or not all(0 <= a <= 1 for a in accepts):
        raise ZdslError(f"--accept '{text}': give comma-separated acceptances from 0 to 1, e.g. 0.5,0.7,0.9")
    return accepts


def parse_draft_max(text: str) -> list[int]:
    """'3', '1,2,4' or a range '1..4'."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            sizes = list(range(lo, hi + 1))
        else:
            sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or sizes[-1] > 15:
        raise ZdslError(f"--draft-max '{text}': give draft counts from 1 to 15, e.g. 3, 1,2,4 or 1..4")
    return sizes


def bench_prompt(vocab: int, n: int, repeats: bool) -> list[int]:
    rng = np.random.default_rng(0)
    if not repeats:
        return rng.integers(0, vocab, n).tolist()
    return (rng.integers(0, vocab, REPEATED).tolist() * (n // REPEATED + 1))[:n]


def generation(gen, prompt: list[int], tokens: int) -> tuple[list[int], float, object]:
    """The tokens, the decode tok/s and the speculation's stats of one greedy generation."""
    out = list(gen.generate(prompt, tokens, stop=False))
    return out, gen.timings.decode_tps, gen.timings.spec


def measure_speculation(gen, mode: str, accepts: list[float], draft_maxes: list[int], prompt_len: int, tokens: int,
                        repeats: int, say) -> dict:
    """Plain decoding's tok/s, then one row per (acceptance, draft max): its acceptance, tokens per
    step, tok/s (medians over repeats, after an untimed run) and whether its tokens were plain
    decoding's. `gen` is greedy, with steps of at least max(draft_maxes) + 1 tokens."""
    from zdsl.models.qwen35.cli.bench import summary
    from zdsl.models.qwen35.model.drafts import ChosenDrafts
    from zdsl.models.qwen35.model.speculate import Speculation, mtp_drafts, speculation

    vocab = gen.model.hparams.vocab
    prompt = bench_prompt(vocab, prompt_len, repeats=mode == "ngram" and not accepts)
    gen.speculate = None
    say(f"speculation: plain decoding of {tokens} tokens after {prompt_len}, then {mode} drafts, {repeats} runs each")
    reference = generation(gen, prompt, tokens)[0]
    plain = summary([generation(gen, prompt, tokens)[1] for _ in range(repeats)])
    rows = []
    for a in accepts or [None]:
        for k in draft_maxes:
            if a is None:
                gen.speculate = speculation(mode, k, gen.graph.sampler)
            else:
                def chosen(p, head, a=a, seed=len(rows)):
                    costs = mtp_drafts(p, head) if mode == "mtp" else None  # the head runs: its time counts
                    return ChosenDrafts(reference, len(p), a, vocab, seed=seed, costs=costs)
                gen.speculate = Speculation(chosen, k, f"chosen {a:g}", mtp=mode == "mtp")
            generation(gen, prompt, tokens)
            runs = [generation(gen, prompt, tokens) for _ in range(repeats)]
            tps = summary([r[1] for r in runs])
            stats = [r[2] for r in runs]
            rows.append({"accept": a, "draft_max": k, "tok_per_s": tps,
                         "acceptance": float(np.median([s.acceptance for s in stats])),
                         "tokens_per_step": float(np.median([s.tokens_per_step for s in stats])),
                         "vs_plain": tps["median"] / plain["median"],
                         "same_as_plain": all(r[0] == reference for r in runs)})
    gen.speculate = None
    return {"mode": f"{mode}, drafts of chosen acceptance" if accepts else mode,
            "prompt": f"repeats a stretch of {REPEATED} tokens" if mode == "ngram" and not accepts else "random",
            "plain_tok_per_s": plain, "rows": rows}


def speculation_table(r: dict):
    from zdsl.console import Table

    s = r["speculation"]
    t = Table(title=f"speculative decoding ({s['mode']}), plain decoding {s['plain_tok_per_s']['median']:,.1f} tok/s")
    for col in ("accept", "draft max", "acceptance", "tokens/step", "tok/s", "× plain", "tokens as plain"):
        t.add_column(col, justify="right")
    for row in s["rows"]:
        t.add_row("" if row["accept"] is None else f"{row['accept']:g}", str(row["draft_max"]),
                  f"{100 * row['acceptance']:.0f}%", f"{row['tokens_per_step']:.2f}",
                  f"{row['tok_per_s']['median']:,.1f} ± {row['tok_per_s']['stdev']:,.1f}", f"{row['vs_plain']:.2f}",
                  "yes" if row["same_as_plain"] else "NO")
    return t


def speculation_markdown(r: dict) -> str:
    s = r["speculation"]
    lines = ["", f"Speculative decoding ({s['mode']}; prompt {s['prompt']}): greedy, decode tok/s from the first new "
             f"token; plain decoding {s['plain_tok_per_s']['median']:,.1f} tok/s in the same run.", "",
             "| accept | draft max | acceptance | tokens/step | tok/s | × plain | tokens as plain |",
             "|---|---|---|---|---|---|---|"]
    for row in s["rows"]:
        lines.append(f"| {'' if row['accept'] is None else format(row['accept'], 'g')} | {row['draft_max']} | "
                     f"{100 * row['acceptance']:.0f}% | {row['tokens_per_step']:.2f} | "
                     f"{row['tok_per_s']['median']:,.1f} ± {row['tok_per_s']['stdev']:,.1f} | {row['vs_plain']:.2f} | "
                     f"{'yes' if row['same_as_plain'] else 'NO'} |")
    return "\n".join(lines) + "\n"
