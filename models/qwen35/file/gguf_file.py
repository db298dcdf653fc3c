"""Qwen3.5 / Qwen3.6 GGUF files (`qwen35moe`, dense `qwen35`), memory-mapped and checked.

`open_model(path)` reads the metadata into a frozen `Hparams`, then checks every tensor the
model needs (name, shape, type) against what the metadata implies, so that a bad file fails
here with one line instead of deep inside a kernel. Tensor bytes stay in the page cache:
`raw()` is a view of the mapping, nothing is copied until `dequant()` is asked for.
`GGUFFile` is the unchecked part (metadata and tensor table of any GGUF file), for describing
files zdsl cannot run.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from zdsl.errors import ModelError
from zdsl.kernels.quant_numpy import SUPPORTED_DEQUANT, dequantize, row_bytes

QuantType = GGMLQuantizationType
ARCHITECTURES = ("qwen35moe", "qwen35")

# Types a weight matrix may have: those the numpy reference can dequantize.
WEIGHT_TYPES = SUPPORTED_DEQUANT
# Norms, conv taps, ssm_a/ssm_dt are elementwise operands: converters keep them in float.
VECTOR_TYPES = frozenset({QuantType.F32, QuantType.F16, QuantType.BF16})


@dataclass(frozen=True)
class Hparams:
    """Every number the forward pass needs, read from the file's metadata."""

    arch: str
    n_layers: int                 # trunk layers (block_count minus MTP blocks)
    nextn_layers: int             # MTP blocks stored after the trunk
    hidden: int
    vocab: int
    context_length: int
    eps: float
    attention: tuple[bool, ...]   # per trunk layer: full attention (True) or delta-net
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dims: int
    rope_base: float
    rope_sections: tuple[int, ...]
    ssm_k_heads: int
    ssm_v_heads: int
    ssm_head_dim: int
    conv_kernel: int
    n_experts: int = 0            # 0 for the dense qwen35
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    ffn: int = 0                  # dense SwiGLU width (qwen35 only)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, a in enumerate(self.attention) if a]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, a in enumerate(self.attention) if not a]

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_k_heads * self.ssm_head_dim

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_v_heads * self.ssm_head_dim

    @property
    def conv_channels(self) -> int:
        """Width of the delta-net qkv projection and of its conv state."""
        return 2 * self.ssm_key_dim + self.ssm_value_dim


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: QuantType
    shape: tuple[int, ...]        # numpy order: outermost first, contiguous (input) dim last
    offset: int                   # absolute byte offset in the file
    nbytes: int

    @property
    def ne(self) -> tuple[int, ...]:
        """GGUF order: contiguous dim first."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class TensorSpec:
    ne: tuple[int, ...]           # GGUF order, as llama.cpp and the model doc write it
    vector: bool = False          # elementwise operand: must be a float type


def tensor_specs(hp: Hparams, present: set[str] | frozenset[str] = frozenset(), head: bool | None = None
                 ) -> dict[str, TensorSpec]:
    """The tensors a trunk needs, in file order, and its MTP head's where it has one (`head`; None:
    where `present` holds the head's eh_proj). `present` picks the fused variants a file uses."""
    H, V = hp.hidden, hp.vocab
    specs = {"token_embd.weight": TensorSpec((H, V))}
    for i in range(hp.n_layers):
        specs |= block_specs(hp, i, hp.attention[i], present)
    specs["output_norm.weight"] = TensorSpec((H,), True)
    if "output.weight" in present or not present:
        specs["output.weight"] = TensorSpec((H, V))
    if head is None:
        head = mtp_name(hp, "eh_proj") in present
    if head:
        specs |= head_specs(hp, present)
    return specs


def mtp_name(hp: Hparams, tensor: str) -> str:
    """The name of the MTP head's `nextn` tensor (eh_proj, enorm, hnorm, shared_head_norm): in the
    block after the trunk's."""
    return f"blk.{hp.n_layers}.nextn.{tensor}.weight"


def head_specs(hp: Hparams, present: set[str] | frozenset[str] = frozenset()) -> dict[str, TensorSpec]:
    """The MTP head (multi-token prediction, `nextn_predict_layers` = 1): one more gated-attention
    block after the trunk, with the trunk's FFN kind, whose input is the next token's embedding and
    the trunk's last hidden state, each normed (enorm, hnorm), concatenated (embedding first) and
    projected by eh_proj; its own output norm (shared_head_norm) before the trunk's head."""
    if hp.nextn_layers != 1:
        raise ModelError(f"this file has {hp.nextn_layers} MTP blocks; zdsl runs files with one")
    H = hp.hidden
    nextn = {mtp_name(hp, "eh_proj"): TensorSpec((2 * H, H)), mtp_name(hp, "enorm"): TensorSpec((H,), True),
             mtp_name(hp, "hnorm"): TensorSpec((H,), True), mtp_name(hp, "shared_head_norm"): TensorSpec((H,), True)}
    return block_specs(hp, hp.n_layers, True, present) | nextn


def block_specs(hp: Hparams, i: int, attention: bool, present: set[str] | frozenset[str]) -> dict[str, TensorSpec]:
    """Block i's tensors: its norms, its mixer's (gated attention or the delta-net) and its FFN's."""
    H, p = hp.hidden, f"blk.{i}."
    s = {"attn_norm.weight": TensorSpec((H,), True)}
    if attention:
        q, kv = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
        if p + "attn_qkv.weight" in present:
            s["attn_qkv.weight"] = TensorSpec((H, 2 * q + 2 * kv))
        else:
            s |= {"attn_q.weight": TensorSpec((H, 2 * q)), "attn_k.weight": TensorSpec((H, kv)),
                  "attn_v.weight": TensorSpec((H, kv))}
        s |= {"attn_q_norm.weight": TensorSpec((hp.head_dim,), True),
              "attn_k_norm.weight": TensorSpec((hp.head_dim,), True),
              "attn_output.weight": TensorSpec((q, H))}
    else:
        vd, nv = hp.ssm_value_dim, hp.ssm_v_heads
        s |= {"attn_qkv.weight": TensorSpec((H, hp.conv_channels)),
              "attn_gate.weight": TensorSpec((H, vd)),
              "ssm_conv1d.weight": TensorSpec((hp.conv_kernel, hp.conv_channels), True),
              "ssm_dt.bias": TensorSpec((nv,), True),
              "ssm_a": TensorSpec((nv,), True),
              "ssm_beta.weight": TensorSpec((H, nv)),
              "ssm_alpha.weight": TensorSpec((H, nv)),
              "ssm_norm.weight": TensorSpec((hp.ssm_head_dim,), True),
              "ssm_out.weight": TensorSpec((vd, H))}
    s["post_attention_norm.weight"] = TensorSpec((H,), True)
    if hp.moe:
        E, F, S = hp.n_experts, hp.expert_ffn, hp.shared_ffn
        s["ffn_gate_inp.weight"] = TensorSpec((H, E))
        if p + "ffn_gate_up_exps.weight" in present:
            s["ffn_gate_up_exps.weight"] = TensorSpec((H, 2 * F, E))
        else:
            s |= {"ffn_gate_exps.weight": TensorSpec((H, F, E)), "ffn_up_exps.weight": TensorSpec((H, F, E))}
        s |= {"ffn_down_exps.weight": TensorSpec((F, H, E)),
              "ffn_gate_inp_shexp.weight": TensorSpec((H,), True),
              "ffn_gate_shexp.weight": TensorSpec((H, S)),
              "ffn_up_shexp.weight": TensorSpec((H, S)),
              "ffn_down_shexp.weight": TensorSpec((S, H))}
    else:
        s |= {"ffn_gate.weight": TensorSpec((H, hp.ffn)), "ffn_up.weight": TensorSpec((H, hp.ffn)),
              "ffn_down.weight": TensorSpec((hp.ffn, H))}
    return {p + k: v for k, v in s.items()}


class _Reader(GGUFReader):
    """GGUFReader that checks every tensor's extent against the file size before viewing it
    (the stock reader fails with a numpy reshape error on a truncated file), and reads arrays
    quickly: the stock reader makes numpy views per element, 6 s for a Qwen vocabulary; one
    view per numeric array and memoryview slices per string take a fraction of that."""

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        types = [GGUFValueType.ARRAY, GGUFValueType(int(item_type[0]))]
        scalar = self.gguf_scalar_to_np.get(types[1])
        if scalar is not None:  # one view for the whole array (read it with .contents() only)
            values = self._get(orig_offs + 12, scalar, int(count[0]))
            if len(values) < count[0]:
                raise ValueError("array runs past the end of the file")
            return 12 + int(values.nbytes), [item_type, count, values], [2], types
        if types[1] != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf, length = memoryview(self.data), struct.Struct("<Q").unpack_from
        strings, pos = [], orig_offs + 12
        try:
            for _ in range(int(count[0])):
                (n,) = length(buf, pos)
                strings.append(buf[pos + 8:pos + 8 + n])
                pos += 8 + n
        except struct.error:
            raise ValueError("string array runs past the end of the file") from None
        # parts: type, count, then the strings (the per-string lengths are not kept)
        return pos - orig_offs, [item_type, count, *strings], list(range(2, 2 + len(strings))), types

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                qtype = QuantType(int(raw_type[0]))
            except ValueError:
                raise _Bad(f"tensor {name} has unknown type id {int(raw_type[0])}; "
                           "the file needs a newer reader, use a file with standard GGUF types") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            end = int(start_offs + offset[0]) + int(np.prod(dims, dtype=np.int64)) // block * type_size
            if end > size:
                raise _Bad(f"is truncated: tensor {name} ends at byte {end:,} but the file has {size:,} bytes; "
                           "download or write it again")
        super()._build_tensors(start_offs, fields)


class _Bad(Exception):
    pass


def read_gguf(path: str | os.PathLike) -> GGUFReader:
    """Any GGUF file's header and tensor table (checked against the file size), or ModelError."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file; check the path (or make one with `zdsl model synth`)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model")
    try:
        return _Reader(path)
    except _Bad as e:
        raise ModelError(f"{path} {e}") from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError):
        raise ModelError(f"{path} has a truncated or corrupt GGUF header; download or write it again") from None


def field_contents(path, key: str, field):
    """A metadata field's value. Text that is not UTF-8 (a flipped bit) reads with U+FFFD in its
    place, as llama.cpp, which keeps strings as bytes, reads on; a field the reader cannot decode
    otherwise is a ModelError naming the key, not a traceback."""
    try:
        return field.contents()
    except UnicodeDecodeError:
        if field.types and field.types[-1] == GGUFValueType.STRING:
            texts = [field.parts[i].tobytes().decode("utf-8", "replace") for i in field.data]
            return texts if field.types[0] == GGUFValueType.ARRAY else texts[0]
    except (ValueError, IndexError):
        pass
    raise ModelError(f"{path}: metadata key '{key}' is corrupt; download or write the file again")


class GGUFFile:
    """Any GGUF file the reader can parse: its metadata and tensor table, checked against the
    file size only, so that `zdsl model info` can describe files zdsl cannot run. Keeps the
    mapping alive as long as the object lives."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._reader = read_gguf(self.path)
        self.fields = self._reader.fields
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, QuantType(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())),
                               int(t.data_offset), int(t.n_bytes))
            for t in self._reader.tensors
        }

    # metadata -----------------------------------------------------------------------------
    def get(self, key: str, default=None, *, required: bool = False):
        field = self.fields.get(key)
        if field is None:
            if required:
                raise ModelError(f"{self.path} lacks metadata key '{key}'; the file is incomplete or from "
                                 "an unsupported converter, reconvert it with a current llama.cpp")
            return default
        return field_contents(self.path, key, field)

    # tensors ------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path} lacks tensor {name}; use a complete qwen35/qwen35moe file") from None

    def qtype(self, name: str) -> QuantType:
        return self.info(name).qtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape


class ModelFile(GGUFFile):
    """An open qwen35moe / qwen35 file, checked to hold what the model needs in types zdsl reads."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.hparams = read_hparams(self)
        check_tensors(self, self.hparams)
        check_types(self, self.hparams)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes as a read-only memmap view: shape (*outer dims, bytes per row)."""
        t = self.info(name)
        rb = row_bytes(t.qtype, t.shape[-1])
        return self._reader.data[t.offset:t.offset + t.nbytes].reshape(*t.shape[:-1], rb)

    def path_of(self, name: str) -> Path:
        """The file that holds tensor `name` (this one; WithHead's head is in another)."""
        return self.path

    def dequant(self, name: str, index=None) -> np.ndarray:
        """float32 values in numpy order; `index` selects along the outermost dim first
        (an expert of a 3-D expert tensor, token rows of the embedding) without touching the rest."""
        t = self.info(name)
        raw = self.raw(name)
        if index is not None:
            raw = raw[index]
        return dequantize(raw, t.qtype, (*raw.shape[:-1], t.shape[-1]))

    @property
    def output_name(self) -> str:
        """The head: `output.weight`, or the embedding when the file ties them."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    @property
    def has_mtp(self) -> bool:
        """Whether the file holds its MTP head (a file may count the block and leave it out)."""
        return self.hparams.nextn_layers > 0 and mtp_name(self.hparams, "eh_proj") in self.tensors


class WithHead:
    """A trunk file and its MTP head from a file of its own (llama.cpp's `mtp-*.gguf`, `-md`): the
    trunk's ModelFile with the head's tensors added, each read from the file that holds it."""

    def __init__(self, trunk: ModelFile, head_path: str | os.PathLike):
        self.trunk, self.head = trunk, GGUFFile(head_path)
        hp = read_hparams(self.head)
        t = trunk.hparams
        if (hp.arch, hp.hidden, hp.vocab, hp.n_layers, hp.n_heads, hp.head_dim) != \
                (t.arch, t.hidden, t.vocab, t.n_layers, t.n_heads, t.head_dim) or hp.nextn_layers != 1:
            raise ModelError(f"{self.head.path} is not an MTP head of {trunk.path.name}: its metadata gives another "
                             f"model or no head (a {hp.arch} of {hp.n_layers} + {hp.nextn_layers} blocks, hidden "
                             f"{hp.hidden}, vocab {hp.vocab})")
        self.hparams = dataclasses.replace(t, nextn_layers=1)
        names = head_specs(self.hparams, frozenset(self.head.tensors))
        check_tensors(self.head, self.hparams, names)
        check_types(self.head, self.hparams, names)
        self.tensors = {**trunk.tensors, **{n: self.head.tensors[n] for n in names if n in self.head.tensors}}
        self._files = {n: self.head for n in names}
        self.path = trunk.path

    def __getattr__(self, name: str):
        return getattr(self.trunk, name)  # the metadata (the tokenizer's) and the rest: the trunk's

    def path_of(self, name: str) -> Path:
        return self._files.get(name, self.trunk).path

    def info(self, name: str) -> TensorInfo:
        return self._files[name].info(name) if name in self._files else self.trunk.info(name)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def qtype(self, name: str) -> QuantType:
        return self.info(name).qtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def raw(self, name: str) -> np.ndarray:
        f = self._files.get(name)
        if f is None:
            return self.trunk.raw(name)
        t = f.info(name)
        return f._reader.data[t.offset:t.offset + t.nbytes].reshape(*t.shape[:-1], row_bytes(t.qtype, t.shape[-1]))

    def dequant(self, name: str, index=None) -> np.ndarray:
        t, raw = self.info(name), self.raw(name)
        if index is not None:
            raw = raw[index]
        return dequantize(raw, t.qtype, (*raw.shape[:-1], t.shape[-1]))

    output_name = ModelFile.output_name
    has_mtp = True


def check_tensors(f: GGUFFile, hp: Hparams, specs: dict[str, TensorSpec] | None = None) -> None:
    """ModelError unless every tensor the metadata implies is present with the implied shape."""
    optional = {"output.weight", mtp_name(hp, "shared_head_norm")}  # else token_embd, output_norm
    for name, spec in (specs or tensor_specs(hp, frozenset(f.tensors))).items():
        if name in optional and name not in f.tensors:
            continue
        t = f.info(name)
        if t.ne != spec.ne:
            raise ModelError(f"{f.path}: tensor {name} has shape {list(t.ne)} but the metadata implies "
                             f"{list(spec.ne)}; the file is inconsistent, reconvert it")


def check_types(f: GGUFFile, hp: Hparams, specs: dict[str, TensorSpec] | None = None) -> None:
    """ModelError unless every tensor the model needs (`specs`: these) has a type zdsl reads there."""
    for name, spec in (specs or tensor_specs(hp, frozenset(f.tensors))).items():
        t = f.tensors.get(name)
        allowed = VECTOR_TYPES if spec.vector else WEIGHT_TYPES
        if t is not None and t.qtype not in allowed:
            names = ", ".join(sorted(q.name for q in allowed))
            raise ModelError(f"{f.path}: tensor {name} is {t.qtype.name}, which zdsl cannot run; "
                             f"use a file whose weights are {names}")


def _f32(v) -> float:
    """The shortest decimal that round-trips the stored float32 (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def read_hparams(f: GGUFFile) -> Hparams:
    """The hyperparameters of a qwen35moe / qwen35 file; ModelError for another architecture or
    missing or inconsistent metadata."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"{f.path} is a '{arch}' model; zdsl runs only qwen35moe and qwen35 "
                         "(Qwen3.5/3.6) GGUF files")

    def key(k, default=None):
        return f.get(f"{arch}.{k}", default, required=default is None)

    blocks = int(key("block_count"))
    nextn = int(key("nextn_predict_layers", 0))
    n_layers = blocks - nextn
    recurrent = f.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        attention = tuple(not bool(r) for r in list(recurrent)[:n_layers])
    else:
        interval = int(key("full_attention_interval", 4))
        attention = tuple((i + 1) % interval == 0 for i in range(n_layers))
    tokens = f.get("tokenizer.ggml.tokens", required=True)
    moe = arch == "qwen35moe"
    head_dim = int(key("attention.key_length"))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ModelError(f"{f.path}: attention key and value head sizes differ; not a Qwen3.5 layout")
    ssm_inner = int(key("ssm.inner_size"))
    hp = Hparams(
        arch=arch,
        n_layers=n_layers,
        nextn_layers=nextn,
        hidden=int(key("embedding_length")),
        vocab=len(tokens),
        context_length=int(key("context_length")),
        eps=_f32(key("attention.layer_norm_rms_epsilon")),
        attention=attention,
        n_heads=int(key("attention.head_count")),
        n_kv_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim,
        rope_dims=int(key("rope.dimension_count", head_dim)),
        rope_base=_f32(key("rope.freq_base", 10000.0)),
        rope_sections=tuple(int(s) for s in key("rope.dimension_sections", [])),
        ssm_k_heads=int(key("ssm.group_count")),
        ssm_v_heads=int(key("ssm.time_step_rank")),
        ssm_head_dim=int(key("ssm.state_size")),
        conv_kernel=int(key("ssm.conv_kernel")),
        n_experts=int(key("expert_count")) if moe else 0,
        n_experts_used=int(key("expert_used_count")) if moe else 0,
        expert_ffn=int(key("expert_feed_forward_length")) if moe else 0,
        shared_ffn=int(key("expert_shared_feed_forward_length")) if moe else 0,
        ffn=0 if moe else int(key("feed_forward_length")),
    )
    if hp.ssm_value_dim != ssm_inner or hp.ssm_v_heads % hp.ssm_k_heads or hp.n_heads % hp.n_kv_heads:
        raise ModelError(f"{f.path}: inconsistent head counts in the metadata (ssm.inner_size {ssm_inner}, "
                         f"{hp.ssm_v_heads} value heads of {hp.ssm_head_dim}); reconvert the file")
    return hp


def open_model(path: str | os.PathLike) -> ModelFile:
    """Open and check a qwen35moe / qwen35 GGUF file; raises ModelError with one line if it is bad."""
    return ModelFile(path)
