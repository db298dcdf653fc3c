"""`zdsl run` and `zdsl chat`: text generation from a GGUF file (or the embedded default)."""

from __future__ import annotations

import json
import sys

import click

from zdsl.models.qwen35.model.sampler import SamplerConfig


def kv_type_option(f):
    """--kv-type: the KV caches' formats (kernels/kvcache.py), as (K, V)."""
    from zdsl.kernels.kvcache import KV_FORMATS, kv_types

    return click.option("--kv-type", "kv", default="f16", show_default=True, callback=lambda ctx, param, v: kv_types(v),
                        help=f"KV cache format for K and V ({', '.join(KV_FORMATS)}), or K,V: e.g. q8_0 (both) or "
                             "q4_0,q8_0; q3_rot (3 bits after a Hadamard rotation) is experimental.")(f)


def sampler_options(f):
    for decorator in reversed([
        kv_type_option,
        click.option("--temp", "temperature", type=float, default=0.8, show_default=True, help="0 samples greedily."),
        click.option("--top-k", type=int, default=40, show_default=True),
        click.option("--top-p", type=float, default=0.95, show_default=True),
        click.option("--min-p", type=float, default=0.05, show_default=True, help="Applied before temperature."),
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                     help="Divides positive logits (multiplies negative ones) of tokens in the last --repeat-last-n."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
        click.option("--repeat-last-n", "last_n", type=int, default=64, show_default=True,
                     help="Context tokens the penalties look at, prompt included (-1: all, 0: none)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", "device", default=None, help="Index, name substring or alias (zdsl devices)."),
        click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True, help="Context length to allocate."),
    ]):
        f = decorator(f)
    return f


def spec_options(f):
    """--spec and --draft-max: speculative decoding (model/speculate.py)."""
    from zdsl.models.qwen35.model.speculate import DRAFT_MAX, SPEC_MODES

    f = click.option("--draft-max", type=int, default=None,
                     help=f"Most draft tokens checked in one step [default: {DRAFT_MAX}].")(f)
    f = click.option("--draft-model", type=click.Path(dir_okay=False), default=None,
                     help="The MTP head from a file of its own (an mtp-*.gguf beside a file without it).")(f)
    return click.option("--spec", type=click.Choice(SPEC_MODES), default="auto", show_default=True,
                        help="Speculative decoding: drafts checked in one step, the output plain decoding's token "
                             "for token. mtp: the file's MTP head drafts; ngram: what the prompt and reply already "
                             "hold (prompt lookup). auto: mtp where the file has a head, else none (n-gram drafts "
                             "pay only on text that repeats).")(f)


def make_sampler(o: dict) -> SamplerConfig:
    return SamplerConfig(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o["min_p"],
                         repeat_penalty=o["repeat_penalty"], presence_penalty=o["presence_penalty"],
                         frequency_penalty=o["frequency_penalty"], last_n=o["last_n"], seed=o["seed"])


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("run")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("-p", "--prompt", default="Hello, world.", show_default=True)
@click.option("-n", "n_predict", type=int, default=64, show_default=True, help="Tokens to generate.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--no-think", is_flag=True, help="With --chat: enable_thinking=False.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-sequence tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print token ids, text and timings as JSON.")
@sampler_options
@spec_options
def run(model, prompt, n_predict, chat, no_think, ignore_eos, as_json, spec, draft_max, draft_model, **opts):
    """Generate text. With no MODEL, a small synthetic model (generated on first use) shows the
    whole pipeline working."""
    from zdsl.errors import ZdslError
    from zdsl.models.qwen35.model.generate import load
    from zdsl.models.qwen35.model.speculate import speculation

    if n_predict < 1:
        raise ZdslError(f"-n must be at least 1, got {n_predict}")
    sampler = make_sampler(opts)
    gen = load(model, opts["device"], n_ctx=opts["n_ctx"], sampler=sampler, progress=not as_json, say=_say,
               kv=opts["kv"], speculate=speculation(spec, draft_max, sampler), draft_model=draft_model)
    tok = gen.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], enable_thinking=not no_think) if chat else prompt
    ids = tok.encode(text, parse_special=chat)
    if not as_json:
        _say(f"{gen.model.path.name} on {gen.device.info.name}, {len(ids)} prompt tokens")
    out: list[int] = []
    shown = ""
    for token in gen.generate(ids, n_predict, stop=not ignore_eos):
        out.append(token)
        if not as_json:
            now = tok.decode(out, skip_special=True)
            stable = now[:-1] if now.endswith("\ufffd") else now
            sys.stdout.write(stable[len(shown):])
            sys.stdout.flush()
            shown = stable
    t = gen.timings
    if as_json:
        click.echo(json.dumps({"model": str(gen.model.path), "device": gen.device.info.name, "prompt_ids": ids,
                               "token_ids": out, "text": tok.decode(out, skip_special=True), "timings": t.as_dict()}))
    else:
        sys.stdout.write("\n")
        _say(t.summary())
    gen.close()


@click.command("chat")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("-n", "n_predict", type=int, default=512, show_default=True, help="Most tokens per reply.")
@click.option("--no-think", is_flag=True, help="enable_thinking=False.")
@click.option("--system", default=None, help="A system message.")
@sampler_options
@spec_options
def chat(model, n_predict, no_think, system, spec, draft_max, draft_model, **opts):
    """Interactive chat with the model's template (an empty line or Ctrl-D ends it). The
    conversation stays in the caches: each turn feeds only its new tokens."""
    from zdsl.models.qwen35.model.generate import load
    from zdsl.models.qwen35.model.speculate import speculation

    sampler = make_sampler(opts)
    gen = load(model, opts["device"], n_ctx=opts["n_ctx"], sampler=sampler, say=_say, keep=True,
               kv=opts["kv"], speculate=speculation(spec, draft_max, sampler), draft_model=draft_model)
    tok = gen.tokenizer
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    _say(f"{gen.model.path.name} on {gen.device.info.name}; an empty line ends the chat")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        turn = messages + [{"role": "user", "content": line}]
        ids = tok.chat_ids(turn, enable_thinking=not no_think)
        if len(ids) >= gen.n_ctx and messages != start:
            _say(f"this turn would fill the context ({len(ids)} of {gen.n_ctx} tokens)")
            if not click.confirm("start a new conversation with this message?", default=True, err=True):
                continue
            messages, turn = list(start), list(start) + turn[-1:]
            ids = tok.chat_ids(turn, enable_thinking=not no_think)
        if len(ids) >= gen.n_ctx:
            _say(f"this message alone needs {len(ids)} tokens; the context holds {gen.n_ctx} (raise --ctx)")
            continue
        reply: list[int] = []
        shown = ""
        for token in gen.generate(ids, min(n_predict, gen.n_ctx - len(ids))):
            if token in gen.stop_ids:
                break
            reply.append(token)
            now = tok.decode(reply, skip_special=True)
            stable = now[:-1] if now.endswith("\ufffd") else now
            sys.stdout.write(stable[len(shown):])
            sys.stdout.flush()
            shown = stable
        sys.stdout.write("\n")
        _say(gen.timings.summary())
        messages = turn + [{"role": "assistant", "content": tok.decode(reply, skip_special=True), "ids": reply}]
    gen.close()
