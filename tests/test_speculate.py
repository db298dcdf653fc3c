"""Speculative decoding (model/speculate.py, model/drafts.py) against plain decoding.

The drafters against plain scans of the history. On lavapipe, tiny MoE and dense models: a
generation whose drafts are checked in steps of several tokens and cut back gives plain
decoding's tokens, token for token: greedy, and sampled with the same seed (the sampler draws
each position with that position's counter, so the rule that keeps a draft equal to the draw is
exact); drafts of a chosen acceptance (every cut position is met); a stop token inside a step;
and a chat that goes on from what the cut left.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.cli import main
from zdsl.errors import ZdslError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.drafts import NGRAM_LONGEST, NGRAM_SHORTEST, ChosenDrafts, NgramDrafts
from zdsl.models.qwen35.model.generate import Generator
from zdsl.models.qwen35.model.sampler import SamplerConfig
from zdsl.models.qwen35.model.speculate import Speculation, speculation

from budget import examples

CTX = 160


def lookup(history: list[int], k: int) -> list[int]:
    """Prompt lookup by scanning: the latest earlier occurrence of the longest suffix, and what
    follows it, continued past the end as the copy goes on copying."""
    for n in range(min(NGRAM_LONGEST, len(history)), NGRAM_SHORTEST - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                out = list(history)
                for j in range(k):
                    out.append(out[start + n + j])
                return out[len(history):]
    return []


@settings(max_examples=examples(60))
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6),
       split=st.integers(0, 40))
def test_ngram_drafts_are_the_latest_match_of_the_longest_suffix(tokens, k, split):
    drafts = NgramDrafts()
    drafts.draft(tokens[:max(split, 1)], k)  # indexed part-way first: the index grows with the history
    assert drafts.draft(tokens, k) == lookup(tokens, k)


def test_chosen_drafts_are_the_reference_each_right_with_probability_accept():
    ref = list(range(100, 400))
    assert ChosenDrafts(ref, 5, 1.0, 1024).draft([0] * 7, 4) == ref[2:6]
    wrong = ChosenDrafts(ref, 5, 0.0, 1024).draft([0] * 5, 300)
    assert all(w != r and 0 <= w < 1024 for w, r in zip(wrong, ref))
    right = np.mean([d == r for d, r in zip(ChosenDrafts(ref, 0, 0.7, 1024, seed=1).draft([], 300), ref)])
    assert 0.6 < right < 0.8


def test_speculation_options_say_what_is_wrong():
    greedy = SamplerConfig(temperature=0)
    assert speculation("auto", None, greedy).resolved(has_mtp=False) is None and speculation("none", 4, greedy) is None
    assert speculation("auto", 2, greedy).resolved(has_mtp=True).mtp
    assert speculation("auto", None, SamplerConfig(repeat_penalty=1.1)) is None
    assert speculation("ngram", None, greedy).draft_max == 3
    with pytest.raises(ZdslError, match="--draft-max must be from 1 to 15"):
        speculation("ngram", 0, greedy)
    with pytest.raises(ZdslError, match="choose one of"):
        speculation("eagle", 2, greedy)
    with pytest.raises(ZdslError, match="without repetition penalties"):
        speculation("ngram", 2, SamplerConfig(repeat_penalty=1.1))


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"], ids=["moe", "dense"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "model.gguf"
    synth.write(path, request.param, seed=3)
    return open_model(path)


def echoing_prompt(gen, seed: int) -> list[int]:
    """A prompt P, what the model says after it, and P again: prompt lookup drafts that it says the
    same again (which a random model may or may not)."""
    prompt = np.random.default_rng(seed).integers(0, gen.model.hparams.vocab, 12).tolist()
    return prompt + list(gen.generate(prompt, 12, stop=False)) + prompt


def generators(model, device, sampler, spec: Speculation | None, keep: bool = False):
    """A plain generator and one that speculates (steps of up to 5 tokens) on its weights."""
    plain = Generator(model, device, n_ctx=CTX, sampler=sampler, progress=False, keep=keep)
    fast = Generator(model, device, n_ctx=CTX, sampler=sampler, progress=False, keep=keep, weights_of=plain,
                     speculate=spec, step_tokens=5)
    return plain, fast


@pytest.mark.parametrize("sampler", [SamplerConfig(temperature=0), SamplerConfig(temperature=1.5, top_k=0, seed=7)],
                         ids=["greedy", "sampled"])
def test_ngram_speculation_gives_plain_decodings_tokens(model, device, sampler):
    plain, fast = generators(model, device, sampler, speculation("ngram", 3, sampler))
    try:
        for seed in (1, 2):
            prompt = echoing_prompt(plain, seed)
            want = list(plain.generate(prompt, 40, stop=False))
            got = list(fast.generate(prompt, 40, stop=False))
            assert got == want
            s = fast.timings.spec
            assert s.accepted + s.steps + s.plain == 40 - 1  # every step gave its accepted drafts and one more
    finally:
        fast.close(), plain.close()


def test_chosen_drafts_cut_anywhere_and_give_plain_decodings_tokens(model, device):
    """Drafts right with probability 1/2: steps are cut back to every position they hold."""
    greedy = SamplerConfig(temperature=0)
    prompt = np.random.default_rng(4).integers(0, model.hparams.vocab, 11).tolist()
    plain = Generator(model, device, n_ctx=CTX, sampler=greedy, progress=False)
    want = list(plain.generate(prompt, 48, stop=False))
    kept = []

    def drafter(p, head):
        """The chosen drafts, noting how many of each are right (where the step is cut)."""
        chosen = ChosenDrafts(want, len(p), 0.5, model.hparams.vocab, seed=1)
        draft = chosen.draft

        def watched(history, k):
            out = draft(history, k)
            at = len(history) - len(prompt)
            if out:  # (asked for none where the generation has room for one more token only)
                kept.append(next((j for j, d in enumerate(out) if d != want[at + j]), len(out)))
            return out
        chosen.draft = watched
        return chosen

    fast = Generator(model, device, n_ctx=CTX, sampler=greedy, progress=False, weights_of=plain,
                     speculate=Speculation(drafter, 4))
    try:
        assert list(fast.generate(prompt, 48, stop=False)) == want
        assert set(kept) == {0, 1, 2, 3, 4}
        s = fast.timings.spec
        assert (s.steps, s.accepted) == (len(kept), sum(kept))
    finally:
        fast.close(), plain.close()


def test_a_chat_goes_on_from_where_a_stop_token_cut_the_step(model, device):
    """A stop token the model says inside a step of right drafts: the reply ends there, nothing
    past it is fed, and the next turn (fed only its new tokens) goes on as plain decoding does."""
    greedy = SamplerConfig(temperature=0)
    prompt = np.random.default_rng(5).integers(0, model.hparams.vocab, 10).tolist()
    plain, fast = generators(model, device, greedy, None, keep=True)
    try:
        free = list(plain.generate(prompt, 20, stop=False))
        first = next(i for i in range(8, 10) if free[i] not in free[:i])  # inside the second step: 6 … 10
        for g in (plain, fast):
            g.stop_ids = frozenset([free[first]])
            g.forget()
        fast.speculate = Speculation(lambda p, head: ChosenDrafts(free, len(p), 1.0, model.hparams.vocab), 4)
        want1 = list(plain.generate(prompt, 20))
        assert list(fast.generate(prompt, 20)) == want1 == free[:first + 1]
        assert fast.timings.spec.steps == 2 and fast.timings.spec.plain == 0
        assert fast.context == plain.context == prompt + free[:first]
        assert fast.graph.position == len(fast.context)
        turn2 = prompt + free[:first + 1] + prompt[:5]
        fast.speculate = speculation("ngram", 4, greedy)
        assert list(fast.generate(turn2, 20, stop=False)) == list(plain.generate(turn2, 20, stop=False))
        assert fast.timings.reused_tokens == len(prompt) + first
    finally:
        fast.close(), plain.close()


@pytest.mark.slow
def test_a_long_generation_with_drafts_is_plain_decoding(model, device):
    """The issue's check: a 300-token prompt, 200 generated tokens, greedy, with n-gram drafts
    (which a random model rarely says) and with drafts right 70% of the time."""
    greedy = SamplerConfig(temperature=0)
    prompt = (np.random.default_rng(9).integers(0, model.hparams.vocab, 60).tolist() * 5)[:300]
    plain = Generator(model, device, n_ctx=512, sampler=greedy, progress=False)
    fast = Generator(model, device, n_ctx=512, sampler=greedy, progress=False, weights_of=plain,
                     speculate=speculation("ngram", 4, greedy))
    try:
        want = list(plain.generate(prompt, 200, stop=False))
        assert list(fast.generate(prompt, 200, stop=False)) == want
        assert fast.timings.spec.drafted > 0
        fast.speculate = Speculation(lambda p, head: ChosenDrafts(want, len(p), 0.7, model.hparams.vocab), 4)
        assert list(fast.generate(prompt, 200, stop=False)) == want
        assert fast.timings.spec.tokens_per_step > 2
    finally:
        fast.close(), plain.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.write(path, "tiny", seed=3)
    return path


@pytest.mark.device
def test_run_with_ngram_drafts_prints_plain_decodings_tokens(tiny, capsys):
    args = ["run", str(tiny), "--device", "lavapipe", "--ctx", "96", "-n", "24", "--temp", "0", "--ignore-eos",
            "--json", "-p", "the cat sat on the mat; the cat sat on the mat; the cat"]
    outputs = []
    for spec in (["--spec", "none"], ["--spec", "ngram", "--draft-max", "4"]):
        assert main(args + spec) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    plain, fast = outputs
    assert fast["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 24
    assert "speculation" not in plain["timings"]
    s = fast["timings"]["speculation"]
    assert s["accepted"] + s["steps"] + s["plain_steps"] == 23


@pytest.mark.device
def test_bench_of_chosen_acceptance(tiny, tmp_path):
    assert main(["bench", str(tiny), "--device", "lavapipe", "--contexts", "0", "--tokens", "16", "--prompt", "8",
                 "--repeats", "1", "--copy-mb", "4", "--spec", "ngram", "--accept", "1,0", "--draft-max", "1..2",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["command"].endswith("--spec ngram --draft-max 1,2 --accept 1,0")
    s = r["speculation"]
    assert [(row["accept"], row["draft_max"]) for row in s["rows"]] == [(1.0, 1), (1.0, 2), (0.0, 1), (0.0, 2)]
    assert all(row["same_as_plain"] for row in s["rows"])
    # every draft right: steps of k + 1 tokens (16 = the prompt's token and 15 in steps; the last steps shorter)
    assert [row["acceptance"] for row in s["rows"]] == [1.0, 1.0, 0.0, 0.0]
    assert s["rows"][1]["tokens_per_step"] == pytest.approx(15 / 5) and s["rows"][2]["tokens_per_step"] == 1.0
    for row in s["rows"]:
        assert row["vs_plain"] == pytest.approx(row["tok_per_s"]["median"] / s["plain_tok_per_s"]["median"])
    assert "| 1 | 2 | 100% | 3.00 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--accept", "0.5"], "give it with --spec mtp or --spec ngram"),
    (["--spec", "ngram", "--accept", "1.5"], "acceptances from 0 to 1"),
    (["--spec", "ngram", "--draft-max", "0..2"], "draft counts from 1 to 15"),
    (["--spec", "ngram", "--draft-max", "x"], "draft counts from 1 to 15"),
])
def test_bench_speculation_options_say_what_is_wrong(tiny, capsys, args, message):
    assert main(["bench", str(tiny), "--device", "lavapipe", *args]) != 0
    assert message in capsys.readouterr().err


def top_k_probabilities(logits, k: int) -> dict[int, float]:
    """The sampler's distribution at temperature 1 with top_k = k (no min_p, no top_p)."""
    top = np.argsort(-logits, kind="stable")[:k]
    p = np.exp(logits[top] - logits[top].max())
    return dict(zip(top.tolist(), (p / p.sum()).tolist()))


def chi_square(samples: list[int], probabilities: dict[int, float]) -> float:
    n = len(samples)
    assert set(samples) <= set(probabilities)
    return sum((samples.count(t) - n * p) ** 2 / (n * p) for t, p in probabilities.items())


@pytest.mark.slow
def test_sampled_tokens_of_verification_steps_have_the_models_distribution(device, tmp_path):
    """Over many seeds, the token a verification step samples after the drafted-for token, and the
    one after an accepted draft, follow the model's distribution (the numpy reference's logits,
    top-4 at temperature 1): chi-square with 3 degrees of freedom under 16.27 (p = 0.001). Each
    generation after the first resumes from the prompt's checkpoint (its last token fed again), as a
    chat's next turn would: the same tokens as feeding the whole prompt each time, in a quarter of
    the time."""
    from zdsl.models.qwen35.model.reference import ReferenceModel

    path = tmp_path / "tiny.gguf"
    synth.write(path, "tiny-dense", seed=4)
    model = open_model(path)
    ref = ReferenceModel(model, int8_activations=True)
    prompt = np.random.default_rng(2).integers(0, model.hparams.vocab, 10).tolist()
    state = ref.new_state()
    first = int(np.argmax(ref.forward(prompt, state)[-1]))
    p1 = top_k_probabilities(ref.forward([first], state)[0], 4)
    draft = max(p1, key=p1.get)
    p2 = top_k_probabilities(ref.forward([draft], state)[0], 4)
    reference = [first, draft, 0]
    drafts = Speculation(lambda p, head: ChosenDrafts(reference, len(p), 1.0, 1024), 2)
    gen = Generator(model, device, n_ctx=32, sampler=SamplerConfig(temperature=1.0, top_k=4, top_p=1, min_p=0),
                    progress=False, speculate=drafts, keep=True, checkpoints=8 << 20)
    after_first, after_draft = [], []
    try:
        for seed in range(240):
            gen.use(SamplerConfig(temperature=1.0, top_k=4, top_p=1, min_p=0, seed=seed))
            out = list(gen.generate(prompt, 3, stop=False))
            if out[0] == first:
                after_first.append(out[1])
                if out[1] == draft:
                    after_draft.append(out[2])
    finally:
        gen.close()
    assert len(after_first) >= 60 and len(after_draft) >= 30
    assert chi_square(after_first, p1) < 16.27
    assert chi_square(after_draft, p2) < 16.27
