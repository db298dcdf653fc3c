"""What a model's decode step dispatches: every (kernel, shape) the decode graph asks `choose()`
for, with the sizes the dispatch sees and how often it runs per token.

This mirrors `models/qwen35/graph.py` call for call, so the keys the tuner stores are the keys the
graph looks up: `Use.key` is the graph's `{**shape, **fixed}`. Shapes come from a GGUF file or,
without one, from a preset's hyperparameters and the tensor types a Q4_K_M quantizer would pick.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.errors import ZdslError
from zdsl.kernels import attention, deltanet, dmmv, dmmv_q8, moe, q8_1, sampling
from zdsl.kernels.quant import FORMATS, INT8_FORMATS
from zdsl.lang.kernel import KernelDef

# as in the decode graph
from zdsl.models.qwen35.graph import ATTN_MAX_SPLITS, ATTN_MIN_CHUNK


@dataclass
class Use:
    kernel: KernelDef
    shape: dict            # the shape the graph passes to choose()
    fixed: dict            # the parameters it fixes
    sizes: dict            # what else the dispatch sees (experts, slots, heads, context, ...)
    role: str              # the first tensor or step that dispatches it
    pins: dict = field(default_factory=dict)  # parameters the graph leaves at their default
    count: int = 1         # dispatches per token

    @property
    def key(self) -> dict:
        return {**self.shape, **self.fixed}

    @property
    def ident(self) -> tuple:
        return (self.kernel.name, tuple(sorted((k, repr(v)) for k, v in self.key.items())))

    @property
    def label(self) -> str:
        """The key, short: weight types bare, the rest as name=value."""
        return " ".join(v if isinstance(v, str) else f"{k}={v}" for k, v in self.key.items() if v != "")


class Tensors:
    """Hyperparameters, tensor shapes (numpy order) and types of a model file or a preset, by
    the names the decode graph reads them under (models/qwen35/weights.py: fused tensors split,
    shared experts stacked)."""

    def __init__(self, weights, source: str):
        self.hparams, self.weights, self.source = weights.hp, weights, source

    @classmethod
    def from_file(cls, path) -> "Tensors":
        from zdsl.models.qwen35.gguf_file import open_model
        from zdsl.models.qwen35.weights import graph_weights

        return cls(graph_weights(open_model(path)), str(path))

    @classmethod
    def from_preset(cls, name: str) -> "Tensors":
        from zdsl.models.qwen35.synth import plan, preset
        from zdsl.models.qwen35.weights import GraphWeights

        hp = preset(name)
        return cls(GraphWeights(hp, {n: (s, q) for n, s, q in plan(hp)}), f"preset {name} (Q4_K_M types)")

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    @property
    def output_name(self) -> str:
        return self.weights.output_name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(name)

    def qtype(self, name: str) -> str:
        q = self.weights.qtype(name).name.lower()
        if q not in FORMATS:
            raise ZdslError(f"tensor {name} is {q.upper()}, which has no GPU kernel yet")
        return q


def decode_uses(model: Tensors, n_ctx: int = 4096, caps: tuple[int, ...] = (1,)) -> list[Use]:
    """Every kernel dispatch of one decode step at context n_ctx, merged by (kernel, key): the
    first use's sizes stand for all, `count` adds up. The sampler appears once per candidate cap
    in `caps` (1 for greedy decoding, the sampler's cap otherwise): a step records one of them."""
    hp = model.hparams
    uses: list[Use] = []

    def add(kernel, shape, fixed, sizes, role, pins=None):
        uses.append(Use(kernel, shape, fixed, sizes, role, pins or {}))

    def int8(tensor):
        return model.qtype(tensor) in INT8_FORMATS

    def norm(role):
        add(q8_1.norm_q8_1, {"n": hp.hidden}, {}, dict(eps=hp.eps), role)

    def project(tensor):
        """graph._project: a projection of the normed input."""
        m, k = model.shape(tensor)[-2:]
        q = model.qtype(tensor)
        kernel = dmmv_q8.dmmv_q8 if int8(tensor) else dmmv.dmmv
        add(kernel, {"QTYPE": q, "k": k, "m": m}, {"QTYPE": q}, {}, tensor, {"COLS": 1})

    def project_two(tensor, tensor2):
        """graph._project_two: two projections of the normed input, one dispatch where both are int8."""
        if not (int8(tensor) and int8(tensor2)):
            project(tensor)
            project(tensor2)
            return
        (m, k), (m2, _) = model.shape(tensor)[-2:], model.shape(tensor2)[-2:]
        q, q2 = model.qtype(tensor), model.qtype(tensor2)
        add(dmmv_q8.dmmv_q8_pair, {"QTYPE": q, "QTYPE2": q2, "k": k, "m": m, "m2": m2}, {"QTYPE": q, "QTYPE2": q2}, {},
            tensor)

    def residual(tensor, q8_input=True, normed=True):
        """graph._residual: x += W · input, then x normed for the next projections (unless the
        next consumer, the MoE router, norms it itself)."""
        m, k = model.shape(tensor)[-2:]
        q = model.qtype(tensor)
        kernel = dmmv_q8.dmmv_q8 if int8(tensor) and q8_input else dmmv.dmmv
        add(kernel, {"QTYPE": q, "k": k, "m": m}, {"QTYPE": q, "ADD": True}, {}, tensor, {"COLS": 1})
        if normed:
            norm(tensor + "+norm")

    nh, nkv, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
    splits = attention.split_count(n_ctx, ATTN_MIN_CHUNK, ATTN_MAX_SPLITS)
    attn = dict(n_head=nh, n_kv=nkv, ctx=n_ctx, nsplit=splits, min_chunk=ATTN_MIN_CHUNK)
    norm("blk.0.attn_norm")
    for i in range(hp.n_layers):
        p = f"blk.{i}."
        if hp.attention[i]:
            for name in ("attn_q", "attn_k", "attn_v"):
                project(p + name + ".weight")
            add(attention.attn_prep, {"d": d}, {},
                dict(attn, d=d, rope_dims=hp.rope_dims, rope_base=hp.rope_base, eps=hp.eps), p + "attn_prep")
            add(attention.attn_decode, {"D": d, "G": nh // nkv}, {"D": d, "G": nh // nkv}, attn, p + "attn_decode")
            add(attention.attn_combine, {"D": d}, {"D": d, "Q8": int8(p + "attn_output.weight")}, attn,
                p + "attn_combine")
            residual(p + "attn_output.weight", normed=not hp.moe)
        else:
            project_two(p + "attn_qkv.weight", p + "attn_gate.weight")
            q = model.qtype(p + "ssm_beta_alpha.weight")
            add(deltanet.deltanet_step, {"D": hp.ssm_head_dim, "QTYPE": q},
                {"D": hp.ssm_head_dim, "KC": hp.conv_kernel, "Q8": int8(p + "ssm_out.weight"), "QTYPE": q},
                dict(k_heads=hp.ssm_k_heads, v_heads=hp.ssm_v_heads, hidden=hp.hidden, eps=hp.eps),
                p + "ssm_conv+step")
            residual(p + "ssm_out.weight", normed=not hp.moe)
        if hp.moe:
            _moe(model, p, add, norm)
        else:
            gate_up(add, model, p + "ffn_gate.weight", 1, False)
            residual(p + "ffn_down.weight", q8_input=False)
    project(model.output_name)
    for cap in caps:
        add(sampling.sample_candidates, {"n_vocab": hp.vocab}, {"CAP": cap}, {}, "sample")
    return merge(uses)


def gate_up(add, model: Tensors, gate: str, slots: int, experts: bool) -> None:
    """graph._gate_up: SwiGLU gate·up of the normed input, per slot (MoE: the shared expert last,
    appended to the experts' stacks)."""
    m, k = model.shape(gate)[-2:]
    q = model.qtype(gate)
    kernel = dmmv_q8.ffn_gate_up_q8 if q in INT8_FORMATS else dmmv.ffn_gate_up
    n_exp = model.shape(gate)[0] if experts else 1
    add(kernel, {"QTYPE": q, "k": k, "m": m, "slots": slots},
        {"QTYPE": q, "EXPERTS": experts},
        dict(experts=n_exp, slots=slots), gate.removesuffix(".weight") + "+up")


def _moe(model: Tensors, p: str, add, norm) -> None:
    hp = model.hparams
    K, E = hp.n_experts_used, hp.n_experts
    router = p + "ffn_gate_inp.weight"
    qr, kr = model.qtype(router), model.shape(router)[-1]
    add(moe.moe_router, {"QTYPE": qr, "k": kr, "n_expert": E}, {"QTYPE": qr, "K": K}, dict(eps=hp.eps),
        p + "ffn_gate_inp+moe_route")
    gate_up(add, model, p + "ffn_gate_exps.weight", K + 1, True)
    down, down_sh = p + "ffn_down_exps.weight", p + "ffn_down_shexp.weight"
    md, kd = model.shape(down)[-2:]
    qd = model.qtype(down)
    qs = model.qtype(down_sh) if down_sh in model else ""  # "": the stack's last expert
    fd, fs = FORMATS[qd], FORMATS[qs or qd]
    if (fd.block, fd.parts) != (fs.block, fs.parts):
        for tensor, q_, slots, experts in ((down, qd, K, E), (down_sh, qs, 1, 1)):
            add(dmmv.moe_down, {"QTYPE": q_, "k": kd, "m": md}, {"QTYPE": q_, "ADD": True},
                dict(experts=experts, slots=slots), tensor)
    else:
        add(dmmv.moe_down_all, {"QTYPE": qd, "QTYPE_SH": qs, "k": kd, "m": md, "K": K},
            {"QTYPE": qd, "QTYPE_SH": qs, "K": K}, dict(experts=model.shape(down)[0]), p + "ffn_down_exps+shexp")
    norm(p + "ffn_down+norm")


def merge(uses: list[Use]) -> list[Use]:
    out: dict[tuple, Use] = {}
    for u in uses:
        if u.ident in out:
            out[u.ident].count += 1
        else:
            out[u.ident] = u
    return list(out.values())
