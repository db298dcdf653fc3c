"""What `zdsl model info` says about a GGUF file, including one zdsl cannot run.

`open_model` refuses a file at its first problem, as running needs; a description goes as far
as the file allows (metadata, hyperparameters, tensor layout, memory plan) and says what stops
zdsl from running it: another architecture, missing tensors, or weight types that have no GPU
kernel yet. Only a file the reader cannot parse (missing, not GGUF, truncated) is an error.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from zdsl.errors import ModelError
from zdsl.kernels.quant import FORMATS

from .gguf_file import GGUFFile, Hparams, check_tensors, check_types, field_contents, mtp_name, read_hparams
from .info import MemoryPlan, plan_tensors

NO_KERNEL = "no GPU kernel yet"
LONG_TEXT = 80  # characters: a longer string value (a chat template) is summarized by its length


@dataclass(frozen=True)
class TypeShare:
    name: str          # GGUF type name, e.g. Q4_K
    tensors: int
    bytes: int
    gpu_kernel: bool


@dataclass(frozen=True)
class Description:
    path: Path
    arch: str
    metadata: dict[str, object]     # every key; arrays and long strings summarized
    types: list[TypeShare]          # the file's type mix, most bytes first
    families: dict[str, dict[str, int]]  # tensor family (name without blk.N.) -> type -> tensors
    no_kernel: list[str]            # tensors whose type has no GPU kernel yet
    hparams: Hparams | None         # when the file is a qwen35moe / qwen35 model with readable metadata
    plan: MemoryPlan | None         # when its tensors are also all there, in their shapes
    problem: str | None             # why zdsl cannot run the file; None when it can

    @property
    def runnable(self) -> bool:
        return self.problem is None and not self.no_kernel

    @property
    def verdict(self) -> str:
        """What zdsl makes of the file, in a few words."""
        if self.problem:
            return f"cannot run it: {self.problem}"
        if self.no_kernel:
            return f"cannot run it on the GPU yet ({self.no_kernel_summary})"
        return "runs it"

    @property
    def no_kernel_summary(self) -> str:
        return f"{NO_KERNEL} for {len(self.no_kernel):,} of {self.tensor_count:,} tensors"

    @property
    def tensor_count(self) -> int:
        return sum(s.tensors for s in self.types)


def family(name: str) -> str:
    """A tensor's family: its name without the layer prefix and the .weight suffix
    (blk.7.ffn_down_exps.weight -> ffn_down_exps), where published files vary the type."""
    return re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")


def has_kernel(type_name: str) -> bool:
    return type_name.lower() in FORMATS


def describe(path: str | os.PathLike) -> Description:
    """The description of any GGUF file the reader can parse; ModelError for one it cannot."""
    f = GGUFFile(path)
    hp = plan = problem = None
    try:
        hp = read_hparams(f)
        if hp.nextn_layers and mtp_name(hp, "eh_proj") in f.tensors and "blk.0.attn_norm.weight" not in f.tensors:
            raise ModelError("it is an MTP head alone: give it with --draft-model beside its trunk's file")
        check_tensors(f, hp)
        plan = plan_tensors(hp, [(t.name, t.qtype, t.shape) for t in f.tensors.values()])
        check_types(f, hp)
    except ModelError as e:
        problem = str(e)
    count, size = Counter(), Counter()
    for t in f.tensors.values():
        count[t.qtype.name] += 1
        size[t.qtype.name] += t.nbytes
    types = [TypeShare(name, count[name], size[name], has_kernel(name)) for name, _ in size.most_common()]
    families: dict[str, Counter] = {}
    for t in f.tensors.values():
        families.setdefault(family(t.name), Counter())[t.qtype.name] += 1
    return Description(
        path=f.path, arch=str(f.get("general.architecture", "unknown")),
        metadata={key: _summary(f.path, key, field) for key, field in f.fields.items() if not key.startswith("GGUF.")},
        types=types, families={k: dict(v.most_common()) for k, v in families.items()},
        no_kernel=[t.name for t in f.tensors.values() if not has_kernel(t.qtype.name)],
        hparams=hp, plan=plan, problem=problem)


def _summary(path, key: str, field):
    """A metadata value as JSON can hold it: scalars as they are, arrays by length and item type."""
    if field.types[0] == GGUFValueType.ARRAY:
        return f"[{int(field.parts[4][0]):,} × {field.types[1].name.lower()}]"   # parts: ..., item type, count
    value = field_contents(path, key, field)
    if isinstance(value, str) and len(value) > LONG_TEXT:
        return f"text of {len(value):,} characters"
    return value
