"""Random-weight Qwen3.5 GGUF files with the real tensor names, shapes and quant-type mix.

They let tests, the GPU decode path and benchmarks run without downloading 20 GB. Weights
are scaled so every sub-block sees unit-RMS inputs and the head's logits have a spread of a
few units: activations stay finite and the argmax moves from position to position.
Files are written tensor by tensor, so the 35B-A3B preset holds only the few tensors (at most a
few hundred MB each) that its pool of writer processes has ready.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFWriter, TokenType

from zdsl.errors import ModelError
from zdsl.kernels.quant_numpy import SUPPORTED_QUANT, block_shape, dequantize, quantize, set_iq1_m_d_bits

from .gguf_file import Hparams, QuantType, TensorInfo, TensorSpec, row_bytes, tensor_specs

PRESETS: dict[str, Hparams] = {
    # MoE, 4 layers (3 delta-net + 1 attention), real head sizes, K-quant friendly widths.
    "tiny": Hparams(
        arch="qwen35moe", n_layers=4, nextn_layers=0, hidden=256, vocab=1024, context_length=4096,
        eps=1e-6, attention=(), n_heads=4, n_kv_heads=2, head_dim=256, rope_dims=64, rope_base=1e7,
        rope_sections=(11, 11, 10, 0), ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=128, conv_kernel=4,
        n_experts=16, n_experts_used=4, expert_ffn=256, shared_ffn=256),
    # The dense qwen35 variant of `tiny`: a SwiGLU FFN in place of the MoE.
    "tiny-dense": Hparams(
        arch="qwen35", n_layers=4, nextn_layers=0, hidden=256, vocab=1024, context_length=4096,
        eps=1e-6, attention=(), n_heads=4, n_kv_heads=2, head_dim=256, rope_dims=64, rope_base=1e7,
        rope_sections=(11, 11, 10, 0), ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=128, conv_kernel=4,
        ffn=768),
    # Big enough for kernels to see realistic widths, small enough to write in seconds.
    "small": Hparams(
        arch="qwen35moe", n_layers=8, nextn_layers=0, hidden=1024, vocab=8192, context_length=32768,
        eps=1e-6, attention=(), n_heads=8, n_kv_heads=2, head_dim=256, rope_dims=64, rope_base=1e7,
        rope_sections=(11, 11, 10, 0), ssm_k_heads=8, ssm_v_heads=16, ssm_head_dim=128, conv_kernel=4,
        n_experts=64, n_experts_used=8, expert_ffn=512, shared_ffn=512),
    # Qwen3.5/3.6-35B-A3B shapes exactly (without the MTP block).
    "35b-a3b": Hparams(
        arch="qwen35moe", n_layers=40, nextn_layers=0, hidden=2048, vocab=248320, context_length=262144,
        eps=1e-6, attention=(), n_heads=16, n_kv_heads=2, head_dim=256, rope_dims=64, rope_base=1e7,
        rope_sections=(11, 11, 10, 0), ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128, conv_kernel=4,
        n_experts=256, n_experts_used=8, expert_ffn=512, shared_ffn=512),
}
FULL_ATTENTION_INTERVAL = 4
# the FFN's matrices (routed experts', or a dense FFN's) in one type, every other matrix Q8_0: MXFP4
# as the gpt-oss-style MoE files have them, and each IQ type that the published mixes above lack
# (for timing their kernels)
FFN_MIXES = {"mxfp4_moe": QuantType.MXFP4, "iq3_s_moe": QuantType.IQ3_S, "iq2_xs_moe": QuantType.IQ2_XS,
             "iq2_s_moe": QuantType.IQ2_S, "iq1_s_moe": QuantType.IQ1_S, "iq1_m_moe": QuantType.IQ1_M}
QUANTS = ("q4_k_m", "iq3_xxs_dynamic", "iq2_xxs_dynamic", *FFN_MIXES, "q8_0", "f16", "f32")
SPECIAL_TOKENS = {  # text: GGUF token type (Qwen marks the think tags as plain added tokens)
    "<|endoftext|>": TokenType.CONTROL, "<|im_start|>": TokenType.CONTROL, "<|im_end|>": TokenType.CONTROL,
    "<think>": TokenType.USER_DEFINED, "</think>": TokenType.USER_DEFINED,
}
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# Distinct random rows per (shape, type) for tensors taller than this; rows beyond are drawn from
# that pool. Keeps the 35B preset's quantization work to seconds while every row stays a valid block.
POOL_ROWS = 8192

# Qwen3.5's chat format, written here: tools listed in the system turn, past calls as
# <tool_call> blocks, tool results as <tool_response> blocks in a user turn, the thinking of
# replies after the last user message kept, and a generation prompt that opens <think>.
CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{%- if tools -%}
<|im_start|>system
# Tools

You may call these functions:
<tools>
{% for tool in tools -%}
{{ tool | tojson }}
{% endfor -%}
</tools>

To call one, answer with nothing else but:
<tool_call>
<function=NAME>
<parameter=ARGUMENT>
value
</parameter>
</function>
</tool_call>
{%- if system %}


{{ system }}
{%- endif %}<|im_end|>
{% elif system -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- set last = namespace(user=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
{%- set content = message.content or '' -%}
{%- set reasoning = message.reasoning_content or '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{%- set content = content.strip() -%}
<|im_start|>assistant
{% if loop.index0 > last.user -%}
<think>
{{ reasoning.strip() }}
</think>

{% endif -%}
{{ content }}
{%- for call in message.tool_calls or [] -%}
{%- if content or not loop.first %}

{% endif -%}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments.items() -%}
<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor -%}
</function>
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
<|im_start|>user
{%- endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
<|im_end|>
{% endif -%}
{% elif message.role != 'system' or not loop.first -%}
{{ raise_exception('unsupported role: ' ~ message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking -%}
<think>

</think>

{% else -%}
<think>
{% endif -%}
{%- endif -%}
"""


# Vocabulary sizes of the real tokenizers: Qwen3.5's, and Qwen3's (llama.cpp's test vocabulary).
REAL_VOCABS = {"qwen35": 248320, "qwen3": 151936}


def preset(name: str, layers: int | None = None, vocab: int | None = None, shared_ffn: int | None = None,
           hidden: int | None = None) -> Hparams:
    """A preset's hyperparameters, with layer kinds filled in (every 4th layer is attention) and
    optionally another vocabulary size (real ones have more output rows than many devices launch
    workgroups along one axis), another shared-expert width (some files' is wider than the
    routed experts') or another hidden width (with a real vocabulary, an F32 head larger than
    many devices bind in one buffer)."""
    if name not in PRESETS:
        raise ModelError(f"unknown preset '{name}'; choose one of {', '.join(PRESETS)}")
    hp = PRESETS[name]
    n = hp.n_layers if layers is None else layers
    if n < 1:
        raise ModelError(f"--layers must be at least 1, got {n}")
    if vocab is not None and vocab < MIN_VOCAB:
        raise ModelError(f"--vocab must be at least {MIN_VOCAB} (256 bytes and the special tokens), got {vocab}")
    if shared_ffn is not None and not hp.moe:
        raise ModelError(f"--shared-ffn: preset '{name}' is dense; it has no shared expert")
    if shared_ffn is not None and shared_ffn < 1:
        raise ModelError(f"--shared-ffn must be at least 1, got {shared_ffn}")
    if hidden is not None and (hidden < 32 or hidden % 32):
        raise ModelError(f"--hidden must be a positive multiple of 32 (zdsl's Q8_1 activations), got {hidden}")
    return replace(hp, n_layers=n, attention=tuple((i + 1) % FULL_ATTENTION_INTERVAL == 0 for i in range(n)),
                   vocab=hp.vocab if vocab is None else vocab,
                   shared_ffn=hp.shared_ffn if shared_ffn is None else shared_ffn,
                   hidden=hp.hidden if hidden is None else hidden)


DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _kept_high(name: str) -> QuantType:
    """What the low-bit mixes keep at more bits: the head Q6_K, the embedding Q4_K, the rest Q8_0."""
    return {"output.weight": QuantType.Q6_K, "token_embd.weight": QuantType.Q4_K}.get(name, QuantType.Q8_0)


def tensor_type(name: str, spec: TensorSpec, quant: str, layer: int, n_layers: int) -> QuantType:
    """The type a llama.cpp-style quantizer would pick for this tensor."""
    if spec.vector or name.endswith("ssm_conv1d.weight") or name.endswith("ffn_gate_inp.weight"):
        return QuantType.F32
    if quant in FFN_MIXES:  # the routed experts (a dense FFN) in one type, every other matrix (the shared expert's too) Q8_0
        return FFN_MIXES[quant] if name.endswith(("_exps.weight", *DENSE_FFN)) else QuantType.Q8_0
    if quant == "iq3_xxs_dynamic":
        # The popular "dynamic" files' shape: the routed experts' (a dense FFN's) gate and up at
        # 3 bits, their down a step higher, and the few small matrices every token reads
        # (attention, delta-net, the shared expert) kept at Q8_0 beside them.
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", *DENSE_FFN[:2])):
            return QuantType.IQ3_XXS
        if name.endswith(("ffn_down_exps.weight", DENSE_FFN[2])):
            return QuantType.IQ4_XS
        return _kept_high(name)
    if quant == "iq2_xxs_dynamic":
        # The 2-bit files' shape: the FFN's gate and up (routed or dense) at 2 bits, its down and
        # the attention and delta-net projections IQ3_XXS (as the dense Qwen3.5 files have
        # them), the shared expert and the delta-net's gates Q8_0.
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", *DENSE_FFN[:2])):
            return QuantType.IQ2_XXS
        if name.endswith(("ffn_down_exps.weight", DENSE_FFN[2], "attn_qkv.weight", "attn_gate.weight",
                          "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ssm_out.weight")):
            return QuantType.IQ3_XXS
        return _kept_high(name)
    if quant != "q4_k_m":
        return {"q8_0": QuantType.Q8_0, "f16": QuantType.F16, "f32": QuantType.F32}[quant]
    # Q4_K_M: more bits for V, shared-expert down, the head, delta-net qkv, and ffn_down on
    # the first/last eighth and every third layer in between (llama.cpp's "use more bits").
    more_bits = layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
    if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down_shexp.weight")):
        return QuantType.Q6_K
    if name.endswith("ffn_down_exps.weight") or name.endswith("ffn_down.weight"):
        return QuantType.Q6_K if more_bits else QuantType.Q4_K
    if name.endswith("attn_qkv.weight"):
        return QuantType.Q5_K
    if name.endswith(("ssm_alpha.weight", "ssm_beta.weight")):
        return QuantType.Q8_0
    return QuantType.Q4_K


def _values(name: str, shape: tuple[int, ...], hp: Hparams, rng: np.random.Generator) -> np.ndarray | float:
    """Float values for small tensors, or the std of a Gaussian weight matrix."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(0.0, np.log(16.0), shape))              # -exp(A_log), A in [1, 16]
    if name.endswith("ssm_dt.bias"):
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        return np.log(np.expm1(dt))                                        # softplus^-1(dt)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)                      # "+1" already folded in
    if name.endswith("ssm_conv1d.weight"):
        return 0.5 * rng.standard_normal(shape)
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return rng.standard_normal(shape) / np.sqrt(shape[-1])
    if name == "output.weight":
        return 3.0 / np.sqrt(shape[-1])                                    # logits std ~3
    if name == "token_embd.weight":
        return 1.0
    return 1.0 / np.sqrt(shape[-1])                                        # unit-RMS outputs


# Files at least this large are written by a pool of processes (one tensor per task, written in
# order); smaller ones in this process, where a pool would cost more than it saves.
PARALLEL_BYTES = 256 << 20
_pools: dict[tuple, np.ndarray] = {}  # per process: quantized rows by (seed, width, type, std)


# Block types whose f16 scale d is the first two bytes, all other bytes free; IQ1_M's d is spread
# over the top nibbles of its four scale words (quant_numpy.set_iq1_m_d_bits).
SCALE_FIRST = frozenset(QuantType[t] for t in ("Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS",
                                                        "IQ2_XS", "IQ2_S", "IQ1_S"))
RANDOM_BLOCKS = SCALE_FIRST | {QuantType.IQ1_M}  # the types without encoder written as scaled random blocks


def random_rows(std: float, n: int, width: int, qtype: QuantType, rng: np.random.Generator) -> np.ndarray:
    """n rows of `width` weights of about this std in `qtype`: Gaussian values quantized where
    zdsl has the type's encoder; otherwise (Q4_0, Q5_0 and the IQ types) random blocks whose f16
    scale d is set so that each block's values have that RMS: valid blocks in the type's real
    layout, as a file's would be, which is all a random-weight model needs."""
    if qtype in SUPPORTED_QUANT:
        return quantize(std * rng.standard_normal((n, width), dtype=np.float32), qtype)
    if qtype not in RANDOM_BLOCKS:
        raise ModelError(f"zdsl model synth cannot write {qtype.name} weights")
    block, nbytes = block_shape(qtype)
    blocks = rng.integers(0, 256, (n * width // block, nbytes), dtype=np.uint8)
    _set_scale(blocks, qtype, np.ones(len(blocks), np.float16))
    rms = np.sqrt(np.mean(np.square(dequantize(blocks, qtype, (len(blocks), block))), axis=1))
    _set_scale(blocks, qtype, (std / np.maximum(rms, 1e-30)).astype(np.float16))
    return blocks.reshape(n, width // block * nbytes)


def _set_scale(blocks: np.ndarray, qtype: QuantType, d: np.ndarray) -> None:
    """Each block's f16 scale d (in place)."""
    bits = d.astype("<f2").view("<u2")
    if qtype == QuantType.IQ1_M:
        set_iq1_m_d_bits(blocks, bits)
    else:
        blocks[:, :2] = bits[:, None].view(np.uint8)


def _tensor_data(task: tuple) -> np.ndarray:
    """The bytes of one tensor. Each tensor draws from its own generator (seed, index), and the
    pools of tall tensors from one per (seed, width, type, std), so a file is the same whichever
    process writes which tensor."""
    seed, index, name, shape, qtype, hp = task
    rng = np.random.default_rng([seed, index])
    values = _values(name, shape, hp, rng)
    if isinstance(values, np.ndarray):
        return quantize(values.reshape(-1, shape[-1]), qtype)
    n, width = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    if n <= POOL_ROWS:
        return random_rows(values, n, width, qtype, rng)
    key = (seed, width, qtype, values)
    if key not in _pools:
        pool_rng = np.random.default_rng([seed, width, int(qtype), int(values * 1e9)])
        _pools[key] = random_rows(values, POOL_ROWS, width, qtype, pool_rng)
    return _pools[key][rng.integers(0, POOL_ROWS, n)]


def _vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly `size` tokens: all 256 byte tokens, merges trained
    on a fixed pseudo-text, the Qwen special tokens, then pseudo-words up to the size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)  # the vocabulary does not depend on --seed
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["qu", "th", "sh", "ing", "er"]
    words = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words, 12)) + rng.choice([".", ",", "!", "?", " 42", "\n"]) for _ in range(400)]
    corpus.append("The quick brown fox jumps over the lazy dog. 0123456789 Hello, world!\n\t")

    n_regular = size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=n_regular, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)[:n_regular]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]][: n_regular - 256]
    types = [TokenType.NORMAL] * len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += list(SPECIAL_TOKENS.values())
    # The rest, as far as a real vocabulary's size: pseudo-words (with a leading space, "Ġ" in
    # byte-level BPE, or without) that no merge builds but that decode to text, so sampling from
    # a large vocabulary prints words rather than padding markers.
    known = set(tokens)
    for n in range(2, 6):
        for parts in itertools.product(syllables, repeat=n):
            if len(tokens) >= size:
                break
            for word in ("".join(parts), "Ġ" + "".join(parts)):
                if word not in known and len(tokens) < size:
                    tokens.append(word)
                    types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types], merges


def _metadata(w: GGUFWriter, hp: Hparams, name: str) -> None:
    a = hp.arch
    w.add_name(f"zdsl synthetic {name}")
    w.add_quantization_version(2)
    w.add_uint32(f"{a}.block_count", hp.n_layers + hp.nextn_layers)
    if hp.nextn_layers:
        w.add_uint32(f"{a}.nextn_predict_layers", hp.nextn_layers)
    w.add_uint32(f"{a}.context_length", hp.context_length)
    w.add_uint32(f"{a}.embedding_length", hp.hidden)
    w.add_uint32(f"{a}.attention.head_count", hp.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", hp.n_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", hp.head_dim)
    w.add_uint32(f"{a}.attention.value_length", hp.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp.eps)
    w.add_uint32(f"{a}.rope.dimension_count", hp.rope_dims)
    w.add_float32(f"{a}.rope.freq_base", hp.rope_base)
    w.add_array(f"{a}.rope.dimension_sections", list(hp.rope_sections))
    w.add_uint32(f"{a}.full_attention_interval", FULL_ATTENTION_INTERVAL)
    w.add_uint32(f"{a}.ssm.conv_kernel", hp.conv_kernel)
    w.add_uint32(f"{a}.ssm.state_size", hp.ssm_head_dim)
    w.add_uint32(f"{a}.ssm.group_count", hp.ssm_k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", hp.ssm_v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", hp.ssm_value_dim)
    if hp.moe:
        w.add_uint32(f"{a}.expert_count", hp.n_experts)
        w.add_uint32(f"{a}.expert_used_count", hp.n_experts_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", hp.expert_ffn)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", hp.shared_ffn)
    else:
        w.add_uint32(f"{a}.feed_forward_length", hp.ffn)
    tokens, types, merges = _vocab(hp.vocab)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|endoftext|>"))
    w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
    w.add_uint32("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"))
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def plan(hp: Hparams, quant: str = "q4_k_m", tensor_types: dict[str, QuantType] | None = None
         ) -> list[tuple[str, tuple[int, ...], QuantType]]:
    """(name, numpy-order shape, type) of every tensor a synthetic file holds, in file order:
    the mix's type, or that of the first of `tensor_types` (regular expression: type, as
    llama-quantize's --tensor-type) that a matrix's name matches."""
    if quant not in QUANTS:
        raise ModelError(f"unknown --quant '{quant}'; choose one of {', '.join(QUANTS)}")
    out = []
    for name, spec in tensor_specs(hp, head=hp.nextn_layers > 0).items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        qtype = tensor_type(name, spec, quant, layer, hp.n_layers)
        if not spec.vector and not name.endswith("ssm_conv1d.weight"):  # the conv's taps stay F32
            qtype = next((t for pattern, t in (tensor_types or {}).items() if re.search(pattern, name)), qtype)
        block = block_shape(qtype)[0]
        if spec.ne[0] % block:
            raise ModelError(f"{name} would be {qtype.name}, whose rows hold multiples of {block} values, not "
                             f"{spec.ne[0]}; choose widths that fit --quant {quant}")
        out.append((name, tuple(reversed(spec.ne)), qtype))
    return out


def tensor_type_option(text: str) -> tuple[str, QuantType]:
    """`REGEX=TYPE` (--tensor-type) as (pattern, type), checked: a pattern that compiles, a type
    synth writes."""
    pattern, sep, name = text.rpartition("=")
    if not sep or not pattern:
        raise ModelError(f"--tensor-type '{text}': write PATTERN=TYPE, e.g. ffn_up_exps=q5_k")
    try:
        re.compile(pattern)
        qtype = QuantType[name.upper()]
    except (re.error, KeyError):
        raise ModelError(f"--tensor-type '{text}': '{pattern}' must be a regular expression and '{name}' a GGUF "
                         "type such as q4_k or iq3_xxs") from None
    if qtype not in SUPPORTED_QUANT and qtype not in RANDOM_BLOCKS:
        raise ModelError(f"--tensor-type '{text}': zdsl model synth cannot write {qtype.name} weights")
    return pattern, qtype


class PresetModel:
    """A preset as the decode graph sees a model file (hyperparameters, tensors' shapes, types and
    places), with no file behind it: enough to record its step on a DryDevice."""

    path = None

    def path_of(self, name: str) -> None:
        return None

    def __init__(self, name: str, quant: str = "q4_k_m"):
        self.hparams = preset(name)
        self.source = f"preset {name} ({quant.upper()} types)"
        self.tensors, offset = {}, 0
        for tensor, shape, qtype in plan(self.hparams, quant):
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(qtype, shape[-1])
            self.tensors[tensor] = TensorInfo(tensor, qtype, shape, offset, nbytes)
            offset += nbytes

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]


def write(path: str | os.PathLike, preset_name: str = "tiny", *, layers: int | None = None,
          vocab: int | None = None, shared_ffn: int | None = None, hidden: int | None = None, quant: str = "q4_k_m",
          tensor_types: dict[str, QuantType] | None = None, seed: int = 0, mtp: bool = False,
          mtp_file: str | os.PathLike | None = None, progress: Callable[[int, int], None] | None = None) -> Hparams:
    """Write a synthetic model (`tensor_types`: plan's overrides); with `mtp`, its MTP head in the
    file, the block after the trunk's, as converters graft it in; with `mtp_file`, the head in a
    file of its own there instead (llama.cpp's mtp-*.gguf: the same metadata, the embedding, the
    output norm and head, and the head's block), the same tensors either way. `progress(done_bytes,
    total_bytes)` is called after each tensor."""
    base = preset(preset_name, layers, vocab, shared_ffn, hidden)
    hp = replace(base, nextn_layers=int(mtp or mtp_file is not None))
    tensors = list(enumerate(plan(hp, quant, tensor_types)))  # a tensor's data is drawn by its index here
    if mtp_file is None:
        _write_file(Path(path), hp, preset_name, tensors, seed, progress)
        return hp
    head = f"blk.{hp.n_layers}."
    shared = ("token_embd.weight", "output_norm.weight", "output.weight")
    _write_file(Path(path), base, preset_name, [t for t in tensors if not t[1][0].startswith(head)], seed, progress)
    _write_file(Path(mtp_file), hp, preset_name, [t for t in tensors if t[1][0].startswith(head) or t[1][0] in shared],
                seed, progress)
    return hp


def _write_file(path: Path, hp: Hparams, preset_name: str, tensors: list, seed: int, progress) -> None:
    """A GGUF file of `hp`'s metadata and `tensors`, (index, (name, shape, type)) each."""
    w = GGUFWriter(path, hp.arch)
    pool = None
    try:
        _metadata(w, hp, preset_name)
        sizes = []
        for _, (name, shape, qtype) in tensors:
            rb = row_bytes(qtype, shape[-1])
            sizes.append(int(np.prod(shape[:-1], dtype=np.int64)) * rb)
            w.add_tensor_info(name, (*shape[:-1], rb), np.dtype(np.uint8), sizes[-1], raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total, done = sum(sizes), 0
        tasks = [(seed, i, name, shape, qtype, hp) for i, (name, shape, qtype) in tensors]
        if total >= PARALLEL_BYTES and (os.cpu_count() or 1) > 1:
            pool = multiprocessing.get_context("fork").Pool(os.cpu_count())
            datas = pool.imap(_tensor_data, tasks)
        else:
            datas = map(_tensor_data, tasks)
        for data, size in zip(datas, sizes):
            w.write_tensor_data(data)
            done += size
            if progress:
                progress(done, total)
    except OSError as e:
        path.unlink(missing_ok=True)  # no truncated file left behind
        raise ModelError(f"cannot write {path}: {e.strerror}; check the directory and free space") from None
    finally:
        if pool is not None:
            pool.terminate()
        w.close()
