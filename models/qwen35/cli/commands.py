"""`zdsl model ...`: inspect GGUF files and write synthetic Qwen3.5 ones."""

from __future__ import annotations

import json

import click

from ..file.synth import PRESETS, QUANTS

GIB = 1 << 30


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@click.group()
def model():
    """Inspect GGUF models and make synthetic ones."""


@model.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option("--layers", type=int, default=None, help="Trunk layers (default: the preset's).")
@click.option("--vocab", default=None, metavar="N|qwen35|qwen3",
              help="Vocabulary size (default: the preset's); qwen35 = 248,320 and qwen3 = 151,936 tokens, as real files.")
@click.option("--quant", type=click.Choice(QUANTS), default="q4_k_m", show_default=True,
              help="Type mix: q4_k_m mixes Q4_K/Q5_K/Q6_K/Q8_0 like llama.cpp; iq3_xxs_dynamic has the FFN's "
                   "(routed experts' or dense) gate and up IQ3_XXS, its down IQ4_XS; iq2_xxs_dynamic the FFN's gate "
                   "and up IQ2_XXS, its down and the projections IQ3_XXS; mxfp4_moe, iq3_s_moe, iq2_xs_moe, "
                   "iq2_s_moe, iq1_s_moe and iq1_m_moe the FFN in that type (the "
                   "low-bit mixes keep the rest, the shared expert too, at Q8_0); others are uniform.")
@click.option("--shared-ffn", type=int, default=None, metavar="N",
              help="The shared expert's width (default: the preset's, the routed experts' width).")
@click.option("--hidden", type=int, default=None, metavar="N",
              help="The hidden width (default: the preset's); with --vocab qwen35 and --tensor-type '^output=f32', "
                   "--hidden 512 makes a 485 MiB head, more than many devices bind in one buffer.")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="REGEX=TYPE",
              help="Give the matrices whose names match REGEX this type (as llama-quantize's --tensor-type; "
                   "repeatable, the first match wins), e.g. ffn_up_exps=q5_k.")
@click.option("--mtp", is_flag=True, help="With the MTP head (multi-token prediction: drafts for --spec mtp), "
                                          "one more block after the trunk's, as converters graft it in.")
@click.option("--mtp-file", type=click.Path(dir_okay=False), default=None,
              help="The MTP head in a file of its own instead (an mtp-*.gguf, for --draft-model).")
@click.option("--seed", type=int, default=0, show_default=True)
def synth(out, preset, layers, vocab, quant, shared_ffn, hidden, tensor_types, mtp, mtp_file, seed):
    """Write a random-weight model with the real tensor names, shapes and types."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from ..file.synth import tensor_type_option, write

    overrides = dict(tensor_type_option(t) for t in tensor_types)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(f"writing {out}", total=None)
        hp = write(out, preset, layers=layers, vocab=_vocab_size(vocab), shared_ffn=shared_ffn, hidden=hidden,
                   quant=quant, tensor_types=overrides, seed=seed, mtp=mtp, mtp_file=mtp_file,
                   progress=lambda done, total: bar.update(task, completed=done, total=total))
    head = f", its MTP head in {mtp_file}" if mtp_file else " + MTP head" if mtp else ""
    click.echo(f"wrote {out}: {hp.arch} preset {preset}, {hp.n_layers} layers{head}, "
               f"hidden {hp.hidden}, vocab {hp.vocab}, {quant}")


def _vocab_size(text: str | None) -> int | None:
    from zdsl.errors import ZdslError

    from ..file.synth import REAL_VOCABS

    if text is None:
        return None
    if text.lower() in REAL_VOCABS:
        return REAL_VOCABS[text.lower()]
    try:
        return int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise ZdslError(f"--vocab '{text}': give a number of tokens or one of {', '.join(REAL_VOCABS)}") from None


@model.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--vram", default=None, metavar="SIZE",
              help="Card memory (e.g. 32GiB, 24GB, 512MiB; a bare number is GiB): the longest context each KV cache "
                   "format allows beside the weights and the other buffers [default: --device's free memory].")
@click.option("--device", default=None, help="Index, name substring or alias (zdsl devices) whose free memory to plan for.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def info(path, vram, device, as_json):
    """Architecture, type mix and what zdsl can run of any GGUF file; for a Qwen3.5 model also
    hyperparameters, bytes read per token, KV and state sizes, and the context that fits a card."""
    from ..file.describe import NO_KERNEL, describe

    d = describe(path)
    memory = parse_size(vram) if vram is not None else _free_memory(device) if device is not None else None
    if as_json:
        click.echo(json.dumps(_as_json(d, memory), indent=1, ensure_ascii=False))
        return
    from zdsl.console import Table, make_console

    t = Table(title=str(d.path), show_header=False)
    for k, v in [("architecture", d.arch), ("zdsl", d.verdict), *_model_rows(d, memory),
                 *([] if d.hparams else [(k, str(v)) for k, v in d.metadata.items()]),
                 ("tensors", f"{d.tensor_count:,}, {_size(sum(s.bytes for s in d.types))}")]:
        t.add_row(k, v)
    types = Table(title="tensor types")
    for col in ("type", "tensors", "bytes", "GPU kernel"):
        types.add_column(col, justify="right" if col in ("tensors", "bytes") else "left")
    for s in d.types:
        types.add_row(s.name, f"{s.tensors:,}", _size(s.bytes), "yes" if s.gpu_kernel else NO_KERNEL)
    families = Table(title="tensor families")
    for col in ("family", "types"):
        families.add_column(col)
    for name, mix in d.families.items():
        families.add_row(name, ", ".join(k if len(mix) == 1 else f"{k} × {n}" for k, n in mix.items()))
    con = make_console()
    con.print(t)
    con.print(types)
    con.print(families)
    if d.no_kernel:
        shown = ", ".join(d.no_kernel[:SHOWN]) + (f" and {len(d.no_kernel) - SHOWN:,} more (--json lists them all)"
                                                  if len(d.no_kernel) > SHOWN else "")
        con.print(f"{d.no_kernel_summary}: {shown}", markup=False, highlight=False)


SHOWN = 8  # tensors named in the table output's list of those without a GPU kernel


def parse_size(text: str) -> int:
    """Bytes of a size such as 32GiB, 24GB, 512MiB or 32 (GiB)."""
    from zdsl.errors import ZdslError

    units = {"": GIB, "gib": GIB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "tib": 1 << 40, "tb": 10**12}
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ZdslError(f"--vram '{text}': give a size such as 32GiB, 24GB or 512MiB")
    return int(value * units[unit])


def _free_memory(selector: str) -> int:
    from zdsl.runtime import open_device

    dev = open_device(selector)
    try:
        return dev.memory_available()
    finally:
        dev.close()


def _contexts(d, memory: int) -> dict[str, int]:
    """The longest context each KV format allows in `memory` bytes: from the buffers a run
    allocates (buffers.py) where zdsl runs the file, else beside the weights and state alone."""
    from zdsl.kernels.kvcache import kv_types

    from ..file.info import SHOWN_KV_TYPES

    if not d.runnable:
        return {f: d.plan.max_context(memory, f) for f in SHOWN_KV_TYPES}
    from ..file.gguf_file import open_model
    from ..model.buffers import largest_context
    from ..model.weights import graph_weights

    tensors = graph_weights(open_model(d.path))
    return {f: largest_context(d.hparams, tensors, memory, kv_types(f)) for f in SHOWN_KV_TYPES}


def _model_rows(d, memory: int | None) -> list[tuple[str, str]]:
    """Hyperparameters, and the memory plan when the file holds every tensor the model needs."""
    from ..file.info import SHOWN_KV_TYPES

    hp, plan = d.hparams, d.plan
    if hp is None:
        return []
    kinds = "".join("A" if a else "D" for a in hp.attention)
    rows = [
        ("layers", f"{hp.n_layers} ({len(hp.attention_layers)} attention, {len(hp.deltanet_layers)} delta-net: "
                   f"{kinds})" + (f" + {hp.nextn_layers} MTP" if hp.nextn_layers else "")),
        ("hidden / vocab / context", f"{hp.hidden} / {hp.vocab:,} / {hp.context_length:,}"),
        ("attention", f"{hp.n_heads} heads, {hp.n_kv_heads} KV heads, head dim {hp.head_dim}, "
                      f"RoPE {hp.rope_dims} dims base {hp.rope_base:g}"),
        ("delta-net", f"{hp.ssm_k_heads} key heads, {hp.ssm_v_heads} value heads, dim {hp.ssm_head_dim}, "
                      f"conv {hp.conv_kernel}"),
        ("ffn", f"{hp.n_experts} experts, {hp.n_experts_used} used, expert ffn {hp.expert_ffn}, "
                f"shared ffn {hp.shared_ffn}" if hp.moe else f"dense SwiGLU {hp.ffn}"),
        ("norm eps", f"{hp.eps:g}"),
    ]
    if plan is None:
        return rows
    rows += [
        ("weights", _size(plan.weight_bytes)),
        ("weights read per token", _size(plan.read_per_token)),
        ("recurrent state / sequence", f"{_size(plan.recurrent_state_bytes)} "
                                       f"(S {_size(plan.ssm_state_bytes)} + conv {_size(plan.conv_state_bytes)}, f32)"),
        *((f"KV per token, {f}", _size(plan.kv_bytes_per_token[f])) for f in SHOWN_KV_TYPES),
    ]
    if hp.nextn_layers:
        rows.append(("MTP head", f"block {hp.n_layers}: gated attention + {'MoE' if hp.moe else 'dense FFN'}, "
                                 f"{_size(plan.mtp_bytes)}, {_size(plan.mtp_read_per_draft)} read per draft (--spec mtp)"
                     if plan.mtp_bytes else "counted in the metadata, not in the file"))
    if memory is not None:
        rows += [(f"context in {_size(memory)}, KV {f}", f"{n:,} tokens") for f, n in _contexts(d, memory).items()]
    return rows


def _as_json(d, memory: int | None) -> dict:
    from dataclasses import asdict

    plan = None
    if d.plan is not None:
        p = d.plan
        plan = {"weight_bytes": p.weight_bytes, "bytes_by_type": p.bytes_by_type, "read_per_token": p.read_per_token,
                "expert_bytes": p.expert_bytes, "kv_bytes_per_token": p.kv_bytes_per_token,
                "ssm_state_bytes": p.ssm_state_bytes, "conv_state_bytes": p.conv_state_bytes}
        if memory is not None:
            plan["memory_bytes"], plan["max_context"] = memory, _contexts(d, memory)
    return {"path": str(d.path), "architecture": d.arch, "runnable": d.runnable, "problem": d.problem,
            "metadata": d.metadata, "hparams": asdict(d.hparams) if d.hparams else None, "plan": plan,
            "types": [asdict(s) for s in d.types], "families": d.families, "no_gpu_kernel": d.no_kernel}
