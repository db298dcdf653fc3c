"""The MTP head on the GPU: drafts of the next tokens from the trunk's last hidden state.

The head (gguf_file.head_specs) is one more gated-attention block after the trunk's, with its own
KV rows, recorded through the layer schedule like any other (RowBlocks over a step's rows,
token_rows.py's activations). Its row at position q reads the token x_q and h_{q-1}, the trunk's
hidden state at q - 1 after the output norm (what the head reads), and says x_{q+1}.

Drafting, as llama.cpp chains one head: after a verification step fed positions p0 … p0 + T - 1
and kept the first j + 1 of them, the head catches up on those rows (its KV rows at p0 … p0 + j,
from the trunk's h of the step's rows and the h carried from the step before); then it drafts
from the token the model said at p0 + j + 1 and the trunk's h of the last kept row, each draft's
own normed output being the next draft's h. Drafts are argmax: a function of the history, which
keeps verification exact (speculate.py). Catch-up and chain run in one submission. A prompt's
chunk is caught up after it ran (`prompt`), on the chunk's kernels (prefill.py), from the h of
its rows (the output norm of its last residual rows), and a prompt's last token that a decode
step fed after it (`decoded`); the h before position 0 is zero.
"""

from __future__ import annotations

import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels import embedding, sampling, steps as step_kernels
from zdsl.kernels.attention import cache_rows
from zdsl.kernels.kvcache import KV_FORMATS
from zdsl.kernels.steps import STEP_STRIDE, STEP_WORDS
from zdsl.models.qwen35.file.gguf_file import mtp_name
from zdsl.models.qwen35.model.buffers import BufferSpec, f32, scratch
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.model.schedule import RowBlocks

PROMPT_LENGTHS = 4  # recorded prompt catch-ups kept of lengths other than the full chunk
MTP = "mtp."  # the head's buffers' names start so (a sequence's own, never borrowed: graph.borrows)


def head_buffers(hp, n_ctx: int, most: int, chunk: int, kv) -> list[BufferSpec]:
    """The head's buffers beside a graph's (whose step and prompt rows it shares): its KV rows, the
    h rows it reads (a carried one and a step's, or a prompt chunk's), its step values (the
    catch-up's rows, then the chain's one) and its drafts by position."""
    L, H = hp.n_layers, hp.hidden
    rows = cache_rows(n_ctx) * hp.n_kv_heads
    k_fmt, v_fmt = (KV_FORMATS[name] for name in kv)
    return [BufferSpec(f"k_cache.{L}", rows * k_fmt.row_bytes(hp.head_dim), "KV cache"),
            BufferSpec(f"v_cache.{L}", rows * v_fmt.row_bytes(hp.head_dim), "KV cache"),
            f32(MTP + "h", (most + 1) * H), f32(MTP + "chain_h", H), f32(MTP + "prompt_h", (chunk + 1) * H),
            scratch(MTP + "steps", STEP_STRIDE * (most + 1)),
            scratch(MTP + "tokens", 4 * n_ctx), scratch(MTP + "settings", 4 * len(SamplerConfig().settings()))]


class MtpHead:
    """The MTP head of DecodeGraph `g`, made with mtp=True (the head's buffers, head_buffers) and
    step_tokens > 1 (the head runs on its step rows)."""

    def __init__(self, g):
        if not g.model.has_mtp:
            raise ZdslError(f"{g.model.path.name} has no MTP head; use --spec ngram, or a file with its head")
        if g.token_rows is None or not g.with_mtp:
            raise ZdslError("the MTP head runs on a graph made for it: mtp=True and step_tokens > 1")
        hp = g.hp
        self.g, self.hp, self.L = g, hp, hp.n_layers
        self.a, self.most = g.token_rows.rows, g.token_rows.most
        specs = head_buffers(hp, g.n_ctx, self.most, g.chunk, g.kv_types)
        self.buffers = b = {s.name: g.by_name[s.name] for s in specs}
        g.kv[self.L] = (b[f"k_cache.{self.L}"], b[f"v_cache.{self.L}"])  # the schedule's attention finds them there
        self.h, self.chain_h, self.prompt_h = b[MTP + "h"], b[MTP + "chain_h"], b[MTP + "prompt_h"]
        self.steps, self.tokens = b[MTP + "steps"], b[MTP + "tokens"]
        self.chain_step = self.steps.slice(STEP_STRIDE * self.most, 4 * STEP_WORDS)
        self.host = g.device.host_buffer(STEP_STRIDE * (self.most + 1), name="mtp.steps_host")
        self.host_words = self.host.view(np.uint32).reshape(self.most + 1, STEP_STRIDE // 4)
        greedy = SamplerConfig(temperature=0)  # drafts are argmax, whatever the trunk samples with
        b[MTP + "settings"].write((greedy.as_sampling(g.sampler.kernel_cap) if g.sampler.kernel_cap > 1
                                   else greedy).settings())
        self._seqs: dict[tuple, object] = {}
        self._prompt_seqs: dict[int, object] = {}  # by chunk length, the last few
        self.clear()

    def clear(self) -> None:
        """Zero the head's KV rows (DecodeGraph.reset zeroes them too, among the graph's)."""
        seq = self.g.device.sequence()
        for buf in self.g.kv[self.L]:
            seq.fill(buf)
        seq.run()
        seq.free()

    # -- recording --------------------------------------------------------------------------
    def forward(self, seq, t: int, h, ids) -> None:
        """The head over t rows of the step rows' activations: row r's step values (token,
        position) at STEP_STRIDE · r in `ids`, its h in row r of `h`; leaves each row's normed
        output (its h for a chained draft, what the output head reads) in the rows' `normed`."""
        g, a, hp, L = self.g, self.a, self.hp, self.L
        p = f"blk.{L}."
        emb = "token_embd.weight"
        step_values = [ids.slice(STEP_STRIDE * r, 4 * STEP_WORDS) for r in range(t)]
        embedding.embed.launch(seq, g.pick, QTYPE=g.qname(emb), table=g.weights[emb], ids=ids, out=a.x,
                               k=hp.hidden, index=2, stride=STEP_STRIDE // 4, rows=t)
        eh = mtp_name(hp, "eh_proj")
        g.norm(seq, mtp_name(hp, "enorm"), a, t)
        g.project(seq, eh + ".e", a.x, a.normed, t)
        g.norm(seq, mtp_name(hp, "hnorm"), a, t, x=h)
        g.project(seq, eh + ".h", a.x, a.normed, t, add=True)
        g.norm(seq, p + "attn_norm.weight", a, t)
        blocks = RowBlocks(g, seq, [(g, view) for view in step_values], a)
        blocks.attention(seq, L, t)
        (blocks.moe if hp.moe else blocks.ffn)(seq, L, t)  # ending with the head's norm (schedule.next_norm)

    def record(self, caught: int, drafts: int):
        """One submission: the head over `caught` rows of the last step (their tokens and positions
        from the host, their h: the carried one, then the step's rows'), then `drafts` chained
        drafts from the chain's step values (host) and the trunk's h of the last caught row (or
        the carried h, with none caught)."""
        g, a, H = self.g, self.a, self.hp.hidden
        seq = g.device.sequence()
        seq.copy(self.host, self.steps)
        row = 4 * H
        if caught:
            seq.copy(a.normed.f32, self.h, row * caught, dst_offset=row)  # h_{p0} …: rows 1 … caught
            self.forward(seq, caught, self.h, self.steps)
            last = self.h.slice(row * caught, row)
            seq.copy(last, self.h, row)  # carried to the next catch-up
        seq.copy(self.h, self.chain_h, row)
        for _ in range(drafts):
            self.forward(seq, 1, self.chain_h, self.chain_step)
            g.project(seq, g.tensors.output_name, a.logits, a.normed, 1)
            for launch in self.draw():
                launch(seq)
            seq.copy(a.normed.f32, self.chain_h, row)
            step_kernels.advance.launch(seq, g.pick, step=self.chain_step)
        return seq

    def record_prompt(self, t: int):
        """The head over a prompt chunk of t rows just run (prefill.py's rows: their tokens, step
        values and last residuals), after the carried h; carries its last row's h on."""
        g, pf, H = self.g, self.g.prompt, self.hp.hidden
        row, eh, L = 4 * H, mtp_name(self.hp, "eh_proj"), self.L
        seq = g.device.sequence()
        pf.norm(seq, "output_norm.weight", t)  # the trunk's h of the chunk's rows
        seq.copy(pf.normed.f32, self.prompt_h, row * t, dst_offset=row)
        seq.copy(self.h, self.prompt_h, row)
        seq.copy(self.prompt_h.slice(row * t, row), self.h, row)
        emb = "token_embd.weight"
        embedding.embed.launch(seq, g.pick, QTYPE=g.qname(emb), table=g.weights[emb], ids=pf.tokens, out=pf.x,
                               k=H, index=0, rows=t)
        pf.norm(seq, mtp_name(self.hp, "enorm"), t)
        pf.project(seq, eh + ".e", pf.x, t)
        pf.norm(seq, mtp_name(self.hp, "hnorm"), t, x=self.prompt_h)
        pf.project(seq, eh + ".h", pf.x, t, add=True)
        pf.norm(seq, f"blk.{L}.attn_norm.weight", t)
        pf.attention(seq, L, t)
        (pf.moe if self.hp.moe else pf.ffn)(seq, L, t)
        return seq

    def prompt(self, t: int, p0: int) -> None:
        """Catch up on the prompt chunk of t tokens at p0 that just ran (from a zero h at 0)."""
        if p0 == 0:
            self.h.write(np.zeros(self.hp.hidden, np.float32))
        seq = self._prompt_seqs.pop(t, None)
        self._prompt_seqs[t] = seq = seq if seq is not None else self.record_prompt(t)
        seq.run()
        for old in [k for k in self._prompt_seqs if k != self.g.chunk][:-PROMPT_LENGTHS]:
            self._prompt_seqs.pop(old).free()

    def record_decoded(self):
        """The head's row of a token a decode step just fed (its step values from the host, the
        carried h), then the step's h (the graph's own rows') carried on."""
        g = self.g
        seq = g.device.sequence()
        seq.copy(self.host, self.steps)
        self.forward(seq, 1, self.h, self.steps)
        seq.copy(g.normed.f32, self.h, 4 * self.hp.hidden)
        return seq

    def decoded(self, token: int, position: int) -> None:
        """Catch up on `token`, which a decode step fed at `position` (a prompt's last, with
        checkpoints: Generator._prefill)."""
        w = self.host_words
        w[:] = 0
        w[0, :3] = position, position + 1, token
        if "decoded" not in self._seqs:
            self._seqs["decoded"] = self.record_decoded()
        self._seqs["decoded"].run()

    def draw(self) -> list:
        """Row 0's argmax into the chain's step values (its next token) and the drafts by position."""
        g, a = self.g, self.a
        cap, vocab, settings = g.sampler.kernel_cap, self.hp.vocab, self.buffers[MTP + "settings"]
        return [lambda seq: sampling.sample_candidates.launch(seq, g.pick, CAP=cap, logits=a.logits, bias=g.logit_bias,
                                                              counts=g.counts, allowed=g.allowed, cand=a.cands[0],
                                                              settings=settings, n_vocab=vocab, row=0),
                lambda seq: sampling.sample_draw.launch(seq, g.pick, CAP=cap, WG=g.sample_pass.params["WG"],
                                                        R=g.sample_pass.params["R"], cand=a.cands[0],
                                                        step=self.chain_step, tokens=self.tokens, settings=settings,
                                                        n_vocab=vocab, max_tokens=g.n_ctx)]

    # -- running ----------------------------------------------------------------------------
    def draft(self, tokens: list[int], p0: int, start: int, k: int) -> list[int]:
        """Catch up on `tokens` (fed at p0 …, kept) and draft k tokens after `start`, the token
        at position p0 + len(tokens)."""
        c = len(tokens)
        if c > self.most:
            raise ZdslError(f"the MTP head catches up on at most {self.most} rows, not {c}")
        w = self.host_words
        w[:] = 0
        w[:c, 0] = np.arange(p0, p0 + c)
        w[:c, 1] = w[:c, 0] + 1
        w[:c, 2] = tokens
        at = p0 + c
        w[self.most, :3] = at, at + 1, start
        if (c, k) not in self._seqs:
            self._seqs[(c, k)] = self.record(c, k)
        self._seqs[(c, k)].run()
        return self.tokens.read(np.uint32, (k,), offset=4 * at).tolist()

    def close(self) -> None:
        for seq in [*self._seqs.values(), *self._prompt_seqs.values()]:
            seq.free()
        self._seqs.clear()
        self._prompt_seqs.clear()
        self.g.kv.pop(self.L, None)
        self.host.free()  # the buffers are the graph's


class MtpDrafts:
    """The head's drafts for one generation (speculate.Verifier's drafter): each call catches the
    head up on what the last step kept, then chains k drafts."""

    def __init__(self, head: MtpHead):
        """After the prompt ran, caught up (Generator: MtpHead.prompt after each chunk)."""
        self.head, self.p0 = head, None

    def draft(self, history: list[int], k: int) -> list[int]:
        """Up to k drafts after `history`; with k = 0, only the catch-up (after a generation's last
        step, so that a next turn goes on from it)."""
        g = self.head.g
        at = g.position  # where history[-1] goes in; the last step fed p0 … at - 1 of it
        kept = [] if self.p0 is None else history[self.p0:at]
        self.p0 = at
        if kept and g.last_step is None:  # a decode step fed it (a generation's last token): its h is the graph's
            self.head.decoded(kept[0], at - 1)
            kept = []
        return self.head.draft(kept, at - len(kept), history[-1], k) if kept or k else []
